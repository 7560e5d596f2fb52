//! The state vault's server: per component, records and descriptors that
//! outlive every incarnation of that component. One thread per component
//! socket; requests are applied whole under one lock.

use std::collections::{BTreeMap, HashMap};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, IntoRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use kintsugi_runtime::abi::fdpass;
use kintsugi_runtime::priority::Priority;
use kintsugi_system::{VaultQuota, VaultStorage};

use crate::quota::{is_file, Changes, Entry, FdBudget, Records, Saved, VaultUsage};
use crate::turns::Turns;

mod disk;
pub(crate) use disk::kept_descriptors;
use disk::{Disk, Holds, LoggedOp};

use crate::sockets::Inherited;
#[cfg(test)]
mod ahead_tests;
use kintsugi_runtime::vault::{
    lent_key, listed_bytes, RecordHeader, VaultMessage, VaultOp, VaultReply, VaultRequest,
    LIST_PAGE, MAX_RECORD,
};

/// What a component's vault may hold, and the priority its requests may
/// be served at.
#[derive(Debug, Clone)]
pub(crate) struct Limits {
    pub quota: VaultQuota,
    /// Where what it holds is published.
    pub usage: Arc<VaultUsage>,
    /// The highest priority of the component and of its clients, direct
    /// or not: a request is served at the priority it carries, never above.
    pub ceiling: Priority,
    /// Its id in the system, and the component serving each interface it
    /// uses: whose records lent to it ([`lent_key`]) it may borrow.
    pub id: u32,
    pub servers: HashMap<String, String>,
}

/// What one component's vault thread has taken and finished, for telling
/// a safe point (see `checkpoints.rs`): `taking` is raised before a request
/// leaves the socket, `done` once it is applied and its reply sent, so a
/// request is always either still queued or counted in `taking - done`.
#[derive(Debug, Default)]
pub(crate) struct VaultActivity {
    pub taking: AtomicU64,
    pub done: AtomicU64,
}

/// Every component's kept state.
#[derive(Clone)]
pub struct VaultStore {
    inner: Arc<Mutex<Kept>>,
    budget: Arc<FdBudget>,
}

/// The records of every component, and the directory they are kept in,
/// if any: changed together, under one lock.
#[derive(Default)]
struct Kept {
    records: BTreeMap<String, Records>,
    disk: Option<Disk>,
    /// A dead supervisor's vault sockets (under a keeper), each drained
    /// into the records as its component's vault is served again.
    left: Vec<(String, OwnedFd)>,
    /// Under a keeper: the descriptors stay open when the store goes (see
    /// the `Drop`).
    shared: bool,
}

/// Under a keeper the descriptor table is the keeper's too: a supervisor
/// that fails (its start refused, an error after it) and unwinds must not
/// close what its records hold, or the next one inherits nothing (netd's
/// listener and connections closed). They stay in the table, where the
/// next supervisor takes them back by the log; a clean stop ends the
/// keeper, which closes them.
impl Drop for Kept {
    fn drop(&mut self) {
        if self.shared {
            self.records
                .values_mut()
                .for_each(Records::leave_descriptors_open);
            for (_, fd) in self.left.drain(..) {
                let _open = fd.into_raw_fd();
            }
        }
    }
}

impl Default for VaultStore {
    fn default() -> Self {
        Self {
            inner: Arc::default(),
            budget: Arc::new(FdBudget::from_limit()),
        }
    }
}

impl VaultStore {
    /// The vault kept in `storage`'s directory, with what it holds loaded;
    /// what a load quarantined is logged as an error.
    /// Under a keeper, `inherited` holds the descriptors a dead supervisor
    /// left in the shared table: the records that name one take it.
    pub fn open(
        storage: &VaultStorage,
        known: &dyn Fn(&str) -> bool,
        inherited: Option<&mut Inherited>,
    ) -> Result<Self, String> {
        let shared = inherited.is_some();
        let (disk, loaded) = Disk::open(storage, known, inherited)?;
        for line in &loaded.quarantined {
            tracing::error!("vault: quarantined: {line}");
        }
        if loaded.stale > 0 {
            tracing::info!(
                "vault: {} records of what the last system's clients held (descriptors' creation records, lent pages) dropped",
                loaded.stale
            );
        }
        if loaded.gone > 0 {
            tracing::info!(
                "vault: {} records were being deleted or replaced as the last supervisor died: gone",
                loaded.gone
            );
        }
        for (component, n) in &loaded.orphans {
            tracing::warn!(
                "vault: {n} records of {component}, which the system description does not name, moved to {}",
                storage.dir.join("quarantine").display()
            );
        }
        let store = VaultStore::default();
        let mut kept = store.inner.lock().unwrap();
        for (component, records) in loaded.records {
            let into = kept.records.entry(component).or_default();
            for (key, r) in records {
                let fd = r.file.map(|f| f.1).or(r.kept);
                into.insert_counted(key, r.value, fd, &store.budget);
            }
        }
        kept.disk = Some(disk);
        kept.left = loaded.sockets;
        kept.shared = shared;
        tracing::info!(
            "vault: {} records of {} components loaded from {} ({} frames read)",
            kept.records.values().map(|r| r.map().len()).sum::<usize>(),
            kept.records.len(),
            storage.dir.display(),
            loaded.frames,
        );
        drop(kept);
        Ok(store)
    }

    /// Serves one component's socket for as long as the system runs (the
    /// supervisor holds the other end for every incarnation to come),
    /// counting a turn at least every `turns.timeout()`.
    pub fn serve(
        &self,
        component: String,
        sock: OwnedFd,
        activity: Arc<VaultActivity>,
        limits: Limits,
        turns: Turns,
    ) -> std::thread::JoinHandle<()> {
        self.take_over(&component, &sock, &limits);
        let store = self.clone();
        std::thread::Builder::new()
            .name(format!("vault:{component}"))
            .spawn(move || {
                let mut buf = Vec::new();
                // Standbys' private sockets, on which only reads are served.
                let mut readers: Vec<OwnedFd> = Vec::new();
                loop {
                    let (main, ready) = wait_readable(&sock, &readers, turns.timeout());
                    turns.turned();
                    if main {
                        activity.taking.fetch_add(1, Ordering::SeqCst);
                        let _finished = Finished(&activity.done);
                        match store.serve_one(&component, &limits, &sock, &mut buf, Side::Main) {
                            Step::Closed => return,
                            Step::Reader(fd) if readers.len() < READERS => readers.push(fd),
                            Step::Reader(_) => tracing::warn!(
                                "vault of {component}: a reader refused ({READERS} are open)"
                            ),
                            Step::Served => {}
                        }
                    }
                    // From the last, so that removing one keeps the others' places.
                    for i in ready.into_iter().rev() {
                        let step = store.serve_one(
                            &component,
                            &limits,
                            &readers[i],
                            &mut buf,
                            Side::Reader,
                        );
                        if !matches!(step, Step::Served) {
                            readers.swap_remove(i);
                        }
                    }
                }
            })
            .expect("spawn vault thread")
    }

    /// Under a keeper: logs `sock` as `component`'s vault socket, and
    /// applies what its component sent on the dead supervisor's socket and
    /// nobody read (a connection netd posted as the supervisor died): the
    /// component is dead too, so nobody hears the replies.
    fn take_over(&self, component: &str, sock: &OwnedFd, limits: &Limits) {
        let old = {
            let mut kept = self.inner.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(Err(e)) = kept.disk.as_mut().map(|d| d.log_socket(component, sock)) {
                tracing::error!("vault of {component}: its socket not logged: {e}");
            }
            let at = kept.left.iter().position(|(c, _)| c == component);
            at.map(|i| kept.left.swap_remove(i).1)
        };
        let Some(old) = old else { return };
        if rustix::fs::fcntl_setfl(&old, rustix::fs::OFlags::NONBLOCK).is_err() {
            return;
        }
        let mut buf = Vec::new();
        let mut applied = 0;
        while let Ok((n, fds)) = fdpass::peek_into(&old, &mut buf) {
            if n == 0 {
                break;
            }
            let _ = self.handle(component, limits, &buf[..n], fds, Side::Main);
            applied += 1;
            if fdpass::discard(&old).is_err() {
                break;
            }
        }
        if applied > 0 {
            tracing::warn!(
                "vault of {component}: {applied} requests left unread by the dead supervisor applied"
            );
        }
    }

    /// Takes one message from `sock` and answers it.
    fn serve_one(
        &self,
        component: &str,
        limits: &Limits,
        sock: &OwnedFd,
        buf: &mut Vec<u8>,
        side: Side,
    ) -> Step {
        // Whatever a faulty incarnation sends (an empty record, a
        // message cut short) costs that message only: the vault
        // must outlive every incarnation of its component.
        //
        // The component's requests are peeked, and taken off the queue
        // only once applied and logged (before the reply): a supervisor
        // that dies in between leaves the request to the next, which
        // applies it again (`take_over`; puts and deletes applied twice
        // in the order sent end as applied once). A request read and
        // lost with the supervisor would lose a connection netd posted.
        let main = side == Side::Main;
        let taken = |sock: &OwnedFd| {
            if main {
                if let Err(e) = fdpass::discard(sock) {
                    tracing::warn!("vault socket of {component}: {e}");
                }
            }
        };
        let read = if main {
            fdpass::peek_into(sock, buf)
        } else {
            fdpass::recv_into(sock, buf)
        };
        let (bytes, fds) = match read {
            Ok((n, fds)) => (&buf[..n], fds),
            Err(e) if e.kind() == std::io::ErrorKind::InvalidData => {
                taken(sock);
                // Unread (too large): answered as unreadable.
                let why = format!("malformed request: {e}");
                let reply =
                    serde_json::to_vec(&reply(0, Err(why))).expect("vault reply serializes");
                let _ = fdpass::send(sock, &reply, &[]);
                return Step::Served;
            }
            Err(e) if side == Side::Reader => {
                tracing::debug!("vault reader of {component}: {e}");
                return Step::Closed;
            }
            Err(e) => {
                tracing::warn!("vault socket of {component}: {e}");
                std::thread::sleep(std::time::Duration::from_millis(1));
                return Step::Served;
            }
        };
        if bytes.is_empty() {
            if side == Side::Reader || peer_closed(sock) {
                return Step::Closed;
            }
            taken(sock);
            tracing::warn!("vault socket of {component}: an empty message, ignored");
            return Step::Served;
        }
        let outcome = self.handle(component, limits, bytes, fds, side);
        taken(sock);
        let (reply, out_fds) = match outcome {
            Outcome::Reply(reply, fds) => (reply, fds),
            Outcome::Posted => return Step::Served,
            Outcome::Reader(fd) => return Step::Reader(fd),
        };
        let reply = serde_json::to_vec(&reply).expect("vault reply serializes");
        let borrowed: Vec<BorrowedFd<'_>> = out_fds.iter().map(|f| f.as_fd()).collect();
        // A send can fail only if the component died meanwhile; its
        // successor ignores replies it did not ask for.
        let _ = fdpass::send(sock, &reply, &borrowed);
        Step::Served
    }

    fn handle(
        &self,
        component: &str,
        limits: &Limits,
        bytes: &[u8],
        fds: Vec<OwnedFd>,
        side: Side,
    ) -> Outcome {
        let request = match serde_json::from_slice::<VaultMessage>(bytes) {
            Ok(VaultMessage { priority, request }) => {
                // Served at the priority of the thread it is done for, as
                // far as the system description grants it.
                kintsugi_runtime::priority::adopt(clamp(priority, limits.ceiling));
                request
            }
            Err(e) => {
                let why = format!("malformed request: {e}");
                return Outcome::Reply(reply(0, Err(why)), vec![]);
            }
        };
        if side == Side::Reader && !request.reads_only() {
            let why = "a reader's socket serves reads only".to_string();
            return Outcome::Reply(reply(request.id(), Err(why)), vec![]);
        }
        let mut kept = self.inner.lock().unwrap();
        let kept = &mut *kept;
        let apply = |kept: &mut Kept, ops: Vec<VaultOp>, fds: Vec<OwnedFd>| {
            kept.apply(component, limits, &self.budget, ops, fds)
        };
        let (reply, fds) = match request {
            VaultRequest::Post { ops } => {
                if let Err(e) = apply(kept, ops, fds) {
                    tracing::warn!("vault of {component}: posted request refused: {e}");
                }
                return Outcome::Posted;
            }
            VaultRequest::Reader => {
                let mut fds = fds.into_iter();
                return match (fds.next(), fds.next()) {
                    (Some(sock), None) => Outcome::Reader(sock),
                    _ => {
                        tracing::warn!("vault of {component}: a reader without its one socket");
                        Outcome::Posted
                    }
                };
            }
            VaultRequest::Apply { id, ops } => {
                (reply(id, apply(kept, ops, fds).map(|()| vec![])), vec![])
            }
            VaultRequest::List {
                id,
                after,
                prefix,
                keys_only,
            } => {
                let mut out = Vec::new();
                let listing = match (keys_only, side) {
                    (true, _) => Listing::Keys,
                    (false, Side::Reader) => Listing::Ahead,
                    (false, Side::Main) => Listing::Whole,
                };
                let (records, more) = kept.list(component, after, &prefix, listing, &mut out);
                let mut r = reply(id, Ok(records));
                r.more = more;
                r.seq = kept.records.get(component).map_or(0, Records::seq);
                (r, out)
            }
            VaultRequest::Changes { id, since } => {
                kept.changes(component, id, since, side == Side::Reader)
            }
            VaultRequest::Get { id, key } => kept.one(component, &key, &key, id),
            VaultRequest::Borrow { id, interface, key } => {
                let Some(server) = limits.servers.get(&interface) else {
                    let why = format!("{component} uses no interface {interface:?}");
                    return Outcome::Reply(reply(id, Err(why)), vec![]);
                };
                kept.one(server, &lent_key(limits.id, &key), &key, id)
            }
            VaultRequest::Create { id, key, value } => {
                let made = kept.make_file(component, &key).and_then(|fd| {
                    let back = fd.try_clone().map_err(|e| format!("dup: {e}"))?;
                    let op = VaultOp::Put {
                        key: key.clone(),
                        value: value.clone(),
                        fd: true,
                    };
                    match apply(kept, vec![op], vec![fd]) {
                        Ok(()) => Ok(back),
                        Err(e) => {
                            kept.drop_unheld(&back);
                            Err(e)
                        }
                    }
                });
                match made {
                    Ok(fd) => {
                        let record = RecordHeader {
                            key,
                            value,
                            fd: true,
                        };
                        (reply(id, Ok(vec![record])), vec![fd])
                    }
                    Err(e) => (reply(id, Err(e)), vec![]),
                }
            }
        };
        Outcome::Reply(reply, fds)
    }

    /// Every record of `component`, for an exported checkpoint: a
    /// descriptor travels as its contents if it is a regular file (a memfd
    /// or a file of the vault's); any other kind (a socket) cannot leave
    /// this machine, and fails the export.
    pub(crate) fn export(&self, component: &str) -> Result<Vec<ExportedRecord>, String> {
        let kept = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let Some(records) = kept.records.get(component) else {
            return Ok(Vec::new());
        };
        records
            .map()
            .iter()
            .map(|(key, e)| {
                let contents = e.fd.as_ref().map(|fd| file_contents(key, fd)).transpose()?;
                Ok(ExportedRecord {
                    key: key.clone(),
                    value: e.value.to_string(),
                    contents,
                })
            })
            .collect()
    }

    /// Puts exported records into `component`'s vault (before its first
    /// incarnation reads them); each descriptor becomes a new file.
    pub(crate) fn import(
        &self,
        component: &str,
        records: Vec<ExportedRecord>,
    ) -> Result<(), String> {
        let mut kept = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let mut made = Vec::new();
        for r in records {
            let value: serde_json::Value =
                serde_json::from_str(&r.value).map_err(|e| format!("record {}: {e}", r.key))?;
            let fd = r
                .contents
                .map(|bytes| {
                    let file = std::fs::File::from(kept.make_file(component, &r.key)?);
                    file.write_all_at(&bytes, 0)
                        .map_err(|e| format!("record {}: {e}", r.key))?;
                    Ok::<_, String>(OwnedFd::from(file))
                })
                .transpose()?;
            made.push((r.key, value, fd));
        }
        let keys = made.iter().map(|m| m.0.clone()).collect();
        let budget = &self.budget;
        kept.change(component, keys, |into| {
            for (key, value, fd) in made {
                into.insert_counted(key, value, fd, budget);
            }
            Ok(())
        })
    }

    /// Puts `fd` in `component`'s vault as record `key` (no value), before
    /// its first incarnation: a socket passed by a service manager.
    pub(crate) fn put_socket(&self, component: &str, key: &str, fd: OwnedFd) {
        let mut kept = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let budget = &self.budget;
        let r = kept.change(component, vec![key.to_string()], |into| {
            into.insert_counted(key.to_string(), serde_json::Value::Null, Some(fd), budget);
            Ok(())
        });
        if let Err(e) = r {
            tracing::error!("vault of {component}: socket {key}: {e}");
        }
    }

    /// Number of records kept for `component`.
    #[cfg(test)]
    pub fn len(&self, component: &str) -> usize {
        self.inner
            .lock()
            .unwrap()
            .records
            .get(component)
            .map_or(0, |r| r.map().len())
    }
}

impl Kept {
    /// Applies a request's `ops` (with `fds`) to `component`'s records
    /// within its quota, and publishes what they hold.
    fn apply(
        &mut self,
        component: &str,
        limits: &Limits,
        budget: &FdBudget,
        ops: Vec<VaultOp>,
        fds: Vec<OwnedFd>,
    ) -> Result<(), String> {
        // Only a vault on disk needs the keys (to log their new states).
        let keys = match self.disk {
            Some(_) => keys_of(&ops),
            None => Vec::new(),
        };
        let r = self.change(component, keys, |r| {
            r.apply(ops, fds, &limits.quota, budget)
        });
        limits
            .usage
            .set(self.records.entry(component.to_string()).or_default());
        r
    }

    /// Removes the file behind `fd` (a refused create's) if the vault is
    /// on disk and no record holds it.
    fn drop_unheld(&mut self, fd: &OwnedFd) {
        if let Some(disk) = self.disk.as_mut() {
            disk.drop_unheld(fd);
        }
    }

    /// Makes `change` to `component`'s records, which touches `keys`, and
    /// logs their new states if the vault is on disk (`keys` may be empty
    /// if it is not). If the log refuses,
    /// the records are put back as they were and the change is refused.
    fn change(
        &mut self,
        component: &str,
        keys: Vec<String>,
        change: impl FnOnce(&mut Records) -> Result<(), String>,
    ) -> Result<(), String> {
        let records = self.records.entry(component.to_string()).or_default();
        let Some(disk) = self.disk.as_mut() else {
            return change(records);
        };
        let saved: Vec<Saved> = keys
            .into_iter()
            .map(|key| {
                let before = records.map().get(&key).map(|e| {
                    let fd = e.fd.as_ref().and_then(|f| f.try_clone().ok());
                    (e.value.clone(), fd)
                });
                (key, before)
            })
            .collect();
        change(records)?;
        let changes = saved
            .iter()
            .map(|(key, before)| {
                let held = disk.holds(before.as_ref().and_then(|b| b.1.as_ref()));
                (held, logged(disk, key, records.map().get(key)))
            })
            .collect();
        if let Err(e) = disk.commit(component, changes) {
            records.restore(saved);
            return Err(format!(
                "the vault's disk refused the change ({e}); nothing changed"
            ));
        }
        if disk.wants_compaction() {
            self.compact();
        }
        Ok(())
    }

    /// The reply to request `id` for `component`'s record under `key`,
    /// sent as `shown` (its one record, or none), and its descriptor.
    fn one(&self, component: &str, key: &str, shown: &str, id: u64) -> (VaultReply, Vec<OwnedFd>) {
        let mut out = Vec::new();
        let records = self
            .records
            .get(component)
            .and_then(|r| r.map().get(key))
            .map(|e| header(shown, e, &mut out))
            .into_iter()
            .collect();
        (reply(id, Ok(records)), out)
    }

    /// Rewrites the log with only the live records.
    fn compact(&mut self) {
        let Some(disk) = self.disk.as_mut() else {
            return;
        };
        let snapshot: Vec<(String, Vec<LoggedOp>)> = self
            .records
            .iter()
            .map(|(c, r)| {
                let ops = r
                    .map()
                    .iter()
                    .map(|(key, e)| logged(disk, key, Some(e)))
                    .filter(|op| matches!(op, LoggedOp::Put { .. }))
                    .collect();
                (c.clone(), ops)
            })
            .collect();
        if let Err(e) = disk.rewrite(snapshot.into_iter()) {
            tracing::error!("vault: the log could not be rewritten: {e}");
        }
    }

    /// A new empty file for record `key` of `component`: in the vault's
    /// directory, or a memfd when the vault is in memory only.
    fn make_file(&mut self, component: &str, key: &str) -> Result<OwnedFd, String> {
        match self.disk.as_mut() {
            Some(disk) => disk.create_file(),
            None => sealed_memfd(&format!("kintsugi:{component}:{key}"))
                .map_err(|e| format!("record {key}: memfd_create: {e}")),
        }
    }

    /// Request `id`'s answer: what changed in `component`'s records after
    /// change `since` (see [`Records::changes`]), if it fits in one reply;
    /// else a reply with nothing but `relist`.
    fn changes(
        &self,
        component: &str,
        id: u64,
        since: u64,
        ahead: bool,
    ) -> (VaultReply, Vec<OwnedFd>) {
        let none = Records::default();
        let records = self.records.get(component).unwrap_or(&none);
        let mut r = reply(id, Ok(vec![]));
        r.seq = records.seq();
        let fits = |c: &Changes<'_>| {
            let listed = c.changed.iter().map(|(k, e)| listed_bytes(k, &e.value));
            let deleted = c
                .deleted
                .iter()
                .map(|k| listed_bytes(k, &serde_json::Value::Null));
            c.changed.len() + c.deleted.len() <= LIST_PAGE
                && listed.chain(deleted).sum::<usize>() <= MAX_RECORD
        };
        let Some(changes) = records.changes(since, ahead).filter(fits) else {
            r.relist = true;
            return (r, vec![]);
        };
        let mut fds = Vec::new();
        r.records = changes
            .changed
            .iter()
            .map(|(key, e)| header(key, e, &mut fds))
            .collect();
        r.deleted = changes.deleted.into_iter().cloned().collect();
        (r, fds)
    }

    /// Up to [`LIST_PAGE`] of `component`'s records with keys after the
    /// later of `after` and `prefix` and starting with `prefix`, in order
    /// (their descriptors join `fds`), as many as fit in one reply, and
    /// whether more follow, as `listing` asks.
    fn list(
        &self,
        component: &str,
        after: Option<String>,
        prefix: &str,
        listing: Listing,
        fds: &mut Vec<OwnedFd>,
    ) -> (Vec<RecordHeader>, bool) {
        let Some(records) = self.records.get(component) else {
            return (vec![], false);
        };
        let from = match after {
            Some(k) if k.as_str() >= prefix => std::ops::Bound::Excluded(k),
            _ => std::ops::Bound::Included(prefix.to_string()),
        };
        let mut range = records
            .map()
            .range::<String, _>((from, std::ops::Bound::Unbounded))
            .take_while(|(key, _)| key.starts_with(prefix))
            .filter(|(_, e)| listing != Listing::Ahead || e.readable_ahead());
        // The records of a reply may take `MAX_RECORD` bytes (the rest of
        // a message is the reply's own); the first always fits, the vault
        // taking no larger record.
        let (mut headers, mut used) = (Vec::new(), 0);
        let mut next = range.next();
        const NULL: &serde_json::Value = &serde_json::Value::Null;
        while let Some((key, e)) = next {
            let value = match listing {
                Listing::Keys => NULL,
                Listing::Whole | Listing::Ahead => &e.value,
            };
            let listed = listed_bytes(key, value);
            if headers.len() == LIST_PAGE || (!headers.is_empty() && used + listed > MAX_RECORD) {
                break;
            }
            used += listed;
            headers.push(match listing {
                Listing::Keys => RecordHeader {
                    key: key.clone(),
                    value: serde_json::Value::Null,
                    fd: false,
                },
                Listing::Whole | Listing::Ahead => header(key, e, fds),
            });
            next = range.next();
        }
        (headers, next.is_some())
    }
}

/// Record `key`'s state as logged: what a record holding a descriptor
/// that does not outlive the system is logged as is its absence.
fn logged(disk: &Disk, key: &str, entry: Option<&Entry>) -> LoggedOp {
    let delete = || LoggedOp::Delete {
        key: key.to_string(),
    };
    let Some(e) = entry else {
        return delete();
    };
    let (file, kept) = match disk.holds(e.fd.as_ref()) {
        Holds::Transient => return delete(),
        Holds::Nothing => (None, None),
        Holds::File(id) => (Some(id), None),
        Holds::Kept(k) => (None, Some(k)),
    };
    LoggedOp::Put {
        key: key.to_string(),
        value: e.value.clone(),
        file,
        kept,
    }
}

/// The keys `ops` touch, each once, in order.
fn keys_of(ops: &[VaultOp]) -> Vec<String> {
    let mut keys: Vec<String> = Vec::new();
    for op in ops {
        let (VaultOp::Put { key, .. } | VaultOp::Delete { key }) = op;
        if !keys.contains(key) {
            keys.push(key.clone());
        }
    }
    keys
}

/// A reply to request `id`: records, or why it was refused.
fn reply(id: u64, result: Result<Vec<RecordHeader>, String>) -> VaultReply {
    let (records, error) = match result {
        Ok(r) => (r, None),
        Err(e) => (vec![], Some(e)),
    };
    VaultReply {
        id,
        error,
        records,
        more: false,
        seq: 0,
        deleted: Vec::new(),
        relist: false,
    }
}

/// A vault record as it travels with an exported checkpoint.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub(crate) struct ExportedRecord {
    pub key: String,
    /// The value, as JSON text.
    pub value: String,
    /// The contents of its descriptor (a memfd), if it has one.
    pub contents: Option<Vec<u8>>,
}

/// The whole contents of the file behind record `key`'s descriptor.
fn file_contents(key: &str, fd: &OwnedFd) -> Result<Vec<u8>, String> {
    if !is_file(Some(fd)) {
        let target = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
            .map(|p| p.display().to_string())
            .unwrap_or_default();
        return Err(format!(
            "record {key} holds {target}, which cannot travel with a checkpoint (only files can)"
        ));
    }
    let file = std::fs::File::from(fd.try_clone().map_err(|e| format!("record {key}: {e}"))?);
    let len = file
        .metadata()
        .map_err(|e| format!("record {key}: {e}"))?
        .len();
    let mut bytes = vec![0u8; len as usize];
    file.read_exact_at(&mut bytes, 0)
        .map_err(|e| format!("record {key}: {e}"))?;
    Ok(bytes)
}

/// Counts a taken request finished when dropped, whichever way its
/// handling ends.
struct Finished<'a>(&'a AtomicU64);

impl Drop for Finished<'_> {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// Readers' sockets a component's vault serves at once at most: one per
/// standby, and one more for a standby that replaces it.
const READERS: usize = 2;

/// What a listing gives of each record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Listing {
    /// Key, value and descriptor.
    Whole,
    /// The same, of the records a reader may hold ahead
    /// ([`Entry::readable_ahead`]).
    Ahead,
    /// The key alone.
    Keys,
}

/// Which socket a request came on: the component's own, or a reader's
/// (a standby listing ahead of its activation, through
/// [`VaultRequest::Reader`]), on which only reads are served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Main,
    Reader,
}

/// What became of one message taken from a socket.
enum Step {
    Served,
    /// The socket is closed (a reader's, or an unreadable one).
    Closed,
    /// A new reader's socket, to serve from now on.
    Reader(OwnedFd),
}

/// What a request asks of the serving thread.
enum Outcome {
    Reply(VaultReply, Vec<OwnedFd>),
    /// Nothing to send back.
    Posted,
    Reader(OwnedFd),
}

/// Blocks until the component's socket or a reader's has a message (or
/// is closed), or for `at_most`: whether the component's has, and which
/// readers have.
fn wait_readable(
    sock: &OwnedFd,
    readers: &[OwnedFd],
    at_most: Option<rustix::event::Timespec>,
) -> (bool, Vec<usize>) {
    use rustix::event::{PollFd, PollFlags};
    let mut fds: Vec<PollFd<'_>> = std::iter::once(sock)
        .chain(readers)
        .map(|fd| PollFd::new(fd, PollFlags::IN))
        .collect();
    while let Err(rustix::io::Errno::INTR) = rustix::event::poll(&mut fds, at_most.as_ref()) {}
    let ready = |fd: &PollFd<'_>| !fd.revents().is_empty();
    let readers = (1..fds.len()).filter(|&i| ready(&fds[i])).map(|i| i - 1);
    (ready(&fds[0]), readers.collect())
}

/// The highest priority of component `name` and of every component that
/// calls it, directly or through others: what work done for it may run at.
pub(crate) fn priority_ceiling(system: &kintsugi_system::System, name: &str) -> Priority {
    let mut seen = vec![name];
    let mut i = 0;
    while let Some(&server) = seen.get(i) {
        for c in &system.components {
            if c.uses.iter().any(|u| u.server == server) && !seen.contains(&c.name.as_str()) {
                seen.push(&c.name);
            }
        }
        i += 1;
    }
    let specs = || seen.iter().filter_map(|n| system.component(n));
    Priority {
        nice: specs().map(|c| c.priority).min().unwrap_or(0),
        fifo: specs().filter_map(|c| c.realtime).max(),
    }
}

/// The priority `word` a request carries, lowered to `ceiling` if above
/// it (0, no priority, stays 0).
fn clamp(word: u32, ceiling: Priority) -> u32 {
    let Some(p) = Priority::from_word(word) else {
        return 0;
    };
    Priority {
        nice: p.nice.max(ceiling.nice),
        fifo: p.fifo.zip(ceiling.fifo).map(|(f, c)| f.min(c)),
    }
    .word()
}

/// Whether the component's end of a seqpacket socket is closed (an empty
/// read is either that or an empty message).
fn peer_closed(sock: &OwnedFd) -> bool {
    let mut fds = [rustix::event::PollFd::new(
        sock,
        rustix::event::PollFlags::IN,
    )];
    matches!(rustix::event::poll(&mut fds, Some(&rustix::time::Timespec::default())), Ok(n) if n > 0)
        && fds[0].revents().contains(rustix::event::PollFlags::HUP)
}

/// A record as sent back; a duplicate of its descriptor, if it has one
/// (and it can be duplicated), joins `fds`.
fn header(key: &str, e: &Entry, fds: &mut Vec<OwnedFd>) -> RecordHeader {
    let dup = e.fd.as_ref().and_then(|fd| fd.try_clone().ok());
    let fd = dup.is_some();
    fds.extend(dup);
    RecordHeader {
        key: key.to_string(),
        value: e.value.clone(),
        fd,
    }
}

/// A memfd for a record's file, sealed as far as its use allows: its
/// holder writes, grows and shrinks it (a ramfs file), so those stay open,
/// but it can never be made executable (`MFD_NOEXEC_SEAL`: nothing a
/// component writes into the vault runs through `execveat`), and no seal
/// can be added later (`F_SEAL_SEAL`: a holder cannot freeze another's
/// file against writing). A kernel older than 6.3 gets the second alone.
fn sealed_memfd(name: &str) -> rustix::io::Result<OwnedFd> {
    use rustix::fs::{MemfdFlags, SealFlags};
    let fd = match rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::NOEXEC_SEAL) {
        Err(rustix::io::Errno::INVAL) => {
            rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?
        }
        made => made?,
    };
    rustix::fs::fcntl_add_seals(&fd, SealFlags::SEAL)?;
    Ok(fd)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kintsugi_runtime::vault::Vault;
    use rustix::net::{socketpair, AddressFamily, SocketFlags, SocketType};
    use std::io::{Read, Seek, Write};

    /// A vault client on a socket served by `store` as component `c`.
    fn client(store: &VaultStore) -> Vault {
        Vault::new(served(store).0)
    }

    /// The component's end of a socket served by `store` as component
    /// `c`, and what its thread has taken.
    pub(super) fn served(store: &VaultStore) -> (OwnedFd, Arc<VaultActivity>) {
        let limits = Limits {
            quota: VaultQuota::default(),
            usage: Arc::default(),
            ceiling: Priority::nice(0),
            id: 1,
            servers: HashMap::new(),
        };
        served_as(store, "c", limits)
    }

    /// The same for component `name`, with `limits`.
    fn served_as(store: &VaultStore, name: &str, limits: Limits) -> (OwnedFd, Arc<VaultActivity>) {
        let (a, b) = socketpair(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )
        .unwrap();
        let activity = Arc::new(VaultActivity::default());
        store.serve(name.into(), b, activity.clone(), limits, Turns::unwatched());
        (a, activity)
    }

    /// A store kept in `dir` (fsync `always`) and a client of it.
    fn on_disk(dir: &std::path::Path) -> (VaultStore, Vault) {
        let storage = VaultStorage {
            dir: dir.to_path_buf(),
            fsync: kintsugi_system::FsyncPolicy::Always,
        };
        let store = VaultStore::open(&storage, &|c| c == "c", None).unwrap();
        let vault = client(&store);
        (store, vault)
    }

    fn scratch(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("kintsugi-vault-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    fn quarantined(dir: &std::path::Path) -> usize {
        std::fs::read_dir(dir.join("quarantine")).unwrap().count()
    }

    /// Writes a plain record (then replaced), a file record, one deleted,
    /// and one holding a memfd (not persisted).
    fn populate(vault: &Vault) {
        vault
            .put("plain", serde_json::json!({"n": 1}), None)
            .unwrap();
        let f = vault.create_file("file", serde_json::json!("f")).unwrap();
        std::fs::File::from(f).write_all(b"file contents").unwrap();
        vault.put("gone", serde_json::json!(0), None).unwrap();
        vault.delete("gone").unwrap();
        let m = memfd_with(b"memory only");
        vault
            .put("socketish", serde_json::json!(1), Some(m.as_fd()))
            .unwrap();
        vault
            .put("plain", serde_json::json!({"n": 2}), None)
            .unwrap();
    }

    #[test]
    fn a_store_under_a_keeper_leaves_its_descriptors_open_when_it_goes() {
        for keeper in [false, true] {
            let dir = scratch(&format!("shared-{keeper}"));
            let storage = VaultStorage {
                dir: dir.clone(),
                fsync: kintsugi_system::FsyncPolicy::Never,
            };
            let mut first = Inherited::first();
            let store =
                VaultStore::open(&storage, &|c| c == "c", keeper.then_some(&mut first)).unwrap();
            let vault = client(&store);
            let m = memfd_with(b"held");
            vault
                .put("held", serde_json::json!(1), Some(m.as_fd()))
                .unwrap();
            let held = store.inner.lock().unwrap().records["c"].map()["held"]
                .fd
                .as_ref()
                .map(|fd| fd.as_raw_fd())
                .unwrap();
            drop(vault);
            // Its thread ends with the client's socket, and lets go of it.
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while Arc::strong_count(&store.inner) > 1 {
                assert!(
                    std::time::Instant::now() < deadline,
                    "the vault thread did not end"
                );
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            drop(store);
            // The same file (inode) behind the number still, or not.
            let ino = |fd: i32| {
                use std::os::unix::fs::MetadataExt;
                std::fs::metadata(format!("/proc/self/fd/{fd}")).map(|m| (m.dev(), m.ino()))
            };
            let same = |fd: i32| ino(fd).ok() == ino(m.as_raw_fd()).ok();
            assert_eq!(same(held), keeper, "keeper {keeper}: its descriptor open");
            let _ = std::fs::remove_dir_all(&dir);
        }
    }

    #[test]
    fn records_of_a_component_no_longer_described_go_to_the_quarantine() {
        let dir = scratch("orphan");
        let (store, vault) = on_disk(&dir);
        populate(&vault);
        drop((store, vault));
        let storage = VaultStorage {
            dir: dir.clone(),
            fsync: kintsugi_system::FsyncPolicy::Always,
        };
        let store = VaultStore::open(&storage, &|c| c == "renamed", None).unwrap();
        assert_eq!(store.len("c"), 0, "not loaded");
        let names: Vec<String> = std::fs::read_dir(dir.join("quarantine"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names.len(), 3, "two records and one file: {names:?}");
        let file = names.iter().find(|n| n.contains("c.file-")).expect("file");
        let contents = std::fs::read(dir.join("quarantine").join(file)).unwrap();
        assert_eq!(contents, b"file contents", "kept byte for byte");
        assert_eq!(std::fs::read_dir(dir.join("files")).unwrap().count(), 0);
        drop(store);
        // Nor do they come back when the component is described again.
        let (store, _vault) = on_disk(&dir);
        assert_eq!(store.len("c"), 0);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_vault_on_disk_gives_back_its_records_and_files_after_a_restart() {
        let dir = scratch("restart");
        let (_store, vault) = on_disk(&dir);
        populate(&vault);
        // A second file, then its record deleted: its file goes too.
        let f = vault.create_file("temp", serde_json::json!(null)).unwrap();
        drop(f);
        vault.delete("temp").unwrap();
        let (store, vault) = on_disk(&dir);
        let list = vault.list().unwrap();
        let keys: Vec<&str> = list.iter().map(|r| r.key.as_str()).collect();
        assert_eq!(
            keys,
            ["file", "plain"],
            "the memfd record lived in memory only"
        );
        assert_eq!(list[1].value, serde_json::json!({"n": 2}));
        let mut list = list;
        assert_eq!(read_all(list.remove(0).fd.unwrap()), "file contents");
        assert_eq!(store.len("c"), 2);
        let files = std::fs::read_dir(dir.join("files")).unwrap().count();
        assert_eq!(files, 1, "the deleted record's file was removed");
        assert_eq!(quarantined(&dir), 0);
        // The loaded file counts in the supervisor's descriptor budget, and
        // deleting it gives it back (an uncounted load once made the count
        // wrap below zero, and every later descriptor was refused).
        assert_eq!(store.budget.held.load(Ordering::SeqCst), 1);
        vault.delete("file").unwrap();
        assert_eq!(store.budget.held.load(Ordering::SeqCst), 0);
        vault
            .put(
                "again",
                serde_json::json!(0),
                Some(memfd_with(b"x").as_fd()),
            )
            .unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_records_memfd_is_written_and_grown_but_never_made_executable_or_frozen() {
        use rustix::fs::{fcntl_add_seals, fcntl_get_seals, fstat, Mode, SealFlags};
        let fd = sealed_memfd("t").unwrap();
        let mut file = std::fs::File::from(fd);
        file.write_all(b"contents").unwrap();
        file.set_len(1 << 20).unwrap();
        file.set_len(3).unwrap();
        let seals = fcntl_get_seals(&file).unwrap();
        assert!(seals.contains(SealFlags::SEAL), "{seals:?}");
        assert!(!seals.intersects(SealFlags::WRITE | SealFlags::GROW | SealFlags::SHRINK));
        assert_eq!(
            fcntl_add_seals(&file, SealFlags::WRITE),
            Err(rustix::io::Errno::PERM),
            "no holder can freeze the file"
        );
        assert!(seals.contains(SealFlags::EXEC), "{seals:?}");
        assert_eq!(
            rustix::fs::fchmod(&file, Mode::from_raw_mode(0o755)),
            Err(rustix::io::Errno::PERM)
        );
        assert_eq!(fstat(&file).unwrap().st_mode & 0o111, 0, "not executable");
    }

    #[test]
    fn a_corrupted_frame_is_quarantined_and_the_others_are_served() {
        let dir = scratch("corrupt");
        let (_store, vault) = on_disk(&dir);
        for i in 0..5 {
            vault
                .put(&format!("k{i}"), serde_json::json!(i), None)
                .unwrap();
        }
        let log = dir.join("log");
        let mut bytes = std::fs::read(&log).unwrap();
        // Flip a byte inside the payload of k2's frame.
        let at = bytes.windows(4).position(|w| w == b"\"k2\"").unwrap();
        bytes[at + 1] ^= 0x20;
        std::fs::write(&log, &bytes).unwrap();
        let (_store, vault) = on_disk(&dir);
        let keys: Vec<String> = vault.list().unwrap().into_iter().map(|r| r.key).collect();
        assert_eq!(keys, ["k0", "k1", "k3", "k4"], "k2 is never served");
        assert_eq!(quarantined(&dir), 1);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Cut at every byte of the last frame: the load gives back every
    /// earlier request whole, and the cut one not at all.
    #[test]
    fn a_log_cut_anywhere_loads_every_whole_request_before_the_cut() {
        let dir = scratch("cut");
        let (_store, vault) = on_disk(&dir);
        vault.put("a", serde_json::json!(1), None).unwrap();
        let before = std::fs::metadata(dir.join("log")).unwrap().len() as usize;
        vault
            .apply(
                vec![
                    VaultOp::Put {
                        key: "b".into(),
                        value: serde_json::json!(2),
                        fd: false,
                    },
                    VaultOp::Delete { key: "a".into() },
                ],
                &[],
            )
            .unwrap();
        let whole = std::fs::read(dir.join("log")).unwrap();
        for cut in before..=whole.len() {
            let copy = scratch(&format!("cut{cut}"));
            std::fs::create_dir_all(&copy).unwrap();
            std::fs::set_permissions(&copy, std::os::unix::fs::PermissionsExt::from_mode(0o700))
                .unwrap();
            std::fs::write(copy.join("log"), &whole[..cut]).unwrap();
            let (_s, v) = on_disk(&copy);
            let keys: Vec<String> = v.list().unwrap().into_iter().map(|r| r.key).collect();
            let want = if cut == whole.len() {
                vec!["b"]
            } else {
                vec!["a"]
            };
            assert_eq!(keys, want, "cut at {cut} of {}", whole.len());
            let q = quarantined(&copy);
            assert_eq!(
                q,
                usize::from(cut != before && cut != whole.len()),
                "cut at {cut}"
            );
            let _ = std::fs::remove_dir_all(&copy);
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_record_whose_file_is_gone_is_quarantined_not_served() {
        let dir = scratch("missing");
        let (_store, vault) = on_disk(&dir);
        drop(vault.create_file("lost", serde_json::json!(1)).unwrap());
        drop(vault.create_file("kept", serde_json::json!(2)).unwrap());
        let lost = std::fs::read_dir(dir.join("files"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .min()
            .unwrap();
        std::fs::remove_file(lost).unwrap();
        let (_store, vault) = on_disk(&dir);
        let keys: Vec<String> = vault.list().unwrap().into_iter().map(|r| r.key).collect();
        assert_eq!(keys, ["kept"]);
        assert_eq!(quarantined(&dir), 1);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_change_the_disk_refuses_changes_nothing() {
        let dir = scratch("refused");
        let (store, vault) = on_disk(&dir);
        vault.put("a", serde_json::json!(1), None).unwrap();
        store
            .inner
            .lock()
            .unwrap()
            .disk
            .as_mut()
            .unwrap()
            .break_log();
        let err = vault.put("a", serde_json::json!(2), None).unwrap_err();
        assert!(err.to_string().contains("nothing changed"), "{err}");
        assert!(vault.put("b", serde_json::json!(3), None).is_err());
        assert!(vault.create_file("c", serde_json::json!(4)).is_err());
        let list = vault.list().unwrap();
        assert_eq!(list.len(), 1);
        assert_eq!(
            (list[0].key.as_str(), &list[0].value),
            ("a", &serde_json::json!(1))
        );
        let files = std::fs::read_dir(dir.join("files")).unwrap().count();
        assert_eq!(files, 0, "the refused create's file was removed");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_vault_directory_others_may_enter_is_refused() {
        let dir = scratch("open");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        let storage = VaultStorage {
            dir: dir.clone(),
            fsync: kintsugi_system::FsyncPolicy::Never,
        };
        let err = VaultStore::open(&storage, &|_| true, None)
            .err()
            .expect("refused");
        assert!(err.contains("mode 755"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A keys-only listing gives every key under its prefix, in order,
    /// across pages, and no value or descriptor.
    #[test]
    fn keys_are_listed_alone_across_pages() {
        let store = VaultStore::default();
        let vault = client(&store);
        let f = memfd_with(b"x");
        let mut want = Vec::new();
        for i in 0..(2 * LIST_PAGE + 3) {
            let key = format!("k/{i:04}");
            let fd = (i % 2 == 0).then(|| f.as_fd());
            vault.put(&key, serde_json::json!({"i": i}), fd).unwrap();
            want.push(key);
        }
        vault.put("l/1", serde_json::json!(1), None).unwrap();
        assert_eq!(vault.keys("k/").unwrap(), want);
        assert_eq!(vault.keys("l/").unwrap(), vec!["l/1".to_string()]);
        assert!(vault.keys("m/").unwrap().is_empty());
        // The records themselves are as they were.
        let r = vault.get("k/0000").unwrap().unwrap();
        assert_eq!(read_all(r.fd.unwrap()), "x");
    }

    /// A client (component 7, using `mm` of component "mm") borrows only
    /// the records mm lent to component 7, only through an interface it
    /// uses, and never mm's own.
    #[test]
    fn a_component_borrows_only_what_its_server_lent_it() {
        let store = VaultStore::default();
        let limits = |id, servers: &[(&str, &str)]| Limits {
            quota: VaultQuota::default(),
            usage: Arc::default(),
            ceiling: Priority::nice(0),
            id,
            servers: servers
                .iter()
                .map(|(i, s)| (i.to_string(), s.to_string()))
                .collect(),
        };
        let mm = Vault::new(served_as(&store, "mm", limits(3, &[])).0);
        let c = Vault::new(served_as(&store, "c", limits(7, &[("mm", "mm")])).0);
        let mine = memfd_with(b"lent to 7");
        let theirs = memfd_with(b"lent to 8");
        let json = serde_json::json!({"pages": 1});
        mm.put(&lent_key(7, "page/1"), json.clone(), Some(mine.as_fd()))
            .unwrap();
        mm.put(&lent_key(8, "page/2"), json.clone(), Some(theirs.as_fd()))
            .unwrap();
        mm.put("page/1", json.clone(), Some(theirs.as_fd()))
            .unwrap();

        let r = c.borrow("mm", "page/1").unwrap().expect("lent to 7");
        assert_eq!((r.key.as_str(), &r.value), ("page/1", &json));
        assert_eq!(read_all(r.fd.expect("with its descriptor")), "lent to 7");
        assert!(c.borrow("mm", "page/2").unwrap().is_none(), "lent to 8");
        assert!(
            c.borrow("mm", "lent/8/page/2").unwrap().is_none(),
            "no path out"
        );
        assert!(c.borrow("mm", "../page/1").unwrap().is_none());
        let refused = c.borrow("fs", "page/1").unwrap_err().to_string();
        assert!(refused.contains("uses no interface \"fs\""), "{refused}");
        // mm uses nothing: it borrows nothing, not even its own records.
        assert!(mm.borrow("mm", "page/1").is_err());
        // Borrowing took nothing away from mm.
        assert_eq!(store.len("mm"), 3);
        assert_eq!(store.len("c"), 0);
    }

    fn memfd_with(contents: &[u8]) -> std::fs::File {
        let mut f = std::fs::File::from(
            rustix::fs::memfd_create("t", rustix::fs::MemfdFlags::CLOEXEC).unwrap(),
        );
        f.write_all(contents).unwrap();
        f
    }

    fn read_all(fd: OwnedFd) -> String {
        let mut f = std::fs::File::from(fd);
        f.seek(std::io::SeekFrom::Start(0)).unwrap();
        let mut s = String::new();
        f.read_to_string(&mut s).unwrap();
        s
    }

    /// Records of a kilobyte and more: 128 of them (a page by count) do
    /// not fit in one message, so pages end by size; ramfs with files of
    /// long names could not restart before (its listing was cut at 128 KiB
    /// and failed to parse). A record too large to list alone is refused,
    /// and so is a request too large to send.
    #[test]
    fn large_records_are_listed_in_pages_that_fit_and_a_record_too_large_is_refused() {
        let store = VaultStore::default();
        let vault = client(&store);
        let n = 300;
        let value =
            |i: usize| serde_json::json!({ "name": format!("{i:04}{}", "n".repeat(1000 + i)) });
        for i in 0..n {
            vault.put(&format!("k{i:04}"), value(i), None).unwrap();
        }
        let mut pages = 0;
        let mut listed: Vec<kintsugi_runtime::vault::VaultRecord> = Vec::new();
        loop {
            let after = listed.last().map(|r| r.key.clone());
            let (page, more) = vault.list_page("", after.as_deref()).unwrap();
            assert!(
                !page.is_empty() && page.len() < LIST_PAGE,
                "{} records",
                page.len()
            );
            pages += 1;
            listed.extend(page);
            if !more {
                break;
            }
        }
        assert!(pages >= 3, "{pages} pages");
        assert_eq!(listed.len(), n);
        for (i, r) in listed.iter().enumerate() {
            assert_eq!((&r.key, &r.value), (&format!("k{i:04}"), &value(i)));
        }

        let too_large = serde_json::json!("v".repeat(MAX_RECORD));
        let e = vault.put("big", too_large, None).unwrap_err().to_string();
        assert!(e.contains("larger than one reply"), "{e}");
        let just =
            serde_json::json!("v".repeat(MAX_RECORD - listed_bytes("big", &serde_json::json!(""))));
        assert_eq!(listed_bytes("big", &just), MAX_RECORD);
        vault.put("big", just.clone(), None).unwrap();
        assert_eq!(vault.get("big").unwrap().unwrap().value, just);
        let e = vault
            .put(
                "huge",
                serde_json::json!("v".repeat(fdpass::MAX_MESSAGE)),
                None,
            )
            .unwrap_err()
            .to_string();
        assert!(e.contains("larger than the vault reads"), "{e}");
        assert_eq!(vault.list().unwrap().len(), n + 1, "nothing else changed");
    }

    #[test]
    fn threads_listing_at_once_each_get_every_page_of_their_own() {
        let store = VaultStore::default();
        let vault = Arc::new(client(&store));
        let n = LIST_PAGE * 8 + 50;
        for i in 0..n {
            let f = memfd_with(format!("{i}").as_bytes());
            vault
                .put(&format!("k{i:05}"), serde_json::json!(i), Some(f.as_fd()))
                .unwrap();
        }
        let threads: Vec<_> = (0..3)
            .map(|_| {
                let vault = vault.clone();
                std::thread::spawn(move || {
                    for _ in 0..3 {
                        let list = vault.list().unwrap();
                        assert_eq!(list.len(), n);
                        for (i, r) in list.into_iter().enumerate() {
                            assert_eq!(r.key, format!("k{i:05}"));
                            assert_eq!(r.value, serde_json::json!(i));
                            // Descriptors of one file share its offset
                            // across the threads: read at an offset.
                            let f = std::fs::File::from(r.fd.unwrap());
                            let mut buf = [0u8; 8];
                            let got = std::os::unix::fs::FileExt::read_at(&f, &mut buf, 0);
                            assert_eq!(&buf[..got.unwrap()], format!("{i}").as_bytes());
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
    }

    #[test]
    fn records_and_descriptors_survive_the_client() {
        let store = VaultStore::default();
        let vault = client(&store);
        let f = memfd_with(b"contents");
        vault
            .put("k1", serde_json::json!({"name": "a"}), Some(f.as_fd()))
            .unwrap();
        vault.put("k2", serde_json::json!(2), None).unwrap();
        drop(f);
        vault.delete("k2").unwrap();
        for i in 0..300 {
            vault
                .put(&format!("n{i:03}"), serde_json::json!(i), None)
                .unwrap();
        }
        let list = vault.list().unwrap();
        assert_eq!(list.len(), 301, "pages are joined");
        assert_eq!(list[0].key, "k1");
        assert_eq!(
            read_all(list.into_iter().next().unwrap().fd.unwrap()),
            "contents"
        );
        assert_eq!(store.len("c"), 301);
    }

    #[test]
    fn a_prefix_lists_only_its_records_across_pages() {
        let store = VaultStore::default();
        let vault = client(&store);
        for i in 0..300 {
            vault
                .put(&format!("mail/{i:03}"), serde_json::json!(i), None)
                .unwrap();
        }
        vault.put("fs/desc/1", serde_json::json!(0), None).unwrap();
        vault.put("mailbox", serde_json::json!(0), None).unwrap();
        vault.put("a", serde_json::json!(0), None).unwrap();
        let mail = vault.list_prefix("mail/").unwrap();
        assert_eq!(mail.len(), 300, "pages are joined");
        assert!(mail.iter().all(|r| r.key.starts_with("mail/")));
        assert_eq!(mail[299].key, "mail/299");
        assert!(vault.list_prefix("nothing/").unwrap().is_empty());
        assert_eq!(vault.list().unwrap().len(), 303);
    }

    #[test]
    fn get_finds_present_keys_only() {
        let store = VaultStore::default();
        let vault = client(&store);
        let f = memfd_with(b"kept");
        vault
            .put("with-fd", serde_json::json!({"size": 4}), Some(f.as_fd()))
            .unwrap();
        drop(f);
        vault.put("plain", serde_json::json!([1, 2]), None).unwrap();
        vault.put("gone", serde_json::json!(0), None).unwrap();
        vault.delete("gone").unwrap();

        let r = vault.get("with-fd").unwrap().expect("present");
        assert_eq!(
            (r.key.as_str(), &r.value),
            ("with-fd", &serde_json::json!({"size": 4}))
        );
        assert_eq!(read_all(r.fd.expect("its descriptor rides along")), "kept");

        let r = vault.get("plain").unwrap().expect("present");
        assert_eq!(r.value, serde_json::json!([1, 2]));
        assert!(r.fd.is_none());

        assert!(vault.get("gone").unwrap().is_none(), "deleted");
        assert!(vault.get("never").unwrap().is_none(), "absent");
        assert!(vault.get("plai").unwrap().is_none(), "a prefix is no match");
        // A get changes nothing, and the descriptor is still kept.
        assert_eq!(store.len("c"), 2);
        assert_eq!(
            read_all(vault.get("with-fd").unwrap().unwrap().fd.unwrap()),
            "kept"
        );
    }

    #[test]
    fn a_request_is_served_no_higher_than_the_ceiling() {
        let ceiling = Priority {
            nice: -5,
            fifo: Some(10),
        };
        let word = |nice, fifo| Priority { nice, fifo }.word();
        assert_eq!(clamp(word(-20, Some(99)), ceiling), word(-5, Some(10)));
        assert_eq!(clamp(word(3, Some(4)), ceiling), word(3, Some(4)));
        assert_eq!(clamp(word(0, Some(50)), Priority::nice(0)), word(0, None));
        assert_eq!(clamp(0, ceiling), 0, "no priority carried");
    }

    #[test]
    fn the_ceiling_is_the_highest_priority_of_the_component_and_its_callers() {
        let text = "[system]\nname = \"p\"\n\
            [[component]]\nname = \"leaf\"\nbinary = \"x\"\nprovides = [\"fs\"]\npriority = 5\n\
            [[component]]\nname = \"mid\"\nbinary = \"x\"\nprovides = [\"lock\"]\nuses = [\"fs\"]\nrealtime = 20\n\
            [[component]]\nname = \"top\"\nbinary = \"x\"\nuses = [\"lock\"]\npriority = -3\n\
            [[component]]\nname = \"other\"\nbinary = \"x\"\nrealtime = 99\npriority = -20\n";
        let system = kintsugi_system::parse(std::path::Path::new("p.toml"), text).unwrap();
        let c = |n| priority_ceiling(&system, n);
        assert_eq!(
            c("leaf"),
            Priority {
                nice: -3,
                fifo: Some(20)
            }
        );
        assert_eq!(
            c("mid"),
            Priority {
                nice: -3,
                fifo: Some(20)
            }
        );
        assert_eq!(c("top"), Priority::nice(-3));
        assert_eq!(
            c("other"),
            Priority {
                nice: -20,
                fifo: Some(99)
            }
        );
    }

    /// Creation records read ahead through the real vault: a record a
    /// faulty incarnation wrote malformed fails its own lookup only, not
    /// those of the records read in the same page.
    #[test]
    fn a_malformed_record_fails_only_its_own_lookup() {
        use kintsugi_runtime::records::{GlobalRecords, ReadAhead, RecordStore, VaultRecords};
        let store = VaultStore::default();
        let vault = Arc::new(client(&store));
        let records: Arc<dyn RecordStore> =
            Arc::new(ReadAhead::new(Arc::new(VaultRecords(vault.clone()))));
        let record = |id: u64| {
            // func 0, creator 7, no parent, one argument byte.
            let mut v = vec![0, 0, 0, 0, 7, 0, 0, 0, 0];
            v.extend_from_slice(&0u64.to_le_bytes());
            v.push(id as u8);
            v
        };
        for id in 1..=5u64 {
            records
                .put(&format!("lock/Lock/{id:016x}"), &record(id))
                .unwrap();
        }
        // Odd hex: what a flipped length could leave.
        vault
            .put(
                &format!("desc/lock/Lock/{:016x}", 3),
                serde_json::json!("0100000"),
                None,
            )
            .unwrap();
        let g = GlobalRecords::new(records, "lock");
        for id in [1u64, 2, 4, 5] {
            let r = g.fetch("Lock", id).unwrap().expect("recorded");
            assert_eq!((r.creator, r.args.clone()), (7, vec![id as u8]), "{id}");
        }
        let err = g.fetch("Lock", 3).unwrap_err();
        assert!(err.to_string().contains("malformed"), "{err}");
        assert!(g.fetch("Lock", 6).unwrap().is_none());
    }
}

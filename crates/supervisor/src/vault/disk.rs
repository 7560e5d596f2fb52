//! The vault kept in a directory (`[system] vault = { dir, fsync }`), so
//! that what components keep outlives the supervisor and the machine.
//! NewtOS's storage server kept its state in memory only; its successors
//! (and systemd's fdstore, which keeps descriptors across a manager's
//! re-execution but not across a reboot) leave persistence to each
//! service. Here the vault itself is crash-consistent, so every component
//! that keeps its state there gets it.
//!
//! The directory (mode 0700, owned by the supervisor's user, refused
//! otherwise) holds:
//!
//! | path | contents |
//! | --- | --- |
//! | `log` | `ksgvault1\n`, then one frame per applied request |
//! | `files/<id>` | the contents of a file the vault made ([`VaultRequest::Create`](kintsugi_runtime::vault::VaultRequest)) |
//! | `quarantine/` | what a load refused: a frame's bytes, a record whose file is gone |
//!
//! A frame is `u32` LE payload length, `u32` LE CRC-32 of the payload, and
//! the payload: JSON `{"component", "ops"}` whose ops are the records'
//! new states (`Put { key, value, file }`, `Delete { key }`). A request is
//! one frame, written with one `write` and, under `fsync = "always"`,
//! synced before its reply: a crash leaves it whole or absent. Loading
//! replays the frames; one that fails its checksum is copied to
//! `quarantine/` and skipped up to the next frame that passes (a cut tail,
//! from a crash mid-write, likewise), and a record whose file is missing
//! is quarantined: neither is ever served. The log is then rewritten with
//! only the live records (atomically: a new file synced and renamed), as
//! it is again whenever it grows past four times its rewritten size.
//!
//! Records whose descriptor the vault did not make (a socket, a memfd a
//! component made) live in memory only: they describe what does not
//! survive the system, and their key is logged as deleted. Under a keeper
//! (`[system] keeper`, README "The keeper"), which shares the supervisor's
//! descriptor table and so holds every such descriptor after the
//! supervisor's death, they are logged with the descriptor's number and
//! identity (`kept`: fd, device, inode); the supervisor the keeper starts
//! next finds them in the table it inherits and takes each back only if
//! the number still names the same file.

use std::collections::BTreeSet;
use std::collections::{BTreeMap, HashMap};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::ops::Range;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use kintsugi_system::{FsyncPolicy, VaultStorage};

use crate::sockets::Inherited;

const MAGIC: &[u8; 10] = b"ksgvault1\n";
/// No frame is longer: a length past it is corruption.
const MAX_FRAME: usize = 64 << 20;
/// The log is rewritten when it grows past this many times its size after
/// the last rewrite (and past [`MIN_COMPACT`]).
const GROWTH: u64 = 4;
const MIN_COMPACT: u64 = 1 << 20;

/// A record's state as logged.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) enum LoggedOp {
    Put {
        key: String,
        value: serde_json::Value,
        /// The vault's file it holds, if any.
        file: Option<u64>,
        /// The descriptor it holds in the table the keeper shares, if any.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        kept: Option<KeptFd>,
    },
    Delete {
        key: String,
    },
    /// Under a keeper: the supervisor's end of the component's vault
    /// socket, on which requests the component sent as the supervisor died
    /// may still wait (the next supervisor drains it).
    Socket {
        kept: KeptFd,
    },
}

/// A descriptor a record holds, as the keeper holds it: its number in the
/// shared table and the file it names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct KeptFd {
    fd: RawFd,
    dev: u64,
    ino: u64,
}

impl KeptFd {
    fn of(fd: &OwnedFd) -> Option<Self> {
        let st = rustix::fs::fstat(fd).ok()?;
        Some(Self {
            fd: fd.as_raw_fd(),
            dev: st.st_dev,
            ino: st.st_ino,
        })
    }

    /// Whether `fd` is the file this names.
    fn names(&self, fd: &OwnedFd) -> bool {
        rustix::fs::fstat(fd).is_ok_and(|st| (st.st_dev, st.st_ino) == (self.dev, self.ino))
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct Frame {
    component: String,
    ops: Vec<LoggedOp>,
}

/// What a component's record holds, as far as the disk is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Holds {
    Nothing,
    /// A file the vault made.
    File(u64),
    /// A descriptor that does not outlive the system.
    Transient,
    /// A descriptor the keeper holds.
    Kept(KeptFd),
}

/// A record read back: its value and, for a file record, the file; for a
/// record of a descriptor the keeper held, that descriptor.
pub(crate) struct LoadedRecord {
    pub value: serde_json::Value,
    pub file: Option<(u64, OwnedFd)>,
    pub kept: Option<OwnedFd>,
}

/// A record's state as the log leaves it: value, file, kept descriptor.
type Logged = (serde_json::Value, Option<u64>, Option<KeptFd>);

/// What the log leaves: each component's records, and the vault socket
/// logged last for it.
#[derive(Default)]
struct Folded {
    records: BTreeMap<String, BTreeMap<String, Logged>>,
    sockets: BTreeMap<String, KeptFd>,
}

/// What [`Disk::open`] found.
#[derive(Default)]
pub(crate) struct Loaded {
    /// Component → key → record.
    pub records: BTreeMap<String, BTreeMap<String, LoadedRecord>>,
    /// One line per thing quarantined, saying what and why.
    pub quarantined: Vec<String>,
    /// Components the log names that the system description does not, and
    /// how many records of each were moved to the quarantine.
    pub orphans: Vec<(String, usize)>,
    /// Under a keeper's restart: each component's vault socket of the dead
    /// supervisor, with what its component sent and no one read.
    pub sockets: Vec<(String, OwnedFd)>,
    /// Records whose kept descriptor was not in the inherited table: being
    /// deleted or replaced as the supervisor died.
    pub gone: usize,
    /// Under a keeper's restart: records of what the dead system's clients
    /// held (descriptors' creation records, pages lent), dropped.
    pub stale: usize,
    pub frames: u64,
}

/// The log's open file, and which file it is (device, inode). Its
/// descriptor is one number among every other the supervisor holds (and
/// the keeper's, which shares the table): a fault that closed it (a
/// flipped register in another thread) would let the next descriptor
/// opened, a client's connection received from netd say, take its number,
/// and every later frame would be written into that connection (seen once
/// in a campaign of register flips into the supervisor).
struct Log {
    file: File,
    id: (u64, u64),
}

impl Log {
    fn new(file: File, what: impl std::fmt::Display) -> Result<Self, String> {
        let st = rustix::fs::fstat(&file).map_err(|e| io(what, e.into()))?;
        Ok(Self {
            file,
            id: (st.st_dev, st.st_ino),
        })
    }

    /// The file, if its descriptor names the log still.
    fn checked(&mut self) -> Option<&mut File> {
        let st = rustix::fs::fstat(&self.file);
        (st.map(|s| (s.st_dev, s.st_ino)).ok() == Some(self.id)).then_some(&mut self.file)
    }

    /// The file, checked; one whose descriptor names another file now
    /// aborts the supervisor (under a keeper another starts, and reads the
    /// log from the disk) rather than write the log elsewhere.
    fn or_abort(&mut self) -> &mut File {
        if self.checked().is_none() {
            tracing::error!(
                "vault: the log's descriptor no longer names the log (a fault closed it, and another file took its number); stopping rather than write the log elsewhere"
            );
            std::process::abort();
        }
        &mut self.file
    }
}

/// The open directory.
pub(crate) struct Disk {
    dir: PathBuf,
    log: Log,
    fsync: FsyncPolicy,
    /// The vault's files by (device, inode), and how many records hold each.
    ids: HashMap<(u64, u64), u64>,
    refs: HashMap<u64, u32>,
    next_file: u64,
    log_len: u64,
    compacted_len: u64,
    /// Whether a keeper holds the descriptors of records (their numbers
    /// are logged).
    keeps: bool,
    /// The vault sockets logged (`LoggedOp::Socket`), logged again by
    /// every rewrite.
    sockets: BTreeMap<String, KeptFd>,
}

fn io(what: impl std::fmt::Display, e: std::io::Error) -> String {
    format!("{what}: {e}")
}

impl Disk {
    /// Opens (or creates) the directory, loads what it holds, and rewrites
    /// the log with only the live records: those of the components the
    /// system describes (`known`); the records of others (a component
    /// removed or renamed since) go to the quarantine, files and all, so
    /// that they neither grow the log for ever nor come back unasked.
    ///
    /// Under a keeper (`inherited`), records of kept descriptors take them
    /// from the inherited table; one whose descriptor is not there (or is
    /// another file now) was being deleted or replaced as the supervisor
    /// died, and is gone. A restarted supervisor also drops the records of
    /// what the dead system's clients held ([`held_for_clients`]).
    pub(crate) fn open(
        storage: &VaultStorage,
        known: &dyn Fn(&str) -> bool,
        inherited: Option<&mut Inherited>,
    ) -> Result<(Disk, Loaded), String> {
        let dir = storage.dir.clone();
        for d in [dir.clone(), dir.join("files"), dir.join("quarantine")] {
            private_dir(&d)?;
        }
        let mut loaded = Loaded::default();
        let frames = read_log(&dir, &mut loaded.quarantined)?;
        loaded.frames = frames.len() as u64;
        let Folded {
            records: states,
            sockets,
        } = fold(frames);
        let present = file_ids(&dir)?;
        let mut disk = Disk {
            log: Log::new(
                File::open("/dev/null").map_err(|e| io("/dev/null", e))?,
                "/dev/null",
            )?,
            next_file: present.iter().max().map_or(1, |m| m + 1),
            dir,
            fsync: storage.fsync,
            ids: HashMap::new(),
            refs: HashMap::new(),
            log_len: 0,
            compacted_len: 0,
            keeps: inherited.is_some(),
            sockets: BTreeMap::new(),
        };
        // What the dead supervisor left, if this one was restarted.
        let mut left = inherited.filter(|i| i.restarted());
        let restarted = left.is_some();
        if let Some(i) = left.as_deref_mut() {
            for (component, k) in sockets {
                if let Some(fd) = take_kept(i, k).filter(|_| known(&component)) {
                    loaded.sockets.push((component, fd));
                }
            }
        }
        for (component, kept) in states {
            if !known(&component) {
                if !kept.is_empty() {
                    loaded.orphans.push((component.clone(), kept.len()));
                    disk.quarantine_orphan(&component, kept);
                }
                continue;
            }
            let out = loaded.records.entry(component.clone()).or_default();
            for (key, (value, file, kept)) in kept {
                if restarted && held_for_clients(&key) {
                    loaded.stale += 1;
                    continue;
                }
                let kept = match kept {
                    None => None,
                    Some(k) => {
                        match left.as_deref_mut().map(|i| take_kept(i, k)) {
                            Some(Some(fd)) => Some(fd),
                            // Deleted or replaced as the supervisor died
                            // (a change is applied, then logged).
                            Some(None) => {
                                loaded.gone += 1;
                                continue;
                            }
                            // A descriptor of an earlier system, gone with it.
                            None => continue,
                        }
                    }
                };
                let file = match file.map(|id| disk.open_file(id).map(|fd| (id, fd))) {
                    Some(Err(why)) => {
                        let line = format!("{component}/{key}: {why}");
                        disk.quarantine_record(&component, &key, &value, &why);
                        loaded.quarantined.push(line);
                        continue;
                    }
                    file => file.transpose().expect("an error went on above"),
                };
                out.insert(key, LoadedRecord { value, file, kept });
            }
        }
        // Files no record holds: made, but the crash came before their
        // record was logged.
        for id in present {
            if !disk.refs.contains_key(&id) {
                let _ = std::fs::remove_file(disk.file_path(id));
            }
        }
        let snapshot = loaded.records.iter().map(|(c, kept)| {
            let ops = kept
                .iter()
                .map(|(key, r)| LoggedOp::Put {
                    key: key.clone(),
                    value: r.value.clone(),
                    file: r.file.as_ref().map(|f| f.0),
                    kept: r.kept.as_ref().and_then(KeptFd::of),
                })
                .collect();
            (c.clone(), ops)
        });
        disk.rewrite(snapshot)?;
        Ok((disk, loaded))
    }

    fn file_path(&self, id: u64) -> PathBuf {
        self.dir.join("files").join(id.to_string())
    }

    /// Opens file `id` of a loaded record and counts the record's hold.
    fn open_file(&mut self, id: u64) -> Result<OwnedFd, String> {
        let path = self.file_path(id);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&path)
            .map_err(|e| format!("its file {} cannot be opened: {e}", path.display()))?;
        let meta = file.metadata().map_err(|e| io(path.display(), e))?;
        if !meta.is_file() {
            return Err(format!("{} is not a regular file", path.display()));
        }
        self.ids.insert((meta.dev(), meta.ino()), id);
        *self.refs.entry(id).or_default() += 1;
        Ok(OwnedFd::from(file))
    }

    /// A new empty file, not yet held by any record.
    pub(crate) fn create_file(&mut self) -> Result<OwnedFd, String> {
        let id = self.next_file;
        let path = self.file_path(id);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&path)
            .map_err(|e| io(path.display(), e))?;
        self.next_file += 1;
        let meta = file.metadata().map_err(|e| io(path.display(), e))?;
        self.ids.insert((meta.dev(), meta.ino()), id);
        if self.fsync == FsyncPolicy::Always {
            // Its name on disk before any record naming it.
            sync_dir(&self.dir.join("files"))?;
        }
        Ok(OwnedFd::from(file))
    }

    /// Removes the file behind `fd` if no record holds it: made for a
    /// request that was then refused.
    pub(crate) fn drop_unheld(&mut self, fd: &OwnedFd) {
        if let Holds::File(id) = self.holds(Some(fd)) {
            if !self.refs.contains_key(&id) {
                self.ids.retain(|_, v| *v != id);
                let _ = std::fs::remove_file(self.file_path(id));
            }
        }
    }

    /// What a record holding `fd` holds, for the log.
    pub(crate) fn holds(&self, fd: Option<&OwnedFd>) -> Holds {
        let Some(fd) = fd else {
            return Holds::Nothing;
        };
        let transient = || match self.keeps.then(|| KeptFd::of(fd)).flatten() {
            Some(k) => Holds::Kept(k),
            None => Holds::Transient,
        };
        match rustix::fs::fstat(fd) {
            Ok(st) => self
                .ids
                .get(&(st.st_dev, st.st_ino))
                .map_or_else(transient, |&id| Holds::File(id)),
            Err(_) => transient(),
        }
    }

    /// Logs one request's changes: each touched record's state before
    /// (what it held) and after. Files no record holds any more are
    /// removed once the change is logged.
    pub(crate) fn commit(
        &mut self,
        component: &str,
        changes: Vec<(Holds, LoggedOp)>,
    ) -> Result<(), String> {
        let mut released = Vec::new();
        let ops: Vec<LoggedOp> = changes
            .iter()
            .map(|(before, after)| {
                if let Holds::File(id) = before {
                    released.push(*id);
                }
                after.clone()
            })
            .collect();
        let frame = encode(component, ops)?;
        let log = self.log.or_abort();
        log.write_all(&frame).map_err(|e| io("vault log", e))?;
        if self.fsync == FsyncPolicy::Always {
            rustix::fs::fdatasync(&*log).map_err(|e| io("vault log", e.into()))?;
        }
        self.log_len += frame.len() as u64;
        for (_, after) in &changes {
            if let LoggedOp::Put { file: Some(id), .. } = after {
                *self.refs.entry(*id).or_default() += 1;
            }
        }
        for id in released {
            self.release(id);
        }
        Ok(())
    }

    fn release(&mut self, id: u64) {
        let Some(n) = self.refs.get_mut(&id) else {
            return;
        };
        *n -= 1;
        if *n == 0 {
            self.refs.remove(&id);
            self.ids.retain(|_, v| *v != id);
            let _ = std::fs::remove_file(self.file_path(id));
        }
    }

    /// Logs `sock` as `component`'s vault socket, under a keeper.
    pub(crate) fn log_socket(&mut self, component: &str, sock: &OwnedFd) -> Result<(), String> {
        let Some(k) = self.keeps.then(|| KeptFd::of(sock)).flatten() else {
            return Ok(());
        };
        self.sockets.insert(component.to_string(), k);
        self.commit(
            component,
            vec![(Holds::Nothing, LoggedOp::Socket { kept: k })],
        )
    }

    /// Whether the log has grown enough to be rewritten.
    pub(crate) fn wants_compaction(&self) -> bool {
        self.log_len > MIN_COMPACT && self.log_len > GROWTH * self.compacted_len
    }

    /// Replaces the log by one holding `records` (component → its live
    /// records as puts): written to a new file, synced, renamed over.
    pub(crate) fn rewrite(
        &mut self,
        records: impl Iterator<Item = (String, Vec<LoggedOp>)>,
    ) -> Result<(), String> {
        let path = self.dir.join("log");
        let new = self.dir.join("log.new");
        let _ = std::fs::remove_file(&new);
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&new)
            .map_err(|e| io(new.display(), e))?;
        let mut bytes = MAGIC.to_vec();
        for (component, ops) in records {
            if !ops.is_empty() {
                bytes.extend(encode(&component, ops)?);
            }
        }
        for (component, &kept) in &self.sockets {
            bytes.extend(encode(component, vec![LoggedOp::Socket { kept }])?);
        }
        file.write_all(&bytes).map_err(|e| io(new.display(), e))?;
        file.sync_all().map_err(|e| io(new.display(), e))?;
        std::fs::rename(&new, &path).map_err(|e| io(path.display(), e))?;
        sync_dir(&self.dir)?;
        let log = OpenOptions::new()
            .append(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&path)
            .map_err(|e| io(path.display(), e))?;
        self.log = Log::new(log, path.display())?;
        self.log_len = bytes.len() as u64;
        self.compacted_len = self.log_len;
        Ok(())
    }

    /// Makes every later log write fail, as a full or failing disk would.
    #[cfg(test)]
    pub(crate) fn break_log(&mut self) {
        self.log = Log::new(File::open("/dev/null").expect("/dev/null"), "/dev/null").unwrap();
    }

    fn quarantine_record(&self, component: &str, key: &str, value: &serde_json::Value, why: &str) {
        let body =
            serde_json::json!({ "component": component, "key": key, "value": value, "why": why });
        self.quarantine(&format!("{component}.record"), body.to_string().as_bytes());
    }

    /// Moves the records of a component the system does not describe,
    /// and their files, to the quarantine.
    fn quarantine_orphan(&self, component: &str, kept: BTreeMap<String, Logged>) {
        for (key, (value, file, _)) in kept {
            let why = "its component is not in the system description";
            self.quarantine_record(component, &key, &value, why);
            if let Some(id) = file {
                let to = quarantine_path(&self.dir, &format!("{component}.file-{id}"));
                if let Err(e) = std::fs::rename(self.file_path(id), &to) {
                    tracing::error!("cannot move file {id} to {}: {e}", to.display());
                }
            }
        }
    }

    fn quarantine(&self, what: &str, bytes: &[u8]) {
        quarantine_into(&self.dir, what, bytes);
    }
}

/// `quarantine/<nanoseconds>-<what>`.
fn quarantine_path(dir: &Path, what: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    dir.join("quarantine").join(format!("{nanos}-{what}"))
}

/// Saves `bytes` as `quarantine/<nanoseconds>-<what>`.
fn quarantine_into(dir: &Path, what: &str, bytes: &[u8]) {
    let path = quarantine_path(dir, what);
    let written = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&path)
        .and_then(|mut f| f.write_all(bytes));
    if let Err(e) = written {
        tracing::error!("cannot save {} to quarantine: {e}", path.display());
    }
}

fn encode(component: &str, ops: Vec<LoggedOp>) -> Result<Vec<u8>, String> {
    let payload = serde_json::to_vec(&Frame {
        component: component.to_string(),
        ops,
    })
    .map_err(|e| format!("vault frame: {e}"))?;
    if payload.len() > MAX_FRAME {
        return Err(format!(
            "a request of {} bytes is past the vault's frame limit of {MAX_FRAME}",
            payload.len()
        ));
    }
    let mut frame = Vec::with_capacity(8 + payload.len());
    frame.extend((payload.len() as u32).to_le_bytes());
    frame.extend(crc32fast::hash(&payload).to_le_bytes());
    frame.extend(payload);
    Ok(frame)
}

/// The frame at the start of `bytes`, and its length, if it is whole and
/// passes its checksum.
fn frame_at(bytes: &[u8]) -> Option<(Frame, usize)> {
    let len = u32::from_le_bytes(bytes.get(..4)?.try_into().ok()?) as usize;
    let crc = u32::from_le_bytes(bytes.get(4..8)?.try_into().ok()?);
    if len > MAX_FRAME {
        return None;
    }
    let payload = bytes.get(8..8 + len)?;
    if crc32fast::hash(payload) != crc {
        return None;
    }
    let frame = serde_json::from_slice(payload).ok()?;
    Some((frame, 8 + len))
}

/// Each component's records as `frames` leave them.
fn fold(frames: Vec<Frame>) -> Folded {
    let mut folded = Folded::default();
    for frame in frames {
        let kept = folded.records.entry(frame.component.clone()).or_default();
        for op in frame.ops {
            match op {
                LoggedOp::Put {
                    key,
                    value,
                    file,
                    kept: k,
                } => {
                    kept.insert(key, (value, file, k));
                }
                LoggedOp::Delete { key } => {
                    kept.remove(&key);
                }
                LoggedOp::Socket { kept: k } => {
                    folded.sockets.insert(frame.component.clone(), k);
                }
            }
        }
    }
    folded
}

/// Whether record `key` stands for something a client of the component
/// holds: a descriptor's creation record (`desc/`), a page lent to a
/// holder (`lent/`). When the keeper restarts the supervisor every
/// component starts anew, its clients with it, and such records would
/// bring back what no client holds (mm's pages granted to an httpd that is
/// gone, for ever).
fn held_for_clients(key: &str) -> bool {
    key.starts_with(kintsugi_runtime::records::VAULT_PREFIX)
        || key.starts_with(kintsugi_runtime::vault::LENT)
}

/// The inherited descriptor `k` names, if it is there and still that file.
/// A record logged with a descriptor that is not (gone, or another file at
/// its number) was being deleted or replaced as the supervisor died: each
/// change is applied, closing the old descriptor, before it is logged.
fn take_kept(inherited: &mut Inherited, k: KeptFd) -> Option<OwnedFd> {
    inherited.take(k.fd).filter(|fd| k.names(fd))
}

/// The descriptors the log in `dir` says its records hold in the keeper's
/// table: what a supervisor restarted by its keeper keeps of the table it
/// inherits (it closes the rest before it opens anything). Read without
/// quarantining anything; [`Disk::open`] reads the log again and does.
pub(crate) fn kept_descriptors(dir: &Path) -> BTreeSet<RawFd> {
    let Ok(bytes) = std::fs::read(dir.join("log")) else {
        return BTreeSet::new();
    };
    let frames = scan(&bytes).into_iter().filter_map(Result::ok).collect();
    let folded = fold(frames);
    let records = folded.records.values().flat_map(|r| r.values());
    records
        .filter_map(|r| r.2.map(|k| k.fd))
        .chain(folded.sockets.values().map(|k| k.fd))
        .collect()
}

/// The frames of a log's bytes in order, and where bytes that are not a
/// whole frame with its checksum lie (`Err(start..end)`); nothing if the
/// log does not start with [`MAGIC`].
fn scan(bytes: &[u8]) -> Vec<Result<Frame, Range<usize>>> {
    let mut out = Vec::new();
    if !bytes.starts_with(MAGIC) {
        return out;
    }
    let mut at = MAGIC.len();
    while at < bytes.len() {
        if let Some((frame, len)) = frame_at(&bytes[at..]) {
            out.push(Ok(frame));
            at += len;
            continue;
        }
        let next = (at + 1..bytes.len())
            .find(|&p| frame_at(&bytes[p..]).is_some())
            .unwrap_or(bytes.len());
        out.push(Err(at..next));
        at = next;
    }
    out
}

/// The frames of `dir/log` that pass their checksums, in order; what lies
/// between them is quarantined.
fn read_log(dir: &Path, quarantined: &mut Vec<String>) -> Result<Vec<Frame>, String> {
    let path = dir.join("log");
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io(path.display(), e)),
    };
    if !bytes.starts_with(MAGIC) {
        quarantine_into(dir, "log", &bytes);
        quarantined.push(format!(
            "{}: not a kintsugi vault log (its {} bytes are in quarantine)",
            path.display(),
            bytes.len()
        ));
        return Ok(Vec::new());
    }
    let mut frames = Vec::new();
    for scanned in scan(&bytes) {
        let Range {
            start: at,
            end: next,
        } = match scanned {
            Ok(frame) => {
                frames.push(frame);
                continue;
            }
            Err(r) => r,
        };
        quarantine_into(dir, &format!("{at}.frame"), &bytes[at..next]);
        quarantined.push(format!(
            "{}: bytes {at}..{next} are not a whole frame with its checksum{}",
            path.display(),
            if next == bytes.len() {
                " (the log's end: a write cut short, or corruption)"
            } else {
                ""
            }
        ));
    }
    Ok(frames)
}

/// The ids of the files in `dir/files`.
fn file_ids(dir: &Path) -> Result<Vec<u64>, String> {
    let files = dir.join("files");
    let entries = std::fs::read_dir(&files).map_err(|e| io(files.display(), e))?;
    Ok(entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect())
}

/// `d`, created 0700 if absent; refused unless a directory (not a
/// symlink) of this user that no one else may enter.
fn private_dir(d: &Path) -> Result<(), String> {
    match crate::private::refusal(d) {
        Ok(None) => Ok(()),
        Ok(Some(why)) => Err(format!("vault directory {} refused: {why}", d.display())),
        Err(e) => Err(io(d.display(), e)),
    }
}

fn sync_dir(d: &Path) -> Result<(), String> {
    let f = File::open(d).map_err(|e| io(d.display(), e))?;
    rustix::fs::fsync(f.as_fd()).map_err(|e| io(d.display(), e.into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_log_descriptor_that_names_another_file_is_found() {
        let dir = std::env::temp_dir().join(format!("kintsugi-log-id-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let a = File::create(dir.join("log")).unwrap();
        let b = File::create(dir.join("other")).unwrap();
        let mut log = Log::new(a, "log").unwrap();
        assert!(log.checked().is_some(), "the log, as opened");
        // Its number closed and taken by another file, as a fault would.
        let mut fd = std::os::fd::OwnedFd::from(log.file);
        rustix::io::dup2(&b, &mut fd).unwrap();
        log.file = File::from(fd);
        assert!(log.checked().is_none(), "another file at the log's number");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The log reader on damaged logs (bytes flipped, inserted, cut; a
    /// seeded xorshift, seed printed): it never panics, and every frame it
    /// gives back is one that was written, whole.
    #[test]
    fn a_damaged_log_never_panics_and_yields_only_frames_written() {
        let seed = std::env::var("KINTSUGI_TEST_SEED")
            .ok()
            .and_then(|s| s.parse::<u64>().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(1, |d| d.as_nanos() as u64)
            })
            | 1;
        eprintln!("seed {seed} (KINTSUGI_TEST_SEED replays it)");
        let mut x = seed;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let op = |i: u64| LoggedOp::Put {
            key: format!("k{i}"),
            value: serde_json::json!(i),
            file: None,
            kept: None,
        };
        let mut log = MAGIC.to_vec();
        for i in 0..40 {
            log.extend(encode("c", vec![op(i)]).unwrap());
        }
        let dir =
            std::env::temp_dir().join(format!("kintsugi-vault-damage-{}", std::process::id()));
        private_dir(&dir).unwrap();
        private_dir(&dir.join("quarantine")).unwrap();
        for round in 0..300 {
            let mut bytes = log.clone();
            for _ in 0..1 + next() % 4 {
                if bytes.len() == MAGIC.len() {
                    break; // cut to the magic: nothing left to damage
                }
                let at = MAGIC.len() + (next() as usize) % (bytes.len() - MAGIC.len());
                match next() % 3 {
                    0 => bytes[at] ^= 1 << (next() % 8),
                    1 => bytes.insert(at, next() as u8),
                    _ => bytes.truncate(at.max(MAGIC.len())),
                }
            }
            std::fs::write(dir.join("log"), &bytes).unwrap();
            let mut quarantined = Vec::new();
            let frames = read_log(&dir, &mut quarantined).unwrap();
            for f in &frames {
                assert_eq!(f.component, "c", "round {round}");
                let [LoggedOp::Put { key, value, .. }] = f.ops.as_slice() else {
                    panic!("round {round}: a frame not written: {f:?}");
                };
                let i = value.as_u64().expect("a number");
                assert_eq!(&op(i), &f.ops[0], "round {round}: {key}");
            }
            assert!(frames.len() <= 40, "round {round}");
            if frames.len() < 40 && bytes.len() > MAGIC.len() + 8 {
                // What was lost is accounted for (unless cut at a frame's end).
                assert!(
                    !quarantined.is_empty() || bytes.len() < log.len(),
                    "round {round}"
                );
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// An empty directory for a vault, and the vault kept there.
    fn fresh_storage(name: &str) -> (PathBuf, VaultStorage) {
        let dir =
            std::env::temp_dir().join(format!("kintsugi-vault-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let storage = VaultStorage {
            dir: dir.clone(),
            fsync: FsyncPolicy::Never,
        };
        (dir, storage)
    }

    fn memfd(name: &str) -> OwnedFd {
        rustix::fs::memfd_create(name, rustix::fs::MemfdFlags::CLOEXEC).unwrap()
    }

    /// Under a keeper a record's descriptor is logged by number and file;
    /// a supervisor the keeper restarted takes it back only if that number
    /// still names that file (else the record was being deleted or replaced
    /// as the supervisor died, and is gone), and a first supervisor finds
    /// such records gone with the system that held them.
    #[test]
    fn a_kept_descriptor_comes_back_only_as_the_same_file_after_a_keepers_restart() {
        let (dir, storage) = fresh_storage("kept");
        let mut first = Inherited::first();
        let (mut disk, _) = Disk::open(&storage, &|_| true, Some(&mut first)).unwrap();
        let (a, b) = (memfd("a"), memfd("b"));
        let put = |key: &str, fd: &OwnedFd, disk: &Disk| {
            let Holds::Kept(k) = disk.holds(Some(fd)) else {
                panic!("a memfd under a keeper is kept");
            };
            assert_eq!(k.fd, fd.as_raw_fd());
            let kept = Some(k);
            let value = serde_json::json!(key);
            let key = key.to_string();
            (
                Holds::Nothing,
                LoggedOp::Put {
                    key,
                    value,
                    file: None,
                    kept,
                },
            )
        };
        let ops = vec![put("a", &a, &disk), put("b", &b, &disk)];
        disk.commit("c", ops).unwrap();
        drop(disk);
        let (a_fd, b_fd) = (a.as_raw_fd(), b.as_raw_fd());
        let a_ino = rustix::fs::fstat(&a).unwrap().st_ino;
        // `a` where it was; another file at `b`'s number.
        let mut restarted = Inherited::restarted_with([(a_fd, a), (b_fd, memfd("other"))]);
        let (_, loaded) = Disk::open(&storage, &|_| true, Some(&mut restarted)).unwrap();
        let records = &loaded.records["c"];
        let got = records["a"]
            .kept
            .as_ref()
            .expect("a's descriptor taken back");
        assert_eq!(rustix::fs::fstat(got).unwrap().st_ino, a_ino);
        assert!(!records.contains_key("b"), "b names another file now");
        assert_eq!(loaded.gone, 1);
        assert!(loaded.quarantined.is_empty(), "{:?}", loaded.quarantined);
        assert!(restarted.is_empty(), "both taken");
        // The log now names a's new number; a first supervisor (no restart)
        // finds it gone with its system, and quarantines nothing.
        let (_, loaded) = Disk::open(&storage, &|_| true, Some(&mut Inherited::first())).unwrap();
        assert!(loaded.records.get("c").is_none_or(|r| r.is_empty()));
        assert!(loaded.quarantined.is_empty(), "{:?}", loaded.quarantined);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A supervisor its keeper restarted starts every component anew, and
    /// their clients with them: the records of what those clients held
    /// (creation records of their descriptors, pages lent to them) are
    /// dropped; a start without a keeper keeps them, as before.
    #[test]
    fn a_keepers_restart_drops_what_the_dead_systems_clients_held() {
        let (dir, storage) = fresh_storage("stale");
        let (mut disk, _) = Disk::open(&storage, &|_| true, None).unwrap();
        let plain = |key: &str| {
            let (key, value) = (key.to_string(), serde_json::json!(1));
            let op = LoggedOp::Put {
                key,
                value,
                file: None,
                kept: None,
            };
            (Holds::Nothing, op)
        };
        let ops = vec![plain("desc/7"), plain("lent/3/page/0x10"), plain("tree")];
        disk.commit("c", ops).unwrap();
        drop(disk);
        let (_, loaded) = Disk::open(&storage, &|_| true, None).unwrap();
        assert_eq!(loaded.records["c"].len(), 3);
        assert_eq!(loaded.stale, 0);
        let mut restarted = Inherited::restarted_with([]);
        let (_, loaded) = Disk::open(&storage, &|_| true, Some(&mut restarted)).unwrap();
        let keys: Vec<&String> = loaded.records["c"].keys().collect();
        assert_eq!(keys, ["tree"]);
        assert_eq!(loaded.stale, 2);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

//! What one component's vault holds, and the most it may hold: the vault
//! no longer trusts its clients (issue 17). NewtOS's storage server served
//! trusted system servers; here any component, a compromised one too, can
//! send it requests, so each component has a quota of records, bytes and
//! descriptors (`vault_quota` in the system description), and all
//! components together may hold at most the supervisor's descriptor limit
//! less a reserve that keeps the supervisor able to work. A request that
//! would cross a limit is refused whole, with the numbers, and changes
//! nothing; the other components' vaults are untouched.

use std::collections::{BTreeMap, HashMap};
use std::os::fd::{IntoRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};

use kintsugi_runtime::vault::{listed_bytes, VaultOp, MAX_RECORD};
use kintsugi_system::VaultQuota;

/// One record: its value, its descriptor if it has one, and its size as
/// counted against the quota.
#[derive(Default)]
pub(crate) struct Entry {
    pub value: serde_json::Value,
    pub fd: Option<OwnedFd>,
    size: u64,
    /// The change that last wrote it ([`Records::seq`]).
    seq: u64,
    /// Whether `fd` is a file (a memfd, or a file of the vault's
    /// directory), which a reader may hold ahead: see [`Records::changes`].
    file: bool,
}

impl Entry {
    /// Whether a reader's listing may carry this record with its
    /// descriptor: it has none, or a file.
    pub(crate) fn readable_ahead(&self) -> bool {
        self.fd.is_none() || self.file
    }
}

/// Whether `fd` is a regular file.
pub(crate) fn is_file(fd: Option<&OwnedFd>) -> bool {
    fd.is_some_and(|fd| {
        rustix::fs::fstat(fd)
            .is_ok_and(|st| rustix::fs::FileType::from_raw_mode(st.st_mode).is_file())
    })
}

/// Deleted keys remembered for [`Records::changes`]; a reader whose
/// listing is older than the oldest lists again.
const TOMBSTONES: usize = 4096;

/// What changed in a component's records since a reader listed them.
pub(crate) struct Changes<'a> {
    /// Records written since, and every record whose descriptor a reader
    /// is never given ahead (a socket), in key order.
    pub changed: Vec<(&'a String, &'a Entry)>,
    /// Keys deleted since and absent now.
    pub deleted: Vec<&'a String>,
}

/// A record's state before a change: its value and a duplicate of its
/// descriptor (none: it was absent), to put back if the change cannot be
/// kept.
pub(crate) type Saved = (String, Option<(serde_json::Value, Option<OwnedFd>)>);

/// Descriptors the supervisor lets every vault hold in all.
#[derive(Debug)]
pub(crate) struct FdBudget {
    pub(crate) held: AtomicU64,
    ceiling: u64,
}

/// Descriptors the supervisor keeps for itself whatever the vaults hold:
/// its channels, pidfds, sockets and files.
pub(crate) const FD_RESERVE: u64 = 1024;

impl FdBudget {
    /// The budget under this process's descriptor limit.
    pub(crate) fn from_limit() -> Self {
        let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile)
            .current
            .unwrap_or(u64::MAX);
        Self::new(limit.saturating_sub(FD_RESERVE))
    }

    pub(crate) fn new(ceiling: u64) -> Self {
        Self {
            held: AtomicU64::new(0),
            ceiling,
        }
    }

    /// Takes `n` more descriptors, if the budget has room.
    fn take(&self, n: u64) -> Result<(), String> {
        self.held
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |held| {
                (held + n <= self.ceiling).then_some(held + n)
            })
            .map(|_| ())
            .map_err(|held| {
                format!(
                    "the supervisor's descriptors are spent ({held} held by vaults, at most {})",
                    self.ceiling
                )
            })
    }

    fn give_back(&self, n: u64) {
        self.held.fetch_sub(n, Ordering::SeqCst);
    }

    /// Counts `n` descriptors held whatever the room: records put by the
    /// supervisor itself (loaded from disk, passed by a service manager,
    /// restored from an image), which a later delete gives back.
    fn charge(&self, n: u64) {
        self.held.fetch_add(n, Ordering::SeqCst);
    }
}

/// What one component's vault holds, as the last request left it: read
/// by observers (`kintsugi status`, the metrics endpoint) without the
/// vault's lock.
#[derive(Debug, Default)]
pub struct VaultUsage {
    records: AtomicU64,
    bytes: AtomicU64,
    fds: AtomicU64,
}

/// A snapshot of a [`VaultUsage`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VaultUse {
    pub records: u64,
    pub bytes: u64,
    pub fds: u64,
}

impl VaultUsage {
    pub(crate) fn set(&self, r: &Records) {
        self.records.store(r.map.len() as u64, Ordering::Relaxed);
        self.bytes.store(r.bytes, Ordering::Relaxed);
        self.fds.store(r.fds, Ordering::Relaxed);
    }

    pub fn now(&self) -> VaultUse {
        VaultUse {
            records: self.records.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
            fds: self.fds.load(Ordering::Relaxed),
        }
    }
}

/// One component's records, and what they add up to.
#[derive(Default)]
pub(crate) struct Records {
    map: BTreeMap<String, Entry>,
    bytes: u64,
    fds: u64,
    /// Changes made: each put and delete takes the next number.
    seq: u64,
    /// Keys deleted, by the change that deleted them: the latest
    /// [`TOMBSTONES`].
    deleted: BTreeMap<u64, String>,
    /// Deletions at or before this change may be missing from `deleted`.
    floor: u64,
}

/// The size a record counts for: its key and its value as JSON text.
fn size_of(key: &str, value: &serde_json::Value) -> u64 {
    (key.len() + value.to_string().len()) as u64
}

fn key_of(op: &VaultOp) -> &str {
    match op {
        VaultOp::Put { key, .. } | VaultOp::Delete { key } => key,
    }
}

impl Records {
    pub(crate) fn map(&self) -> &BTreeMap<String, Entry> {
        &self.map
    }

    /// Gives up every descriptor held without closing it (a supervisor
    /// under a keeper failing: see `vault::Kept`'s `Drop`).
    pub(crate) fn leave_descriptors_open(&mut self) {
        for entry in self.map.values_mut() {
            if let Some(fd) = entry.fd.take() {
                let _open = fd.into_raw_fd();
            }
        }
    }

    /// Puts a record back as exported (not checked against a quota: it was
    /// within one when it was taken).
    pub(crate) fn insert(&mut self, key: String, value: serde_json::Value, fd: Option<OwnedFd>) {
        let entry = Entry {
            size: size_of(&key, &value),
            value,
            file: is_file(fd.as_ref()),
            fd,
            seq: self.stamp(),
        };
        self.bytes += entry.size;
        self.fds += u64::from(entry.fd.is_some());
        if let Some(old) = self.map.insert(key, entry) {
            self.bytes -= old.size;
            self.fds -= u64::from(old.fd.is_some());
        }
    }

    /// [`Records::insert`] of a record the supervisor puts itself, its
    /// descriptor counted in `budget` (and a replaced one's given back).
    pub(crate) fn insert_counted(
        &mut self,
        key: String,
        value: serde_json::Value,
        fd: Option<OwnedFd>,
        budget: &FdBudget,
    ) {
        let before = self.fds;
        self.insert(key, value, fd);
        match self.fds.cmp(&before) {
            std::cmp::Ordering::Greater => budget.charge(self.fds - before),
            std::cmp::Ordering::Less => budget.give_back(before - self.fds),
            std::cmp::Ordering::Equal => {}
        }
    }

    /// Removes record `key`, if there is one.
    fn remove(&mut self, key: &str) {
        if let Some(old) = self.map.remove(key) {
            self.bytes -= old.size;
            self.fds -= u64::from(old.fd.is_some());
            self.note_deleted(key.to_string());
        }
    }

    /// The number of the change being made.
    fn stamp(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }

    /// Remembers that `key` was deleted by a change of its own.
    fn note_deleted(&mut self, key: String) {
        let seq = self.stamp();
        self.deleted.insert(seq, key);
        while self.deleted.len() > TOMBSTONES {
            if let Some((oldest, _)) = self.deleted.pop_first() {
                self.floor = oldest;
            }
        }
    }

    /// The number of the latest change.
    pub(crate) fn seq(&self) -> u64 {
        self.seq
    }

    /// What changed after change `since`, for one who listed the records
    /// then (None: the deletions since are no longer all known, or `since`
    /// is no change of these records; list again): for a reader (`ahead`),
    /// the records written since that it may hold; for the component
    /// itself, those and every record a reader is not given.
    pub(crate) fn changes(&self, since: u64, ahead: bool) -> Option<Changes<'_>> {
        if since < self.floor || since > self.seq {
            return None;
        }
        let changed = self
            .map
            .iter()
            .filter(|(_, e)| match ahead {
                true => e.seq > since && e.readable_ahead(),
                false => e.seq > since || !e.readable_ahead(),
            })
            .collect();
        let mut deleted: Vec<&String> = self
            .deleted
            .range(since + 1..)
            .map(|(_, key)| key)
            .filter(|key| !self.map.contains_key(*key))
            .collect();
        deleted.sort();
        deleted.dedup();
        Some(Changes { changed, deleted })
    }

    /// Puts records back as they were before a change that could not be
    /// kept. Their descriptors stay counted against the supervisor's
    /// budget as they were while the change held (a rare failure of the
    /// vault's disk; the budget is an estimate that errs high).
    pub(crate) fn restore(&mut self, saved: Vec<Saved>) {
        for (key, before) in saved {
            match before {
                Some((value, fd)) => self.insert(key, value, fd),
                None => self.remove(&key),
            }
        }
    }

    /// What the records would add up to after `ops` (whose sizes are
    /// `sizes`): records, bytes, descriptors.
    fn after(&self, ops: &[VaultOp], sizes: &[u64]) -> (u64, u64, u64) {
        let mut touched: HashMap<&str, Option<(u64, bool)>> = HashMap::new();
        let (mut n, mut bytes, mut fds) =
            (self.map.len() as i128, self.bytes as i128, self.fds as i128);
        for (op, size) in ops.iter().zip(sizes) {
            let key = key_of(op);
            let before = match touched.get(key) {
                Some(t) => *t,
                None => self.map.get(key).map(|e| (e.size, e.fd.is_some())),
            };
            let after = match op {
                VaultOp::Put { fd, .. } => Some((*size, *fd || before.is_some_and(|b| b.1))),
                VaultOp::Delete { .. } => None,
            };
            for (sign, state) in [(-1, before), (1, after)] {
                if let Some((size, fd)) = state {
                    n += sign;
                    bytes += sign * size as i128;
                    fds += sign * i128::from(fd);
                }
            }
            touched.insert(key, after);
        }
        (n as u64, bytes as u64, fds as u64)
    }

    /// Applies every op or none: none if the descriptors attached do not
    /// match those announced, or if the result would cross `quota` or the
    /// supervisor's `budget`.
    pub(crate) fn apply(
        &mut self,
        ops: Vec<VaultOp>,
        fds: Vec<OwnedFd>,
        quota: &VaultQuota,
        budget: &FdBudget,
    ) -> Result<(), String> {
        let wanted = ops
            .iter()
            .filter(|op| matches!(op, VaultOp::Put { fd: true, .. }))
            .count();
        if wanted != fds.len() {
            return Err(format!(
                "{wanted} descriptors announced, {} attached",
                fds.len()
            ));
        }
        for op in &ops {
            if let VaultOp::Put { key, value, .. } = op {
                let listed = listed_bytes(key, value);
                if listed > MAX_RECORD {
                    return Err(format!(
                        "record {:?} of {listed} bytes is larger than one reply of the vault \
                         holds ({MAX_RECORD}); nothing changed",
                        key.chars().take(64).collect::<String>()
                    ));
                }
            }
        }
        let sizes: Vec<u64> = ops
            .iter()
            .map(|op| match op {
                VaultOp::Put { key, value, .. } => size_of(key, value),
                VaultOp::Delete { .. } => 0,
            })
            .collect();
        let (n, bytes, nfds) = self.after(&ops, &sizes);
        // A request that does not make an excess worse passes: a vault
        // imported above its quota can still shrink.
        for (what, value, max, now) in [
            ("records", n, quota.records, self.map.len() as u64),
            ("bytes", bytes, quota.bytes, self.bytes),
            ("descriptors", nfds, quota.fds, self.fds),
        ] {
            if value > max && value > now {
                return Err(format!(
                    "over quota: {value} {what} (vault_quota allows {max}); nothing changed"
                ));
            }
        }
        if nfds > self.fds {
            budget.take(nfds - self.fds)?;
        } else {
            budget.give_back(self.fds - nfds);
        }
        let mut fds = fds.into_iter();
        for (op, size) in ops.into_iter().zip(sizes) {
            match op {
                VaultOp::Put { key, value, fd } => {
                    let seq = self.stamp();
                    let entry = self.map.entry(key).or_default();
                    entry.value = value;
                    entry.size = size;
                    entry.seq = seq;
                    if fd {
                        entry.fd = fds.next();
                        entry.file = is_file(entry.fd.as_ref());
                    }
                }
                VaultOp::Delete { key } => {
                    if self.map.remove(&key).is_some() {
                        self.note_deleted(key);
                    }
                }
            }
        }
        (self.bytes, self.fds) = (bytes, nfds);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn put(key: &str, value: serde_json::Value, fd: bool) -> VaultOp {
        VaultOp::Put {
            key: key.into(),
            value,
            fd,
        }
    }

    fn memfd() -> OwnedFd {
        rustix::fs::memfd_create("q", rustix::fs::MemfdFlags::CLOEXEC).unwrap()
    }

    #[test]
    fn a_request_past_a_quota_is_refused_whole_and_counts_stay_exact() {
        let quota = VaultQuota {
            records: 3,
            bytes: 100,
            fds: 1,
        };
        let budget = FdBudget::new(10);
        let mut r = Records::default();
        r.apply(
            vec![put("a", json!(1), false), put("b", json!("xy"), true)],
            vec![memfd()],
            &quota,
            &budget,
        )
        .unwrap();
        assert_eq!((r.map.len(), r.bytes, r.fds), (2, 2 + 1 + 4, 1));
        // A second descriptor: refused, and nothing of the request applied.
        let e = r
            .apply(
                vec![put("c", json!(3), true)],
                vec![memfd()],
                &quota,
                &budget,
            )
            .unwrap_err();
        assert!(e.contains("2 descriptors (vault_quota allows 1)"), "{e}");
        assert!(!r.map.contains_key("c"));
        // Replacing a record's descriptor keeps the count.
        r.apply(
            vec![put("b", json!("z"), true)],
            vec![memfd()],
            &quota,
            &budget,
        )
        .unwrap();
        assert_eq!((r.fds, budget.held.load(Ordering::SeqCst)), (1, 1));
        // Records and bytes.
        let e = r
            .apply(
                vec![put("c", json!(3), false), put("d", json!(4), false)],
                vec![],
                &quota,
                &budget,
            )
            .unwrap_err();
        assert!(e.contains("4 records (vault_quota allows 3)"), "{e}");
        let e = r
            .apply(
                vec![put("c", json!("x".repeat(100)), false)],
                vec![],
                &quota,
                &budget,
            )
            .unwrap_err();
        assert!(e.contains("bytes (vault_quota allows 100)"), "{e}");
        // Put then delete in one request counts as nothing.
        r.apply(
            vec![
                put("c", json!("x".repeat(100)), false),
                VaultOp::Delete { key: "c".into() },
            ],
            vec![],
            &quota,
            &budget,
        )
        .unwrap();
        // Deleting gives the descriptor back to the supervisor's budget.
        r.apply(
            vec![VaultOp::Delete { key: "b".into() }],
            vec![],
            &quota,
            &budget,
        )
        .unwrap();
        assert_eq!((r.map.len(), r.bytes, r.fds), (1, 2, 0));
        assert_eq!(budget.held.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn a_request_with_missing_descriptors_changes_nothing() {
        let mut r = Records::default();
        let ops = vec![put("a", json!(1), false), put("b", json!(2), true)];
        let e = r
            .apply(ops, vec![], &VaultQuota::default(), &FdBudget::new(10))
            .unwrap_err();
        assert_eq!(e, "1 descriptors announced, 0 attached");
        assert!(r.map.is_empty());
    }

    #[test]
    fn the_supervisors_budget_holds_across_components() {
        let quota = VaultQuota::default();
        let budget = FdBudget::new(2);
        let (mut a, mut b) = (Records::default(), Records::default());
        a.apply(
            vec![put("x", json!(0), true), put("y", json!(0), true)],
            vec![memfd(), memfd()],
            &quota,
            &budget,
        )
        .unwrap();
        let e = b
            .apply(
                vec![put("x", json!(0), true)],
                vec![memfd()],
                &quota,
                &budget,
            )
            .unwrap_err();
        assert!(e.contains("descriptors are spent"), "{e}");
        assert!(b.map.is_empty());
    }

    /// What one who listed at change `since` is told: the records written
    /// since (for a reader, only those it may hold; for the component,
    /// sockets too, always), the keys deleted since; nothing once the
    /// deletions since are more than are remembered.
    #[test]
    fn changes_since_a_listing_are_told_until_the_deletions_are_forgotten() {
        let (quota, budget) = (VaultQuota::default(), FdBudget::new(100));
        let mut r = Records::default();
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let ops = vec![put("f", json!(1), true), put("s", json!(2), true)];
        r.apply(ops, vec![memfd(), OwnedFd::from(a)], &quota, &budget)
            .unwrap();
        r.apply(vec![put("p", json!(3), false)], vec![], &quota, &budget)
            .unwrap();
        let since = r.seq();
        let keys = |c: &Changes<'_>| -> (Vec<String>, Vec<String>) {
            let changed = c.changed.iter().map(|(k, _)| k.to_string()).collect();
            (changed, c.deleted.iter().map(|k| k.to_string()).collect())
        };
        let none: Vec<String> = vec![];
        assert_eq!(
            keys(&r.changes(since, true).unwrap()),
            (none.clone(), none.clone())
        );
        assert_eq!(
            keys(&r.changes(since, false).unwrap()),
            (vec!["s".into()], none.clone())
        );
        let ops = vec![
            put("p", json!(4), false),
            VaultOp::Delete { key: "f".into() },
            put("g", json!(5), true),
        ];
        r.apply(ops, vec![memfd()], &quota, &budget).unwrap();
        let told = keys(&r.changes(since, true).unwrap());
        assert_eq!(told, (vec!["g".into(), "p".into()], vec!["f".into()]));
        // Deleted and put back: a change, not a deletion.
        r.apply(
            vec![VaultOp::Delete { key: "g".into() }],
            vec![],
            &quota,
            &budget,
        )
        .unwrap();
        r.apply(vec![put("g", json!(6), false)], vec![], &quota, &budget)
            .unwrap();
        let told = keys(&r.changes(since, true).unwrap());
        assert_eq!(told, (vec!["g".into(), "p".into()], vec!["f".into()]));
        assert!(
            r.changes(r.seq() + 1, true).is_none(),
            "a change not made yet"
        );
        for i in 0..=TOMBSTONES {
            let key = format!("t{i}");
            r.apply(vec![put(&key, json!(0), false)], vec![], &quota, &budget)
                .unwrap();
            r.apply(vec![VaultOp::Delete { key }], vec![], &quota, &budget)
                .unwrap();
        }
        assert!(r.changes(since, true).is_none(), "deletions forgotten");
        let recent = r.seq() - 1;
        assert_eq!(keys(&r.changes(recent, true).unwrap()).1.len(), 1);
    }
}

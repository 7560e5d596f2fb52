//! A standby reads its vault ahead of its activation.
//!
//! Listing a component's records costs about 1.5 µs a record (JSON both
//! ways, descriptors duplicated and passed): for ramfs's 201 files in
//! C3's Table I, 0.9–1.4 ms of its initialization, on the reboot's path.
//! NewtOS's storage server hands a restarted server its state when it
//! asks; a warm standby can ask before it is needed. So a standby lists
//! its records while it waits, through a socket of its own
//! ([`VaultRequest::Reader`]: the component's socket belongs to the live
//! incarnation, whose replies it must not take), keeps the copy up to date
//! every [`REFRESH`], and at activation its first [`Vault::list`] asks only
//! what changed since ([`VaultRequest::Changes`]): the vault numbers every
//! change to a component's records and remembers the keys it deleted.
//!
//! What a standby holds ahead: the records' values and the descriptors
//! that are files (ramfs's memfds). A deleted file's memory is given back
//! once the standby's copy is next brought up to date, within [`REFRESH`].
//! Sockets (netd's connections) are never held ahead: a peer must see one
//! closed when its record goes. Their records come with the changes.

use std::collections::BTreeMap;
use std::os::fd::AsFd;
use std::time::Duration;

use super::{records, Vault, VaultError, VaultRecord, VaultRequest};

/// How often a standby brings its copy up to date.
pub const REFRESH: Duration = Duration::from_millis(200);

/// The records as read ahead, as of change `seq`.
pub(super) struct Snapshot {
    seq: u64,
    records: BTreeMap<String, VaultRecord>,
}

/// What a [`Vault`] holds for its first listing.
pub(super) enum Ahead {
    /// Nothing (yet, or while the standby brings its copy up to date).
    Unread,
    Ready(Snapshot),
    /// The incarnation has listed: what is read after is of no use.
    Taken,
}

impl Vault {
    /// Standby: reads this component's records through a connection of
    /// its own, then brings them up to date every [`REFRESH`], until
    /// `activated` says the standby runs (or `park` is cut short by an
    /// unpark: the caller's way to end it sooner).
    pub fn read_ahead_until(&self, activated: impl Fn() -> bool) -> Result<(), VaultError> {
        let reader = self.reader()?;
        let mut snapshot = reader.snapshot()?;
        loop {
            if !self.publish(snapshot) {
                return Ok(());
            }
            std::thread::park_timeout(REFRESH);
            if activated() {
                return Ok(());
            }
            let Some(mut held) = self.take_back() else {
                return Ok(());
            };
            if !reader.catch_up(&mut held)? {
                held = reader.snapshot()?;
            }
            snapshot = held;
        }
    }

    /// A connection on which the vault serves this component's reads to
    /// this process alone.
    fn reader(&self) -> Result<Vault, VaultError> {
        use rustix::net::{socketpair, AddressFamily, SocketFlags, SocketType};
        let (mine, theirs) = socketpair(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )
        .map_err(std::io::Error::from)?;
        self.send_only(VaultRequest::Reader, &[theirs.as_fd()])?;
        Ok(Vault::new(mine))
    }

    /// Every record (a reader is given), as of the first page's change.
    fn snapshot(&self) -> Result<Snapshot, VaultError> {
        let mut records = BTreeMap::new();
        let mut seq = None;
        let mut after: Option<String> = None;
        loop {
            let page = self.page("", after.as_deref(), false)?;
            seq.get_or_insert(page.seq);
            after = page.records.last().map(|r| r.key.clone()).or(after);
            records.extend(page.records.into_iter().map(|r| (r.key.clone(), r)));
            if !page.more {
                let seq = seq.unwrap_or_default();
                return Ok(Snapshot { seq, records });
            }
        }
    }

    /// Brings `snapshot` up to what the vault holds now; false if the
    /// vault cannot say what changed (then list again).
    fn catch_up(&self, snapshot: &mut Snapshot) -> Result<bool, VaultError> {
        let since = snapshot.seq;
        let (reply, fds) = self.round_trip(|id| VaultRequest::Changes { id, since }, &[])?;
        if reply.relist {
            return Ok(false);
        }
        for key in &reply.deleted {
            snapshot.records.remove(key);
        }
        for r in records(reply.records, fds)? {
            snapshot.records.insert(r.key.clone(), r);
        }
        snapshot.seq = reply.seq;
        Ok(true)
    }

    /// Offers `snapshot` to the first listing; false if it is done.
    fn publish(&self, snapshot: Snapshot) -> bool {
        let mut ahead = self.ahead.lock().unwrap_or_else(|e| e.into_inner());
        if matches!(*ahead, Ahead::Taken) {
            return false;
        }
        *ahead = Ahead::Ready(snapshot);
        true
    }

    /// The snapshot offered, to bring up to date (the first listing meanwhile
    /// lists as if none had been read).
    fn take_back(&self) -> Option<Snapshot> {
        let mut ahead = self.ahead.lock().unwrap_or_else(|e| e.into_inner());
        match std::mem::replace(&mut *ahead, Ahead::Unread) {
            Ahead::Ready(s) => Some(s),
            other => {
                *ahead = other;
                None
            }
        }
    }

    /// Drops what was read ahead and not listed: the incarnation is
    /// initialized, and later listings ask the vault.
    pub fn forget_ahead(&self) {
        let mut ahead = self.ahead.lock().unwrap_or_else(|e| e.into_inner());
        *ahead = Ahead::Taken;
    }

    /// The incarnation's first listing, made from what its standby read
    /// ahead and what changed since; None if it read nothing or the vault
    /// cannot say what changed.
    pub(super) fn caught_up(&self) -> Result<Option<Vec<VaultRecord>>, VaultError> {
        let taken = {
            let mut ahead = self.ahead.lock().unwrap_or_else(|e| e.into_inner());
            std::mem::replace(&mut *ahead, Ahead::Taken)
        };
        let Ahead::Ready(mut snapshot) = taken else {
            return Ok(None);
        };
        if !self.catch_up(&mut snapshot)? {
            return Ok(None);
        }
        Ok(Some(snapshot.records.into_values().collect()))
    }
}

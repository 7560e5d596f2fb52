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

use std::any::Any;
use std::collections::BTreeMap;
use std::os::fd::AsFd;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::{records, Builder, Vault, VaultError, VaultRecord, VaultRequest};

/// How often a standby brings its copy up to date.
pub const REFRESH: Duration = Duration::from_millis(200);

/// The records as read ahead, as of change `seq`, and the state built
/// from them ([`prepared`]).
pub(super) struct Snapshot {
    seq: u64,
    records: BTreeMap<String, VaultRecord>,
    built: Option<Box<dyn Any + Send>>,
}

impl Snapshot {
    /// Builds the state from the records.
    fn build(&mut self, builder: Option<&Builder>) {
        self.built = builder.and_then(|b| b.build(self.records.values()));
    }
}

/// What bringing a snapshot up to date found.
enum Caught {
    Unchanged,
    Changed,
    /// The vault cannot say what changed: list again.
    Relist,
}

/// What a standby's snapshot gives its incarnation's first listing.
pub(super) enum FirstListing {
    /// The records, up to date.
    Records(Vec<VaultRecord>),
    /// The state built from records that did not change since.
    Built(Box<dyn Any + Send>),
}

/// What a [`Vault`] holds for its first listing.
pub(super) enum Ahead {
    /// Nothing (yet, or while the standby brings its copy up to date).
    Unread,
    Ready(Snapshot),
    /// The incarnation has listed: what is read after is of no use. What
    /// its listing did not use waits here to be dropped a while after its
    /// activation ([`Vault::drop_spent`]).
    Taken(Option<Box<dyn Any + Send>>),
}

impl Vault {
    /// Standby: reads this component's records through a connection of
    /// its own, then brings them up to date every [`REFRESH`], until
    /// `activated` says the standby runs (or `park` is cut short by an
    /// unpark: the caller's way to end it sooner).
    pub fn read_ahead_until(&self, activated: impl Fn() -> bool) -> Result<(), VaultError> {
        let reader = self.reader()?;
        let builder = self.builder.as_ref();
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
            // The state is built once the records stood for a refresh: a
            // component that writes its vault all the time would otherwise
            // have it built again at every refresh, and never taken.
            match reader.catch_up(&mut held)? {
                Caught::Unchanged if held.built.is_none() => held.build(builder),
                Caught::Unchanged => {}
                Caught::Changed => held.built = None,
                Caught::Relist => held = reader.snapshot()?,
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
                return Ok(Snapshot {
                    seq,
                    records,
                    built: None,
                });
            }
        }
    }

    /// Brings `snapshot` up to what the vault holds now.
    fn catch_up(&self, snapshot: &mut Snapshot) -> Result<Caught, VaultError> {
        let since = snapshot.seq;
        let (reply, fds) = self.round_trip(|id| VaultRequest::Changes { id, since }, &[])?;
        if reply.relist {
            return Ok(Caught::Relist);
        }
        if reply.deleted.is_empty() && reply.records.is_empty() {
            snapshot.seq = reply.seq;
            return Ok(Caught::Unchanged);
        }
        for key in &reply.deleted {
            snapshot.records.remove(key);
        }
        for r in records(reply.records, fds)? {
            snapshot.records.insert(r.key.clone(), r);
        }
        snapshot.seq = reply.seq;
        Ok(Caught::Changed)
    }

    /// Offers `snapshot` to the first listing; false if it is done.
    fn publish(&self, snapshot: Snapshot) -> bool {
        let mut ahead = self.ahead.lock().unwrap_or_else(|e| e.into_inner());
        if matches!(*ahead, Ahead::Taken(_)) {
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

    /// Ends the reading ahead: the incarnation is initialized, and later
    /// listings ask the vault. What was read and never listed is dropped;
    /// what the first listing left unused stays for [`Vault::drop_spent`].
    pub fn forget_ahead(&self) {
        let unlisted = {
            let mut ahead = self.ahead.lock().unwrap_or_else(|e| e.into_inner());
            match std::mem::replace(&mut *ahead, Ahead::Taken(None)) {
                Ahead::Taken(spent) => {
                    *ahead = Ahead::Taken(spent);
                    None
                }
                other => Some(other),
            }
        };
        drop(unlisted); // outside the lock
    }

    /// Drops what the first listing left unused (the records a state was
    /// built from, a state built from records that changed since, or a
    /// copy the vault could not bring up to date):
    /// a standby's reader thread does it a while after the activation, off
    /// the path of the incarnation's first calls (closing ramfs's 1,001
    /// descriptors on the main thread right after its report had raised
    /// the reboot's memory part from about 130 to 400–600 µs).
    pub fn drop_spent(&self) {
        let spent = {
            let mut ahead = self.ahead.lock().unwrap_or_else(|e| e.into_inner());
            match &mut *ahead {
                Ahead::Taken(spent) => spent.take(),
                _ => None,
            }
        };
        drop(spent);
    }

    /// The incarnation's first listing, made from what its standby read
    /// ahead and what changed since (the state built from it if nothing
    /// did); None if it read nothing or the vault cannot say what changed.
    /// Every listing comes here first, and is noted.
    pub(super) fn caught_up(&self) -> Result<Option<FirstListing>, VaultError> {
        if let Some(flag) = self.lists {
            flag.store(1, Ordering::Relaxed); // see `Vault::noting_lists`
        }
        let taken = {
            let mut ahead = self.ahead.lock().unwrap_or_else(|e| e.into_inner());
            std::mem::replace(&mut *ahead, Ahead::Taken(None))
        };
        let Ahead::Ready(mut snapshot) = taken else {
            return Ok(None);
        };
        let caught = self.catch_up(&mut snapshot)?;
        let (listing, spent): (_, Option<Box<dyn Any + Send>>) = match (caught, snapshot.built) {
            (Caught::Relist, built) => (None, Some(Box::new((snapshot.records, built)))),
            (Caught::Unchanged, Some(built)) => (
                Some(FirstListing::Built(built)),
                Some(Box::new(snapshot.records)),
            ),
            (_, built) => (
                Some(FirstListing::Records(
                    snapshot.records.into_values().collect(),
                )),
                built.map(|b| Box::new(b) as Box<dyn Any + Send>),
            ),
        };
        self.drop_later(spent);
        Ok(listing)
    }

    /// Keeps `spent` until [`Vault::drop_spent`] (after the activation).
    fn drop_later(&self, spent: Option<Box<dyn Any + Send>>) {
        let mut ahead = self.ahead.lock().unwrap_or_else(|e| e.into_inner());
        if let Ahead::Taken(held) = &mut *ahead {
            *held = spent;
        }
    }
}

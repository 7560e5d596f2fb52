//! What netd owes the vault: connections accepted and not yet posted, and
//! ended ones whose records are still to be deleted. Both ride on one post
//! when [`FLUSH_AT`] of either are waiting, on any other post (a hand-over
//! or a park, which must follow the connection's first record), and on the
//! reaper's tick, so that the vault's thread in the supervisor wakes once
//! for many connections rather than once or twice for each; a connection
//! that ends before the post costs the vault nothing.
//!
//! Until its post, an accepted socket is safe in the keeper, which shares
//! netd's descriptor table (`keeper.rs`), and named in a slot of netd's
//! durable arena: its id, holder, descriptor number and inode. The next
//! incarnation takes every such socket from the dead one's keeper and
//! restores it as if the vault had kept it (`keep_descriptors` in
//! `main.rs`); the inode tells a socket from a later one that got the same
//! number after the first was closed. What the keeper cannot cover, and
//! the vault's own copy did: a faulty netd closing a descriptor it does
//! not own closes it in the shared table too, so an unposted connection is
//! lost to such a fault (an unposted one only, for at most the reaper's
//! tick).

use std::os::fd::{AsFd, AsRawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use kintsugi_runtime::abi::shm::Region;
use kintsugi_runtime::vault::VaultOp;

use crate::conn::{Entry, Holder, Kept};

/// Where the slots begin in netd's arena (after the counters of `main.rs`).
const SLOTS_AT: usize = 64;
/// Slots in the arena: twice [`FLUSH_AT`], so a flush always finds room.
pub const SLOTS: usize = 64;
/// Connections (accepted, or ended) that make a post.
pub const FLUSH_AT: usize = 32;
/// A slot's words: id (0: free, written last), client, worker, descriptor
/// number, inode.
const WORDS: usize = 5;
/// Arena bytes netd needs, its counters included.
pub const ARENA_BYTES: usize = SLOTS_AT + SLOTS * WORDS * 8;

/// One arena slot, as typed words.
struct Slot<'a> {
    arena: &'a Region,
    at: usize,
}

impl<'a> Slot<'a> {
    fn new(arena: &'a Region, index: usize) -> Self {
        Self {
            arena,
            at: SLOTS_AT + index * WORDS * 8,
        }
    }

    fn word(&self, n: usize) -> &AtomicU64 {
        self.arena.at::<AtomicU64>(self.at + n * 8)
    }

    fn id(&self) -> &AtomicU64 {
        self.word(0)
    }
    fn client(&self) -> &AtomicU64 {
        self.word(1)
    }
    fn worker(&self) -> &AtomicU64 {
        self.word(2)
    }
    fn fd(&self) -> &AtomicU64 {
        self.word(3)
    }
    fn inode(&self) -> &AtomicU64 {
        self.word(4)
    }
}

/// A connection a dead incarnation accepted and did not post.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Unposted {
    pub id: u64,
    pub client: u32,
    pub worker: u32,
    /// Its number in the shared descriptor table, and its socket's inode.
    pub fd: i32,
    pub inode: u64,
}

impl Unposted {
    /// Its record, as netd posts a connection it has just accepted.
    pub fn kept(&self) -> Kept {
        Kept {
            holder: Holder::Worker {
                client: self.client,
                worker: self.worker,
            },
            rb: 0,
            tb: 0,
        }
    }
}

/// The connections the arena names as accepted and not posted (by a dead
/// incarnation), and the slots cleared for this one. Nothing read here is
/// trusted further than a descriptor number to look at and an inode it
/// must have.
pub fn left_behind(arena: &Region) -> Vec<Unposted> {
    let left = named(arena).collect();
    for i in 0..SLOTS {
        Slot::new(arena, i).id().store(0, Ordering::SeqCst);
    }
    left
}

/// The connections the arena names, read in place and left named;
/// allocates nothing (netd's keeper reads them as the supervisor dies).
pub fn named(arena: &Region) -> impl Iterator<Item = Unposted> + '_ {
    (0..SLOTS).filter_map(|i| {
        let s = Slot::new(arena, i);
        let id = s.id().load(Ordering::SeqCst);
        if id == 0 {
            return None; // free: its other words are stale
        }
        Some(Unposted {
            id,
            client: u32::try_from(s.client().load(Ordering::SeqCst)).ok()?,
            worker: u32::try_from(s.worker().load(Ordering::SeqCst)).ok()?,
            fd: i32::try_from(s.fd().load(Ordering::SeqCst)).ok()?,
            inode: s.inode().load(Ordering::SeqCst),
        })
    })
}

/// An accepted connection not yet posted.
struct Fresh {
    id: u64,
    kept: Kept,
    /// Gone once the connection closed: nothing to post then.
    entry: Weak<Entry>,
    slot: usize,
}

/// One post's worth of what is owed: the operations, the sockets they
/// announce (in order), and the slots to clear once it is sent.
pub struct Due {
    pub ops: Vec<VaultOp>,
    pub sockets: Vec<Arc<Entry>>,
    slots: Vec<usize>,
}

/// What netd owes the vault (behind a mutex in `Netd`).
pub struct Owed {
    fresh: Vec<Fresh>,
    ended: Vec<u64>,
    free: Vec<usize>,
    /// Records owed before a post (1: each posted as it comes).
    flush_at: usize,
}

impl Default for Owed {
    fn default() -> Self {
        Self::posting_every(FLUSH_AT)
    }
}

impl Owed {
    /// Posts once `n` records (or deletions) are owed (`1..=SLOTS`).
    pub fn posting_every(n: usize) -> Self {
        Self {
            fresh: Vec::new(),
            ended: Vec::new(),
            free: (0..SLOTS).rev().collect(),
            flush_at: n,
        }
    }

    /// Owes the record of connection `id`, just accepted for a worker, and
    /// names it in the arena; false (nothing owed) if no slot is free, and
    /// the caller posts it itself.
    pub fn accepted(&mut self, arena: &Region, id: u64, kept: Kept, entry: &Arc<Entry>) -> bool {
        let Holder::Worker { client, worker } = kept.holder else {
            return false;
        };
        let (Some(slot), Some(inode)) = (
            self.free.last().copied(),
            crate::keeper::inode(entry.fd.as_fd()),
        ) else {
            return false;
        };
        self.free.pop();
        let s = Slot::new(arena, slot);
        s.client().store(u64::from(client), Ordering::SeqCst);
        s.worker().store(u64::from(worker), Ordering::SeqCst);
        s.fd().store(entry.fd.as_raw_fd() as u64, Ordering::SeqCst);
        s.inode().store(inode, Ordering::SeqCst);
        s.id().store(id, Ordering::SeqCst);
        self.fresh.push(Fresh {
            id,
            kept,
            entry: Arc::downgrade(entry),
            slot,
        });
        true
    }

    /// Owes the deletion of connection `id`'s record.
    pub fn ended(&mut self, id: u64) {
        self.ended.push(id);
    }

    /// Whether enough is owed for a post.
    pub fn full(&self) -> bool {
        self.fresh.len() >= self.flush_at || self.ended.len() >= self.flush_at
    }

    pub fn is_empty(&self) -> bool {
        self.fresh.is_empty() && self.ended.is_empty()
    }

    /// Everything owed, as one post: a connection accepted and ended since
    /// the last costs nothing.
    pub fn take(&mut self) -> Due {
        let mut ended = std::mem::take(&mut self.ended);
        let mut due = Due {
            ops: Vec::new(),
            sockets: Vec::new(),
            slots: Vec::new(),
        };
        for f in std::mem::take(&mut self.fresh) {
            due.slots.push(f.slot);
            let was_ended = ended.iter().position(|&id| id == f.id);
            match (f.entry.upgrade(), was_ended) {
                (Some(entry), None) => {
                    due.ops.push(crate::put(f.id, f.kept, true));
                    due.sockets.push(entry);
                }
                (_, Some(at)) => {
                    ended.swap_remove(at);
                }
                (None, None) => {} // closed without ending: nothing to keep
            }
        }
        due.ops.extend(ended.into_iter().map(|id| VaultOp::Delete {
            key: crate::conn_key(id),
        }));
        due
    }

    /// `due` is on the vault's socket: its slots are free again.
    pub fn posted(&mut self, arena: &Region, due: &Due) {
        for &slot in &due.slots {
            Slot::new(arena, slot).id().store(0, Ordering::SeqCst);
            self.free.push(slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conn::Io;
    use std::os::fd::OwnedFd;

    fn socket() -> Arc<Entry> {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        Entry::new(OwnedFd::from(a), Io::default(), 0)
    }

    fn worker(client: u32, worker: u32) -> Kept {
        Kept {
            holder: Holder::Worker { client, worker },
            rb: 0,
            tb: 0,
        }
    }

    fn keys(due: &Due) -> Vec<String> {
        due.ops
            .iter()
            .map(|op| match op {
                VaultOp::Put { key, fd: true, .. } => format!("put {key}"),
                VaultOp::Put { key, .. } => format!("put {key} without its socket"),
                VaultOp::Delete { key } => format!("delete {key}"),
            })
            .collect()
    }

    #[test]
    fn accepted_connections_are_named_in_the_arena_until_posted() {
        let arena = Region::create("netd-owed-test", ARENA_BYTES).unwrap();
        let mut owed = Owed::default();
        let (a, b) = (socket(), socket());
        assert!(owed.accepted(&arena, 7, worker(3, 1), &a));
        assert!(owed.accepted(&arena, 8, worker(3, 2), &b));
        // A dead incarnation's slots name both, with their sockets' inodes.
        let left = left_behind(&arena);
        let ino = |e: &Arc<Entry>| crate::keeper::inode(e.fd.as_fd()).unwrap();
        assert_eq!(
            left,
            [
                Unposted {
                    id: 7,
                    client: 3,
                    worker: 1,
                    fd: a.fd.as_raw_fd(),
                    inode: ino(&a)
                },
                Unposted {
                    id: 8,
                    client: 3,
                    worker: 2,
                    fd: b.fd.as_raw_fd(),
                    inode: ino(&b)
                }
            ]
        );
        assert!(left_behind(&arena).is_empty(), "read once, then cleared");

        // This incarnation's post carries both, with their sockets.
        assert!(owed.accepted(&arena, 9, worker(3, 1), &socket()));
        let due = owed.take();
        assert_eq!(
            keys(&due),
            [
                format!("put {}", crate::conn_key(7)),
                format!("put {}", crate::conn_key(8)),
            ],
            "9's socket closed before the post: nothing to keep"
        );
        assert_eq!(due.sockets.len(), 2);
        owed.posted(&arena, &due);
        assert!(owed.is_empty());
        assert!(left_behind(&arena).is_empty(), "posted: no slot names them");
        assert_eq!(owed.free.len(), SLOTS, "every slot free again");
    }

    #[test]
    fn a_connection_ended_before_its_post_costs_the_vault_nothing() {
        let arena = Region::create("netd-owed-test", ARENA_BYTES).unwrap();
        let mut owed = Owed::default();
        let a = socket();
        assert!(owed.accepted(&arena, 1, worker(2, 0), &a));
        owed.ended(1);
        owed.ended(40); // posted in an earlier message
        let due = owed.take();
        assert_eq!(keys(&due), [format!("delete {}", crate::conn_key(40))]);
        assert!(due.sockets.is_empty());
        owed.posted(&arena, &due);
        assert!(owed.is_empty() && !owed.full());
    }

    #[test]
    fn a_post_is_due_at_the_flush_mark_and_slots_never_run_out_before() {
        let arena = Region::create("netd-owed-test", ARENA_BYTES).unwrap();
        let mut owed = Owed::default();
        let sockets: Vec<_> = (0..SLOTS).map(|_| socket()).collect();
        for (i, s) in sockets.iter().enumerate() {
            assert_eq!(owed.full(), i >= FLUSH_AT);
            assert!(owed.accepted(&arena, i as u64 + 1, worker(1, 0), s));
        }
        // Not posted in time: the next is refused a slot, for the caller
        // to post at once.
        assert!(!owed.accepted(&arena, 99, worker(1, 0), &socket()));
        let due = owed.take();
        assert_eq!(due.ops.len(), SLOTS);
        owed.posted(&arena, &due);
        assert!(owed.accepted(&arena, 100, worker(1, 0), &socket()));
    }

    #[test]
    fn a_parked_connection_is_never_owed_a_first_record() {
        let arena = Region::create("netd-owed-test", ARENA_BYTES).unwrap();
        let mut owed = Owed::default();
        let parked = Kept {
            holder: Holder::Parked {
                client: 1,
                idle_ms: 10,
            },
            rb: 0,
            tb: 0,
        };
        assert!(!owed.accepted(&arena, 5, parked, &socket()));
        assert!(owed.is_empty());
    }
}

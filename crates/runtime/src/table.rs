//! The client stub's descriptor tables, on the path of every invocation.
//!
//! C3 (004_3ccfb766519ab98a.txt §III) tracks each descriptor's state in the
//! client stub, so every call through a descriptor looks it up before the
//! invocation (where does it live now: which server id, in which epoch) and
//! records the call's effect after it. That bookkeeping is the tracking
//! overhead, and it must stay small beside a null invocation of about
//! 120 ns (issue 14: ≤ 10 %).
//!
//! A [`DescTable`] is a slab of slots indexed by the virtual id, in buckets
//! that never move (bucket `k` holds `32 << k` slots, allocated on first
//! use), so a lookup is arithmetic, not a hash. Each slot publishes where its
//! descriptor lives through a seqlock ([`DescTable::locate`] reads it without
//! any atomic read-modify-write) and keeps the descriptor's record behind a
//! lock of its own, so threads using different descriptors never meet.
//! Freed slots are reused, and a virtual id carries the slot's generation so
//! that an id used after its descriptor was removed is refused, not taken
//! for the slot's next descriptor (until the generation wraps, after 1,024
//! reuses of one slot).

use std::sync::atomic::{fence, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};

use crate::stub::Tracked;

/// Slots per table: virtual ids have this many bits of slot number.
const SLOT_BITS: u32 = 22;
/// Generations per slot before an id repeats.
const GENERATIONS: u32 = 1 << (32 - SLOT_BITS);
/// Bucket `k` holds `FIRST_BUCKET << k` slots.
const FIRST_BUCKET: usize = 32;
/// Enough buckets for every slot number below `1 << SLOT_BITS`.
const BUCKETS: usize = 18;

/// A virtual id, split: the slot it names and the slot's generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct VirtualId {
    /// Index of the slot, from 0.
    slot: usize,
    generation: u32,
}

impl VirtualId {
    /// The id a client holds: never 0 (slot + 1 in the low bits).
    fn encode(self) -> u32 {
        (self.generation << SLOT_BITS) | (self.slot as u32 + 1)
    }

    fn decode(id: u32) -> Option<Self> {
        let slot = (id & ((1 << SLOT_BITS) - 1)).checked_sub(1)?;
        Some(Self {
            slot: slot as usize,
            generation: id >> SLOT_BITS,
        })
    }
}

/// Which bucket holds slot `slot`, and where in it.
fn bucket_of(slot: usize) -> (usize, usize) {
    let shifted = slot + FIRST_BUCKET;
    let k = (usize::BITS - 1 - shifted.leading_zeros()) as usize
        - FIRST_BUCKET.trailing_zeros() as usize;
    (k, shifted - (FIRST_BUCKET << k))
}

/// One descriptor's place in the table.
struct Slot<R> {
    /// Seqlock over the published fields below: odd while a writer (who
    /// holds `entry`) changes them.
    seq: AtomicU32,
    /// The virtual id of the descriptor in the slot, 0 while it is free.
    id: AtomicU32,
    server_id: AtomicU64,
    epoch: AtomicU64,
    /// The descriptor itself; its lock orders the writers.
    entry: Mutex<Option<Tracked<R>>>,
}

impl<R> Default for Slot<R> {
    fn default() -> Self {
        Self {
            seq: AtomicU32::new(0),
            id: AtomicU32::new(0),
            server_id: AtomicU64::new(0),
            epoch: AtomicU64::new(0),
            entry: Mutex::new(None),
        }
    }
}

/// Where a descriptor lives now, as [`DescTable::locate`] reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Location {
    /// The id the server incarnation of `epoch` knows it by.
    pub server_id: u64,
    pub epoch: u64,
}

/// A slot's descriptor, locked.
type Entry<'a, R> = MutexGuard<'a, Option<Tracked<R>>>;

impl<R> Slot<R> {
    fn lock(&self) -> Entry<'_, R> {
        // A panic in a caller's update closure leaves the record as the
        // closure left it; the table stays usable.
        self.entry.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Publishes the slot's id and location; the caller holds `entry`.
    fn publish(&self, id: u32, at: Location) {
        let seq = self.seq.load(Ordering::Relaxed);
        self.seq.store(seq.wrapping_add(1), Ordering::Relaxed);
        fence(Ordering::Release);
        self.id.store(id, Ordering::Relaxed);
        self.server_id.store(at.server_id, Ordering::Relaxed);
        self.epoch.store(at.epoch, Ordering::Relaxed);
        self.seq.store(seq.wrapping_add(2), Ordering::Release);
    }

    /// The published id and location, read whole.
    fn read(&self) -> (u32, Location) {
        let mut spins = 0u32;
        loop {
            let seq = self.seq.load(Ordering::Acquire);
            if seq & 1 == 0 {
                let id = self.id.load(Ordering::Relaxed);
                let at = Location {
                    server_id: self.server_id.load(Ordering::Relaxed),
                    epoch: self.epoch.load(Ordering::Relaxed),
                };
                fence(Ordering::Acquire);
                if self.seq.load(Ordering::Relaxed) == seq {
                    return (id, at);
                }
            }
            // A writer is between its stores; it may have been preempted.
            spins += 1;
            if spins.is_multiple_of(64) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }
}

/// Slot allocation: slots never used yet start at `next`; freed ones wait
/// in `free` with the generation their next descriptor gets.
#[derive(Default)]
struct Allocator {
    next: usize,
    free: Vec<VirtualId>,
}

/// A client stub's table of descriptors, keyed by stable virtual ids that
/// survive server reboots.
pub struct DescTable<R> {
    buckets: [OnceLock<Box<[Slot<R>]>>; BUCKETS],
    alloc: Mutex<Allocator>,
    len: AtomicUsize,
}

impl<R> Default for DescTable<R> {
    fn default() -> Self {
        Self {
            buckets: std::array::from_fn(|_| OnceLock::new()),
            alloc: Mutex::new(Allocator::default()),
            len: AtomicUsize::new(0),
        }
    }
}

impl<R: Clone> DescTable<R> {
    /// The slot an id names, if that slot was ever allocated.
    fn slot(&self, slot: usize) -> Option<&Slot<R>> {
        let (k, at) = bucket_of(slot);
        self.buckets.get(k)?.get().map(|b| &b[at])
    }

    /// The slot holding descriptor `id` now, locked.
    fn entry(&self, id: u32) -> Option<(&Slot<R>, Entry<'_, R>)> {
        let slot = self.slot(VirtualId::decode(id)?.slot)?;
        let guard = slot.lock();
        (guard.is_some() && slot.id.load(Ordering::Relaxed) == id).then_some((slot, guard))
    }

    /// Starts tracking a new descriptor and returns its virtual id.
    ///
    /// # Panics
    ///
    /// When the table already holds `1 << 22` descriptors.
    pub fn insert(&self, server_id: u64, epoch: u64, record: R) -> u32 {
        let vid = {
            let mut alloc = self.alloc.lock().unwrap_or_else(|e| e.into_inner());
            alloc.free.pop().unwrap_or_else(|| {
                let slot = alloc.next;
                assert!(slot + 1 < 1 << SLOT_BITS, "descriptor table full");
                alloc.next += 1;
                VirtualId {
                    slot,
                    generation: 0,
                }
            })
        };
        let (k, _) = bucket_of(vid.slot);
        self.buckets[k].get_or_init(|| (0..FIRST_BUCKET << k).map(|_| Slot::default()).collect());
        let slot = self.slot(vid.slot).expect("just allocated");
        let id = vid.encode();
        let mut entry = slot.lock();
        *entry = Some(Tracked {
            server_id,
            epoch,
            record,
        });
        slot.publish(id, Location { server_id, epoch });
        drop(entry);
        self.len.fetch_add(1, Ordering::Relaxed);
        id
    }

    /// Where descriptor `id` lives now, without a lock: the fast path of
    /// every call.
    pub fn locate(&self, id: u32) -> Option<Location> {
        let slot = self.slot(VirtualId::decode(id)?.slot)?;
        let (now, at) = slot.read();
        (now == id).then_some(at)
    }

    /// Whether descriptor `id` is tracked, built in `epoch`.
    pub fn holds(&self, id: u32, epoch: u64) -> bool {
        self.locate(id).is_some_and(|at| at.epoch == epoch)
    }

    pub fn get(&self, id: u32) -> Option<Tracked<R>> {
        self.entry(id).and_then(|(_, e)| e.clone())
    }

    /// Applies `f` to a descriptor; false if it is not tracked.
    pub fn update(&self, id: u32, f: impl FnOnce(&mut Tracked<R>)) -> bool {
        let Some((slot, mut entry)) = self.entry(id) else {
            return false;
        };
        let Some(t) = entry.as_mut() else {
            return false;
        };
        let before = Location {
            server_id: t.server_id,
            epoch: t.epoch,
        };
        f(t);
        let after = Location {
            server_id: t.server_id,
            epoch: t.epoch,
        };
        if after != before {
            slot.publish(id, after);
        }
        true
    }

    pub fn remove(&self, id: u32) -> Option<Tracked<R>> {
        let (slot, mut entry) = self.entry(id)?;
        let gone = entry.take();
        slot.publish(
            0,
            Location {
                server_id: 0,
                epoch: 0,
            },
        );
        drop(entry);
        let mut vid = VirtualId::decode(id).expect("decoded by entry");
        vid.generation = (vid.generation + 1) % GENERATIONS;
        self.alloc
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .free
            .push(vid);
        self.len.fetch_sub(1, Ordering::Relaxed);
        gone
    }

    pub fn len(&self) -> usize {
        self.len.load(Ordering::Relaxed)
    }

    /// The descriptors not yet rebuilt in server epoch `epoch`.
    pub fn stale(&self, epoch: u64) -> Vec<u32> {
        let used = self.alloc.lock().unwrap_or_else(|e| e.into_inner()).next;
        (0..used)
            .filter_map(|s| self.slot(s))
            .map(Slot::read)
            .filter(|&(id, at)| id != 0 && at.epoch != epoch)
            .map(|(id, _)| id)
            .collect()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn virtual_ids_are_stable_and_distinct() {
        let t = DescTable::<String>::default();
        let a = t.insert(10, 1, "a".into());
        let b = t.insert(10, 1, "b".into());
        assert_ne!(a, b);
        assert!(t.update(a, |e| {
            e.server_id = 99;
            e.epoch = 2
        }));
        let e = t.get(a).unwrap();
        assert_eq!((e.server_id, e.epoch, e.record.as_str()), (99, 2, "a"));
        assert_eq!(
            t.locate(a),
            Some(Location {
                server_id: 99,
                epoch: 2
            })
        );
        assert_eq!(t.remove(b).unwrap().record, "b");
        assert!(t.get(b).is_none());
        assert!(t.locate(b).is_none());
        assert!(!t.update(b, |_| {}));
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn buckets_cover_every_slot_once() {
        let mut expected = (0, 0);
        for slot in 0..(FIRST_BUCKET << 6) {
            assert_eq!(bucket_of(slot), expected, "slot {slot}");
            expected.1 += 1;
            if expected.1 == FIRST_BUCKET << expected.0 {
                expected = (expected.0 + 1, 0);
            }
        }
        let (k, at) = bucket_of((1 << SLOT_BITS) - 2);
        assert!(k < BUCKETS && at < FIRST_BUCKET << k);
    }

    #[test]
    fn a_removed_id_is_refused_after_its_slot_is_reused() {
        let t = DescTable::<u32>::default();
        let first = t.insert(1, 1, 1);
        assert_eq!(first, 1, "ids start at 1");
        t.remove(first).unwrap();
        let second = t.insert(2, 1, 2);
        assert_ne!(second, first, "the reused slot has a new generation");
        assert!(t.get(first).is_none() && t.locate(first).is_none());
        assert_eq!(t.get(second).unwrap().record, 2);
        assert!(t.get(0).is_none() && t.get(999).is_none() && t.get(u32::MAX).is_none());
    }

    #[test]
    fn stale_lists_the_descriptors_of_other_epochs() {
        let t = DescTable::<u32>::default();
        let ids: Vec<u32> = (0..100).map(|i| t.insert(i, 1 + i % 2, i as u32)).collect();
        t.remove(ids[1]);
        let mut stale = t.stale(2);
        stale.sort();
        let expected: Vec<u32> = ids.iter().copied().step_by(2).collect();
        assert_eq!(stale, expected);
        assert_eq!(t.len(), 99);
    }

    /// Writers move descriptors between locations whose server id and epoch
    /// are equal; readers on other threads must never see them differ.
    #[test]
    fn a_location_is_read_whole_while_others_write() {
        let t = std::sync::Arc::new(DescTable::<u64>::default());
        let ids: Vec<u32> = (0..64).map(|i| t.insert(i, i, i)).collect();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let writer = {
            let (t, ids, stop) = (t.clone(), ids.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut k = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    k += 1;
                    for &id in &ids {
                        t.update(id, |e| {
                            e.server_id = k;
                            e.epoch = k;
                        });
                    }
                }
            })
        };
        let deadline = std::time::Instant::now() + std::time::Duration::from_millis(300);
        let mut reads = 0u64;
        while std::time::Instant::now() < deadline {
            for &id in &ids {
                let at = t.locate(id).expect("tracked");
                assert_eq!(at.server_id, at.epoch, "torn read after {reads} reads");
                reads += 1;
            }
        }
        stop.store(true, Ordering::Relaxed);
        writer.join().unwrap();
        assert!(reads > 1000, "only {reads} reads");
    }
}

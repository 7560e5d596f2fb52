//! Named descriptor slots in a server's durable arena, shared by the `lock`
//! and `evt` servers.
//!
//! A server whose descriptors are global (one id for every client, kept
//! across the server's reboots) and whose state must outlive its crashes
//! keeps each descriptor in a fixed-size slot of its arena (`arena_kib`,
//! the same memory in every incarnation):
//!
//! ```text
//! slot i (32 bytes):  ident: u64 | name: u64 | payload: 16 bytes, the server's own atomics
//! ident = LIVE | generation << 16 | i        id = ident without LIVE
//! ```
//!
//! The slot is found from the id alone, so the server stub's rebuild
//! (`reuse: Some(id)`) maps straight back to it, and a slot reused for
//! another name gets a new generation, hence a new id. A slot is published
//! by storing its ident last, so a crash half-way through a creation leaves
//! it free; freeing clears `LIVE` and keeps the generation.
//!
//! [`Deaths`] counts, per client component, the deaths this incarnation has
//! heard of: a call that blocks on behalf of a client notes the count when
//! it starts and gives up when it changes, so a server never blocks for a
//! dead client.

#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::ops::Deref;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use kintsugi_runtime::abi::shm::Region;
use kintsugi_runtime::Runtime;
use thiserror::Error;

/// Bytes per slot.
pub const SLOT_BYTES: usize = 32;
/// Bytes of payload per slot, at offsets 0..16 of [`Slot::u32`] / [`Slot::u64`].
pub const PAYLOAD_BYTES: usize = 16;
const PAYLOAD: usize = 16;
const LIVE: u64 = 1 << 63;
const INDEX_BITS: u32 = 16;
const INDEX_MASK: u64 = (1 << INDEX_BITS) - 1;
const GENERATION_MASK: u64 = (LIVE - 1) >> INDEX_BITS;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum SlotError {
    #[error("all {0} slots are in use")]
    Full(usize),
    #[error("descriptor {id:#x} cannot be rebuilt: {why}")]
    Conflict { id: u64, why: &'static str },
}

/// The component's arena, checked once at initialization.
pub struct Arena(Arc<Runtime>);

impl Arena {
    /// The arena of `rt`'s component; an error if the system description
    /// gives it none (`arena_kib`).
    pub fn of(rt: &Arc<Runtime>) -> anyhow::Result<Self> {
        anyhow::ensure!(
            rt.arena().is_some(),
            "component `{}` needs a durable arena: set `arena_kib` in the system description",
            rt.name()
        );
        Ok(Self(rt.clone()))
    }
}

impl Deref for Arena {
    type Target = Region;

    fn deref(&self) -> &Region {
        self.0.arena().expect("checked by Arena::of")
    }
}

/// The descriptor slots in `arena[base..base + len]`.
pub struct Slots<A> {
    arena: A,
    base: usize,
    count: usize,
    /// Creations are serialized within an incarnation; lookups take no lock.
    create: Mutex<()>,
}

/// One live slot: its id and its payload words.
pub struct Slot<'a> {
    arena: &'a Region,
    at: usize,
    pub id: u64,
}

impl Slot<'_> {
    /// The payload's `u32` at byte `offset` (0, 4, 8 or 12).
    pub fn u32(&self, offset: usize) -> &AtomicU32 {
        assert!(offset + 4 <= PAYLOAD_BYTES, "payload offset out of range");
        self.arena.at(self.at + PAYLOAD + offset)
    }

    /// The payload's `u64` at byte `offset` (0 or 8).
    pub fn u64(&self, offset: usize) -> &AtomicU64 {
        assert!(offset + 8 <= PAYLOAD_BYTES, "payload offset out of range");
        self.arena.at(self.at + PAYLOAD + offset)
    }
}

impl<A: Deref<Target = Region>> Slots<A> {
    pub fn new(arena: A, base: usize, len: usize) -> Self {
        assert!(
            base.is_multiple_of(SLOT_BYTES) && base + len <= arena.len(),
            "slots outside the arena"
        );
        let count = (len / SLOT_BYTES).min(1 << INDEX_BITS);
        Self {
            arena,
            base,
            count,
            create: Mutex::new(()),
        }
    }

    pub fn capacity(&self) -> usize {
        self.count
    }

    /// The whole arena, for what the server keeps beside its slots.
    pub fn arena(&self) -> &Region {
        &self.arena
    }

    fn ident(&self, i: usize) -> &AtomicU64 {
        self.arena.at(self.base + i * SLOT_BYTES)
    }

    fn name(&self, i: usize) -> &AtomicU64 {
        self.arena.at(self.base + i * SLOT_BYTES + 8)
    }

    fn slot(&self, i: usize, id: u64) -> Slot<'_> {
        Slot {
            arena: &self.arena,
            at: self.base + i * SLOT_BYTES,
            id,
        }
    }

    /// The live slot of descriptor `id`.
    pub fn get(&self, id: u64) -> Option<Slot<'_>> {
        let i = (id & INDEX_MASK) as usize;
        (id & LIVE == 0 && i < self.count && self.ident(i).load(Ordering::Acquire) == id | LIVE)
            .then(|| self.slot(i, id))
    }

    /// Every live slot.
    pub fn live(&self) -> impl Iterator<Item = Slot<'_>> {
        (0..self.count).filter_map(|i| {
            let ident = self.ident(i).load(Ordering::Acquire);
            (ident & LIVE != 0).then(|| self.slot(i, ident & !LIVE))
        })
    }

    /// The live descriptor named `name`.
    fn find(&self, name: u64) -> Option<u64> {
        self.live()
            .find(|s| {
                self.name((s.id & INDEX_MASK) as usize)
                    .load(Ordering::Relaxed)
                    == name
            })
            .map(|s| s.id)
    }

    /// The descriptor named `name`, created if absent; with `reuse`, the
    /// server stub rebuilds descriptor `reuse` after a reboot, and it must
    /// come back with exactly that id. `reset` gives a new slot's payload
    /// its initial values before the slot is published.
    pub fn create(
        &self,
        name: u64,
        reuse: Option<u64>,
        reset: impl FnOnce(&Slot<'_>),
    ) -> Result<u64, SlotError> {
        let _one_at_a_time = self.create.lock().unwrap_or_else(|e| e.into_inner());
        let existing = self.find(name);
        let (i, id) = match (reuse, existing) {
            (None, Some(id)) => return Ok(id),
            (Some(id), Some(found)) if found == id => return Ok(id),
            (Some(id), Some(_)) => {
                return Err(SlotError::Conflict {
                    id,
                    why: "its name now names another descriptor",
                })
            }
            (Some(id), None) => {
                let i = (id & INDEX_MASK) as usize;
                if id & LIVE != 0 || i >= self.count {
                    return Err(SlotError::Conflict {
                        id,
                        why: "no such slot",
                    });
                }
                let current = self.ident(i).load(Ordering::Acquire);
                if current & LIVE != 0 || current >> INDEX_BITS > id >> INDEX_BITS {
                    return Err(SlotError::Conflict {
                        id,
                        why: "its slot now holds another descriptor",
                    });
                }
                (i, id)
            }
            (None, None) => {
                let i = (0..self.count)
                    .find(|&i| self.ident(i).load(Ordering::Acquire) & LIVE == 0)
                    .ok_or(SlotError::Full(self.count))?;
                let previous = self.ident(i).load(Ordering::Acquire) >> INDEX_BITS;
                let generation = ((previous + 1) & GENERATION_MASK).max(1);
                (i, generation << INDEX_BITS | i as u64)
            }
        };
        self.name(i).store(name, Ordering::Relaxed);
        reset(&self.slot(i, id));
        self.ident(i).store(id | LIVE, Ordering::Release);
        Ok(id)
    }

    /// Frees descriptor `id`; false if it was not live.
    pub fn remove(&self, id: u64) -> bool {
        let i = (id & INDEX_MASK) as usize;
        id & LIVE == 0
            && i < self.count
            && self
                .ident(i)
                .compare_exchange(id | LIVE, id, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
    }
}

/// How many deaths of each client component this incarnation has heard of.
#[derive(Default)]
pub struct Deaths(RwLock<HashMap<u32, u64>>);

impl Deaths {
    pub fn of(&self, client: u32) -> u64 {
        let map = self.0.read().unwrap_or_else(|e| e.into_inner());
        map.get(&client).copied().unwrap_or(0)
    }

    /// Client `client` died: calls it started before now must give up.
    /// Bump the words those calls sleep on afterwards, so none misses it.
    pub fn record(&self, client: u32) {
        let mut map = self.0.write().unwrap_or_else(|e| e.into_inner());
        *map.entry(client).or_default() += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slots() -> Slots<Arc<Region>> {
        let region = Arc::new(Region::create("slots-test", 4096).unwrap());
        Slots::new(region, 0, 4 * SLOT_BYTES)
    }

    #[test]
    fn a_name_keeps_its_id_and_a_reused_slot_gets_a_new_one() {
        let s = slots();
        let a = s.create(7, None, |_| {}).unwrap();
        assert_eq!(s.create(7, None, |_| {}).unwrap(), a, "create-if-absent");
        let b = s.create(8, None, |_| {}).unwrap();
        assert_ne!(a, b);
        assert!(s.get(a).is_some());
        assert!(s.remove(a));
        assert!(!s.remove(a), "freed once");
        assert!(s.get(a).is_none());
        let c = s
            .create(9, None, |slot| slot.u64(0).store(5, Ordering::Relaxed))
            .unwrap();
        assert_eq!(c & INDEX_MASK, a & INDEX_MASK, "the freed slot is reused");
        assert_ne!(c, a, "with a new generation");
        assert_eq!(s.get(c).unwrap().u64(0).load(Ordering::Relaxed), 5);
        assert_eq!(s.live().count(), 2);
    }

    #[test]
    fn rebuilding_returns_the_same_id_or_refuses_a_conflict() {
        let s = slots();
        let a = s.create(7, None, |_| {}).unwrap();
        assert_eq!(
            s.create(7, Some(a), |_| {}).unwrap(),
            a,
            "still live: same id"
        );
        assert!(s.remove(a));
        assert_eq!(
            s.create(7, Some(a), |_| {}).unwrap(),
            a,
            "freed, not reused: rebuilt"
        );
        assert!(s.remove(a));
        let b = s.create(8, None, |_| {}).unwrap();
        assert!(matches!(
            s.create(7, Some(a), |_| {}),
            Err(SlotError::Conflict { .. })
        ));
        assert!(matches!(
            s.create(9, Some(b), |_| {}),
            Err(SlotError::Conflict { .. })
        ));
        for n in 10..13 {
            s.create(n, None, |_| {}).unwrap();
        }
        assert_eq!(s.create(99, None, |_| {}), Err(SlotError::Full(4)));
    }

    #[test]
    fn deaths_count_per_client() {
        let d = Deaths::default();
        assert_eq!(d.of(3), 0);
        d.record(3);
        d.record(3);
        assert_eq!((d.of(3), d.of(4)), (2, 0));
    }
}

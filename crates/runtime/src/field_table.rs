//! A client stub's per-client fields of global descriptors, read before
//! every call without a lock.
//!
//! C3 (004_3ccfb766519ab98a.txt §III) has the client stub track what a
//! descriptor's calls change, and SuperGlue's IDL names such tracked
//! fields: evt's `seen`, the last event count a client saw, passed to every
//! `wait` and updated from its reply. A global descriptor's id is the
//! server's, so the table is keyed by a hash, not indexed like
//! [`crate::table::DescTable`]; and since its record is only tracked
//! fields, all `u64` ([`Fields`]), each slot keeps them as atomic words
//! under a seqlock: [`FieldTable::get`] reads them with no atomic
//! read-modify-write, and [`FieldTable::update`] of a tracked id makes one
//! (the compare-and-swap that takes the slot). The table before, behind
//! one mutex, made four per call (issue 14; `kintsugi bench tables`
//! times both against a null invocation of the same run).
//!
//! Slots never move: an id lives in one of the [`WINDOW`] slots from its
//! hash, before any never-used slot; a removed entry's slot is marked
//! gone (probes go past it) and reused by a later insert. Ids that find no
//! slot in their window go to an overflow map behind the writers' lock,
//! which readers take only while the overflow holds something. Inserts and
//! removals take that lock; updates of a tracked id do not.

use std::hash::BuildHasher;
use std::sync::atomic::{fence, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

/// A record of `N` tracked fields, all `u64` (what the IDL generates for a
/// global descriptor's fields).
pub trait Fields<const N: usize>: Default {
    fn to_words(&self) -> [u64; N];
    fn from_words(words: [u64; N]) -> Self;
}

/// Slots per table (a power of two).
const SLOTS: usize = 512;
/// Slots an id may take, from the one its hash names.
const WINDOW: usize = 8;

/// A slot's state word values.
const FREE: u64 = 0;
const LIVE: u64 = 1;
const GONE: u64 = 2;

struct Slot<const N: usize> {
    /// Seqlock over the words below: odd while a writer changes them.
    seq: AtomicU32,
    /// [`FREE`] (never used: probes stop here), [`LIVE`] or [`GONE`].
    state: AtomicU64,
    id: AtomicU64,
    words: [AtomicU64; N],
}

impl<const N: usize> Default for Slot<N> {
    fn default() -> Self {
        Self {
            seq: AtomicU32::new(0),
            state: AtomicU64::new(FREE),
            id: AtomicU64::new(0),
            words: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

/// A slot's contents, read whole.
struct Snapshot<const N: usize> {
    state: u64,
    id: u64,
    words: [u64; N],
}

/// A slot taken for writing (its seqlock odd); released, with what was
/// written published, when dropped (also if the caller's closure panics).
struct Writing<'a, const N: usize> {
    slot: &'a Slot<N>,
    seq: u32,
}

impl<const N: usize> Drop for Writing<'_, N> {
    fn drop(&mut self) {
        self.slot
            .seq
            .store(self.seq.wrapping_add(2), Ordering::Release);
    }
}

impl<const N: usize> Slot<N> {
    /// The slot's contents, consistent with one another.
    fn read(&self) -> Snapshot<N> {
        let mut tries = 0u32;
        loop {
            let seq = self.seq.load(Ordering::Acquire);
            if !seq.is_multiple_of(2) {
                back_off(&mut tries);
                continue;
            }
            let state = self.state.load(Ordering::Relaxed);
            let id = self.id.load(Ordering::Relaxed);
            let words = std::array::from_fn(|i| self.words[i].load(Ordering::Relaxed));
            fence(Ordering::Acquire);
            if self.seq.load(Ordering::Relaxed) == seq {
                return Snapshot { state, id, words };
            }
        }
    }

    /// Takes the slot for writing.
    fn write(&self) -> Writing<'_, N> {
        let mut tries = 0u32;
        loop {
            let seq = self.seq.load(Ordering::Relaxed);
            if seq.is_multiple_of(2)
                && self
                    .seq
                    .compare_exchange_weak(
                        seq,
                        seq.wrapping_add(1),
                        Ordering::Acquire,
                        Ordering::Relaxed,
                    )
                    .is_ok()
            {
                fence(Ordering::Release);
                return Writing { slot: self, seq };
            }
            back_off(&mut tries);
        }
    }

    fn store_words(&self, words: [u64; N]) {
        for (w, v) in self.words.iter().zip(words) {
            w.store(v, Ordering::Relaxed);
        }
    }
}

/// Waits a little for a slot's writer: spins, then yields the CPU (the
/// writer may have been preempted holding the slot, on a CPU this thread
/// would otherwise keep from it).
fn back_off(tries: &mut u32) {
    *tries += 1;
    match *tries < 64 {
        true => std::hint::spin_loop(),
        false => std::thread::yield_now(),
    }
}

/// Where a probe for an id ended.
enum Probe<const N: usize> {
    /// Slot `at` holds it, with these words (read with its id, whole).
    Found { at: usize, words: [u64; N] },
    /// Not in its window; the first slot an insert may take, if any.
    Absent(Option<usize>),
}

/// A tracked id's fields as read before a call, and the slot they were
/// in: the update after the call starts there instead of probing again.
#[derive(Debug, Clone)]
pub struct Looked<R> {
    pub fields: R,
    at: Option<usize>,
}

/// Per-client fields of global descriptors, keyed by the descriptors'
/// global ids (a descriptor another component created starts at defaults).
pub struct FieldTable<R, const N: usize> {
    slots: Box<[Slot<N>]>,
    /// Seeded per table (hashbrown's foldhash): a server cannot choose ids
    /// that crowd one window without knowing the seed.
    hasher: hashbrown::DefaultHashBuilder,
    /// Ids whose window was full; also the writers' lock.
    overflow: Mutex<hashbrown::HashMap<u64, R>>,
    /// Entries in `overflow`: readers skip its lock while 0.
    overflowed: AtomicUsize,
    len: AtomicUsize,
}

impl<R: Fields<N>, const N: usize> Default for FieldTable<R, N> {
    fn default() -> Self {
        Self {
            slots: (0..SLOTS).map(|_| Slot::default()).collect(),
            hasher: hashbrown::DefaultHashBuilder::default(),
            overflow: Mutex::new(hashbrown::HashMap::new()),
            overflowed: AtomicUsize::new(0),
            len: AtomicUsize::new(0),
        }
    }
}

impl<R: Fields<N> + Clone, const N: usize> FieldTable<R, N> {
    /// The fields of `id` (defaults if untracked).
    pub fn get(&self, id: u64) -> R {
        self.look(id).fields
    }

    /// The fields of `id` and where they are, for
    /// [`FieldTable::update_looked`] after the call.
    pub fn look(&self, id: u64) -> Looked<R> {
        let fields = match self.probe(id) {
            Probe::Found { at, words } => {
                return Looked {
                    fields: R::from_words(words),
                    at: Some(at),
                }
            }
            Probe::Absent(_) if self.overflowed.load(Ordering::Acquire) == 0 => R::default(),
            Probe::Absent(_) => self.writers().get(&id).cloned().unwrap_or_default(),
        };
        Looked { fields, at: None }
    }

    /// [`FieldTable::update`], starting where `looked` found `id`'s fields.
    pub fn update_looked(&self, looked: &Looked<R>, id: u64, f: impl FnOnce(&mut R)) {
        match looked.at {
            Some(at) => {
                if let Err(f) = self.update_slot(at, id, f) {
                    self.update_locked(id, f)
                }
            }
            None => self.update(id, f),
        }
    }

    /// Changes the fields of `id` with `f` (from defaults if untracked,
    /// and tracked from then on).
    pub fn update(&self, id: u64, f: impl FnOnce(&mut R)) {
        if let Probe::Found { at, .. } = self.probe(id) {
            match self.update_slot(at, id, f) {
                Ok(()) => return,
                // Removed or moved meanwhile: look again, in turn with
                // the inserts and removals.
                Err(f) => return self.update_locked(id, f),
            }
        }
        self.update_locked(id, f)
    }

    /// Forgets `id`.
    pub fn remove(&self, id: u64) {
        let mut overflow = self.writers();
        match self.probe(id) {
            Probe::Found { at, .. } => {
                let slot = &self.slots[at];
                let _writing = slot.write();
                slot.state.store(GONE, Ordering::Relaxed);
                self.len.fetch_sub(1, Ordering::Relaxed);
            }
            Probe::Absent(_) => {
                if overflow.remove(&id).is_some() {
                    self.overflowed.fetch_sub(1, Ordering::Release);
                    self.len.fetch_sub(1, Ordering::Relaxed);
                }
            }
        }
    }

    /// Ids tracked.
    pub fn len(&self) -> usize {
        self.len.load(Ordering::Relaxed)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn writers(&self) -> MutexGuard<'_, hashbrown::HashMap<u64, R>> {
        self.overflow.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn probe(&self, id: u64) -> Probe<N> {
        let home = self.hasher.hash_one(id) as usize;
        let mut reusable = None;
        for i in 0..WINDOW {
            let at = (home + i) % SLOTS;
            let s = self.slots[at].read();
            match s.state {
                LIVE if s.id == id => return Probe::Found { at, words: s.words },
                LIVE => {}
                FREE => return Probe::Absent(reusable.or(Some(at))),
                _ => {
                    reusable.get_or_insert(at);
                }
            }
        }
        Probe::Absent(reusable)
    }

    /// Applies `f` to slot `at` if it still holds `id` (else hands `f`
    /// back).
    fn update_slot<F: FnOnce(&mut R)>(&self, at: usize, id: u64, f: F) -> Result<(), F> {
        let slot = &self.slots[at];
        let _writing = slot.write();
        if slot.state.load(Ordering::Relaxed) != LIVE || slot.id.load(Ordering::Relaxed) != id {
            return Err(f);
        }
        let mut r = R::from_words(std::array::from_fn(|i| {
            slot.words[i].load(Ordering::Relaxed)
        }));
        f(&mut r);
        slot.store_words(r.to_words());
        Ok(())
    }

    /// [`FieldTable::update`] in turn with inserts and removals.
    fn update_locked(&self, id: u64, f: impl FnOnce(&mut R)) {
        let mut overflow = self.writers();
        let free = match self.probe(id) {
            Probe::Found { at, .. } => {
                // Only inserts and removals move an id, and this thread
                // holds their lock.
                let _ = self.update_slot(at, id, f);
                return;
            }
            Probe::Absent(free) => free,
        };
        if let Some(r) = overflow.get_mut(&id) {
            return f(r);
        }
        let mut r = R::default();
        f(&mut r);
        self.len.fetch_add(1, Ordering::Relaxed);
        match free {
            Some(at) => {
                let slot = &self.slots[at];
                let _writing = slot.write();
                slot.id.store(id, Ordering::Relaxed);
                slot.store_words(r.to_words());
                slot.state.store(LIVE, Ordering::Relaxed);
            }
            None => {
                overflow.insert(id, r);
                self.overflowed.fetch_add(1, Ordering::Release);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[derive(Debug, Clone, Default, PartialEq)]
    struct Two {
        a: u64,
        b: u64,
    }

    impl Fields<2> for Two {
        fn to_words(&self) -> [u64; 2] {
            [self.a, self.b]
        }
        fn from_words([a, b]: [u64; 2]) -> Self {
            Self { a, b }
        }
    }

    #[test]
    fn fields_start_at_defaults_and_keep_what_updates_write() {
        let t = FieldTable::<Two, 2>::default();
        assert_eq!(t.get(7), Two::default());
        assert!(t.is_empty());
        t.update(7, |r| r.a = 3);
        t.update(7, |r| r.b = r.a + 1);
        assert_eq!(t.get(7), Two { a: 3, b: 4 });
        assert_eq!(t.len(), 1);
        t.remove(7);
        assert_eq!(t.get(7), Two::default());
        assert!(t.is_empty());
        t.remove(7);
        assert!(t.is_empty(), "removing an untracked id changes nothing");
    }

    /// An update after a look lands on the id looked up, also when the
    /// id was removed (or removed and tracked again elsewhere) between
    /// the two.
    #[test]
    fn an_update_after_a_look_lands_on_its_id() {
        let t = FieldTable::<Two, 2>::default();
        let untracked = t.look(5);
        t.update_looked(&untracked, 5, |r| r.a = 1);
        let looked = t.look(5);
        assert_eq!(looked.fields, Two { a: 1, b: 0 });
        t.update_looked(&looked, 5, |r| r.b = 2);
        assert_eq!(t.get(5), Two { a: 1, b: 2 });
        let stale = t.look(5);
        t.remove(5);
        t.update_looked(&stale, 5, |r| r.b += 1);
        assert_eq!(t.get(5), Two { a: 0, b: 1 }, "tracked again from defaults");
        assert_eq!(t.len(), 1);
    }

    /// Far more ids than slots: every window fills, the rest overflow, and
    /// removals leave gone slots that later inserts reuse; every id keeps
    /// its own fields throughout.
    #[test]
    fn ids_past_the_slots_overflow_and_freed_slots_are_reused() {
        let t = FieldTable::<Two, 2>::default();
        let ids: Vec<u64> = (0..4 * SLOTS as u64).map(|i| i * 7919 + 1).collect();
        for &id in &ids {
            t.update(id, |r| *r = Two { a: id, b: !id });
        }
        assert_eq!(t.len(), ids.len());
        assert!(t.overflowed.load(Ordering::Relaxed) > 0);
        for &id in &ids {
            assert_eq!(t.get(id), Two { a: id, b: !id }, "id {id}");
        }
        for &id in ids.iter().step_by(2) {
            t.remove(id);
        }
        assert_eq!(t.len(), ids.len() / 2);
        for (i, &id) in ids.iter().enumerate() {
            let want = match i % 2 {
                0 => Two::default(),
                _ => Two { a: id, b: !id },
            };
            assert_eq!(t.get(id), want, "id {id}");
        }
        let fresh: Vec<u64> = (0..SLOTS as u64).map(|i| u64::MAX - i).collect();
        let overflowed = t.overflowed.load(Ordering::Relaxed);
        for &id in &fresh {
            t.update(id, |r| r.a = id);
        }
        assert!(
            t.overflowed.load(Ordering::Relaxed) < overflowed + fresh.len(),
            "gone slots were reused"
        );
        for &id in &fresh {
            assert_eq!(t.get(id).a, id);
        }
    }

    /// Writers keep both words of each id equal; readers on other threads
    /// must never see them differ, while ids come and go.
    #[test]
    fn fields_are_read_whole_while_others_write_insert_and_remove() {
        let t = Arc::new(FieldTable::<Two, 2>::default());
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let writers: Vec<_> = (0..2u64)
            .map(|w| {
                let (t, stop) = (t.clone(), stop.clone());
                std::thread::spawn(move || {
                    let mut k = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        k += 1;
                        for id in 0..64u64 {
                            t.update(id, |r| *r = Two { a: k, b: k });
                        }
                        // Churn beside them: ids inserted and removed.
                        let churn = 1000 + w * 100 + k % 50;
                        t.update(churn, |r| r.a = 1);
                        t.remove(churn);
                    }
                })
            })
            .collect();
        let deadline = std::time::Instant::now() + std::time::Duration::from_millis(300);
        let mut reads = 0u64;
        while std::time::Instant::now() < deadline {
            for id in 0..64u64 {
                let r = t.get(id);
                assert_eq!(r.a, r.b, "torn read after {reads} reads");
                reads += 1;
            }
        }
        stop.store(true, Ordering::Relaxed);
        for w in writers {
            w.join().unwrap();
        }
        assert!(reads > 1000, "only {reads} reads");
        assert_eq!(t.len(), 64, "the churned ids are gone");
    }
}

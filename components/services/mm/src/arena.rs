//! mm's durable state, in its arena: which grant uses each pool page, and
//! every page descriptor (id, parent, holder).
//!
//! The "pool" is mm's page space: the numbers of the pages it may grant
//! (`pages` in its config). It is not memory: each grant's memory is a
//! memfd of its own (`server.rs`); a page's number says where the grant
//! lies in that space, so that two live grants never overlap and ids name
//! their extents.
//!
//! This is resource data that no client could replay: after a reboot, a
//! fresh grant must not hand out pages whose grant has not been rebuilt yet,
//! and `held` and `client_died` must see descriptors nobody has named since
//! the reboot. Layout, all atomics:
//!
//! ```text
//! [0, 8)                      the id sequence (the last one handed out)
//! [64, 64 + 8·P)              per pool page: the id of the grant using it, 0 if free
//! then S slots of 32 bytes    id (0: free slot), parent (0: a grant), holder
//! ```
//!
//! Every change is ordered so that a crash between two stores leaves
//! something [`Arena::scan`] repairs: a grant claims its pages before its
//! slot is published (its id stored last), and is unpublished before its
//! pages are released; an alias is unpublished before its parent. So a
//! crash can leave pages without a grant, or an alias without a parent,
//! and the next incarnation frees both. Pages a holder never confirmed it
//! unmapped are quarantined: owned by no id, and never handed out again.
//!
//! A page id encodes where it lies: `seq << 24 | first pool page << 8 |
//! pages - 1`. Aliases share their grant's low bits, so any id names its
//! extent, and a grant rebuilt from its creation record (`reuse`) finds its
//! pages again even if a crash had already released them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use kintsugi_runtime::abi::shm::Mapping;

const HEADER: usize = 64;
const SLOT: usize = 32;
/// Pool pages an id can name (16 bits of it).
pub const MAX_POOL_PAGES: usize = 1 << 16;
/// The owner of pool pages that must never be handed out again (no id:
/// sequences stay far below 2^40).
const QUARANTINED: u64 = u64::MAX;

/// A page descriptor as the arena keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Desc {
    pub id: u64,
    /// The page it is an alias of; 0 for a grant.
    pub parent: u64,
    /// The component that may locate, map and revoke it.
    pub holder: u32,
}

/// Pool pages `first..first + count`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Span {
    pub first: usize,
    pub count: usize,
}

/// The pool pages `id` names.
pub fn span(id: u64) -> Span {
    Span {
        first: ((id >> 8) & 0xffff) as usize,
        count: (id & 0xff) as usize + 1,
    }
}

/// The arena, mapped.
pub struct Arena {
    map: Mapping,
    pool_pages: usize,
    slots: usize,
}

/// What [`Arena::scan`] found: the live descriptors by slot, and what it repaired.
pub struct Scan {
    pub live: Vec<(usize, Desc)>,
    pub dropped_orphans: usize,
    pub freed_pages: usize,
}

impl Arena {
    /// Lays the arena out for a pool of `pool_pages` pages.
    pub fn new(map: Mapping, pool_pages: usize) -> anyhow::Result<Self> {
        anyhow::ensure!(
            (1..=MAX_POOL_PAGES).contains(&pool_pages),
            "a pool of {pool_pages} pages: mm handles 1 to {MAX_POOL_PAGES}"
        );
        let table = HEADER + 8 * pool_pages;
        let slots = map.len().saturating_sub(table) / SLOT;
        anyhow::ensure!(
            slots >= 16,
            "arena of {} bytes is too small for a pool of {pool_pages} pages and 16 descriptors",
            map.len()
        );
        Ok(Self {
            map,
            pool_pages,
            slots,
        })
    }

    pub fn slots(&self) -> usize {
        self.slots
    }

    fn owner(&self, page: usize) -> &AtomicU64 {
        self.map.at(HEADER + 8 * page)
    }

    fn slot_at(&self, slot: usize) -> usize {
        HEADER + 8 * self.pool_pages + SLOT * slot
    }

    /// A new id for pages `span` (never handed out before, in any incarnation).
    pub fn new_id(&self, span: Span) -> u64 {
        let seq = self.map.at::<AtomicU64>(0).fetch_add(1, Ordering::SeqCst) + 1;
        seq << 24 | (span.first as u64) << 8 | (span.count as u64 - 1)
    }

    /// The first run of `count` free pool pages.
    pub fn find_free(&self, count: usize) -> Option<Span> {
        let mut run = 0;
        for page in 0..self.pool_pages {
            if self.owner(page).load(Ordering::Acquire) == 0 {
                run += 1;
                if run == count {
                    return Some(Span {
                        first: page + 1 - count,
                        count,
                    });
                }
            } else {
                run = 0;
            }
        }
        None
    }

    /// True if every page of `span` lies in the pool and is free.
    pub fn is_free(&self, span: Span) -> bool {
        span.first + span.count <= self.pool_pages
            && (span.first..span.first + span.count)
                .all(|p| self.owner(p).load(Ordering::Acquire) == 0)
    }

    /// Marks the pages of `span` as used by grant `id`.
    pub fn claim(&self, span: Span, id: u64) {
        for p in span.first..span.first + span.count {
            self.owner(p).store(id, Ordering::Release);
        }
    }

    pub fn release(&self, span: Span) {
        for p in span.first..span.first + span.count {
            self.owner(p).store(0, Ordering::Release);
        }
    }

    /// Keeps the pages of `span` out of every future grant, in every incarnation.
    pub fn quarantine(&self, span: Span) {
        for p in span.first..span.first + span.count {
            self.owner(p).store(QUARANTINED, Ordering::Release);
        }
    }

    /// Publishes `desc` in `slot` (its id last: a torn write is a free slot).
    pub fn write(&self, slot: usize, desc: Desc) {
        let at = self.slot_at(slot);
        self.map
            .at::<AtomicU64>(at + 8)
            .store(desc.parent, Ordering::Relaxed);
        self.map
            .at::<AtomicU32>(at + 16)
            .store(desc.holder, Ordering::Relaxed);
        self.map
            .at::<AtomicU64>(at)
            .store(desc.id, Ordering::Release);
    }

    pub fn clear(&self, slot: usize) {
        self.map
            .at::<AtomicU64>(self.slot_at(slot))
            .store(0, Ordering::Release);
    }

    fn read(&self, slot: usize) -> Option<Desc> {
        let at = self.slot_at(slot);
        let id = self.map.at::<AtomicU64>(at).load(Ordering::Acquire);
        (id != 0).then(|| Desc {
            id,
            parent: self.map.at::<AtomicU64>(at + 8).load(Ordering::Relaxed),
            holder: self.map.at::<AtomicU32>(at + 16).load(Ordering::Relaxed),
        })
    }

    /// Reads every descriptor, and repairs what a crash between two stores
    /// can leave: aliases whose parent is gone are unpublished, and pages
    /// whose grant is gone are released.
    pub fn scan(&self) -> Scan {
        let mut live: HashMap<u64, (usize, Desc)> = (0..self.slots)
            .filter_map(|s| self.read(s).map(|d| (d.id, (s, d))))
            .collect();
        let mut dropped_orphans = 0;
        loop {
            let orphans: Vec<u64> = live
                .values()
                .filter(|(_, d)| d.parent != 0 && !live.contains_key(&d.parent))
                .map(|(_, d)| d.id)
                .collect();
            if orphans.is_empty() {
                break;
            }
            for id in orphans {
                let (slot, _) = live.remove(&id).expect("listed above");
                self.clear(slot);
                dropped_orphans += 1;
            }
        }
        let mut freed_pages = 0;
        for page in 0..self.pool_pages {
            let owner = self.owner(page).load(Ordering::Acquire);
            let granted = live.get(&owner).is_some_and(|(_, d)| d.parent == 0);
            if owner != 0 && owner != QUARANTINED && !granted {
                self.owner(page).store(0, Ordering::Release);
                freed_pages += 1;
            }
        }
        let mut live: Vec<(usize, Desc)> = live.into_values().collect();
        live.sort_by_key(|(_, d)| d.id);
        Scan {
            live,
            dropped_orphans,
            freed_pages,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kintsugi_runtime::abi::shm::Region;

    fn arena(pool_pages: usize) -> (Region, Arena) {
        let region = Region::create("mm-arena-test", 64 * 1024).unwrap();
        let map = region.map_range(0, region.len()).unwrap();
        (region, Arena::new(map, pool_pages).unwrap())
    }

    #[test]
    fn ids_name_their_pages_and_are_never_reused() {
        let (_r, a) = arena(64);
        let s = Span { first: 5, count: 3 };
        let (x, y) = (a.new_id(s), a.new_id(s));
        assert_ne!(x, y);
        assert_eq!((span(x), span(y)), (s, s));
        assert_eq!(
            span(a.new_id(Span {
                first: 63,
                count: 256
            }))
            .count,
            256
        );
    }

    #[test]
    fn free_runs_skip_claimed_pages() {
        let (_r, a) = arena(8);
        let first = a.find_free(3).unwrap();
        assert_eq!(first, Span { first: 0, count: 3 });
        a.claim(first, 7);
        assert!(!a.is_free(Span { first: 2, count: 2 }));
        assert_eq!(a.find_free(5), Some(Span { first: 3, count: 5 }));
        assert_eq!(a.find_free(6), None);
        a.release(first);
        assert_eq!(a.find_free(6), Some(Span { first: 0, count: 6 }));
        a.quarantine(Span { first: 1, count: 1 });
        assert_eq!(a.find_free(6), Some(Span { first: 2, count: 6 }));
        assert_eq!(a.scan().freed_pages, 0, "quarantined pages stay out");
        assert!(!a.is_free(Span { first: 4, count: 5 }), "past the pool");
    }

    #[test]
    fn a_scan_repairs_what_a_crash_between_two_stores_leaves() {
        let (_r, a) = arena(16);
        // A grant with an alias, and an alias of that alias.
        let g = a.new_id(Span { first: 0, count: 2 });
        a.claim(span(g), g);
        a.write(
            0,
            Desc {
                id: g,
                parent: 0,
                holder: 2,
            },
        );
        let al = a.new_id(span(g));
        a.write(
            1,
            Desc {
                id: al,
                parent: g,
                holder: 3,
            },
        );
        let al2 = a.new_id(span(g));
        a.write(
            2,
            Desc {
                id: al2,
                parent: al,
                holder: 4,
            },
        );
        // Pages claimed by a grant whose slot was never published.
        let lost = a.new_id(Span { first: 4, count: 1 });
        a.claim(span(lost), lost);
        let scan = a.scan();
        assert_eq!(scan.live.len(), 3);
        assert_eq!((scan.dropped_orphans, scan.freed_pages), (0, 1));
        assert!(a.is_free(span(lost)));
        // A revoke cut short after the grant was unpublished: its aliases
        // and pages go at the next scan.
        a.clear(0);
        let scan = a.scan();
        assert!(scan.live.is_empty());
        assert_eq!((scan.dropped_orphans, scan.freed_pages), (2, 2));
        assert_eq!(
            a.find_free(16),
            Some(Span {
                first: 0,
                count: 16
            })
        );
    }
}

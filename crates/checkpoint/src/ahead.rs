//! Reading a checkpoint's pages ahead, while the process runs: the
//! pre-copy of live migration applied to RMK's TAC checkpoints (issue 15:
//! the pause of a checkpoint of 1 GiB with 1 % written was the copy of its
//! 2,600 pages, 9–40 ms, against a 3 ms target).
//!
//! [`Checkpointer::read_ahead`] finds the pages written since the last
//! checkpoint with the same `PAGEMAP_SCAN` a checkpoint uses, which
//! protects them again, and copies them out while the process goes on.
//! The checkpoint that follows, with the process held still, scans again:
//! a page written after the read-ahead's scan is found written once more
//! and copied in the pause, superseding the copy read ahead (which a write
//! during the read may have torn); a page not written since holds what was
//! read ahead. So the pause copies only what the process wrote since the
//! read-ahead, and the pages read ahead go into the image after every
//! fallible step of the checkpoint, so a checkpoint that fails leaves the
//! one before whole, as before.
//!
//! Pages read ahead and not yet in a checkpoint are pages written since
//! the latest one whose write-protection says otherwise: an in-place
//! restore writes them back as well ([`ReadAhead::ranges`]). A mapping
//! changed or made anew at the checkpoint is copied whole, and what was
//! read ahead of it is dropped.
//!
//! [`Checkpointer::read_ahead`]: crate::Checkpointer::read_ahead

use std::collections::BTreeMap;

use crate::image::Area;
use crate::maps::{Mapping, PAGE};

/// The pages read ahead of one mapping.
struct Staged {
    map: Mapping,
    /// Page address → its bytes when read.
    pages: BTreeMap<u64, Box<[u8]>>,
}

/// Pages read ahead of the next checkpoint, by the start of their mapping.
#[derive(Default)]
pub(crate) struct ReadAhead {
    areas: BTreeMap<u64, Staged>,
}

impl ReadAhead {
    /// Keeps `pages` of `map` (newer than any kept before for them).
    pub fn stage(&mut self, map: &Mapping, pages: Vec<(u64, Box<[u8]>)>) {
        let staged = self.areas.entry(map.start).or_insert_with(|| Staged {
            map: map.clone(),
            pages: BTreeMap::new(),
        });
        if staged.map != *map {
            staged.map = map.clone();
            staged.pages.clear();
        }
        staged.pages.extend(pages);
    }

    /// The checkpoint copied `ranges` of the mapping at `start` itself:
    /// what was read ahead of them is older.
    pub fn supersede(&mut self, start: u64, ranges: &[(u64, u64)]) {
        if let Some(staged) = self.areas.get_mut(&start) {
            for &(s, e) in ranges {
                let covered: Vec<u64> = staged.pages.range(s..e).map(|(&p, _)| p).collect();
                for page in covered {
                    staged.pages.remove(&page);
                }
            }
        }
    }

    /// The mapping at `start` is copied whole (or gone).
    pub fn forget(&mut self, start: u64) {
        self.areas.remove(&start);
    }

    pub fn clear(&mut self) {
        self.areas.clear();
    }

    /// The pages held of the mapping at `start`, as sorted page ranges.
    pub fn ranges(&self, start: u64) -> Vec<(u64, u64)> {
        let mut out: Vec<(u64, u64)> = Vec::new();
        let Some(staged) = self.areas.get(&start) else {
            return out;
        };
        for &page in staged.pages.keys() {
            match out.last_mut() {
                Some(last) if last.1 == page => last.1 = page + PAGE,
                _ => out.push((page, page + PAGE)),
            }
        }
        out
    }

    /// Puts every page held into the area of the same mapping in `areas`
    /// (a mapping no longer there is dropped); returns the pages put.
    pub fn apply(&mut self, areas: &mut BTreeMap<u64, Area>) -> u64 {
        let mut applied = 0;
        for (start, staged) in std::mem::take(&mut self.areas) {
            let Some(area) = areas.get_mut(&start).filter(|a| a.map == staged.map) else {
                continue;
            };
            for (page, bytes) in staged.pages {
                let at = (page - start) as usize;
                area.data[at..at + bytes.len()].copy_from_slice(&bytes);
                area.mark(page, page + PAGE);
                applied += 1;
            }
        }
        applied
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(start: u64, pages: u64) -> Mapping {
        Mapping::private(start, start + pages * PAGE, true, "")
    }

    /// Pages held of the mapping at `start`.
    fn held(ahead: &ReadAhead, start: u64) -> u64 {
        ahead
            .ranges(start)
            .iter()
            .map(|&(s, e)| (e - s) / PAGE)
            .sum()
    }

    fn page(byte: u8) -> Box<[u8]> {
        vec![byte; PAGE as usize].into_boxed_slice()
    }

    #[test]
    fn pages_read_ahead_fill_the_area_except_those_copied_since() {
        let m = map(0x10000, 4);
        let mut ahead = ReadAhead::default();
        ahead.stage(&m, vec![(0x10000, page(1)), (0x11000, page(2))]);
        ahead.stage(&m, vec![(0x11000, page(3)), (0x13000, page(4))]);
        assert_eq!(held(&ahead, 0x10000), 3);
        assert_eq!(
            ahead.ranges(0x10000),
            [(0x10000, 0x12000), (0x13000, 0x14000)]
        );
        // The checkpoint copied the second page itself, later.
        ahead.supersede(0x10000, &[(0x11000, 0x12000)]);
        let mut areas = BTreeMap::from([(0x10000, Area::new(m.clone()))]);
        areas.get_mut(&0x10000).unwrap().data[0x1000] = 9;
        assert_eq!(ahead.apply(&mut areas), 2);
        let a = &areas[&0x10000];
        assert_eq!(
            (a.data[0], a.data[0x1000], a.data[0x2000], a.data[0x3000]),
            (1, 9, 0, 4)
        );
        assert!(a.is_populated(0) && !a.is_populated(1) && !a.is_populated(2) && a.is_populated(3));
        assert_eq!(held(&ahead, 0x10000), 0, "applied pages are gone");
    }

    #[test]
    fn a_changed_mapping_drops_what_was_read_ahead() {
        let mut ahead = ReadAhead::default();
        ahead.stage(&map(0x10000, 4), vec![(0x10000, page(1))]);
        ahead.stage(&map(0x10000, 2), vec![(0x11000, page(2))]);
        assert_eq!(ahead.ranges(0x10000), [(0x11000, 0x12000)]);
        // The area in the image is of the old shape: nothing goes in.
        let mut areas = BTreeMap::from([(0x10000, Area::new(map(0x10000, 4)))]);
        assert_eq!(ahead.apply(&mut areas), 0);
        ahead.stage(&map(0x20000, 1), vec![(0x20000, page(1))]);
        ahead.forget(0x20000);
        assert_eq!(held(&ahead, 0x20000), 0);
    }
}

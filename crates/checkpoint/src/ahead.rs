//! Reading a checkpoint's pages ahead, while the process runs: the
//! pre-copy of live migration applied to RMK's TAC checkpoints (issue 15:
//! the pause of a checkpoint of 1 GiB with 1 % written was the copy of its
//! 5,200 written pages, 7–40 ms on these VMs, against a 3 ms target).
//!
//! [`Checkpointer::with_read_ahead`] finds the pages written since the
//! latest checkpoint with the same `PAGEMAP_SCAN` a checkpoint uses, which
//! protects them again, and copies them from the running process straight
//! into the image, keeping here the bytes the image had for them; then it
//! runs the caller's code, which holds the process still and checkpoints
//! it. That checkpoint scans again: a page written after the read-ahead's
//! scan (during the read, too, which may have torn it) is found written
//! once more and copied in the pause over what was read ahead; a page not
//! written since holds what was read. So the pause copies only what the
//! process wrote since the read-ahead, and when the checkpoint succeeds
//! the kept bytes are forgotten, which costs nothing (a copy of the pages
//! read ahead into the image in the pause cost 0.5 µs a page: 2.5 ms of
//! the 4 ms pause left for 1 GiB with 1 % written).
//!
//! Until then the image is not the latest checkpoint, so the read-ahead
//! lasts only as long as the caller's code: if that takes no checkpoint,
//! or the checkpoint fails, the kept bytes go back ([`ReadAhead::revert`])
//! and the pages read ahead, written since the latest checkpoint whatever
//! their protection says now, are unprotected again (after a failed
//! checkpoint, every page is copied next anyway). A restore puts them back
//! first too, and an in-place restore writes those pages back.
//!
//! [`Checkpointer::with_read_ahead`]: crate::Checkpointer::with_read_ahead

use std::collections::BTreeMap;

use crate::image::Area;
use crate::maps::PAGE;

/// One page read ahead into the image.
struct Kept {
    /// The start of its area, and its address.
    area: u64,
    page: u64,
    /// Whether the latest checkpoint had captured it.
    populated: bool,
}

/// The image's bytes of the pages read ahead into it since the latest
/// checkpoint, as that checkpoint had them.
#[derive(Default)]
pub(crate) struct ReadAhead {
    /// Page `i` of `kept` is `bytes[i * PAGE..]`.
    kept: Vec<Kept>,
    bytes: Vec<u8>,
    /// Pages kept, by area start: one bit per page of the area.
    marks: BTreeMap<u64, Vec<u64>>,
}

impl ReadAhead {
    /// Keeps what `area` holds of `ranges` (pages about to be overwritten
    /// with what the process has now), unless kept before.
    pub fn keep(&mut self, area: &Area, ranges: &[(u64, u64)]) {
        let start = area.map.start;
        let marks = self
            .marks
            .entry(start)
            .or_insert_with(|| vec![0; area.pages().div_ceil(64)]);
        for &(s, e) in ranges {
            for page in (s..e).step_by(PAGE as usize) {
                let i = ((page - start) / PAGE) as usize;
                if marks[i / 64] & (1 << (i % 64)) != 0 {
                    continue;
                }
                marks[i / 64] |= 1 << (i % 64);
                self.kept.push(Kept {
                    area: start,
                    page,
                    populated: area.is_populated(i),
                });
                self.bytes.extend_from_slice(area.bytes(page, page + PAGE));
            }
        }
    }

    /// Pages kept.
    pub fn pages(&self) -> u64 {
        self.kept.len() as u64
    }

    /// Forgets the kept bytes (their buffer stays, for the next
    /// read-ahead): the latest checkpoint now holds what was read ahead, or
    /// the image is replaced.
    pub fn forget(&mut self) {
        self.kept.clear();
        self.bytes.clear();
        self.marks.clear();
    }

    /// Puts the kept bytes back into `areas`, which holds again the latest
    /// checkpoint; returns the pages read ahead, as sorted ranges by area
    /// start (written since that checkpoint).
    pub fn revert(&mut self, areas: &mut BTreeMap<u64, Area>) -> BTreeMap<u64, Vec<(u64, u64)>> {
        let mut read: BTreeMap<u64, Vec<(u64, u64)>> = BTreeMap::new();
        for (k, old) in self.kept.iter().zip(self.bytes.chunks_exact(PAGE as usize)) {
            read.entry(k.area)
                .or_default()
                .push((k.page, k.page + PAGE));
            let Some(area) = areas.get_mut(&k.area) else {
                continue;
            };
            let i = ((k.page - area.map.start) / PAGE) as usize;
            let at = i * PAGE as usize;
            area.data[at..at + PAGE as usize].copy_from_slice(old);
            if !k.populated {
                area.populated[i / 64] &= !(1 << (i % 64));
            }
        }
        self.forget();
        for ranges in read.values_mut() {
            ranges.sort_unstable();
        }
        read
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::maps::Mapping;

    fn area(start: u64, pages: u64) -> Area {
        let mut a = Area::new(Mapping::private(start, start + pages * PAGE, true, ""));
        for p in 0..pages {
            let at = (p * PAGE) as usize;
            a.data[at..at + PAGE as usize].fill(p as u8 + 1);
        }
        a.mark(start, start + 2 * PAGE);
        a
    }

    #[test]
    fn reverting_gives_back_the_checkpoints_bytes_and_marks() {
        let start = 0x10000;
        let mut areas = BTreeMap::from([(start, area(start, 4))]);
        let before = areas[&start].clone();
        let mut ahead = ReadAhead::default();
        // Two read-aheads over pages 1–2, then 2–3: page 2 is kept once,
        // with the checkpoint's bytes, not the first read-ahead's.
        ahead.keep(&areas[&start], &[(start + PAGE, start + 3 * PAGE)]);
        let a = areas.get_mut(&start).unwrap();
        a.data[PAGE as usize..3 * PAGE as usize].fill(0xaa);
        a.mark(start + PAGE, start + 3 * PAGE);
        ahead.keep(&areas[&start], &[(start + 2 * PAGE, start + 4 * PAGE)]);
        let a = areas.get_mut(&start).unwrap();
        a.data[2 * PAGE as usize..].fill(0xbb);
        a.mark(start + 2 * PAGE, start + 4 * PAGE);
        assert_eq!(ahead.pages(), 3);
        let read = ahead.revert(&mut areas);
        assert_eq!(
            read[&start],
            [
                (start + PAGE, start + 2 * PAGE),
                (start + 2 * PAGE, start + 3 * PAGE),
                (start + 3 * PAGE, start + 4 * PAGE)
            ]
        );
        let a = &areas[&start];
        assert_eq!(a.data, before.data);
        assert_eq!(a.populated, before.populated);
        assert_eq!(ahead.pages(), 0);
    }

    #[test]
    fn forgetting_keeps_what_was_read_ahead_in_the_image() {
        let start = 0x10000;
        let mut areas = BTreeMap::from([(start, area(start, 2))]);
        let mut ahead = ReadAhead::default();
        ahead.keep(&areas[&start], &[(start, start + PAGE)]);
        areas.get_mut(&start).unwrap().data[0] = 0xcc;
        ahead.forget();
        assert!(ahead.revert(&mut areas).is_empty());
        assert_eq!(areas[&start].data[0], 0xcc);
    }
}

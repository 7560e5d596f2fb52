//! Restoring a checkpoint into the process it was taken from, in place,
//! keeping its pid (TAC's rollback of a hung or faulty incarnation): the
//! program break and the private mappings are put back as they were
//! (mappings created since are unmapped, removed ones mapped again, all by
//! system calls the target is made to execute), only the pages written
//! since the checkpoint are written back (the same `PAGEMAP_SCAN` that an
//! incremental checkpoint uses, so a restore costs what was written, not
//! the size of the heap), every page of a mapping made again is written,
//! and every thread gets its registers back. A thread blocked in a system
//! call at the checkpoint makes that call again when it runs.

use std::os::fd::AsFd;
use std::time::Instant;

use crate::checkpoint::{Checkpointer, Parts, Stats};
use crate::freeze::Frozen;
use crate::image::{Area, Image};
use crate::maps::{self, Mapping, PAGE};
use crate::remote::{Crew, Syscall};
use crate::{memio, sys, Error};

impl Checkpointer {
    /// Restores the latest checkpoint into the running process.
    pub fn restore_in_place(&mut self) -> Result<Stats, Error> {
        let started = Instant::now();
        let frozen = Frozen::freeze(self.pid())?;
        let mut stats = self.restore_frozen(&frozen)?;
        drop(frozen);
        stats.pause = started.elapsed();
        Ok(stats)
    }

    /// Restores the latest checkpoint into a process the caller holds
    /// still (and will let go).
    pub fn restore_frozen(&mut self, frozen: &Frozen) -> Result<Stats, Error> {
        self.retire_previous();
        let pairs = same_threads(self.image(), frozen)?;
        self.restore_with(frozen, Memory::Tracked, &pairs)
    }

    /// Restores `image` (read from a file, say) into the running process
    /// it was taken from: every checkpointed mapping is mapped anew and
    /// written whole, since what was written since is known only for the
    /// checkpoints taken here. It becomes the latest checkpoint.
    pub fn restore_image(&mut self, image: Image) -> Result<Stats, Error> {
        let started = Instant::now();
        let frozen = Frozen::freeze(self.pid())?;
        let mut stats = self.restore_image_frozen(&frozen, image)?;
        drop(frozen);
        stats.pause = started.elapsed();
        Ok(stats)
    }

    /// [`Self::restore_image`] into a process the caller holds still.
    pub fn restore_image_frozen(&mut self, frozen: &Frozen, image: Image) -> Result<Stats, Error> {
        self.retire_previous();
        if image.exe != self.image().exe {
            return Err(Error::Unrestorable {
                pid: self.pid(),
                detail: format!(
                    "the image is of {}, the process runs {}",
                    image.exe,
                    self.image().exe
                ),
            });
        }
        // What was read ahead is of the image replaced.
        self.forget_read_ahead();
        *self.parts().image = image;
        let pairs = same_threads(self.image(), frozen)?;
        self.restore_with(frozen, Memory::Unknown, &pairs)
    }

    /// Restores the image into the frozen process, `pairs` saying which of
    /// its threads takes which thread of the image (by tid).
    pub(crate) fn restore_with(
        &mut self,
        frozen: &Frozen,
        into: Memory,
        pairs: &[(u32, u32)],
    ) -> Result<Stats, Error> {
        if self.image().seq == 0 {
            return Err(Error::NoCheckpoint(self.pid()));
        }
        // The image holds the latest checkpoint again; the pages read
        // ahead were written since, and an in-place restore writes them back.
        let read_ahead = self.revert_read_ahead();
        let Layout { remade, calls } = self.parts().restore_layout(frozen, into)?;
        let mut stats = Stats {
            layout_calls: calls,
            ..Stats::default()
        };
        let starts: Vec<u64> = self.image().areas.keys().copied().collect();
        for start in starts {
            let map = self.image().areas[&start].map.clone();
            let read = read_ahead.get(&start).map_or(&[][..], |r| &r[..]);
            let plan = self.plan(&map, into, remade.contains(&start), read)?;
            stats.compared += plan.compared;
            stats.pages += self.parts().write_back(start, &plan.write)?;
            self.parts().protect(start, &plan.protect)?;
        }
        restore_threads(self.image(), frozen, pairs)?;
        stats.areas = self.image().areas.len();
        stats.new_areas = remade.len();
        stats.threads = frozen.tids().len();
        stats.bytes = stats.pages * PAGE;
        Ok(stats)
    }
}

/// What a restore may assume of the memory it writes into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Memory {
    /// The process the image was taken from, write-protected since the
    /// checkpoint: only the pages written since go back.
    Tracked,
    /// Memory that has nothing to do with the image: every checkpointed
    /// mapping is made anew and written whole.
    Unknown,
    /// A process forked from the same pristine image as the one the image
    /// was taken from (a standby): most of its pages still hold what the
    /// image holds, both having them from that pristine image, so a
    /// mapping where the image has one of the same kind is kept, and only
    /// the pages whose bytes differ are written (reading a page costs
    /// less than writing it, which breaks its sharing with the pristine
    /// image).
    Sibling,
}

/// What a restore does with one checkpointed area.
struct Plan {
    /// The ranges whose bytes it writes.
    write: Vec<(u64, u64)>,
    /// The ranges it write-protects after, so that the next incremental
    /// checkpoint sees only what the process writes from then on.
    protect: Vec<(u64, u64)>,
    /// Pages compared to find `write` (a restore into a sibling).
    compared: u64,
}

impl Plan {
    /// Write `ranges` and protect them again.
    fn ranges(ranges: Vec<(u64, u64)>) -> Self {
        Self {
            protect: ranges.clone(),
            write: ranges,
            compared: 0,
        }
    }
}

impl Checkpointer {
    /// Which pages of `map` a restore `into` memory writes, `remade` if
    /// the layout's restore mapped it anew; `read_ahead`: its pages read
    /// ahead since the checkpoint.
    fn plan(
        &mut self,
        map: &Mapping,
        into: Memory,
        remade: bool,
        read_ahead: &[(u64, u64)],
    ) -> Result<Plan, Error> {
        if remade {
            return Ok(Plan::ranges(
                self.image().areas[&map.start].populated_runs(),
            ));
        }
        match into {
            // The standby's own pages were never protected: all of them are.
            Memory::Sibling => {
                self.parts().track(map);
                let (write, compared) = self.differing(map)?;
                Ok(Plan {
                    write,
                    protect: vec![(map.start, map.end)],
                    compared,
                })
            }
            // (`Unknown` remade every area it keeps.)
            Memory::Tracked | Memory::Unknown => match self.written_ranges(map)? {
                // A failed checkpoint or read-ahead protected pages that
                // the image does not hold: which were written is unknown.
                Some(_) if self.writes_unknown() => Ok(Plan::ranges(vec![(map.start, map.end)])),
                // Pages read ahead were written since, whatever their
                // protection says now.
                Some(mut written) => {
                    written.extend_from_slice(read_ahead);
                    Ok(Plan::ranges(merged(written)))
                }
                // Mapped anew in the same place since: not tracked, so
                // every byte goes back, and it is tracked from now on.
                None => {
                    self.parts().track(map);
                    Ok(Plan::ranges(vec![(map.start, map.end)]))
                }
            },
        }
    }

    /// The pages of `map` (kept, not made anew) that the process must be
    /// given to hold what the image holds: the image's pages whose bytes
    /// differ in the process, and pages the process has that the image
    /// never captured (which the image holds as zeros). Returns them,
    /// sorted and merged, with the number of pages compared.
    fn differing(&self, map: &Mapping) -> Result<(Vec<(u64, u64)>, u64), Error> {
        let area = &self.image().areas[&map.start];
        let runs = area.populated_runs();
        let mut out: Vec<(u64, u64)> = minus(&self.resident(map)?, &runs);
        // A batch at a time into one buffer: a buffer as large as the
        // mapping would cost a page fault per page, as much as the read.
        let longest = memio::total(&runs).min(COMPARED_AT_ONCE as usize);
        let mut theirs = vec![0u8; longest];
        let mut compared = 0;
        for batch in memio::batches(&runs, COMPARED_AT_ONCE) {
            memio::read(self.pid(), self.mem(), &batch, &mut theirs)
                .map_err(|e| Error::proc(&format!("/proc/{}/mem", self.pid()), e))?;
            let pages = batch
                .iter()
                .flat_map(|&(s, e)| (s..e).step_by(PAGE as usize));
            for (page, now) in pages.zip(theirs.chunks_exact(PAGE as usize)) {
                if now != area.bytes(page, page + PAGE) {
                    out.push((page, page + PAGE));
                }
                compared += 1;
            }
        }
        Ok((merged(out), compared))
    }
}

/// Bytes a restore into a sibling reads from it at a time to compare.
const COMPARED_AT_ONCE: u64 = 1024 * PAGE;

/// `ranges` sorted and with touching ones joined.
pub(crate) fn merged(mut ranges: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    ranges.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
    for (s, e) in ranges {
        match out.last_mut() {
            Some(last) if last.1 >= s => last.1 = last.1.max(e),
            _ => out.push((s, e)),
        }
    }
    out
}

/// What of `ranges` none of `minus` covers (both sorted, each disjoint).
fn minus(ranges: &[(u64, u64)], minus: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    for &(start, end) in ranges {
        let mut at = start;
        for &(s, e) in minus.iter().filter(|&&(s, e)| e > start && s < end) {
            if s > at {
                out.push((at, s));
            }
            at = at.max(e);
        }
        if at < end {
            out.push((at, end));
        }
    }
    out
}

/// In-place restore keeps the threads: the same set must be there; each
/// takes its own registers back.
fn same_threads(image: &Image, frozen: &Frozen) -> Result<Vec<(u32, u32)>, Error> {
    let want: Vec<u32> = image.threads.iter().map(|t| t.tid).collect();
    if want != frozen.tids() {
        return Err(Error::ThreadsChanged {
            pid: frozen.pid(),
            at_checkpoint: want,
            now: frozen.tids().to_vec(),
        });
    }
    Ok(want.iter().map(|&t| (t, t)).collect())
}

/// Gives thread `to` the registers of the image's thread `from`, for
/// each pair.
pub(crate) fn restore_threads(
    image: &Image,
    frozen: &Frozen,
    pairs: &[(u32, u32)],
) -> Result<(), Error> {
    for &(from, to) in pairs {
        let t = image
            .threads
            .iter()
            .find(|t| t.tid == from)
            .ok_or(Error::NoCheckpoint(from))?;
        frozen.set_regs(to, t.user_regs())?;
        sys::set_xstate(to as i32, &t.xstate).map_err(|e| Error::Kernel {
            what: "PTRACE_SETREGSET NT_X86_XSTATE",
            source: e,
        })?;
    }
    Ok(())
}

/// Whether a restore puts `m` back: private, and not the kernel's own.
fn is_private(m: &Mapping) -> bool {
    !m.prot.shared && !m.is_special()
}

/// What putting a process's mappings back did.
struct Layout {
    /// The start of each checkpointed area mapped anew.
    remade: Vec<u64>,
    /// System calls made.
    calls: u64,
}

/// How the current mappings cover an image mapping.
#[derive(Debug, PartialEq, Eq)]
enum Cover {
    /// Wholly, with its protection and kind (file or anonymous).
    Same,
    /// Wholly and of its kind, but with another protection somewhere.
    OtherProt,
    /// Not wholly, or by a mapping of another kind.
    Gaps,
}

fn coverage(current: &[Mapping], w: &Mapping) -> Cover {
    let mut at = w.start;
    let mut prot_differs = false;
    for m in current
        .iter()
        .filter(|m| m.end > w.start && m.start < w.end)
    {
        if m.start > at || m.is_file() != w.is_file() || (w.is_file() && m.name != w.name) {
            return Cover::Gaps;
        }
        prot_differs |= m.prot != w.prot;
        at = m.end;
    }
    match (at >= w.end, prot_differs) {
        (false, _) => Cover::Gaps,
        (true, false) => Cover::Same,
        (true, true) => Cover::OtherProt,
    }
}

/// The address ranges of `current` that no mapping of `wanted` covers.
fn subtract(current: &[Mapping], wanted: &[Mapping]) -> Vec<(u64, u64)> {
    let ranges =
        |maps: &[Mapping]| -> Vec<(u64, u64)> { maps.iter().map(|m| (m.start, m.end)).collect() };
    minus(&ranges(current), &ranges(wanted))
}

impl Parts<'_> {
    /// Puts the break and the private mappings back as the image has
    /// them; returns the start of each checkpointed area mapped anew
    /// (whose every page must then be written) and the calls it took.
    /// Mappings are compared by the addresses they cover, not by `/proc`'s
    /// lines (the kernel merges and splits those): an image mapping not
    /// wholly covered as it was is mapped again in place (`MAP_FIXED`
    /// replaces what is there in one step, so no page the process needs is
    /// ever missing between two calls: the kernel itself writes a thread's
    /// rseq area on each return to user space), and only then is what the
    /// image does not cover unmapped. Into [`Memory::Unknown`], every checkpointed mapping is
    /// mapped anew. The calls of each of those two steps touch disjoint
    /// ranges: they are made at once, spread over the process's threads.
    fn restore_layout(&mut self, frozen: &Frozen, into: Memory) -> Result<Layout, Error> {
        let whole = into == Memory::Unknown;
        let mut crew = Crew::new(frozen, self.insn);
        let mut current = maps::read(self.pid)?;
        let (_, brk) = maps::program_break(self.pid, &current)?;
        let moved_break = brk != self.image.brk.1;
        if moved_break {
            let got = crew.run(&[(
                self.pid,
                Syscall::new("brk", libc::SYS_brk, [self.image.brk.1, 0, 0, 0, 0, 0]),
            )])?;
            if got[0] != self.image.brk.1 {
                return Err(Error::Unrestorable {
                    pid: self.pid,
                    detail: format!("brk({:#x}) gave {:#x}", self.image.brk.1, got[0]),
                });
            }
            current = maps::read(self.pid)?;
        }
        current.retain(is_private);
        let wanted: Vec<Mapping> = self
            .image
            .layout
            .iter()
            .filter(|w| !w.is_special())
            .cloned()
            .collect();
        let mut calls = Vec::new();
        let mut remapped = Vec::new();
        for w in &wanted {
            let cover = match coverage(&current, w) {
                Cover::Same | Cover::OtherProt
                    if whole && self.image.areas.contains_key(&w.start) =>
                {
                    Cover::Gaps
                }
                c => c,
            };
            match cover {
                Cover::Same => {}
                Cover::OtherProt => calls.push(Syscall::new(
                    "mprotect",
                    libc::SYS_mprotect,
                    [w.start, w.len(), w.prot.bits(), 0, 0, 0],
                )),
                Cover::Gaps if w.is_file() && !self.image.areas.contains_key(&w.start) => {
                    return Err(Error::Unrestorable {
                        pid: self.pid,
                        detail: format!(
                            "{} at {:#x} was unmapped and is not in the image",
                            w.name, w.start
                        ),
                    });
                }
                Cover::Gaps => {
                    // Anonymous and private: its contents come from the image.
                    let flags = (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED) as u64;
                    remapped.push((calls.len(), w));
                    calls.push(Syscall::new(
                        "mmap",
                        libc::SYS_mmap,
                        [w.start, w.len(), w.prot.bits(), flags, u64::MAX, 0],
                    ));
                }
            }
        }
        let got = crew.spread(&calls)?;
        let mut remade = Vec::new();
        for (i, w) in remapped {
            if got[i] != w.start {
                return Err(Error::Unrestorable {
                    pid: self.pid,
                    detail: format!("mmap at {:#x} gave {:#x}", w.start, got[i]),
                });
            }
            self.track(w);
            if self.image.areas.contains_key(&w.start) {
                remade.push(w.start);
            }
        }
        // What the calls just made mapped lies within `wanted`: what it
        // does not cover is what it did not cover before them.
        let unmaps: Vec<Syscall> = subtract(&current, &wanted)
            .into_iter()
            .map(|(s, e)| Syscall::new("munmap", libc::SYS_munmap, [s, e - s, 0, 0, 0, 0]))
            .collect();
        crew.spread(&unmaps)?;
        crew.finish()?;
        Ok(Layout {
            remade,
            calls: (u64::from(moved_break) + calls.len() as u64 + unmaps.len() as u64),
        })
    }

    /// Registers the area at `w` for write-protection.
    fn track(&mut self, w: &Mapping) {
        if let Some(area) = self.image.areas.get_mut(&w.start) {
            area.tracked = sys::uffd_register_wp(self.uffd.as_fd(), w.start, w.len()).is_ok();
        }
    }

    /// Write-protects `ranges` of the area at `start`, if it is tracked.
    fn protect(&mut self, start: u64, ranges: &[(u64, u64)]) -> Result<(), Error> {
        if !self.image.areas[&start].tracked {
            return Ok(());
        }
        for &(s, e) in ranges {
            sys::uffd_write_protect(self.uffd.as_fd(), s, e - s).map_err(|e| Error::Kernel {
                what: "UFFDIO_WRITEPROTECT",
                source: e,
            })?;
        }
        Ok(())
    }

    /// Writes `ranges` of the area at `start` back into the process;
    /// returns the pages written.
    fn write_back(&mut self, start: u64, ranges: &[(u64, u64)]) -> Result<u64, Error> {
        let area: &Area = &self.image.areas[&start];
        let bytes = memio::write_from(self.pid, self.mem, area, ranges)
            .map_err(|e| Error::proc(&format!("/proc/{}/mem", self.pid), e))?;
        Ok(bytes / PAGE)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(start: u64, end: u64, write: bool, name: &str) -> Mapping {
        Mapping::private(start, end, write, name)
    }

    #[test]
    fn coverage_is_by_address_not_by_line() {
        let w = m(0x1000, 0x5000, true, "");
        assert_eq!(coverage(&[m(0x1000, 0x5000, true, "")], &w), Cover::Same);
        // Split in two lines by the kernel: still the same cover.
        let split = [m(0x1000, 0x2000, true, ""), m(0x2000, 0x5000, true, "")];
        assert_eq!(coverage(&split, &w), Cover::Same);
        // Merged with a neighbour: still covered.
        assert_eq!(coverage(&[m(0x0, 0x9000, true, "")], &w), Cover::Same);
        let hole = [m(0x1000, 0x2000, true, ""), m(0x3000, 0x5000, true, "")];
        assert_eq!(coverage(&hole, &w), Cover::Gaps);
        let ro = [m(0x1000, 0x2000, true, ""), m(0x2000, 0x5000, false, "")];
        assert_eq!(coverage(&ro, &w), Cover::OtherProt);
        assert_eq!(
            coverage(&[m(0x1000, 0x5000, true, "/lib/x")], &w),
            Cover::Gaps
        );
    }

    #[test]
    fn ranges_are_merged_and_subtracted() {
        assert_eq!(
            merged(vec![(30, 40), (0, 10), (10, 20), (35, 50)]),
            vec![(0, 20), (30, 50)]
        );
        assert_eq!(
            minus(&[(0, 100), (200, 300)], &[(10, 20), (90, 210), (250, 300)]),
            vec![(0, 10), (20, 90), (210, 250)]
        );
        assert_eq!(minus(&[(0, 10)], &[]), vec![(0, 10)]);
        assert!(minus(&[(0, 10)], &[(0, 10)]).is_empty());
    }

    #[test]
    fn subtract_leaves_what_the_image_does_not_cover() {
        let cur = [m(0x0, 0x9000, true, ""), m(0xa000, 0xb000, true, "")];
        let want = [m(0x1000, 0x2000, true, ""), m(0x3000, 0x4000, true, "")];
        assert_eq!(
            subtract(&cur, &want),
            vec![
                (0x0, 0x1000),
                (0x2000, 0x3000),
                (0x4000, 0x9000),
                (0xa000, 0xb000)
            ]
        );
    }
}

//! Incremental checkpoints of a running process, without its cooperation
//! and without a fault per page (RMK's TAC, on Linux): at [`attach`] the
//! target is made to create a userfaultfd, which is taken from it
//! (`pidfd_getfd`) and handshaken for asynchronous write-protection
//! (`UFFD_FEATURE_WP_ASYNC`: a write to a protected page just unprotects
//! it, in the kernel, with no message to anyone). Each checkpoint holds
//! every thread still, registers each new private writable mapping and
//! copies its resident pages, finds the pages written since the previous
//! checkpoint in the others with one `PAGEMAP_SCAN` per mapping that also
//! protects them again (`PM_SCAN_WP_MATCHING`), copies just those, and
//! reads every thread's registers.
//!
//! [`attach`]: Checkpointer::attach

use std::collections::BTreeMap;
use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::time::{Duration, Instant};

use rustix::process::{pidfd_getfd, pidfd_open, Pid, PidfdFlags, PidfdGetfdFlags};

use crate::ahead::ReadAhead;
use crate::freeze::Frozen;
use crate::image::{Area, Image, Rseq, ThreadState};
use crate::maps::{self, Mapping};
use crate::sys::{self, PageRegion, Scan};
use crate::{memio, remote, Error};

/// Read-ahead rounds before a checkpoint, at most, unless set otherwise
/// (see [`Checkpointer::with_read_ahead`]).
const READ_AHEAD_ROUNDS: usize = 4;
/// A read-ahead round that read this many pages or fewer is the last.
const SETTLED_PAGES: u64 = 64;

/// What one checkpoint or restore did.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Stats {
    /// Checkpointed mappings.
    pub areas: usize,
    /// Of which new since the previous checkpoint (copied whole).
    pub new_areas: usize,
    /// Pages copied (by a restore: written), with the process held still.
    pub pages: u64,
    /// Pages a checkpoint took from those read ahead while the process
    /// ran ([`Checkpointer::with_read_ahead`]), not copied in its pause.
    pub read_ahead: u64,
    /// Pages a restore into a sibling process compared with the image
    /// before writing only those that differ.
    pub compared: u64,
    /// System calls a restore made the process run to put its mappings
    /// back as the image has them (`brk`, `mmap`, `mprotect`, `munmap`).
    pub layout_calls: u64,
    pub bytes: u64,
    pub threads: usize,
    /// How long the process was held still.
    pub pause: Duration,
}

/// Checkpoints one process, keeping the latest checkpoint in memory.
pub struct Checkpointer {
    pid: u32,
    uffd: OwnedFd,
    pagemap: File,
    mem: File,
    insn: u64,
    image: Image,
    /// Each thread's `clear_child_tid` address, asked once per thread.
    tid_addresses: BTreeMap<u32, u64>,
    /// Copy every page of every area each time (RTCR's first approach; the
    /// baseline of `kintsugi bench checkpoint`).
    full_copy: bool,
    /// The last checkpoint failed: the next copies every page.
    resync: bool,
    /// The undo buffer of the last checkpoint, emptied: its memory is
    /// already in place for the next one's (a fresh buffer costs a page
    /// fault per page saved, as much as the copy itself).
    spare: Vec<u8>,
    /// Keep what [`Self::take_back`] needs until the next checkpoint.
    keep_previous: bool,
    /// At most this many read-ahead rounds before a checkpoint.
    read_ahead_rounds: usize,
    previous: Option<Previous>,
    /// What the image held of the pages read ahead into it since the
    /// latest checkpoint (see [`crate::ahead`]).
    ahead: ReadAhead,
    /// When the latest checkpoint was taken, and the pages a second the
    /// process wrote between the two latest (see [`Self::expected_pages`]).
    last_at: Option<Instant>,
    write_rate: f64,
}

/// How the latest checkpoint changed the image: what
/// [`Checkpointer::take_back`] puts back.
struct Previous {
    /// The bytes and areas the latest checkpoint replaced.
    undo: Undo,
    /// The previous checkpoint's areas whose mappings were gone at the
    /// latest.
    gone: BTreeMap<u64, Area>,
    /// What the image held of the pages read ahead into the latest.
    ahead: ReadAhead,
    layout: Vec<Mapping>,
    shared: Vec<Mapping>,
    brk: (u64, u64),
    threads: Vec<ThreadState>,
}

/// How to put the previous checkpoint back if one fails halfway (or, with
/// [`Checkpointer::keep_previous`], is taken back).
#[derive(Default)]
struct Undo {
    /// Areas updated in place: the ranges and marks they had.
    updated: Vec<Saved>,
    /// The saved ranges' bytes, one after the other in `updated`'s order.
    bytes: Vec<u8>,
    /// Areas replaced by new ones.
    replaced: Vec<Area>,
}

/// An area's marks before an update, and which of its ranges `Undo::bytes`
/// holds, from offset `at` on.
struct Saved {
    start: u64,
    ranges: Vec<(u64, u64)>,
    at: usize,
    populated: Vec<u64>,
}

impl Undo {
    /// An undo whose saved bytes go into `buffer` (emptied first).
    fn with_buffer(mut buffer: Vec<u8>) -> Self {
        buffer.clear();
        Self {
            bytes: buffer,
            ..Self::default()
        }
    }

    /// Saves `ranges` of `area`, and its marks, before they are updated.
    fn save(&mut self, area: &Area, ranges: &[(u64, u64)]) {
        let at = self.bytes.len();
        for &(s, e) in ranges {
            self.bytes.extend_from_slice(area.bytes(s, e));
        }
        self.updated.push(Saved {
            start: area.map.start,
            ranges: ranges.to_vec(),
            at,
            populated: area.populated.clone(),
        });
    }

    /// The buffer, for the next checkpoint; given back to the allocator
    /// if it is much larger than this one needed.
    fn into_buffer(self) -> Vec<u8> {
        let used = self.bytes.len();
        let mut buffer = self.bytes;
        if buffer.capacity() > 2 * used + (1 << 20) {
            buffer.shrink_to(used);
        }
        buffer
    }

    /// The previous checkpoint's areas, from the ones a failed checkpoint
    /// `touched` and the ones it did not get to (`rest`).
    fn revert(
        self,
        touched: BTreeMap<u64, Area>,
        mut rest: BTreeMap<u64, Area>,
    ) -> BTreeMap<u64, Area> {
        let mut saved: BTreeMap<u64, Saved> =
            self.updated.into_iter().map(|s| (s.start, s)).collect();
        for (start, mut area) in touched {
            // An area made anew is dropped; one updated gets its bytes back.
            if let Some(s) = saved.remove(&start) {
                let mut from_buffer = s.at;
                for (from, to) in s.ranges {
                    let (at, len) = ((from - area.map.start) as usize, (to - from) as usize);
                    area.data[at..at + len]
                        .copy_from_slice(&self.bytes[from_buffer..from_buffer + len]);
                    from_buffer += len;
                }
                area.populated = s.populated;
                rest.insert(start, area);
            }
        }
        for area in self.replaced {
            rest.insert(area.map.start, area);
        }
        rest
    }
}

fn open_proc(pid: u32, what: &str, write: bool) -> Result<File, Error> {
    let path = format!("/proc/{pid}/{what}");
    std::fs::OpenOptions::new()
        .read(true)
        .write(write)
        .open(&path)
        .map_err(|e| Error::proc(&path, e))
}

impl Checkpointer {
    /// Prepares to checkpoint process `pid`: gives it a userfaultfd for
    /// asynchronous write-protection, held here.
    pub fn attach(pid: u32) -> Result<Self, Error> {
        let frozen = Frozen::freeze(pid)?;
        let layout = maps::read(pid)?;
        let insn = remote::find_syscall_insn(pid, &layout)?;
        let uffd = steal_userfaultfd(&frozen, insn)?;
        let granted = sys::uffd_api(
            uffd.as_fd(),
            sys::UFFD_FEATURE_WP_ASYNC | sys::UFFD_FEATURE_WP_UNPOPULATED,
        )
        .map_err(|e| Error::Kernel {
            what: "UFFDIO_API with UFFD_FEATURE_WP_ASYNC (Linux 6.7)",
            source: e,
        })?;
        if granted & sys::UFFD_FEATURE_WP_ASYNC == 0 {
            return Err(Error::Kernel {
                what: "UFFD_FEATURE_WP_ASYNC",
                source: std::io::Error::from_raw_os_error(libc::EOPNOTSUPP),
            });
        }
        let exe = std::fs::read_link(format!("/proc/{pid}/exe"))
            .map(|p| p.display().to_string())
            .unwrap_or_default();
        drop(frozen);
        Ok(Self {
            pid,
            uffd,
            pagemap: open_proc(pid, "pagemap", false)?,
            mem: open_proc(pid, "mem", true)?,
            insn,
            image: Image {
                pid,
                exe,
                ..Image::default()
            },
            tid_addresses: BTreeMap::new(),
            full_copy: false,
            resync: false,
            spare: Vec::new(),
            keep_previous: false,
            read_ahead_rounds: READ_AHEAD_ROUNDS,
            previous: None,
            ahead: ReadAhead::default(),
            last_at: None,
            write_rate: 0.0,
        })
    }

    /// Copies every page each time instead of the written ones.
    pub fn set_full_copy(&mut self, on: bool) {
        self.full_copy = on;
    }

    /// Reads ahead in at most `rounds` rounds before a checkpoint (see
    /// [`Self::with_read_ahead`]; 4 unless set).
    pub fn set_read_ahead_rounds(&mut self, rounds: usize) {
        self.read_ahead_rounds = rounds;
    }

    /// Keeps, from each checkpoint until the next one (or a restore), what
    /// [`Self::take_back`] needs: the bytes the checkpoint overwrote in
    /// the image (as much memory as it copied) and the areas it dropped.
    pub fn keep_previous(&mut self, on: bool) {
        self.keep_previous = on;
        if !on {
            self.retire_previous();
        }
    }

    /// Takes back the latest checkpoint, which must be the last thing done
    /// (a checkpoint found damaged after it was taken, say): the image is
    /// the one before it again, and the next checkpoint copies every page.
    /// Only with [`Self::keep_previous`]; `false` if there is nothing to
    /// take back (the image is left as it is).
    pub fn take_back(&mut self) -> bool {
        let Some(p) = self.previous.take() else {
            return false;
        };
        let taken = std::mem::take(&mut self.image.areas);
        self.image.areas = p.undo.revert(taken, p.gone);
        let mut ahead = p.ahead;
        ahead.revert(&mut self.image.areas);
        self.image.layout = p.layout;
        self.image.shared = p.shared;
        self.image.brk = p.brk;
        self.image.threads = p.threads;
        self.image.seq -= 1;
        // The pages it copied are protected again, as if no one had
        // written them since the one before.
        self.resync = true;
        true
    }

    /// Lets go of what [`Self::take_back`] would need, keeping its
    /// buffers for the next checkpoint and read-ahead.
    pub(crate) fn retire_previous(&mut self) {
        if let Some(p) = self.previous.take() {
            self.spare = p.undo.into_buffer();
            if self.ahead.pages() == 0 {
                self.ahead = p.ahead;
                self.ahead.forget();
            }
        }
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// What travels with the image in its file besides memory (see
    /// [`crate::file`]).
    pub fn attachments_mut(&mut self) -> &mut BTreeMap<String, Vec<u8>> {
        &mut self.image.attachments
    }

    /// The latest checkpoint (inside [`Self::with_read_ahead`], with the
    /// pages read ahead in it until a checkpoint or restore).
    pub fn image(&self) -> &Image {
        &self.image
    }

    /// Takes a checkpoint: holds the process still for its duration.
    pub fn checkpoint(&mut self) -> Result<Stats, Error> {
        let started = Instant::now();
        let frozen = Frozen::freeze(self.pid)?;
        let mut stats = self.checkpoint_frozen(&frozen)?;
        drop(frozen);
        // From the first thread stopped to the last one let go.
        stats.pause = started.elapsed();
        Ok(stats)
    }

    /// Takes a checkpoint of a process the caller holds still. It is all
    /// or nothing: if it fails (the process died under it, say), the
    /// latest checkpoint is still the one before, whole, and the next
    /// checkpoint copies every page again (the failed one's scans have
    /// already protected pages written since).
    pub fn checkpoint_frozen(&mut self, frozen: &Frozen) -> Result<Stats, Error> {
        let started = Instant::now();
        self.retire_previous();
        self.learn_tid_addresses(frozen)?;
        let current = maps::read(self.pid)?;
        let mut stats = Stats::default();
        let mut old = std::mem::take(&mut self.image.areas);
        let mut undo = Undo::with_buffer(std::mem::take(&mut self.spare));
        let copied = self.copy_areas(&current, &mut old, &mut undo, &mut stats);
        let threads = copied.and_then(|()| self.capture_threads(frozen));
        let brk = threads.and_then(|t| Ok((t, maps::program_break(self.pid, &current)?)));
        let (threads, brk) = match brk {
            Ok(done) => done,
            Err(e) => {
                let touched = std::mem::take(&mut self.image.areas);
                self.image.areas = undo.revert(touched, old);
                self.ahead.revert(&mut self.image.areas);
                self.resync = true;
                return Err(e);
            }
        };
        self.resync = false;
        // The pages read ahead are this checkpoint's.
        stats.read_ahead = self.ahead.pages();
        let ahead = std::mem::take(&mut self.ahead);
        let now = Instant::now();
        if let Some(at) = self.last_at {
            let secs = now.duration_since(at).as_secs_f64().max(1e-3);
            self.write_rate = (stats.pages + stats.read_ahead) as f64 / secs;
        }
        self.last_at = Some(now);
        let (shared, private): (Vec<Mapping>, Vec<Mapping>) = current
            .into_iter()
            .filter(|m| !m.is_special())
            .partition(|m| m.prot.shared);
        let previous = Previous {
            layout: std::mem::replace(&mut self.image.layout, private),
            shared: std::mem::replace(&mut self.image.shared, shared),
            brk: std::mem::replace(&mut self.image.brk, brk),
            threads: std::mem::replace(&mut self.image.threads, threads),
            undo,
            gone: old,
            ahead,
        };
        match self.keep_previous {
            true => self.previous = Some(previous),
            false => {
                self.spare = previous.undo.into_buffer();
                self.ahead = previous.ahead;
                self.ahead.forget();
            }
        }
        self.image.seq += 1;
        stats.areas = self.image.areas.len();
        stats.threads = self.image.threads.len();
        stats.bytes = stats.pages * maps::PAGE;
        stats.pause = frozen.held().max(started.elapsed());
        Ok(stats)
    }

    /// Runs `f` after reading ahead into the image, while the process
    /// runs, the pages written since the latest checkpoint (see
    /// `ahead.rs`): a checkpoint `f` takes copies in its pause only
    /// the pages written after that. The read-ahead goes in rounds, each
    /// reading what the process wrote during the one before (live
    /// migration's pre-copy), for as long as they shrink by half or more
    /// (at most [`Self::set_read_ahead_rounds`]; a round of
    /// `SETTLED_PAGES` or fewer ends them): a process that keeps writing then leaves to the pause only
    /// what it wrote during the last, shortest round. If `f` takes no
    /// checkpoint, the image gets the latest checkpoint's bytes back and
    /// the pages read ahead are marked written again. A read-ahead that
    /// fails is undone the same way (or, if that fails too, the next
    /// checkpoint copies every page). Nothing is read ahead before the
    /// first checkpoint or after a failed one.
    pub fn with_read_ahead<R>(&mut self, f: impl FnOnce(&mut Self) -> R) -> R {
        if !self.full_copy && !self.resync && self.image.seq > 0 {
            let mut before = u64::MAX;
            for _ in 0..self.read_ahead_rounds {
                match self.read_written() {
                    Err(_) => {
                        self.settle_read_ahead();
                        break;
                    }
                    // Settled, or not shrinking enough to be worth a round.
                    Ok(read) if read <= SETTLED_PAGES || read > before / 2 => break,
                    Ok(read) => before = read,
                }
            }
        }
        let r = f(self);
        self.settle_read_ahead();
        r
    }

    /// Reads the pages written since the latest checkpoint (or the last
    /// read-ahead) into the image, keeping what the checkpoint held of
    /// them; returns how many pages it read.
    fn read_written(&mut self) -> Result<u64, Error> {
        self.retire_previous();
        let mut read = 0;
        for m in maps::read(self.pid)?.iter().filter(|m| m.is_checkpointed()) {
            let tracked = self
                .image
                .areas
                .get(&m.start)
                .is_some_and(|a| a.map == *m && a.tracked);
            // A mapping made anew since (`None`) is copied whole at the checkpoint.
            let ranges = match tracked.then(|| self.written(m)).transpose() {
                Ok(Some(Some(ranges))) => ranges,
                Ok(_) => continue,
                Err(e) => {
                    // A scan that failed may have protected some pages.
                    self.resync = true;
                    return Err(e);
                }
            };
            let Some(area) = self.image.areas.get_mut(&m.start) else {
                continue;
            };
            self.ahead.keep(area, &ranges);
            read += memio::read_into(self.pid, &self.mem, area, &ranges)
                .map_err(|e| Error::proc(&format!("/proc/{}/mem", self.pid), e))?
                / maps::PAGE;
        }
        Ok(read)
    }

    /// Undoes a read-ahead no checkpoint took: the image's bytes back, and
    /// the pages read ahead unprotected, so that the next scan finds them
    /// written as they were before it.
    fn settle_read_ahead(&mut self) {
        for (_, ranges) in self.ahead.revert(&mut self.image.areas) {
            for (start, end) in crate::restore::merged(ranges) {
                if sys::uffd_unprotect(self.uffd.as_fd(), start, end - start).is_err() {
                    // Unmapped since, say: which pages were written is lost.
                    self.resync = true;
                }
            }
        }
    }

    /// Puts the latest checkpoint's bytes back where pages were read ahead
    /// into the image; returns those pages (as ranges by area start).
    pub(crate) fn revert_read_ahead(&mut self) -> BTreeMap<u64, Vec<(u64, u64)>> {
        self.ahead.revert(&mut self.image.areas)
    }

    /// Forgets what the image held of the pages read ahead: it is replaced.
    pub(crate) fn forget_read_ahead(&mut self) {
        self.ahead.forget();
    }

    /// Whether pages may have been written that nothing recorded: the
    /// last checkpoint or read-ahead failed after its scans protected
    /// them again (the next checkpoint copies every page).
    pub(crate) fn writes_unknown(&self) -> bool {
        self.resync
    }

    /// The pages the process has likely written since the latest
    /// checkpoint: as many a second as between the two latest (0 until
    /// there are two), for choosing whether to read ahead.
    pub fn expected_pages(&self) -> u64 {
        self.last_at.map_or(0, |at| {
            (self.write_rate * at.elapsed().as_secs_f64()) as u64
        })
    }

    /// Copies what changed in every checkpointed mapping into the image's
    /// areas (`old`: the previous checkpoint's, taken out), noting in
    /// `undo` how to put the previous checkpoint back.
    fn copy_areas(
        &mut self,
        current: &[Mapping],
        old: &mut BTreeMap<u64, Area>,
        undo: &mut Undo,
        stats: &mut Stats,
    ) -> Result<(), Error> {
        for m in current.iter().filter(|m| m.is_checkpointed()) {
            let prev = old.remove(&m.start);
            let incremental = !self.full_copy
                && !self.resync
                && prev.as_ref().is_some_and(|a| a.map == *m && a.tracked);
            let area = match prev {
                Some(mut a) if incremental => match self.written(&a.map) {
                    Ok(Some(ranges)) => {
                        undo.save(&a, &ranges);
                        let read = memio::read_into(self.pid, &self.mem, &mut a, &ranges);
                        let start = a.map.start;
                        // Where the undo finds it, whatever happens next.
                        self.image.areas.insert(start, a);
                        let bytes =
                            read.map_err(|e| Error::proc(&format!("/proc/{}/mem", self.pid), e))?;
                        stats.pages += bytes / maps::PAGE;
                        continue;
                    }
                    // Unmapped and mapped again in the same place since:
                    // the new mapping is not registered yet.
                    Ok(None) => {
                        undo.replaced.push(a);
                        self.fresh_area(m, stats)?
                    }
                    Err(e) => {
                        old.insert(a.map.start, a);
                        return Err(e);
                    }
                },
                prev => {
                    undo.replaced.extend(prev);
                    self.fresh_area(m, stats)?
                }
            };
            self.image.areas.insert(m.start, area);
        }
        Ok(())
    }

    /// A mapping copied whole into a new area.
    fn fresh_area(&mut self, m: &Mapping, stats: &mut Stats) -> Result<Area, Error> {
        stats.new_areas += 1;
        let mut a = Area::new(m.clone());
        stats.pages += self.copy_new(&mut a)?;
        Ok(a)
    }

    /// The latest checkpoint, taken out of a checkpointer done with its
    /// process (one that died, whose image a new incarnation is to get).
    pub fn into_image(mut self) -> Image {
        std::mem::take(&mut self.image)
    }

    /// A new area: registered for write-protection, its resident pages
    /// (every page of a file mapping) copied, then protected.
    fn copy_new(&mut self, area: &mut Area) -> Result<u64, Error> {
        let (start, len) = (area.map.start, area.map.len());
        area.tracked =
            !self.full_copy && sys::uffd_register_wp(self.uffd.as_fd(), start, len).is_ok();
        let ranges = if area.map.is_file() {
            vec![(start, area.map.end)]
        } else {
            self.resident(&area.map)?
        };
        let bytes = memio::read_into(self.pid, &self.mem, area, &ranges)
            .map_err(|e| Error::proc(&format!("/proc/{}/mem", self.pid), e))?;
        if area.tracked {
            sys::uffd_write_protect(self.uffd.as_fd(), start, len).map_err(|e| Error::Kernel {
                what: "UFFDIO_WRITEPROTECT",
                source: e,
            })?;
        }
        Ok(bytes / maps::PAGE)
    }

    /// The pages of `map` written since they were last protected, which
    /// this protects again; `None` if `map` is not registered for
    /// write-protection (a mapping made anew where a tracked one was).
    fn written(&self, map: &Mapping) -> Result<Option<Vec<(u64, u64)>>, Error> {
        let scan = Scan {
            flags: sys::PM_SCAN_WP_MATCHING | sys::PM_SCAN_CHECK_WPASYNC,
            category_mask: sys::PAGE_IS_WRITTEN,
            return_mask: sys::PAGE_IS_WRITTEN,
            ..Scan::default()
        };
        match self.scan(map, scan) {
            Ok(r) => Ok(Some(r)),
            Err(Error::Kernel { source, .. }) if source.raw_os_error() == Some(libc::EPERM) => {
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// The target's memory, opened through `/proc`.
    pub(crate) fn mem(&self) -> &File {
        &self.mem
    }

    /// The pages of `map` the process has in memory (or swapped out).
    pub(crate) fn resident(&self, map: &Mapping) -> Result<Vec<(u64, u64)>, Error> {
        self.scan(
            map,
            Scan {
                category_anyof_mask: sys::PAGE_IS_PRESENT | sys::PAGE_IS_SWAPPED,
                return_mask: sys::PAGE_IS_PRESENT | sys::PAGE_IS_SWAPPED,
                ..Scan::default()
            },
        )
    }

    fn scan(&self, map: &Mapping, scan: Scan) -> Result<Vec<(u64, u64)>, Error> {
        let mut regions: Vec<PageRegion> = Vec::new();
        sys::pagemap_scan(self.pagemap.as_fd(), map.start, map.end, scan, &mut regions).map_err(
            |e| Error::Kernel {
                what: "PAGEMAP_SCAN (Linux 6.7)",
                source: e,
            },
        )?;
        // Sorted and disjoint, whatever the kernel reported: a scan of a
        // process that runs meanwhile (a read-ahead) once gave regions that
        // did not follow each other (the testbench, seed 924978: reading
        // them ahead overran the area; not reproduced on demand), perhaps
        // where the kernel walked a range again after a page table changed
        // under it.
        Ok(crate::restore::merged(
            regions.iter().map(|r| (r.start, r.end)).collect(),
        ))
    }

    pub(crate) fn parts(&mut self) -> Parts<'_> {
        Parts {
            pid: self.pid,
            uffd: &self.uffd,
            mem: &self.mem,
            insn: self.insn,
            image: &mut self.image,
            tid_addresses: &mut self.tid_addresses,
        }
    }

    pub(crate) fn written_ranges(&self, map: &Mapping) -> Result<Option<Vec<(u64, u64)>>, Error> {
        self.written(map)
    }
}

/// What a restore needs of a checkpointer, borrowed apart.
pub(crate) struct Parts<'a> {
    pub pid: u32,
    pub uffd: &'a OwnedFd,
    pub mem: &'a File,
    pub insn: u64,
    pub image: &'a mut Image,
    pub tid_addresses: &'a mut BTreeMap<u32, u64>,
}

impl Checkpointer {
    /// Asks each thread not seen before where its id word is (a system
    /// call it makes: done before anything is copied, since running even
    /// one instruction lets the kernel update the thread's rseq area), and
    /// forgets the threads gone.
    fn learn_tid_addresses(&mut self, frozen: &Frozen) -> Result<(), Error> {
        self.tid_addresses
            .retain(|tid, _| frozen.tids().contains(tid));
        for &tid in frozen.tids() {
            if !self.tid_addresses.contains_key(&tid) {
                let a = remote::tid_address(frozen, &self.mem, tid, self.insn)?;
                self.tid_addresses.insert(tid, a);
            }
        }
        Ok(())
    }

    /// Every thread's registers, extended state, id address and rseq
    /// registration.
    fn capture_threads(&self, frozen: &Frozen) -> Result<Vec<ThreadState>, Error> {
        let mut threads = Vec::with_capacity(frozen.tids().len());
        for &tid in frozen.tids() {
            let mut t = ThreadState::new(tid, &frozen.regs(tid)?, frozen.xstate(tid)?);
            t.tid_address = self.tid_addresses.get(&tid).copied().unwrap_or(0);
            let rseq = sys::rseq_config(tid as i32).map_err(|e| Error::Kernel {
                what: "PTRACE_GET_RSEQ_CONFIGURATION",
                source: e,
            })?;
            t.rseq = Rseq {
                address: rseq.address,
                len: rseq.len,
                signature: rseq.signature,
            };
            threads.push(t);
        }
        Ok(threads)
    }
}

/// Makes the frozen target create a userfaultfd, takes it, and closes the
/// target's copy (the context lives on in ours).
fn steal_userfaultfd(frozen: &Frozen, insn: u64) -> Result<OwnedFd, Error> {
    let pid = frozen.pid();
    let flags = (libc::O_CLOEXEC | libc::O_NONBLOCK) as u64 | sys::UFFD_USER_MODE_ONLY;
    let fd = remote::checked(
        frozen,
        pid,
        insn,
        "userfaultfd",
        libc::SYS_userfaultfd,
        [flags, 0, 0, 0, 0, 0],
    )?;
    let gone = |e: rustix::io::Errno| Error::Kernel {
        what: "pidfd_getfd",
        source: e.into(),
    };
    let target = Pid::from_raw(pid as i32).ok_or(Error::Gone(pid))?;
    let pidfd = pidfd_open(target, PidfdFlags::empty()).map_err(gone)?;
    let taken = pidfd_getfd(&pidfd, fd as i32, PidfdGetfdFlags::empty()).map_err(gone);
    remote::checked(
        frozen,
        pid,
        insn,
        "close",
        libc::SYS_close,
        [fd, 0, 0, 0, 0, 0],
    )?;
    taken
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::maps::PAGE;

    fn area(start: u64, pages: u64, fill: u8) -> Area {
        let mut a = Area::new(Mapping::private(start, start + pages * PAGE, true, ""));
        a.data.fill(fill);
        a
    }

    /// A checkpoint that updated two areas and replaced a third, then
    /// failed: the revert gives back every byte and mark the areas had,
    /// through an undo buffer reused from an earlier checkpoint.
    #[test]
    fn a_failed_checkpoint_is_undone_byte_for_byte() {
        let (a, b) = (0x10_000, 0x40_000);
        let before: BTreeMap<u64, Area> = [(a, area(a, 4, 1)), (b, area(b, 3, 2))].into();
        let mut undo = Undo::with_buffer(vec![9; 3 * PAGE as usize]);
        let mut touched = BTreeMap::new();
        for (start, ranges) in [
            (a, vec![(a, a + PAGE), (a + 2 * PAGE, a + 4 * PAGE)]),
            (b, vec![(b + PAGE, b + 2 * PAGE)]),
        ] {
            let mut x = before[&start].clone();
            undo.save(&x, &ranges);
            for &(s, e) in &ranges {
                let at = (s - start) as usize;
                x.data[at..at + (e - s) as usize].fill(0xee);
                x.mark(s, e);
            }
            touched.insert(start, x);
        }
        let c = 0x80_000;
        undo.replaced.push(area(c, 1, 3));
        touched.insert(c, area(c, 2, 4));
        let reverted = undo.revert(touched, BTreeMap::new());
        assert_eq!(reverted.len(), 3);
        for (start, was) in &before {
            assert_eq!(reverted[start].data, was.data, "area {start:#x}");
            assert_eq!(reverted[start].populated, was.populated);
        }
        assert_eq!(reverted[&c].data, vec![3; PAGE as usize]);
    }
}

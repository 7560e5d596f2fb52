//! The component's side of the watchdog (hang detection, RMK's SHD and AHD):
//! a table in the control block that the supervisor's monitor samples.
//!
//! - **Stretches** (SHD). Every server worker thread owns a [`WorkerEntry`]:
//!   its thread id and a sequence number that is odd while the thread runs
//!   a stretch of one invocation. The worker makes it odd before dispatch
//!   and even after: two plain stores, no system call and no clock read on
//!   the invocation path. A stretch also ends where the thread waits for
//!   something else: an outgoing invocation ([`crate::client`]) or a wait a
//!   service declares with [`blocking`]; a new one starts after it. The
//!   monitor measures a stretch's progress from the thread's CPU time.
//! - **Sections** (AHD). [`section`] names a code section; [`Section::enter`]
//!   takes the thread's CPU clock and records an active instance,
//!   [`Entered::leave`] records the CPU time it took in the history of the
//!   exit it left by. Histories live in the control block, so they survive
//!   micro-reboots. Sections nest and overlap freely: each instance has its
//!   own entry. An unchecked section ([`unchecked_section`]) keeps a history
//!   but is never judged.
//!
//! With the watchdog off (the system description has no `[watchdog]`), no
//! worker is watched and sections cost one atomic load.

use std::cell::Cell;
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
use std::sync::OnceLock;

use rustix::time::{clock_gettime, ClockId};

use crate::abi::boot::LIFELINES;
use crate::abi::shm::SharedPod;
use crate::counters::{claim_by_name, SharedName, NAME_LEN};

/// Watched worker threads per component (one per channel slot it serves).
pub const WORKERS: usize = LIFELINES;
/// Named sections per component.
pub const SECTIONS: usize = 16;
/// Exits per section.
pub const EXITS: usize = 8;
/// History kept per exit: the longest window a system may configure.
pub const HISTORY: usize = 64;
/// Section instances active at once, over all threads of a component.
pub const ACTIVE: usize = 64;

/// One server worker thread.
#[repr(C)]
pub struct WorkerEntry {
    /// The worker's thread id (0: never served).
    pub tid: AtomicU32,
    /// The process of the incarnation it belongs to.
    pub pid: AtomicU32,
    /// The function of the invocation in progress.
    pub func: AtomicU32,
    _pad: AtomicU32,
    /// Odd while the thread runs a stretch.
    pub seq: AtomicU64,
    /// Requests the worker has taken from its slot; odd while it holds one
    /// (from taking it until its response is published). A request that
    /// waits in the slot while this stays even was never taken: the
    /// worker lost track of its slot.
    pub taken: AtomicU64,
    /// The thread's name: `interface:slot`.
    pub name: SharedName,
}

impl WorkerEntry {
    /// Starts a stretch of an invocation of `func`.
    #[inline]
    pub fn begin(&self, func: u32) {
        self.func.store(func, Ordering::Relaxed);
        let s = self.seq.load(Ordering::Relaxed);
        self.seq.store(s | 1, Ordering::Release);
    }

    /// Ends the stretch in progress.
    #[inline]
    pub fn end(&self) {
        let s = self.seq.load(Ordering::Relaxed);
        self.seq.store((s | 1) + 1, Ordering::Release);
    }

    /// The worker took the request in its slot.
    #[inline]
    pub fn take(&self) {
        let t = self.taken.load(Ordering::Relaxed);
        self.taken.store(t | 1, Ordering::Release);
    }

    /// The worker published the response to the request it held.
    #[inline]
    pub fn release(&self) {
        let t = self.taken.load(Ordering::Relaxed);
        self.taken.store((t | 1) + 1, Ordering::Release);
    }

    /// The worker was rolled back to a checkpoint taken while it was idle
    /// (supervisor): it is in no stretch and holds no request, whatever
    /// this entry said of the incarnation's later life.
    pub fn rolled_back(&self) {
        if self.seq.load(Ordering::Acquire) & 1 == 1 {
            self.end();
        }
        if self.taken.load(Ordering::Acquire) & 1 == 1 {
            self.release();
        }
    }

    /// Whether the thread is inside a stretch.
    pub fn in_stretch(&self) -> bool {
        self.seq.load(Ordering::Acquire) & 1 == 1
    }
}

/// The CPU times (ns) of one exit's recent runs: a ring of [`HISTORY`].
#[repr(C)]
pub struct ExitHistory {
    /// Runs recorded so far; the next goes to `runs % HISTORY`.
    pub runs: AtomicU64,
    ns: [AtomicU64; HISTORY],
}

impl ExitHistory {
    fn record(&self, ns: u64) {
        let i = self.runs.fetch_add(1, Ordering::AcqRel) as usize % HISTORY;
        self.ns[i].store(ns, Ordering::Release);
    }

    /// The largest of the last `window` runs (at most [`HISTORY`]), and how
    /// many runs there were in all.
    pub fn window_max(&self, window: usize) -> (u64, u64) {
        let runs = self.runs.load(Ordering::Acquire);
        let n = (runs as usize).min(window).min(HISTORY);
        let max = (0..n)
            .map(|k| self.ns[(runs as usize - 1 - k) % HISTORY].load(Ordering::Acquire))
            .max()
            .unwrap_or(0);
        (max, runs)
    }
}

/// A named code section and its per-exit history.
#[repr(C)]
pub struct SectionEntry {
    pub name: SharedName,
    /// 1: judged by the monitor; 0: history only.
    pub checked: AtomicU32,
    _pad: AtomicU32,
    pub exits: [ExitHistory; EXITS],
}

/// One section instance in progress.
#[repr(C)]
pub struct ActiveEntry {
    /// [`ACTIVE_FREE`], [`ACTIVE_FILLING`] or [`ACTIVE_IN`].
    pub state: AtomicU32,
    pub section: AtomicU32,
    pub tid: AtomicU32,
    pub pid: AtomicU32,
    /// The exit the code said it expects to leave by, plus one (0: none).
    pub expect: AtomicU32,
    /// A seqlock over the other fields: odd while an instance that claimed
    /// the entry writes them, even once it is complete, so that a reader
    /// can tell a consistent copy ([`ActiveEntry::read`]) from one torn by a
    /// thread that left and another that came in meanwhile.
    pub instance: AtomicU32,
    /// The thread's CPU time at enter (ns, the same clock as
    /// `/proc/PID/task/TID/schedstat`).
    pub cpu_enter: AtomicU64,
}

/// A consistent copy of an [`ActiveEntry`] in progress.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ActiveView {
    pub instance: u32,
    pub section: u32,
    pub tid: u32,
    pub expect: u32,
    pub cpu_enter: u64,
}

impl ActiveEntry {
    /// The instance in progress in this entry, if one of incarnation `pid`
    /// is: all fields from that one instance, never the thread id of one
    /// and the CPU time of another.
    pub fn read(&self, pid: u32) -> Option<ActiveView> {
        let instance = self.instance.load(Ordering::Acquire);
        if instance & 1 == 1
            || self.state.load(Ordering::Acquire) != ACTIVE_IN
            || self.pid.load(Ordering::Relaxed) != pid
        {
            return None;
        }
        let view = ActiveView {
            instance,
            section: self.section.load(Ordering::Relaxed),
            tid: self.tid.load(Ordering::Relaxed),
            expect: self.expect.load(Ordering::Relaxed),
            cpu_enter: self.cpu_enter.load(Ordering::Relaxed),
        };
        self.still(&view).then_some(view)
    }

    /// Whether the instance `view` was read from is still in progress (so
    /// that what was measured of its thread meanwhile belongs to it).
    pub fn still(&self, view: &ActiveView) -> bool {
        fence(Ordering::Acquire);
        self.instance.load(Ordering::Relaxed) == view.instance
            && self.state.load(Ordering::Relaxed) == ACTIVE_IN
    }

    /// Fills the entry for a new instance (the caller claimed it).
    fn fill(&self, view: ActiveView, pid: u32) {
        self.instance.fetch_add(1, Ordering::Relaxed);
        // The odd number is visible before any field of the new instance.
        fence(Ordering::Release);
        self.section.store(view.section, Ordering::Relaxed);
        self.tid.store(view.tid, Ordering::Relaxed);
        self.pid.store(pid, Ordering::Relaxed);
        self.expect.store(view.expect, Ordering::Relaxed);
        self.cpu_enter.store(view.cpu_enter, Ordering::Relaxed);
        self.instance.fetch_add(1, Ordering::Release);
        self.state.store(ACTIVE_IN, Ordering::Release);
    }
}

pub const ACTIVE_FREE: u32 = 0;
pub const ACTIVE_FILLING: u32 = 1;
pub const ACTIVE_IN: u32 = 2;

/// The watchdog's part of [`crate::abi::boot::ControlBlock`].
#[repr(C)]
pub struct WatchTable {
    /// The process id of the incarnation that enabled the watchdog last.
    /// Kept here, in shared memory, not in the process's own: a restore
    /// into a new incarnation replaces the process's memory with the
    /// image's, which holds the dead incarnation's id.
    pub pid: AtomicU32,
    _pad: AtomicU32,
    pub workers: [WorkerEntry; WORKERS],
    pub sections: [SectionEntry; SECTIONS],
    pub active: [ActiveEntry; ACTIVE],
}
// SAFETY: repr(C), atomics only; all-zero is an empty table.
unsafe impl SharedPod for WatchTable {}

/// This incarnation's table, once the watchdog is on.
static TABLE: OnceLock<&'static WatchTable> = OnceLock::new();

thread_local! {
    /// The worker entry of the calling thread, if it is a watched worker.
    static WORKER: Cell<Option<&'static WorkerEntry>> = const { Cell::new(None) };
    /// The calling thread's id, once asked, and the process id it was
    /// asked in (after a restore into a new incarnation the cache is the
    /// image's: another process's, and it is asked again).
    static TID: Cell<(u32, u32)> = const { Cell::new((0, 0)) };
}

/// The calling thread's id in process `pid` (one system call per thread
/// and incarnation).
fn tid(pid: u32) -> u32 {
    TID.with(|t| {
        let (cached_in, tid) = t.get();
        if cached_in == pid && tid != 0 {
            return tid;
        }
        let tid = rustix::thread::gettid().as_raw_nonzero().get() as u32;
        t.set((pid, tid));
        tid
    })
}

/// Runtime: turns the watchdog on for this incarnation.
pub(crate) fn enable(table: &'static WatchTable) {
    let pid = rustix::process::getpid().as_raw_nonzero().get() as u32;
    table.pid.store(pid, Ordering::Relaxed);
    let _ = TABLE.set(table);
}

/// Runtime: makes the calling thread watched worker number `index`, called
/// `name`; returns its entry (None with the watchdog off).
pub(crate) fn register_worker(index: usize, name: &str) -> Option<&'static WorkerEntry> {
    let table = TABLE.get()?;
    let e = table.workers.get(index)?;
    let pid = table.pid.load(Ordering::Relaxed);
    // A stretch the previous incarnation left open is over.
    e.end();
    e.pid.store(pid, Ordering::Relaxed);
    e.tid.store(tid(pid), Ordering::Relaxed);
    claim_by_name(std::slice::from_ref(&e.name), name, |n| n);
    WORKER.with(|w| w.set(Some(e)));
    Some(e)
}

/// The calling thread's worker entry, if it is a watched worker.
pub(crate) fn this_worker() -> Option<&'static WorkerEntry> {
    WORKER.with(Cell::get)
}

/// Runs `f`, a wait that may legitimately last (a `block` function waiting
/// for its wake-up, a call to another component), outside the calling
/// worker's stretch: the stretch ends before and a new one starts after.
/// Anywhere else it just runs `f`.
pub fn blocking<T>(f: impl FnOnce() -> T) -> T {
    match this_worker().filter(|w| w.in_stretch()) {
        Some(w) => {
            w.end();
            let out = f();
            w.begin(w.func.load(Ordering::Relaxed));
            out
        }
        None => f(),
    }
}

/// Why a section could not be had.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SectionError {
    #[error("section name `{0}` is empty or longer than {NAME_LEN} bytes")]
    BadName(String),
    #[error("no room for section `{0}`: a component has at most {SECTIONS}")]
    Full(String),
}

/// A named code section, judged by the monitor from its own history.
#[derive(Debug, Clone, Copy)]
pub struct Section {
    /// None with the watchdog off.
    id: Option<u32>,
}

/// The section called `name`, checked against its history.
pub fn section(name: &str) -> Result<Section, SectionError> {
    claim_section(name, true)
}

/// The section called `name`, whose history is kept but which is never
/// judged (for code that may legitimately run long).
pub fn unchecked_section(name: &str) -> Result<Section, SectionError> {
    claim_section(name, false)
}

fn claim_section(name: &str, checked: bool) -> Result<Section, SectionError> {
    if name.is_empty() || name.len() > NAME_LEN {
        return Err(SectionError::BadName(name.to_string()));
    }
    let Some(table) = TABLE.get() else {
        return Ok(Section { id: None });
    };
    let s = claim_by_name(&table.sections, name, |s| &s.name)
        .ok_or_else(|| SectionError::Full(name.to_string()))?;
    s.checked.store(checked as u32, Ordering::Release);
    let id = table
        .sections
        .iter()
        .position(|x| std::ptr::eq(x, s))
        .expect("claimed from the table") as u32;
    Ok(Section { id: Some(id) })
}

/// The calling thread's CPU time, in ns.
fn thread_cpu_ns() -> u64 {
    let t = clock_gettime(ClockId::ThreadCPUTime);
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

impl Section {
    /// Enters the section; its check value comes from the exit with the
    /// largest runs.
    pub fn enter(&self) -> Entered {
        self.start(0)
    }

    /// Enters the section, saying that it should leave by `exit` (which the
    /// code often knows up front: a large request takes the large path):
    /// it is then judged by that exit's history alone, and by the default
    /// bound until that exit has a full window.
    pub fn enter_expecting(&self, exit: u32) -> Entered {
        self.start(exit.min(EXITS as u32 - 1) + 1)
    }

    fn start(&self, expect: u32) -> Entered {
        let (Some(id), Some(table)) = (self.id, TABLE.get()) else {
            return Entered { slot: None };
        };
        let pid = table.pid.load(Ordering::Relaxed);
        let tid = tid(pid);
        let slot = table.active.iter().position(|a| {
            let st = a.state.load(Ordering::Acquire);
            // An instance left by a dead incarnation is free too.
            let free =
                st == ACTIVE_FREE || (st == ACTIVE_IN && a.pid.load(Ordering::Relaxed) != pid);
            free && a
                .state
                .compare_exchange(st, ACTIVE_FILLING, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        });
        let Some(slot) = slot else {
            tracing::warn!("more than {ACTIVE} active sections: this one goes unwatched");
            return Entered { slot: None };
        };
        let view = ActiveView {
            instance: 0,
            section: id,
            tid,
            expect,
            cpu_enter: thread_cpu_ns(),
        };
        table.active[slot].fill(view, pid);
        Entered {
            slot: Some((table, slot)),
        }
    }
}

/// A section instance in progress; leave it with [`Entered::leave`]
/// (dropping it leaves by exit 0).
#[must_use = "a section is left by `leave` or when this guard drops"]
pub struct Entered {
    slot: Option<(&'static WatchTable, usize)>,
}

impl Entered {
    /// Leaves the section by `exit` (0..[`EXITS`]; larger ones count as the
    /// last) and records the CPU time it took in that exit's history.
    pub fn leave(mut self, exit: u32) {
        self.finish(exit);
    }

    fn finish(&mut self, exit: u32) {
        let Some((table, slot)) = self.slot.take() else {
            return;
        };
        let a = &table.active[slot];
        let took = thread_cpu_ns().saturating_sub(a.cpu_enter.load(Ordering::Relaxed));
        let section = a.section.load(Ordering::Relaxed) as usize;
        a.state.store(ACTIVE_FREE, Ordering::Release);
        table.sections[section].exits[(exit as usize).min(EXITS - 1)].record(took);
    }
}

impl Drop for Entered {
    fn drop(&mut self) {
        self.finish(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::abi::shm::Region;

    #[test]
    fn exit_history_keeps_the_window_maximum() {
        let region = Region::create("watch-test", std::mem::size_of::<WatchTable>()).unwrap();
        let t: &WatchTable = region.at(0);
        let h = &t.sections[0].exits[0];
        assert_eq!(h.window_max(50), (0, 0));
        h.record(900);
        for i in 0..60 {
            h.record(10 + i);
        }
        // The 900 ns run is 61 runs back: out of a 50-run window, inside a 64-run one.
        assert_eq!(h.window_max(50), (69, 61));
        assert_eq!(h.window_max(64), (900, 61));
        for _ in 0..HISTORY {
            h.record(5);
        }
        assert_eq!(h.window_max(64), (5, 61 + HISTORY as u64));
    }

    #[test]
    fn an_active_entry_is_read_whole_or_not_at_all() {
        // One thread fills and frees an entry as fast as it can, each
        // instance with every field equal to its number; another reads it.
        // A copy mixing two instances (the thread id of one, the CPU time
        // of another) is what made the monitor see a section run for far
        // longer than it did.
        let region = Region::create("watch-test", std::mem::size_of::<WatchTable>()).unwrap();
        let t: &'static WatchTable = Box::leak(Box::new(region)).at(0);
        let a = &t.active[0];
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let writer = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut k = 1u32;
                while !stop.load(Ordering::Relaxed) {
                    a.state.store(ACTIVE_FILLING, Ordering::Relaxed);
                    let v = ActiveView {
                        instance: 0,
                        section: k,
                        tid: k,
                        expect: k,
                        cpu_enter: u64::from(k),
                    };
                    a.fill(v, 7);
                    // In for a varying while, so that reads overlap both
                    // the instance and its end.
                    for _ in 0..k % 64 {
                        std::hint::spin_loop();
                    }
                    a.state.store(ACTIVE_FREE, Ordering::Release);
                    k = k.wrapping_add(1);
                }
            })
        };
        let (mut whole, mut reads) = (0u64, 0u64);
        let end = std::time::Instant::now() + std::time::Duration::from_millis(300);
        while std::time::Instant::now() < end {
            reads += 1;
            if let Some(v) = a.read(7) {
                whole += 1;
                assert!(
                    v.section == v.tid && v.expect == v.tid && v.cpu_enter == u64::from(v.tid),
                    "a torn copy: {v:?}"
                );
                assert_eq!(v.instance & 1, 0, "{v:?}");
            }
            assert!(a.read(8).is_none(), "another incarnation's entry");
        }
        stop.store(true, Ordering::Relaxed);
        writer.join().unwrap();
        println!("{whole} whole copies in {reads} reads");
    }

    /// A thread's id cached in another process (as a restore into a new
    /// incarnation leaves the image's in its thread-local storage) is
    /// asked again; one cached in this process is kept.
    #[test]
    fn a_thread_id_cached_in_another_process_is_asked_again() {
        let pid = rustix::process::getpid().as_raw_nonzero().get() as u32;
        let real = rustix::thread::gettid().as_raw_nonzero().get() as u32;
        let other = pid.wrapping_add(1);
        TID.with(|t| t.set((other, 4_000_000)));
        assert_eq!(tid(other), 4_000_000, "cached for that process");
        assert_eq!(tid(pid), real, "asked again in this one");
        assert_eq!(TID.with(Cell::get), (pid, real));
    }

    #[test]
    fn stretches_are_odd_and_blocking_ends_them() {
        let region = Region::create("watch-test", std::mem::size_of::<WatchTable>()).unwrap();
        let t: &'static WatchTable = Box::leak(Box::new(region)).at(0);
        let e = &t.workers[0];
        e.begin(3);
        assert!(e.in_stretch());
        WORKER.with(|w| w.set(Some(e)));
        let seen = blocking(|| e.in_stretch());
        assert!(!seen, "a blocking wait runs outside the stretch");
        assert!(e.in_stretch(), "and a new stretch starts after it");
        assert_eq!(e.func.load(Ordering::Relaxed), 3);
        e.end();
        assert!(!e.in_stretch());
        assert_eq!(
            e.seq.load(Ordering::Relaxed),
            4,
            "two stretches, each odd then even"
        );
        WORKER.with(|w| w.set(None));
    }
}

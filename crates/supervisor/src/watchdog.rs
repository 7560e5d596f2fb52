//! The watchdog's monitor (RMK's SHD and AHD, on CPU time): a supervisor
//! thread that samples every live component's watch table
//! (`kintsugi_runtime::watchdog`) each period and reports a hang through the
//! [`Roster`], which makes the supervisor kill and reboot the incarnation as
//! for a crash.
//!
//! Progress is CPU time, read from `/proc/PID/task/TID/schedstat` (the
//! first field, the scheduler's `sum_exec_runtime`; one `pread` on a kept
//! descriptor). The kernel brings a running thread's figure up to date at
//! every scheduler tick and context switch, so a reading may lag by up to
//! a tick: the `floor` bound covers it.
//!
//! - **SHD**: a stretch seen odd with the same sequence number on two
//!   samples is running long; its CPU time is read from then on. Its
//!   progress (CPU since that second sighting, a lower bound, so that a
//!   thread preempted under load never looks busy) past the worker's bound
//!   is a hang. The bound is `margin` × the largest of the last `window`
//!   measured stretches of that worker (kept across reboots), at least
//!   `floor`, and `default_bound` while the window fills. A worker inside a
//!   checked section is judged by the section instead.
//! - **Timestamp check**: a thread inside a stretch that neither runs nor
//!   waits on a run queue for `stuck` (stopped, or waiting for ever where
//!   no wait was declared) is hung. Progress is schedstat's CPU time or
//!   run-queue wait (its second field) moving, or the thread being
//!   runnable now (state `R`): the run-queue wait grows only when a queued
//!   thread gets the CPU, so a thread starved by load for longer than a
//!   period shows only in its state. Load alone never looks like a hang.
//! - **Unserved requests**: a request that waits in a channel slot for
//!   `stuck` while the slot's worker holds none (its `taken` count even and
//!   unchanged) and neither runs nor waits to run was never taken: the
//!   worker is lost (asleep on a wrong address, say, after a bit flip in
//!   the pointer it waits on).
//! - **AHD**: an active section instance whose thread has run longer than
//!   the section's check value since it entered is hung. The check value is
//!   `margin` × the largest run in the window of the exit with the largest
//!   runs (or of the exit the code said it expects), at least `min_section`,
//!   and `default_bound` until that history holds a full window.
//! - **Suspected incarnations**: a client that got a reply no correct
//!   server gives marks the server's epoch in the edge header
//!   (`EdgeHeader::suspected`); the live incarnation named there is
//!   reported as faulty, not hung, and rebooted like the rest.

use std::collections::HashMap;
use std::fmt;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kintsugi_runtime::abi::boot::ControlBlock;
use kintsugi_runtime::abi::channel::{state as slot_state, Edge};
use kintsugi_runtime::stub::InterfaceInfo;
use kintsugi_runtime::watchdog::{WatchTable, EXITS, WORKERS};
use kintsugi_system::WatchdogSettings;

use crate::roster::{call_name, FaultReport, Roster};

/// How a hang was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HangKind {
    /// A stretch ran past its worker's adaptive bound.
    Shd,
    /// A section instance ran past its check value.
    Ahd,
    /// No CPU progress inside a stretch for the `stuck` time.
    Stuck,
    /// A request waited in a slot for the `stuck` time while the slot's
    /// worker held none: the worker lost track of its slot (e.g. it sleeps
    /// on a wrong address after a corrupted pointer).
    Unserved,
}

impl HangKind {
    fn as_str(self) -> &'static str {
        match self {
            HangKind::Shd => "shd",
            HangKind::Ahd => "ahd",
            HangKind::Stuck => "stuck",
            HangKind::Unserved => "unserved",
        }
    }
}

/// One detected hang. Its `Display` is the detail of the fault report (and
/// of `Event::FaultReported`); [`FromStr`] reads it back.
///
/// ```text
/// hang detected: kind=shd tid=4242 thread=spin:0 call=spin.hang section=- measured_us=20950 bound_us=20000 wall_us=21400
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Detection {
    pub kind: HangKind,
    pub tid: u32,
    /// `interface:slot` for a server worker, else the thread's name.
    pub thread: String,
    /// The invocation in progress (`interface.function`), if any.
    pub call: Option<String>,
    pub section: Option<String>,
    /// CPU time consumed (shd, ahd) or time without CPU progress (stuck).
    pub measured: Duration,
    /// What `measured` was held against.
    pub bound: Duration,
    /// SHD: the wall time in which `measured` was used (about as long: the
    /// thread ran all along; much longer: it shared its CPU).
    pub wall: Option<Duration>,
}

const PREFIX: &str = "hang detected: ";

impl fmt::Display for Detection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let dash = |o: &Option<String>| o.clone().unwrap_or_else(|| "-".into());
        write!(
            f,
            "{PREFIX}kind={} tid={} thread={} call={} section={} measured_us={} bound_us={}",
            self.kind.as_str(),
            self.tid,
            self.thread.replace(' ', "_"),
            dash(&self.call),
            dash(&self.section),
            self.measured.as_micros(),
            self.bound.as_micros()
        )?;
        match self.wall {
            Some(w) => write!(f, " wall_us={}", w.as_micros()),
            None => Ok(()),
        }
    }
}

impl FromStr for Detection {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let rest = s
            .strip_prefix(PREFIX)
            .ok_or_else(|| format!("not a hang detection: {s}"))?;
        let fields: HashMap<&str, &str> = rest
            .split(' ')
            .filter_map(|kv| kv.split_once('='))
            .collect();
        let get = |k: &str| {
            fields
                .get(k)
                .copied()
                .ok_or_else(|| format!("no `{k}` in: {s}"))
        };
        let num = |k: &str| -> Result<u64, String> {
            get(k)?.parse().map_err(|_| format!("bad `{k}` in: {s}"))
        };
        let opt = |k: &str| get(k).map(|v| (v != "-").then(|| v.to_string()));
        Ok(Self {
            kind: match get("kind")? {
                "shd" => HangKind::Shd,
                "ahd" => HangKind::Ahd,
                "stuck" => HangKind::Stuck,
                "unserved" => HangKind::Unserved,
                k => return Err(format!("unknown hang kind `{k}`")),
            },
            tid: num("tid")? as u32,
            thread: get("thread")?.to_string(),
            call: opt("call")?,
            section: opt("section")?,
            measured: Duration::from_micros(num("measured_us")?),
            bound: Duration::from_micros(num("bound_us")?),
            wall: num("wall_us").ok().map(Duration::from_micros),
        })
    }
}

/// The running monitor; dropping it stops the thread.
pub struct Monitor {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Monitor {
    /// Samples every `settings.period` the components that `per` (their
    /// own settings, by name) says are watched.
    pub fn start(
        roster: Arc<Roster>,
        settings: WatchdogSettings,
        per: HashMap<String, WatchdogSettings>,
        interfaces: Vec<&'static InterfaceInfo>,
    ) -> std::io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::Builder::new()
            .name("watchdog".into())
            .spawn(move || {
                let mut m = Sampler {
                    settings,
                    per,
                    interfaces,
                    comps: HashMap::new(),
                };
                while !s.load(Ordering::Relaxed) {
                    std::thread::sleep(m.settings.period);
                    m.sample(&roster);
                }
            })?;
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What the monitor keeps per worker thread slot.
#[derive(Default)]
struct WorkerState {
    /// Measured stretches (CPU ns), the most recent last; kept across reboots.
    window: Vec<u64>,
    /// Stretches measured so far.
    measured: u64,
    /// The odd sequence number last seen, and how often in a row.
    seq: u64,
    sightings: u32,
    /// CPU at the second sighting and when it was read, the latest CPU
    /// read, and when it last moved.
    base_cpu: u64,
    base_at: Option<Instant>,
    last_cpu: u64,
    /// Run-queue wait at the latest read.
    last_waited: u64,
    moved_at: Option<Instant>,
    /// Since when the worker's slot has held a request it has not taken,
    /// with the worker's `taken` count and CPU and run-queue times then.
    unserved: Option<Unserved>,
}

impl WorkerState {
    /// The tracked stretch is over: its progress joins the window.
    fn close(&mut self, window: usize) {
        if self.sightings >= 2 {
            self.window
                .push(self.last_cpu.saturating_sub(self.base_cpu));
            if self.window.len() > window {
                self.window.remove(0);
            }
            self.measured += 1;
        }
        self.seq = 0;
        self.sightings = 0;
        self.moved_at = None;
    }
}

/// A request waiting in a slot its worker has not taken.
#[derive(Clone, Copy)]
struct Unserved {
    since: Instant,
    taken: u64,
    cpu: u64,
    waited: u64,
    /// The request's sequence number in its slot (the client's count of
    /// its calls): the same request waits for as long as it stays.
    request: u64,
    /// The worker's CPU time when this request was first seen waiting
    /// (kept while it and `taken` stay).
    ran_from: u64,
}

/// One component as the monitor sees it.
#[derive(Default)]
struct CompState {
    /// The incarnation the per-thread state belongs to, and how often it
    /// had been rolled back in place.
    pid: u32,
    rollbacks: u64,
    /// A hang of this incarnation was reported: leave it alone.
    reported: bool,
    workers: Vec<WorkerState>,
    /// Open schedstat files by thread id.
    stats: HashMap<u32, File>,
    /// The checkpoint thread's freezes of it, at the last sample, and
    /// until when the threads' movement may be a freeze's.
    freezes: u64,
    rebase_until: Option<Instant>,
}

/// How long after a checkpoint's freeze began, or after its thaw, a
/// thread's CPU time or run-queue wait moving is not taken for progress
/// (each takes a few ms at most; the freeze itself may last longer).
const FREEZE_SHADOW: Duration = Duration::from_millis(20);

struct Sampler {
    /// The system's (its period is the sampling period).
    settings: WatchdogSettings,
    /// Each component's own.
    per: HashMap<String, WatchdogSettings>,
    interfaces: Vec<&'static InterfaceInfo>,
    comps: HashMap<String, CompState>,
}

impl Sampler {
    fn sample(&mut self, roster: &Roster) {
        for member in roster.members() {
            let (Some(pid), Some(control)) = (member.pid, roster.control(&member.name)) else {
                continue;
            };
            let settings = self.per.get(&member.name).unwrap_or(&self.settings);
            if !settings.enabled {
                continue;
            }
            let ctl: &ControlBlock = control.at(0);
            let st = self.comps.entry(member.name.clone()).or_default();
            if st.pid != pid || st.rollbacks != member.rollbacks {
                st.pid = pid;
                st.rollbacks = member.rollbacks;
                st.reported = false;
                st.stats.clear();
                st.workers.resize_with(WORKERS, WorkerState::default);
                for w in &mut st.workers {
                    w.seq = 0;
                    w.sightings = 0;
                    w.moved_at = None;
                    w.unserved = None;
                }
            }
            // A checkpoint's freeze and its thaw run every thread a little
            // (into and out of a ptrace-stop; the count is raised at both):
            // not progress of a hung one, for a while after.
            let freezes = roster.freezes(&member.name);
            let now = Instant::now();
            if std::mem::replace(&mut st.freezes, freezes) != freezes {
                st.rebase_until = Some(now + FREEZE_SHADOW);
            }
            let rebase = st.rebase_until.is_some_and(|t| now < t);
            if st.reported {
                continue;
            }
            let served = roster.served(&member.name);
            let edges: Vec<Arc<Edge>> = served.iter().map(|(_, e)| e.clone()).collect();
            let found = suspected(&self.interfaces, &edges).or_else(|| {
                check(settings, &ctl.watch, pid, st, rebase)
                    .or_else(|| unserved(settings, &ctl.watch, &edges, pid, st, rebase))
                    .map(|d| name_call(&self.interfaces, &served, d).to_string())
            });
            if let Some(detail) = found {
                st.reported = true;
                tracing::warn!(component = %member.name, "{detail}");
                roster.report_fault(FaultReport {
                    component: member.name.clone(),
                    pid,
                    detail,
                    hang: true,
                });
            }
        }
    }
}

/// A client's suspicion of the live incarnation on one of `edges` (an
/// impossible reply, see [`kintsugi_runtime::client`]), as a fault report's
/// detail: `faulty reply: interface=… epoch=…`.
fn suspected(interfaces: &[&'static InterfaceInfo], edges: &[Arc<Edge>]) -> Option<String> {
    edges.iter().find_map(|edge| {
        let h = edge.header();
        let epoch = h.epoch.load(Ordering::SeqCst);
        (epoch != 0 && h.suspected.load(Ordering::SeqCst) == epoch).then(|| {
            let hash = h.interface_hash.load(Ordering::SeqCst);
            let interface = interfaces.iter().find(|i| i.hash == hash).map_or("?", |i| i.name);
            format!("faulty reply: interface={interface} epoch={epoch} (a client found a reply no correct server gives)")
        })
    })
}

/// Replaces a function number (`call` = "interface#func") by its name, as
/// [`call_name`] names it on a `served` edge of that interface.
fn name_call(
    interfaces: &[&'static InterfaceInfo],
    served: &[(String, Arc<Edge>)],
    mut d: Detection,
) -> Detection {
    if let Some(raw) = d.call.take() {
        let (iface, func) = raw.split_once('#').unwrap_or((raw.as_str(), "0"));
        let func: u32 = func.parse().unwrap_or(0);
        d.call = Some(match served.iter().find(|(i, _)| i == iface) {
            Some((_, edge)) => call_name(interfaces, iface, edge, func),
            None => format!("{iface}.#{func}"),
        });
    }
    d
}

/// A thread's CPU time and its time spent waiting runnable on a run queue
/// (ns), from its schedstat file kept open in `stats`.
fn sched_ns(stats: &mut HashMap<u32, File>, pid: u32, tid: u32) -> Option<(u64, u64)> {
    if let std::collections::hash_map::Entry::Vacant(e) = stats.entry(tid) {
        let f = File::open(format!("/proc/{pid}/task/{tid}/schedstat")).ok()?;
        e.insert(f);
    }
    let mut buf = [0u8; 96];
    let n = stats.get(&tid)?.read_at(&mut buf, 0).ok()?;
    let mut fields = std::str::from_utf8(&buf[..n]).ok()?.split_whitespace();
    let cpu = fields.next()?.parse().ok()?;
    let waited = fields.next()?.parse().ok()?;
    Some((cpu, waited))
}

/// Whether a thread is running or waits on a run queue (state `R` in
/// `/proc/PID/task/TID/stat`). Schedstat's run-queue wait grows only when
/// a queued thread gets the CPU, so a thread starved by load for longer
/// than a sampling period looks, from schedstat alone, like one that
/// sleeps: read only when schedstat has not moved.
fn runnable(pid: u32, tid: u32) -> bool {
    std::fs::read(format!("/proc/{pid}/task/{tid}/stat")).is_ok_and(|stat| {
        // `pid (comm) S …`: the state follows the last `)`; comm may hold
        // anything, `)` included.
        let after = stat.iter().rposition(|&b| b == b')').map_or(0, |i| i + 1);
        stat[after..].iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'R')
    })
}

fn thread_name(pid: u32, tid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm"))
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "?".into())
}

/// One sample of one incarnation's table: the first hang found, if any.
fn check(
    s: &WatchdogSettings,
    t: &WatchTable,
    pid: u32,
    st: &mut CompState,
    rebase: bool,
) -> Option<Detection> {
    let now = Instant::now();
    let window = s.window as usize;
    // Threads inside a checked section, which judges them instead of SHD.
    let mut in_section = Vec::new();
    for a in &t.active {
        let Some(view) = a.read(pid) else {
            continue;
        };
        let sec = &t.sections[view.section as usize % t.sections.len()];
        if sec.checked.load(Ordering::Acquire) == 0 {
            continue;
        }
        let tid = view.tid;
        in_section.push(tid);
        let Some((cpu, _)) = sched_ns(&mut st.stats, pid, tid) else {
            continue;
        };
        let ran = cpu.saturating_sub(view.cpu_enter);
        let expect = view.expect;
        let exits: Vec<(u64, u64)> = match expect {
            0 => sec.exits.iter().map(|h| h.window_max(window)).collect(),
            e => vec![sec.exits[(e as usize - 1).min(EXITS - 1)].window_max(window)],
        };
        let runs: u64 = exits.iter().map(|(_, r)| r).sum();
        let largest = exits.iter().map(|(m, _)| *m).max().unwrap_or(0);
        let bound = if runs < window as u64 {
            s.default_bound
        } else {
            s.min_section
                .max(Duration::from_nanos((largest as f64 * s.margin) as u64))
        };
        // Re-check that the instance is still the same before blaming it.
        if Duration::from_nanos(ran) > bound && a.still(&view) {
            return Some(Detection {
                kind: HangKind::Ahd,
                tid,
                thread: thread_name(pid, tid),
                call: None,
                section: sec.name.get(),
                measured: Duration::from_nanos(ran),
                bound,
                wall: None,
            });
        }
    }
    for (i, e) in t.workers.iter().enumerate() {
        let tid = e.tid.load(Ordering::Relaxed);
        if tid == 0 || e.pid.load(Ordering::Relaxed) != pid {
            continue;
        }
        let w = &mut st.workers[i];
        let seq = e.seq.load(Ordering::Acquire);
        if seq & 1 == 0 || seq != w.seq {
            if w.seq != 0 {
                w.close(window);
            }
            if seq & 1 == 1 {
                w.seq = seq;
                w.sightings = 1;
            }
            continue;
        }
        let Some((cpu, waited)) = sched_ns(&mut st.stats, pid, tid) else {
            continue;
        };
        if w.sightings == 1 {
            w.sightings = 2;
            w.base_cpu = cpu;
            w.base_at = Some(now);
            w.last_cpu = cpu;
            w.last_waited = waited;
            w.moved_at = Some(now);
            continue;
        }
        // A thread that waits on a run queue is starved by load, not hung.
        if cpu != w.last_cpu || waited != w.last_waited || runnable(pid, tid) {
            if !rebase || runnable(pid, tid) {
                w.moved_at = Some(now);
            }
            w.last_cpu = cpu;
            w.last_waited = waited;
        }
        let name = e.name.get().unwrap_or_default();
        let call = Some(format!(
            "{}#{}",
            name.split(':').next().unwrap_or(""),
            e.func.load(Ordering::Relaxed)
        ));
        let still = now.duration_since(w.moved_at.unwrap_or(now));
        let found = if still >= s.stuck {
            Some((HangKind::Stuck, still, s.stuck))
        } else {
            let progress = Duration::from_nanos(cpu.saturating_sub(w.base_cpu));
            let bound = if (w.measured as usize) < window {
                s.default_bound
            } else {
                let largest = w.window.iter().copied().max().unwrap_or(0);
                s.floor
                    .max(Duration::from_nanos((largest as f64 * s.margin) as u64))
            };
            (progress > bound && !in_section.contains(&tid)).then_some((
                HangKind::Shd,
                progress,
                bound,
            ))
        };
        // Only if the stretch is still the one measured.
        if let Some((kind, measured, bound)) =
            found.filter(|_| e.seq.load(Ordering::Acquire) == seq)
        {
            return Some(Detection {
                kind,
                tid,
                thread: name,
                call,
                section: None,
                measured,
                bound,
                wall: (kind == HangKind::Shd)
                    .then(|| w.base_at.map(|at| now.duration_since(at)))
                    .flatten(),
            });
        }
    }
    None
}

/// The unserved-request check: worker `i` serves slot `i` of the served
/// edges' slots, in order (as the runtime starts them).
fn unserved(
    s: &WatchdogSettings,
    t: &WatchTable,
    edges: &[Arc<Edge>],
    pid: u32,
    st: &mut CompState,
    rebase: bool,
) -> Option<Detection> {
    let now = Instant::now();
    let stuck_ns = u64::try_from(s.stuck.as_nanos()).unwrap_or(u64::MAX);
    let slots = edges
        .iter()
        .flat_map(|e| (0..e.slot_count()).map(move |slot| (e, slot)));
    for ((i, e), (edge, slot)) in t.workers.iter().enumerate().zip(slots) {
        let tid = e.tid.load(Ordering::Relaxed);
        if tid == 0 || e.pid.load(Ordering::Relaxed) != pid {
            continue;
        }
        let taken = e.taken.load(Ordering::Acquire);
        let request = edge.slot(slot).seq.load(Ordering::Acquire);
        let waiting = edge.slot(slot).state.load(Ordering::Acquire) == slot_state::REQUEST;

        if !waiting || taken & 1 == 1 {
            st.workers[i].unserved = None;
            continue;
        }
        let Some((cpu, waited)) = sched_ns(&mut st.stats, pid, tid) else {
            continue;
        };
        // The worker lost track of its slot, after `measured`.
        let lost = |measured| Detection {
            kind: HangKind::Unserved,
            tid,
            thread: e.name.get().unwrap_or_default(),
            call: None,
            section: None,
            measured,
            bound: s.stuck,
            wall: None,
        };
        let w = &mut st.workers[i];
        // In a freeze's shadow, the thread's movement is the freeze's:
        // caught runnable (into or out of its ptrace-stop, which under
        // load takes a while), it is not seen at all, lest the clock
        // start again at every checkpoint; seen asleep, its times are the
        // new baseline, and it is judged on that sighting (a second read
        // could catch it on its way into or out of the stop).
        let mut seen_asleep = false;
        if let Some(u) = w.unserved.as_mut().filter(|u| rebase && u.taken == taken) {
            if runnable(pid, tid) {
                continue;
            }
            (u.cpu, u.waited) = (cpu, waited);
            seen_asleep = true;
        }
        match w.unserved {
            // The worker has run for `stuck` of CPU time with the request
            // waiting and not taken: it spins somewhere other than on its
            // slot (an every-register flip in its wait's spin: 3 and 7 of
            // 40 flips into evt, found only by the campaign's stall check).
            // A sound worker takes a posted request within microseconds of
            // running; what else it runs with the slot's request waiting
            // (a replay of the log, in a checkpoint-recovered server) takes
            // far less. CPU time, not wall time: a worker starved by load
            // gains none.
            Some(u)
                if u.taken == taken
                    && u.request == request
                    && cpu.saturating_sub(u.ran_from) >= stuck_ns =>
            {
                return Some(lost(Duration::from_nanos(cpu - u.ran_from)));
            }
            // The worker neither ran nor waited to run since, and is not
            // runnable now: it sleeps somewhere other than on its slot.
            Some(u)
                if u.taken == taken
                    && u.cpu == cpu
                    && u.waited == waited
                    && (seen_asleep || !runnable(pid, tid)) =>
            {
                let waited = now.duration_since(u.since);
                if waited >= s.stuck {
                    return Some(lost(waited));
                }
            }
            _ => {
                let ran_from = w
                    .unserved
                    .filter(|u| u.taken == taken && u.request == request)
                    .map_or(cpu, |u| u.ran_from);
                w.unserved = Some(Unserved {
                    since: now,
                    taken,
                    cpu,
                    waited,
                    request,
                    ran_from,
                })
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A worker that runs (spins) with a request waiting in its slot and
    /// never takes it is unserved once it has run for `stuck` of CPU time;
    /// the same worker holding a request (serving it) is not.
    #[test]
    fn a_worker_that_spins_past_a_waiting_request_is_unserved() {
        use kintsugi_runtime::abi::shm::Region;
        use std::sync::atomic::AtomicU32;
        let region = Region::create("watch-spin", std::mem::size_of::<WatchTable>()).unwrap();
        let table: &WatchTable = region.at(0);
        let edge = Arc::new(Edge::create("watch-spin", 1).unwrap());
        edge.slot(0)
            .state
            .store(slot_state::REQUEST, Ordering::SeqCst);
        let stop = Arc::new(AtomicBool::new(false));
        let tid = Arc::new(AtomicU32::new(0));
        let spinner = {
            let (stop, tid) = (stop.clone(), tid.clone());
            std::thread::spawn(move || {
                tid.store(
                    rustix::thread::gettid().as_raw_nonzero().get() as u32,
                    Ordering::SeqCst,
                );
                while !stop.load(Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            })
        };
        while tid.load(Ordering::SeqCst) == 0 {
            std::thread::yield_now();
        }
        let pid = std::process::id();
        let worker = &table.workers[0];
        worker
            .tid
            .store(tid.load(Ordering::SeqCst), Ordering::SeqCst);
        worker.pid.store(pid, Ordering::SeqCst);
        let settings = WatchdogSettings {
            enabled: true,
            stuck: Duration::from_millis(50),
            ..WatchdogSettings::default()
        };
        let detect = |taken: u64, within: Duration| {
            worker.taken.store(taken, Ordering::SeqCst);
            let mut st = CompState::default();
            st.workers.resize_with(WORKERS, WorkerState::default);
            let until = Instant::now() + within;
            while Instant::now() < until {
                let edges = [edge.clone()];
                if let Some(d) = unserved(&settings, table, &edges, pid, &mut st, false) {
                    return Some(d);
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            None
        };
        // Holding a request (taken odd): serving it, however long.
        assert!(detect(1, Duration::from_millis(400)).is_none());
        // Taken and answered two, the third waits: it spins past it.
        let d = detect(2, Duration::from_secs(20)).expect("a spinning worker is unserved");
        assert_eq!(d.kind, HangKind::Unserved);
        assert!(d.measured >= settings.stuck, "{:?}", d.measured);
        stop.store(true, Ordering::SeqCst);
        spinner.join().unwrap();
    }

    #[test]
    fn a_call_is_named_by_the_built_in_interfaces_else_by_the_edge_it_is_served_on() {
        static TALLY: InterfaceInfo = InterfaceInfo {
            name: "tally",
            hash: 7,
            functions: &["add", "total"],
            readonly: &[],
        };
        let edge = Arc::new(Edge::create("watchdog-names", 1).unwrap());
        edge.register_functions(&TALLY);
        edge.header()
            .interface_hash
            .store(TALLY.hash, std::sync::atomic::Ordering::Relaxed);
        let served = vec![("tally".to_string(), edge)];
        let detection = |call: &str| Detection {
            kind: HangKind::Stuck,
            tid: 1,
            thread: "tally:0".into(),
            call: Some(call.into()),
            section: None,
            measured: Duration::ZERO,
            bound: Duration::ZERO,
            wall: None,
        };
        let named = |interfaces: &[&'static InterfaceInfo], call: &str| {
            name_call(interfaces, &served, detection(call))
                .call
                .unwrap()
        };
        assert_eq!(
            named(&[], "tally#1"),
            "tally.total",
            "registered in the edge"
        );
        assert_eq!(named(&[&TALLY], "tally#0"), "tally.add", "built in");
        assert_eq!(named(&[], "tally#9"), "tally.#9", "no such function");
        assert_eq!(named(&[], "other#0"), "other.#0", "no such edge");
    }

    #[test]
    fn a_detection_reads_back_from_its_detail() {
        let d = Detection {
            kind: HangKind::Shd,
            tid: 4242,
            thread: "spin:0".into(),
            call: Some("spin.hang".into()),
            section: None,
            measured: Duration::from_micros(20950),
            bound: Duration::from_millis(20),
            wall: Some(Duration::from_micros(21400)),
        };
        let text = d.to_string();
        assert_eq!(
            text,
            "hang detected: kind=shd tid=4242 thread=spin:0 call=spin.hang section=- measured_us=20950 bound_us=20000 wall_us=21400"
        );
        assert_eq!(text.parse::<Detection>(), Ok(d));
        assert!("crashed".parse::<Detection>().is_err());
    }

    #[test]
    fn a_worker_window_slides_over_measured_stretches_only() {
        let mut w = WorkerState {
            seq: 1,
            sightings: 1,
            ..Default::default()
        };
        w.close(3);
        assert_eq!(
            (w.window.len(), w.measured),
            (0, 0),
            "seen once: not measured"
        );
        for ns in [5, 9, 7, 3] {
            w.seq = 1;
            w.sightings = 2;
            w.base_cpu = 100;
            w.last_cpu = 100 + ns;
            w.close(3);
        }
        assert_eq!(w.window, vec![9, 7, 3]);
        assert_eq!(w.measured, 4);
    }
}

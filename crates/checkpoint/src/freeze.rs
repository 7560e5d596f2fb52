//! Holding every thread of a process still: each is seized with
//! `PTRACE_SEIZE` and stopped with `PTRACE_INTERRUPT`, the thread list read
//! again until no new thread appears (one not yet stopped may have been
//! creating one), and each stop collected with `waitid(WSTOPPED)` on that
//! thread alone (never `WEXITED`, so that an exit status belonging to the
//! target's parent is never consumed here). Dropping a [`Frozen`] detaches
//! every thread, which then runs on from its (possibly rewritten)
//! registers.

use std::collections::BTreeSet;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::libc::user_regs_struct;
use nix::sys::ptrace;
use nix::sys::signal::Signal;
use nix::sys::wait::{waitid, Id, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

use crate::Error;

/// How long one thread may take to reach its stop.
const STOP_TIMEOUT: Duration = Duration::from_secs(5);

/// The thread ids of process `pid`, leader first.
pub fn thread_ids(pid: u32) -> Result<Vec<u32>, Error> {
    let dir = format!("/proc/{pid}/task");
    let entries = std::fs::read_dir(&dir).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => Error::Gone(pid),
        _ => Error::proc(&dir, e),
    })?;
    let mut tids: Vec<u32> = entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    tids.sort_by_key(|&t| (t != pid, t));
    Ok(tids)
}

/// Every thread of one process, each in a ptrace-stop.
pub struct Frozen {
    pid: u32,
    /// Leader first, then by tid.
    tids: Vec<u32>,
    /// When the first thread was stopped.
    since: Instant,
    /// Signals that reached a thread while it was held (a stop for its
    /// delivery was collected instead of the stop asked for, which takes
    /// the signal away): sent to it again as it is let go, so that none is
    /// lost.
    signals: Mutex<Vec<(u32, Signal)>>,
}

impl Frozen {
    /// Stops every thread of process `pid`.
    pub fn freeze(pid: u32) -> Result<Self, Error> {
        let since = Instant::now();
        let mut frozen = Frozen {
            pid,
            tids: Vec::new(),
            since,
            signals: Mutex::new(Vec::new()),
        };
        let mut seen = BTreeSet::new();
        loop {
            let mut fresh = Vec::new();
            for tid in thread_ids(pid)? {
                if seen.insert(tid) {
                    fresh.push(tid);
                }
            }
            if fresh.is_empty() {
                break;
            }
            for tid in fresh {
                match seize(pid, tid) {
                    Ok(()) => frozen.tids.push(tid),
                    // Seized, then gone before the interrupt (killed): it
                    // is traced from here, and must be let go or collected
                    // with the others, or its death holds back its
                    // process's.
                    Err(Seize::Interrupt(e)) => {
                        frozen.tids.push(tid);
                        return Err(e);
                    }
                    // It exited between the listing and the seize.
                    Err(Seize::Attach(Error::Gone(_))) if tid != pid => {}
                    Err(Seize::Attach(e)) => return Err(e),
                }
            }
        }
        for &tid in &frozen.tids {
            let stop = wait_stop(pid, tid)?;
            frozen.keep_signal(tid, &stop);
        }
        frozen.tids.sort_by_key(|&t| (t != pid, t));
        Ok(frozen)
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The stopped threads, leader first.
    pub fn tids(&self) -> &[u32] {
        &self.tids
    }

    /// How long the process has been held.
    pub fn held(&self) -> Duration {
        self.since.elapsed()
    }

    pub fn regs(&self, tid: u32) -> Result<user_regs_struct, Error> {
        ptrace::getregs(Pid::from_raw(tid as i32)).map_err(|e| Error::ptrace(tid, e))
    }

    /// The thread's extended register state (`xsave` layout).
    pub fn xstate(&self, tid: u32) -> Result<Vec<u8>, Error> {
        crate::sys::get_xstate(tid as i32).map_err(|e| Error::Kernel {
            what: "PTRACE_GETREGSET NT_X86_XSTATE",
            source: e,
        })
    }

    pub fn set_regs(&self, tid: u32, regs: user_regs_struct) -> Result<(), Error> {
        ptrace::setregs(Pid::from_raw(tid as i32), regs).map_err(|e| Error::ptrace(tid, e))
    }

    /// Executes one instruction of `tid` and waits until it stops again.
    ///
    /// A thread let go from a stop first takes a signal pending for it or
    /// its process (one that came while it was held), and stops to report
    /// it before the instruction runs: the signal is kept to be sent again
    /// on release, and the step made again.
    pub fn step(&self, tid: u32) -> Result<(), Error> {
        self.start_step(tid)?;
        self.finish_step(tid)
    }

    /// Lets `tid` execute one instruction, without waiting for it: several
    /// threads can step at once, each collected by [`Frozen::finish_step`].
    pub fn start_step(&self, tid: u32) -> Result<(), Error> {
        ptrace::step(Pid::from_raw(tid as i32), None::<Signal>).map_err(|e| Error::ptrace(tid, e))
    }

    /// Waits until `tid`, let go by [`Frozen::start_step`], has executed its
    /// instruction and stopped again (see [`Frozen::step`]).
    pub fn finish_step(&self, tid: u32) -> Result<(), Error> {
        for _ in 0..MAX_SIGNALS_PER_STEP {
            let stop = wait_stop(self.pid, tid)?;
            match stop {
                WaitStatus::PtraceEvent(_, Signal::SIGTRAP, _)
                | WaitStatus::Stopped(_, Signal::SIGTRAP) => return Ok(()),
                _ if delivered_signal(&stop).is_some() => {
                    self.keep_signal(tid, &stop);
                    self.start_step(tid)?;
                }
                other => {
                    return Err(Error::Malformed {
                        what: format!("thread {tid}"),
                        detail: format!("a single step stopped with {other:?}"),
                    })
                }
            }
        }
        Err(Error::Malformed {
            what: format!("thread {tid}"),
            detail: format!(
                "a single step stopped for a signal {MAX_SIGNALS_PER_STEP} times in a row"
            ),
        })
    }

    /// Notes the signal of a signal-delivery stop (not a ptrace event's).
    fn keep_signal(&self, tid: u32, stop: &WaitStatus) {
        if let Some(sig) = delivered_signal(stop) {
            self.signals
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((tid, sig));
        }
    }
}

/// How many signals a single step may find pending before it runs (each
/// standard signal is pending at most once).
const MAX_SIGNALS_PER_STEP: usize = 64;

/// The signal a stop reports as being delivered, if it is a
/// signal-delivery stop; `None` for a ptrace event's stop (an interrupt, a
/// group stop) and for a single step's trap.
///
/// `waitid` reports every stop of a traced thread as `CLD_TRAPPED` with
/// the whole stop code in `si_status`, which nix turns into
/// [`WaitStatus::PtraceEvent`] even for a signal's delivery: event 0 is
/// that case. (`waitpid` would give [`WaitStatus::Stopped`]; both are
/// read.) Reading only the latter lost every signal that reached a thread
/// during a freeze: detaching without it suppressed it.
fn delivered_signal(stop: &WaitStatus) -> Option<Signal> {
    let sig = match *stop {
        WaitStatus::Stopped(_, sig) | WaitStatus::PtraceEvent(_, sig, 0) => sig,
        _ => return None,
    };
    (sig != Signal::SIGTRAP).then_some(sig)
}

impl Drop for Frozen {
    fn drop(&mut self) {
        let mut signals = std::mem::take(self.signals.get_mut().unwrap_or_else(|e| e.into_inner()));
        for &tid in &self.tids {
            let t = Pid::from_raw(tid as i32);
            if ptrace::detach(t, None) != Err(Errno::ESRCH) {
                continue;
            }
            // Not in a stop: seized and interrupted, its stop not yet
            // collected (a freeze that failed part way), or dead. Left
            // so, it would stop later and stay stopped, traced from here
            // (a hang), and its zombie would hold back its process's
            // death report (a lost system): collect its stop and let it
            // go, or collect its zombie.
            match wait_stop(self.pid, tid) {
                Ok(stop) => {
                    if let Some(sig) = delivered_signal(&stop) {
                        signals.push((tid, sig));
                    }
                    let _ = ptrace::detach(t, None);
                }
                Err(_) if tid != self.pid => reap_traced(self.pid, tid),
                Err(_) => {}
            }
        }
        // Sent again rather than handed to the detach, which delivers a
        // signal only from the stop that reported it (a thread stepped
        // since is in another).
        for &(tid, sig) in &signals {
            let _ = crate::sys::tgkill(self.pid as i32, tid as i32, sig as i32);
        }
        wake_for_pending(self.pid, &self.tids);
    }
}

/// A signal sent while every thread was held stays pending without any
/// thread being told (the kernel picks a thread to wake when the signal
/// comes, and a traced thread in a stop is none): a thread let go returns
/// to user space without looking, and the signal would wait for the next
/// one. Each signal found pending is sent again, which merges with the
/// pending one (a standard signal is pending at most once) and wakes a
/// thread for it.
fn wake_for_pending(pid: u32, tids: &[u32]) {
    let pending = |path: String, field: &str| -> u64 {
        std::fs::read_to_string(path)
            .ok()
            .and_then(|s| {
                let line = s.lines().find(|l| l.starts_with(field))?;
                u64::from_str_radix(line[field.len()..].trim(), 16).ok()
            })
            .unwrap_or(0)
    };
    let send = |mask: u64, tid: Option<u32>| {
        for bit in (0..64i32).filter(|b| mask & (1u64 << b) != 0) {
            let Ok(sig) = Signal::try_from(bit + 1) else {
                continue;
            };
            let _ = match tid {
                None => nix::sys::signal::kill(Pid::from_raw(pid as i32), sig).map_err(drop),
                Some(t) => crate::sys::tgkill(pid as i32, t as i32, sig as i32).map_err(drop),
            };
        }
    };
    send(pending(format!("/proc/{pid}/status"), "ShdPnd:"), None);
    for &tid in tids {
        send(
            pending(format!("/proc/{pid}/task/{tid}/status"), "SigPnd:"),
            Some(tid),
        );
    }
}

/// Collects thread `tid` (not the leader) of process `pid`, which died
/// while traced from here (killed during a checkpoint): a traced thread
/// stays a zombie until its tracer collects it, and while it does, the
/// process's death is never reported (its pidfd never becomes readable).
/// The thread's exit status is the tracer's alone; the leader's, which
/// its parent collects, is never taken here.
fn reap_traced(pid: u32, tid: u32) {
    let deadline = Instant::now() + STOP_TIMEOUT;
    loop {
        let flags = WaitPidFlag::WEXITED | WaitPidFlag::WNOHANG | WaitPidFlag::__WALL;
        match waitid(Id::Pid(Pid::from_raw(tid as i32)), flags) {
            Ok(WaitStatus::StillAlive) | Err(Errno::EINTR) => {}
            // Collected, not traced from here after all, or gone.
            _ => return,
        }
        if Instant::now() >= deadline
            || !std::path::Path::new(&format!("/proc/{pid}/task/{tid}")).exists()
        {
            return;
        }
        std::thread::sleep(Duration::from_micros(50));
    }
}

/// Why [`seize`] failed: before the thread was traced, or after.
enum Seize {
    Attach(Error),
    Interrupt(Error),
}

fn seize(pid: u32, tid: u32) -> Result<(), Seize> {
    let t = Pid::from_raw(tid as i32);
    let gone = |e| match e {
        Errno::ESRCH => Error::Gone(pid),
        e => Error::ptrace(tid, e),
    };
    ptrace::seize(t, ptrace::Options::empty()).map_err(|e| Seize::Attach(gone(e)))?;
    ptrace::interrupt(t).map_err(|e| Seize::Interrupt(gone(e)))
}

/// Waits for `tid`'s next ptrace-stop, polling so that a thread that dies
/// instead is noticed (its exit is never collected here).
fn wait_stop(pid: u32, tid: u32) -> Result<WaitStatus, Error> {
    let deadline = Instant::now() + STOP_TIMEOUT;
    let mut spins = 0u32;
    loop {
        match waitid(
            Id::Pid(Pid::from_raw(tid as i32)),
            WaitPidFlag::WSTOPPED | WaitPidFlag::WNOHANG | WaitPidFlag::__WALL,
        ) {
            Ok(WaitStatus::StillAlive) => {}
            Ok(st) => return Ok(st),
            Err(Errno::ECHILD) | Err(Errno::ESRCH) => return Err(Error::Gone(pid)),
            Err(Errno::EINTR) => {}
            Err(e) => return Err(Error::ptrace(tid, e)),
        }
        spins += 1;
        if spins > 64 {
            if !alive(pid, tid) {
                return Err(Error::Gone(pid));
            }
            if Instant::now() >= deadline {
                return Err(Error::Unstoppable {
                    tid,
                    waited_ms: STOP_TIMEOUT.as_millis() as u64,
                });
            }
            std::thread::sleep(Duration::from_micros(20));
        } else {
            std::thread::yield_now();
        }
    }
}

fn alive(pid: u32, tid: u32) -> bool {
    let state = procfs::process::Process::new(pid as i32)
        .and_then(|p| p.task_from_tid(tid as i32))
        .and_then(|t| t.stat())
        .map(|s| s.state);
    !matches!(state, Err(_) | Ok('Z' | 'X'))
}

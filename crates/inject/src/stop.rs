//! Stopping one thread of another process: `PTRACE_SEIZE` then
//! `PTRACE_INTERRUPT`, and polling until its registers can be read (a
//! thread is readable only once it is in its ptrace-stop). The stop is
//! never collected with `wait`, so that nothing here can consume an exit
//! status that belongs to the target's parent; only the zombie of a traced
//! non-leader thread that died while stopped, which no one else may reap,
//! is reaped here.

use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::libc::user_regs_struct;
use nix::sys::ptrace;
use nix::sys::signal::Signal;
use nix::sys::wait::{waitid, Id, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

use rustix::process::PidfdFlags;

use crate::procfs::thread_state;

/// `PIDFD_THREAD` (= `O_EXCL`, Linux 6.9): a pidfd for one thread, whose
/// signals go to that thread.
const PIDFD_THREAD: u32 = 0o200;
use crate::InjectError;

/// A thread held in a ptrace-stop; dropping it lets the thread run on.
pub struct Stopped {
    pid: u32,
    tid: u32,
    regs: user_regs_struct,
    /// The registers were changed and must be written back before it runs.
    dirty: bool,
    released: bool,
}

impl Stopped {
    /// Stops thread `tid` of process `pid` (never its leader: see
    /// [`crate::threads`]), waiting up to `timeout` for the stop.
    pub fn seize(pid: u32, tid: u32, timeout: Duration) -> Result<Self, InjectError> {
        let t = Pid::from_raw(tid as i32);
        ptrace::seize(t, ptrace::Options::empty()).map_err(|e| match e {
            Errno::ESRCH => InjectError::Gone(pid),
            Errno::EPERM => InjectError::Permission {
                pid,
                tid,
                source: e,
            },
            e => InjectError::Ptrace { tid, source: e },
        })?;
        if let Err(e) = ptrace::interrupt(t) {
            // Seized, so only its death can fail this.
            let _ = detach_or_reap(pid, tid);
            return Err(match e {
                Errno::ESRCH => InjectError::Gone(pid),
                e => InjectError::Ptrace { tid, source: e },
            });
        }
        let deadline = Instant::now() + timeout;
        let mut spins = 0u32;
        loop {
            match ptrace::getregs(t) {
                Ok(regs) => return Ok(Self::new(pid, tid, regs)),
                // Not stopped yet, or dead.
                Err(Errno::ESRCH) => {}
                Err(e) => return Err(InjectError::Ptrace { tid, source: e }),
            }
            spins += 1;
            if spins.is_multiple_of(64) {
                if matches!(thread_state(pid, tid), None | Some('Z' | 'X')) {
                    let _ = detach_or_reap(pid, tid);
                    return Err(InjectError::Gone(pid));
                }
                if Instant::now() >= deadline {
                    // It stays seized until it reaches its stop (detaching
                    // is only possible then), or until this process exits.
                    return Err(InjectError::Unstoppable {
                        tid,
                        waited_ms: timeout.as_millis() as u64,
                    });
                }
                std::thread::sleep(Duration::from_micros(20));
            } else {
                std::thread::yield_now();
            }
        }
    }

    fn new(pid: u32, tid: u32, regs: user_regs_struct) -> Self {
        Self {
            pid,
            tid,
            regs,
            dirty: false,
            released: false,
        }
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    pub fn tid(&self) -> u32 {
        self.tid
    }

    /// True if it was stopped while executing user code, not inside a
    /// system call (`orig_rax` is -1 outside one).
    pub fn in_user_code(&self) -> bool {
        self.regs.orig_rax as i64 == -1
    }

    /// The registers it stopped with (as changed by [`Self::regs_mut`]).
    pub fn regs(&self) -> &user_regs_struct {
        &self.regs
    }

    /// The registers, to change: they are written back when it resumes.
    pub fn regs_mut(&mut self) -> &mut user_regs_struct {
        self.dirty = true;
        &mut self.regs
    }

    /// Lets it run on (writing back changed registers).
    pub fn resume(mut self) -> Result<(), InjectError> {
        self.release()
    }

    /// Lets it run on with `signal` pending for it alone (sent through a
    /// thread pidfd while it is stopped), so that it takes the signal at
    /// this instruction, as if the instruction had raised it. (A signal
    /// passed to `PTRACE_DETACH` would be dropped: this is not a
    /// signal-delivery stop.)
    pub fn resume_with(mut self, signal: Signal) -> Result<(), InjectError> {
        let gone = |_| InjectError::Gone(self.pid);
        let tid =
            rustix::process::Pid::from_raw(self.tid as i32).ok_or(InjectError::Gone(self.pid))?;
        let fd = rustix::process::pidfd_open(tid, PidfdFlags::from_bits_retain(PIDFD_THREAD))
            .map_err(gone)?;
        let sig = rustix::process::Signal::from_named_raw(signal as i32)
            .ok_or(InjectError::Gone(self.pid))?;
        rustix::process::pidfd_send_signal(&fd, sig).map_err(gone)?;
        self.release()
    }

    fn release(&mut self) -> Result<(), InjectError> {
        if std::mem::replace(&mut self.released, true) {
            return Ok(());
        }
        let mut result = Ok(());
        if self.dirty {
            result = ptrace::setregs(Pid::from_raw(self.tid as i32), self.regs).map_err(|e| {
                InjectError::Ptrace {
                    tid: self.tid,
                    source: e,
                }
            });
        }
        let detached = detach_or_reap(self.pid, self.tid);
        result.and(detached)
    }

    /// True once its process is dying or gone.
    pub fn process_dead(&self) -> bool {
        !matches!(thread_state(self.pid, self.pid), Some(s) if s != 'Z' && s != 'X')
            || matches!(thread_state(self.pid, self.tid), None | Some('Z' | 'X'))
    }
}

/// Detaches from `tid`; if it died while traced, collects its zombie, which
/// no one else may, and which holds back its process's exit until then.
fn detach_or_reap(pid: u32, tid: u32) -> Result<(), InjectError> {
    let t = Pid::from_raw(tid as i32);
    match ptrace::detach(t, delivering(t)) {
        Ok(()) => Ok(()),
        Err(Errno::ESRCH) => {
            // Dying, not yet a zombie: wait for it (a process killed while
            // another tracer holds its other threads may take a while),
            // for its zombie holds back its process's exit.
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline {
                match waitid(
                    Id::Pid(t),
                    WaitPidFlag::WEXITED | WaitPidFlag::WNOHANG | WaitPidFlag::__WALL,
                ) {
                    Ok(WaitStatus::StillAlive) => std::thread::sleep(Duration::from_micros(100)),
                    _ => break,
                }
            }
            Err(InjectError::Gone(pid))
        }
        Err(e) => Err(InjectError::Ptrace { tid, source: e }),
    }
}

/// The signal `t` is stopped to deliver, if its stop is a signal's
/// delivery (a signal reached it between the seize and the interrupt's
/// stop) rather than the interrupt's or a group stop: passed back to the
/// detach, which would otherwise suppress it.
fn delivering(t: Pid) -> Option<Signal> {
    let info = ptrace::getsiginfo(t).ok()?;
    let sig = Signal::try_from(info.si_signo).ok()?;
    (sig != Signal::SIGTRAP).then_some(sig)
}

impl std::fmt::Debug for Stopped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Stopped {{ pid: {}, tid: {} }}", self.pid, self.tid)
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        let _ = self.release();
    }
}

/// A hang: a thread held stopped until [`Held::release`], until its
/// process dies (then [`Held::reap_if_dead`] collects it), or until dropped.
#[derive(Debug)]
pub struct Held(Stopped);

impl Held {
    pub fn new(stopped: Stopped) -> Self {
        Self(stopped)
    }

    pub fn tid(&self) -> u32 {
        self.0.tid
    }

    /// If the held thread's process has died (say, rebooted after the
    /// hang was detected), collects the thread and returns true.
    pub fn reap_if_dead(&mut self) -> bool {
        if !self.0.process_dead() {
            return false;
        }
        let _ = self.0.release();
        true
    }

    /// Lets the thread run on.
    pub fn release(self) -> Result<(), InjectError> {
        self.0.resume()
    }
}

/// Holds thread `tid` stopped from a tracer thread of its own (ptrace
/// binds a tracee to the thread that seized it) until the thread's process
/// dies; the handle ends then. Fails if the thread cannot be stopped.
pub fn hold_until_death(tid: u32) -> Result<std::thread::JoinHandle<()>, InjectError> {
    let status_path = format!("/proc/{tid}/status");
    let status = std::fs::read_to_string(&status_path).map_err(|e| InjectError::Proc {
        path: status_path,
        source: e,
    })?;
    let pid = status
        .lines()
        .find_map(|l| l.strip_prefix("Tgid:"))
        .and_then(|v| v.trim().parse().ok())
        .ok_or(InjectError::Gone(tid))?;
    let (tx, rx) = std::sync::mpsc::channel();
    let tracer = std::thread::Builder::new()
        .name(format!("hold:{tid}"))
        .spawn(move || {
            let mut held = match Stopped::seize(pid, tid, Duration::from_secs(1)) {
                Ok(s) => Held::new(s),
                Err(e) => {
                    let _ = tx.send(Err(e));
                    return;
                }
            };
            let _ = tx.send(Ok(()));
            while !held.reap_if_dead() {
                std::thread::sleep(Duration::from_millis(2));
            }
        })
        .map_err(|e| InjectError::Proc {
            path: "thread".into(),
            source: e,
        })?;
    match rx.recv() {
        Ok(Ok(())) => Ok(tracer),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(InjectError::Gone(pid)),
    }
}

//! Real thread priorities: the component's at boot, and the caller's while a
//! server works for it.
//!
//! Every runtime thread of an incarnation takes its component's priority
//! (`priority` and `realtime` in the system description): `SCHED_FIFO` at the
//! realtime priority where the kernel permits it, falling back to the nice
//! value when it does not, and otherwise `SCHED_OTHER` at the nice value.
//! Priorities are per thread (Linux applies `setpriority(PRIO_PROCESS, tid)`
//! and `sched_setscheduler(tid)` to that one thread).
//!
//! Each invocation carries the calling thread's priority as one word
//! ([`Priority::word`]); the server's slot worker [`adopt`]s it before it
//! dispatches, so work done for a thread runs at that thread's priority.
//! The priority a thread was given through this module is cached per thread,
//! so adopting an unchanged priority costs no system call.
//!
//! `SCHED_FIFO` threads never spin unboundedly in the runtime: the
//! spin-then-sleep waits of [`crate::futex`] are bounded (50 µs by
//! default), after which they sleep on a futex and free the core.

use std::cell::Cell;

use rustix::process::Pid;
use thiserror::Error;

/// Nice values, as the kernel clamps them.
const NICE_RANGE: std::ops::RangeInclusive<i32> = -20..=19;

/// A thread's scheduling: a nice value and, for realtime threads, a
/// `SCHED_FIFO` priority (1..=99), which takes precedence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Priority {
    pub nice: i32,
    pub fifo: Option<u8>,
}

impl Priority {
    /// A `SCHED_OTHER` priority with nice value `nice`.
    pub const fn nice(nice: i32) -> Self {
        Self { nice, fifo: None }
    }

    /// The priority as one nonzero word, as invocations carry it: bits 0–7
    /// hold `nice + 21` (1..=40), bits 8–15 the `SCHED_FIFO` priority (0:
    /// none).
    pub fn word(self) -> u32 {
        let nice = (self.nice.clamp(*NICE_RANGE.start(), *NICE_RANGE.end()) + 21) as u32;
        nice | u32::from(self.fifo.unwrap_or(0)) << 8
    }

    /// The priority a word holds; `None` for 0 (a call that carries none).
    pub fn from_word(word: u32) -> Option<Self> {
        let nice = (word & 0xff) as i32;
        (nice != 0).then(|| Self {
            nice: nice - 21,
            fifo: match (word >> 8) as u8 {
                0 => None,
                p => Some(p),
            },
        })
    }
}

#[derive(Debug, Error)]
pub enum PriorityError {
    #[error("setpriority(nice {nice}) for thread {tid}: {source}")]
    Nice {
        tid: i32,
        nice: i32,
        source: std::io::Error,
    },
    #[error("sched_setscheduler({policy}) for thread {tid}: {source}")]
    Policy {
        tid: i32,
        policy: &'static str,
        source: std::io::Error,
    },
    #[error("reading the scheduling of thread {tid}: {source}")]
    Read { tid: i32, source: std::io::Error },
}

thread_local! {
    /// The word of the priority this thread was last given (0: not yet known).
    static CURRENT: Cell<u32> = const { Cell::new(0) };
}

/// Gives the calling thread priority `p`: `SCHED_FIFO` at `p.fifo` if set
/// and permitted (on `EPERM` it falls back to `SCHED_OTHER`), else
/// `SCHED_OTHER`; and nice value `p.nice` in either case (it is the one that
/// counts once the thread leaves `SCHED_FIFO`). Only what differs from the
/// thread's current priority is changed. Remembers `p` as the thread's
/// priority even when the kernel refuses it, so that [`adopt`] does not
/// retry it at every call.
pub fn apply_to_current_thread(p: Priority) -> Result<(), PriorityError> {
    let was = current();
    CURRENT.with(|c| c.set(p.word()));
    let tid = rustix::thread::gettid();
    let policy_error = |policy, source| PriorityError::Policy {
        tid: tid.as_raw_nonzero().get(),
        policy,
        source,
    };
    let fifo = match p.fifo {
        Some(f) if was.fifo == Some(f) => true,
        Some(f) => match set_policy(tid, libc::SCHED_FIFO, i32::from(f)) {
            Ok(()) => true,
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => {
                tracing::debug!("SCHED_FIFO {f} not permitted; using nice {}", p.nice);
                false
            }
            Err(e) => return Err(policy_error("SCHED_FIFO", e)),
        },
        None => false,
    };
    if !fifo && was.fifo.is_some() {
        set_policy(tid, libc::SCHED_OTHER, 0).map_err(|e| policy_error("SCHED_OTHER", e))?;
    }
    if p.nice != was.nice {
        rustix::process::setpriority_process(Some(tid), p.nice).map_err(|e| {
            PriorityError::Nice {
                tid: tid.as_raw_nonzero().get(),
                nice: p.nice,
                source: e.into(),
            }
        })?;
    }
    Ok(())
}

/// The calling thread's priority: the one last given to it through this
/// module, or what the kernel says on the first use in a thread.
pub fn current() -> Priority {
    let word = CURRENT.with(Cell::get);
    if let Some(p) = Priority::from_word(word) {
        return p;
    }
    let p = of_thread(rustix::thread::gettid().as_raw_nonzero().get()).unwrap_or_default();
    CURRENT.with(|c| c.set(p.word()));
    p
}

/// Takes on the priority `word` an invocation carries, if it differs from
/// the calling thread's: one system call or two when it changes, none
/// otherwise. A zero word (no priority carried) changes nothing; a refusal
/// by the kernel is logged and the thread keeps running.
pub fn adopt(word: u32) {
    if word == 0 || word == CURRENT.with(Cell::get) {
        return;
    }
    let Some(p) = Priority::from_word(word) else {
        return;
    };
    if let Err(e) = apply_to_current_thread(p) {
        tracing::debug!("adopting the caller's priority: {e}");
    }
}

/// The priority thread `tid` runs at, as the kernel says.
pub fn of_thread(tid: i32) -> Result<Priority, PriorityError> {
    let read = |source| PriorityError::Read { tid, source };
    let pid = Pid::from_raw(tid).ok_or_else(|| read(std::io::ErrorKind::InvalidInput.into()))?;
    let nice = rustix::process::getpriority_process(Some(pid)).map_err(|e| read(e.into()))?;
    // SAFETY: sched_getscheduler only reads the scheduling policy of `tid`.
    let policy = unsafe { libc::sched_getscheduler(tid) };
    if policy == -1 {
        return Err(read(std::io::Error::last_os_error()));
    }
    let fifo = if policy & !libc::SCHED_RESET_ON_FORK == libc::SCHED_FIFO {
        let mut param = libc::sched_param { sched_priority: 0 };
        // SAFETY: `param` is a valid, writable sched_param for the call to fill.
        if unsafe { libc::sched_getparam(tid, &mut param) } == -1 {
            return Err(read(std::io::Error::last_os_error()));
        }
        u8::try_from(param.sched_priority).ok()
    } else {
        None
    };
    Ok(Priority { nice, fifo })
}

fn set_policy(tid: Pid, policy: i32, priority: i32) -> std::io::Result<()> {
    let param = libc::sched_param {
        sched_priority: priority,
    };
    // SAFETY: `param` is a valid sched_param that the call only reads; on
    // Linux the pid argument names one thread.
    if unsafe { libc::sched_setscheduler(tid.as_raw_nonzero().get(), policy, &param) } == -1 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_round_trip_and_zero_means_none() {
        for p in [
            Priority::nice(-20),
            Priority::nice(0),
            Priority::nice(19),
            Priority {
                nice: 5,
                fifo: Some(99),
            },
        ] {
            assert_ne!(p.word(), 0);
            assert_eq!(Priority::from_word(p.word()), Some(p));
        }
        assert_eq!(Priority::from_word(0), None);
    }

    #[test]
    fn a_thread_reads_back_the_nice_value_it_was_given() {
        std::thread::spawn(|| {
            apply_to_current_thread(Priority::nice(11)).unwrap();
            let tid = rustix::thread::gettid().as_raw_nonzero().get();
            assert_eq!(of_thread(tid).unwrap(), Priority::nice(11));
            assert_eq!(current(), Priority::nice(11));
        })
        .join()
        .unwrap();
    }
}

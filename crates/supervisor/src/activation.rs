//! Activation: a standby let run as the next epoch, and the wait for its
//! report of readiness. At boot the supervisor waits for it; a restart
//! waits at most [`SYNC_ACTIVATION`] (a warm standby is ready within
//! microseconds), then parks the incarnation in [`Phase::Starting`] and
//! goes back to its event loop, which checks it every
//! [`READY_POLL`] until it is ready, fails or times out: a component
//! that hangs in its initialization delays no other component's reboot
//! (issue 17: "a supervisor that one component cannot stall").

use std::time::{Duration, Instant};

use kintsugi_runtime::abi::boot::{Activation, ControlBlock, READY_POLL};
use kintsugi_runtime::futex::timespec;
use kintsugi_system::RecoveryMode;
use rustix::event::{poll, PollFd, PollFlags};
use thiserror::Error;

use crate::events::Event;
use crate::managed::{Incarnation, Phase};
use crate::options::{StopReason, SupervisorError};
use crate::supervisor::Supervisor;

/// How long a restart waits for its new incarnation before it parks it.
pub(crate) const SYNC_ACTIVATION: Duration = Duration::from_millis(10);

/// Why an incarnation did not become live.
#[derive(Debug, Error)]
pub(crate) enum ActivationFailure {
    /// It failed, died or timed out during initialization.
    #[error("{0}")]
    Init(String),
    /// A signal asked the supervisor to stop while it waited.
    #[error("stopped by a signal during initialization")]
    Interrupted,
}

/// Where an activation stands after a wait.
pub(crate) enum Waited {
    /// Live, as this pid.
    Ready(u32),
    /// Still initializing, and its deadline not reached.
    Pending(Incarnation),
    /// It will not be live: this pid was killed and reaped.
    Failed(u32, ActivationFailure),
}

/// A restart in progress: since when the component is down, the events to
/// report once it serves again, and its activations that failed in a row.
pub(crate) struct Attempt {
    pub since: Instant,
    pub pending: Vec<Event>,
    pub failed: u32,
    pub last: String,
}

impl Attempt {
    pub(crate) fn new(since: Instant, pending: Vec<Event>) -> Self {
        Self {
            since,
            pending,
            failed: 0,
            last: String::new(),
        }
    }
}

/// What a restart does next.
pub(crate) enum Next {
    /// It is over for now (the component serves, is parked, or was given
    /// up), with the reason to stop the system if there is one.
    Done(Option<StopReason>),
    /// Another incarnation is to be tried.
    Retry(Attempt),
}

impl Supervisor<'_> {
    /// Lets `inc` run as the next epoch and waits until it is ready (at
    /// boot: the whole ready timeout).
    pub(crate) fn activate(
        &mut self,
        idx: usize,
        inc: Incarnation,
    ) -> Result<(), ActivationFailure> {
        let timeout = self.start_timeout(idx);
        let deadline = Instant::now() + timeout;
        match self.launch(idx, inc, deadline, timeout) {
            Waited::Ready(_) => Ok(()),
            Waited::Failed(_, f) => Err(f),
            Waited::Pending(inc) => {
                let exit = inc.proc.kill();
                Err(ActivationFailure::Init(format!(
                    "not ready within {} ms ({exit})",
                    timeout.as_millis()
                )))
            }
        }
    }

    /// Lets `inc` run as the next epoch of component `idx` and waits at
    /// most `wait` for it (and until `deadline` in all).
    pub(crate) fn launch(
        &mut self,
        idx: usize,
        inc: Incarnation,
        deadline: Instant,
        wait: Duration,
    ) -> Waited {
        let m = &mut self.comps[idx];
        // A checkpoint-recovered server's state (and so every descriptor
        // it handed out) carries on: its epoch does too, after the first.
        if m.spec.recovery != RecoveryMode::Checkpoint || m.epoch == 0 {
            m.epoch += 1;
        }
        let ctl: &ControlBlock = m.wiring.control.at(0);
        ctl.activate(inc.generation, m.epoch);
        self.await_ready(idx, inc, deadline, (Instant::now() + wait).min(deadline))
    }

    /// Waits until `inc` is ready, dies, fails or reaches `deadline`, or
    /// the supervisor is asked to stop, or `until` comes (then it is
    /// still pending). An incarnation that will not be live is killed.
    fn await_ready(
        &mut self,
        idx: usize,
        inc: Incarnation,
        deadline: Instant,
        until: Instant,
    ) -> Waited {
        let m = &mut self.comps[idx];
        let ctl: &ControlBlock = m.wiring.control.at(0);
        let signal_pipe = &self.signal_pipe;
        let outcome = ctl.wait_ready(
            inc.generation,
            until.saturating_duration_since(Instant::now()),
            || {
                let mut fds = [
                    PollFd::new(&inc.proc.pidfd, PollFlags::IN),
                    PollFd::new(signal_pipe, PollFlags::IN),
                ];
                match poll(&mut fds, Some(&timespec(Duration::ZERO))) {
                    Ok(_) if !fds[0].revents().is_empty() => Some(Activation::Died),
                    Ok(_) if !fds[1].revents().is_empty() => Some(Activation::Interrupted),
                    _ => None,
                }
            },
        );
        let pid = inc.proc.pid;
        if outcome == Activation::Ready {
            for s in &m.wiring.served {
                s.edge.server_live(m.epoch, pid);
            }
            m.standby.went_live(inc.bank);
            m.restarts.went_live(Instant::now());
            self.roster.set_live(&m.spec.name, Some(pid), m.epoch);
            m.phase = Phase::Live { inc, watch: None };
            return Waited::Ready(pid);
        }
        if outcome == Activation::TimedOut && Instant::now() < deadline {
            return Waited::Pending(inc);
        }
        let exit = inc.proc.kill();
        Waited::Failed(
            pid,
            match outcome {
                Activation::Interrupted => ActivationFailure::Interrupted,
                Activation::Failed => {
                    ActivationFailure::Init(format!("initialization failed ({exit})"))
                }
                Activation::Died => {
                    ActivationFailure::Init(format!("died during initialization ({exit})"))
                }
                _ => ActivationFailure::Init(format!(
                    "not ready within {} ms ({exit})",
                    self.start_timeout(idx).as_millis()
                )),
            },
        )
    }

    /// How long component `idx`'s incarnations may take to initialize.
    pub(crate) fn start_timeout(&self, idx: usize) -> Duration {
        self.comps[idx]
            .spec
            .start_timeout
            .unwrap_or(self.options.ready_timeout)
    }

    /// When the event loop must next look at a parked activation.
    pub(crate) fn starting_wake(&self, now: Instant) -> Option<Instant> {
        self.comps
            .iter()
            .any(|m| matches!(m.phase, Phase::Starting { .. }))
            .then_some(now + READY_POLL)
    }

    /// Before the components stop: the restarts a backoff put off (a
    /// restart group's members waiting for the one that backs off among
    /// them) are made now, and the incarnations still initializing are
    /// waited for, for at most the longest start timeout in all, so that
    /// clients blocked on them are served their last calls and stop rather
    /// than wait out their stop timeout and be killed. A component that
    /// dies meanwhile is not rebooted again; a second signal ends the wait.
    pub(crate) fn settle(&mut self) {
        let mut deferred = std::mem::take(&mut self.deferred);
        deferred.sort_by_key(|d| d.idx);
        for d in deferred {
            // The system stops anyway: a reason to stop changes nothing.
            if !matches!(
                self.restart(d.idx, Attempt::new(d.detected, Vec::new())),
                Ok(None)
            ) {
                return;
            }
        }
        let longest = (0..self.comps.len())
            .map(|idx| self.start_timeout(idx))
            .max()
            .unwrap_or_default();
        let end = Instant::now() + longest;
        while self.starting_wake(Instant::now()).is_some() && Instant::now() < end {
            std::thread::sleep(READY_POLL);
            if !matches!(self.check_starting(), Ok(None)) {
                return;
            }
        }
    }

    /// Looks at every parked activation, and carries on the restarts whose
    /// incarnation is ready or failed.
    pub(crate) fn check_starting(&mut self) -> Result<Option<StopReason>, SupervisorError> {
        for idx in 0..self.comps.len() {
            let Some((inc, deadline, attempt)) = self.comps[idx].take_starting() else {
                continue;
            };
            let waited = self.await_ready(idx, inc, deadline, Instant::now());
            let stop = match self.after_start(idx, waited, deadline, attempt)? {
                Next::Done(stop) => stop,
                Next::Retry(attempt) => self.restart(idx, attempt)?,
            };
            if stop.is_some() {
                return Ok(stop);
            }
        }
        Ok(None)
    }
}

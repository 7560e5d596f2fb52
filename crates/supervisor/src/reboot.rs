//! Micro-reboot (the C3 and NewtOS recovery path): a dead incarnation's
//! edges are marked down, its standby is activated as the next epoch, and
//! the restart policy decides when to stop trying.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kintsugi_runtime::abi::boot::{Activation, ControlBlock};
use kintsugi_runtime::futex::timespec;
use kintsugi_system::{GiveUpAction, RebootMode, RecoveryMode};
use rustix::event::{poll, PollFd, PollFlags};
use thiserror::Error;

use crate::events::{Event, Exit};
use crate::managed::{Incarnation, Phase};
use crate::options::{StopReason, SupervisorError};
use crate::supervisor::Supervisor;
use crate::watch::Watch;

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

impl Supervisor<'_> {
    /// Lets `inc` run as the next epoch and waits until it is ready, until
    /// it dies or fails, or until the supervisor is asked to stop; an
    /// incarnation that does not become ready is killed and reaped.
    pub(crate) fn activate(
        &mut self,
        idx: usize,
        inc: Incarnation,
    ) -> Result<(), ActivationFailure> {
        let timeout = self.options.ready_timeout;
        let m = &mut self.comps[idx];
        // A checkpoint-recovered server's state (and so every descriptor
        // it handed out) carries on: its epoch does too, after the first.
        if m.spec.recovery != RecoveryMode::Checkpoint || m.epoch == 0 {
            m.epoch += 1;
        }
        let ctl: &ControlBlock = m.wiring.control.at(0);
        ctl.activate(inc.generation, m.epoch);
        let signal_pipe = &self.signal_pipe;
        let outcome = ctl.wait_ready(inc.generation, timeout, || {
            let mut fds = [
                PollFd::new(&inc.proc.pidfd, PollFlags::IN),
                PollFd::new(signal_pipe, PollFlags::IN),
            ];
            match poll(&mut fds, Some(&timespec(Duration::ZERO))) {
                Ok(_) if !fds[0].revents().is_empty() => Some(Activation::Died),
                Ok(_) if !fds[1].revents().is_empty() => Some(Activation::Interrupted),
                _ => None,
            }
        });
        if outcome == Activation::Ready {
            for s in &m.wiring.served {
                s.edge.server_live(m.epoch, inc.proc.pid);
            }
            m.standby.went_live(inc.bank);
            m.restarts.went_live(Instant::now());
            self.roster
                .set_live(&m.spec.name, Some(inc.proc.pid), m.epoch);
            m.phase = Phase::Live { inc, watch: None };
            return Ok(());
        }
        let exit = inc.proc.kill();
        Err(match outcome {
            Activation::Interrupted => ActivationFailure::Interrupted,
            Activation::Failed => {
                ActivationFailure::Init(format!("initialization failed ({exit})"))
            }
            Activation::Died => {
                ActivationFailure::Init(format!("died during initialization ({exit})"))
            }
            _ => ActivationFailure::Init(format!(
                "not ready within {} ms ({exit})",
                timeout.as_millis()
            )),
        })
    }

    /// Starts watching the live incarnation's lifelines (after the reboot is
    /// done: spawning the watcher is not on the reboot's path).
    pub(crate) fn watch_live(&mut self, idx: usize) {
        if !self.options.lifelines {
            return;
        }
        let m = &mut self.comps[idx];
        if let Phase::Live { inc, watch } = &mut m.phase {
            *watch = Some(Watch::start(
                m.wiring.control.clone(),
                inc.bank,
                idx as u32,
                inc.generation,
                self.lifeline_notify.clone(),
            ));
        }
    }

    /// Component `idx`'s incarnation is gone: its slot claims on the edges it
    /// used are void, and its servers are told, so that they release what it held.
    pub(crate) fn client_gone(&mut self, idx: usize) {
        for u in &self.comps[idx].wiring.used {
            u.edge.client_down();
            if let Some(server) = self.comps.iter().find(|c| c.spec.name == u.server) {
                let ctl: &ControlBlock = server.wiring.control.at(0);
                ctl.client_died();
            }
        }
    }

    /// Micro-reboots component `idx` after its incarnation `pid` died: at
    /// once, or after the backoff delay of a component that keeps failing
    /// the same way (then the event loop calls [`Self::restart`] when it
    /// is due, and serves everything else meanwhile).
    pub(crate) fn reboot(
        &mut self,
        idx: usize,
        pid: u32,
        exit: Exit,
        detected: Instant,
    ) -> Result<Option<StopReason>, SupervisorError> {
        let mut pending = self.crashed(idx, pid, exit, detected);
        let m = &mut self.comps[idx];
        let ctl: &ControlBlock = m.wiring.control.at(0);
        let panic_site = ctl.panic_site.swap(0, Ordering::SeqCst);
        let (delay, failures) = m.restarts.failed(detected, exit, panic_site);
        if delay.is_zero() {
            return self.restart(idx, detected, pending);
        }
        pending.push(Event::BackingOff {
            component: m.spec.name.clone(),
            failures,
            delay,
        });
        self.deferred.push((detected + delay, idx));
        pending.into_iter().for_each(|e| self.emit(e));
        Ok(None)
    }

    /// What follows the death of component `idx`'s incarnation `pid`, before
    /// a new one is started: its calls and edges, and the events to report.
    fn crashed(&mut self, idx: usize, pid: u32, exit: Exit, detected: Instant) -> Vec<Event> {
        let m = &mut self.comps[idx];
        let name = m.spec.name.clone();
        let journaled = m.spec.recovery == RecoveryMode::Checkpoint;
        let mut calls = Vec::new();
        for (i, s) in m.wiring.served.iter().enumerate() {
            if journaled {
                // Calls in flight stay posted: the next incarnation
                // answers them, by replay or anew; it serves nothing
                // until its checkpoint is restored (see `recover`).
                calls.extend(s.edge.in_flight().into_iter().map(|f| (i, f)));
                s.edge.mark_down();
                s.edge.hold_serving(true);
            } else {
                calls.extend(s.edge.server_down().into_iter().map(|f| (i, f)));
            }
        }
        let epoch = m.epoch;
        self.client_gone(idx);
        // Events are emitted after the reboot, so that logging does not delay it.
        let in_flight = calls
            .into_iter()
            .map(|(i, f)| self.name_call(&self.comps[idx].wiring.served[i], f))
            .collect();
        let after_injection = self
            .chaos
            .as_ref()
            .and_then(|c| c.after_injection(pid, detected));
        let mut pending = vec![Event::Crashed {
            component: name,
            pid,
            epoch,
            exit,
            in_flight,
            after_injection,
        }];
        pending.extend(self.recoveries(idx));
        pending
    }

    /// Starts a new incarnation of component `idx`, which is down since
    /// `since`, and recovers its state; tries again while its policy
    /// allows, then gives up.
    pub(crate) fn restart(
        &mut self,
        idx: usize,
        since: Instant,
        mut pending: Vec<Event>,
    ) -> Result<Option<StopReason>, SupervisorError> {
        let name = self.comps[idx].spec.name.clone();
        let (mut failed, mut last) = (0, String::new());
        loop {
            let m = &mut self.comps[idx];
            if let Err(reason) = m.restarts.attempt(Instant::now(), failed, &last) {
                let action = m.spec.restart.on_give_up;
                m.retire();
                pending.push(Event::GaveUp {
                    component: name.clone(),
                    reason,
                    action,
                });
                pending.into_iter().for_each(|e| self.emit(e));
                return Ok(match action {
                    GiveUpAction::Stop => Some(StopReason::GaveUp(name)),
                    GiveUpAction::Isolate => None,
                });
            }
            if m.spec.reboot == RebootMode::Exec {
                self.respawn_zygote(idx)?;
            }
            let inc = self.fork_now(idx)?;
            let new_pid = inc.proc.pid;
            match self
                .activate(idx, inc)
                .and_then(|()| self.recover_state(idx, &mut pending))
            {
                Ok(()) => {
                    let m = &self.comps[idx];
                    let ctl: &ControlBlock = m.wiring.control.at(0);
                    pending.push(Event::Rebooted {
                        component: name.clone(),
                        epoch: m.epoch,
                        pid: new_pid,
                        took: since.elapsed(),
                        init: Duration::from_nanos(ctl.init_ns.load(Ordering::SeqCst)),
                    });
                    self.watch_live(idx);
                    pending.into_iter().for_each(|e| self.emit(e));
                    if self.comps[idx].spec.reboot == RebootMode::Standby {
                        self.request_fork(idx)?;
                    }
                    return Ok(None);
                }
                Err(ActivationFailure::Interrupted) => {
                    pending.into_iter().for_each(|e| self.emit(e));
                    return Ok(Some(StopReason::Signal));
                }
                Err(failure) => {
                    failed += 1;
                    tracing::warn!("{name}: new incarnation {new_pid} failed: {failure}");
                    last = failure.to_string();
                }
            }
        }
    }

    /// Checkpoint recovery of the incarnation just activated (nothing for
    /// the other modes): on failure it is killed, and another one tried.
    fn recover_state(
        &mut self,
        idx: usize,
        pending: &mut Vec<Event>,
    ) -> Result<(), ActivationFailure> {
        let m = &mut self.comps[idx];
        if m.spec.recovery != RecoveryMode::Checkpoint {
            return Ok(());
        }
        let name = m.spec.name.clone();
        match self.roster.recover(&name) {
            Ok(done) => {
                pending.push(Event::Replayed {
                    component: name,
                    pid: done.pid,
                    kind: done.kind,
                    pages: done.pages,
                    pause: Duration::from_micros(done.pause_us),
                    entries: done.replayed,
                    replay: Duration::from_micros(done.replay_us),
                });
                Ok(())
            }
            Err(e) => {
                if let Some(live) = m.take_live() {
                    self.roster.set_live(&name, None, m.epoch);
                    let exit = live.proc.kill();
                    return Err(ActivationFailure::Init(format!(
                        "checkpoint recovery failed: {e} ({exit})"
                    )));
                }
                Err(ActivationFailure::Init(format!(
                    "checkpoint recovery failed: {e}"
                )))
            }
        }
    }

    /// How many descriptors each client rebuilt during the epoch that ended,
    /// and what the epoch's eager recovery took, if it had one.
    fn recoveries(&mut self, idx: usize) -> Vec<Event> {
        let mut out = Vec::new();
        let m = &mut self.comps[idx];
        let ctl: &ControlBlock = m.wiring.control.at(0);
        let eager_ns = ctl.eager_ns.swap(0, Ordering::SeqCst);
        if eager_ns != 0 {
            out.push(Event::EagerRecovery {
                component: m.spec.name.clone(),
                epoch: m.epoch,
                descriptors: ctl.eager_descriptors.load(Ordering::SeqCst),
                took: Duration::from_nanos(eager_ns),
            });
        }
        for s in &mut m.wiring.served {
            let now = s.edge.header().recovered.load(Ordering::Relaxed);
            if now > s.recovered_seen {
                out.push(Event::Recovered {
                    server: m.spec.name.clone(),
                    client: s.client.clone(),
                    epoch: m.epoch,
                    descriptors: now - s.recovered_seen,
                });
                s.recovered_seen = now;
            }
        }
        out
    }
}

//! Micro-reboot (the C3 and NewtOS recovery path): a dead incarnation's
//! edges are marked down, its standby is activated as the next epoch, and
//! the restart policy decides when to stop trying.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kintsugi_runtime::abi::boot::ControlBlock;
use kintsugi_runtime::abi::journal::JournalRegion;
use kintsugi_system::{GiveUpAction, RebootMode, RecoveryMode, RestartType};
use rustix::process::Signal;

use crate::activation::{ActivationFailure, Attempt, Next, Waited, SYNC_ACTIVATION};
use crate::events::{Event, Exit};
use crate::ladder::Crash;
use crate::managed::Phase;
use crate::options::{StopReason, SupervisorError};
use crate::policy::GiveUpReason;
use crate::process::ExitProbe;
use crate::supervisor::{Deferred, Supervisor};
use crate::watch::Watcher;

impl Supervisor<'_> {
    /// Starts watching the live incarnation's lifelines (after the reboot is
    /// done: spawning the watcher is not on the reboot's path).
    pub(crate) fn watch_live(&mut self, idx: usize) {
        if !self.options.lifelines {
            return;
        }
        let m = &mut self.comps[idx];
        if let Phase::Live { inc, watch } = &mut m.phase {
            let watcher = self.watchers.entry(idx).or_insert_with(|| {
                Watcher::start(
                    m.wiring.control.clone(),
                    idx as u32,
                    self.lifeline_notify.clone(),
                )
            });
            // Opened now, while it lives, so that reading its exit at its
            // death is one `pread`.
            let exit = ExitProbe::open(inc.proc.pid).ok();
            *watch = Some(watcher.watch(inc.bank, inc.generation, exit));
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
        // A death its group asked for takes no one else with it.
        let because = self.comps[idx].killed_for_group.take();
        let cascade = because.is_none();
        self.poisoned_recovery(idx, pid, exit, detected);
        let mut pending = self.crashed(idx, pid, exit, detected);
        if self.comps[idx].spec.restart.kind == RestartType::Temporary {
            return Ok(self.give_up(idx, GiveUpReason::Temporary, pending));
        }
        let m = &mut self.comps[idx];
        let ctl: &ControlBlock = m.wiring.control.at(0);
        let panic_site = ctl.panic_site.swap(0, Ordering::SeqCst);
        let (delay, failures) = m.restarts.failed(detected, exit, panic_site);
        // Killed for a member that backs off: restarted with it, not before.
        let with = because.and_then(|f| self.deferred.iter().find(|d| d.idx == f));
        if let Some(w) = with.filter(|w| w.due > detected + delay) {
            let (due, name) = (w.due, self.comps[idx].spec.name.clone());
            tracing::info!(
                "{name}: restarts with {} once its backoff is over",
                self.comps[w.idx].spec.name
            );
            self.deferred.push(Deferred { due, detected, idx });
            pending.into_iter().for_each(|e| self.emit(e));
            return Ok(None);
        }
        let m = &mut self.comps[idx];
        if delay.is_zero() {
            if let Some(stop) = self.restart(idx, Attempt::new(detected, pending))? {
                return Ok(Some(stop));
            }
        } else {
            pending.push(Event::BackingOff {
                component: m.spec.name.clone(),
                failures,
                delay,
            });
            self.deferred.push(Deferred {
                due: detected + delay,
                detected,
                idx,
            });
            pending.into_iter().for_each(|e| self.emit(e));
        }
        match cascade {
            true => self.restart_group_of(idx),
            false => Ok(None),
        }
    }

    /// A checkpoint-recovered component whose recovered incarnations
    /// crash by themselves at once starts fresh next (see `ladder.rs`).
    fn poisoned_recovery(&mut self, idx: usize, pid: u32, exit: Exit, detected: Instant) {
        let m = &self.comps[idx];
        let injected = self
            .chaos
            .as_ref()
            .is_some_and(|c| c.after_injection(pid, detected).is_some());
        let by_itself = exit != Exit::Signal(libc::SIGKILL) && !injected;
        if m.spec.recovery != RecoveryMode::Checkpoint {
            return;
        }
        let name = m.spec.name.clone();
        let journal = m.wiring.durable.journal.as_deref();
        let crash = Crash {
            failed: crate::ladder::failed(pid, journal),
            by_itself,
        };
        if self.ladder.crashed(&name, crash) {
            tracing::warn!(
                "{name}: crashed ({exit}) within {} ms of its checkpoint recovery before serving anything new, the second in a row: it starts afresh, its checkpoint and request log dropped (its state is lost)",
                crate::ladder::AGAIN.as_millis()
            );
        }
    }

    /// Restarts the members of component `idx`'s group that its failure
    /// takes with it (`one_for_all`: all; `rest_for_one`: those after it):
    /// each live one is sent SIGKILL, in group order, and its death is
    /// rebooted when the event loop sees it, as on a crash (the loop never
    /// waits here for a process to die: one in an uninterruptible sleep
    /// would hold it). Their restarts take no one else with them.
    fn restart_group_of(&mut self, idx: usize) -> Result<Option<StopReason>, SupervisorError> {
        let failed = self.comps[idx].spec.name.clone();
        let Some(group) = self.groups.iter().find(|g| g.members.contains(&failed)) else {
            return Ok(None);
        };
        let (group_name, others): (String, Vec<String>) = (
            group.name.clone(),
            group
                .restarted_with(&failed)
                .into_iter()
                .map(String::from)
                .collect(),
        );
        for other in others {
            let Some(j) = self.comps.iter().position(|m| m.spec.name == other) else {
                continue;
            };
            let m = &mut self.comps[j];
            // Down, starting, given up or already killed: nothing live to
            // restart.
            let Some(live) = m.live().filter(|_| m.killed_for_group.is_none()) else {
                continue;
            };
            live.proc.signal(Signal::KILL);
            m.killed_for_group = Some(idx);
            self.emit(Event::GroupRestarted {
                component: other,
                group: group_name.clone(),
                because: failed.clone(),
            });
        }
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
        if journaled && !self.ladder.fresh_next(&name) {
            // Its state comes back from a checkpoint and the log: the
            // descriptors it holds of its servers stay valid (see
            // `Edge::client_restored`).
            for u in &self.comps[idx].wiring.used {
                u.edge.client_restored();
            }
        } else {
            self.client_gone(idx);
        }
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

    /// Starts a new incarnation of component `idx` and recovers its state;
    /// tries again while its policy allows, then gives up. An incarnation
    /// slow to initialize is left to the event loop
    /// ([`Self::check_starting`]), which serves the other components
    /// meanwhile.
    pub(crate) fn restart(
        &mut self,
        idx: usize,
        mut attempt: Attempt,
    ) -> Result<Option<StopReason>, SupervisorError> {
        loop {
            let m = &mut self.comps[idx];
            if let Err(reason) = m
                .restarts
                .attempt(Instant::now(), attempt.failed, &attempt.last)
            {
                return Ok(self.give_up(idx, reason, attempt.pending));
            }
            if m.spec.reboot == RebootMode::Exec {
                self.respawn_zygote(idx)?;
            }
            let inc = self.fork_now(idx)?;
            let deadline = Instant::now() + self.start_timeout(idx);
            let waited = self.launch(idx, inc, deadline, SYNC_ACTIVATION);
            match self.after_start(idx, waited, deadline, attempt)? {
                Next::Done(stop) => return Ok(stop),
                Next::Retry(a) => attempt = a,
            }
        }
    }

    /// What follows an activation's wait: the component is back, or its
    /// incarnation is still initializing (parked), or another is to be tried.
    pub(crate) fn after_start(
        &mut self,
        idx: usize,
        waited: Waited,
        deadline: Instant,
        mut attempt: Attempt,
    ) -> Result<Next, SupervisorError> {
        let failure = match waited {
            Waited::Pending(inc) => {
                // What happened so far is told now, not when it is ready.
                let told = std::mem::take(&mut attempt.pending);
                told.into_iter().for_each(|e| self.emit(e));
                self.comps[idx].phase = Phase::Starting {
                    inc,
                    deadline,
                    attempt,
                };
                return Ok(Next::Done(None));
            }
            Waited::Ready(pid) => match self.recover_state(idx, &mut attempt.pending) {
                Ok(()) => return self.back_up(idx, pid, attempt).map(Next::Done),
                Err(f) => (pid, f),
            },
            Waited::Failed(_, ActivationFailure::Interrupted) => {
                attempt.pending.into_iter().for_each(|e| self.emit(e));
                return Ok(Next::Done(Some(StopReason::Signal)));
            }
            Waited::Failed(pid, f) => (pid, f),
        };
        let (pid, failure) = failure;
        let name = &self.comps[idx].spec.name;
        tracing::warn!("{name}: new incarnation {pid} failed: {failure}");
        attempt.failed += 1;
        attempt.last = failure.to_string();
        Ok(Next::Retry(attempt))
    }

    /// Component `idx` serves again, as incarnation `pid`.
    fn back_up(
        &mut self,
        idx: usize,
        pid: u32,
        mut attempt: Attempt,
    ) -> Result<Option<StopReason>, SupervisorError> {
        let m = &self.comps[idx];
        let ctl: &ControlBlock = m.wiring.control.at(0);
        attempt.pending.push(Event::Rebooted {
            component: m.spec.name.clone(),
            epoch: m.epoch,
            pid,
            took: attempt.since.elapsed(),
            init: Duration::from_nanos(ctl.init_ns.load(Ordering::SeqCst)),
        });
        self.watch_live(idx);
        attempt.pending.into_iter().for_each(|e| self.emit(e));
        if self.comps[idx].spec.reboot == RebootMode::Standby {
            self.request_fork(idx)?;
        }
        Ok(None)
    }

    /// Retires component `idx` for `reason`: the system stops, or the
    /// component stays failed, as its policy says.
    fn give_up(
        &mut self,
        idx: usize,
        reason: GiveUpReason,
        mut pending: Vec<Event>,
    ) -> Option<StopReason> {
        let m = &mut self.comps[idx];
        let action = match reason {
            // Not restarting it is its policy, not a failure of the system.
            GiveUpReason::Temporary => GiveUpAction::Isolate,
            _ => m.spec.restart.on_give_up,
        };
        let name = m.spec.name.clone();
        m.retire();
        pending.push(Event::GaveUp {
            component: name.clone(),
            reason,
            action,
        });
        pending.into_iter().for_each(|e| self.emit(e));
        match action {
            GiveUpAction::Stop => Some(StopReason::GaveUp(name)),
            GiveUpAction::Isolate => None,
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
        let fresh = self.ladder.take_fresh(&name);
        match self.roster.recover(&name, fresh) {
            Ok(done) => {
                let journal = m.wiring.durable.journal.as_deref();
                let served = journal.map_or(0, JournalRegion::served);
                self.ladder.recovered(&name, done.pid, served);
                pending.push(Event::Replayed {
                    component: name,
                    pid: done.pid,
                    kind: done.kind,
                    pages: done.pages,
                    compared: done.compared,
                    layout_calls: done.layout_calls,
                    pause: Duration::from_micros(done.pause_us),
                    entries: done.replayed,
                    replay: Duration::from_micros(done.replay_us),
                    calls: done.replayed_calls,
                    diverged: done.diverged,
                    started_over: done.started_over,
                });
                Ok(())
            }
            Err(e) => {
                if self.ladder.recovery_failed(&name) {
                    tracing::warn!(
                        "{name}: its checkpoint recovery failed twice in a row ({e}): the next incarnation starts afresh, its checkpoint and request log dropped (its state is lost)"
                    );
                }
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

//! Stopping the system: every component, clients before their servers.
//!
//! A component is asked to stop (SIGTERM) and given its grace; while the
//! supervisor waits for it, any other component that exits meanwhile (it
//! finished its work, or crashed) is reaped at once and its servers are
//! told, as the event loop would have, so that the locks and leases it held
//! are released for the components still finishing their last calls. (Once
//! they were reaped only in their own turn: a client waiting for a lease of
//! an exited component waited out its whole grace and was killed.)

use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use rustix::event::{poll, PollFd, PollFlags};
use rustix::process::Signal;

use kintsugi_runtime::futex::timespec;

use crate::chaos::VICTIM_GRACE;
use crate::events::Exit;
use crate::managed::{Incarnation, Phase};
use crate::options::LastExit;
use crate::supervisor::Supervisor;
use crate::zygote;

impl Supervisor<'_> {
    /// Stops every component, clients before their servers, and returns how
    /// each live incarnation ended, in start order.
    pub(crate) fn shutdown(&mut self) -> Vec<LastExit> {
        // SIGINT and SIGTERM stay caught while the components stop: a
        // second one (Ctrl-C again) kills those left at once, and says so,
        // rather than killing the supervisor without a word.
        let mut b = [0u8; 64];
        while matches!(rustix::io::read(&self.signal_pipe, &mut b), Ok(n) if n > 0) {}
        // No checkpoint or restore runs while the components stop, so no
        // request log is cut again: requests run unlogged from now on
        // (else a server with a full log would never answer the clients
        // that finish their calls before they stop).
        self.roster.set_checkpoints(None);
        if let Some(t) = self.checkpoint_thread.take() {
            let _ = t.join();
        }
        for m in &self.comps {
            if let Some(journal) = &m.wiring.durable.journal {
                journal.close();
            }
        }
        for m in &mut self.comps {
            if let Phase::Live { watch, inc } = &mut m.phase {
                *watch = None;
                // A stopped server would hold its clients' last calls, and
                // so their stop, for the whole grace.
                inc.proc.signal(Signal::CONT);
            }
        }
        let mut stopping = Stopping {
            exits: Vec::new(),
            hurried: false,
        };
        for idx in (0..self.comps.len()).rev() {
            self.stop_component(idx, &mut stopping);
        }
        for id in self.signal_ids.drain(..) {
            signal_hook::low_level::unregister(id);
        }
        // Every process that wrote to the output pipes is gone: what
        // they wrote is relayed before the run returns.
        self.output.finish();
        stopping.exits.sort_by_key(|(idx, _)| *idx);
        stopping.exits.into_iter().map(|(_, e)| e).collect()
    }

    /// Stops component `idx`'s live incarnation and every process it has.
    fn stop_component(&mut self, idx: usize, stopping: &mut Stopping) {
        let m = &mut self.comps[idx];
        for p in m.dying.drain(..) {
            p.kill();
        }
        if let Some(live) = m.take_live() {
            let grace = match stopping.hurried {
                true => Duration::ZERO,
                false => m.spec.stop_timeout.unwrap_or(self.options.stop_grace),
            };
            let exit = self.stop_live(idx, &live, grace, stopping);
            // Its servers are not told: they stop next, and what a server
            // does for a dead client (closing its descriptors) must not
            // reach what it keeps for the system's next start.
            stopping.exits.push((idx, self.last_exit(idx, &live, exit)));
        }
        let m = &mut self.comps[idx];
        if let Some((starting, _, _)) = m.take_starting() {
            starting.proc.kill();
        }
        for s in &m.wiring.served {
            s.edge.server_gone();
        }
        let (parked, pending) = m.standby.abandon();
        if let Some(s) = parked {
            s.proc.kill();
        }
        if pending {
            if let Some(orphan) = zygote::drain_reply(&m.zygote.sock, Duration::from_secs(1)) {
                orphan.kill();
            }
        }
        if m.zygote.proc.try_reap().is_none() {
            m.zygote.proc.kill();
        }
    }

    /// Asks component `idx`'s `live` incarnation to stop (SIGTERM) and waits up to `grace` for it, then
    /// kills it; a second SIGINT or SIGTERM to the supervisor kills it (and
    /// the components left) at once. Other components that exit meanwhile
    /// are reaped and their servers told.
    fn stop_live(
        &mut self,
        idx: usize,
        live: &Incarnation,
        grace: Duration,
        stopping: &mut Stopping,
    ) -> Exit {
        live.proc.signal(Signal::TERM);
        // A stopped process acts on no signal but SIGKILL (systemd sends
        // SIGCONT after SIGTERM too).
        live.proc.signal(Signal::CONT);
        let deadline = Instant::now() + grace;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let others: Vec<usize> = (0..self.comps.len())
                .filter(|&j| self.comps[j].live().is_some())
                .collect();
            let (hurry, exited) = {
                let mut fds = vec![
                    PollFd::new(&live.proc.pidfd, PollFlags::IN),
                    PollFd::from_borrowed_fd(self.signal_pipe.as_fd(), PollFlags::IN),
                ];
                fds.extend(others.iter().map(|&j| {
                    let other = self.comps[j].live().expect("live");
                    PollFd::new(&other.proc.pidfd, PollFlags::IN)
                }));
                while let Err(rustix::io::Errno::INTR) = poll(&mut fds, Some(&timespec(left))) {}
                let readable = |fd: &PollFd<'_>| fd.revents().contains(PollFlags::IN);
                let exited: Vec<usize> = others
                    .iter()
                    .zip(&fds[2..])
                    .filter(|(_, fd)| readable(fd))
                    .map(|(&j, _)| j)
                    .collect();
                (readable(&fds[1]), exited)
            };
            if let Some(e) = live.proc.try_reap() {
                return e;
            }
            for j in exited {
                self.reap_exited(j, stopping);
            }
            if hurry && !stopping.hurried {
                stopping.hurried = true;
                tracing::warn!(
                    "interrupted again while stopping: {} and the components left are killed now",
                    self.comps[idx].spec.name
                );
            }
            if stopping.hurried || left.is_zero() {
                return live.proc.kill();
            }
        }
    }

    /// Component `j`, not yet asked to stop, exited: its exit is its last,
    /// and its servers are told, as the event loop tells them of a
    /// component that finishes while the system runs.
    fn reap_exited(&mut self, j: usize, stopping: &mut Stopping) {
        let m = &mut self.comps[j];
        let Some(exit) = m.live().and_then(|l| l.proc.try_reap()) else {
            return;
        };
        let live = m.take_live().expect("reaped");
        stopping.exits.push((j, self.last_exit(j, &live, exit)));
        self.client_gone(j);
    }

    /// How component `idx`'s last incarnation `live` ended.
    fn last_exit(&self, idx: usize, live: &Incarnation, exit: Exit) -> LastExit {
        // Signalled by the injector within its grace: a death by that
        // signal is the fault, not a failed stop.
        let hit = self.chaos.as_ref().is_some_and(|c| {
            c.after_injection(live.proc.pid, Instant::now())
                .is_some_and(|after| after < VICTIM_GRACE)
        });
        let injected = hit && !matches!(exit, Exit::Code(0) | Exit::Signal(15));
        LastExit {
            component: self.comps[idx].spec.name.clone(),
            exit,
            injected,
        }
    }
}

/// What the stop has gathered so far.
struct Stopping {
    /// Each live incarnation's exit, by component index.
    exits: Vec<(usize, LastExit)>,
    /// Interrupted again: the components left are killed at once.
    hurried: bool,
}

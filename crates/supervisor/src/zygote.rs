//! The supervisor's side of the zygote protocol
//! ([`kintsugi_runtime::abi::zygote`]): exec a component's pristine
//! image, ask it for standbys, read its replies, and replace it when it dies.

use std::os::fd::{AsFd, OwnedFd};
use std::time::{Duration, Instant};

use kintsugi_runtime::abi::fdpass;
use kintsugi_runtime::abi::zygote;
use kintsugi_runtime::futex::timespec;
use kintsugi_system::{ComponentSpec, RebootMode};
use rustix::event::{poll, PollFd, PollFlags};

use crate::events::Event;
use crate::managed::{Incarnation, SystemWide, Wiring};
use crate::options::SupervisorError;
use crate::process::{cpu_set, spawn_component, Confinement, Proc};
use crate::source::{listen, Source};
use crate::supervisor::Supervisor;

/// Execs `spec`'s binary as a new pristine image wired by `wiring`.
pub(crate) fn exec(
    spec: &ComponentSpec,
    wiring: &Wiring,
    wide: SystemWide,
) -> Result<Proc, SupervisorError> {
    let (boot, pass) = wiring.boot_info(spec, wide);
    let json = serde_json::to_string(&boot).expect("boot info serializes");
    let spawned = cpu_set(&spec.cpus).and_then(|cpus| {
        // A checkpointed component gets the same layout at every exec, so
        // that its images restore under another supervisor (another machine).
        let how = Confinement {
            nice: spec.priority,
            fixed_layout: spec.checkpoint.is_some(),
            one_malloc_arena: spec.recovery == kintsugi_system::RecoveryMode::Checkpoint,
            capabilities: spec
                .capabilities
                .iter()
                .fold(0u64, |mask, c| mask | 1 << c.number()),
            ceiling: wiring.ceiling,
            user: spec.user.as_ref().map(|u| (u.uid, u.gid)),
            cpus,
        };
        spawn_component(&spec.binary, &json, &pass, &wiring.output, how)
    });
    spawned.map_err(|source| {
        let source = match &spec.user {
            Some(u) if source.kind() == std::io::ErrorKind::PermissionDenied => {
                std::io::Error::new(
                    source.kind(),
                    format!(
                        "running it as user `{}` (uid {}) needs a supervisor run by root: {source}",
                        u.name, u.uid
                    ),
                )
            }
            _ => source,
        };
        SupervisorError::Spawn {
            component: spec.name.clone(),
            binary: spec.binary.display().to_string(),
            source,
        }
    })
}

/// The standby announced by a pending fork reply, if one arrives within `wait`.
pub(crate) fn drain_reply(sock: &OwnedFd, wait: Duration) -> Option<Proc> {
    let mut fds = [PollFd::new(sock, PollFlags::IN)];
    let ts = timespec(wait);
    poll(&mut fds, Some(&ts)).ok()?;
    if !fds[0].revents().contains(PollFlags::IN) {
        return None;
    }
    let (msg, _) = fdpass::recv(sock.as_fd()).ok()?;
    let pid = zygote::Forked::decode(&msg)?.pid;
    Proc::adopt_child(pid).ok()
}

impl Supervisor<'_> {
    /// Asks the zygote for a standby without waiting for it.
    pub(crate) fn request_fork(&mut self, idx: usize) -> Result<(), SupervisorError> {
        let m = &mut self.comps[idx];
        if let Some(cmd) = m.standby.request() {
            fdpass::send(&m.zygote.sock, &cmd.encode(), &[])?;
        }
        Ok(())
    }

    /// Reads the zygote's reply to a fork request (waiting up to the ready timeout).
    pub(crate) fn take_fork_reply(&mut self, idx: usize) -> Result<Incarnation, SupervisorError> {
        let timeout = self.start_timeout(idx);
        let m = &mut self.comps[idx];
        let boot_err = |detail: String| SupervisorError::Boot {
            component: m.spec.name.clone(),
            detail,
        };
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(boot_err(format!(
                    "no reply from the pristine image within {} ms",
                    timeout.as_millis()
                )));
            }
            let ts = timespec(left);
            let mut fds = [
                PollFd::new(&m.zygote.sock, PollFlags::IN),
                PollFd::new(&m.zygote.proc.pidfd, PollFlags::IN),
            ];
            match poll(&mut fds, Some(&ts)) {
                Err(rustix::io::Errno::INTR) => continue,
                r => {
                    r?;
                }
            }
            if fds[0].revents().contains(PollFlags::IN) {
                break;
            }
            if !fds[1].revents().is_empty() {
                let exit = m
                    .zygote
                    .proc
                    .try_reap()
                    .map_or("an unknown status".to_string(), |e| e.to_string());
                return Err(boot_err(format!(
                    "the process exited during boot with {exit}"
                )));
            }
        }
        let (msg, _) = fdpass::recv(&m.zygote.sock)?;
        let forked = zygote::Forked::decode(&msg)
            .ok_or_else(|| boot_err("malformed zygote reply".into()))?;
        let (generation, bank) = m.standby.answer(forked).map_err(boot_err)?;
        let proc = Proc::adopt_child(forked.pid)?;
        listen(&self.epoll, &proc.pidfd, Source::Exit(forked.pid))?;
        Ok(Incarnation {
            proc,
            generation,
            bank,
        })
    }

    /// The zygote's socket is readable: park the standby it announces.
    pub(crate) fn on_zygote(&mut self, idx: usize) -> Result<(), SupervisorError> {
        if self.comps[idx].standby.pending() {
            let inc = self.take_fork_reply(idx)?;
            let m = &mut self.comps[idx];
            if m.spec.checkpoint.is_some() {
                self.roster.standby_parked(&m.spec.name, inc.proc.pid);
            }
            m.standby.park(inc);
        }
        Ok(())
    }

    /// A standby now: the warm one if there is one, else forked on the spot.
    pub(crate) fn fork_now(&mut self, idx: usize) -> Result<Incarnation, SupervisorError> {
        if let Some(s) = self.comps[idx].standby.take() {
            return Ok(s);
        }
        self.request_fork(idx)?;
        self.take_fork_reply(idx)
    }

    /// Replaces the pristine image by exec'ing the binary again.
    pub(crate) fn respawn_zygote(&mut self, idx: usize) -> Result<(), SupervisorError> {
        let wide = self.wide;
        let m = &mut self.comps[idx];
        let (parked, pending) = m.standby.abandon();
        if let Some(s) = parked {
            s.proc.kill();
        }
        if pending {
            // A standby the old zygote forked before it died must not linger.
            if let Some(orphan) = drain_reply(&m.zygote.sock, Duration::ZERO) {
                orphan.kill();
            }
        }
        if m.zygote.proc.try_reap().is_none() {
            m.zygote.proc.kill();
        }
        let proc = exec(&m.spec, &m.wiring, wide)?;
        listen(&self.epoll, &proc.pidfd, Source::Exit(proc.pid))?;
        let pid = proc.pid;
        m.zygote.proc = proc;
        if m.spec.reboot != RebootMode::Exec {
            let component = m.spec.name.clone();
            self.emit(Event::ZygoteRespawned { component, pid });
            if self.comps[idx].spec.reboot == RebootMode::Standby {
                self.request_fork(idx)?;
            }
        }
        Ok(())
    }
}

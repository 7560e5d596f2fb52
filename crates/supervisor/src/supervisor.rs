//! The supervisor's event loop: start the system in dependency order, watch
//! every process through its pidfd and its threads' lifelines, micro-reboot
//! what dies (`reboot.rs`), keep standbys warm (`zygote.rs`), carry out a
//! crash schedule (`chaos.rs`), and stop everything cleanly.

use std::collections::HashMap;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kintsugi_runtime::abi::boot::ControlBlock;
use kintsugi_runtime::abi::channel::Edge;
use kintsugi_runtime::abi::shm::Region;
use kintsugi_runtime::futex::timespec;
use kintsugi_runtime::futex::Spin;
use kintsugi_runtime::priority::{self, Priority};
use kintsugi_system::{
    ComponentSpec, HangAction, RebootMode, RecoveryMode, RestartGroup, RestartType, SpinPolicy,
    System,
};

use crate::ladder::{HangAnswer, Ladder};
use crate::mailbox::Mailbox;
use crate::managed::SystemWide;
use crate::output::Relay;
use crate::watch::Watcher;
use rustix::event::epoll;
use rustix::net::{socketpair, AddressFamily, SocketFlags, SocketType};
use rustix::process::Signal;

use crate::activation::Attempt;
use crate::chaos::{Chaos, Target};
use crate::checkpoints::{self, Command, Kept, Quiet, Tracked};
use crate::events::{Event, Exit};
use crate::managed::{Durable, Managed, Phase, Role, Served, Standby, Used, Wiring, Zygote};
use crate::options::{Options, Report, StopReason, SupervisorError};
use crate::policy::RestartWindow;
use crate::roster::{call_name, FaultReport, RollbackOutcome, Roster};
use crate::sockets::Inherited;
use crate::source::{listen, Source};
use crate::vault::{priority_ceiling, Limits, VaultActivity, VaultStore};
use crate::watchdog::Monitor;
use crate::zygote;
use kintsugi_checkpoint::Image;
use std::path::PathBuf;

/// The nice value of the supervisor's threads (event loop, vault, lifeline
/// watchers, watchdog monitor), above the components' default of 0: a
/// reboot must not wait behind the components, and least of all behind the
/// dead incarnation's threads, which tear down its address space in the
/// kernel on the CPU the event loop shares with them. Measured with
/// `kintsugi bench recovery`: waking the standby (the reboot's "memory"
/// part) took 130–300 µs p50 with the supervisor at nice 0 and 91–129 µs at
/// nice -10 (docs/benchmarks.md).
const SUPERVISOR_NICE: i32 = -10;

/// How long a planned stop waits for a restart group's member killed for
/// its group to die and be restarted.
const GROUP_SETTLE: Duration = Duration::from_secs(1);

/// The calling thread at [`SUPERVISOR_NICE`] while it lives (where the
/// kernel permits: without `CAP_SYS_NICE` it stays as it was), then back.
struct Raised {
    was: Option<Priority>,
}

impl Raised {
    fn new() -> Self {
        let was = priority::current();
        if was.fifo.is_some() || was.nice <= SUPERVISOR_NICE {
            return Self { was: None };
        }
        match priority::apply_to_current_thread(Priority::nice(SUPERVISOR_NICE)) {
            Ok(()) => Self { was: Some(was) },
            Err(e) => {
                tracing::debug!("the supervisor keeps its priority: {e}");
                // The module remembers what it was asked for; tell it the truth.
                let _ = priority::apply_to_current_thread(was);
                Self { was: None }
            }
        }
    }
}

impl Drop for Raised {
    fn drop(&mut self) {
        if let Some(was) = self.was {
            let _ = priority::apply_to_current_thread(was);
        }
    }
}

/// Runs `system` until it is stopped; `on_event` sees every event as it happens.
pub fn run(
    system: &System,
    options: Options,
    on_event: &mut dyn FnMut(&Event),
) -> Result<Report, SupervisorError> {
    // Before any thread of the supervisor is started: they inherit it.
    let _raised = Raised::new();
    // No component may open the supervisor's descriptors through /proc
    // (every channel and memfd of the system is among them).
    kintsugi_runtime::process::private_memory()?;
    let mut sup = Supervisor::new(options, on_event)?;
    sup.wide = SystemWide {
        watchdog: system.watchdog.enabled,
        spin: match system.spin {
            SpinPolicy::Always => Spin::Always,
            SpinPolicy::UnlessOversubscribed => Spin::UnlessOversubscribed,
            SpinPolicy::Adaptive => Spin::Adaptive,
        },
    };
    let result = sup.start(system).and_then(|()| {
        // Stopped (dropped) before the components are.
        let _monitor = match system.watched() {
            true => Some(Monitor::start(
                sup.roster.clone(),
                system.watchdog.clone(),
                system
                    .components
                    .iter()
                    .map(|c| (c.name.clone(), system.watchdog_of(&c.name).clone()))
                    .collect(),
                sup.options.interfaces.clone(),
            )?),
            false => None,
        };
        sup.event_loop()
    });
    let reason = match result {
        Ok(reason) => reason,
        Err(e) => {
            sup.shutdown();
            return Err(e);
        }
    };
    sup.settle();
    let exits = sup.shutdown();
    sup.emit(Event::Stopped {
        reason: format!("{reason:?}"),
    });
    Ok(Report { reason, exits })
}

pub(crate) struct Supervisor<'a> {
    pub(crate) options: Options,
    on_event: &'a mut dyn FnMut(&Event),
    pub(crate) comps: Vec<Managed>,
    pub(crate) epoll: OwnedFd,
    pub(crate) signal_pipe: OwnedFd,
    /// Lifeline watchers write here; the event loop reads.
    lifeline_pipe: OwnedFd,
    pub(crate) lifeline_notify: Arc<OwnedFd>,
    /// Each component's lifeline watcher, made at its first live
    /// incarnation.
    pub(crate) watchers: HashMap<usize, Watcher>,
    pub(crate) signal_ids: Vec<signal_hook::SigId>,
    vault: VaultStore,
    pub(crate) chaos: Option<Chaos>,
    started: Instant,
    pub(crate) roster: Arc<Roster>,
    /// Woken by [`Roster::report_fault`].
    fault_pipe: OwnedFd,
    /// What every component is told at boot.
    pub(crate) wide: SystemWide,
    /// What the checkpoint thread will keep of each component, gathered
    /// at boot, and its commands, queued until it starts.
    tracked: Vec<Tracked>,
    checkpoint_commands: Option<Arc<Mailbox<Command>>>,
    pub(crate) checkpoint_thread: Option<std::thread::JoinHandle<()>>,
    /// Images to restore at boot (`Options::restores`), read and checked
    /// before anything starts.
    restores: HashMap<String, (PathBuf, Image)>,
    /// Each component's last restore after a failure, which decides how
    /// its next hang is answered.
    pub(crate) ladder: Ladder,
    /// Restarts put off by the restart policy's backoff.
    pub(crate) deferred: Vec<Deferred>,
    /// Components restarted together (`[[group]]`).
    pub(crate) groups: Vec<RestartGroup>,
    /// Relays what the components print.
    pub(crate) output: Relay,
}

impl<'a> Supervisor<'a> {
    fn new(
        mut options: Options,
        on_event: &'a mut dyn FnMut(&Event),
    ) -> Result<Self, SupervisorError> {
        let epoll = epoll::create(epoll::CreateFlags::CLOEXEC)?;
        let (signal_pipe, write_end) = rustix::pipe::pipe_with(
            rustix::pipe::PipeFlags::CLOEXEC | rustix::pipe::PipeFlags::NONBLOCK,
        )?;
        let write_end = std::os::unix::net::UnixStream::from(write_end);
        let mut signal_ids = Vec::new();
        for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
            signal_ids.push(signal_hook::low_level::pipe::register(
                sig,
                write_end.try_clone()?,
            )?);
        }
        listen(&epoll, &signal_pipe, Source::Signal)?;
        let (lifeline_pipe, lifeline_notify) =
            rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
        listen(&epoll, &lifeline_pipe, Source::Lifeline)?;
        let chaos = options.chaos.take().map(Chaos::new);
        let roster = options.roster.clone().unwrap_or_default();
        let (fault_pipe, fault_notify) = rustix::pipe::pipe_with(
            rustix::pipe::PipeFlags::CLOEXEC | rustix::pipe::PipeFlags::NONBLOCK,
        )?;
        roster.set_notify(fault_notify);
        let output = Relay::start(
            roster.clone(),
            options.journal.clone(),
            options.component_stdout,
            roster.thread_turns("output", options.heartbeat),
        )?;
        let checkpoint_commands = Arc::new(Mailbox::new());
        roster.set_checkpoints(Some(checkpoint_commands.clone()));
        listen(&epoll, &fault_pipe, Source::Fault)?;
        Ok(Self {
            options,
            on_event,
            comps: Vec::new(),
            epoll,
            signal_pipe,
            lifeline_pipe,
            lifeline_notify: Arc::new(lifeline_notify),
            watchers: HashMap::new(),
            signal_ids,
            vault: VaultStore::default(),
            chaos,
            started: Instant::now(),
            roster,
            fault_pipe,
            wide: SystemWide::default(),
            tracked: Vec::new(),
            checkpoint_commands: Some(checkpoint_commands),
            checkpoint_thread: None,
            restores: HashMap::new(),
            ladder: Ladder::default(),
            deferred: Vec::new(),
            groups: Vec::new(),
            output,
        })
    }

    pub(crate) fn emit(&mut self, e: Event) {
        self.roster.observe(&e);
        (self.on_event)(&e);
    }

    /// Creates every channel, then boots each component in start order.
    fn start(&mut self, system: &System) -> Result<(), SupervisorError> {
        if let Some(c) = &self.chaos {
            if system.component(c.target()).is_none() {
                return Err(SupervisorError::UnknownTarget(c.target().to_string()));
            }
        }
        // The vault holds every component's descriptors, and duplicates
        // them into its replies: its table grown now costs one wait for
        // an RCU grace period, not one per doubling on a reboot's path
        // (kintsugi_runtime::process::reserve_descriptors).
        let vault_fds = system
            .components
            .iter()
            .map(|c| 2 * c.vault_quota.fds)
            .sum();
        if let Err(e) =
            kintsugi_runtime::process::reserve_descriptors(self.signal_pipe.as_fd(), vault_fds)
        {
            tracing::warn!("descriptor table not grown ahead: {e}");
        }
        if let Some(storage) = &system.vault {
            let known = |c: &str| system.components.iter().any(|s| s.name == c);
            let inherited = self.options.keeper.as_mut();
            self.vault =
                VaultStore::open(storage, &known, inherited).map_err(SupervisorError::Vault)?;
            // What no record took: the dead supervisor's leftovers.
            if let Some(left) = self.options.keeper.as_mut().filter(|k| !k.is_empty()) {
                tracing::info!(
                    "{} inherited descriptors no record named, closed",
                    left.len()
                );
                *left = Inherited::first();
            }
        }
        self.read_restores(system)?;
        self.hand_sockets(system);
        self.groups = system.groups.clone();
        let mut durable = system
            .components
            .iter()
            .map(|c| Ok((c.name.as_str(), Durable::create(c)?)))
            .collect::<std::io::Result<HashMap<_, _>>>()?;
        let pools: HashMap<&str, Arc<Region>> = durable
            .iter()
            .filter_map(|(name, d)| Some((*name, d.pool.clone()?)))
            .collect();
        // One edge per (client, used interface), sized by the server's slots.
        let mut edges: Vec<(&ComponentSpec, &str, &str, Arc<Edge>)> = Vec::new(); // client, server, interface
        for c in &system.components {
            for u in &c.uses {
                let slots = system.component(&u.server).map_or(8, |s| s.slots);
                let edge = Edge::create(
                    &format!("kintsugi:{}->{}:{}", c.name, u.server, u.interface),
                    slots,
                )?;
                edges.push((c, &u.server, &u.interface, Arc::new(edge)));
            }
        }
        for spec in &system.components {
            let served = edges
                .iter()
                .filter(|(_, s, _, _)| *s == spec.name)
                .map(|(c, _, i, e)| Served {
                    client: c.name.clone(),
                    client_id: c.id,
                    interface: i.to_string(),
                    edge: e.clone(),
                    recovered_seen: 0,
                })
                .collect();
            let used = edges
                .iter()
                .filter(|(c, _, _, _)| c.name == spec.name)
                .map(|(_, s, i, e)| Used {
                    interface: i.to_string(),
                    server: s.to_string(),
                    server_id: system.component(s).map_or(0, |c| c.id),
                    edge: e.clone(),
                    pool: pools.get(s).cloned(),
                    replayed: system
                        .component(s)
                        .is_some_and(|c| c.recovery == RecoveryMode::Checkpoint),
                })
                .collect();
            let durable = durable
                .remove(spec.name.as_str())
                .expect("one per component");
            let limits = Limits {
                quota: spec.vault_quota,
                usage: Arc::default(),
                ceiling: priority_ceiling(system, &spec.name),
                id: spec.id,
                servers: spec
                    .uses
                    .iter()
                    .map(|u| (u.interface.clone(), u.server.clone()))
                    .collect(),
            };
            self.boot(spec, served, used, durable, limits)?;
        }
        let dir = self.options.checkpoint_dir.clone().unwrap_or_else(|| {
            std::env::temp_dir().join(format!("kintsugi-checkpoints-{}", std::process::id()))
        });
        if let Some(rx) = self.checkpoint_commands.take() {
            let tracked = std::mem::take(&mut self.tracked);
            self.checkpoint_thread = Some(checkpoints::start(tracked, dir, rx)?);
        }
        self.restore_at_boot()
    }

    /// Reads every image of `Options::restores`: a bad file stops the
    /// start before anything runs.
    fn read_restores(&mut self, system: &System) -> Result<(), SupervisorError> {
        for (name, path) in &self.options.restores {
            let fail = |detail: String| SupervisorError::Restore {
                component: name.clone(),
                file: path.display().to_string(),
                detail,
            };
            if system.component(name).is_none() {
                return Err(fail("no such component in this system".into()));
            }
            let image = kintsugi_checkpoint::file::read(path).map_err(|e| fail(e.to_string()))?;
            self.restores.insert(name.clone(), (path.clone(), image));
        }
        Ok(())
    }

    /// Restores each image of `Options::restores` into its component's
    /// first incarnation, now serving.
    fn restore_at_boot(&mut self) -> Result<(), SupervisorError> {
        for (name, (path, _)) in std::mem::take(&mut self.restores) {
            let done = self
                .roster
                .restore(&name, Some(path.clone()), false)
                .map_err(|detail| SupervisorError::Restore {
                    component: name.clone(),
                    file: path.display().to_string(),
                    detail,
                })?;
            self.emit(Event::Restored {
                component: name,
                pid: done.pid,
                file: path.display().to_string(),
                pages: done.pages,
                pause: Duration::from_micros(done.pause_us),
            });
        }
        Ok(())
    }

    /// Execs one component, forks its first incarnation and activates it.
    fn boot(
        &mut self,
        spec: &ComponentSpec,
        served: Vec<Served>,
        used: Vec<Used>,
        durable: Durable,
        limits: Limits,
    ) -> Result<(), SupervisorError> {
        let t0 = Instant::now();
        let control = Arc::new(Region::create(
            &format!("kintsugi:{}:control", spec.name),
            std::mem::size_of::<ControlBlock>(),
        )?);
        let seqpacket = || {
            socketpair(
                AddressFamily::UNIX,
                SocketType::SEQPACKET,
                SocketFlags::CLOEXEC,
                None,
            )
        };
        let (zygote_sock, zygote_peer) = seqpacket()?;
        let (vault_sock, vault_peer) = seqpacket()?;
        let activity = Arc::new(VaultActivity::default());
        let file_of = |r: Option<&Region>| -> std::io::Result<Option<std::fs::File>> {
            r.map(|r| r.dup_fd().map(std::fs::File::from)).transpose()
        };
        let kept = Kept {
            vault: self.vault.clone(),
            arena: file_of(durable.arena.as_ref())?,
            pool: file_of(durable.pool.as_deref())?,
        };
        if let Some((path, image)) = self.restores.get(&spec.name) {
            kept.import(&spec.name, &image.attachments)
                .map_err(|detail| SupervisorError::Restore {
                    component: spec.name.clone(),
                    file: path.display().to_string(),
                    detail,
                })?;
        }
        let freezes = Arc::new(AtomicU64::new(0));
        self.tracked.push(Tracked::new(
            spec.name.clone(),
            spec.checkpoint,
            Quiet {
                served: served.iter().map(|s| s.edge.clone()).collect(),
                used: used.iter().map(|u| u.edge.clone()).collect(),
                vault: activity.clone(),
                vault_sock: rustix::io::dup(&vault_sock)?,
                vault_peer: rustix::io::dup(&vault_peer)?,
                control: control.clone(),
                freezes: freezes.clone(),
            },
            kept,
            durable.journal.clone(),
        ));
        let usage = limits.usage.clone();
        let ceiling = limits.ceiling;
        let turns = self
            .roster
            .thread_turns(&format!("vault:{}", spec.name), self.options.heartbeat);
        self.vault
            .serve(spec.name.clone(), vault_sock, activity, limits, turns);
        let wiring = Wiring {
            control,
            zygote_peer,
            vault_peer,
            served,
            used,
            durable,
            output: self.output.pipes(&spec.name)?,
            ceiling,
        };
        let proc = zygote::exec(spec, &wiring, self.wide)?;
        let idx = self.comps.len();
        self.roster.add(
            &spec.name,
            wiring.control.clone(),
            wiring
                .served
                .iter()
                .map(|s| (s.interface.clone(), s.edge.clone()))
                .collect(),
            freezes,
            usage,
        );
        listen(&self.epoll, &proc.pidfd, Source::Exit(proc.pid))?;
        listen(&self.epoll, &zygote_sock, Source::Zygote(idx))?;
        self.comps.push(Managed {
            restarts: RestartWindow::new(&spec.restart),
            spec: spec.clone(),
            wiring,
            zygote: Zygote {
                proc,
                sock: zygote_sock,
            },
            phase: Phase::Down,
            standby: Standby::new(),
            dying: Vec::new(),
            killed_for_group: None,
            epoch: 0,
        });
        let inc = self.fork_now(idx)?;
        let pid = inc.proc.pid;
        if let Err(failure) = self.activate(idx, inc) {
            return Err(SupervisorError::Boot {
                component: spec.name.clone(),
                detail: failure.to_string(),
            });
        }
        self.watch_live(idx);
        self.emit(Event::Started {
            component: spec.name.clone(),
            pid,
            boot: t0.elapsed(),
        });
        if spec.reboot == RebootMode::Standby {
            self.request_fork(idx)?;
        }
        Ok(())
    }

    /// The chaos target's state, for the injector.
    fn chaos_target(&self) -> Target {
        let Some(chaos) = &self.chaos else {
            return Target::Retired;
        };
        match self.comps.iter().find(|m| m.spec.name == chaos.target()) {
            Some(m) if m.retired() => Target::Retired,
            Some(m) => m.live().map_or(Target::Down, |l| Target::Live(l.proc.pid)),
            None => Target::Retired,
        }
    }

    fn event_loop(&mut self) -> Result<StopReason, SupervisorError> {
        let mut buf = [MaybeUninit::<epoll::Event>::uninit(); 32];
        // A planned stop (the run's duration, the injections done) that came
        // while a restart group's member was killed for its group and not
        // yet restarted: the stop waits for that restart (up to
        // [`GROUP_SETTLE`]), or the member's clients would wait out their
        // whole stop grace for a server that is gone.
        let mut stopping: Option<(StopReason, Instant)> = None;
        loop {
            self.roster.turned();
            if self.roster.stop_requested() {
                return Ok(StopReason::Requested);
            }
            if stopping.is_none() {
                let reason = self.duration_over().or_else(|| {
                    self.inject_due();
                    self.injections_done()
                });
                stopping = reason.map(|r| (r, Instant::now()));
            }
            if let Some((reason, since)) = &stopping {
                if !self.group_restarting() || since.elapsed() >= GROUP_SETTLE {
                    return Ok(reason.clone());
                }
            }
            let now = Instant::now();
            if let Some(reason) = self.restart_due(now)? {
                return Ok(reason);
            }
            let target = self.chaos_target();
            let mut wake = self.chaos.as_ref().and_then(|c| c.wake(now, target));
            if let Some(reason) = self.check_starting()? {
                return Ok(reason);
            }
            let due = self.deferred.iter().map(|d| d.due).min();
            let beat = self.options.heartbeat.map(|h| Instant::now() + h);
            for due in [due, self.starting_wake(Instant::now()), beat]
                .into_iter()
                .flatten()
            {
                wake = Some(wake.map_or(due, |w| w.min(due)));
            }
            if let Some(d) = self.options.duration {
                let end = self.started + d;
                wake = Some(wake.map_or(end, |w| w.min(end)));
            }
            if let Some((_, since)) = &stopping {
                let end = *since + GROUP_SETTLE;
                wake = Some(wake.map_or(end, |w| w.min(end)));
            }
            let timeout = wake.map(|w| timespec(w.saturating_duration_since(Instant::now())));
            self.roster.flush_checkpoints();
            let (events, _) = match epoll::wait(&self.epoll, &mut buf, timeout.as_ref()) {
                Err(rustix::io::Errno::INTR) => continue,
                r => r?,
            };
            let sources: Vec<Source> = events.iter().filter_map(Source::of).collect();
            for source in sources {
                let stop = match source {
                    Source::Signal => {
                        let mut b = [0u8; 64];
                        let _ = rustix::io::read(&self.signal_pipe, &mut b);
                        Some(StopReason::Signal)
                    }
                    Source::Fault => {
                        self.on_fault_reports();
                        None
                    }
                    Source::Lifeline => self.on_lifelines()?,
                    Source::Zygote(idx) => {
                        self.on_zygote(idx)?;
                        None
                    }
                    Source::Exit(pid) => self.on_exit(pid)?,
                };
                if let Some(reason) = stop {
                    return Ok(reason);
                }
            }
        }
    }

    /// The run's planned end, if its duration is over.
    fn duration_over(&self) -> Option<StopReason> {
        let over = self
            .options
            .duration
            .is_some_and(|d| self.started.elapsed() >= d);
        over.then_some(StopReason::Duration)
    }

    /// Injects the next fault, if one is due.
    fn inject_due(&mut self) {
        let target = self.chaos_target();
        if let Some(sig) = self
            .chaos
            .as_mut()
            .and_then(|c| c.due(Instant::now(), target))
        {
            self.inject(sig);
        }
    }

    /// The run's planned end, if it stops after its injections
    /// (`stop_after_chaos`) and they are done.
    fn injections_done(&self) -> Option<StopReason> {
        let target = self.chaos_target();
        let done = self.options.stop_after_chaos
            && self
                .chaos
                .as_ref()
                .is_some_and(|c| c.finished(Instant::now(), target));
        done.then_some(StopReason::ChaosDone)
    }

    /// Whether a restart group's member was killed for its group and its
    /// death not yet handled (it is restarted when it is).
    fn group_restarting(&self) -> bool {
        self.comps.iter().any(|m| m.killed_for_group.is_some())
    }

    /// Restarts the components whose backoff delay is over at `now`.
    fn restart_due(&mut self, now: Instant) -> Result<Option<StopReason>, SupervisorError> {
        // Earliest first; restarts due together (a restart group's members
        // waiting for the one that backs off) in start order.
        while let Some(i) = (0..self.deferred.len())
            .filter(|&i| self.deferred[i].due <= now)
            .min_by_key(|&i| (self.deferred[i].due, self.deferred[i].idx))
        {
            let d = self.deferred.swap_remove(i);
            // Timed from the death's detection, as every reboot: its
            // clients waited out the delay too.
            if let Some(reason) = self.restart(d.idx, Attempt::new(d.detected, Vec::new()))? {
                return Ok(Some(reason));
            }
        }
        Ok(None)
    }

    /// Faults reported through the roster: each one that concerns a live
    /// incarnation is logged and the incarnation killed; its death then
    /// takes the crash path (reboot and recovery).
    fn on_fault_reports(&mut self) {
        let mut b = [0u8; 64];
        while matches!(rustix::io::read(&self.fault_pipe, &mut b), Ok(n) if n > 0) {}
        for report in self.roster.take_faults() {
            let Some(m) = self.comps.iter().find(|m| m.spec.name == report.component) else {
                continue;
            };
            if m.live().is_none_or(|l| l.proc.pid != report.pid) {
                continue;
            }
            if report.hang {
                let rollback = m
                    .spec
                    .checkpoint
                    .is_some_and(|p| p.on_hang == HangAction::Rollback);
                let hung = crate::ladder::failed(report.pid, m.wiring.durable.journal.as_deref());
                match self.ladder.answer(&report.component, hung, rollback) {
                    HangAnswer::RollBack => {
                        self.roll_back(report);
                        continue;
                    }
                    HangAnswer::RebootFresh => tracing::warn!(
                        "{}: hung again within {} ms of its checkpoint recovery, before serving anything new: it starts afresh, its checkpoint and request log dropped (its state is lost)",
                        report.component,
                        crate::ladder::AGAIN.as_millis()
                    ),
                    HangAnswer::Reboot => {}
                }
            }
            let Some(live) = self.live_of(&report.component, report.pid) else {
                continue;
            };
            live.proc.signal(Signal::KILL);
            self.emit(Event::FaultReported {
                component: report.component,
                pid: report.pid,
                detail: report.detail,
                hang: report.hang,
            });
        }
        for done in self.roster.take_rollbacks() {
            match done.result {
                Ok(s) => {
                    if let Some(c) = self.chaos.as_mut() {
                        c.rolled_back(done.pid);
                    }
                    self.emit(Event::RolledBack {
                        component: done.component,
                        pid: done.pid,
                        detail: done.detail,
                        pages: s.pages,
                        pause: Duration::from_micros(s.pause_us),
                        started_over: s.started_over,
                    })
                }
                Err(e) => self.roster.report_fault(FaultReport {
                    component: done.component,
                    pid: done.pid,
                    detail: format!("{}; the rollback failed: {e}", done.detail),
                    hang: false,
                }),
            }
        }
    }

    /// Puts each socket a service manager passed in the vault of the
    /// component that asks for it by name (see `sockets.rs`).
    fn hand_sockets(&mut self, system: &System) {
        let mut passed = std::mem::take(&mut self.options.sockets);
        for c in &system.components {
            for (key, name) in &c.sockets {
                match passed.take(name) {
                    Some(fd) => {
                        tracing::info!("socket activation: {name} is {}'s {key}", c.name);
                        self.vault.put_socket(&c.name, key, fd);
                    }
                    None => tracing::info!(
                        "socket activation: no socket named {name} was passed; {} makes its own {key}",
                        c.name
                    ),
                }
            }
        }
        for name in passed.unclaimed() {
            tracing::warn!(
                "socket activation: no component takes the socket named {name}; it is closed"
            );
        }
    }

    /// The live incarnation of `component`, if it is `pid`.
    fn live_of(&self, component: &str, pid: u32) -> Option<&crate::managed::Incarnation> {
        self.comps
            .iter()
            .find(|m| m.spec.name == component)?
            .live()
            .filter(|l| l.proc.pid == pid)
    }

    /// Rolls the hung incarnation back in place, off the event loop (the
    /// checkpoint thread answers); the outcome comes back through the
    /// roster, a failure as a fault report that reboots it.
    fn roll_back(&mut self, report: FaultReport) {
        self.ladder.rolled_back(&report.component, report.pid);
        let roster = self.roster.clone();
        let spawned = std::thread::Builder::new()
            .name("rollback".into())
            .spawn(move || {
                let result = roster.restore(&report.component, None, true);
                roster.rollback_done(RollbackOutcome {
                    component: report.component,
                    pid: report.pid,
                    detail: report.detail,
                    result,
                });
            });
        if let Err(e) = spawned {
            tracing::warn!("no rollback thread: {e}");
        }
    }

    /// Sends the chaos schedule's next signal to its target's live incarnation.
    fn inject(&mut self, sig: Signal) {
        let Some(chaos) = &self.chaos else { return };
        let target = chaos.target().to_string();
        let Some(m) = self.comps.iter().find(|m| m.spec.name == target) else {
            return;
        };
        let Some(live) = m.live() else { return };
        let in_flight = m
            .wiring
            .served
            .iter()
            .flat_map(|s| s.edge.in_flight().into_iter().map(|f| self.name_call(s, f)))
            .collect();
        let (pid, rss_kib) = (live.proc.pid, live.proc.rss_kib());
        live.proc.signal(sig);
        if let Some(c) = self.chaos.as_mut() {
            c.hit(pid, Instant::now());
        }
        self.emit(Event::Injected {
            component: target,
            pid,
            signal: sig.as_raw(),
            in_flight,
            rss_kib,
        });
    }

    /// `interface.function` for a call of `func` on a served edge.
    pub(crate) fn name_call(&self, served: &Served, func: u32) -> String {
        call_name(
            &self.options.interfaces,
            &served.interface,
            &served.edge,
            func,
        )
    }

    /// A watched process exited: find out which, and react.
    fn on_exit(&mut self, pid: u32) -> Result<Option<StopReason>, SupervisorError> {
        let detected = Instant::now();
        let Some((idx, role)) = self
            .comps
            .iter()
            .enumerate()
            .find_map(|(i, m)| Some((i, m.role_of(pid)?)))
        else {
            return Ok(None);
        };
        let m = &mut self.comps[idx];
        match role {
            Role::Dying(i) => {
                // Rebooted already, when its lifelines were cut; now it is gone.
                if m.dying[i].try_reap().is_some() {
                    m.dying.swap_remove(i);
                }
                Ok(None)
            }
            Role::Zygote => {
                if m.zygote.proc.try_reap().is_some() {
                    self.respawn_zygote(idx)?;
                }
                Ok(None)
            }
            Role::Standby => {
                if let Some(standby) = m.standby.take() {
                    if standby.proc.try_reap().is_none() {
                        m.standby.park(standby); // not gone after all
                        return Ok(None);
                    }
                }
                self.request_fork(idx)?;
                Ok(None)
            }
            Role::Live => self.on_live_exit(idx, pid, detected),
        }
    }

    /// The live incarnation of component `idx` exited: it finished, or it
    /// is rebooted.
    fn on_live_exit(
        &mut self,
        idx: usize,
        pid: u32,
        detected: Instant,
    ) -> Result<Option<StopReason>, SupervisorError> {
        let m = &mut self.comps[idx];
        let Some(exit) = m.live().and_then(|l| l.proc.try_reap()) else {
            return Ok(None);
        };
        m.take_live();
        self.roster.set_live(&m.spec.name, None, m.epoch);
        if exit == Exit::Code(0) && m.spec.restart.kind != RestartType::Permanent {
            m.retire();
            let name = m.spec.name.clone();
            self.client_gone(idx);
            self.emit(Event::Finished {
                component: name.clone(),
                exit,
            });
            return Ok((self.options.stop_when_finished.as_deref() == Some(&name))
                .then_some(StopReason::Finished(name)));
        }
        self.reboot(idx, pid, exit, detected)
    }

    /// Lifeline watchers report incarnations whose every thread has died:
    /// reboot them now, while the kernel still tears them down.
    fn on_lifelines(&mut self) -> Result<Option<StopReason>, SupervisorError> {
        let detected = Instant::now();
        let mut msg = [0u8; 8];
        if rustix::io::read(&self.lifeline_pipe, &mut msg)? != 8 {
            return Ok(None);
        }
        let idx = u32::from_le_bytes(msg[..4].try_into().unwrap()) as usize;
        let generation = u32::from_le_bytes(msg[4..].try_into().unwrap());
        let m = &mut self.comps[idx];
        if m.live().is_none_or(|l| l.generation != generation) {
            return Ok(None); // already handled through its pidfd
        }
        let exit = match &m.phase {
            Phase::Live { watch: Some(w), .. } => w.dying_exit(),
            _ => Exit::Signal(0),
        };
        let live = m.take_live().expect("checked");
        self.roster.set_live(&m.spec.name, None, m.epoch);
        let pid = live.proc.pid;
        m.dying.push(live.proc);
        self.reboot(idx, pid, exit, detected)
    }
}

/// A restart put off by the restart policy's backoff.
pub(crate) struct Deferred {
    /// When it is due.
    pub(crate) due: Instant,
    /// When the death it answers was detected.
    pub(crate) detected: Instant,
    /// The component.
    pub(crate) idx: usize,
}

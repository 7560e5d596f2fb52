//! The supervisor's event loop: start the system in dependency order, watch
//! every process through its pidfd and its threads' lifelines, micro-reboot
//! what dies, apply restart policies, and stop everything cleanly.

use std::collections::HashMap;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kintsugi_runtime::boot::{Activation, BootInfo, ControlBlock, ProvidedEdge, UsedEdge};
use kintsugi_runtime::channel::Edge;
use kintsugi_runtime::component::zygote;
use kintsugi_runtime::fdpass;
use kintsugi_runtime::futex::timespec;
use kintsugi_runtime::shm::Region;
use kintsugi_runtime::stub::InterfaceInfo;
use kintsugi_system::{ComponentSpec, RebootMode, System};
use rustix::event::epoll;
use rustix::event::{poll, PollFd, PollFlags};
use rustix::net::{socketpair, AddressFamily, SocketFlags, SocketType};
use rustix::process::Signal;
use thiserror::Error;

use crate::chaos::{Chaos, ChaosPlan};
use crate::events::{Event, Exit};
use crate::policy::RestartWindow;
use crate::process::{spawn_component, Proc};
use crate::roster::Roster;
use crate::vault::VaultStore;
use crate::watch::Watch;
use crate::watchdog::Monitor;

#[derive(Debug, Error)]
pub enum SupervisorError {
    #[error("component `{component}`: cannot start `{binary}`: {source}")]
    Spawn {
        component: String,
        binary: String,
        source: std::io::Error,
    },
    #[error("component `{component}` failed to boot: {detail}")]
    Boot { component: String, detail: String },
    #[error("chaos target `{0}` is not a component of this system")]
    UnknownTarget(String),
    #[error("supervisor: {0}")]
    Io(#[from] std::io::Error),
}

impl From<rustix::io::Errno> for SupervisorError {
    fn from(e: rustix::io::Errno) -> Self {
        SupervisorError::Io(e.into())
    }
}

/// How a run is steered.
pub struct Options {
    pub chaos: Option<ChaosPlan>,
    /// Stop the system once the chaos plan's count is reached.
    pub stop_after_chaos: bool,
    /// Stop the system when this component ends by itself.
    pub stop_when_finished: Option<String>,
    /// Stop after this long.
    pub duration: Option<Duration>,
    /// How long an incarnation may take to initialize.
    pub ready_timeout: Duration,
    /// How long a component may take to stop after SIGTERM.
    pub stop_grace: Duration,
    /// Interfaces known by name, to name the functions in flight at a fault.
    pub interfaces: Vec<&'static InterfaceInfo>,
    /// Detect deaths through lifelines as well as pidfds (see
    /// `kintsugi_runtime::lifeline`); off, only the pidfd reports them.
    pub lifelines: bool,
    /// A live view of the system for observers; one is made if not given.
    pub roster: Option<Arc<Roster>>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            chaos: None,
            stop_after_chaos: false,
            stop_when_finished: None,
            duration: None,
            ready_timeout: Duration::from_secs(10),
            stop_grace: Duration::from_secs(20),
            interfaces: Vec::new(),
            lifelines: true,
            roster: None,
        }
    }
}

/// Why a run ended, and how each component's last incarnation ended.
#[derive(Debug)]
pub struct Report {
    pub reason: StopReason,
    pub exits: Vec<(String, Exit)>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopReason {
    Signal,
    ChaosDone,
    Finished(String),
    Duration,
    GaveUp(String),
    /// An observer asked through the roster ([`Roster::request_stop`]).
    Requested,
}

impl Report {
    /// True if the run ended as planned and no active component failed.
    pub fn success(&self) -> bool {
        !matches!(self.reason, StopReason::GaveUp(_))
            && self
                .exits
                .iter()
                .all(|(_, e)| matches!(e, Exit::Code(0) | Exit::Signal(15)))
    }
}

/// A standby or live incarnation.
struct Incarnation {
    proc: Proc,
    generation: u32,
    /// The control block's lifeline bank its threads registered in.
    bank: usize,
}

/// One component under supervision.
struct Managed {
    spec: ComponentSpec,
    control: Arc<Region>,
    zygote: Proc,
    /// Our end of the zygote socket, and the component's (kept to hand to a
    /// respawned zygote).
    zygote_sock: OwnedFd,
    zygote_peer: OwnedFd,
    vault_peer: OwnedFd,
    served: Vec<Served>,
    used: Vec<Used>,
    /// Kept for every zygote it will ever spawn.
    durable: Durable,
    live: Option<Incarnation>,
    /// Watches the live incarnation's lifelines.
    watch: Option<Watch>,
    /// Incarnations found dead by their lifelines, not yet reaped.
    dying: Vec<Proc>,
    /// The bank of the latest live incarnation; its standby takes the other.
    live_bank: usize,
    standby: Option<Incarnation>,
    fork_pending: Option<(u32, usize)>,
    epoch: u64,
    next_generation: u32,
    restarts: RestartWindow,
    done: bool,
}

impl Managed {
    /// The component will not run again: its clients' calls fail from now on.
    fn retire(&mut self) {
        self.done = true;
        for s in &self.served {
            s.edge.server_gone();
        }
    }
}

/// An edge a component serves.
struct Served {
    client: String,
    client_id: u32,
    interface: String,
    edge: Arc<Edge>,
    /// Descriptors the client had rebuilt at the last report.
    recovered_seen: u64,
}

/// An edge a component calls on.
struct Used {
    interface: String,
    server: String,
    edge: Arc<Edge>,
    /// The server's pool, if it has one.
    pool: Option<Arc<Region>>,
}

/// A component's durable memory (`arena_kib`, `pool_kib`): created once, when
/// the system starts, and handed to each of its zygotes, so that every
/// incarnation maps the same pages.
struct Durable {
    arena: Option<Region>,
    pool: Option<Arc<Region>>,
}

impl Durable {
    fn create(spec: &ComponentSpec) -> std::io::Result<Self> {
        let region = |what: &str, kib: u64| -> std::io::Result<Option<Region>> {
            if kib == 0 {
                return Ok(None);
            }
            let name = format!("kintsugi:{}:{what}", spec.name);
            Region::create(&name, kib as usize * 1024).map(Some)
        };
        Ok(Self {
            arena: region("arena", spec.arena_kib)?,
            pool: region("pool", spec.pool_kib)?.map(Arc::new),
        })
    }
}

/// The descriptor number of a region the supervisor holds, as passed at exec.
fn raw_fd(region: Option<&Region>) -> Option<RawFd> {
    region.map(|r| r.fd().as_raw_fd())
}

/// Consecutive failed activations after which a reboot gives up.
const MAX_FAILED_ACTIVATIONS: u32 = 5;

/// Why an incarnation did not become live.
#[derive(Debug, Error)]
enum ActivationFailure {
    /// It failed, died or timed out during initialization.
    #[error("{0}")]
    Init(String),
    /// A signal asked the supervisor to stop while it waited.
    #[error("stopped by a signal during initialization")]
    Interrupted,
}

/// How long the injector waits for its last victim to die and be replaced.
const VICTIM_GRACE: Duration = Duration::from_secs(1);

/// What a readiness in the supervisor's epoll set is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    /// A watched process (pidfd) exited.
    Exit(u32),
    /// SIGINT or SIGTERM arrived (the signal pipe).
    Signal,
    /// A lifeline watcher found an incarnation dead.
    Lifeline,
    /// The watchdog or a checker reported a fault.
    Fault,
    /// Component `idx`'s zygote socket has a message.
    Zygote(usize),
}

impl Source {
    /// The kind in the token's high bits; a pid or an index in the low 32.
    const KIND_SHIFT: u32 = 32;

    fn token(self) -> u64 {
        let (kind, low) = match self {
            Source::Exit(pid) => (0, u64::from(pid)),
            Source::Signal => (1, 0),
            Source::Lifeline => (2, 0),
            Source::Fault => (3, 0),
            Source::Zygote(idx) => (4, idx as u64),
        };
        kind << Self::KIND_SHIFT | low
    }

    fn of(token: u64) -> Option<Source> {
        let low = token & u64::from(u32::MAX);
        Some(match token >> Self::KIND_SHIFT {
            0 => Source::Exit(low as u32),
            1 => Source::Signal,
            2 => Source::Lifeline,
            3 => Source::Fault,
            4 => Source::Zygote(low as usize),
            _ => return None,
        })
    }
}

/// Runs `system` until it is stopped; `on_event` sees every event as it happens.
pub fn run(
    system: &System,
    options: Options,
    on_event: &mut dyn FnMut(&Event),
) -> Result<Report, SupervisorError> {
    let mut sup = Supervisor::new(options, on_event)?;
    sup.watchdog = system.watchdog.enabled;
    let result = sup.start(system).and_then(|()| {
        // Stopped (dropped) before the components are.
        let _monitor = match system.watchdog.enabled {
            true => Some(Monitor::start(
                sup.roster.clone(),
                system.watchdog.clone(),
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
    let exits = sup.shutdown();
    sup.emit(Event::Stopped {
        reason: format!("{reason:?}"),
    });
    Ok(Report { reason, exits })
}

struct Supervisor<'a> {
    options: Options,
    on_event: &'a mut dyn FnMut(&Event),
    comps: Vec<Managed>,
    epoll: OwnedFd,
    signal_pipe: OwnedFd,
    /// Lifeline watchers write here; the event loop reads.
    lifeline_pipe: OwnedFd,
    lifeline_notify: Arc<OwnedFd>,
    signal_ids: Vec<signal_hook::SigId>,
    vault: VaultStore,
    chaos: Option<Chaos>,
    /// The process the injector last signalled, and when.
    last_victim: Option<(u32, Instant)>,
    started: Instant,
    roster: Arc<Roster>,
    /// Woken by [`Roster::report_fault`].
    fault_pipe: OwnedFd,
    /// Whether components are told to publish stretches for the watchdog.
    watchdog: bool,
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
        listen(&epoll, &fault_pipe, Source::Fault)?;
        Ok(Self {
            options,
            on_event,
            comps: Vec::new(),
            epoll,
            signal_pipe,
            lifeline_pipe,
            lifeline_notify: Arc::new(lifeline_notify),
            signal_ids,
            vault: VaultStore::default(),
            chaos,
            last_victim: None,
            started: Instant::now(),
            roster,
            fault_pipe,
            watchdog: false,
        })
    }

    fn emit(&mut self, e: Event) {
        (self.on_event)(&e);
    }

    /// Creates every channel, then boots each component in start order.
    fn start(&mut self, system: &System) -> Result<(), SupervisorError> {
        if let Some(c) = &self.chaos {
            if system.component(&c.plan.target).is_none() {
                return Err(SupervisorError::UnknownTarget(c.plan.target.clone()));
            }
        }
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
                    edge: e.clone(),
                    pool: pools.get(s).cloned(),
                })
                .collect();
            let durable = durable
                .remove(spec.name.as_str())
                .expect("one per component");
            self.boot(spec, served, used, durable)?;
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
    ) -> Result<(), SupervisorError> {
        let t0 = Instant::now();
        let control = Arc::new(Region::create(
            &format!("kintsugi:{}:control", spec.name),
            std::mem::size_of::<ControlBlock>(),
        )?);
        let (zygote_sock, zygote_peer) = socketpair(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )?;
        let (vault_sock, vault_peer) = socketpair(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )?;
        self.vault.serve(spec.name.clone(), vault_sock);
        let zygote = Self::spawn_zygote(
            spec,
            self.watchdog,
            &control,
            &zygote_peer,
            &vault_peer,
            &served,
            &used,
            &durable,
        )?;
        let idx = self.comps.len();
        self.roster.add(
            &spec.name,
            control.clone(),
            served.iter().map(|s| s.edge.clone()).collect(),
        );
        listen(&self.epoll, &zygote.pidfd, Source::Exit(zygote.pid))?;
        listen(&self.epoll, &zygote_sock, Source::Zygote(idx))?;
        self.comps.push(Managed {
            restarts: RestartWindow::new(spec.restart.max, spec.restart.window),
            spec: spec.clone(),
            control,
            zygote,
            zygote_sock,
            zygote_peer,
            vault_peer,
            served,
            used,
            durable,
            live: None,
            watch: None,
            dying: Vec::new(),
            live_bank: 1,
            standby: None,
            fork_pending: None,
            epoch: 0,
            next_generation: 1,
            done: false,
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

    #[allow(clippy::too_many_arguments)]
    fn spawn_zygote(
        spec: &ComponentSpec,
        watchdog: bool,
        control: &Region,
        zygote_peer: &OwnedFd,
        vault_peer: &OwnedFd,
        served: &[Served],
        used: &[Used],
        durable: &Durable,
    ) -> Result<Proc, SupervisorError> {
        let provides = served
            .iter()
            .map(|s| ProvidedEdge {
                interface: s.interface.clone(),
                client: s.client.clone(),
                client_id: s.client_id,
                fd: s.edge.region().fd().as_raw_fd(),
            })
            .collect::<Vec<_>>();
        let uses = used
            .iter()
            .map(|u| UsedEdge {
                interface: u.interface.clone(),
                server: u.server.clone(),
                fd: u.edge.region().fd().as_raw_fd(),
                pool_fd: raw_fd(u.pool.as_deref()),
            })
            .collect::<Vec<_>>();
        let boot = BootInfo {
            component: spec.name.clone(),
            id: spec.id,
            control_fd: control.fd().as_raw_fd(),
            zygote_fd: zygote_peer.as_raw_fd(),
            vault_fd: vault_peer.as_raw_fd(),
            provides,
            uses,
            config: spec.config.clone(),
            recovery: spec.recovery.as_str().to_string(),
            priority: spec.priority,
            realtime: spec.realtime,
            arena_fd: raw_fd(durable.arena.as_ref()),
            pool_fd: raw_fd(durable.pool.as_deref()),
            watchdog,
        };
        let mut pass = vec![boot.control_fd, boot.zygote_fd, boot.vault_fd];
        pass.extend(boot.provides.iter().map(|p| p.fd));
        pass.extend(boot.uses.iter().map(|u| u.fd));
        pass.extend(boot.arena_fd.iter().chain(&boot.pool_fd));
        pass.extend(boot.uses.iter().filter_map(|u| u.pool_fd));
        let json = serde_json::to_string(&boot).expect("boot info serializes");
        spawn_component(&spec.binary, &json, &pass, spec.priority).map_err(|source| {
            SupervisorError::Spawn {
                component: spec.name.clone(),
                binary: spec.binary.display().to_string(),
                source,
            }
        })
    }

    /// Asks the zygote for a standby without waiting for it.
    fn request_fork(&mut self, idx: usize) -> Result<(), SupervisorError> {
        let m = &mut self.comps[idx];
        if m.fork_pending.is_some() || m.standby.is_some() {
            return Ok(());
        }
        let generation = m.next_generation;
        m.next_generation += 1;
        let bank = 1 - m.live_bank;
        fdpass::send(
            &m.zygote_sock,
            &zygote::Command::Fork {
                generation,
                bank: bank as u8,
            }
            .encode(),
            &[],
        )?;
        m.fork_pending = Some((generation, bank));
        Ok(())
    }

    /// Reads the zygote's reply to a fork request (waiting up to the ready timeout).
    fn take_fork_reply(&mut self, idx: usize) -> Result<Incarnation, SupervisorError> {
        let timeout = self.options.ready_timeout;
        let m = &mut self.comps[idx];
        let name = m.spec.name.clone();
        let boot_err = |detail: String| SupervisorError::Boot {
            component: name.clone(),
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
                PollFd::new(&m.zygote_sock, PollFlags::IN),
                PollFd::new(&m.zygote.pidfd, PollFlags::IN),
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
                    .try_reap()
                    .map_or("an unknown status".to_string(), |e| e.to_string());
                return Err(boot_err(format!(
                    "the process exited during boot with {exit}"
                )));
            }
        }
        let (msg, _) = fdpass::recv(&m.zygote_sock)?;
        let zygote::Forked { generation, pid } = zygote::Forked::decode(&msg)
            .ok_or_else(|| boot_err("malformed zygote reply".into()))?;
        let Some((expected, bank)) = m.fork_pending.take() else {
            return Err(boot_err("zygote answered no request".into()));
        };
        if generation != expected {
            return Err(boot_err(format!(
                "zygote answered generation {generation}, expected {expected}"
            )));
        }
        let proc = Proc::adopt(pid)?;
        listen(&self.epoll, &proc.pidfd, Source::Exit(pid))?;
        Ok(Incarnation {
            proc,
            generation,
            bank,
        })
    }

    /// A standby now: the warm one if there is one, else forked on the spot.
    fn fork_now(&mut self, idx: usize) -> Result<Incarnation, SupervisorError> {
        if let Some(s) = self.comps[idx].standby.take() {
            return Ok(s);
        }
        self.request_fork(idx)?;
        self.take_fork_reply(idx)
    }

    /// Lets `inc` run as the next epoch and waits until it is ready, until
    /// it dies or fails, or until the supervisor is asked to stop; an
    /// incarnation that does not become ready is killed and reaped.
    fn activate(&mut self, idx: usize, inc: Incarnation) -> Result<(), ActivationFailure> {
        let timeout = self.options.ready_timeout;
        let m = &mut self.comps[idx];
        m.epoch += 1;
        let ctl: &ControlBlock = m.control.at(0);
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
            for s in &m.served {
                s.edge.server_live(m.epoch, inc.proc.pid);
            }
            m.live_bank = inc.bank;
            self.roster
                .set_live(&m.spec.name, Some(inc.proc.pid), m.epoch);
            m.live = Some(inc);
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
    fn watch_live(&mut self, idx: usize) {
        if !self.options.lifelines {
            return;
        }
        let m = &mut self.comps[idx];
        if let Some(live) = &m.live {
            m.watch = Some(Watch::start(
                m.control.clone(),
                live.bank,
                idx as u32,
                live.generation,
                self.lifeline_notify.clone(),
            ));
        }
    }

    fn event_loop(&mut self) -> Result<StopReason, SupervisorError> {
        let mut buf = [MaybeUninit::<epoll::Event>::uninit(); 32];
        loop {
            if self.roster.stop_requested() {
                return Ok(StopReason::Requested);
            }
            let now = Instant::now();
            if let Some(d) = self.options.duration {
                if now.duration_since(self.started) >= d {
                    return Ok(StopReason::Duration);
                }
            }
            if self.victim_replaced() {
                if let Some(sig) = self.chaos.as_mut().and_then(|c| c.due(now)) {
                    self.inject(sig);
                }
            }
            let victim_replaced = self.victim_replaced();
            if self.options.stop_after_chaos
                && self.chaos.as_ref().is_some_and(|c| c.done())
                && victim_replaced
            {
                return Ok(StopReason::ChaosDone);
            }
            // While the last victim is still dying, its pidfd is what wakes us.
            let mut wake = match victim_replaced {
                true => self.chaos.as_ref().and_then(|c| c.deadline()),
                false => self.last_victim.map(|(_, at)| at + VICTIM_GRACE),
            };
            if let Some(d) = self.options.duration {
                let end = self.started + d;
                wake = Some(wake.map_or(end, |w| w.min(end)));
            }
            let timeout = wake.map(|w| {
                let d = w.saturating_duration_since(Instant::now());
                timespec(d)
            });
            let (events, _) = match epoll::wait(&self.epoll, &mut buf, timeout.as_ref()) {
                Err(rustix::io::Errno::INTR) => continue,
                r => r?,
            };
            let sources: Vec<Source> = events
                .iter()
                .filter_map(|e| Source::of(e.data.u64()))
                .collect();
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
                        if self.comps[idx].fork_pending.is_some() {
                            let inc = self.take_fork_reply(idx)?;
                            self.comps[idx].standby = Some(inc);
                        }
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
            let Some(live) = m.live.as_ref().filter(|l| l.proc.pid == report.pid) else {
                continue;
            };
            live.proc.signal(Signal::KILL);
            self.emit(Event::FaultReported {
                component: report.component,
                pid: report.pid,
                detail: report.detail,
            });
        }
    }

    /// Sends the chaos plan's next signal to its target's live incarnation.
    fn inject(&mut self, sig: Signal) {
        let target = self.chaos.as_ref().expect("chaos").plan.target.clone();
        let Some(m) = self.comps.iter().find(|m| m.spec.name == target) else {
            return;
        };
        let Some(live) = &m.live else { return };
        let in_flight = m
            .served
            .iter()
            .flat_map(|s| s.edge.in_flight().into_iter().map(|f| self.name_call(s, f)))
            .collect();
        let (pid, rss_kib) = (live.proc.pid, live.proc.rss_kib());
        live.proc.signal(sig);
        self.last_victim = Some((pid, Instant::now()));
        self.emit(Event::Injected {
            component: target,
            pid,
            signal: sig.as_raw(),
            in_flight,
            rss_kib,
        });
    }

    /// True once the last injection's target runs a new incarnation, or
    /// the injection visibly did not kill it. The injector never signals a
    /// process it has already signalled, so each injection is one fault.
    fn victim_replaced(&self) -> bool {
        let Some((victim, at)) = self.last_victim else {
            return true;
        };
        let target = &self.chaos.as_ref().expect("chaos").plan.target;
        at.elapsed() >= VICTIM_GRACE
            || self
                .comps
                .iter()
                .find(|m| &m.spec.name == target)
                .is_some_and(|m| m.done || m.live.as_ref().is_some_and(|l| l.proc.pid != victim))
    }

    /// `interface.function` for a call of `func` on a served edge: named by
    /// the interfaces the supervisor was built with, else by the names the
    /// stubs registered in the edge, else by number.
    fn name_call(&self, served: &Served, func: u32) -> String {
        let hash = served.edge.header().interface_hash.load(Ordering::Relaxed);
        let built_in = self
            .options
            .interfaces
            .iter()
            .find(|i| i.hash == hash)
            .and_then(|i| i.functions.get(func as usize))
            .map(|f| f.to_string());
        match built_in.or_else(|| served.edge.function_name(func)) {
            Some(f) => format!("{}.{f}", served.interface),
            None => format!("{}.#{func}", served.interface),
        }
    }

    /// A watched process exited: find out which, and react.
    fn on_exit(&mut self, pid: u32) -> Result<Option<StopReason>, SupervisorError> {
        let detected = Instant::now();
        let Some(idx) = self.comps.iter().position(|m| {
            m.zygote.pid == pid
                || m.live.as_ref().is_some_and(|l| l.proc.pid == pid)
                || m.standby.as_ref().is_some_and(|s| s.proc.pid == pid)
                || m.dying.iter().any(|p| p.pid == pid)
        }) else {
            return Ok(None);
        };
        let m = &mut self.comps[idx];
        if let Some(i) = m.dying.iter().position(|p| p.pid == pid) {
            // Rebooted already, when its lifelines were cut; now it is gone.
            if m.dying[i].try_reap().is_some() {
                m.dying.swap_remove(i);
            }
            return Ok(None);
        }
        if m.zygote.pid == pid {
            let Some(_) = m.zygote.try_reap() else {
                return Ok(None);
            };
            self.respawn_zygote(idx)?;
            return Ok(None);
        }
        if m.standby.as_ref().is_some_and(|s| s.proc.pid == pid) {
            if m.standby.as_ref().unwrap().proc.try_reap().is_none() {
                return Ok(None);
            }
            m.standby = None;
            self.request_fork(idx)?;
            return Ok(None);
        }
        let Some(exit) = m.live.as_ref().unwrap().proc.try_reap() else {
            return Ok(None);
        };
        m.live = None;
        m.watch = None;
        self.roster.set_live(&m.spec.name, None, m.epoch);
        if exit == Exit::Code(0) {
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
        if m.live.as_ref().is_none_or(|l| l.generation != generation) {
            return Ok(None); // already handled through its pidfd
        }
        let live = m.live.take().expect("checked");
        m.watch = None;
        self.roster.set_live(&m.spec.name, None, m.epoch);
        let (pid, exit) = (live.proc.pid, dying_exit(live.proc.pid));
        m.dying.push(live.proc);
        self.reboot(idx, pid, exit, detected)
    }

    /// Component `idx`'s incarnation is gone: its slot claims on the edges it
    /// used are void, and its servers are told, so that they release what it held.
    fn client_gone(&mut self, idx: usize) {
        for u in &self.comps[idx].used {
            u.edge.client_down();
            if let Some(server) = self.comps.iter().find(|c| c.spec.name == u.server) {
                let ctl: &ControlBlock = server.control.at(0);
                ctl.client_died();
            }
        }
    }

    /// Micro-reboots component `idx` after its incarnation `pid` died.
    fn reboot(
        &mut self,
        idx: usize,
        pid: u32,
        exit: Exit,
        detected: Instant,
    ) -> Result<Option<StopReason>, SupervisorError> {
        let m = &mut self.comps[idx];
        let name = m.spec.name.clone();
        let mut calls = Vec::new();
        for (i, s) in m.served.iter().enumerate() {
            calls.extend(s.edge.server_down().into_iter().map(|f| (i, f)));
        }
        let epoch = m.epoch;
        self.client_gone(idx);
        // Events are emitted after the reboot, so that logging does not delay it.
        let in_flight = calls
            .into_iter()
            .map(|(i, f)| self.name_call(&self.comps[idx].served[i], f))
            .collect();
        let after_injection = self
            .last_victim
            .filter(|(victim, _)| *victim == pid)
            .map(|(_, at)| detected.duration_since(at));
        let mut pending = vec![Event::Crashed {
            component: name.clone(),
            pid,
            epoch,
            exit,
            in_flight,
            after_injection,
        }];
        pending.extend(self.recoveries(idx));
        // Each activation counts against the restart policy, a failed one
        // too; and a component whose every new incarnation fails is given up
        // after a few, whatever its policy allows.
        let mut failed = 0;
        loop {
            let m = &mut self.comps[idx];
            if !m.restarts.allow(Instant::now()) || failed >= MAX_FAILED_ACTIVATIONS {
                let (restarts, window) = (m.restarts.recent(), m.spec.restart.window);
                m.retire();
                pending.push(Event::GaveUp {
                    component: name.clone(),
                    restarts,
                    window,
                });
                pending.into_iter().for_each(|e| self.emit(e));
                return Ok(Some(StopReason::GaveUp(name)));
            }
            if m.spec.reboot == RebootMode::Exec {
                self.respawn_zygote(idx)?;
            }
            let inc = self.fork_now(idx)?;
            let new_pid = inc.proc.pid;
            match self.activate(idx, inc) {
                Ok(()) => {
                    let took = detected.elapsed();
                    let epoch = self.comps[idx].epoch;
                    let ctl: &ControlBlock = self.comps[idx].control.at(0);
                    let init = ctl.init_ns.load(Ordering::SeqCst);
                    pending.push(Event::Rebooted {
                        component: name.clone(),
                        epoch,
                        pid: new_pid,
                        took,
                        init: Duration::from_nanos(init),
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
                }
            }
        }
    }

    /// How many descriptors each client rebuilt during the epoch that ended,
    /// and what the epoch's eager recovery took, if it had one.
    fn recoveries(&mut self, idx: usize) -> Vec<Event> {
        let mut out = Vec::new();
        let m = &mut self.comps[idx];
        let ctl: &ControlBlock = m.control.at(0);
        let eager_ns = ctl.eager_ns.swap(0, Ordering::SeqCst);
        if eager_ns != 0 {
            out.push(Event::EagerRecovery {
                component: m.spec.name.clone(),
                epoch: m.epoch,
                descriptors: ctl.eager_descriptors.load(Ordering::SeqCst),
                took: Duration::from_nanos(eager_ns),
            });
        }
        for s in &mut m.served {
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

    /// Replaces the pristine image by exec'ing the binary again.
    fn respawn_zygote(&mut self, idx: usize) -> Result<(), SupervisorError> {
        let watchdog = self.watchdog;
        let m = &mut self.comps[idx];
        if let Some(s) = m.standby.take() {
            s.proc.kill();
        }
        if m.fork_pending.take().is_some() {
            // A standby the old zygote forked before it died must not linger.
            if let Some(orphan) = Self::drain_reply(&m.zygote_sock, Duration::ZERO) {
                orphan.kill();
            }
        }
        if m.zygote.try_reap().is_none() {
            m.zygote.kill();
        }
        let zygote = Self::spawn_zygote(
            &m.spec,
            watchdog,
            &m.control,
            &m.zygote_peer,
            &m.vault_peer,
            &m.served,
            &m.used,
            &m.durable,
        )?;
        listen(&self.epoll, &zygote.pidfd, Source::Exit(zygote.pid))?;
        let pid = zygote.pid;
        m.zygote = zygote;
        let exec_mode = m.spec.reboot == RebootMode::Exec;
        let name = m.spec.name.clone();
        if !exec_mode {
            self.emit(Event::ZygoteRespawned {
                component: name,
                pid,
            });
            if self.comps[idx].spec.reboot == RebootMode::Standby {
                self.request_fork(idx)?;
            }
        }
        Ok(())
    }

    /// Stops every component, clients before their servers, and returns how
    /// each live incarnation ended.
    fn shutdown(&mut self) -> Vec<(String, Exit)> {
        for id in self.signal_ids.drain(..) {
            signal_hook::low_level::unregister(id);
        }
        let grace = self.options.stop_grace;
        let mut exits = Vec::new();
        for m in &mut self.comps {
            m.watch = None;
        }
        for m in self.comps.iter_mut().rev() {
            for p in m.dying.drain(..) {
                p.kill();
            }
            if let Some(live) = m.live.take() {
                exits.push((m.spec.name.clone(), live.proc.stop(grace)));
            }
            for s in &m.served {
                s.edge.server_gone();
            }
            if let Some(s) = m.standby.take() {
                s.proc.kill();
            }
            if m.fork_pending.take().is_some() {
                if let Some(orphan) = Self::drain_reply(&m.zygote_sock, Duration::from_secs(1)) {
                    orphan.kill();
                }
            }
            if m.zygote.try_reap().is_none() {
                m.zygote.kill();
            }
        }
        exits.reverse();
        exits
    }

    /// The standby announced by a pending fork reply, if one arrives within `wait`.
    fn drain_reply(sock: &OwnedFd, wait: Duration) -> Option<Proc> {
        let mut fds = [PollFd::new(sock, PollFlags::IN)];
        let ts = timespec(wait);
        poll(&mut fds, Some(&ts)).ok()?;
        if !fds[0].revents().contains(PollFlags::IN) {
            return None;
        }
        let (msg, _) = fdpass::recv(sock.as_fd()).ok()?;
        let pid = zygote::Forked::decode(&msg)?.pid;
        Proc::adopt(pid).ok()
    }
}

/// How a process whose threads have all died is ending, read from
/// `/proc/PID/stat` while the kernel still tears it down (the exit code is
/// set before the address space is freed).
fn dying_exit(pid: u32) -> Exit {
    let status = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(49)?.parse::<i32>().ok())
        });
    match status {
        Some(st) if st & 0x7f != 0 => Exit::Signal(st & 0x7f),
        Some(st) => Exit::Code((st >> 8) & 0xff),
        None => Exit::Signal(0),
    }
}

/// Adds `fd` to the supervisor's epoll set; its readiness comes back as `source`.
fn listen(epoll: &OwnedFd, fd: impl AsFd, source: Source) -> rustix::io::Result<()> {
    epoll::add(
        epoll,
        fd,
        epoll::EventData::new_u64(source.token()),
        epoll::EventFlags::IN,
    )
}

#[cfg(test)]
mod tests {
    use super::Source;

    #[test]
    fn every_source_comes_back_from_its_token() {
        let sources = [
            Source::Exit(1),
            Source::Exit(u32::MAX),
            Source::Signal,
            Source::Lifeline,
            Source::Fault,
            Source::Zygote(0),
            Source::Zygote(4095),
        ];
        for s in sources {
            assert_eq!(Source::of(s.token()), Some(s), "{s:?}");
        }
        let tokens: std::collections::HashSet<u64> = sources.iter().map(|s| s.token()).collect();
        assert_eq!(tokens.len(), sources.len(), "tokens are distinct");
        assert_eq!(Source::of(99 << 32), None, "an unknown kind is no source");
    }
}

//! A component's life: boot from what the supervisor passed at exec, become
//! the pristine image, and fork incarnations from it on request.
//!
//! ```text
//! exec ─▶ boot: map control block and edges ─▶ pristine image (zygote)
//!                                                  │ "fork" from the supervisor
//!                                                  ▼
//!            warm standby: worker threads parked, waiting for activation
//!                                                  │ supervisor: go (epoch N)
//!                                                  ▼
//!            incarnation N: init() rebuilds execution state, services open, ready
//!                                                  │ recovery = "eager" and N > 1
//!                                                  ▼
//!            RECOVER upcall to every listening client; until all answered,
//!            only calls that rebuild descriptors pass the workers' gate
//! ```
//!
//! The pristine image is everything the process holds when it calls [`run`]:
//! code, statics, whatever `main` built before. Each incarnation is forked
//! from that image, so a reboot costs the same however much the failed
//! incarnation had allocated. Incarnations are forked with `CLONE_PARENT`,
//! which makes them children of the supervisor: it holds their pidfds and
//! reads their exit status directly.
//!
//! Every thread the runtime starts takes the component's priority.

use std::collections::HashMap;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use serde::de::DeserializeOwned;
use thiserror::Error;

use crate::abi::boot::{BootInfo, ControlBlock, ABI, BOOT_ENV, LIFELINES};
use crate::abi::channel::Edge;
use crate::abi::fdpass;
use crate::abi::journal::JournalRegion;
use crate::abi::shm::Region;
use crate::client::{Connection, Supervision};
use crate::counters::{Counter, CounterError, WorkloadCounters};
use crate::durable::Durable;
use crate::futex;
use crate::journal::{Journal, Served};
use crate::priority::{self, Priority};
use crate::process;
use crate::records::{ReadAhead, RecordStore, VaultRecords};
use crate::seccomp::Sysno;
use crate::server::{RecoveryGate, SlotWorker};
use crate::stub::{Callers, InterfaceInfo, Service};
use crate::upcall::{self, Listener, Mailbox, UpcallError};
use crate::vault::Vault;

/// `BootInfo::recovery` of components that recover their clients eagerly.
const EAGER: &str = "eager";
/// The most pages a standby faults in ahead of its activation (32 MiB of
/// 4 KiB pages): the incarnation takes the rest as they come.
const POPULATED_PAGES: usize = 8192;
/// How long eager recovery waits for its clients before it serves everyone.
const EAGER_TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Debug, Error)]
pub enum ConnectError {
    #[error(
        "component `{component}` is not granted interface `{interface}` by the system description"
    )]
    NotGranted {
        component: String,
        interface: String,
    },
    #[error("interface `{interface}`: the server speaks another version (hash {found:#x}, this client {expected:#x})")]
    InterfaceMismatch {
        interface: String,
        expected: u64,
        found: u64,
    },
    #[error("interface `{interface}`: starting the upcall thread: {source}")]
    UpcallThread {
        interface: String,
        source: std::io::Error,
    },
}

/// What one incarnation runs: the services it provides and, for active
/// components, a main function (the component exits when it returns).
/// `main` runs after the incarnation has reported ready, off the reboot's
/// critical path.
pub struct Incarnation {
    services: Vec<Arc<dyn Service>>,
    main: Option<Box<dyn FnOnce() -> anyhow::Result<()> + Send>>,
    /// Servers: keep serving after `main` returns.
    serve_after_main: bool,
}

impl Incarnation {
    /// A passive server.
    pub fn serve(services: Vec<Arc<dyn Service>>) -> Self {
        Self {
            services,
            main: None,
            serve_after_main: true,
        }
    }

    /// An active component with no services.
    pub fn main(f: impl FnOnce() -> anyhow::Result<()> + Send + 'static) -> Self {
        Self {
            services: Vec::new(),
            main: Some(Box::new(f)),
            serve_after_main: false,
        }
    }

    /// A server that also does `f` once it is serving (and goes on serving).
    pub fn then(mut self, f: impl FnOnce() -> anyhow::Result<()> + Send + 'static) -> Self {
        self.main = Some(Box::new(f));
        self
    }
}

/// The component's view of the system: its identity, configuration,
/// granted interfaces, durable memory and vault.
pub struct Runtime {
    boot: BootInfo,
    /// The used edges' upcall listeners, in `boot.uses` order.
    used: Vec<Arc<Listener>>,
    /// The provided edges' upcall mailboxes, in `boot.provides` order.
    provided: Vec<Mailbox>,
    durable: Durable,
    vault: Arc<Vault>,
    /// Creation records, read ahead: one store for every holder in the
    /// process, so that what one writes the others do not read stale.
    records: Arc<ReadAhead>,
    epoch: u64,
    stop: Arc<AtomicBool>,
    control: Arc<Region>,
}

impl Runtime {
    pub fn name(&self) -> &str {
        &self.boot.component
    }

    pub fn id(&self) -> u32 {
        self.boot.id
    }

    /// This incarnation's epoch (1 for the first).
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The component's `[component.config]` table.
    pub fn config<T: DeserializeOwned>(&self) -> anyhow::Result<T> {
        serde_json::from_value(self.boot.config.clone()).map_err(|e| {
            anyhow::anyhow!("component `{}`: bad [component.config]: {e}", self.name())
        })
    }

    pub fn vault(&self) -> &Vault {
        &self.vault
    }

    /// Where generated server stubs keep the creation records of global
    /// descriptors: this component's part of the state vault.
    pub fn records(&self) -> Arc<dyn RecordStore> {
        self.records.clone()
    }

    /// The component's private durable memory (`arena_kib`, zero-filled at
    /// system start): every incarnation sees what the previous ones wrote.
    pub fn arena(&self) -> Option<&Region> {
        self.durable.arena.as_ref()
    }

    /// The durable memory this component shares with its clients (`pool_kib`).
    pub fn pool(&self) -> Option<&Region> {
        self.durable.pool.as_ref()
    }

    /// The pool of the server that provides `interface` to this component,
    /// if it has one; map the pages it grants with [`Region::map_range`].
    pub fn server_pool(&self, interface: &str) -> Option<Arc<Region>> {
        self.durable.server_pools.get(interface).cloned()
    }

    /// Every caller this component may hear from: each client component's
    /// id with its channel slots (one per client thread). A server checks
    /// state that names a caller (an owner kept in its arena) against it.
    pub fn callers(&self) -> Callers {
        Callers(
            self.boot
                .provides
                .iter()
                .zip(&self.provided)
                .map(|(edge, mailbox)| (edge.client_id, mailbox.slot_count()))
                .collect(),
        )
    }

    /// Raises change counter `counter` on every edge of `interface` this
    /// component serves, after the change it counts (see
    /// [`crate::client::Changes`]).
    pub fn publish_change(&self, interface: &str, counter: usize) {
        for (p, mailbox) in self.boot.provides.iter().zip(&self.provided) {
            if p.interface == interface {
                mailbox.edge().publish_change(counter);
            }
        }
    }

    /// The counter called `name`, which the supervisor and tools watching
    /// the system can read; it keeps its value across reboots.
    pub fn counter(&self, name: &str) -> Result<&Counter, CounterError> {
        let ctl: &ControlBlock = self.control.at(0);
        ctl.counters.get(name)
    }

    /// The counters a checking workload publishes (`ops`, `errors`, `corrupt`).
    pub fn workload_counters(&self) -> Result<WorkloadCounters<'_>, CounterError> {
        let ctl: &ControlBlock = self.control.at(0);
        WorkloadCounters::new(&ctl.counters)
    }

    /// True once the supervisor asked this component to stop (SIGTERM).
    pub fn stop_requested(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }

    /// Whether the system grants this component `interface`.
    pub fn uses(&self, interface: &str) -> bool {
        self.boot.uses.iter().any(|u| u.interface == interface)
    }

    /// A connection to a granted interface. There is no other way to reach a
    /// server: the supervisor created the only channels that exist.
    pub fn connect(&self, info: &'static InterfaceInfo) -> Result<Connection, ConnectError> {
        let (used, listener) = self
            .boot
            .uses
            .iter()
            .zip(&self.used)
            .find(|(u, _)| u.interface == info.name)
            .ok_or_else(|| ConnectError::NotGranted {
                component: self.name().to_string(),
                interface: info.name.to_string(),
            })?;
        let found = listener
            .edge()
            .header()
            .interface_hash
            .load(Ordering::SeqCst);
        if found != 0 && found != info.hash {
            return Err(ConnectError::InterfaceMismatch {
                interface: info.name.to_string(),
                expected: info.hash,
                found,
            });
        }
        listener.edge().register_functions(info);
        Connection::new(
            listener.clone(),
            used.server.clone(),
            used.server_id,
            info,
            Supervision {
                watched: self.boot.watchdog,
                replayed: used.replayed,
            },
        )
        .map_err(|source| ConnectError::UpcallThread {
            interface: info.name.to_string(),
            source,
        })
    }

    /// Calls client `client` back on the edge where this component serves it
    /// `interface`: upcall `op` (see [`upcall`]) with `args`, answered by the
    /// client's upcall thread within `timeout`. Upcalls on one edge take
    /// turns.
    pub fn upcall(
        &self,
        interface: &str,
        client: u32,
        op: u32,
        args: [u64; 3],
        timeout: Duration,
    ) -> Result<u64, UpcallError> {
        let (_, mailbox) = self
            .boot
            .provides
            .iter()
            .zip(&self.provided)
            .find(|(p, _)| p.interface == interface && p.client_id == client)
            .ok_or_else(|| UpcallError::UnknownEdge {
                interface: interface.to_string(),
                client,
            })?;
        crate::watchdog::blocking(|| mailbox.call(op, args, timeout))
    }

    /// Eager recovery after a reboot: every listening client rebuilds its
    /// descriptors, while `gate` holds the calls of everyone else. Records
    /// what it took in the control block.
    fn recover_eagerly(&self, gate: &RecoveryGate, ctl: &ControlBlock) {
        let report = upcall::recover_eagerly(gate, &self.provided, self.epoch, EAGER_TIMEOUT);
        ctl.eager_ns
            .store(report.elapsed.as_nanos() as u64, Ordering::SeqCst);
        ctl.eager_descriptors
            .store(report.descriptors, Ordering::SeqCst);
        tracing::debug!(
            epoch = self.epoch,
            clients = report.clients,
            failed = report.failed,
            descriptors = report.descriptors,
            elapsed_us = report.elapsed.as_micros() as u64,
            "eager recovery done"
        );
    }
}

/// The component's priority, as the system description gives it.
fn component_priority(info: &BootInfo) -> Priority {
    Priority {
        nice: info.priority,
        fifo: info.realtime,
    }
}

/// Gives the calling runtime thread the component's priority.
fn take_priority(p: Priority) {
    if let Err(e) = priority::apply_to_current_thread(p) {
        tracing::warn!("thread priority: {e}");
    }
}

/// Runs this process as a kintsugi component. `init` runs at the start of
/// every incarnation and returns what it serves; everything built before
/// `run` is called is part of the pristine image. The component may make
/// the system calls of the runtime's list ([`crate::seccomp::RUNTIME`]) and
/// those its system description adds; [`run_allowing`] declares more.
pub fn run<F>(init: F) -> !
where
    F: FnOnce(&Arc<Runtime>) -> anyhow::Result<Incarnation>,
{
    run_allowing(&[], init)
}

/// [`run`] for a component that needs system calls beyond the runtime's
/// list (netd: `socket`, `bind`, `accept4`, …): `syscalls` joins the
/// seccomp filter's allow list, installed before `init` first runs.
pub fn run_allowing<F>(syscalls: &[Sysno], init: F) -> !
where
    F: FnOnce(&Arc<Runtime>) -> anyhow::Result<Incarnation>,
{
    // First: from exec until this call, a process of the same user may
    // open this one's descriptors through /proc (exec makes it dumpable).
    if let Err(e) = process::private_memory() {
        fatal(&format!("PR_SET_DUMPABLE: {e}"));
    }
    process::name_after_binary();
    process::abort_on_panic();
    let boot = match std::env::var(BOOT_ENV) {
        Ok(json) => match serde_json::from_str::<BootInfo>(&json) {
            Ok(b) => b,
            Err(e) => fatal(&format!("malformed {BOOT_ENV}: {e}")),
        },
        Err(_) => {
            let exe = std::env::args().next().unwrap_or_default();
            eprintln!("{exe} is a kintsugi component: start it with `kintsugi run SYSTEM.toml`");
            std::process::exit(2);
        }
    };
    crate::logging::init(&boot.component);
    if boot.abi != ABI {
        fatal(&format!(
            "`{}` was built against a kintsugi runtime whose shared memory is laid out otherwise than its supervisor's (layout {ABI:#018x}, the supervisor's {:#018x}): build the component and kintsugi from the same version",
            boot.component, boot.abi
        ));
    }
    match Boot::new(boot, syscalls) {
        Ok(b) => b.zygote(init),
        Err(e) => fatal(&format!("boot failed: {e:#}")),
    }
}

fn fatal(msg: &str) -> ! {
    tracing::error!("{msg}");
    eprintln!("kintsugi component: {msg}");
    std::process::exit(3);
}

/// Everything mapped at boot, inherited by every incarnation.
struct Boot {
    info: BootInfo,
    supervisor: u32,
    control: Region,
    zygote: OwnedFd,
    vault: OwnedFd,
    provided: Vec<Arc<Edge>>,
    used: Vec<Arc<Edge>>,
    durable: Durable,
    journal: Option<Arc<Journal>>,
}

impl Boot {
    fn new(info: BootInfo, syscalls: &[Sysno]) -> anyhow::Result<Self> {
        let supervisor = info.supervisor;
        process::die_with_parent(supervisor)?;
        process::disable_core_dumps()?;
        let mut allowed = syscalls.to_vec();
        for &n in &info.syscalls {
            let call = usize::try_from(n).ok().and_then(Sysno::new);
            allowed.push(call.ok_or_else(|| anyhow::anyhow!("no system call {n} here"))?);
        }
        crate::seccomp::install(&allowed, crate::seccomp::Mode::from_env())
            .map_err(|e| anyhow::anyhow!("seccomp filter: {e}"))?;
        process::default_fault_signals()?;
        crate::futex::set_spin_policy(info.spin);
        // SAFETY: the supervisor passed these descriptors for this process
        // alone, and nothing else in it owns them.
        let control = unsafe { Region::from_raw_fd(info.control_fd)? };
        // SAFETY: as for the control block.
        let zygote = unsafe { OwnedFd::from_raw_fd(info.zygote_fd) };
        // SAFETY: as for the control block.
        let vault = unsafe { OwnedFd::from_raw_fd(info.vault_fd) };
        let map_edge = |fd| -> anyhow::Result<Arc<Edge>> {
            // SAFETY: as for the control block.
            Ok(Arc::new(Edge::open(unsafe { Region::from_raw_fd(fd)? })?))
        };
        let provided = info
            .provides
            .iter()
            .map(|e| map_edge(e.fd))
            .collect::<anyhow::Result<_>>()?;
        let used = info
            .uses
            .iter()
            .map(|e| map_edge(e.fd))
            .collect::<anyhow::Result<_>>()?;
        // SAFETY: as above; `Durable::map` adopts each descriptor once.
        let durable = Durable::map(&info, |fd| unsafe { Region::from_raw_fd(fd) })?;
        let journal = info
            .journal_fd
            // SAFETY: as for the control block.
            .map(|fd| JournalRegion::open(unsafe { Region::from_raw_fd(fd)? }))
            .transpose()?
            .map(|log| Arc::new(Journal::new(log)));
        Ok(Self {
            info,
            supervisor,
            control,
            zygote,
            vault,
            provided,
            used,
            durable,
            journal,
        })
    }

    /// The pristine image's loop: fork a standby whenever the supervisor asks.
    fn zygote<F>(self, init: F) -> !
    where
        F: FnOnce(&Arc<Runtime>) -> anyhow::Result<Incarnation>,
    {
        // One receive buffer (128 KiB, so mapped apart from the heap) for
        // the pristine image's whole life: a buffer per message was mapped
        // while the first standby was forked and unmapped after, so the
        // first incarnation alone inherited it, and every mapping it made
        // afterwards (its threads' stacks) lay 132 KiB lower than in every
        // later one, which a checkpoint restored into another incarnation
        // then had to remap (`kintsugi-checkpoint`'s `restore_new_frozen`).
        let mut buf = Vec::new();
        loop {
            let n = match fdpass::recv_into(&self.zygote, &mut buf) {
                Ok((n, _)) => n,
                Err(e) => fatal(&format!("zygote socket: {e}")),
            };
            if n == 0 {
                std::process::exit(0); // the supervisor is gone or done with us
            }
            let Some(crate::abi::zygote::Command::Fork { generation, bank }) =
                crate::abi::zygote::Command::decode(&buf[..n])
            else {
                fatal("malformed zygote command");
            };
            match process::fork_sibling() {
                Ok(None) => self.standby(generation, usize::from(bank), init),
                Ok(Some(pid)) => {
                    let reply = crate::abi::zygote::Forked { generation, pid }.encode();
                    if let Err(e) = fdpass::send(&self.zygote, &reply, &[]) {
                        fatal(&format!("zygote reply: {e}"));
                    }
                }
                Err(e) => fatal(&format!("fork from the pristine image: {e}")),
            }
        }
    }

    /// A forked incarnation-to-be: park the workers, wait for activation,
    /// initialize, serve.
    fn standby<F>(self, generation: u32, bank: usize, init: F) -> !
    where
        F: FnOnce(&Arc<Runtime>) -> anyhow::Result<Incarnation>,
    {
        let Boot {
            info,
            supervisor,
            control,
            zygote,
            vault,
            provided,
            used,
            durable,
            journal,
        } = self;
        drop(zygote);
        if let Err(e) = process::die_with_parent(supervisor) {
            fatal(&format!("standby: {e}"));
        }
        let control = Arc::new(control);
        let ctl: &ControlBlock = control.at(0);
        let prio = component_priority(&info);
        take_priority(prio);
        if let Err(e) =
            process::reserve_descriptors(std::os::fd::AsFd::as_fd(&vault), info.vault_fds)
        {
            tracing::warn!("descriptor table not grown ahead: {e}");
        }
        let gate = start_workers(&info, &provided, &control, bank, journal.as_ref());
        // Started here, not once active: a checkpoint taken right after the
        // activation must find every thread the incarnation will have (one
        // that found this one missing could be restored into no later
        // incarnation: its threads never matched).
        watch_clients(&control, &info_provides(&info), &provided, &gate, prio);
        // The control block is mapped for the rest of this process's life.
        let forever: &'static Region = Box::leak(Box::new(control.clone()));
        let forever: &'static ControlBlock = forever.at(0);
        let mut vault = Vault::new(vault).noting_lists(&forever.lists_vault);
        if let Some(builder) = crate::vault::registered_builder() {
            vault = vault.building_ahead(builder);
        }
        let vault = Arc::new(vault);
        // Only for a component that lists its vault (its incarnations
        // raise the flag).
        let lists = forever.lists_vault.load(Ordering::Relaxed) != 0;
        let ahead = (info.read_vault_ahead && lists)
            .then(|| read_vault_ahead(&vault, &control, generation))
            .flatten();
        take_first_faults(ctl, generation, journal.is_some());
        let epoch = ctl.wait_activation(generation);
        let woke = std::time::Instant::now();
        crate::logging::set_epoch(epoch);
        process::report_panics_to(&forever.panic_site);
        if info.watchdog {
            crate::watchdog::enable(&forever.watch);
        }
        let eager = info.recovery == EAGER && epoch > 1;
        if eager {
            // Before any worker serves: only recovering calls until it opens.
            gate.recovery.close();
        }
        let stop = Arc::new(AtomicBool::new(false));
        // Caught from here, so that a stop asked while it initializes is
        // not lost: a SIGTERM right after a reboot used to kill a component
        // with a main before its handler was there, and it never reported.
        let caught = signal_hook::flag::register(signal_hook::consts::SIGTERM, stop.clone());
        let used = info
            .uses
            .iter()
            .zip(used)
            .map(|(u, edge)| Arc::new(Listener::new(edge, &u.interface, Some(prio))))
            .collect();
        let runtime = Arc::new(Runtime {
            used,
            provided: provided.iter().cloned().map(Mailbox::new).collect(),
            boot: info,
            durable,
            records: Arc::new(ReadAhead::new(Arc::new(VaultRecords(vault.clone())))),
            vault,
            epoch,
            stop: stop.clone(),
            control: control.clone(),
        });
        let incarnation =
            match init(&runtime).and_then(|inc| open_services(&runtime.boot, &provided, inc)) {
                Ok(inc) => inc,
                Err(e) => {
                    tracing::error!("initialization failed: {e:#}");
                    ctl.report(generation, false);
                    std::process::exit(1);
                }
            };
        let Incarnation {
            services,
            main,
            serve_after_main,
        } = incarnation;
        if main.is_none() || serve_after_main {
            // A server stops by SIGTERM's default action, as it always did,
            // after any action of its own (netd kills its keeper first).
            let always = Arc::new(AtomicBool::new(true));
            let _ = signal_hook::flag::register_conditional_default(
                signal_hook::consts::SIGTERM,
                always,
            );
            if let Ok(id) = caught {
                signal_hook::low_level::unregister(id);
            }
            if stop.load(Ordering::SeqCst) {
                std::process::exit(0); // asked to stop while it initialized
            }
        }
        if let Some(journal) = &journal {
            journal.set_served(served(&runtime.boot, &provided, &services));
        }
        gate.open(services, epoch);
        ctl.init_ns
            .store(woke.elapsed().as_nanos() as u64, Ordering::SeqCst);
        ctl.report(generation, true);
        runtime.vault.forget_ahead();
        if let Some(reader) = ahead {
            reader.unpark(); // it drops what the listing left unused, a while later, and ends
        }
        if eager {
            runtime.recover_eagerly(&gate.recovery, ctl);
        }
        if let Some(main) = main {
            match main() {
                Ok(()) if !serve_after_main => {
                    // Its lifelines will fire, but this is no crash.
                    ctl.exiting.store(generation, Ordering::SeqCst);
                    std::process::exit(0)
                }
                Ok(()) => {}
                Err(e) => {
                    tracing::error!("{e:#}");
                    std::process::exit(1);
                }
            }
        }
        loop {
            std::thread::park();
        }
    }
}

/// A standby takes ahead the page faults its incarnation would take first
/// ([`process::populate_private_memory`]), once it has waited [`SETTLE`] unneeded:
/// done at once, it competed for the two vCPUs with the incarnation just
/// activated and the supervisor (bench-echo killed 40 times: reboot p50
/// 515 and 308 µs against 259 and 253 without); after the wait, its
/// initialization p50 fell from 59–67 to 44–48 µs, and `bench reboot`'s
/// small-heap reboot p50 from 229–232 to 184–193 µs (docs/benchmarks.md). A
/// checkpoint-recovered standby is left as it is: a restore writes its
/// pages anyway.
fn take_first_faults(ctl: &ControlBlock, generation: u32, restored: bool) {
    if restored || ctl.await_activation_for(generation, SETTLE) {
        return;
    }
    if let Err(e) = process::populate_private_memory(POPULATED_PAGES, || ctl.activated(generation))
    {
        tracing::warn!("standby: pages left to fault in the incarnation: {e}");
    }
}

/// Starts a standby's thread that reads its vault ahead
/// ([`Vault::read_ahead_until`]), once it has waited [`SETTLE`] unneeded;
/// the thread, to unpark once the incarnation no longer needs it.
fn read_vault_ahead(
    vault: &Arc<Vault>,
    control: &Arc<Region>,
    generation: u32,
) -> Option<std::thread::Thread> {
    let (vault, control) = (vault.clone(), control.clone());
    let spawned = std::thread::Builder::new()
        .name("vault-ahead".into())
        .spawn(move || {
            let ctl: &ControlBlock = control.at(0);
            // Not woken by the activation: it would take a CPU then.
            std::thread::park_timeout(SETTLE);
            if ctl.activated(generation) {
                return;
            }
            if let Err(e) = vault.read_ahead_until(|| ctl.activated(generation)) {
                tracing::debug!("standby: vault not read ahead: {e}");
            }
            // Unparked once the incarnation has reported ready.
            std::thread::sleep(SETTLE);
            vault.drop_spent();
        });
    match spawned {
        Ok(t) => Some(t.thread().clone()),
        Err(e) => {
            tracing::warn!("standby: vault not read ahead: {e}");
            None
        }
    }
}

/// How long a new standby waits before it takes its faults ahead.
const SETTLE: Duration = Duration::from_millis(10);

/// The provided edges' (interface, client id), in edge order.
fn info_provides(info: &BootInfo) -> Vec<(String, u32)> {
    info.provides
        .iter()
        .map(|p| (p.interface.clone(), p.client_id))
        .collect()
}

/// Starts the thread that tells this incarnation's services when one of
/// their clients dies (the supervisor raises the edge's client epoch),
/// once the services are open.
fn watch_clients(
    control: &Arc<Region>,
    clients: &[(String, u32)],
    provided: &[Arc<Edge>],
    gate: &Arc<Gate>,
    prio: Priority,
) {
    let edges: Vec<(String, u32, Arc<Edge>)> = clients
        .iter()
        .zip(provided)
        .map(|((i, c), e)| (i.clone(), *c, e.clone()))
        .collect();
    if edges.is_empty() {
        return;
    }
    let (control, gate) = (control.clone(), gate.clone());
    let spawned = std::thread::Builder::new()
        .name("clients".into())
        .stack_size(256 * 1024)
        .spawn(move || {
            take_priority(prio);
            let ctl: &ControlBlock = control.at(0);
            let (services, _) = gate.opened();
            loop {
                let deaths = ctl.client_deaths.load(Ordering::SeqCst);
                for (interface, client, edge) in &edges {
                    if let Some(service) = services.get(interface.as_str()) {
                        edge.tell_client_deaths(|| service.client_died(*client));
                    }
                }
                futex::wait(&ctl.client_deaths, deaths, None);
            }
        });
    if let Err(e) = spawned {
        fatal(&format!("spawn client watcher: {e}"));
    }
}

/// Every provided edge with its service and client, in boot order.
fn served(info: &BootInfo, provided: &[Arc<Edge>], services: &[Arc<dyn Service>]) -> Vec<Served> {
    info.provides
        .iter()
        .zip(provided)
        .filter_map(|(p, edge)| {
            let service = services
                .iter()
                .find(|s| s.interface().name == p.interface)?;
            Some(Served {
                edge: edge.clone(),
                service: service.clone(),
                client: p.client_id,
            })
        })
        .collect()
}

/// Starts one parked worker thread per slot of every provided edge (and,
/// for a checkpoint-recovered component, the thread that answers audits),
/// gives each thread (and the calling one) its lifeline in `bank`, and
/// returns once all of them hold it.
fn start_workers(
    info: &BootInfo,
    provided: &[Arc<Edge>],
    control: &Arc<Region>,
    bank: usize,
    journal: Option<&Arc<Journal>>,
) -> Arc<Gate> {
    let ctl: &ControlBlock = control.at(0);
    let prio = component_priority(info);
    let workers: usize = provided.iter().map(|e| e.slot_count() as usize).sum();
    let threads = workers + usize::from(journal.is_some());
    if threads + 1 > LIFELINES {
        fatal(&format!(
            "{threads} runtime threads exceed the {LIFELINES} lifelines"
        ));
    }
    ctl.lifeline_count[bank].store(threads as u32 + 1, Ordering::SeqCst);
    if let Err(e) = ctl.lifelines[bank][0].register() {
        fatal(&format!("lifeline: {e}"));
    }
    crate::restart::publish(&ctl.restarts);
    let gate = Arc::new(Gate::default());
    let slots = provided
        .iter()
        .zip(&info.provides)
        .enumerate()
        .flat_map(|(i, (edge, p))| (0..edge.slot_count()).map(move |slot| (i, edge, p, slot)));
    for (line, (index, edge, p, slot)) in (1..).zip(slots) {
        let mut worker = SlotWorker::new(
            edge.clone(),
            slot,
            p.client_id,
            Arc::new(AtomicBool::new(false)),
        );
        worker.journal = journal.map(|j| (j.clone(), index as u32));
        let interface = p.interface.clone();
        let name = format!("{interface}:{slot}");
        // The loop a restart after a restore runs again (`restart.rs`).
        let body = {
            let (gate, name) = (gate.clone(), name.clone());
            move || {
                let (service, epoch) = gate.wait(&interface);
                crate::watchdog::register_worker(line - 1, &name);
                worker.run_gated(service.as_ref(), epoch, &gate.recovery);
            }
        };
        let at = Line {
            control,
            bank,
            line,
            gate: &gate,
            prio,
        };
        at.start(name, move |_| crate::restart::run(line, Box::new(body)));
    }
    if journal.is_some() {
        // The thread that answers the supervisor's audits (`audit.rs`),
        // once the incarnation's services exist.
        let opened = gate.clone();
        let at = Line {
            control,
            bank,
            line: workers + 1,
            gate: &gate,
            prio,
        };
        at.start("audit".into(), move |ctl| {
            crate::audit::answer(&ctl.audits, &opened.all())
        });
    }
    // Every thread holds its lifeline before this incarnation can serve:
    // each did before the next was started.
    debug_assert_eq!(gate.registered.load(Ordering::SeqCst) as usize, threads);
    gate
}

/// Where a runtime thread is started: its lifeline (`line` of `bank` in
/// the control block), the gate counting the threads that hold theirs,
/// its priority.
struct Line<'a> {
    control: &'a Arc<Region>,
    bank: usize,
    line: usize,
    gate: &'a Arc<Gate>,
    prio: Priority,
}

impl Line<'_> {
    /// Starts thread `name` on this line to run `body`; returns once the
    /// thread holds its lifeline. One thread at a time: a thread maps its
    /// own signal stack as it starts, and the next one's stack is mapped
    /// by this thread, so starting them together would interleave the two
    /// at random. One at a time, every incarnation forked from the
    /// pristine image lays its threads out alike, and a checkpoint
    /// restored into another one (`kintsugi-checkpoint`, `respawn.rs`)
    /// finds their stacks where it left them, with nothing to map anew.
    fn start(self, name: String, body: impl FnOnce(&ControlBlock) + Send + 'static) {
        let (control, gate, prio) = (self.control.clone(), self.gate.clone(), self.prio);
        let (bank, line) = (self.bank, self.line);
        std::thread::Builder::new()
            .name(name)
            .stack_size(crate::restart::WORKER_STACK)
            .spawn(move || {
                take_priority(prio);
                let ctl: &ControlBlock = control.at(0);
                if let Err(e) = ctl.lifelines[bank][line].register() {
                    fatal(&format!("lifeline: {e}"));
                }
                gate.registered.fetch_add(1, Ordering::SeqCst);
                futex::wake_all(&gate.registered);
                body(ctl);
            })
            .unwrap_or_else(|e| fatal(&format!("spawn runtime thread: {e}")));
        // Asleep, not yielding: beside CPU-bound work each yield gave the
        // CPU away for a whole time slice, and a standby's 18 threads
        // took tens of milliseconds to start (2026-12-07).
        loop {
            let registered = self.gate.registered.load(Ordering::SeqCst);
            if registered as usize >= line {
                break;
            }
            futex::wait(&self.gate.registered, registered, None);
        }
    }
}

/// Checks that the incarnation serves exactly what the system description
/// says the component provides, and publishes the interface hashes.
fn open_services(
    boot: &BootInfo,
    provided: &[Arc<Edge>],
    inc: Incarnation,
) -> anyhow::Result<Incarnation> {
    for (p, edge) in boot.provides.iter().zip(provided) {
        let service = inc
            .services
            .iter()
            .find(|s| s.interface().name == p.interface)
            .ok_or_else(|| {
                anyhow::anyhow!(
                    "the system description says `{}` provides `{}`, but it serves only [{}]",
                    boot.component,
                    p.interface,
                    inc.services
                        .iter()
                        .map(|s| s.interface().name)
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            })?;
        edge.header()
            .interface_hash
            .store(service.interface().hash, Ordering::SeqCst);
        edge.register_functions(service.interface());
    }
    Ok(inc)
}

/// The services of an incarnation by interface name, and its epoch.
type Services = (HashMap<&'static str, Arc<dyn Service>>, u64);

/// Holds parked workers until the incarnation's services exist.
#[derive(Default)]
struct Gate {
    open: AtomicU32,
    /// Workers that hold their lifeline.
    registered: AtomicU32,
    services: OnceLock<Services>,
    /// Closed during eager recovery.
    recovery: RecoveryGate,
}

impl Gate {
    fn open(&self, services: Vec<Arc<dyn Service>>, epoch: u64) {
        let map = services
            .into_iter()
            .map(|s| (s.interface().name, s))
            .collect();
        let _ = self.services.set((map, epoch));
        self.open.store(1, Ordering::SeqCst);
        futex::wake_all(&self.open);
    }

    /// Waits until the gate is open; returns the services and the epoch.
    fn opened(&self) -> &Services {
        while self.open.load(Ordering::SeqCst) == 0 {
            futex::wait(&self.open, 0, None);
        }
        self.services.get().expect("gate opened without services")
    }

    /// Every service, once the gate is open.
    fn all(&self) -> Vec<Arc<dyn Service>> {
        self.opened().0.values().cloned().collect()
    }

    fn wait(&self, interface: &str) -> (Arc<dyn Service>, u64) {
        let (map, epoch) = self.opened();
        match map.get(interface) {
            Some(s) => (s.clone(), *epoch),
            // open_services checked this before the gate opened.
            None => unreachable!("no service for a provided interface"),
        }
    }
}

//! A live view of a running system for what runs beside the supervisor (the
//! watchdog, the fault injector, campaigns, benchmarks): each component's
//! live process, epoch and counters, and a way to report a fault that the
//! supervisor then treats as a crash of that incarnation.

use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kintsugi_runtime::abi::boot::ControlBlock;
use kintsugi_runtime::abi::channel::Edge;
use kintsugi_runtime::abi::shm::Region;
use kintsugi_runtime::InterfaceInfo;

use crate::checkpoints::{Command, Summary};
use crate::events::Event;
use crate::health::{component_of, Health};
use crate::mailbox::Mailbox;
use crate::output::Tails;
use crate::quota::{VaultUsage, VaultUse};
use crate::turns::{Threads, Turns};

/// One component as the roster sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub name: String,
    /// The live incarnation's process, if one serves.
    pub pid: Option<u32>,
    pub epoch: u64,
    /// Incarnations that went live so far (a checkpoint recovery keeps the
    /// epoch, not the process: this counts both kinds of reboot).
    pub incarnations: u64,
    /// In-place rollbacks of this incarnation (its pid stays).
    pub rollbacks: u64,
    /// Its state and history, as the supervisor's events tell them.
    pub health: Health,
}

/// A fault found outside the supervisor's own detection (a hang, a checker).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FaultReport {
    pub component: String,
    /// The incarnation it concerns; a report about one already replaced is
    /// dropped.
    pub pid: u32,
    /// What was found, for the event log.
    pub detail: String,
    /// A hang the watchdog found (which a checkpointed component may
    /// answer by a rollback instead of a reboot).
    pub hang: bool,
}

/// The end of a rollback the supervisor started on a hang.
#[derive(Debug, Clone)]
pub(crate) struct RollbackOutcome {
    pub component: String,
    pub pid: u32,
    pub detail: String,
    pub result: Result<Summary, String>,
}

struct Entry {
    member: Member,
    control: Arc<Region>,
    /// How often the checkpoint thread has frozen it.
    freezes: Arc<AtomicU64>,
    /// What its vault holds.
    vault: Arc<VaultUsage>,
    /// The edges it serves, each with its interface's name, in the order
    /// its workers are numbered.
    served: Vec<(String, Arc<Edge>)>,
}

/// Shared between the supervisor and its observers.
#[derive(Default)]
pub struct Roster {
    entries: Mutex<Vec<Entry>>,
    faults: Mutex<Vec<FaultReport>>,
    rollbacks: Mutex<Vec<RollbackOutcome>>,
    /// Set by [`Roster::request_stop`].
    stop: std::sync::atomic::AtomicBool,
    /// Written once per report or stop request; the supervisor's event loop listens.
    notify: Mutex<Option<OwnedFd>>,
    /// The supervisor's checkpoint thread, while the system runs.
    checkpoints: Mutex<Option<Arc<Mailbox<Command>>>>,
    /// Turns of the supervisor's event loop.
    turns: AtomicU64,
    /// Turns of its other serving threads.
    threads: Arc<Threads>,
    /// Each component's last stderr lines (`output.rs`).
    tails: Mutex<Tails>,
}

impl Roster {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Every component, in start order.
    pub fn members(&self) -> Vec<Member> {
        self.lock().iter().map(|e| e.member.clone()).collect()
    }

    /// The last lines component `name` wrote to its stderr (at most
    /// [`crate::output::TAIL`]), oldest first.
    pub fn last_lines(&self, name: &str) -> Vec<String> {
        self.tails
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .of(name)
    }

    pub(crate) fn note_line(&self, name: &str, line: &str) {
        self.tails
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(name, line);
    }

    pub fn member(&self, name: &str) -> Option<Member> {
        self.lock()
            .iter()
            .find(|e| e.member.name == name)
            .map(|e| e.member.clone())
    }

    /// The named counters of component `name` ([`kintsugi_runtime::counters`]).
    pub fn counters(&self, name: &str) -> Vec<(String, u64)> {
        self.control(name)
            .map(|c| {
                let ctl: &ControlBlock = c.at(0);
                ctl.counters.snapshot()
            })
            .unwrap_or_default()
    }

    /// One counter's value (0 if the component has not named it yet).
    pub fn counter(&self, name: &str, counter: &str) -> u64 {
        self.counters(name)
            .into_iter()
            .find(|(n, _)| n == counter)
            .map_or(0, |(_, v)| v)
    }

    /// What component `name`'s vault holds now.
    pub fn vault_use(&self, name: &str) -> VaultUse {
        self.lock()
            .iter()
            .find(|e| e.member.name == name)
            .map(|e| e.vault.now())
            .unwrap_or_default()
    }

    /// The control block region of component `name`.
    pub fn control(&self, name: &str) -> Option<Arc<Region>> {
        self.lock()
            .iter()
            .find(|e| e.member.name == name)
            .map(|e| e.control.clone())
    }

    /// Asks the supervisor to treat `pid`'s incarnation of `component` as
    /// failed: it logs the report, kills the process and reboots it.
    pub fn report_fault(&self, report: FaultReport) {
        self.faults
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(report);
        self.wake();
    }

    /// Asks the supervisor to stop the system, as SIGTERM would (for an
    /// observer that runs a system in process, e.g. a benchmark).
    pub fn request_stop(&self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        self.wake();
    }

    /// How many times the supervisor's event loop has turned: a count that
    /// stops growing means a hung supervisor (see `Options::heartbeat`).
    pub fn loop_turns(&self) -> u64 {
        self.turns.load(Ordering::Relaxed)
    }

    pub(crate) fn turned(&self) {
        self.turns.fetch_add(1, Ordering::Relaxed);
    }

    /// The turn count of serving thread `name`, which wakes at least
    /// `every` (watched only if given: see `Options::heartbeat`).
    pub fn thread_turns(&self, name: &str, every: Option<Duration>) -> Turns {
        self.threads.register(name, every)
    }

    /// Each watched serving thread's name and turn count (the event loop's
    /// is [`Roster::loop_turns`]); read them with [`crate::Stalls`].
    pub fn thread_turn_counts(&self) -> Vec<(String, u64)> {
        self.threads.snapshot()
    }

    pub(crate) fn stop_requested(&self) -> bool {
        self.stop.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn wake(&self) {
        if let Some(fd) = self
            .notify
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            let _ = rustix::io::write(fd, &[1]);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Entry>> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn set_notify(&self, fd: OwnedFd) {
        *self.notify.lock().unwrap_or_else(|p| p.into_inner()) = Some(fd);
    }

    /// A rollback started on a hang has ended: the event loop reports it
    /// (and reboots the component if it failed).
    pub(crate) fn rollback_done(&self, outcome: RollbackOutcome) {
        if outcome.result.is_ok() {
            if let Some(e) = self
                .lock()
                .iter_mut()
                .find(|e| e.member.name == outcome.component)
            {
                e.member.rollbacks += 1;
            }
        }
        self.rollbacks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(outcome);
        self.wake();
    }

    pub(crate) fn take_rollbacks(&self) -> Vec<RollbackOutcome> {
        std::mem::take(&mut *self.rollbacks.lock().unwrap_or_else(|p| p.into_inner()))
    }

    pub(crate) fn take_faults(&self) -> Vec<FaultReport> {
        std::mem::take(&mut *self.faults.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// The edges component `name` serves, each with its interface's name,
    /// in the order its slot workers are numbered.
    pub fn served(&self, name: &str) -> Vec<(String, Arc<Edge>)> {
        self.lock()
            .iter()
            .find(|e| e.member.name == name)
            .map(|e| e.served.clone())
            .unwrap_or_default()
    }

    /// Adds component `name`, with the count of its freezes that the
    /// checkpoint thread raises.
    pub(crate) fn add(
        &self,
        name: &str,
        control: Arc<Region>,
        served: Vec<(String, Arc<Edge>)>,
        freezes: Arc<AtomicU64>,
        vault: Arc<VaultUsage>,
    ) {
        self.lock().push(Entry {
            freezes,
            vault,
            member: Member {
                name: name.to_string(),
                pid: None,
                epoch: 0,
                incarnations: 0,
                rollbacks: 0,
                health: Health::default(),
            },
            control,
            served,
        });
    }

    /// How often the checkpoint thread has frozen component `name`.
    pub(crate) fn freezes(&self, name: &str) -> u64 {
        self.lock()
            .iter()
            .find(|e| e.member.name == name)
            .map_or(0, |e| e.freezes.load(Ordering::SeqCst))
    }

    /// Records the live incarnation of `name` (None: none serves).
    /// Takes in an event the supervisor emits.
    pub(crate) fn observe(&self, e: &Event) {
        let Some(name) = component_of(e) else {
            return;
        };
        if let Some(entry) = self.lock().iter_mut().find(|x| x.member.name == name) {
            entry.member.health.observe(e);
        }
    }

    pub(crate) fn set_live(&self, name: &str, pid: Option<u32>, epoch: u64) {
        if let Some(e) = self.lock().iter_mut().find(|e| e.member.name == name) {
            e.member.pid = pid;
            e.member.epoch = epoch;
            e.member.rollbacks = 0;
            e.member.incarnations += u64::from(pid.is_some());
        }
        let name = name.to_string();
        // Said on the reboot's path: handled before anything the
        // checkpoint thread does next, woken when the event loop flushes.
        self.post_checkpoints(match pid {
            Some(pid) => Command::Live { name, pid },
            None => Command::Down { name },
        });
    }

    /// A standby of checkpointed component `name` waits in `pid`.
    pub(crate) fn standby_parked(&self, name: &str, pid: u32) {
        let name = name.to_string();
        self.tell_checkpoints(Command::Standby { name, pid });
    }

    /// The checkpoint thread's mailbox while the system runs; `None`
    /// closes the one before, and the thread ends once it has taken what
    /// it holds.
    pub(crate) fn set_checkpoints(&self, commands: Option<Arc<Mailbox<Command>>>) {
        let was = std::mem::replace(
            &mut *self.checkpoints.lock().unwrap_or_else(|p| p.into_inner()),
            commands,
        );
        if let Some(was) = was {
            was.close();
        }
    }

    fn tell_checkpoints(&self, cmd: Command) -> bool {
        self.with_checkpoints(|m| m.send(cmd)).unwrap_or(false)
    }

    fn post_checkpoints(&self, cmd: Command) {
        self.with_checkpoints(|m| m.post(cmd));
    }

    /// Wakes the checkpoint thread for the commands posted since it last
    /// looked (the event loop does, before it sleeps).
    pub(crate) fn flush_checkpoints(&self) {
        self.with_checkpoints(Mailbox::flush);
    }

    fn with_checkpoints<R>(&self, f: impl FnOnce(&Mailbox<Command>) -> R) -> Option<R> {
        let held = self.checkpoints.lock().unwrap_or_else(|p| p.into_inner());
        held.as_deref().map(f)
    }

    /// Checkpoints `component` at its next safe point (waiting up to 2 s
    /// for one) and, with `out`, writes the image to that file.
    pub fn checkpoint(&self, component: &str, out: Option<PathBuf>) -> Result<Summary, String> {
        let (reply, answer) = std::sync::mpsc::channel();
        let name = component.to_string();
        self.ask(Command::Take { name, out, reply }, answer)
    }

    /// Restores `component` at its next safe point (`force`: without
    /// waiting for one, as for a hung component): from its latest
    /// checkpoint, in place, or from an image file (see `checkpoints.rs`).
    pub fn restore(
        &self,
        component: &str,
        from: Option<PathBuf>,
        force: bool,
    ) -> Result<Summary, String> {
        let (reply, answer) = std::sync::mpsc::channel();
        let name = component.to_string();
        let cmd = Command::Restore {
            name,
            from,
            force,
            reply,
        };
        self.ask(cmd, answer)
    }

    /// Checkpoint recovery of `component`'s new incarnation (see
    /// `checkpoints.rs`): its last checkpoint restored, its log replayed;
    /// or, `fresh`, both dropped (see `ladder.rs`).
    pub(crate) fn recover(&self, component: &str, fresh: bool) -> Result<Summary, String> {
        let (reply, answer) = std::sync::mpsc::channel();
        let name = component.to_string();
        self.ask(Command::Recover { name, fresh, reply }, answer)
    }

    fn ask(
        &self,
        cmd: Command,
        answer: std::sync::mpsc::Receiver<Result<Summary, String>>,
    ) -> Result<Summary, String> {
        if !self.tell_checkpoints(cmd) {
            return Err("the system is not running".into());
        }
        answer
            .recv()
            .unwrap_or_else(|_| Err("the system stopped".into()))
    }
}

/// `interface.function` for a call of `func` on `edge`, which serves
/// `interface`: named by the interfaces the supervisor was built with (by
/// the hash in the edge), else by the names the stubs registered in the
/// edge (identifiers only: a faulty component may write anything there),
/// else by number.
pub(crate) fn call_name(
    interfaces: &[&'static InterfaceInfo],
    interface: &str,
    edge: &Edge,
    func: u32,
) -> String {
    let hash = edge.header().interface_hash.load(Ordering::Relaxed);
    let built_in = interfaces
        .iter()
        .find(|i| i.hash == hash)
        .and_then(|i| i.functions.get(func as usize))
        .map(|f| f.to_string());
    match built_in.or_else(|| edge.function_name(func)) {
        Some(f) => format!("{interface}.{f}"),
        None => format!("{interface}.#{func}"),
    }
}

//! What the supervisor tells a component at exec: its identity, its
//! descriptors (control block, sockets, one shared region per edge, its
//! durable memory and its servers' pools), its policies and its
//! configuration, as JSON in the `KINTSUGI_BOOT` environment variable.

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::abi::lifeline::Lifeline;
use crate::abi::shm::SharedPod;
use crate::counters::CounterTable;
use crate::futex;
use crate::watchdog::WatchTable;

/// Lifelines per incarnation: its main thread and its slot workers.
pub const LIFELINES: usize = 128;

/// The layout of the shared memory a component and its supervisor both
/// map, as this build of the runtime has it: a hand-kept version, bumped
/// when a shared structure's meaning changes, mixed with the sizes of the
/// structures in the control block. The supervisor sends its own in
/// [`BootInfo::abi`]; a component built against another version of the
/// runtime refuses to boot rather than misread the supervisor's memory.
pub const ABI: u64 = abi_fingerprint();

/// Bumped by hand when a shared structure changes meaning but not size.
const ABI_VERSION: u64 = 1;

/// FNV-1a over the version and the sizes.
const fn abi_fingerprint() -> u64 {
    let words = [
        ABI_VERSION,
        std::mem::size_of::<ControlBlock>() as u64,
        std::mem::size_of::<WatchTable>() as u64,
        std::mem::size_of::<CounterTable>() as u64,
        std::mem::size_of::<Lifeline>() as u64,
    ];
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let mut i = 0;
    while i < words.len() {
        hash ^= words[i];
        hash = hash.wrapping_mul(0x0100_0000_01b3);
        i += 1;
    }
    hash
}

/// The environment variable that carries [`BootInfo`].
pub const BOOT_ENV: &str = "KINTSUGI_BOOT";

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BootInfo {
    /// The supervisor's [`ABI`] (0 from a supervisor that predates it).
    #[serde(default)]
    pub abi: u64,
    pub component: String,
    pub id: u32,
    /// The supervisor's process id: the parent the component must have.
    /// Read from here, not from `getppid` after the exec: a supervisor
    /// killed in between leaves the component to a reaper, which it would
    /// take for its parent and outlive its system by.
    #[serde(default)]
    pub supervisor: u32,
    /// Region holding the [`ControlBlock`].
    pub control_fd: RawFd,
    /// Seqpacket socket on which the supervisor asks the pristine image to fork.
    pub zygote_fd: RawFd,
    /// Seqpacket socket to the supervisor's state vault.
    pub vault_fd: RawFd,
    pub provides: Vec<ProvidedEdge>,
    pub uses: Vec<UsedEdge>,
    pub config: serde_json::Value,
    /// How clients rebuild this component's descriptors: "on-demand" or "eager".
    #[serde(default = "on_demand")]
    pub recovery: String,
    /// Nice value (already applied at exec).
    #[serde(default)]
    pub priority: i32,
    /// SCHED_FIFO priority for the component's threads, where permitted.
    #[serde(default)]
    pub realtime: Option<u8>,
    /// Memfd of the component's private durable memory (`arena_kib`): every
    /// incarnation maps the same pages.
    #[serde(default)]
    pub arena_fd: Option<RawFd>,
    /// Memfd of the durable memory it shares with its clients (`pool_kib`).
    #[serde(default)]
    pub pool_fd: Option<RawFd>,
    /// Memfd of its request log (`recovery = "checkpoint"`,
    /// [`crate::abi::journal`]).
    #[serde(default)]
    pub journal_fd: Option<RawFd>,
    /// Whether the supervisor's watchdog watches this component's workers
    /// and sections ([`crate::watchdog`]).
    #[serde(default)]
    pub watchdog: bool,
    /// When waiters spin before they sleep.
    #[serde(default)]
    pub spin: crate::futex::Spin,
    /// The most descriptors its vault may hand it (`vault_quota.fds`): each
    /// incarnation makes room for them in its descriptor table before its
    /// threads start ([`crate::process::reserve_descriptors`]).
    #[serde(default)]
    pub vault_fds: u64,
    /// System calls its description allows beyond the runtime's list
    /// (`syscalls = [...]`), by number ([`crate::seccomp`]).
    #[serde(default)]
    pub syscalls: Vec<i32>,
    /// Whether its standbys read the vault ahead of their activation
    /// (`vault::ahead`): not for a checkpointed component, whose standby
    /// must be laid out as its image is.
    #[serde(default)]
    pub read_vault_ahead: bool,
}

fn on_demand() -> String {
    "on-demand".to_string()
}

/// An edge on which this component serves a client.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ProvidedEdge {
    pub interface: String,
    pub client: String,
    pub client_id: u32,
    pub fd: RawFd,
}

/// An edge on which this component calls a server.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct UsedEdge {
    pub interface: String,
    pub server: String,
    /// The server's component id (its place in the system description,
    /// from 1): what the server's [`crate::Caller::component`] would say of
    /// it, for a client that hands it something by id (an mm page aliased
    /// to it).
    #[serde(default)]
    pub server_id: u32,
    pub fd: RawFd,
    /// The server's pool (`pool_kib`), if it has one; the same descriptor on
    /// every edge to that server.
    #[serde(default)]
    pub pool_fd: Option<RawFd>,
    /// The server is checkpoint-recovered (`recovery = "checkpoint"`): a
    /// rollback's replay answers a call it ran again, so a reply that
    /// does not decode is awaited from the replay, not asked for twice.
    #[serde(default)]
    pub replayed: bool,
}

/// Shared between the supervisor and one component's processes: how the
/// supervisor wakes a warm standby and learns that it is ready.
#[repr(C)]
pub struct ControlBlock {
    /// Generation of the standby to activate (futex).
    pub go: AtomicU32,
    /// Generation that finished initialization (futex).
    pub ready: AtomicU32,
    /// Generation whose initialization failed.
    pub failed: AtomicU32,
    _pad: AtomicU32,
    /// Epoch of the incarnation being activated.
    pub epoch: AtomicU64,
    /// Generation that is exiting by itself (not a crash).
    pub exiting: AtomicU32,
    /// Raised (and woken) by the supervisor when a client of this component dies.
    pub client_deaths: AtomicU32,
    /// Lifelines registered in each bank.
    pub lifeline_count: [AtomicU32; 2],
    /// Two banks of lifelines: the live incarnation uses one, its standby the other.
    pub lifelines: [[Lifeline; LIFELINES]; 2],
    /// The last eager recovery: how long it took (ns) and how many
    /// descriptors its clients rebuilt.
    pub eager_ns: AtomicU64,
    pub eager_descriptors: AtomicU64,
    /// The last activation's execution re-initialization: from the standby
    /// waking to its report of readiness (ns), i.e. the component's `init`.
    pub init_ns: AtomicU64,
    /// The component's named counters ([`crate::counters`]).
    pub counters: CounterTable,
    /// What the watchdog samples: worker stretches, section histories and
    /// active sections ([`crate::watchdog`]).
    pub watch: WatchTable,
    /// Where the incarnation that died last panicked: a hash of the
    /// panic's file, line and column (0: it did not panic), written by its
    /// panic hook and read and cleared by the supervisor, which backs off
    /// the restarts of a component that panics at the same place again and
    /// again.
    pub panic_site: AtomicU64,
    /// Where this component's worker threads can start over after a
    /// restore ([`crate::restart`]).
    pub restarts: Restarts,
    /// The supervisor's audits of a checkpoint-recovered component's state
    /// before each checkpoint (the runtime's `audit.rs`).
    pub audits: Audits,
    /// Raised by an incarnation's first listing of its vault: the
    /// component lists it, so its standbys read it ahead (`vault::ahead`).
    pub lists_vault: AtomicU32,
}

/// Audits asked for and answered: generation numbers, raised by one side
/// and answered by the other. All zero: none asked.
#[repr(C)]
#[derive(Debug, Default)]
pub struct Audits {
    /// The latest audit asked for (futex; the supervisor raises it).
    pub asked: AtomicU32,
    /// The latest audit answered (futex; the component raises it).
    pub answered: AtomicU32,
    /// The latest audit whose answer was that the state is damaged.
    pub damaged: AtomicU32,
}

/// What an audit answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Every service found its state sound.
    Sound,
    /// A service found its state damaged (it logged what).
    Damaged,
    /// No answer came in time.
    Unanswered,
}

impl Audits {
    /// Supervisor: asks for an audit and waits up to `within` for its
    /// verdict, or until `gone()` (checked every millisecond) says no
    /// answer can come.
    pub fn ask(&self, within: Duration, gone: impl Fn() -> bool) -> Verdict {
        let asked = self.asked.fetch_add(1, Ordering::SeqCst).wrapping_add(1);
        futex::wake_all(&self.asked);
        let until = Instant::now() + within;
        loop {
            let answered = self.answered.load(Ordering::SeqCst);
            if answered == asked {
                return match self.damaged.load(Ordering::SeqCst) == asked {
                    true => Verdict::Damaged,
                    false => Verdict::Sound,
                };
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() || gone() {
                return Verdict::Unanswered;
            }
            let slice = left.min(Duration::from_millis(1));
            futex::wait(&self.answered, answered, Some(slice));
        }
    }

    /// Component: answers each audit asked for with `sound()`, for ever.
    pub fn answer(&self, sound: impl Fn() -> bool) -> ! {
        loop {
            let asked = self.asked.load(Ordering::SeqCst);
            if self.answered.load(Ordering::SeqCst) != asked {
                if !sound() {
                    self.damaged.store(asked, Ordering::SeqCst);
                }
                self.answered.store(asked, Ordering::SeqCst);
                futex::wake_all(&self.answered);
            }
            futex::wait(&self.asked, asked, None);
        }
    }
}

/// A component's restart point, as its incarnation publishes it at boot:
/// every incarnation forked from one pristine image publishes the same.
/// The supervisor uses it only on that component's own threads.
#[repr(C)]
#[derive(Debug, Default)]
pub struct Restarts {
    /// The address of the function a restarted worker begins in (0: none
    /// published).
    pub entry: AtomicU64,
    /// The address of the table of [`LIFELINES`] [`WorkerLine`]s, in the
    /// component's own memory.
    pub lines: AtomicU64,
    /// The size of a worker's stack: a line's thread whose stack pointer
    /// lies within this many bytes below the line's top is in its loop.
    pub stack: AtomicU64,
}

/// One worker line's entry in the table [`Restarts::lines`] names (in the
/// component's memory, not shared: a restore puts back the image's).
#[repr(C)]
#[derive(Debug, Default)]
pub struct WorkerLine {
    /// The worker thread's thread pointer (its `fs` base; 0: no worker).
    pub thread: AtomicU64,
    /// Where its stack stood when it entered its loop.
    pub top: AtomicU64,
}

impl Restarts {
    pub fn publish(&self, entry: u64, lines: u64, stack: u64) {
        self.lines.store(lines, Ordering::Relaxed);
        self.stack.store(stack, Ordering::Relaxed);
        self.entry.store(entry, Ordering::Release);
    }
}
// SAFETY: repr(C), atomics only, all-zero means "nothing activated yet".
unsafe impl SharedPod for ControlBlock {}

/// How an activation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    Ready,
    /// The incarnation reported that its initialization failed.
    Failed,
    /// The incarnation died before it reported anything.
    Died,
    /// The supervisor was asked to stop while it waited.
    Interrupted,
    TimedOut,
}

/// How often [`ControlBlock::wait_ready`] asks its caller whether to stop
/// waiting: the bound on how late a death during initialization is seen.
pub const READY_POLL: Duration = Duration::from_millis(2);

impl ControlBlock {
    /// Supervisor: lets standby `generation` run as incarnation `epoch`.
    pub fn activate(&self, generation: u32, epoch: u64) {
        self.epoch.store(epoch, Ordering::SeqCst);
        self.go.store(generation, Ordering::SeqCst);
        futex::wake_all(&self.go);
    }

    /// Supervisor: waits until `generation` reports ready or failed. Every
    /// [`READY_POLL`] it asks `check`, which returns `Some` (e.g.
    /// [`Activation::Died`] when the incarnation's pidfd is readable) to
    /// stop waiting: a process that dies during initialization never
    /// reports, and no futex wakes on its death.
    pub fn wait_ready(
        &self,
        generation: u32,
        timeout: Duration,
        mut check: impl FnMut() -> Option<Activation>,
    ) -> Activation {
        let deadline = Instant::now() + timeout;
        // No spin first: an initialization takes tens of microseconds at
        // least, and a spinning waiter yields its CPU, which put the
        // supervisor behind a dying incarnation's teardown (milliseconds
        // in the kernel for a large heap) while the other CPU was idle.
        loop {
            let r = self.ready.load(Ordering::SeqCst);
            if r == generation {
                return Activation::Ready;
            }
            if self.failed.load(Ordering::SeqCst) == generation {
                return Activation::Failed;
            }
            if let Some(outcome) = check() {
                // It may have reported just before it died or we were stopped.
                return match self.ready.load(Ordering::SeqCst) == generation {
                    true => Activation::Ready,
                    false => outcome,
                };
            }
            let now = Instant::now();
            if now >= deadline {
                return Activation::TimedOut;
            }
            futex::wait(&self.ready, r, Some((deadline - now).min(READY_POLL)));
        }
    }

    /// Standby: whether the supervisor has activated `generation` (it need
    /// not wait in [`Self::wait_activation`]).
    pub fn activated(&self, generation: u32) -> bool {
        self.go.load(Ordering::SeqCst) == generation
    }

    /// Standby: sleeps until the supervisor activates `generation` or
    /// `timeout` passes; whether it did.
    pub fn await_activation_for(&self, generation: u32, timeout: std::time::Duration) -> bool {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let g = self.go.load(Ordering::SeqCst);
            let now = std::time::Instant::now();
            if g == generation || now >= deadline {
                return g == generation;
            }
            futex::wait(&self.go, g, Some(deadline - now));
        }
    }

    /// Standby: sleeps until the supervisor activates `generation`; returns the epoch.
    pub fn wait_activation(&self, generation: u32) -> u64 {
        loop {
            let g = self.go.load(Ordering::SeqCst);
            if g == generation {
                return self.epoch.load(Ordering::SeqCst);
            }
            futex::wait(&self.go, g, None);
        }
    }

    /// The lifelines of bank `bank` that are in use.
    pub fn bank(&self, bank: usize) -> &[Lifeline] {
        let n = (self.lifeline_count[bank].load(Ordering::SeqCst) as usize).min(LIFELINES);
        &self.lifelines[bank][..n]
    }

    /// Supervisor: tells the component that one of its clients died.
    pub fn client_died(&self) {
        self.client_deaths.fetch_add(1, Ordering::SeqCst);
        futex::wake_all(&self.client_deaths);
    }

    /// Incarnation: reports the end of initialization.
    pub fn report(&self, generation: u32, ok: bool) {
        let word = if ok { &self.ready } else { &self.failed };
        word.store(generation, Ordering::SeqCst);
        futex::wake_all(&self.ready);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::abi::shm::Region;

    fn block() -> Region {
        Region::create("boot-test", std::mem::size_of::<ControlBlock>()).unwrap()
    }

    #[test]
    fn each_audit_gets_its_own_verdict_and_a_silent_one_none() {
        let region = std::sync::Arc::new(block());
        let ctl: &ControlBlock = region.at(0);
        assert_eq!(
            ctl.audits.ask(Duration::from_millis(20), || false),
            Verdict::Unanswered,
            "no one answers yet"
        );
        let damage = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (r, seen) = (region.clone(), damage.clone());
        std::thread::spawn(move || {
            r.at::<ControlBlock>(0)
                .audits
                .answer(|| !seen.load(Ordering::SeqCst))
        });
        let mut verdicts = Vec::new();
        for damaged in [false, true, false] {
            damage.store(damaged, Ordering::SeqCst);
            verdicts.push(ctl.audits.ask(Duration::from_secs(10), || false));
        }
        assert_eq!(verdicts, [Verdict::Sound, Verdict::Damaged, Verdict::Sound]);
    }

    #[test]
    fn a_death_reported_by_the_check_ends_the_wait_at_once() {
        let region = block();
        let ctl: &ControlBlock = region.at(0);
        ctl.activate(1, 1);
        let t = Instant::now();
        let mut polls = 0;
        let outcome = ctl.wait_ready(1, Duration::from_secs(10), || {
            polls += 1;
            (polls == 3).then_some(Activation::Died)
        });
        assert_eq!(outcome, Activation::Died);
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    }

    #[test]
    fn readiness_and_failure_are_reported_as_such() {
        let region = std::sync::Arc::new(block());
        let ctl: &ControlBlock = region.at(0);
        let r = region.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            r.at::<ControlBlock>(0).report(1, true);
        });
        assert_eq!(
            ctl.wait_ready(1, Duration::from_secs(10), || None),
            Activation::Ready
        );
        t.join().unwrap();
        ctl.report(2, false);
        assert_eq!(
            ctl.wait_ready(2, Duration::from_secs(10), || None),
            Activation::Failed
        );
        // A generation that never reports times out.
        assert_eq!(
            ctl.wait_ready(3, Duration::from_millis(20), || None),
            Activation::TimedOut
        );
    }
}

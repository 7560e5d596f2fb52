//! System descriptions: the TOML file naming a kintsugi system's components,
//! their binaries, the interfaces each provides and uses, and their restart,
//! reboot and recovery policies.
//!
//! [`load`] reads, validates and resolves a file; [`parse`] validates text
//! without looking for binaries. Every error found in the text displays as
//! `path:line:col: message`.
//!
//! ```toml
//! [system]
//! name = "demo"
//! description = "ramfs with a verifying file workload"
//! # vault = { dir = "state", fsync = "always" }  # optional: the vault kept in a directory (relative to this file),
//! #                                             # its log synced before each answer ("never": left to the kernel)
//! # keeper = { hang_ms = 1000, max = 100, window_ms = 10000 }  # optional: a keeper process restarts the supervisor
//! #                                             # when it dies or its loop stalls for hang_ms (README, "The keeper")
//!
//! [[component]]
//! name = "ramfs"
//! binary = "kintsugi-ramfs"          # looked up in the search dirs, or a path relative to this file if it contains '/'
//! provides = ["fs"]
//! priority = 0              # nice value, -20..=19
//! realtime = 10             # optional: SCHED_FIFO priority 1..=99 where permitted
//! cpus = [1]                # optional: the CPUs its processes may run on (default: the supervisor's)
//! recovery = "on-demand"    # on-demand | eager | checkpoint (restore the last checkpoint and replay the request log)
//! reboot = "standby"        # standby | fork | exec
//! restart = { max = 1000, window_ms = 1000, type = "transient", on_give_up = "stop" }  # type: permanent | transient | temporary; on_give_up = "isolate": leave it failed, the rest running
//! # backoff: after `backoff_after` failures in a row the same way (exit code, panic site), each restart
//! # waits backoff_ms, doubling up to backoff_max_ms; an incarnation up healthy_ms ends the series
//! # restart = { backoff = true, backoff_after = 3, backoff_ms = 10, backoff_max_ms = 1000, healthy_ms = 1000 }
//! slots = 8                 # 1..=64
//! arena_kib = 64            # private memory that survives micro-reboots (default 0: none)
//! pool_kib = 0              # memory shared with its clients, also durable (default 0: none)
//! checkpoint = { every_ms = 100, keep = 0, on_hang = "reboot", read_ahead_pages = 256 }  # optional: incremental checkpoints at safe points; on_hang = "rollback": a hang the watchdog finds rolls it back in place; read ahead while it runs when it has likely written that many pages since the last
//! journal_kib = 16384       # recovery = "checkpoint" only: the request log's durable memory
//! capabilities = []         # kept (default: none); every other one is dropped, and no_new_privs set
//! syscalls = []             # allowed beside the runtime's list and what its binary declares (default: none)
//! vault_quota = { records = 100000, kib = 65536, fds = 4096 }  # the defaults; past them a vault request is refused
//! watchdog = { stuck_ms = 1000 }  # its own hang detection: the [watchdog] fields written replaced (not period_us)
//! sockets = { listen = "http" }  # socket activation: the socket named http (LISTEN_FDNAMES) put in its vault as `listen`
//! start_timeout_ms = 10000  # an incarnation not ready by then failed (default 10 s)
//! stop_timeout_ms = 20000   # after SIGTERM, killed after this long (default 20 s)
//!
//! [[group]]                # optional: components restarted together (OTP's strategies)
//! name = "storage"
//! members = ["ramfs", "workload"]  # in order, for rest_for_one
//! strategy = "one_for_all"      # one_for_all | rest_for_one (those after the failed one)
//!
//! [watchdog]               # optional: hang detection (see docs/reliability.md)
//! period_us = 5000          # the monitor samples every period
//! window = 50               # stretches / section runs in the adaptive bound (1..=64)
//! margin = 2.0              # bound = margin × the window's maximum
//! default_bound_us = 100000 # while a window fills
//! floor_us = 20000          # least stretch bound (CPU time is read at scheduler-tick granularity)
//! stuck_ms = 5000           # no CPU progress inside an invocation for this long: a hang
//! min_section_us = 5000     # least section check value (RMK's threshold)
//!
//! [[component]]
//! name = "workload"
//! binary = "kintsugi-fs-workload"
//! uses = ["fs"]             # or "fs@ramfs" to pick a provider
//! [component.config]        # free-form, handed to the component as JSON
//! files = 16
//! ```

#![forbid(unsafe_code)]

mod error;
mod parse;

use std::collections::BTreeMap;
use std::fmt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
pub use syscalls::Sysno;

pub use error::{ErrorKind, Location, SystemError};

/// Nice values a component's `priority` may take.
pub const PRIORITY_RANGE: std::ops::RangeInclusive<i32> = -20..=19;
/// Values `slots` may take.
pub const SLOTS_RANGE: std::ops::RangeInclusive<u32> = 1..=64;
/// `slots` when not given.
pub const DEFAULT_SLOTS: u32 = 8;
/// Values `realtime` (a SCHED_FIFO priority) may take.
pub const REALTIME_RANGE: std::ops::RangeInclusive<u8> = 1..=99;
/// CPU numbers `cpus` may list (the kernel's `CPU_SETSIZE`).
pub const CPU_RANGE: std::ops::RangeInclusive<u16> = 0..=1023;
/// Values `checkpoint.every_ms` may take (1 ms to an hour).
pub const CHECKPOINT_EVERY_MS_RANGE: std::ops::RangeInclusive<u64> = 1..=3_600_000;
/// Values `checkpoint.read_ahead_pages` may take (0: always).
pub const CHECKPOINT_READ_AHEAD_RANGE: std::ops::RangeInclusive<u64> = 0..=1 << 40;
/// `checkpoint.read_ahead_pages` unless given (1 MiB).
pub const DEFAULT_READ_AHEAD_PAGES: u64 = 256;
/// Values `checkpoint.keep` may take.
pub const CHECKPOINT_KEEP_RANGE: std::ops::RangeInclusive<u32> = 0..=1000;
/// Sizes `arena_kib` and `pool_kib` may take (0: none; at most 1 GiB).
pub const DURABLE_KIB_RANGE: std::ops::RangeInclusive<u64> = 0..=1_048_576;
/// Sizes a request log may have, KiB: room for a few of the largest
/// requests and replies at least.
pub const JOURNAL_KIB_RANGE: std::ops::RangeInclusive<u64> = 1024..=4_194_304;
/// The request log's size when `journal_kib` is not given.
pub const DEFAULT_JOURNAL_KIB: u64 = 16 * 1024;

/// The longest watchdog window (the history a component's control block keeps
/// per exit: `kintsugi_runtime::watchdog::HISTORY`).
pub const MAX_WATCH_WINDOW: u32 = 64;

/// Hang detection settings: the `[watchdog]` table. Without the table the
/// watchdog is off; with it, on unless `enabled = false`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WatchdogSettings {
    pub enabled: bool,
    /// How often the monitor samples the components' tables.
    pub period: Duration,
    /// How many measured stretches (or section runs per exit) the adaptive
    /// bound looks back on, 1..=[`MAX_WATCH_WINDOW`].
    pub window: u32,
    /// The bound is `margin` times the window's largest value (at least 1).
    pub margin: f64,
    /// The bound while a window fills.
    pub default_bound: Duration,
    /// The least stretch bound: CPU time is only as fine as the kernel's
    /// accounting (a scheduler tick for a running thread).
    pub floor: Duration,
    /// A thread inside an invocation whose CPU time does not advance for
    /// this long is hung (stopped, never scheduled, waiting for ever).
    pub stuck: Duration,
    /// The least check value of a section (RMK's threshold against check
    /// values learnt from trivial runs).
    pub min_section: Duration,
}

impl Default for WatchdogSettings {
    fn default() -> Self {
        Self {
            enabled: false,
            period: Duration::from_micros(5000),
            window: 50,
            margin: 2.0,
            default_bound: Duration::from_millis(100),
            floor: Duration::from_millis(20),
            stuck: Duration::from_secs(5),
            min_section: Duration::from_millis(5),
        }
    }
}

/// A validated system description.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct System {
    pub name: String,
    pub description: String,
    /// The file it was read from (as given to [`load`] / [`parse`]).
    pub path: PathBuf,
    /// Components in start order: every provider before its users
    /// (topological, and otherwise in file order).
    pub components: Vec<ComponentSpec>,
    /// Hang detection.
    pub watchdog: WatchdogSettings,
    /// Components restarted together (`[[group]]`).
    pub groups: Vec<RestartGroup>,
    /// When the components' waiters spin before they sleep.
    #[serde(default)]
    pub spin: SpinPolicy,
    /// Where the vault is kept on disk (`vault = { dir = … }` in
    /// `[system]`); none: in the supervisor's memory only.
    pub vault: Option<VaultStorage>,
    /// A keeper process that restarts the supervisor when it dies or hangs
    /// (`keeper = { … }` in `[system]`); none: the system ends with it.
    pub keeper: Option<KeeperPolicy>,
    /// Where each component's `binary` value lies in the text, for errors of
    /// [`System::resolve_binaries`].
    #[serde(skip)]
    binary_locations: BTreeMap<String, Location>,
}

/// Components that are restarted together, as OTP's supervisors do: when
/// one of them fails and is rebooted, `one_for_all` restarts every other
/// member too, `rest_for_one` those after it in `members`. For components
/// whose states must agree and that cannot rebuild them from each other.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RestartGroup {
    pub name: String,
    pub members: Vec<String>,
    pub strategy: GroupStrategy,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GroupStrategy {
    OneForAll,
    RestForOne,
}

impl RestartGroup {
    /// The other members to restart when `failed` fails.
    pub fn restarted_with(&self, failed: &str) -> Vec<&str> {
        let Some(at) = self.members.iter().position(|m| m == failed) else {
            return Vec::new();
        };
        self.members
            .iter()
            .enumerate()
            .filter(|(i, _)| match self.strategy {
                GroupStrategy::OneForAll => *i != at,
                GroupStrategy::RestForOne => *i > at,
            })
            .map(|(_, m)| m.as_str())
            .collect()
    }
}

/// One component of a system.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ComponentSpec {
    /// 1-based, in file order.
    pub id: u32,
    pub name: String,
    /// As written by [`parse`]; the resolved path after [`System::resolve_binaries`].
    pub binary: PathBuf,
    pub provides: Vec<String>,
    pub uses: Vec<Use>,
    /// Nice value, in [`PRIORITY_RANGE`].
    pub priority: i32,
    /// SCHED_FIFO priority for its threads where permitted, in [`REALTIME_RANGE`].
    pub realtime: Option<u8>,
    /// The CPUs its processes may run on (`cpus = [0, 1]`, systemd's
    /// `CPUAffinity=`), each in [`CPU_RANGE`] and listed once; empty: any
    /// the supervisor may use.
    pub cpus: Vec<u16>,
    pub recovery: RecoveryMode,
    pub reboot: RebootMode,
    pub restart: RestartPolicy,
    /// Channel slots per client edge, in [`SLOTS_RANGE`].
    pub slots: u32,
    /// KiB of private shared memory that every incarnation maps (0: none),
    /// in [`DURABLE_KIB_RANGE`].
    pub arena_kib: u64,
    /// KiB of shared memory that the component shares with its clients, which
    /// map the pages it grants them (0: none), in [`DURABLE_KIB_RANGE`].
    pub pool_kib: u64,
    /// Incremental checkpoints taken at safe points (none if absent;
    /// always present with [`RecoveryMode::Checkpoint`]).
    pub checkpoint: Option<CheckpointPolicy>,
    /// KiB of durable memory for the request log of
    /// [`RecoveryMode::Checkpoint`] (0 for the other modes), in
    /// [`JOURNAL_KIB_RANGE`].
    pub journal_kib: u64,
    /// The capabilities its processes keep (every other one is dropped
    /// from their bounding set before exec); [`Capability::DEFAULT`] unless
    /// written.
    pub capabilities: Vec<Capability>,
    /// System calls its seccomp filter allows beyond the runtime's list and
    /// what its binary declares (`syscalls = ["name", …]`); never one of
    /// [`NEVER_ALLOWED`].
    #[serde(serialize_with = "syscall_names")]
    pub syscalls: Vec<Sysno>,
    /// The user its processes run as (`user = "name"` or a uid), with no
    /// supplementary group; None: the supervisor's own.
    pub user: Option<User>,
    /// What its vault may hold (`vault_quota = { … }`).
    pub vault_quota: VaultQuota,
    /// Sockets a service manager passes (socket activation), put in its
    /// vault before its first incarnation: vault key → the socket's name
    /// (`LISTEN_FDNAMES`, systemd's `FileDescriptorName=`), from
    /// `sockets = { listen = "http" }`.
    pub sockets: BTreeMap<String, String>,
    /// Its own hang detection settings (`watchdog = { … }`: the system's
    /// `[watchdog]` with the fields written replaced; `enabled = false`
    /// exempts it, `enabled = true` watches it with the system's off);
    /// None: the system's.
    pub watchdog: Option<WatchdogSettings>,
    /// How long an incarnation may take to initialize, and to stop after
    /// SIGTERM before it is killed (`start_timeout_ms`, `stop_timeout_ms`;
    /// None: the supervisor's defaults, 10 s and 20 s).
    pub start_timeout: Option<Duration>,
    pub stop_timeout: Option<Duration>,
    /// Free-form configuration, always a JSON object (`{}` if absent).
    pub config: serde_json::Value,
}

/// A user a component runs as, resolved when the description is read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct User {
    /// Its name in the user database, or the uid written as a number.
    pub name: String,
    pub uid: u32,
    /// Its primary group (a uid the user database does not know: the
    /// group of the same number).
    pub gid: u32,
}

/// The most a component's vault may hold; a request that would take it
/// past one of these is refused whole (the supervisor also keeps a reserve
/// of descriptors of its own, whatever the quotas add up to).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct VaultQuota {
    pub records: u64,
    /// Keys and values, as JSON text.
    pub bytes: u64,
    /// Records holding a descriptor.
    pub fds: u64,
}

impl Default for VaultQuota {
    fn default() -> Self {
        VaultQuota {
            records: 100_000,
            bytes: 64 << 20,
            fds: 4096,
        }
    }
}

/// System calls a description may not allow a component, whatever it
/// says: other processes' memory and tracing, mounts and namespaces, the
/// kernel's modules, keys, clocks, BPF, performance counters, accounting
/// and the machine itself. A component that needs one of these does not
/// belong in a kintsugi system; the supervisor does them for it (the
/// checkpointer's ptrace, for one).
pub const NEVER_ALLOWED: &[Sysno] = &[
    Sysno::ptrace,
    Sysno::process_vm_readv,
    Sysno::process_vm_writev,
    Sysno::kcmp,
    Sysno::mount,
    Sysno::umount2,
    Sysno::pivot_root,
    Sysno::chroot,
    Sysno::setns,
    Sysno::unshare,
    Sysno::open_by_handle_at,
    Sysno::name_to_handle_at,
    Sysno::init_module,
    Sysno::finit_module,
    Sysno::delete_module,
    Sysno::kexec_load,
    Sysno::kexec_file_load,
    Sysno::reboot,
    Sysno::swapon,
    Sysno::swapoff,
    Sysno::bpf,
    Sysno::perf_event_open,
    Sysno::keyctl,
    Sysno::add_key,
    Sysno::request_key,
    Sysno::settimeofday,
    Sysno::clock_settime,
    Sysno::clock_adjtime,
    Sysno::adjtimex,
    Sysno::acct,
    Sysno::quotactl,
    Sysno::syslog,
    Sysno::iopl,
    Sysno::ioperm,
];

/// A Linux capability a component may keep (`capabilities = [...]`).
/// Components run with `no_new_privs` and keep only these, whatever user
/// runs the system.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Capability {
    /// Any priority. Not needed for the priorities the description grants:
    /// a component's `RLIMIT_NICE` and `RLIMIT_RTPRIO` let it take those of
    /// its most urgent caller, and no higher.
    SysNice,
    /// Access to other processes (ptrace, `pidfd_getfd`, their `/proc`
    /// descriptors): netd's keeper needs it.
    SysPtrace,
    /// Binding ports below 1024.
    NetBindService,
    NetAdmin,
    NetRaw,
    /// `mlock` beyond the limit.
    IpcLock,
    /// Raising resource limits.
    SysResource,
}

impl Capability {
    /// What a component keeps unless its description says otherwise.
    pub const DEFAULT: &'static [Capability] = &[];

    /// The capability's number (`linux/capability.h`).
    pub fn number(self) -> u32 {
        match self {
            Capability::NetBindService => 10,
            Capability::NetAdmin => 12,
            Capability::NetRaw => 13,
            Capability::IpcLock => 14,
            Capability::SysPtrace => 19,
            Capability::SysNice => 23,
            Capability::SysResource => 24,
        }
    }
}

/// `checkpoint = { every_ms = …, keep = … }`: the supervisor checkpoints
/// the component every `every` at a safe point, keeping the latest
/// checkpoint in its memory; with `keep` above 0, the `keep` latest are
/// also written to image files in the system's checkpoint directory.
/// When the component has likely written `read_ahead_pages` or more since
/// its latest checkpoint (at the rate it wrote before it), the next one's
/// pages are read ahead while the component runs, and its pause copies
/// only what was written after that.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CheckpointPolicy {
    pub every: Duration,
    pub keep: u32,
    pub on_hang: HangAction,
    pub read_ahead_pages: u64,
}

impl CheckpointPolicy {
    /// Checkpoints every `every`, none kept in files, hangs answered by
    /// `on_hang`, read ahead from [`DEFAULT_READ_AHEAD_PAGES`].
    pub fn every(every: Duration, on_hang: HangAction) -> Self {
        Self {
            every,
            keep: 0,
            on_hang,
            read_ahead_pages: DEFAULT_READ_AHEAD_PAGES,
        }
    }
}

/// What a hang the watchdog finds in a checkpointed component leads to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum HangAction {
    /// A micro-reboot, as for any component.
    #[default]
    Reboot,
    /// TAC's rollback: the live incarnation restored in place from its
    /// latest checkpoint, keeping its pid (a reboot if that fails, or if
    /// it hangs again within a second of a rollback).
    Rollback,
}

impl Serialize for CheckpointPolicy {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut st = s.serialize_struct("CheckpointPolicy", 4)?;
        st.serialize_field("every_ms", &(self.every.as_millis() as u64))?;
        st.serialize_field("keep", &self.keep)?;
        st.serialize_field("on_hang", &self.on_hang)?;
        st.serialize_field("read_ahead_pages", &self.read_ahead_pages)?;
        st.end()
    }
}

/// A dependency of a component on an interface of another.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
pub struct Use {
    pub interface: String,
    /// The providing component's name.
    pub server: String,
}

impl fmt::Display for Use {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@{}", self.interface, self.server)
    }
}

/// When a thread waiting for a call's reply (or a server slot waiting for a
/// request) spins before it sleeps on its futex.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SpinPolicy {
    /// Up to the spin budget, always: fastest for a few components on
    /// idle CPUs.
    #[default]
    Always,
    /// Not while more threads are runnable than there are CPUs, when the
    /// spin would only take CPU time from the thread waited for.
    UnlessOversubscribed,
    /// Where it has been paying, per waiting site of each thread: after a
    /// spin that caught nothing, the site sleeps at once for a while.
    Adaptive,
}

/// A vault persisted to a directory: its records (and the files it made
/// for its components) outlive the supervisor and the machine.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VaultStorage {
    /// Absolute, or relative to the system file's directory as written.
    pub dir: PathBuf,
    pub fsync: FsyncPolicy,
}

/// How the keeper watches the supervisor (`[system] keeper = { hang_ms,
/// max, window_ms }`): a supervisor whose event loop has not turned for
/// `hang` is killed, and one that dies is started again, up to `max` times
/// within `window`; past that the keeper gives up and the system ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct KeeperPolicy {
    pub hang: Duration,
    pub max: u32,
    pub window: Duration,
}

impl Default for KeeperPolicy {
    fn default() -> Self {
        Self {
            hang: Duration::from_millis(1000),
            max: 100,
            window: Duration::from_secs(10),
        }
    }
}

/// When the vault's log reaches the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FsyncPolicy {
    /// Before each request is answered: what a component was told is kept
    /// survives a crash of the machine.
    #[default]
    Always,
    /// Left to the kernel's writeback: survives any process's crash (the
    /// page cache keeps it), not the machine's.
    Never,
}

/// How a crashed server's state comes back for its clients.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RecoveryMode {
    /// A micro-reboot; the clients' stubs rebuild descriptors lazily, in
    /// the client thread that next touches one.
    #[default]
    OnDemand,
    /// A micro-reboot; the clients rebuild every descriptor at once.
    Eager,
    /// The last checkpoint restored and the requests served since
    /// replayed from a log in durable memory: the state comes back whole,
    /// with no recovery code in the server and nothing for the clients to
    /// rebuild.
    Checkpoint,
}

impl RecoveryMode {
    pub fn as_str(self) -> &'static str {
        match self {
            RecoveryMode::OnDemand => "on-demand",
            RecoveryMode::Eager => "eager",
            RecoveryMode::Checkpoint => "checkpoint",
        }
    }
}

impl fmt::Display for RecoveryMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where a micro-rebooted component comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RebootMode {
    /// A warm standby forked from the pristine image, ready to take over.
    #[default]
    Standby,
    /// Fork the pristine image on demand.
    Fork,
    /// Cold start from disk (for comparison).
    Exec,
}

impl RebootMode {
    pub fn as_str(self) -> &'static str {
        match self {
            RebootMode::Standby => "standby",
            RebootMode::Fork => "fork",
            RebootMode::Exec => "exec",
        }
    }
}

impl fmt::Display for RebootMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// At most `max` restarts within any `window`, else give up (OTP
/// intensity/period), then `on_give_up`; and a growing delay before the
/// restart of a component that keeps failing the same way (`backoff`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RestartPolicy {
    pub max: u32,
    pub window: Duration,
    /// Which ends are restarted (OTP's restart types).
    pub kind: RestartType,
    pub on_give_up: GiveUpAction,
    /// None: every restart is immediate.
    pub backoff: Option<Backoff>,
}

impl RestartPolicy {
    pub const DEFAULT_MAX: u32 = 5;
    pub const DEFAULT_WINDOW: Duration = Duration::from_millis(1000);
}

impl Default for RestartPolicy {
    fn default() -> Self {
        RestartPolicy {
            max: Self::DEFAULT_MAX,
            window: Self::DEFAULT_WINDOW,
            kind: RestartType::default(),
            on_give_up: GiveUpAction::default(),
            backoff: Some(Backoff::default()),
        }
    }
}

impl Serialize for RestartPolicy {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut st = s.serialize_struct("RestartPolicy", 5)?;
        st.serialize_field("max", &self.max)?;
        st.serialize_field("window_ms", &(self.window.as_millis() as u64))?;
        st.serialize_field("type", &self.kind)?;
        st.serialize_field("on_give_up", &self.on_give_up)?;
        st.serialize_field("backoff", &self.backoff)?;
        st.end()
    }
}

/// Which ends of a component's incarnation are followed by a restart, as
/// OTP's child specifications say.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RestartType {
    /// Every end, a clean exit (code 0) too.
    Permanent,
    /// Every end but a clean exit, which retires it.
    #[default]
    Transient,
    /// None: its first failure leaves it failed, and the rest runs on.
    Temporary,
}

/// What giving up on a component does to the rest of the system.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum GiveUpAction {
    /// Stop the whole system (OTP's default: the supervisor fails).
    #[default]
    Stop,
    /// Leave that component failed, its clients' calls to it failing with
    /// an error, and the rest running.
    Isolate,
}

/// Delays before restarting a component that fails the same way again
/// and again, as systemd's `RestartSec`, `RestartSteps` and
/// `RestartMaxDelaySec` do: after `after` such failures in a row, each
/// restart waits `first`, then twice as long each time, at most `max`.
/// "The same way" is the same exit code, or an abort at the same place
/// (a panic's file and line); a signal from outside (SIGKILL, or the
/// fault signals an injector sends) never counts, since the supervisor
/// cannot tell a deterministic one from an injected one. An incarnation
/// that stays up `healthy` ends the series.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct Backoff {
    pub after: u32,
    #[serde(rename = "first_ms", serialize_with = "millis")]
    pub first: Duration,
    #[serde(rename = "max_ms", serialize_with = "millis")]
    pub max: Duration,
    #[serde(rename = "healthy_ms", serialize_with = "millis")]
    pub healthy: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            after: 3,
            first: Duration::from_millis(10),
            max: Duration::from_millis(1000),
            healthy: Duration::from_millis(1000),
        }
    }
}

impl Backoff {
    /// The delay before the restart that follows `streak` same-way
    /// failures in a row (zero while `streak <= after`).
    pub fn delay(&self, streak: u32) -> Duration {
        match streak.checked_sub(self.after + 1) {
            None => Duration::ZERO,
            Some(n) => self
                .first
                .checked_mul(1u32 << n.min(30))
                .unwrap_or(self.max)
                .min(self.max),
        }
    }
}

fn syscall_names<S: serde::Serializer>(calls: &[Sysno], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(calls.iter().map(Sysno::name))
}

fn millis<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u64(d.as_millis() as u64)
}

impl ComponentSpec {
    /// Sets (or overrides) top-level key `key` of the component's config.
    pub fn set_config(&mut self, key: &str, value: serde_json::Value) {
        if !self.config.is_object() {
            self.config = serde_json::Value::Object(serde_json::Map::new());
        }
        if let serde_json::Value::Object(map) = &mut self.config {
            map.insert(key.to_owned(), value);
        }
    }

    /// Overrides the restart policy.
    pub fn set_restart(&mut self, max: u32, window: Duration) {
        self.restart.max = max;
        self.restart.window = window;
    }

    /// The component providing `interface` to this one, if it uses it.
    pub fn server_of(&self, interface: &str) -> Option<&str> {
        self.uses
            .iter()
            .find(|u| u.interface == interface)
            .map(|u| u.server.as_str())
    }

    /// The config as a JSON string, as handed to the component.
    pub fn config_json(&self) -> String {
        self.config.to_string()
    }
}

impl System {
    /// The component called `name`.
    pub fn component(&self, name: &str) -> Option<&ComponentSpec> {
        self.components.iter().find(|c| c.name == name)
    }

    /// The hang detection settings of component `name`: its own, else the
    /// system's.
    pub fn watchdog_of(&self, name: &str) -> &WatchdogSettings {
        self.component(name)
            .and_then(|c| c.watchdog.as_ref())
            .unwrap_or(&self.watchdog)
    }

    /// Whether any component is watched for hangs.
    pub fn watched(&self) -> bool {
        self.components
            .iter()
            .any(|c| self.watchdog_of(&c.name).enabled)
    }

    /// The component called `name`, mutably (to override its config or restart policy).
    pub fn component_mut(&mut self, name: &str) -> Option<&mut ComponentSpec> {
        self.components.iter_mut().find(|c| c.name == name)
    }

    /// Restarts every component whatever the number of its faults (for
    /// benchmarks and campaigns, which cause faults on purpose).
    pub fn restart_always(&mut self) {
        for c in &mut self.components {
            c.set_restart(u32::MAX, Duration::from_secs(1));
            c.restart.backoff = None;
        }
    }

    /// The component with id `id`.
    pub fn component_by_id(&self, id: u32) -> Option<&ComponentSpec> {
        self.components.iter().find(|c| c.id == id)
    }

    /// The components that provide `interface`, in start order.
    pub fn providers(&self, interface: &str) -> impl Iterator<Item = &ComponentSpec> {
        let interface = interface.to_owned();
        self.components
            .iter()
            .filter(move |c| c.provides.contains(&interface))
    }

    /// The components that use some interface of `server`, in start order.
    pub fn clients_of<'a>(&'a self, server: &'a str) -> impl Iterator<Item = &'a ComponentSpec> {
        self.components
            .iter()
            .filter(move |c| c.uses.iter().any(|u| u.server == server))
    }

    /// Replaces each component's `binary` by the path of the executable it names.
    ///
    /// A binary containing `/` is a path, relative to the directory of the
    /// system description's file; any other is looked for in `search_dirs`, in
    /// order. Stops at the first component whose binary cannot be found.
    pub fn resolve_binaries(&mut self, search_dirs: &[PathBuf]) -> Result<(), SystemError> {
        let base = match self.path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let mut resolved = Vec::with_capacity(self.components.len());
        for c in &self.components {
            resolved.push(self.resolve_one(c, &base, search_dirs)?);
        }
        for (c, bin) in self.components.iter_mut().zip(resolved) {
            c.binary = bin;
        }
        Ok(())
    }

    fn resolve_one(
        &self,
        c: &ComponentSpec,
        base: &Path,
        search_dirs: &[PathBuf],
    ) -> Result<PathBuf, SystemError> {
        let err = |kind, message: String| SystemError::Invalid {
            path: self.path.clone(),
            location: self.binary_locations.get(&c.name).copied(),
            kind,
            message,
        };
        let written = c.binary.display().to_string();
        let is_path = c.binary.as_os_str().as_encoded_bytes().contains(&b'/');
        let candidates: Vec<(PathBuf, PathBuf)> = if is_path {
            let p = base.join(&c.binary); // join keeps an absolute binary as is
            let dir = p
                .parent()
                .map_or_else(|| PathBuf::from("/"), Path::to_path_buf);
            vec![(dir, p)]
        } else {
            search_dirs
                .iter()
                .map(|d| (d.clone(), d.join(&c.binary)))
                .collect()
        };
        let mut not_executable = None;
        for (_, p) in &candidates {
            match std::fs::metadata(p) {
                Ok(m) if m.is_file() && m.permissions().mode() & 0o111 != 0 => return Ok(p.clone()),
                Ok(m) if m.is_file() => {
                    not_executable.get_or_insert_with(|| p.clone());
                }
                _ => {}
            }
        }
        if let Some(p) = not_executable {
            return Err(err(
                ErrorKind::BinaryNotExecutable,
                format!(
                    "component `{}`: binary `{written}` found at {} but it is not executable",
                    c.name,
                    p.display()
                ),
            ));
        }
        let looked = if candidates.is_empty() {
            "no search directories given".to_owned()
        } else {
            candidates
                .iter()
                .map(|(d, _)| d.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        };
        Err(err(
            ErrorKind::BinaryNotFound,
            format!(
                "component `{}`: binary `{written}` not found (looked in: {looked})",
                c.name
            ),
        ))
    }
}

/// Reads, validates and resolves the binaries of the system description at `path`.
pub fn load(path: &Path, search_dirs: &[PathBuf]) -> Result<System, SystemError> {
    let text = std::fs::read_to_string(path).map_err(|source| SystemError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let mut system = parse(path, &text)?;
    system.resolve_binaries(search_dirs)?;
    Ok(system)
}

/// Where component binaries are looked for by default: next to the running
/// executable (and its parent folder, for test binaries in `target/*/deps`),
/// then `$PATH`.
pub fn search_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Ok(exe) = std::env::current_exe() {
        if let Some(d) = exe.parent() {
            dirs.push(d.to_path_buf());
            if let Some(p) = d.parent() {
                dirs.push(p.to_path_buf());
            }
        }
    }
    if let Some(path) = std::env::var_os("PATH") {
        dirs.extend(std::env::split_paths(&path));
    }
    dirs
}

/// Validates a system description built into a program (`name` stands for
/// its path in errors) and resolves its binaries in [`search_dirs`].
pub fn parse_builtin(name: &str, text: &str) -> Result<System, SystemError> {
    let mut system = parse(Path::new(name), text)?;
    system.resolve_binaries(&search_dirs())?;
    Ok(system)
}

/// Validates the system description `text` (read from `path`, used in errors
/// and to resolve relative binaries later). Binaries are kept as written.
pub fn parse(path: &Path, text: &str) -> Result<System, SystemError> {
    parse::parse(path, text)
}

//! The keeper (issue 17): a small parent that restarts the supervisor when
//! it dies or hangs, and holds what the supervisor held meanwhile. Minix
//! 3's reincarnation server and OSIRIS recover their own recovery server;
//! systemd re-executes itself and keeps services' descriptors in its
//! fdstore. Here `kintsugi run` of a system with `[system] keeper = { … }`
//! stays a single-threaded process that forks the supervisor sharing its
//! descriptor table (`CLONE_FILES`): every descriptor the supervisor opens
//! (listeners, connections, the vault's memfds and files) is the keeper's
//! too, and survives it. The vault logs, beside each record, the number
//! and identity of the descriptor it holds (`vault/disk.rs`, in a private
//! directory when the system names none); the next supervisor inherits the
//! table, takes back what the log names and closes the rest.
//!
//! What a supervisor's death costs: the components die with it (their
//! parent-death signal) and start again under the next one, from their
//! vault, as after a crash of each (NewtOS's restart of everything above
//! the storage server). Connections in netd's vault, ramfs's files and
//! every other record carry on; a listener never closes, so new
//! connections wait in its backlog. Hangs are found by a heartbeat: the
//! supervisor's event loop counts its turns, a thread copies the count to
//! a page shared with the keeper, and the loop turns at least four times
//! per `hang_ms`; a count that has not moved for `hang_ms` gets the
//! supervisor SIGKILLed and restarted. The thread stops copying when
//! another serving thread (a vault thread, the output relay) has not
//! turned for half of `hang_ms` (a bit flipped in its loop: its
//! components would wait on it for ever while the loop turns); a panic in
//! any thread aborts the supervisor. While the supervisor starts its
//! system (before its loop first turns) the thread ticks a second count
//! instead: a stopped process is found then too, but a start stuck in
//! itself only by the start's own ready timeouts.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use kintsugi_runtime::abi::shm::{Mapping, Region};
use kintsugi_supervisor::{Inherited, Roster, Stalls};
use kintsugi_system::{FsyncPolicy, KeeperPolicy, System, VaultStorage};
use rustix::process::{Pid, Signal, WaitOptions, WaitStatus};

/// How often the keeper looks at the supervisor: its death is seen
/// within this (the keeper opens no descriptor, which would land in the
/// shared table, so it polls rather than waits on a pidfd).
const TICK: Duration = Duration::from_millis(2);

/// How long the dead supervisor's processes get to die of their
/// parent-death signal before the keeper kills them.
const ORPHANS_DIE: Duration = Duration::from_secs(2);

/// How long a supervisor just forked may show no sign of life at all.
const FIRST_SIGN: Duration = Duration::from_secs(10);

/// A panic in the supervisor's main thread exits with this code.
const PANICKED: i32 = 101;

/// A supervisor that returned an error exits with this code (as
/// `kintsugi` does).
const ERROR: i32 = 2;

/// The page the supervisor's loop count is copied to, shared with the
/// keeper (mapped before the fork; no descriptor of it stays open).
#[derive(Clone)]
pub struct Beat(Arc<Mapping>);

impl Beat {
    fn new() -> anyhow::Result<Self> {
        let region = Region::create("kintsugi-keeper-beat", 16)?;
        Ok(Self(Arc::new(region.map_range(0, region.len())?)))
    }

    /// The event loop's turns.
    fn turns(&self) -> &AtomicU64 {
        self.0.at::<AtomicU64>(0)
    }

    /// Ticks of a supervisor whose loop has not turned yet.
    fn starting(&self) -> &AtomicU64 {
        self.0.at::<AtomicU64>(8)
    }

    fn read(&self) -> (u64, u64) {
        (
            self.turns().load(Ordering::Relaxed),
            self.starting().load(Ordering::Relaxed),
        )
    }

    fn clear(&self) {
        self.turns().store(0, Ordering::Relaxed);
        self.starting().store(0, Ordering::Relaxed);
    }
}

/// In the supervisor: copies its event loop's turn count into the beat
/// page twice per `heartbeat` (a stalled loop stops the count; so does a
/// stopped process), unless one of its other serving threads (a vault
/// thread, the output relay: each turns at least once per `heartbeat`)
/// has not turned for two heartbeats: then it stops copying, so that the
/// keeper finds the supervisor hung.
pub struct Pinger {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Pinger {
    pub fn start(beat: Beat, roster: Arc<Roster>, heartbeat: Duration) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("keeper-beat".into())
            .spawn(move || {
                let mut stalls = Stalls::default();
                while !flag.load(Ordering::Relaxed) {
                    let turns = roster.loop_turns();
                    let counts = roster.thread_turn_counts();
                    if !stalls.stalled(counts, heartbeat * 2, "the beat stops") {
                        beat.turns().store(turns, Ordering::Relaxed);
                        if turns == 0 {
                            beat.starting().fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    std::thread::sleep(heartbeat / 2);
                }
            })
            .ok();
        Self { stop, thread }
    }
}

impl Drop for Pinger {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What a supervisor is given by its keeper.
pub struct Kept {
    /// What it inherited from the one before (nothing for the first).
    pub inherited: Inherited,
    pub beat: Beat,
    /// How often its loop must turn.
    pub heartbeat: Duration,
    pub generation: u32,
}

/// How a supervisor ended, as its keeper saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ended {
    /// It exited by itself with this code.
    Exited(i32),
    /// A signal killed it.
    Killed(i32),
    /// Its loop stopped turning; the keeper killed it.
    Hung,
}

impl Ended {
    /// Whether the keeper starts another: after a crash or a hang; not
    /// after an exit the supervisor chose (a stop, a system given up), nor
    /// after an error of a system that never started (a bad description,
    /// a binary missing), but after an error once it had (`started`: this
    /// supervisor's loop turned, or an earlier one's did): a start the
    /// dead one's leftovers upset, or a fault (a flipped bit) that made a
    /// call fail.
    fn restarts(self, started: bool) -> bool {
        match self {
            Ended::Exited(code) if code == ERROR => started,
            Ended::Exited(code) => code == PANICKED,
            Ended::Killed(_) | Ended::Hung => true,
        }
    }
}

impl std::fmt::Display for Ended {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Ended::Exited(code) => write!(f, "exited with code {code}"),
            Ended::Killed(sig) => write!(f, "was killed by signal {sig}"),
            Ended::Hung => write!(f, "hung (its loop did not turn) and was killed"),
        }
    }
}

/// Runs `supervise` (a whole supervisor: start the system, run it, stop
/// it) in a child process sharing this one's descriptors, again each time
/// it dies or hangs, as `policy` allows; the result is the last one's. The
/// vault is kept in a private directory removed at the end if `system`
/// names none.
pub fn keep(
    system: &mut System,
    policy: KeeperPolicy,
    supervise: impl Fn(&System, Kept) -> anyhow::Result<bool>,
) -> anyhow::Result<bool> {
    let me = rustix::process::getpid();
    let made = match system.vault {
        Some(_) => None,
        None => {
            let dir = crate::roster::private_dir()?.join(format!(
                "{}.vault-{}",
                system.name,
                me.as_raw_nonzero()
            ));
            system.vault = Some(VaultStorage {
                dir: dir.clone(),
                fsync: FsyncPolicy::Never,
            });
            Some(dir)
        }
    };
    let _removed = made.map(RemoveOnDrop);
    rustix::process::set_child_subreaper(Some(me)).context("PR_SET_CHILD_SUBREAPER")?;
    let beat = Beat::new()?;
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, stop.clone())?;
    }
    let heartbeat = policy.hang / 4;
    let mut deaths: VecDeque<Instant> = VecDeque::new();
    for generation in 0.. {
        let Some(pid) = kintsugi_runtime::process::fork_sharing_descriptors()? else {
            supervisor(system, generation, beat.clone(), heartbeat, &supervise);
        };
        let pid = Pid::from_raw(pid as i32).context("fork returned pid 0")?;
        beat.clear();
        let ended = watch(pid, &beat, policy.hang, &stop);
        let started = Instant::now();
        // Its loop turned: its system had started.
        let turned = beat.read().0 > 0;
        reap_orphans();
        if !ended.restarts(generation > 0 || turned) || stop.load(Ordering::Relaxed) {
            return Ok(ended == Ended::Exited(0));
        }
        let now = Instant::now();
        deaths.push_back(now);
        while deaths
            .front()
            .is_some_and(|&d| now.duration_since(d) > policy.window)
        {
            deaths.pop_front();
        }
        if deaths.len() > policy.max as usize {
            anyhow::bail!(
                "the supervisor (pid {pid}) {ended}: {} deaths within {} ms, more than the keeper's max = {}; giving up",
                deaths.len(),
                policy.window.as_millis(),
                policy.max
            );
        }
        tracing::warn!(
            "keeper: the supervisor (pid {pid}, generation {generation}) {ended}; its processes were gone {} µs later; starting generation {}",
            started.elapsed().as_micros(),
            generation + 1
        );
    }
    unreachable!("generations are unbounded")
}

/// The supervisor just forked, of `generation`: takes what it inherits,
/// runs `supervise`, and exits with its result as `kintsugi` would.
fn supervisor(
    system: &System,
    generation: u32,
    beat: Beat,
    heartbeat: Duration,
    supervise: &impl Fn(&System, Kept) -> anyhow::Result<bool>,
) -> ! {
    // A fault signal kills it, however it came (Rust's handler would let
    // a SIGSEGV sent by `kill` pass): the keeper is there. So does a panic
    // in any thread: a supervisor missing a thread (a vault's) would go on
    // and fail its components.
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        report(info);
        std::process::abort();
    }));
    let result = kintsugi_runtime::process::default_fault_signals()
        .map_err(anyhow::Error::from)
        .and_then(|()| inherit(system, generation))
        .and_then(|inherited| {
            let kept = Kept {
                inherited,
                beat,
                heartbeat,
                generation,
            };
            supervise(system, kept)
        });
    let code = match result {
        Ok(true) => 0,
        Ok(false) => 1,
        Err(e) => {
            eprintln!("error: {e:#}");
            ERROR
        }
    };
    std::process::exit(code);
}

/// In a supervisor just forked: what it inherits. The first takes nothing
/// (and finds socket activation's descriptors as if it were the process
/// the service manager started); a later one claims the whole shared
/// table and closes what its vault's records do not name, before it opens
/// anything of its own.
fn inherit(system: &System, generation: u32) -> anyhow::Result<Inherited> {
    let keeper = rustix::process::getppid().map_or(0, |p| p.as_raw_nonzero().get());
    if generation == 0 {
        // Socket activation names the keeper; the supervisor claims.
        if std::env::var("LISTEN_PID").is_ok_and(|p| p == keeper.to_string()) {
            let me = rustix::process::getpid().as_raw_nonzero().get();
            std::env::set_var("LISTEN_PID", me.to_string());
        }
        return Ok(Inherited::first());
    }
    // The first supervisor put what was passed in its vault.
    for var in ["LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"] {
        std::env::remove_var(var);
    }
    let mut inherited = Inherited::claim()?;
    if let Some(storage) = &system.vault {
        inherited.retain_vault_records(storage);
    }
    Ok(inherited)
}

/// Waits for the supervisor `pid` to end, passing on a stop asked of the
/// keeper (SIGINT, SIGTERM) and killing it if its beat stays put for
/// `hang` (for [`FIRST_SIGN`] before its first). Other children (processes
/// the dead supervisor left) are reaped on the way.
fn watch(pid: Pid, beat: &Beat, hang: Duration, stop: &AtomicBool) -> Ended {
    let mut passed_on = false;
    let mut seen = ((0, 0), Instant::now());
    let mut hung = false;
    loop {
        match rustix::process::wait(WaitOptions::NOHANG) {
            Ok(Some((p, status))) if p == pid => {
                return match (hung, status) {
                    (true, _) => Ended::Hung,
                    (false, s) => ended(s),
                };
            }
            Ok(Some(_)) => continue,
            Ok(None) => {}
            Err(e) => {
                tracing::error!("keeper: waitpid: {e}");
                return Ended::Killed(0);
            }
        }
        if stop.load(Ordering::Relaxed) && !passed_on {
            let _ = rustix::process::kill_process(pid, Signal::TERM);
            passed_on = true;
        }
        let count = beat.read();
        let bound = if count == (0, 0) { FIRST_SIGN } else { hang };
        if count != seen.0 {
            seen = (count, Instant::now());
        } else if !hung && !passed_on && seen.1.elapsed() >= bound {
            let _ = rustix::process::kill_process(pid, Signal::KILL);
            hung = true;
        }
        std::thread::sleep(TICK);
    }
}

fn ended(status: WaitStatus) -> Ended {
    match (status.exit_status(), status.terminating_signal()) {
        (Some(code), _) => Ended::Exited(code),
        (None, Some(sig)) => Ended::Killed(sig),
        (None, None) => Ended::Killed(0),
    }
}

/// Reaps every child left (the dead supervisor's processes, which the
/// kernel handed to the keeper, a subreaper), killing those that outlive
/// [`ORPHANS_DIE`]; returns once there are none, so that no incarnation
/// of the old system runs beside the new one.
fn reap_orphans() {
    let deadline = Instant::now() + ORPHANS_DIE;
    loop {
        match rustix::process::wait(WaitOptions::NOHANG) {
            Ok(Some(_)) => continue,
            Ok(None) => {}
            Err(_) => return, // ECHILD: none left
        }
        if Instant::now() >= deadline {
            for child in children() {
                let _ = rustix::process::kill_process(child, Signal::KILL);
            }
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// This process's children, as the kernel lists them.
fn children() -> Vec<Pid> {
    let me = rustix::process::getpid().as_raw_nonzero();
    std::fs::read_to_string(format!("/proc/{me}/task/{me}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| Pid::from_raw(p.parse().ok()?))
        .collect()
}

/// A directory removed (with what it holds) when dropped.
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::{Ended, ERROR, PANICKED};

    #[test]
    fn a_crash_or_a_hang_restarts_a_chosen_exit_does_not_and_an_error_after_a_start_does() {
        for started in [false, true] {
            assert!(Ended::Killed(9).restarts(started));
            assert!(Ended::Hung.restarts(started));
            assert!(Ended::Exited(PANICKED).restarts(started));
            assert!(!Ended::Exited(0).restarts(started), "a stop");
            assert!(!Ended::Exited(1).restarts(started), "a system given up");
        }
        assert!(!Ended::Exited(ERROR).restarts(false), "a bad description");
        assert!(Ended::Exited(ERROR).restarts(true));
    }
}

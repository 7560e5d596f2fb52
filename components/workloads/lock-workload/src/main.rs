//! lock-workload: its threads contend for one named lock, shared with every
//! other component that names it. Each round a thread takes the lock, notes
//! the CLOCK_MONOTONIC instants at which its critical section begins and
//! ends around a short random busy time, releases the lock and pauses for a
//! random moment; a thread that enters while another thread of this
//! component is inside counts a violation (`corrupt`) on the spot. It
//! publishes the counters `ops` (rounds), `errors` and `corrupt`. After
//! its `rounds` (a stop request does not cut a run short, so that a
//! finished run tells a stuck one apart; `rounds = 0` runs until stopped,
//! for campaigns) it writes every
//! critical section to the file `sections` names, if any (a checker merging
//! the files of all components finds any two sections that overlapped: a
//! file, because several components' reports that large would interleave on
//! a shared stdout), and prints a JSON report of its counts. With `lease`
//! its threads take the lock by lease (`kintsugi_interfaces::lock_lease`):
//! among themselves without calls, while no other component wants it.

#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use kintsugi_interfaces::lock;
use kintsugi_interfaces::lock_lease::{Leased, Leases};
use kintsugi_runtime::counters::{Failures, WorkloadCounters};
use kintsugi_runtime::{Incarnation, Sysno};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub seed: u64,
    /// Client threads, each on its own channel slot (so each a lock owner).
    pub threads: usize,
    /// Critical sections per thread (0: until stopped).
    pub rounds: u64,
    /// The lock's name: every component that names it shares it.
    pub lock: u64,
    /// Longest busy time inside a critical section, in µs (drawn from 0..=busy_us).
    pub busy_us: u64,
    /// Longest pause between rounds, in µs (drawn from 0..=think_us).
    pub think_us: u64,
    /// Where to write the critical sections, as a JSON array of
    /// `[enter_ns, exit_ns]` (replaced atomically at the end of a run).
    pub sections: Option<PathBuf>,
    /// Take the lock by lease rather than by a call per take and release.
    pub lease: bool,
    /// After its rounds, take the lock once more and end holding it: its
    /// server must hear of the exit to free the lock for the others.
    pub keep_at_exit: bool,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            seed: 1,
            threads: 2,
            rounds: 1000,
            lock: 1,
            busy_us: 20,
            think_us: 200,
            sections: None,
            lease: false,
            keep_at_exit: false,
        }
    }
}

#[derive(Debug, Default, Serialize)]
struct Report {
    component: String,
    seed: u64,
    threads: usize,
    rounds: u64,
    /// Rounds each thread completed: the lock taken and released.
    completed: Vec<u64>,
    /// Calls that failed, and (`corrupt`) critical sections entered while
    /// another thread of this component was inside.
    #[serde(flatten)]
    failures: Failures,
    /// Critical sections, all threads together.
    sections: usize,
    /// With `lease`: how often the lock server asked for the lease back.
    given_back: u64,
}

/// What one thread did.
#[derive(Default)]
struct Run {
    completed: u64,
    failures: Failures,
    sections: Vec<[u64; 2]>,
}

/// CLOCK_MONOTONIC in nanoseconds: one clock for every process.
fn now_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

/// What the threads of one component share while they contend.
struct Shared<'a> {
    /// Threads of this component inside the critical section.
    inside: AtomicU32,
    counters: WorkloadCounters<'a>,
    stop: &'a (dyn Fn() -> bool + Sync),
}

/// How the threads take the lock.
#[derive(Clone, Copy)]
enum Taking<'a> {
    /// A call to take, a call to release.
    Calls(&'a lock::Client, lock::Lock),
    Lease(&'a Leased),
}

impl Taking<'_> {
    /// Runs `section` holding the lock.
    fn holding(self, section: impl FnOnce()) -> Result<(), String> {
        match self {
            Taking::Calls(client, l) => {
                client.take(l).map_err(|e| format!("take: {e}"))?;
                section();
                client.release(l).map_err(|e| format!("release: {e}"))
            }
            Taking::Lease(leased) => {
                let held = leased.take().map_err(|e| format!("lease: {e}"))?;
                section();
                drop(held);
                Ok(())
            }
        }
    }
}

fn contend(taking: Taking<'_>, config: &Config, thread: usize, shared: &Shared) -> Run {
    let mut rng = StdRng::seed_from_u64(
        config
            .seed
            .wrapping_mul(1_000_003)
            .wrapping_add(thread as u64),
    );
    let mut run = Run::default();
    let mut seen = [0; 2];
    let mut round = 0;
    while round < config.rounds || (config.rounds == 0 && !(shared.stop)()) {
        round += 1;
        shared.counters.publish(&mut seen, &run.failures);
        let mut corrupt = false;
        let done = taking.holding(|| {
            corrupt = shared.inside.fetch_add(1, Ordering::SeqCst) != 0;
            let enter = now_ns();
            let until = enter + rng.gen_range(0..=config.busy_us) * 1000;
            while now_ns() < until {
                std::hint::spin_loop();
            }
            run.sections.push([enter, now_ns()]);
            shared.inside.fetch_sub(1, Ordering::SeqCst);
        });
        if corrupt {
            run.failures.corrupt(format!(
                "thread {thread} round {round}: took the lock while another thread held it"
            ));
        }
        match done {
            Ok(()) => {
                run.completed += 1;
                shared.counters.op();
            }
            Err(e) => run
                .failures
                .error(format!("thread {thread} round {round}: {e}")),
        }
        if config.think_us > 0 {
            std::thread::sleep(Duration::from_micros(rng.gen_range(0..=config.think_us)));
        }
    }
    shared.counters.publish(&mut seen, &run.failures);
    run
}

/// Writes `sections` to `path` through a temporary file, so that the file
/// is whole or absent even if this incarnation dies meanwhile.
fn write_sections(path: &Path, sections: &[[u64; 2]]) -> anyhow::Result<()> {
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    std::fs::write(&tmp, serde_json::to_vec(sections)?)?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

fn main() {
    // Its report file is written whole, then renamed into place.
    kintsugi_runtime::run_allowing(&[Sysno::openat, Sysno::rename], |rt| {
        let config: Config = rt.config()?;
        let client = lock::Client::connect(rt)?;
        let component = rt.name().to_string();
        let rt = rt.clone();
        Ok(Incarnation::main(move || {
            let stop = || rt.stop_requested();
            let shared = Shared {
                inside: AtomicU32::new(0),
                counters: rt.workload_counters()?,
                stop: &stop,
            };
            let threads = config.threads.max(1);
            tracing::info!(
                seed = config.seed,
                threads,
                rounds = config.rounds,
                "lock-workload starting"
            );
            let l = client.alloc(config.lock)?;
            let (leases, leased);
            let taking = if config.lease {
                leases = Leases::new(lock::Client::from_connection(client.connection().clone()))?;
                leased = leases.lease(l);
                Taking::Lease(&leased)
            } else {
                Taking::Calls(&client, l)
            };
            let runs: Vec<Run> = std::thread::scope(|s| {
                let handles: Vec<_> = (0..threads)
                    .map(|t| {
                        let (config, shared) = (&config, &shared);
                        s.spawn(move || contend(taking, config, t, shared))
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().expect("lock-workload thread panicked"))
                    .collect()
            });
            let mut report = Report {
                component,
                seed: config.seed,
                threads,
                rounds: config.rounds,
                ..Default::default()
            };
            let mut sections = Vec::new();
            for run in runs {
                report.completed.push(run.completed);
                report.failures.merge(run.failures);
                sections.extend(run.sections);
            }
            report.sections = sections.len();
            if let Taking::Lease(leased) = taking {
                report.given_back = leased.given_back();
            }
            if let Some(path) = &config.sections {
                write_sections(path, &sections)?;
            }
            if config.keep_at_exit {
                client.take(l)?;
            }
            println!("{}", serde_json::to_string(&report)?);
            Ok(report.failures.check()?)
        }))
    })
}

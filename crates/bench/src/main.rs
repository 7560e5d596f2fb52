//! `kintsugi-bench`, run as `kintsugi bench …`: each benchmark measures
//! kintsugi and a baseline in the same run and prints a markdown table with
//! ratios and percentiles with their sample counts. The benchmarks, their
//! plots and progress bars live in this binary, out of the product's
//! `kintsugi`, which only hands `kintsugi bench …` over to it.

#![forbid(unsafe_code)]

mod checkpoint;
mod idle;
mod json;
mod kv;
mod kv_log;
mod load;
mod recovery;
mod tables;
mod vault;
mod watchdog;
mod web;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use kintsugi_interfaces::bench::{self, Error};
use kintsugi_runtime::abi::channel::Edge;
use kintsugi_runtime::server::SlotWorker;
use kintsugi_runtime::{futex, process, Caller};
use kintsugi_supervisor::stats::Summary;
use kintsugi_supervisor::{ChaosPlan, Event, Options};
use kintsugi_system::RebootMode;
use rustix::process::{Pid, Signal};

const BENCH_SYSTEM: &str = include_str!("../../../systems/bench.toml");
const RECOVERY_SYSTEM: &str = include_str!("../../../systems/bench-recovery.toml");

#[derive(Parser)]
#[command(
    name = "kintsugi bench",
    bin_name = "kintsugi bench",
    version,
    about = "kintsugi's benchmarks (build with --release)"
)]
struct Cli {
    /// Print each table as one JSON object a line (columns, and rows keyed
    /// by column; numbers as numbers) instead of markdown.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    bench: Bench,
}

#[derive(Subcommand)]
enum Bench {
    /// Null-invocation round trip between two processes, against a Unix
    /// socket and a pipe round trip.
    Ipc {
        #[arg(long, default_value_t = 200_000)]
        iterations: usize,
    },
    /// Micro-reboot time (warm standby, fork on demand) against fork+exec,
    /// with a small and a 256 MiB heap; and the cost of rebuilding a descriptor.
    Reboot {
        /// Reboots measured per configuration.
        #[arg(long, default_value_t = 30)]
        kills: u32,
        /// Descriptors held by the recovery benchmark's client.
        #[arg(long, default_value_t = 1000)]
        objects: usize,
        /// Heap of the large configuration, in MiB.
        #[arg(long, default_value_t = 256)]
        heap_mib: u32,
    },
    /// C3's Table I for fs, lock, evt, timer and mm: micro-reboot time
    /// (memory and execution re-initialization), per-descriptor recovery
    /// at high and best-effort priority under CPU contention, and the
    /// tracking overhead per invocation.
    Recovery {
        /// Reboots per service.
        #[arg(long, default_value_t = 20)]
        kills: u32,
        /// Descriptors held by each of the two client threads.
        #[arg(long, default_value_t = 100)]
        descriptors: usize,
        /// CPU hogs spinning while descriptors are rebuilt (default: one per core).
        #[arg(long)]
        hogs: Option<usize>,
        /// Run the high-priority client thread at this `SCHED_FIFO`
        /// priority (1-99, C3's fixed priorities) instead of nice -10.
        #[arg(long, value_parser = clap::value_parser!(u8).range(1..=99))]
        hp_fifo: Option<u8>,
    },
    /// The client stubs' descriptor tables alone, in process: tracking's
    /// cost per call against the former `Mutex<HashMap>` tables.
    Tables {
        /// Descriptors in each table, used in turn.
        #[arg(long, default_value_t = 100)]
        descriptors: u64,
        /// Timed blocks.
        #[arg(long, default_value_t = 200)]
        blocks: usize,
        /// Calls per block.
        #[arg(long, default_value_t = 50_000)]
        per_block: u64,
    },
    /// Hang detection: coverage and latency for each kind of hang, false
    /// positives over varying fault-free work, overhead against no watchdog.
    Watchdog {
        /// Hangs injected per kind.
        #[arg(long, default_value_t = 10)]
        hangs: u32,
        /// Fault-free checked invocations for the false-positive count.
        #[arg(long, default_value_t = 10_000)]
        fp_calls: u64,
        /// Calls per overhead run.
        #[arg(long, default_value_t = 200_000)]
        overhead_calls: u64,
        /// Overhead runs each way.
        #[arg(long, default_value_t = 5)]
        rounds: u32,
        /// Busy threads spinning during the coverage and false-positive
        /// runs (0: none).
        #[arg(long, default_value_t = 0)]
        load: usize,
    },
    /// A high-priority client's first call after a fault while best-effort
    /// clients hold many descriptors, with eager and on-demand recovery.
    Interference {
        /// Faults per configuration.
        #[arg(long, default_value_t = 10)]
        rounds: u32,
        /// Descriptors held by the best-effort clients, in all.
        #[arg(long, value_delimiter = ',', default_values_t = [10, 1000, 100_000])]
        descriptors: Vec<usize>,
    },
    /// The SuperGlue web benchmark: kintsugi's web server (recovery tracking
    /// on and off, then under a fault every 10 s) against nginx and Apache,
    /// with ab and wrk; a markdown table and an SVG plot.
    Web(web::WebArgs),
    /// Checkpoint recovery of the kv store: throughput with checkpoints
    /// every 1,000, 100 and 10 ms against no recovery, recovery time
    /// under kills, and recovery time against the log's length.
    Kv {
        /// Operations per client thread per throughput run.
        #[arg(long, default_value_t = 100_000)]
        ops: u64,
        /// Throughput runs per configuration (the median is shown).
        #[arg(long, default_value_t = 5)]
        repeats: usize,
        /// Kills for the recovery table.
        #[arg(long, default_value_t = 30)]
        kills: u32,
        /// Only the first table (the log's cost per request, in process).
        #[arg(long)]
        log_only: bool,
    },
    /// ramfs file creation with the vault in memory against the vault
    /// kept on disk (fsync never and always).
    Vault {
        /// Seconds per run.
        #[arg(long, default_value_t = 2.0)]
        secs: f64,
        /// Runs per configuration (the median is shown).
        #[arg(long, default_value_t = 3)]
        repeats: usize,
    },
    /// Incremental checkpoints of a live process: pause by heap size and
    /// share written, with and without read-ahead, against copying every
    /// page, restore time per kind, and throughput with checkpoints every
    /// 100 and 10 ms (a workload, and a component idle and writing).
    Checkpoint {
        /// Heap sizes, MiB.
        #[arg(long, value_delimiter = ',', default_values_t = [16, 256, 1024])]
        heap_mib: Vec<u64>,
        /// Checkpoints (and restores) measured per configuration.
        #[arg(long, default_value_t = 30)]
        rounds: usize,
        /// Seconds per throughput run.
        #[arg(long, default_value_t = 3.0)]
        secs: f64,
        /// Throughput runs per configuration (the median is shown).
        #[arg(long, default_value_t = 3)]
        repeats: usize,
    },
    /// What touching memory left idle costs on this machine, per page,
    /// after pauses asleep and running, against touching it at once.
    IdleMemory {
        /// Memory touched, MiB.
        #[arg(long, default_value_t = 4)]
        mib: usize,
        /// Rounds per pause.
        #[arg(long, default_value_t = 10)]
        rounds: usize,
        /// Pauses, ms.
        #[arg(long, value_delimiter = ',', default_values_t = [1, 10, 100, 500])]
        pause_ms: Vec<u64>,
    },
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_env("KINTSUGI_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Logs to stderr: stdout carries the tables (colour as `kintsugi
    // --color` says).
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(kintsugi_runtime::logging::ansi_wanted())
        .with_target(false)
        .without_time()
        .init();
    let result = match cli.json {
        true => {
            let args: Vec<String> = std::env::args().skip(1).filter(|a| a != "--json").collect();
            json::run(&args)
        }
        false => run(cli.bench),
    };
    match result {
        Ok(true) => std::process::ExitCode::SUCCESS,
        Ok(false) => std::process::ExitCode::FAILURE,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::from(2)
        }
    }
}

fn run(b: Bench) -> anyhow::Result<bool> {
    if cfg!(debug_assertions) {
        eprintln!("warning: a debug build; benchmark figures come from `cargo run --release`");
    }
    match b {
        Bench::Ipc { iterations } => ipc(iterations),
        Bench::Reboot {
            kills,
            objects,
            heap_mib,
        } => reboot(kills, objects, heap_mib),
        Bench::Recovery {
            kills,
            descriptors,
            hogs,
            hp_fifo,
        } => recovery::recovery(kills, descriptors, hogs, hp_fifo),
        Bench::Interference {
            rounds,
            descriptors,
        } => recovery::interference(rounds, &descriptors),
        Bench::Tables {
            descriptors,
            blocks,
            per_block,
        } => tables::tables(descriptors, blocks, per_block),
        Bench::Watchdog {
            hangs,
            fp_calls,
            overhead_calls,
            rounds,
            load,
        } => watchdog::watchdog(hangs, fp_calls, overhead_calls, rounds, load),
        Bench::Web(args) => web::web(args),
        Bench::Checkpoint {
            heap_mib,
            rounds,
            secs,
            repeats,
        } => checkpoint::checkpoint(&heap_mib, rounds, secs, repeats),
        Bench::Kv {
            ops,
            repeats,
            kills,
            log_only,
        } => kv::kv(ops, repeats, kills, log_only),
        Bench::Vault { secs, repeats } => vault::vault(secs, repeats),
        Bench::IdleMemory {
            mib,
            rounds,
            pause_ms,
        } => idle::idle_memory(mib, rounds, &pause_ms),
    }
}

/// The median of `v`, sorted in place (0 if empty).
pub(crate) fn median_of(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// A 90 % bootstrap interval of `median(a) / median(b)`: 2,000
/// resamplings of each with replacement, seeded (the same runs give the
/// same interval).
pub(crate) fn ratio_interval(a: &[f64], b: &[f64]) -> (f64, f64) {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let mut resample = |v: &[f64]| {
        let mut r: Vec<f64> = (0..v.len()).map(|_| v[rng.gen_range(0..v.len())]).collect();
        median_of(&mut r)
    };
    if a.is_empty() || b.is_empty() {
        return (0.0, 0.0);
    }
    let mut ratios: Vec<f64> = (0..2000).map(|_| resample(a) / resample(b)).collect();
    ratios.sort_by(f64::total_cmp);
    (ratios[100], ratios[1899])
}

/// Where an in-process measurement's two spinning threads run: the
/// server's workers on CPU 1 and the client on CPU 0, where this process
/// may use both (where the scheduler puts two spinners otherwise moves
/// a round trip by a factor of two). The calling thread's CPUs are
/// restored when dropped.
pub(crate) struct Pinning {
    /// The calling thread's CPUs before, if CPUs 0 and 1 are among them.
    saved: Option<rustix::thread::CpuSet>,
}

impl Pinning {
    pub(crate) fn new() -> Self {
        Self {
            saved: cpus_0_and_1(),
        }
    }

    /// Whether the threads are pinned.
    pub(crate) fn pinned(&self) -> bool {
        self.saved.is_some()
    }

    /// Runs `start` (which starts the server's workers) on CPU 1, then
    /// keeps the calling thread on CPU 0.
    pub(crate) fn apart<T>(&self, start: impl FnOnce() -> T) -> T {
        if !self.pinned() {
            return start();
        }
        pin(1);
        let started = start();
        pin(0);
        started
    }
}

impl Drop for Pinning {
    fn drop(&mut self) {
        if let Some(cpus) = &self.saved {
            rustix::thread::sched_setaffinity(None, cpus).ok();
        }
    }
}

/// The calling thread's CPUs, if CPUs 0 and 1 are among them.
pub(crate) fn cpus_0_and_1() -> Option<rustix::thread::CpuSet> {
    rustix::thread::sched_getaffinity(None)
        .ok()
        .filter(|c| c.is_set(0) && c.is_set(1))
}

/// Keeps the calling thread (and the threads it starts) on CPU `cpu`.
fn pin(cpu: usize) {
    let mut set = rustix::thread::CpuSet::new();
    set.set(cpu);
    if let Err(e) = rustix::thread::sched_setaffinity(None, &set) {
        eprintln!("bench: could not pin to CPU {cpu}: {e}");
    }
}

/// A bench server that answers only `null`.
pub(crate) struct NullServer;

impl bench::Server for NullServer {
    fn null(&self, _: &Caller) -> Result<(), Error> {
        Ok(())
    }
    fn echo(&self, _: &Caller, _: &[u8], _: &mut [u8]) -> Result<usize, Error> {
        Err(Error::Failed)
    }
    fn grow(&self, _: &Caller, _: u32) -> Result<u64, Error> {
        Err(Error::Failed)
    }
    fn crash(&self, _: &Caller) -> Result<(), Error> {
        Err(Error::Failed)
    }
    fn make(&self, _: &Caller, _: u64) -> Result<u64, Error> {
        Err(Error::Failed)
    }
    fn touch(&self, _: &Caller, _: u64, _: u64) -> Result<u64, Error> {
        Err(Error::Failed)
    }
    fn put(&self, _: &Caller, _: u64, _: u64) -> Result<u64, Error> {
        Err(Error::Failed)
    }
    fn drop(&self, _: &Caller, _: u64) -> Result<(), Error> {
        Err(Error::Failed)
    }
}

/// Times `n` calls of `f` after a warm-up; samples in µs.
fn time_calls(n: usize, mut f: impl FnMut()) -> Vec<f64> {
    for _ in 0..n / 10 {
        f();
    }
    (0..n)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_nanos() as f64 / 1e3
        })
        .collect()
}

/// A forked peer process, killed and reaped on drop.
struct Peer(u32);

impl Peer {
    fn spawn(body: impl FnOnce()) -> anyhow::Result<Self> {
        Ok(Self(process::fork_child(body)?))
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let pid = Pid::from_raw(self.0 as i32).expect("child pid");
        let _ = rustix::process::kill_process(pid, Signal::KILL);
        let _ = rustix::process::waitpid(Some(pid), rustix::process::WaitOptions::empty());
    }
}

/// [`shm_round_trips`] without spinning, this process (the client) and
/// the server process forked from it under the seccomp filter every
/// component runs under: what the filter costs on the invocation path's
/// system calls (a futex wake and wait per call each way). The filter
/// cannot be lifted: this must be the last measurement of the process.
fn filtered_round_trips(iterations: usize) -> anyhow::Result<Vec<f64>> {
    kintsugi_runtime::seccomp::install_on_this_thread()
        .map_err(|e| anyhow::anyhow!("seccomp: {e}"))?;
    shm_round_trips(iterations, Duration::ZERO)
}

fn shm_round_trips(iterations: usize, spin: Duration) -> anyhow::Result<Vec<f64>> {
    futex::set_spin_budget(spin);
    let edge = Arc::new(Edge::create("bench-ipc", 1)?);
    let server_edge = edge.clone();
    let _peer = Peer::spawn(move || {
        let worker = SlotWorker::new(server_edge, 0, 0, Default::default());
        worker.run(bench::service(Arc::new(NullServer)).as_ref(), 1);
    })?;
    edge.server_live(1, _peer.0);
    let client = bench::Client::from_connection(kintsugi_runtime::testing::connection_for_tests(
        edge,
        &bench::INFO,
    ));
    Ok(time_calls(iterations, || {
        client.null().expect("null invocation")
    }))
}

/// Round trips of 8 bytes over a byte stream whose peer echoes them.
fn echo_round_trips(
    iterations: usize,
    mut to_peer: impl Write,
    mut from_peer: impl Read,
) -> Vec<f64> {
    let mut buf = [0u8; 8];
    time_calls(iterations, || {
        to_peer.write_all(&buf).expect("write");
        from_peer.read_exact(&mut buf).expect("read");
    })
}

fn echo_loop(mut input: impl Read, mut output: impl Write) {
    let mut buf = [0u8; 8];
    while input.read_exact(&mut buf).is_ok() && output.write_all(&buf).is_ok() {}
}

fn unix_round_trips(iterations: usize) -> anyhow::Result<Vec<f64>> {
    let (a, b) = UnixStream::pair()?;
    let b2 = b.try_clone()?;
    let _peer = Peer::spawn(move || echo_loop(b, b2))?;
    let a2 = a.try_clone()?;
    Ok(echo_round_trips(iterations, a, a2))
}

fn pipe_round_trips(iterations: usize) -> anyhow::Result<Vec<f64>> {
    let (down_r, down_w) = rustix::pipe::pipe()?;
    let (up_r, up_w) = rustix::pipe::pipe()?;
    let _peer =
        Peer::spawn(move || echo_loop(std::fs::File::from(down_r), std::fs::File::from(up_w)))?;
    Ok(echo_round_trips(
        iterations,
        std::fs::File::from(down_w),
        std::fs::File::from(up_r),
    ))
}

fn ipc(iterations: usize) -> anyhow::Result<bool> {
    let spin = futex::spin_budget();
    let socket_n = iterations.min(100_000);
    println!("kintsugi bench ipc: {iterations} shared-memory round trips, {socket_n} socket/pipe round trips, 2 processes\n");
    let rows = [
        (
            format!(
                "kintsugi null invocation (spin {} µs, then futex)",
                spin.as_micros()
            ),
            shm_round_trips(iterations, spin)?,
        ),
        (
            "kintsugi null invocation (futex only, no spin)".to_string(),
            shm_round_trips(socket_n, Duration::ZERO)?,
        ),
        (
            "Unix stream socket, 8-byte echo".to_string(),
            unix_round_trips(socket_n)?,
        ),
        (
            "pipe pair, 8-byte echo".to_string(),
            pipe_round_trips(socket_n)?,
        ),
        // Last: the filter stays on this process once installed.
        (
            "kintsugi null invocation (futex only), both sides under the components' seccomp filter"
                .to_string(),
            filtered_round_trips(socket_n)?,
        ),
    ];
    futex::set_spin_budget(spin);
    let unix = Summary::of(&rows[2].1).unwrap();
    println!("| transport | p50 µs | p99 µs | mean µs | p50 vs Unix socket |");
    println!("| --- | ---: | ---: | ---: | ---: |");
    for (label, samples) in &rows {
        let s = Summary::of(samples).unwrap();
        println!(
            "| {label} | {:.2} | {:.2} | {:.2} | {:.3}× |",
            s.p50,
            s.p99,
            s.mean,
            s.p50 / unix.p50
        );
    }
    Ok(true)
}

/// A built-in system, its binaries resolved, every component restarted
/// whatever the number of faults.
pub(crate) fn parse_system(name: &str, text: &str) -> anyhow::Result<kintsugi_system::System> {
    let mut system =
        kintsugi_system::parse_builtin(name, text).map_err(|e| anyhow::anyhow!("{e}"))?;
    system.restart_always();
    Ok(system)
}

/// Kills `target` `kills` times at intervals drawn from `every`, and collects the events.
pub(crate) fn kill_repeatedly(
    system: &kintsugi_system::System,
    target: &str,
    kills: u32,
    every: (Duration, Duration),
    stop_when_finished: Option<String>,
    lifelines: bool,
) -> anyhow::Result<Vec<Event>> {
    let plan = ChaosPlan {
        target: target.into(),
        signals: vec![nix::sys::signal::Signal::SIGKILL],
        min_interval: every.0,
        max_interval: every.1,
        count: Some(kills),
        seed: 1,
    };
    let options = Options {
        chaos: Some(plan),
        stop_after_chaos: stop_when_finished.is_none(),
        stop_when_finished,
        interfaces: kintsugi_interfaces::ALL.to_vec(),
        lifelines,
        ..Options::default()
    };
    run_collecting(system, options)
}

/// Runs `system` with `options` in process and returns its events; fails
/// unless it ended cleanly.
pub(crate) fn run_collecting(
    system: &kintsugi_system::System,
    options: Options,
) -> anyhow::Result<Vec<Event>> {
    // The components' reports would land among the tables.
    let options = Options {
        component_stdout: kintsugi_supervisor::ComponentStdout::Stderr,
        ..options
    };
    let mut events = Vec::new();
    let report = kintsugi_supervisor::run(system, options, &mut |e| events.push(e.clone()))?;
    if !report.success() {
        anyhow::bail!("benchmark system did not end cleanly: {:?}", report);
    }
    Ok(events)
}

fn reboot(kills: u32, objects: usize, heap_mib: u32) -> anyhow::Result<bool> {
    println!("kintsugi bench reboot: {kills} SIGKILLs per configuration. Detection runs from the signal to the");
    println!("supervisor learning of the death (lifelines or pidfd, whichever is first); reboot from there to the");
    println!("new incarnation reporting ready; the outage, what a client waits, is their sum.\n");
    println!("| heap of the failed incarnation | reboot from | reboot p50 µs | reboot p99 µs | p50 vs fork+exec | detection p50 µs | outage p50 µs | outage p99 µs | mean RSS at kill |");
    println!("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for heap in [0, heap_mib] {
        let mut results = Vec::new();
        let configurations = [
            (RebootMode::Standby, true),
            (RebootMode::Standby, false),
            (RebootMode::Fork, true),
            (RebootMode::Exec, true),
        ];
        for (mode, lifelines) in configurations {
            let mut system = parse_system("systems/bench.toml", BENCH_SYSTEM)?;
            let echo = system.component_mut("echo").expect("bench.toml has echo");
            echo.reboot = mode;
            echo.set_config("grow_mib", heap.into());
            // Growing starts once the incarnation has served for a while, so
            // that it does not compete with the end of its own reboot.
            echo.set_config("grow_after_ms", 50.into());
            // Leave a grown heap time to be allocated and touched before each kill.
            let every = if heap == 0 {
                (Duration::from_millis(20), Duration::from_millis(40))
            } else {
                (
                    Duration::from_millis(400 + heap as u64),
                    Duration::from_millis(500 + heap as u64),
                )
            };
            let events = kill_repeatedly(&system, "echo", kills, every, None, lifelines)?;
            let took: Vec<f64> = events
                .iter()
                .filter_map(|e| match e {
                    Event::Rebooted { took, .. } => Some(took.as_nanos() as f64 / 1e3),
                    _ => None,
                })
                .collect();
            let detect: Vec<f64> = events
                .iter()
                .filter_map(|e| match e {
                    Event::Crashed {
                        after_injection: Some(d),
                        ..
                    } => Some(d.as_nanos() as f64 / 1e3),
                    _ => None,
                })
                .collect();
            // What a client waits: from the fatal signal to the new incarnation's readiness.
            let mut outage = Vec::new();
            let mut since_signal = None;
            for e in &events {
                match e {
                    Event::Crashed {
                        after_injection, ..
                    } => since_signal = *after_injection,
                    Event::Rebooted { took, .. } => {
                        if let Some(d) = since_signal.take() {
                            outage.push((d + *took).as_nanos() as f64 / 1e3);
                        }
                    }
                    _ => {}
                }
            }
            let rss: Vec<f64> = events
                .iter()
                .filter_map(|e| match e {
                    Event::Injected { rss_kib, .. } => Some(*rss_kib as f64 / 1024.0),
                    _ => None,
                })
                .collect();
            results.push((
                mode,
                lifelines,
                Summary::of(&took).expect("reboots"),
                Summary::of(&detect).expect("detections"),
                Summary::of(&outage).expect("outages"),
                Summary::of(&rss).expect("kills"),
            ));
        }
        let exec = results.iter().find(|r| r.0 == RebootMode::Exec).unwrap().2;
        for (mode, lifelines, s, detect, outage, rss) in &results {
            let from = match (mode, lifelines) {
                (RebootMode::Standby, true) => "warm standby (forked from the pristine image)",
                (RebootMode::Standby, false) => "warm standby, death detected by pidfd only",
                (RebootMode::Fork, _) => "fork of the pristine image on demand",
                (RebootMode::Exec, _) => "fork+exec of the binary (baseline)",
            };
            let label = if heap == 0 {
                "small".to_string()
            } else {
                format!("{heap} MiB")
            };
            println!(
                "| {label} | {from} | {:.0} | {:.0} | {:.3}× | {:.0} | {:.0} | {:.0} | {:.1} MiB |",
                s.p50,
                s.p99,
                s.p50 / exec.p50,
                detect.p50,
                outage.p50,
                outage.p99,
                rss.mean
            );
        }
    }
    descriptor_recovery(kills.min(20), objects)
}

fn descriptor_recovery(rounds: u32, objects: usize) -> anyhow::Result<bool> {
    let out = std::env::temp_dir().join(format!(
        "kintsugi-bench-recovery-{}.jsonl",
        std::process::id()
    ));
    let _ = std::fs::remove_file(&out);
    let mut system = parse_system("systems/bench-recovery.toml", RECOVERY_SYSTEM)?;
    let driver = system
        .component_mut("driver")
        .expect("bench-recovery.toml has driver");
    driver.set_config("objects", objects.into());
    driver.set_config("rounds", rounds.into());
    driver.set_config("out", out.display().to_string().into());
    let every = (Duration::from_millis(150), Duration::from_millis(250));
    kill_repeatedly(
        &system,
        "echo",
        rounds + 5,
        every,
        Some("driver".into()),
        true,
    )?;
    let text = std::fs::read_to_string(&out)?;
    let _ = std::fs::remove_file(&out);
    let rounds: Vec<serde_json::Value> = text
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;
    let column = |key: &str| -> Summary {
        let v: Vec<f64> = rounds
            .iter()
            .map(|r| r[key].as_f64().unwrap_or(f64::NAN))
            .collect();
        Summary::of(&v).expect("rounds")
    };
    let (r, p, cold) = (
        column("recover_us"),
        column("plain_us"),
        column("cold_null_us"),
    );
    println!("\nDescriptor recovery: a client holding {objects} descriptors touches each once after a reboot");
    println!("(the stub replays `make` and `put`), then once more (no recovery); {} rounds. Each round first", r.n);
    println!("warms up with 20 ms of null calls, because right after an idle spell these VMs run calls several");
    println!(
        "times slower (first null calls after a reboot: median {:.2} µs, p99 {:.2} µs).\n",
        cold.p50, cold.p99
    );
    println!("| pass | mean µs per descriptor (median of rounds) | p99 of rounds |");
    println!("| --- | ---: | ---: |");
    println!(
        "| first touch after reboot (rebuild + call) | {:.2} | {:.2} |",
        r.p50, r.p99
    );
    println!("| touch without recovery | {:.2} | {:.2} |", p.p50, p.p99);
    println!(
        "| rebuilding one descriptor (difference) | {:.2} | |",
        r.p50 - p.p50
    );
    Ok(true)
}

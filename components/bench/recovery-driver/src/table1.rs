//! The `table1` role: per-descriptor recovery at two priorities under CPU
//! contention, and the tracking overhead of one service.
//!
//! ```text
//! main thread: a call on its own descriptor every 500 µs  ◀── the injector kills the
//!   epoch changed (a reboot) ─▶ settle 30 ms ─▶ hogs spin      service at random instants
//!   ─▶ HP (nice -10) and BE (nice 19) threads, at once, per descriptor:
//!        first call (rebuilds it) | steady call, until done or the budget (150 ms) is spent
//!   ─▶ hogs stop at the budget ─▶ one JSON line per round (dropped if a kill fell in it)
//! after the last kill: tracked vs raw call, and bench.null, interleaved in blocks
//! ```
//!
//! The two client threads each use a client stub of their own (as two client
//! components would), so that neither waits on the other's stub lock.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kintsugi_interfaces::bench;
use kintsugi_runtime::futex;
use kintsugi_runtime::priority::{self, Priority};
use kintsugi_runtime::Runtime;
use serde::{Deserialize, Serialize};

use crate::subjects::{self, Subject};

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Service {
    Fs,
    Lock,
    Evt,
    Timer,
    Mm,
}

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    service: Service,
    /// Descriptors per client thread.
    descriptors: usize,
    /// Reboots the injector will cause: the driver measures after each,
    /// then the overhead, then ends.
    kills: u64,
    hp_nice: i32,
    /// `SCHED_FIFO` priority of the high-priority thread (C3's fixed
    /// priorities), instead of its nice value.
    hp_fifo: Option<u8>,
    be_nice: i32,
    /// CPU hogs spinning during recovery rounds (default: one per core).
    hogs: Option<usize>,
    /// Timed calls per variant for the overhead.
    calls: usize,
    /// A client thread stops a round's pass after this long (having timed
    /// at least one descriptor), so that rounds end well before the next kill.
    round_budget_ms: u64,
    /// Give up waiting for the next reboot after this long.
    idle_timeout_ms: u64,
    out: String,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            service: Service::Fs,
            descriptors: 100,
            kills: 10,
            hp_nice: -10,
            hp_fifo: None,
            be_nice: 19,
            hogs: None,
            calls: 20_000,
            round_budget_ms: 150,
            idle_timeout_ms: 10_000,
            out: String::new(),
        }
    }
}

/// One recovery round, as written to `out`.
#[derive(Serialize)]
struct Round {
    kind: &'static str,
    epoch: u64,
    descriptors: usize,
    hogs: usize,
    hp: Pass,
    be: Pass,
}

/// One client thread's pass over its descriptors after a reboot.
#[derive(Debug, Clone, Copy, Serialize)]
struct Pass {
    /// The thread's nice value, as the kernel reports it.
    nice: i32,
    /// Descriptors timed before the round's budget ran out.
    measured: usize,
    /// Mean µs per descriptor of the first call (which rebuilds it).
    first_us: f64,
    /// Mean µs per descriptor of the call right after it on the same one.
    steady_us: f64,
    /// The same, medians over the descriptors (without one-off delays,
    /// such as waking the server's worker at the start of the pass).
    first_p50_us: f64,
    steady_p50_us: f64,
}

/// The overhead measurement, as written to `out`.
#[derive(Serialize)]
struct Overhead {
    kind: &'static str,
    call: &'static str,
    /// Means of the fastest 90 % of per-call times.
    tracked_ns: f64,
    raw_ns: f64,
    null_ns: f64,
    calls: usize,
}

pub fn run(rt: &Arc<Runtime>, c: Config) -> anyhow::Result<()> {
    anyhow::ensure!(!c.out.is_empty(), "table1: set `out`");
    anyhow::ensure!(c.descriptors > 0, "table1: `descriptors` must be positive");
    match c.service {
        Service::Fs => measure::<subjects::Fs>(rt, &c),
        Service::Lock => measure::<subjects::Lock>(rt, &c),
        Service::Evt => measure::<subjects::Evt>(rt, &c),
        Service::Timer => measure::<subjects::Timer>(rt, &c),
        Service::Mm => measure::<subjects::Mm>(rt, &c),
    }
}

fn measure<S: Subject + 'static>(rt: &Arc<Runtime>, c: &Config) -> anyhow::Result<()> {
    let main = S::connect(rt, 0)?;
    let background = main.create(0)?;
    let hogs = Hogs::start(
        c.hogs
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(2, usize::from)),
    )?;
    let budget = Duration::from_millis(c.round_budget_ms);
    let hp_priority = Priority {
        nice: c.hp_nice,
        fifo: c.hp_fifo,
    };
    let hp = Prober::start::<S>(rt, 1, c.descriptors, hp_priority, budget)?;
    let be = Prober::start::<S>(rt, 2, c.descriptors, Priority::nice(c.be_nice), budget)?;
    let epoch = || main.connection().epoch();
    let mut seen = epoch();
    let (mut rounds, mut dropped) = (0, 0);
    while seen < 1 + c.kills {
        // Use the service until the injector reboots it.
        let deadline = Instant::now() + Duration::from_millis(c.idle_timeout_ms);
        while epoch() == seen {
            if rt.stop_requested() {
                return Ok(());
            }
            if Instant::now() > deadline {
                tracing::warn!("no reboot of epoch {seen} within {} ms", c.idle_timeout_ms);
                break;
            }
            main.probe(background)?;
            std::thread::sleep(Duration::from_micros(500));
        }
        if epoch() == seen {
            break;
        }
        seen = epoch();
        // Let the supervisor fork the next standby, then start the contention.
        std::thread::sleep(Duration::from_millis(30));
        hogs.spin();
        std::thread::sleep(Duration::from_millis(5));
        hp.go();
        be.go();
        // The hogs stop when the budget is spent, so that a thread starved in
        // the middle of a call finishes it soon and the round ends long
        // before the next kill.
        let budget_ends = Instant::now() + budget;
        let (hp_pass, be_pass) = (hp.result_by(budget_ends), be.result_by(budget_ends));
        hogs.rest();
        let hp_pass = hp_pass.unwrap_or_else(|| hp.result())?;
        let be_pass = be_pass.unwrap_or_else(|| be.result())?;
        if epoch() != seen {
            // Killed again during the round: part of it measured another reboot.
            dropped += 1;
            seen = epoch();
            continue;
        }
        rounds += 1;
        crate::emit(
            &c.out,
            &Round {
                kind: "round",
                epoch: seen,
                descriptors: c.descriptors,
                hogs: hogs.count(),
                hp: hp_pass,
                be: be_pass,
            },
        )?;
    }
    tracing::info!(rounds, dropped, "recovery rounds done");
    drop((hp, be, hogs));
    crate::emit(&c.out, &overhead(rt, &main, background, c.calls)?)
}

/// Times the representative call through the tracking stub and through the
/// raw connection, and a null invocation, in interleaved blocks.
fn overhead<S: Subject>(rt: &Runtime, s: &S, d: S::Desc, calls: usize) -> anyhow::Result<Overhead> {
    const BLOCKS: usize = 20;
    let bench = bench::Client::connect(rt)?;
    let raw = s.raw_target(d, 0)?;
    let per_block = calls.div_ceil(BLOCKS).max(1);
    let (mut tracked, mut untracked, mut null) = (Vec::new(), Vec::new(), Vec::new());
    let time = |f: &mut dyn FnMut() -> anyhow::Result<()>| -> anyhow::Result<f64> {
        let t = Instant::now();
        f()?;
        Ok(t.elapsed().as_nanos() as f64)
    };
    // Warm up every path first.
    for _ in 0..per_block {
        s.probe(d)?;
        s.raw(raw, s.prepare(d)?)?;
        bench.null()?;
    }
    for block in 0..BLOCKS {
        for variant in 0..3 {
            // Each block in another order, so that no variant always runs first.
            match (variant + block) % 3 {
                0 => {
                    for _ in 0..per_block {
                        s.prepare(d)?;
                        tracked.push(time(&mut || s.tracked(d))?);
                    }
                }
                1 => {
                    for _ in 0..per_block {
                        let p = s.prepare(d)?;
                        untracked.push(time(&mut || s.raw(raw, p))?);
                    }
                }
                _ => {
                    for _ in 0..per_block {
                        null.push(time(&mut || Ok(bench.null()?))?);
                    }
                }
            }
        }
    }
    Ok(Overhead {
        kind: "overhead",
        call: S::CALL,
        tracked_ns: trimmed_mean(&mut tracked),
        raw_ns: trimmed_mean(&mut untracked),
        null_ns: trimmed_mean(&mut null),
        calls: per_block * BLOCKS,
    })
}

/// The mean of the fastest 90 % of per-call times: it resolves differences
/// finer than the clock's steps (a median of single calls moves by whole
/// steps of about 10 ns here) and leaves out calls that a preemption or an
/// interrupt stretched.
fn trimmed_mean(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let kept = &v[..(v.len() * 9).div_ceil(10)];
    kept.iter().sum::<f64>() / kept.len() as f64
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// A client thread at a fixed priority with descriptors of its own: on
/// each `go`, calls each descriptor twice, until it has called them all or
/// its budget has run out, and reports the times.
struct Prober {
    go: Option<mpsc::Sender<()>>,
    results: mpsc::Receiver<anyhow::Result<Pass>>,
    thread: Option<JoinHandle<()>>,
}

impl Prober {
    /// Starts the thread and waits until it has created its `n`
    /// descriptors at priority `p`.
    fn start<S: Subject + 'static>(
        rt: &Arc<Runtime>,
        who: u64,
        n: usize,
        p: Priority,
        budget: Duration,
    ) -> anyhow::Result<Self> {
        let (go_tx, go_rx) = mpsc::channel::<()>();
        let (tx, results) = mpsc::channel();
        let (ready_tx, ready) = mpsc::channel::<anyhow::Result<()>>();
        let rt = rt.clone();
        let thread = std::thread::Builder::new()
            .name(format!("prober-{who}"))
            .spawn(move || {
                let setup = || -> anyhow::Result<(S, Vec<S::Desc>, i32)> {
                    priority::apply_to_current_thread(p)?;
                    let tid = rustix::thread::gettid().as_raw_nonzero().get();
                    let nice = priority::of_thread(tid)?.nice;
                    let s = S::connect(&rt, who)?;
                    let descs = (0..n as u64)
                        .map(|i| s.create(i))
                        .collect::<anyhow::Result<_>>()?;
                    Ok((s, descs, nice))
                };
                let (s, descs, nice) = match setup() {
                    Ok(v) => v,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let _ = ready_tx.send(Ok(()));
                let pass = || -> anyhow::Result<Pass> {
                    let deadline = Instant::now() + budget;
                    let (mut first, mut steady) = (Vec::new(), Vec::new());
                    for &d in &descs {
                        let t0 = Instant::now();
                        s.probe(d)?;
                        let t1 = Instant::now();
                        s.probe(d)?;
                        let t2 = Instant::now();
                        first.push((t1 - t0).as_secs_f64() * 1e6);
                        steady.push((t2 - t1).as_secs_f64() * 1e6);
                        if t2 > deadline {
                            break;
                        }
                    }
                    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
                    Ok(Pass {
                        nice,
                        measured: first.len(),
                        first_us: mean(&first),
                        steady_us: mean(&steady),
                        first_p50_us: median(&mut first),
                        steady_p50_us: median(&mut steady),
                    })
                };
                while go_rx.recv().is_ok() {
                    if tx.send(pass()).is_err() {
                        return;
                    }
                }
            })?;
        ready
            .recv()
            .map_err(|_| anyhow::anyhow!("prober thread {who} ended during setup"))??;
        Ok(Self {
            go: Some(go_tx),
            results,
            thread: Some(thread),
        })
    }

    fn go(&self) {
        if let Some(g) = &self.go {
            // A thread that ended is reported by `result`.
            let _ = g.send(());
        }
    }

    fn result(&self) -> anyhow::Result<Pass> {
        self.results
            .recv()
            .map_err(|_| anyhow::anyhow!("a prober thread ended"))?
    }

    /// The pass's result if it comes before `deadline`.
    fn result_by(&self, deadline: Instant) -> Option<anyhow::Result<Pass>> {
        match self
            .results
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
        {
            Ok(r) => Some(r),
            Err(mpsc::RecvTimeoutError::Timeout) => None,
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                Some(Err(anyhow::anyhow!("a prober thread ended")))
            }
        }
    }
}

impl Drop for Prober {
    fn drop(&mut self) {
        self.go = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// CPU hogs at nice 0 that spin while told to, and sleep otherwise.
struct Hogs {
    /// 0: rest, 1: spin, 2: quit. The futex they rest on.
    state: Arc<AtomicU32>,
    threads: Vec<JoinHandle<()>>,
}

impl Hogs {
    const REST: u32 = 0;
    const SPIN: u32 = 1;
    const QUIT: u32 = 2;

    fn start(n: usize) -> anyhow::Result<Self> {
        let state = Arc::new(AtomicU32::new(Self::REST));
        let threads = (0..n)
            .map(|i| {
                let state = state.clone();
                std::thread::Builder::new()
                    .name(format!("hog-{i}"))
                    .spawn(move || {
                        if let Err(e) = priority::apply_to_current_thread(Priority::nice(0)) {
                            tracing::warn!("hog priority: {e}");
                        }
                        loop {
                            match state.load(Ordering::Relaxed) {
                                Self::QUIT => return,
                                Self::SPIN => std::hint::spin_loop(),
                                s => futex::wait(&state, s, None),
                            }
                        }
                    })
            })
            .collect::<Result<_, _>>()?;
        Ok(Self { state, threads })
    }

    fn count(&self) -> usize {
        self.threads.len()
    }

    fn spin(&self) {
        self.state.store(Self::SPIN, Ordering::SeqCst);
        futex::wake_all(&self.state);
    }

    fn rest(&self) {
        self.state.store(Self::REST, Ordering::SeqCst);
    }
}

impl Drop for Hogs {
    fn drop(&mut self) {
        self.state.store(Self::QUIT, Ordering::SeqCst);
        futex::wake_all(&self.state);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

//! timer-workload: waits on periodic timers (one thread and one channel slot
//! each, periods spread from `period_us` to 5× it, all armed at one common
//! start) until each has reached tick `ticks`, and on a few one-shot timers
//! in turn on one more thread. For every tick `wait` returns it measures the
//! lateness, now − (start + k·period) on CLOCK_MONOTONIC, and counts the
//! ticks it skipped; it publishes the counters `ops` (ticks), `errors` and
//! `corrupt` (early ticks, ticks out of order). A periodic timer whose `wait`
//! fails is counted and replaced by a fresh one, so a run never gives up.
//! It then checks the documented endings: a disarmed timer
//! and a one-shot timer past its tick answer `NotArmed`. At the end (or on
//! SIGTERM) it prints a JSON report on stdout and exits 0 only if no call
//! failed and no tick came early.

#![forbid(unsafe_code)]

mod drive;
mod report;

use kintsugi_interfaces::timer;
use kintsugi_runtime::Incarnation;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Deserialize;

/// How long after the workload starts its timers' common start lies, so that
/// every thread has armed its timer before the first tick.
const LEAD_NS: u64 = 50_000_000;

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub seed: u64,
    /// Periodic timers, each waited on by its own thread (so with its own
    /// channel slot: `timers` + 1 must not exceed the server's `slots`).
    pub timers: usize,
    /// The shortest period; timer i's is period_us · (1 + 4i/(timers − 1)),
    /// plus a seeded jitter of up to 10 % so that ticks rarely coincide.
    pub period_us: u64,
    /// The tick each periodic timer is waited on until (0: until stopped).
    pub ticks: u64,
    /// One-shot timers, due between period_us · ticks / 2 and
    /// period_us · ticks after the start (seeded), waited on in turn.
    pub once_timers: usize,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            seed: 42,
            timers: 4,
            period_us: 2000,
            ticks: 250,
            once_timers: 3,
        }
    }
}

impl Config {
    /// The periodic timers' periods and the one-shot timers' delays, in µs.
    fn schedule(&self) -> (Vec<u64>, Vec<u64>) {
        let mut rng = StdRng::seed_from_u64(self.seed);
        let base = self.period_us.max(1);
        let spread = self.timers.saturating_sub(1).max(1) as u64;
        let periodic = (0..self.timers as u64)
            .map(|i| base + i * 4 * base / spread + rng.gen_range(0..=base / 10))
            .collect();
        let span = base.saturating_mul(self.ticks.max(2)).min(60_000_000);
        let mut once: Vec<u64> = (0..self.once_timers)
            .map(|_| rng.gen_range(span / 2..=span))
            .collect();
        once.sort_unstable();
        (periodic, once)
    }
}

fn main() {
    kintsugi_runtime::run(|rt| {
        let config: Config = rt.config()?;
        let client = timer::Client::connect(rt)?;
        let rt = rt.clone();
        Ok(Incarnation::main(move || {
            let (periods, delays) = config.schedule();
            tracing::info!(
                seed = config.seed,
                ?periods,
                ?delays,
                "timer-workload starting"
            );
            let start_ns = kintsugi_runtime::clock::monotonic_ns() + LEAD_NS;
            let stop = || rt.stop_requested();
            let counters = rt.workload_counters()?;
            let timers = std::thread::scope(|s| {
                let periodic: Vec<_> = periods
                    .iter()
                    .map(|&period_us| {
                        let (client, stop, counters) = (&client, &stop, &counters);
                        s.spawn(move || {
                            drive::periodic(
                                client,
                                period_us,
                                start_ns,
                                config.ticks,
                                stop,
                                counters,
                            )
                        })
                    })
                    .collect();
                let once = s.spawn(|| drive::one_shots(&client, &delays, start_ns, &stop));
                let mut timers: Vec<_> = periodic
                    .into_iter()
                    .map(|t| t.join().expect("timer thread panicked"))
                    .collect();
                timers.extend(once.join().expect("one-shot thread panicked"));
                timers
            });
            let report = report::Report::of(config.seed, timers);
            println!("{}", serde_json::to_string(&report)?);
            if report.errors > 0 || report.early > 0 {
                anyhow::bail!(
                    "{} errors, {} early ticks; first: {:?}",
                    report.errors,
                    report.early,
                    report.first_errors.first()
                );
            }
            Ok(())
        }))
    })
}

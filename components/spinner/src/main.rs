//! spinner: serves `interfaces/spin.kidl` for the watchdog's tests and
//! benchmark. `work` runs inside the checked section `work`, expecting the
//! exit of its size class; `hang` hangs the way it is asked to (once per
//! token: the counter `hang_token` outlives reboots, so a call re-issued
//! after the reboot returns at once); `nap` waits inside
//! [`watchdog::blocking`]. With `batch_every_ms` set, a background thread
//! runs sections `batch` of varying size, one of which `hang(4)` makes loop.
//!
//! Counters: `hang_ns` (monotonic instant a hang began), `stall_tid` (the
//! thread a stall runs on), `batches`.

#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kintsugi_interfaces::spin::{self, Error};
use kintsugi_interfaces::spin_work::checksum;
use kintsugi_runtime::watchdog::{self, Section};
use kintsugi_runtime::{clock, futex, Caller, Incarnation, Runtime};
use serde::Deserialize;

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct Config {
    /// How often the batch thread runs a section (0: no batch thread).
    batch_every_ms: u64,
    /// Units of a batch, and of the rare large one (one in `large_every`).
    batch_units: u32,
    large_units: u32,
    large_every: u64,
    /// Run `work` inside the checked section `work`.
    work_section: bool,
    /// Print `{"stall_tid": N}` on stdout when a stall starts, for a test
    /// that stops the thread.
    announce_stall: bool,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            batch_every_ms: 0,
            batch_units: 200,
            large_units: 4000,
            large_every: 100,
            work_section: true,
            announce_stall: false,
        }
    }
}

/// The exit (and expected exit) of work of `units`: its size class.
fn size_class(units: u32) -> u32 {
    (units.max(1).ilog2() / 2).min(7)
}

/// Set by `hang(4)`: the batch thread's next section loops.
static BATCH_HANG: AtomicBool = AtomicBool::new(false);

struct Spinner {
    rt: Arc<Runtime>,
    /// None: `work` runs outside any section.
    work: Option<Section>,
    announce_stall: bool,
}

impl Spinner {
    fn counter(&self, name: &str) -> Result<&kintsugi_runtime::counters::Counter, Error> {
        self.rt.counter(name).map_err(|_| Error::Failed)
    }
}

impl spin::Server for Spinner {
    fn work(&self, _: &Caller, seed: u64, units: u32) -> Result<u64, Error> {
        let class = size_class(units);
        let s = self.work.map(|w| w.enter_expecting(class));
        let x = checksum(seed, units);
        if let Some(s) = s {
            s.leave(class);
        }
        Ok(x)
    }

    fn hang(&self, _: &Caller, kind: u32, token: u64) -> Result<(), Error> {
        let last = self.counter("hang_token")?;
        if token <= last.get() {
            return Ok(()); // hung for this token already: a re-issued call
        }
        last.set(token);
        if kind == 4 {
            BATCH_HANG.store(true, Ordering::SeqCst);
            return Ok(());
        }
        self.counter("hang_ns")?.set(clock::monotonic_ns());
        tracing::info!(kind, token, "hanging on request");
        match kind {
            1 => loop {
                std::hint::black_box(checksum(token, 1));
            },
            2 => {
                let never = AtomicU32::new(0);
                loop {
                    futex::wait(&never, 0, None);
                }
            }
            _ => {
                let tid = rustix::thread::gettid().as_raw_nonzero().get() as u64;
                self.counter("stall_tid")?.set(tid);
                if self.announce_stall {
                    println!("{}", serde_json::json!({ "stall_tid": tid }));
                }
                loop {
                    std::thread::sleep(Duration::from_millis(1));
                    std::hint::black_box(checksum(token, 2));
                }
            }
        }
    }

    fn nap(&self, _: &Caller, ms: u32) -> Result<(), Error> {
        watchdog::blocking(|| {
            let word = AtomicU32::new(0);
            let end = Instant::now() + Duration::from_millis(ms.into());
            while let Some(left) = end.checked_duration_since(Instant::now()) {
                futex::wait(&word, 0, Some(left));
            }
        });
        Ok(())
    }
}

/// Runs a `batch` section every `cfg.batch_every_ms`, forever.
fn batches(rt: Arc<Runtime>, cfg: Config) -> anyhow::Result<()> {
    let section = watchdog::section("batch")?;
    let done = rt.counter("batches")?;
    let mut x = rt.epoch() | 1;
    loop {
        std::thread::sleep(Duration::from_millis(cfg.batch_every_ms));
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let units = if x.is_multiple_of(cfg.large_every.max(1)) {
            cfg.large_units
        } else {
            cfg.batch_units / 2 + (x % u64::from(cfg.batch_units.max(1))) as u32
        };
        let class = size_class(units);
        let s = section.enter_expecting(class);
        if BATCH_HANG.load(Ordering::SeqCst) {
            rt.counter("hang_ns")?.set(clock::monotonic_ns());
            loop {
                std::hint::black_box(checksum(x, 1));
            }
        }
        std::hint::black_box(checksum(x, units));
        s.leave(class);
        done.add(1);
    }
}

fn main() {
    kintsugi_runtime::run(|rt| {
        let cfg: Config = rt.config()?;
        let spinner = Spinner {
            rt: rt.clone(),
            work: cfg
                .work_section
                .then(|| watchdog::section("work"))
                .transpose()?,
            announce_stall: cfg.announce_stall,
        };
        if cfg.batch_every_ms > 0 {
            let rt = rt.clone();
            std::thread::Builder::new()
                .name("batch".into())
                .spawn(move || {
                    if let Err(e) = batches(rt, cfg) {
                        tracing::error!("batch thread: {e:#}");
                    }
                })?;
        }
        Ok(Incarnation::serve(vec![spin::service(Arc::new(spinner))]))
    })
}

//! spin-workload: calls `spin.work` with sizes drawn from a seeded
//! distribution (mostly small, one large in `large_every`), checks every
//! result against its own computation, calls `spin.hang` at the calls its
//! config names (and, if asked, one call of a function spin lacks), and
//! prints a JSON report when done (and leaves it in its counters, for
//! in-process benchmarks):
//!
//! ```json
//! {"ops":10000,"errors":0,"mismatches":0,"hangs":2,"refused":0,"elapsed_ns":123456789}
//! ```

#![forbid(unsafe_code)]

use kintsugi_interfaces::spin;
use kintsugi_interfaces::spin_work::checksum;
use kintsugi_runtime::{Fault, Incarnation};

/// A function number the spin interface does not have.
const BOGUS_FUNCTION: u32 = 0x7fff;
use serde::Deserialize;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Hang {
    /// Before which call.
    at_op: u64,
    /// As `spin.hang` takes it.
    kind: u32,
}

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct Config {
    seed: u64,
    ops: u64,
    /// Units of a small call: uniform in `small_units[0]..=small_units[1]`.
    small_units: [u32; 2],
    large_units: u32,
    /// One large call in this many (0: none).
    large_every: u64,
    hangs: Vec<Hang>,
    /// A declared blocking wait before the first call (ms; 0: none).
    nap_ms: u32,
    /// A declared blocking wait after each hang call (ms; 0: none): time
    /// for the watchdog to find a hang the call left on another thread
    /// (`hang(4)`, a batch section that loops) before the workload ends.
    nap_after_hang_ms: u32,
    /// Before this call, one invocation of a function spin does not have,
    /// which must come back refused (after the watchdog rebooted spinner
    /// once on the client's suspicion: the client cannot tell its own bad
    /// request from a faulty server until the reboot).
    bogus_at_op: Option<u64>,
    /// Print the report on stdout (it is always in the counters too).
    print: bool,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            seed: 1,
            ops: 1000,
            small_units: [1, 50],
            large_units: 2000,
            large_every: 0,
            hangs: Vec::new(),
            nap_ms: 0,
            nap_after_hang_ms: 0,
            bogus_at_op: None,
            print: true,
        }
    }
}

fn main() {
    kintsugi_runtime::run(|rt| {
        let cfg: Config = rt.config()?;
        let conn = rt.connect(&spin::INFO)?;
        let client = spin::Client::from_connection(conn.clone());
        let rt = rt.clone();
        Ok(Incarnation::main(move || {
            let start = std::time::Instant::now();
            if cfg.nap_ms > 0 {
                client.nap(cfg.nap_ms)?;
            }
            let (mut errors, mut mismatches, mut hangs, mut refused) = (0u64, 0u64, 0u64, 0u64);
            let mut x = cfg.seed | 1;
            let [lo, hi] = cfg.small_units;
            for op in 0..cfg.ops {
                for h in cfg.hangs.iter().filter(|h| h.at_op == op) {
                    hangs += 1;
                    if let Err(e) = client.hang(h.kind, hangs) {
                        eprintln!("spin-workload: hang({}) failed: {e}", h.kind);
                        errors += 1;
                    }
                    if cfg.nap_after_hang_ms > 0 {
                        client.nap(cfg.nap_after_hang_ms)?;
                    }
                }
                if cfg.bogus_at_op == Some(op) {
                    // Re-issued after a reboot, as a generated stub does.
                    let bogus = || conn.call(BOGUS_FUNCTION, None, |_| Ok(()), |_| Ok(()));
                    match bogus().or_else(|e| if e == Fault::Stale { bogus() } else { Err(e) }) {
                        Err(Fault::Refused(_)) => refused += 1,
                        other => {
                            eprintln!("spin-workload: bogus call: {other:?}, expected a refusal");
                            errors += 1;
                        }
                    }
                }
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let units = if cfg.large_every > 0 && x.is_multiple_of(cfg.large_every) {
                    cfg.large_units
                } else {
                    lo + (x >> 8) as u32 % (hi - lo + 1).max(1)
                };
                match client.work(x, units) {
                    Ok(v) if v == checksum(x, units) => {}
                    Ok(v) => {
                        eprintln!(
                            "spin-workload: call {op}: work({x}, {units}) = {v}, expected {}",
                            checksum(x, units)
                        );
                        mismatches += 1;
                    }
                    Err(e) => {
                        eprintln!("spin-workload: call {op}: {e}");
                        errors += 1;
                    }
                }
            }
            let report = serde_json::json!({
                "ops": cfg.ops,
                "errors": errors,
                "mismatches": mismatches,
                "hangs": hangs,
                "refused": refused,
                "elapsed_ns": start.elapsed().as_nanos() as u64,
            });
            for (name, v) in report.as_object().expect("an object") {
                rt.counter(name)?.set(v.as_u64().unwrap_or(0));
            }
            if cfg.print {
                println!("{report}");
            }
            Ok(())
        }))
    })
}

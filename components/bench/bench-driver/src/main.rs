//! bench-driver: holds `objects` descriptors of the bench server; each time
//! the server is rebooted under it (by the supervisor's injector), touches
//! every descriptor once, which makes the client stub rebuild it, and
//! compares that with a pass over the same descriptors that needs no
//! recovery. Writes one JSON line per round (to `out`, or stdout).

#![forbid(unsafe_code)]

use std::time::{Duration, Instant};

use kintsugi_interfaces::bench;
use kintsugi_runtime::{Incarnation, Sysno};
use serde::{Deserialize, Serialize};

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct Config {
    objects: usize,
    rounds: usize,
    /// File to append the JSON lines to (stdout if empty).
    out: String,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            objects: 1000,
            rounds: 10,
            out: String::new(),
        }
    }
}

#[derive(Serialize)]
struct Round {
    round: usize,
    epoch: u64,
    objects: usize,
    /// Mean µs per descriptor for the first touch after the reboot.
    recover_us: f64,
    /// Mean µs per descriptor for a touch that needs no recovery.
    plain_us: f64,
    /// Mean µs of the first null calls after the reboot, before warming up.
    cold_null_us: f64,
}

fn main() {
    // It appends its results to the file its config names (`out`).
    kintsugi_runtime::run_allowing(&[Sysno::openat], |rt| {
        let config: Config = rt.config()?;
        let client = bench::Client::connect(rt)?;
        let rt = rt.clone();
        Ok(Incarnation::main(move || {
            let objs = (0..config.objects)
                .map(|i| client.make(i as u64))
                .collect::<Result<Vec<_>, _>>()?;
            let pass = |step: u64| -> anyhow::Result<f64> {
                let t = Instant::now();
                for o in &objs {
                    client.touch(*o, step)?;
                }
                Ok(t.elapsed().as_secs_f64() * 1e6 / objs.len() as f64)
            };
            pass(1)?;
            for round in 0..config.rounds {
                let epoch = client.connection().epoch();
                while client.connection().epoch() == epoch {
                    if rt.stop_requested() {
                        return Ok(());
                    }
                    std::thread::sleep(Duration::from_micros(200));
                }
                // Let the supervisor finish forking the next standby, so that the
                // pass measures recovery and not the machine's other work.
                std::thread::sleep(Duration::from_millis(30));
                // On these VMs calls run several times slower for some tens of
                // milliseconds after an idle spell; measure that, then warm up
                // with null calls (they rebuild nothing: recovery is lazy).
                let t = Instant::now();
                for _ in 0..50 {
                    client.null()?;
                }
                let cold_null_us = t.elapsed().as_secs_f64() * 1e6 / 50.0;
                let warm_until = Instant::now() + Duration::from_millis(20);
                while Instant::now() < warm_until {
                    client.null()?;
                }
                let recover_us = pass(1)?;
                let plain_us = pass(1)?;
                let epoch = client.connection().epoch();
                let r = Round {
                    round,
                    epoch,
                    objects: objs.len(),
                    recover_us,
                    plain_us,
                    cold_null_us,
                };
                let line = serde_json::to_string(&r)? + "\n";
                if config.out.is_empty() {
                    print!("{line}");
                } else {
                    use std::io::Write;
                    std::fs::OpenOptions::new()
                        .create(true)
                        .append(true)
                        .open(&config.out)?
                        .write_all(line.as_bytes())?;
                }
            }
            Ok(())
        }))
    })
}

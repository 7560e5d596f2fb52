//! fs-workload: creates, writes, reads, seeks, truncates, renames and
//! unlinks files through the `fs` interface as fast as it can, checking
//! every answer against an in-memory model of what the file system must
//! hold, and publishing its counts as the counters `ops`, `errors` and
//! `corrupt` (wrong answers). On SIGTERM (or after `ops` operations) it verifies every file byte
//! for byte, prints a JSON report on stdout and exits 0 only if nothing
//! differed and no call failed. With `durable = true` it writes instead
//! files that must outlive the whole system, and checks them at start
//! (`durable.rs`).

#![forbid(unsafe_code)]

mod durable;
mod model;

use kintsugi_interfaces::fs;
use kintsugi_runtime::Incarnation;
use serde::Deserialize;

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Distinct file names per directory.
    pub files: usize,
    /// File names padded to at least this many bytes: long names fill a
    /// `readdir` reply with fewer files, so listings take several pages.
    pub name_bytes: usize,
    /// Create every file name, empty, before the random operations.
    pub prefill: bool,
    /// Directories under the root.
    pub dirs: usize,
    pub seed: u64,
    /// Stop after this many operations (0: run until told to stop); in the
    /// durable mode, after file `f-(ops-1)`.
    pub ops: u64,
    /// Largest single write, in bytes (at most 65536).
    pub max_write: usize,
    /// Descriptors held open at once, per thread.
    pub max_open: usize,
    /// Client threads, each with its own channel slot, directories and model.
    pub threads: usize,
    /// Instead of the random operations: files that must outlive the whole
    /// system (see `durable.rs`).
    pub durable: bool,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            files: 16,
            name_bytes: 0,
            prefill: false,
            dirs: 3,
            seed: 42,
            ops: 0,
            max_write: 16384,
            max_open: 6,
            threads: 1,
            durable: false,
        }
    }
}

fn main() {
    kintsugi_runtime::run(|rt| {
        let config: Config = rt.config()?;
        let client = fs::Client::connect(rt)?;
        let rt = rt.clone();
        Ok(Incarnation::main(move || {
            if config.durable {
                return durable::run(&client, &rt, &config);
            }
            tracing::info!(
                seed = config.seed,
                threads = config.threads,
                "fs-workload starting"
            );
            let threads = config.threads.max(1);
            let reports = std::thread::scope(|s| {
                let runs: Vec<_> = (0..threads)
                    .map(|t| {
                        let (client, config, rt) = (&client, &config, &rt);
                        s.spawn(move || -> anyhow::Result<model::Report> {
                            let mut w = model::Workload::new(client, config, t)?;
                            let counters = rt.workload_counters()?;
                            let mut seen = [0; 2];
                            let mut n = 0u64;
                            while !rt.stop_requested() && (config.ops == 0 || n < config.ops) {
                                w.step();
                                counters.op();
                                counters.publish(&mut seen, w.failures());
                                n += 1;
                            }
                            Ok(w.finish())
                        })
                    })
                    .collect();
                runs.into_iter()
                    .map(|r| r.join().expect("workload thread panicked"))
                    .collect::<anyhow::Result<Vec<_>>>()
            })?;
            let mut report = model::Report {
                seed: config.seed,
                ..Default::default()
            };
            for r in reports {
                report.merge(r);
            }
            report.descriptors_open_at_end = client.tracked_files();
            println!("{}", serde_json::to_string(&report)?);
            Ok(report.failures.check()?)
        }))
    })
}

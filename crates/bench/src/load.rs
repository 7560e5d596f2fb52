//! CPU load for the benchmarks that must hold under it: busy threads at
//! nice 0, and a sampler of how many threads are runnable machine-wide (the
//! fourth field of `/proc/loadavg`), so that a table can say what load it
//! was measured under.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// Busy threads spinning until [`Load::finish`].
pub struct Load {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    runnable: Arc<Mutex<Vec<f64>>>,
}

/// What the machine's load was while a [`Load`] ran.
pub struct Figures {
    pub hogs: usize,
    /// Runnable threads machine-wide, sampled every 50 ms.
    pub runnable_mean: f64,
    pub runnable_max: f64,
    pub samples: usize,
    /// The kernel's 1-minute load average at the end.
    pub loadavg_1min: f64,
}

impl std::fmt::Display for Figures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} busy threads (nice 0) beside the system; runnable threads machine-wide, sampled every 50 ms: \
             mean {:.1}, max {} ({} samples); 1-minute load average at the end {:.1}",
            self.hogs, self.runnable_mean, self.runnable_max, self.samples, self.loadavg_1min
        )
    }
}

/// `/proc/loadavg`: the 1-minute average and the threads runnable now.
fn loadavg() -> Option<(f64, f64)> {
    let s = std::fs::read_to_string("/proc/loadavg").ok()?;
    let mut f = s.split_whitespace();
    let avg = f.next()?.parse().ok()?;
    let running = f.nth(2)?.split('/').next()?.parse().ok()?;
    Some((avg, running))
}

impl Load {
    /// Starts `hogs` busy threads and the sampler.
    pub fn start(hogs: usize) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let runnable = Arc::new(Mutex::new(Vec::new()));
        let mut threads: Vec<JoinHandle<()>> = (0..hogs)
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    let mut x = 1u64;
                    while !stop.load(Ordering::Relaxed) {
                        x = std::hint::black_box(
                            x.wrapping_mul(6364136223846793005).wrapping_add(1),
                        );
                    }
                })
            })
            .collect();
        let (s, r) = (stop.clone(), runnable.clone());
        threads.push(std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(50));
                if let Some((_, running)) = loadavg() {
                    // The sampler itself is running as it reads.
                    r.lock().unwrap().push(running - 1.0);
                }
            }
        }));
        Self {
            stop,
            threads,
            runnable,
        }
    }

    /// Stops the threads; what the load was.
    pub fn finish(self) -> Figures {
        self.stop.store(true, Ordering::Relaxed);
        let hogs = self.threads.len() - 1;
        for t in self.threads {
            let _ = t.join();
        }
        let samples = self.runnable.lock().unwrap().clone();
        let n = samples.len().max(1) as f64;
        Figures {
            hogs,
            runnable_mean: samples.iter().sum::<f64>() / n,
            runnable_max: samples.iter().copied().fold(0.0, f64::max),
            samples: samples.len(),
            loadavg_1min: loadavg().map_or(0.0, |(avg, _)| avg),
        }
    }
}

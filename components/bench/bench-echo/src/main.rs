//! bench-echo: the server side of kintsugi's benchmarks. Besides null and
//! echo calls it hands out objects (descriptors with a tracked position) so
//! that recovery can be timed, and it can grow its heap after it starts
//! (`grow_mib` in its config) so that reboot time can be measured against
//! the memory a failed incarnation held.
//!
//! Its durable memory, when the system gives it some, serves the tests: each
//! incarnation counts itself in the first word of its arena and prints the
//! count, and writes a note for its clients at the start of its pool's
//! second page.

#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use kintsugi_interfaces::bench::{self, Error};
use kintsugi_runtime::abi::shm::page_size;
use kintsugi_runtime::{Caller, Incarnation, Runtime};
use serde::Deserialize;

#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct Config {
    /// MiB to allocate and touch once each incarnation has been serving for
    /// `grow_after_ms`.
    grow_mib: u32,
    grow_after_ms: u64,
    /// Pages of the grown heap written every millisecond after it has grown
    /// (by a thread of its own), for the checkpoint benchmark: a server
    /// whose memory keeps changing.
    write_pages_per_ms: u32,
}

#[derive(Default)]
struct Echo {
    heap: Mutex<Vec<Vec<u8>>>,
    objects: Mutex<HashMap<(u32, u64), u64>>,
    next: Mutex<u64>,
}

impl Echo {
    fn grow(&self, mib: u32) -> u64 {
        let mut heap = self.heap.lock().unwrap();
        for _ in 0..mib {
            // Touch every page so that the memory is really resident.
            heap.push(vec![0xA5u8; 1 << 20]);
        }
        heap.len() as u64
    }

    /// Writes `per_ms` pages of the heap every millisecond, for ever,
    /// striding through it so that each is written again only after all
    /// the others.
    fn keep_writing(&self, per_ms: u32) {
        let page = page_size();
        let mut next = 0usize;
        loop {
            {
                let mut heap = self.heap.lock().unwrap();
                let pages_per_chunk = (1 << 20) / page;
                let total = heap.len() * pages_per_chunk;
                for _ in 0..per_ms.min(total as u32) {
                    // A stride coprime with the (power-of-two) page count.
                    next = (next + 7919) % total;
                    let chunk = &mut heap[next / pages_per_chunk];
                    chunk[(next % pages_per_chunk) * page] ^= 1;
                }
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
}

impl bench::Server for Echo {
    fn null(&self, _c: &Caller) -> Result<(), Error> {
        Ok(())
    }
    fn echo(&self, _c: &Caller, data: &[u8], out: &mut [u8]) -> Result<usize, Error> {
        let n = data.len().min(out.len());
        out[..n].copy_from_slice(&data[..n]);
        Ok(n)
    }
    fn grow(&self, _c: &Caller, mib: u32) -> Result<u64, Error> {
        Ok(self.grow(mib))
    }
    fn crash(&self, _c: &Caller) -> Result<(), Error> {
        std::process::abort()
    }
    fn make(&self, c: &Caller, tag: u64) -> Result<u64, Error> {
        let mut next = self.next.lock().unwrap();
        *next += 1;
        self.objects
            .lock()
            .unwrap()
            .insert((c.component, *next), tag);
        Ok(*next)
    }
    fn touch(&self, c: &Caller, o: u64, step: u64) -> Result<u64, Error> {
        self.objects
            .lock()
            .unwrap()
            .get(&(c.component, o))
            .map(|_| step)
            .ok_or(Error::Failed)
    }
    fn put(&self, c: &Caller, o: u64, pos: u64) -> Result<u64, Error> {
        self.objects
            .lock()
            .unwrap()
            .get(&(c.component, o))
            .map(|_| pos)
            .ok_or(Error::Failed)
    }
    fn drop(&self, c: &Caller, o: u64) -> Result<(), Error> {
        self.objects
            .lock()
            .unwrap()
            .remove(&(c.component, o))
            .map(|_| ())
            .ok_or(Error::Failed)
    }
}

/// Counts this incarnation in the arena (if any) and returns the count.
fn count_incarnation(rt: &Runtime) -> Option<u64> {
    let counter: &AtomicU64 = rt.arena()?.at(0);
    Some(counter.fetch_add(1, Ordering::SeqCst) + 1)
}

/// Writes a note for the clients at the start of the pool's second page (if it has one).
fn write_pool_note(rt: &Runtime) {
    let Some(pool) = rt.pool().filter(|p| p.len() >= 2 * page_size()) else {
        return;
    };
    let note = format!("pool of {}", rt.name());
    for (cell, b) in pool.bytes(page_size(), note.len()).iter().zip(note.bytes()) {
        cell.store(b, Ordering::Relaxed);
    }
}

fn main() {
    kintsugi_runtime::run(|rt| {
        let config: Config = rt.config()?;
        let incarnations = count_incarnation(rt);
        write_pool_note(rt);
        let echo = Arc::new(Echo::default());
        let grower = echo.clone();
        let (name, epoch) = (rt.name().to_string(), rt.epoch());
        Ok(
            Incarnation::serve(vec![bench::service(echo)]).then(move || {
                // After the incarnation is ready, off the reboot's path.
                if let Some(n) = incarnations {
                    println!(
                        "{}",
                        serde_json::json!({ "component": name, "epoch": epoch, "incarnations": n })
                    );
                }
                // The failed one's heap, for the reboot benchmark.
                std::thread::sleep(std::time::Duration::from_millis(config.grow_after_ms));
                grower.grow(config.grow_mib);
                if config.write_pages_per_ms > 0 {
                    let per_ms = config.write_pages_per_ms;
                    std::thread::spawn(move || grower.keep_writing(per_ms));
                }
                Ok(())
            }),
        )
    })
}

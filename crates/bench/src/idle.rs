//! `kintsugi bench idle-memory`: what touching memory left untouched for a
//! while costs on this machine, per page. A micro-reboot touches memory
//! that has been idle since the last one (the standby's, the supervisor's
//! paths that run only at a death): on the 2-vCPU VMs kintsugi is measured
//! on, a page left alone for 100 ms costs about a microsecond and more to
//! touch again, whether the process slept or ran on other memory, which
//! bare metal does not show; it is part of every reboot figure in
//! `docs/benchmarks.md`. The baseline is the same pages touched again at
//! once, in the same run.

use std::time::{Duration, Instant};

use kintsugi_supervisor::stats::Summary;

const PAGE: usize = 4096;

/// How the pages were left between two touches.
#[derive(Clone, Copy)]
enum Left {
    /// The thread slept.
    Asleep,
    /// The thread ran, touching other memory of the same size.
    Running,
}

/// Nanoseconds per page of touching (reading and writing a byte of) every
/// page of `pages` after leaving them for `pause` as `left`, `rounds` times.
fn per_page(
    pages: &mut [u8],
    other: &mut [u8],
    pause: Duration,
    left: Left,
    rounds: usize,
) -> Vec<f64> {
    let n = (pages.len() / PAGE) as f64;
    (0..rounds)
        .map(|_| {
            match left {
                Left::Asleep => std::thread::sleep(pause),
                Left::Running => {
                    let end = Instant::now() + pause;
                    while Instant::now() < end {
                        touch(other);
                    }
                }
            }
            let t = Instant::now();
            touch(pages);
            t.elapsed().as_nanos() as f64 / n
        })
        .collect()
}

/// Reads and writes one byte of every page of `mem`.
fn touch(mem: &mut [u8]) {
    for i in (0..mem.len()).step_by(PAGE) {
        mem[i] = std::hint::black_box(mem[i]).wrapping_add(1);
    }
}

pub fn idle_memory(mib: usize, rounds: usize, pauses_ms: &[u64]) -> anyhow::Result<bool> {
    let len = mib.max(1) << 20;
    // Written whole first: every page is present before it is measured.
    let mut pages = vec![1u8; len];
    let mut other = vec![1u8; len];
    let rounds = rounds.max(1);
    touch(&mut pages);
    touch(&mut other);
    println!("## Touching memory left idle ({mib} MiB, one byte a page read and written)\n");
    println!(
        "{rounds} rounds per row; per page: the round's time over its {} pages\n",
        len / PAGE
    );
    println!("| left for | how | rounds | p50 ns/page | p90 | p99 | max | × at once |");
    println!("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |");
    let base = Summary::of(&per_page(
        &mut pages,
        &mut other,
        Duration::ZERO,
        Left::Running,
        rounds,
    ))
    .expect("rounds");
    let row = |pause: u64, how: &str, s: &Summary| {
        println!(
            "| {pause} ms | {how} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.1} |",
            s.n,
            s.p50,
            s.p90,
            s.p99,
            s.max,
            s.p50 / base.p50.max(1.0)
        );
    };
    row(0, "at once (baseline)", &base);
    for &ms in pauses_ms.iter().filter(|&&ms| ms > 0) {
        for (left, how) in [
            (Left::Asleep, "asleep"),
            (Left::Running, "running on other memory"),
        ] {
            let pause = Duration::from_millis(ms);
            let samples = per_page(&mut pages, &mut other, pause, left, rounds);
            row(ms, how, &Summary::of(&samples).expect("rounds"));
        }
    }
    Ok(true)
}

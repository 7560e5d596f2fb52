//! `kintsugi bench watchdog`: hang detection's coverage, latency, false
//! positives and overhead, on spinner (a `spin` server) under spin-workload,
//! which checks every result. All in one run, in process, with the
//! supervisor's roster to read counters.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kintsugi_runtime::clock::monotonic_ns;
use kintsugi_supervisor::{Detection, Event, Options, Roster};

use kintsugi_inject::hold_until_death;
use kintsugi_supervisor::stats::Summary;

use crate::load::Load;

/// The system, with `[watchdog]` on or off and the given configs.
fn system(
    watchdog: bool,
    spinner: &str,
    workload: &str,
) -> anyhow::Result<kintsugi_system::System> {
    let wd = if watchdog {
        "[watchdog]\nstuck_ms = 500\n"
    } else {
        ""
    };
    let text = format!(
        "[system]\nname = \"bench-watchdog\"\n{wd}\n[[component]]\nname = \"spinner\"\nbinary = \"kintsugi-spinner\"\nprovides = [\"spin\"]\nslots = 2\n[component.config]\n{spinner}\n\n[[component]]\nname = \"workload\"\nbinary = \"kintsugi-spin-workload\"\nuses = [\"spin\"]\n[component.config]\nprint = false\n{workload}\n"
    );
    crate::parse_system("bench-watchdog.toml", &text)
}

/// What one run gave: the hang detections with their latency from the
/// hang's start (µs), and the workload's counters.
struct Outcome {
    detections: Vec<(Detection, f64)>,
    workload: Vec<(String, u64)>,
    spinner: Vec<(String, u64)>,
}

impl Outcome {
    /// A counter of the workload's.
    fn counter(&self, name: &str) -> u64 {
        find(&self.workload, name)
    }
}

fn find(counters: &[(String, u64)], name: &str) -> u64 {
    counters
        .iter()
        .find(|(n, _)| n == name)
        .map_or(0, |(_, v)| *v)
}

/// Runs the system until the workload finishes; stops each thread that
/// spinner announces as stalling (hang kind 3).
fn run(system: &kintsugi_system::System) -> anyhow::Result<Outcome> {
    let roster = Roster::new();
    let done = Arc::new(AtomicBool::new(false));
    let freezer = {
        let (roster, done) = (roster.clone(), done.clone());
        std::thread::spawn(move || {
            let mut seen = 0;
            let mut tracers = Vec::new();
            while !done.load(Ordering::Relaxed) {
                let tid = roster.counter("spinner", "stall_tid");
                if tid != seen && tid != 0 {
                    seen = tid;
                    std::thread::sleep(Duration::from_millis(5));
                    match hold_until_death(tid as u32) {
                        Ok(t) => tracers.push(t),
                        Err(e) => eprintln!("bench watchdog: {e}"),
                    }
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            tracers.into_iter().for_each(|t| {
                let _ = t.join();
            });
        })
    };
    let mut detections = Vec::new();
    let options = Options {
        stop_when_finished: Some("workload".into()),
        interfaces: kintsugi_interfaces::ALL.to_vec(),
        roster: Some(roster.clone()),
        component_stdout: kintsugi_supervisor::ComponentStdout::Stderr,
        ..Options::default()
    };
    let report = kintsugi_supervisor::run(system, options, &mut |e| {
        if let Event::FaultReported { detail, .. } = e {
            let at = monotonic_ns();
            let began = roster.counter("spinner", "hang_ns");
            if let Ok(d) = detail.parse::<Detection>() {
                detections.push((d, at.saturating_sub(began) as f64 / 1e3));
            }
        }
    });
    done.store(true, Ordering::Relaxed);
    let _ = freezer.join();
    let report = report?;
    if !report.success() {
        anyhow::bail!("benchmark system did not end cleanly: {report:?}");
    }
    Ok(Outcome {
        detections,
        workload: roster.counters("workload"),
        spinner: roster.counters("spinner"),
    })
}

pub fn watchdog(
    hangs: u32,
    fp_calls: u64,
    overhead_calls: u64,
    rounds: u32,
    load: usize,
) -> anyhow::Result<bool> {
    println!("kintsugi bench watchdog: spinner under spin-workload (every result checked), [watchdog] defaults");
    println!("but stuck_ms = 500. The machine is a noisy 2-core VM.");
    if load > 0 {
        println!("Coverage and false positives are measured under load: {load} busy threads (nice 0) spin meanwhile.");
    }
    println!();
    let mut ok = true;
    let hogs = (load > 0).then(|| Load::start(load));

    // Coverage and latency.
    println!("| hang injected | injected | detected | detected as | bound (median) | latency p50 | latency p90 | latency max | client errors / wrong results |");
    println!("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |");
    let kinds = [
        (1, "infinite loop in an invocation", ""),
        (2, "wait nobody ends, in an invocation", ""),
        (3, "stopped thread (ptrace), in an invocation", ""),
        (
            4,
            "infinite loop in section `batch` (background thread)",
            "batch_every_ms = 2",
        ),
    ];
    for (kind, label, spinner) in kinds {
        let list: Vec<String> = (0..hangs)
            .map(|i| format!("{{ at_op = {}, kind = {kind} }}", 300 + i * 300))
            .collect();
        let workload = format!(
            "ops = {}\nsmall_units = [1, 2000]\nnap_ms = 300\nhangs = [{}]",
            300 + hangs * 300,
            list.join(", ")
        );
        let out = run(&system(true, spinner, &workload)?)?;
        let injected = out.counter("hangs");
        let lat: Vec<f64> = out.detections.iter().map(|(_, l)| l / 1e3).collect();
        let bounds: Vec<f64> = out
            .detections
            .iter()
            .map(|(d, _)| d.bound.as_secs_f64() * 1e3)
            .collect();
        let mut how: Vec<String> = out
            .detections
            .iter()
            .map(|(d, _)| format!("{:?}", d.kind).to_lowercase())
            .collect();
        how.dedup();
        let (l, b) = (Summary::of(&lat), Summary::of(&bounds));
        let ms = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.1} ms"));
        println!(
            "| {label} | {injected} | {} | {} | {} | {} | {} | {} | {} / {} |",
            out.detections.len(),
            how.join(", "),
            ms(b.map(|b| b.p50)),
            ms(l.map(|l| l.p50)),
            ms(l.map(|l| l.p90)),
            ms(l.map(|l| l.max)),
            out.counter("errors"),
            out.counter("mismatches"),
        );
        ok &= out.detections.len() as u64 == injected && injected == u64::from(hangs);
        ok &= out.counter("errors") == 0 && out.counter("mismatches") == 0;
    }

    // False positives.
    let out = run(&system(
        true,
        "batch_every_ms = 1\nbatch_units = 300\nlarge_units = 20000\nlarge_every = 50",
        &format!("ops = {fp_calls}\nsmall_units = [1, 400]\nlarge_units = 20000\nlarge_every = 200\nnap_ms = 1000"),
    )?)?;
    let batches = find(&out.spinner, "batches");
    println!("\nFalse positives: {fp_calls} checked invocations of `spin.work` (1–400 units, about 0.5 µs each; one");
    println!("in 200 of 20,000 units, about 10 ms: a rare long run after many short ones), each in section `work`,");
    println!("and {batches} runs of section `batch` on a background thread (150–450 units, one in 50 of 20,000), after a");
    println!("1 s declared blocking wait (`spin.nap`).\n");
    println!("| runs without a fault | hangs reported | client errors / wrong results |");
    println!("| ---: | ---: | ---: |");
    println!(
        "| {} | {} | {} / {} |",
        fp_calls + batches,
        out.detections.len(),
        out.counter("errors"),
        out.counter("mismatches")
    );
    ok &= out.detections.is_empty();
    if let Some(figures) = hogs.map(Load::finish) {
        println!("\nLoad during coverage and false positives: {figures}.");
    }

    // Overhead.
    let workload = format!("ops = {overhead_calls}\nsmall_units = [1, 20]");
    let configurations = [
        ("watchdog off (baseline)", false, "work_section = false"),
        (
            "watchdog on: invocation stretches (SHD, timestamp check)",
            true,
            "work_section = false",
        ),
        (
            "watchdog on, and every call in a checked section (AHD)",
            true,
            "work_section = true",
        ),
    ];
    let mut per_call = vec![Vec::new(); configurations.len()];
    for _ in 0..rounds {
        for ((_, wd, spinner), into) in configurations.iter().zip(&mut per_call) {
            let out = run(&system(*wd, spinner, &workload)?)?;
            into.push(out.counter("elapsed_ns") as f64 / overhead_calls as f64 / 1e3);
        }
    }
    println!("\nOverhead: {overhead_calls} calls of `spin.work` (1–20 units, a few µs) per run, {rounds} runs of each");
    println!("configuration, interleaved.\n");
    println!("| configuration | µs per call (median of runs) | mean of runs | ratio (medians) |");
    println!("| --- | ---: | ---: | ---: |");
    let base = Summary::of(&per_call[0]).expect("rounds").p50;
    for ((label, _, _), samples) in configurations.iter().zip(&per_call) {
        let s = Summary::of(samples).expect("rounds");
        println!(
            "| {label} | {:.3} | {:.3} | {:.4}× |",
            s.p50,
            s.mean,
            s.p50 / base
        );
    }
    Ok(ok)
}

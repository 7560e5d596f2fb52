//! `kintsugi bench kv`: checkpoint recovery (`recovery = "checkpoint"`)
//! of the kv store measured, all in one run: its throughput under two
//! checking client components with checkpoints every 1,000, 100 and 10 ms
//! against kv with no recovery at all (no checkpoint, no request log); the
//! recovery time (restore plus replay) of kills at random instants with
//! checkpoints every 100 ms; and the recovery time against the length of
//! the log replayed, with one checkpoint and then none.

use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use kintsugi_supervisor::{Event, Options};

use kintsugi_supervisor::stats::Summary;

/// kv and a workload component at full speed (a second one, [`W2`], for
/// the recovery runs).
const SYSTEM: &str = r#"
[system]
name = "bench-kv"

[[component]]
name = "kv"
binary = "kintsugi-kv"
provides = ["kv"]
RECOVERY
KV_CPUS
restart = { max = 100000, window_ms = 1000 }

[[component]]
name = "w1"
binary = "kintsugi-kv-workload"
uses = ["kv"]
W1_CPUS
[component.config]
seed = 1
threads = THREADS
ops = OPS
think_us = 0
report = "DIR/w1.json"

"#;

const W2: &str = r#"
[[component]]
name = "w2"
binary = "kintsugi-kv-workload"
uses = ["kv"]
[component.config]
seed = 2
threads = THREADS
ops = OPS
think_us = 0
report = "DIR/w2.json"
"#;

pub(crate) fn row(cells: &[String]) {
    println!("| {} |", cells.join(" | "));
}

/// Whether the timed runs pin kv to CPU 1 and their client to CPU 0
/// (`cpus = […]`), so that every configuration runs its two spinning
/// threads placed alike (the spread between runs stayed as large:
/// `docs/benchmarks.md`, "The whole-system throughput pinned").
fn pinned() -> bool {
    crate::cpus_0_and_1().is_some()
}

/// The system with kv checkpointed every `recovery` ms (none: no
/// recovery), a request log of `journal_kib` (0: the default), and `ops`
/// operations per client thread (0: until stopped).
fn system(
    recovery: Option<u64>,
    journal_kib: u64,
    ops: u64,
    dir: &Path,
) -> anyhow::Result<kintsugi_system::System> {
    // Timed runs use one client thread (a client and a worker spinning:
    // no more spinning threads than CPUs here), pinned apart where they
    // can be; the others two clients of two threads, as the tests do.
    let (threads, clients) = if ops > 0 { (1, "") } else { (2, W2) };
    let (kv_cpus, w1_cpus) = match ops > 0 && pinned() {
        true => ("cpus = [1]", "cpus = [0]"),
        false => ("", ""),
    };
    let journal = match journal_kib {
        0 => String::new(),
        kib => format!("\njournal_kib = {kib}"),
    };
    let text = (SYSTEM.to_string() + clients)
        .replace(
            "RECOVERY",
            &recovery.map_or(String::new(), |ms| {
                format!("recovery = \"checkpoint\"\ncheckpoint = {{ every_ms = {ms} }}{journal}")
            }),
        )
        .replace("KV_CPUS", kv_cpus)
        .replace("W1_CPUS", w1_cpus)
        .replace("OPS", &ops.to_string())
        .replace("THREADS", &threads.to_string())
        .replace("DIR", &dir.display().to_string());
    crate::parse_system("bench-kv (built in)", &text)
}

/// Operations per second of the timed run's client, from its report
/// (which must be clean).
fn rate(dir: &Path) -> anyhow::Result<f64> {
    let path = dir.join("w1.json");
    let text = std::fs::read_to_string(&path).with_context(|| path.display().to_string())?;
    let r: serde_json::Value = serde_json::from_str(&text)?;
    anyhow::ensure!(
        r["errors"] == 0 && r["counter"] == r["increments"],
        "the client saw errors: {r}"
    );
    let ops: f64 = r["completed"]
        .as_array()
        .context("completed")?
        .iter()
        .filter_map(|c| c.as_f64())
        .sum();
    let elapsed_ms = r["elapsed_ms"].as_f64().context("elapsed_ms")?;
    std::fs::remove_file(&path)?;
    Ok(ops / (elapsed_ms / 1e3))
}

fn throughput_table(ops: u64, repeats: usize, dir: &Path) -> anyhow::Result<()> {
    let placement = match pinned() {
        true => "kv pinned to CPU 1 and the client to CPU 0",
        false => "not pinned: fewer than CPUs 0 and 1 allowed",
    };
    println!(
        "### Throughput: kv under a checking client thread ({ops} operations, no pause, {placement}; median of {repeats}, the configurations taking turns)\n"
    );
    row(&[
        "kv's recovery",
        "ops/s",
        "× none",
        "90 % interval of × none",
        "runs (ops/s)",
    ]
    .map(String::from));
    row(&["---", "---:", "---:", "---:", "---"].map(String::from));
    let configs = [None, Some(1000), Some(100), Some(10)];
    let mut runs = vec![Vec::new(); configs.len()];
    for _ in 0..repeats {
        for (i, recovery) in configs.iter().enumerate() {
            let options = Options {
                stop_when_finished: Some("w1".into()),
                interfaces: kintsugi_interfaces::ALL.to_vec(),
                ..Default::default()
            };
            crate::run_collecting(&system(*recovery, 0, ops, dir)?, options)?;
            runs[i].push(rate(dir)?);
        }
    }
    // Runs of one configuration spread by more than the costs measured
    // (a factor of 1.5 on this VM, not a drift that comparing neighbours
    // takes out): how far the ratio of medians can be trusted is shown by
    // resampling the runs.
    let base = crate::median_of(&mut runs[0].clone());
    let none = runs[0].clone();
    for (recovery, mut v) in configs.into_iter().zip(runs) {
        let (low, high) = crate::ratio_interval(&v, &none);
        let m = crate::median_of(&mut v);
        row(&[
            recovery.map_or("none (no checkpoint, no log)".into(), |ms| {
                format!("checkpoint every {ms} ms + log")
            }),
            format!("{m:.0}"),
            format!("{:.3}", m / base),
            format!("{low:.3}–{high:.3}"),
            v.iter()
                .map(|r| format!("{r:.0}"))
                .collect::<Vec<_>>()
                .join(", "),
        ]);
    }
    println!();
    Ok(())
}

/// One checkpoint recovery as the event log tells it.
struct Recovery {
    entries: u64,
    /// Pages of the new incarnation written, and compared with the image.
    pages: u64,
    compared: u64,
    /// System calls made to put the mappings back.
    layout_calls: u64,
    pause: Duration,
    replay: Duration,
    /// From the death's detection to the incarnation serving again.
    total: Duration,
}

fn recoveries(events: &[Event]) -> Vec<Recovery> {
    let mut out = Vec::new();
    let mut pending = None;
    for e in events {
        match e {
            Event::Replayed {
                entries,
                pages,
                compared,
                layout_calls,
                pause,
                replay,
                ..
            } => {
                pending = Some(Recovery {
                    entries: *entries,
                    pages: *pages,
                    compared: *compared,
                    layout_calls: *layout_calls,
                    pause: *pause,
                    replay: *replay,
                    total: Duration::ZERO,
                })
            }
            Event::Rebooted { took, .. } => {
                if let Some(r) = pending.take() {
                    out.push(Recovery { total: *took, ..r });
                }
            }
            _ => {}
        }
    }
    out
}

fn ms(d: Duration) -> String {
    format!("{:.2}", d.as_secs_f64() * 1e3)
}

fn recovery_table(kills: u32, dir: &Path) -> anyhow::Result<()> {
    let events = crate::kill_repeatedly(
        &system(Some(100), 0, 0, dir)?,
        "kv",
        kills,
        (Duration::from_millis(50), Duration::from_millis(500)),
        None,
        true,
    )?;
    let r = recoveries(&events);
    anyhow::ensure!(!r.is_empty(), "no recovery in the event log");
    println!(
        "### Recovery: kv SIGKILLed {kills} times at random instants 50..500 ms apart, checkpoints every 100 ms, under the clients\n"
    );
    row(&["", "n", "p50", "p99", "max"].map(String::from));
    row(&["---", "---:", "---:", "---:", "---:"].map(String::from));
    let ms_of = |f: fn(&Recovery) -> Duration| -> Vec<f64> {
        r.iter().map(|x| f(x).as_secs_f64() * 1e3).collect()
    };
    let count_of =
        |f: fn(&Recovery) -> u64| -> Vec<f64> { r.iter().map(|x| f(x) as f64).collect() };
    for (what, v, digits) in [
        ("restore, kv held (ms)", ms_of(|x| x.pause), 2),
        ("pages compared with the image", count_of(|x| x.compared), 0),
        ("pages written", count_of(|x| x.pages), 0),
        (
            "calls to put the mappings back",
            count_of(|x| x.layout_calls),
            0,
        ),
        ("replay (ms)", ms_of(|x| x.replay), 2),
        ("recovery, detection to serving (ms)", ms_of(|x| x.total), 2),
        (
            "of which neither restore nor replay (ms)",
            ms_of(|x| x.total.saturating_sub(x.pause + x.replay)),
            2,
        ),
        ("requests replayed", count_of(|x| x.entries), 0),
    ] {
        let s = Summary::of(&v).expect("non-empty");
        row(&[
            what.to_string(),
            s.n.to_string(),
            format!("{:.digits$}", s.p50),
            format!("{:.digits$}", s.p99),
            format!("{:.digits$}", s.max),
        ]);
    }
    println!();
    Ok(())
}

/// Recovery against the log's length: one checkpoint requested early, no
/// periodic ones (the interval is an hour, the log 512 MiB), and kills at
/// random instants 50..1,000 ms apart. Each recovery that replays ends
/// with a checkpoint, so each kill replays what was logged since the
/// recovery before it: as long a log as the interval was long.
fn length_table(kills: u32, dir: &Path) -> anyhow::Result<()> {
    // A log large enough that it never asks for a checkpoint of its own.
    let system = system(Some(3_600_000), 512 * 1024, 0, dir)?;
    let roster = kintsugi_supervisor::Roster::new();
    let asker = {
        let roster = roster.clone();
        std::thread::spawn(move || first_checkpoint(&roster, "kv"))
    };
    let options = Options {
        chaos: Some(kintsugi_inject::ChaosPlan {
            target: "kv".into(),
            signals: vec![nix::sys::signal::Signal::SIGKILL],
            min_interval: Duration::from_millis(50),
            max_interval: Duration::from_millis(1000),
            count: Some(kills),
            seed: 1,
        }),
        stop_after_chaos: true,
        interfaces: kintsugi_interfaces::ALL.to_vec(),
        roster: Some(roster),
        ..Default::default()
    };
    let events = crate::run_collecting(&system, options)?;
    match asker.join() {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => anyhow::bail!("no checkpoint of kv taken: {e}"),
        Err(_) => anyhow::bail!("the thread asking for kv's checkpoint panicked"),
    }
    println!(
        "### Recovery against the log's length: SIGKILLs 50..1,000 ms apart under the clients, no periodic checkpoint (each replays what was logged since the recovery before it, which ended with a checkpoint), by length\n"
    );
    row(&[
        "requests replayed",
        "restore (ms)",
        "replay (ms)",
        "µs per request",
        "recovery (ms)",
    ]
    .map(String::from));
    row(&["---:", "---:", "---:", "---:", "---:"].map(String::from));
    let mut by_length = recoveries(&events);
    by_length.sort_by_key(|r| r.entries);
    for r in by_length {
        row(&[
            r.entries.to_string(),
            ms(r.pause),
            ms(r.replay),
            format!(
                "{:.2}",
                r.replay.as_secs_f64() * 1e6 / r.entries.max(1) as f64
            ),
            ms(r.total),
        ]);
    }
    println!();
    Ok(())
}

/// Asks for `component`'s checkpoint once the system runs: from 100 ms
/// after the start, again every 50 ms while it is refused (the system not
/// yet started on a loaded machine, or the component between a kill and
/// its recovery), for up to 10 s. The last refusal is the error.
fn first_checkpoint(
    roster: &kintsugi_supervisor::Roster,
    component: &str,
) -> Result<kintsugi_supervisor::CheckpointSummary, String> {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    std::thread::sleep(Duration::from_millis(100));
    loop {
        match roster.checkpoint(component, None) {
            Ok(s) => return Ok(s),
            Err(e) if std::time::Instant::now() >= deadline => return Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

pub fn kv(ops: u64, repeats: usize, kills: u32, log_only: bool) -> anyhow::Result<bool> {
    anyhow::ensure!(
        ops > 0 && repeats > 0 && kills > 0,
        "counts must be positive"
    );
    println!("## kintsugi bench kv: checkpoint recovery of a store with no recovery code\n");
    crate::kv_log::table(50_000, 4 * repeats + 1);
    if log_only {
        return Ok(true);
    }
    let dir = std::env::temp_dir().join(format!("kintsugi-bench-kv-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    throughput_table(ops, repeats, &dir)?;
    recovery_table(kills, &dir)?;
    length_table(8, &dir)?;
    std::fs::remove_dir_all(&dir).ok();
    Ok(true)
}

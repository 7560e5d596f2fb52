//! `kintsugi bench checkpoint`: RMK's TAC and RTCR's incremental copying
//! measured on a live process (`kintsugi-ckpt-target`): the pause of an
//! incremental checkpoint by heap size and share of pages written, with and
//! without the pages read ahead while the process runs, against a baseline
//! in the same run that copies every page each time (RTCR's first
//! approach); restore time per kind; a workload's throughput with
//! checkpoints every 100 ms and every 10 ms against none; and a kintsugi
//! component's, idle and writing its heap, checkpointed by the supervisor.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use kintsugi_checkpoint::{file, Checkpointer, Stats};
use kintsugi_supervisor::stats::Summary;

/// The target process, driven over its stdin and stdout.
struct Target {
    child: Child,
    input: ChildStdin,
    output: BufReader<ChildStdout>,
}

fn target_binary() -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let path = exe.with_file_name("kintsugi-ckpt-target");
    if !path.exists() {
        bail!("{} not found (build the workspace)", path.display());
    }
    Ok(path)
}

impl Target {
    fn start(heap: u64, threads: u32) -> anyhow::Result<Self> {
        // Address randomization off (as the supervisor runs checkpointed
        // components), so that a second target has the first one's layout
        // and can take its image.
        let mut child = Command::new("setarch")
            .arg("-R")
            .arg(target_binary()?)
            .args([
                "--heap",
                &heap.to_string(),
                "--threads",
                &threads.to_string(),
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .context("start kintsugi-ckpt-target")?;
        let input = child.stdin.take().context("stdin")?;
        let output = BufReader::new(child.stdout.take().context("stdout")?);
        let mut t = Target {
            child,
            input,
            output,
        };
        t.expect_reply("ready")?;
        Ok(t)
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn expect_reply(&mut self, prefix: &str) -> anyhow::Result<String> {
        let mut line = String::new();
        self.output.read_line(&mut line)?;
        if !line.starts_with(prefix) {
            bail!("target answered {line:?}, not {prefix}");
        }
        Ok(line.trim().to_string())
    }

    fn cmd(&mut self, c: &str, reply: &str) -> anyhow::Result<String> {
        writeln!(self.input, "{c}")?;
        self.input.flush()?;
        self.expect_reply(reply)
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn row(cells: &[String]) {
    println!("| {} |", cells.join(" | "));
}

/// Pauses of `rounds` checkpoints, each after `permille` of the pages are
/// written; the first (which copies every resident page) is not counted.
/// `ahead`: each checkpoint's pages are read ahead first, while the target
/// runs (it is idle, its command done); the second summary is the whole
/// time of the read-ahead and the checkpoint.
fn pauses(
    c: &mut Checkpointer,
    t: &mut Target,
    permille: u32,
    rounds: usize,
    ahead: bool,
) -> anyhow::Result<(Summary, Stats, Option<Summary>)> {
    c.checkpoint()?;
    let mut samples = Vec::new();
    let mut whole = Vec::new();
    let mut last = Stats::default();
    for r in 0..rounds {
        t.cmd(&format!("mutate {permille} {r}"), "done")?;
        last = match ahead {
            true => {
                let started = Instant::now();
                let taken = c.with_read_ahead(|c| c.checkpoint())?;
                whole.push(ms(started.elapsed()));
                taken
            }
            false => c.checkpoint()?,
        };
        samples.push(ms(last.pause));
    }
    let summary = Summary::of(&samples).context("no rounds")?;
    Ok((summary, last, Summary::of(&whole)))
}

fn pause_table(heaps_mib: &[u64], rounds: usize) -> anyhow::Result<()> {
    println!("### Pause per checkpoint (ms), incremental against copying every page\n");
    row(&[
        "heap",
        "written",
        "incremental p50",
        "p99 (n)",
        "pages copied",
        "read ahead: pause p50",
        "p99",
        "pages in the pause",
        "read-ahead and checkpoint p50 (target running, then held)",
        "every page p50 (n)",
        "ratio (incremental, read ahead)",
    ]
    .map(String::from));
    row(&[
        "---", "---:", "---:", "---:", "---:", "---:", "---:", "---:", "---:", "---:", "---:",
    ]
    .map(String::from));
    for &mib in heaps_mib {
        let mut t = Target::start(mib << 20, 2)?;
        let mut inc = Checkpointer::attach(t.pid())?;
        let mut ahead_t = Target::start(mib << 20, 2)?;
        let mut ahead = Checkpointer::attach(ahead_t.pid())?;
        let mut base_t = Target::start(mib << 20, 2)?;
        let mut full = Checkpointer::attach(base_t.pid())?;
        full.set_full_copy(true);
        for permille in [1u32, 10, 100] {
            let (s, last, _) = pauses(&mut inc, &mut t, permille, rounds, false)?;
            let (a, a_last, whole) = pauses(&mut ahead, &mut ahead_t, permille, rounds, true)?;
            let whole = whole.context("no read-ahead")?;
            let (b, _, _) = pauses(&mut full, &mut base_t, permille, rounds.min(5), false)?;
            row(&[
                format!("{mib} MiB"),
                format!("{:.1} %", permille as f64 / 10.0),
                format!("{:.3}", s.p50),
                format!("{:.3} ({})", s.p99, s.n),
                last.pages.to_string(),
                format!("{:.3}", a.p50),
                format!("{:.3}", a.p99),
                format!("{} (+{} read ahead)", a_last.pages, a_last.read_ahead),
                format!("{:.3}", whole.p50),
                format!("{:.2} ({})", b.p50, b.n),
                format!("{:.3}, {:.3}", s.p50 / b.p50, a.p50 / b.p50),
            ]);
        }
    }
    println!();
    Ok(())
}

fn restore_table(mib: u64, rounds: usize, dir: &std::path::Path) -> anyhow::Result<()> {
    println!(
        "### Restore of a {mib} MiB heap with 1 % of its pages written since the checkpoint (ms)\n"
    );
    row(&["kind", "p50", "p99 (n)", "pages written", "image file"].map(String::from));
    row(&["---", "---:", "---:", "---:", "---"].map(String::from));
    let mut t = Target::start(mib << 20, 2)?;
    let mut c = Checkpointer::attach(t.pid())?;
    c.checkpoint()?;
    let digest = t.cmd("digest", "ok")?;
    let mut in_place = Vec::new();
    let mut pages = 0;
    for r in 0..rounds {
        t.cmd(&format!("mutate 10 {r}"), "done")?;
        let s = c.restore_in_place()?;
        pages = s.pages;
        in_place.push(ms(s.pause));
    }
    anyhow::ensure!(
        t.cmd("digest", "ok")? == digest,
        "in-place restore lost the checkpoint"
    );
    let s = Summary::of(&in_place).context("rounds")?;
    row(&[
        "in place".into(),
        format!("{:.3}", s.p50),
        format!("{:.3} ({})", s.p99, s.n),
        pages.to_string(),
        "-".into(),
    ]);

    let path = dir.join("bench.ksgckpt");
    let (mut write, mut read, mut restore) = (Vec::new(), Vec::new(), Vec::new());
    let mut size = 0;
    for r in 0..rounds.min(10) {
        let at = Instant::now();
        size = file::write(c.image(), &path)?;
        write.push(ms(at.elapsed()));
        t.cmd(&format!("mutate 10 {r}"), "done")?;
        let at = Instant::now();
        let image = file::read(&path)?;
        read.push(ms(at.elapsed()));
        let s = c.restore_image(image)?;
        pages = s.pages;
        restore.push(ms(s.pause));
    }
    let image_pages = pages;
    std::fs::remove_file(&path).ok();
    anyhow::ensure!(
        t.cmd("digest", "ok")? == digest,
        "image restore lost the checkpoint"
    );
    // Into a new process of the same program, its heap filled the same
    // way (as a standby forked from the same pristine image): mappings
    // of the same kind are kept, every page the image holds is compared,
    // and only those that differ are written.
    let mut fresh = Vec::new();
    for _ in 0..rounds.min(10) {
        let mut other = Target::start(mib << 20, 2)?;
        let mut oc = Checkpointer::attach(other.pid())?;
        let frozen = kintsugi_checkpoint::Frozen::freeze(other.pid())?;
        let s = oc.restore_new_frozen(&frozen, c.image().clone())?;
        fresh.push(ms(frozen.held()));
        drop(frozen);
        pages = s.pages;
        anyhow::ensure!(
            other.cmd("digest", "ok")? == digest,
            "a restore into a new process lost the checkpoint"
        );
    }
    let s = Summary::of(&fresh).context("rounds")?;
    row(&[
        "new process: restore (pages compared)".into(),
        format!("{:.3}", s.p50),
        format!("{:.3} ({})", s.p99, s.n),
        pages.to_string(),
        "-".into(),
    ]);
    for (kind, v) in [
        ("image file: write", &write),
        ("image file: read and check", &read),
        ("image file: restore (whole)", &restore),
    ] {
        let s = Summary::of(v).context("rounds")?;
        row(&[
            kind.into(),
            format!("{:.3}", s.p50),
            format!("{:.3} ({})", s.p99, s.n),
            if kind.ends_with("(whole)") {
                image_pages.to_string()
            } else {
                "-".into()
            },
            format!("{:.1} MiB (zstd)", size as f64 / (1 << 20) as f64),
        ]);
    }
    println!();
    Ok(())
}

/// Commands of the target's workload (`mutate 1`: 0.1 % of a 64 MiB heap
/// written per command) answered in `secs`, with a checkpoint every
/// `every` (none if `None`) taken by another thread, each read ahead
/// first in up to `rounds` rounds (while the workload runs; 0: not).
/// One throughput run: commands a second, checkpoints taken, and their
/// pause's p50 (ms).
#[derive(Debug, Clone, Copy)]
struct Run {
    rate: f64,
    taken: usize,
    pause_p50: f64,
}

fn throughput(every: Option<Duration>, rounds: usize, secs: f64) -> anyhow::Result<Run> {
    let mut t = Target::start(64 << 20, 2)?;
    let stop = Arc::new(AtomicBool::new(false));
    let ckpt = every.map(|every| {
        let (pid, stop) = (t.pid(), stop.clone());
        std::thread::spawn(move || -> anyhow::Result<Vec<f64>> {
            let mut c = Checkpointer::attach(pid)?;
            c.set_read_ahead_rounds(rounds);
            let mut pauses = Vec::new();
            let mut next = Instant::now();
            while !stop.load(Ordering::SeqCst) {
                let taken = match rounds {
                    0 => c.checkpoint()?,
                    _ => c.with_read_ahead(|c| c.checkpoint())?,
                };
                pauses.push(ms(taken.pause));
                next += every;
                std::thread::sleep(next.saturating_duration_since(Instant::now()));
            }
            Ok(pauses)
        })
    });
    let start = Instant::now();
    let mut n = 0u64;
    while start.elapsed().as_secs_f64() < secs {
        t.cmd(&format!("mutate 1 {n}"), "done")?;
        n += 1;
    }
    let rate = n as f64 / start.elapsed().as_secs_f64();
    stop.store(true, Ordering::SeqCst);
    let pauses = match ckpt {
        Some(h) => h
            .join()
            .map_err(|_| anyhow::anyhow!("checkpoint thread panicked"))??,
        None => Vec::new(),
    };
    Ok(Run {
        rate,
        taken: pauses.len(),
        pause_p50: Summary::of(&pauses).map_or(0.0, |s| s.p50),
    })
}

fn throughput_table(secs: f64, repeats: usize) -> anyhow::Result<()> {
    println!("### Workload throughput (64 MiB heap, 0.1 % of its pages (16) written per command, {secs} s runs, median of {repeats})\n");
    row(&[
        "checkpoints",
        "commands/s",
        "× none",
        "checkpoints taken",
        "pause p50 (ms)",
    ]
    .map(String::from));
    row(&["---", "---:", "---:", "---:", "---:"].map(String::from));
    let (ms100, ms10) = (Duration::from_millis(100), Duration::from_millis(10));
    let configs = [
        ("none", None, 0),
        ("every 100 ms", Some(ms100), 0),
        ("every 100 ms, read ahead once", Some(ms100), 1),
        ("every 100 ms, read ahead in rounds", Some(ms100), 4),
        ("every 10 ms", Some(ms10), 0),
        ("every 10 ms, read ahead once", Some(ms10), 1),
        ("every 10 ms, read ahead in rounds", Some(ms10), 4),
    ];
    let mut results = vec![Vec::new(); configs.len()];
    // Interleaved, so that drift in the machine's speed hits all alike.
    for _ in 0..repeats {
        for (i, (_, every, rounds)) in configs.iter().enumerate() {
            results[i].push(throughput(*every, *rounds, secs)?);
        }
    }
    // The run of median rate, whole: its checkpoints and pauses with it.
    let median = |v: &mut Vec<Run>| {
        v.sort_by(|a, b| a.rate.total_cmp(&b.rate));
        v[v.len() / 2]
    };
    let none = median(&mut results[0]).rate;
    for (i, (name, _, _)) in configs.iter().enumerate() {
        let Run {
            rate,
            taken,
            pause_p50: p50,
        } = median(&mut results[i]);
        row(&[
            name.to_string(),
            format!("{rate:.0}"),
            format!("{:.3}", rate / none),
            taken.to_string(),
            if taken > 0 {
                format!("{p50:.3}")
            } else {
                "-".into()
            },
        ]);
    }
    println!();
    Ok(())
}

pub fn checkpoint(
    heaps_mib: &[u64],
    rounds: usize,
    secs: f64,
    repeats: usize,
) -> anyhow::Result<bool> {
    anyhow::ensure!(
        rounds > 0 && repeats > 0 && !heaps_mib.is_empty(),
        "sizes must be positive"
    );
    println!("kintsugi bench checkpoint: a live process (kintsugi-ckpt-target) checkpointed from outside;");
    println!("pause = from the first thread stopped to the last one let go.\n");
    pause_table(heaps_mib, rounds)?;
    let dir = std::env::temp_dir().join(format!("kintsugi-bench-ckpt-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let restored = restore_table(heaps_mib[heaps_mib.len() / 2], rounds, &dir);
    std::fs::remove_dir_all(&dir).ok();
    restored?;
    throughput_table(secs, repeats)?;
    component_table(
        "A component under its client: echo calls per second (bench-echo with a 64 MiB heap)",
        &[
            ("none", None),
            ("every 100 ms", Some("checkpoint = { every_ms = 100 }")),
            ("every 10 ms", Some("checkpoint = { every_ms = 10 }")),
        ],
        0,
        secs,
        repeats,
    )?;
    component_table(
        "A component that keeps writing: bench-echo writing 16 pages of its 64 MiB heap a millisecond, under its client",
        &[
            ("none", None),
            (
                "every 100 ms, never read ahead",
                Some("checkpoint = { every_ms = 100, read_ahead_pages = 1099511627776 }"),
            ),
            ("every 100 ms, read ahead (default)", Some("checkpoint = { every_ms = 100 }")),
        ],
        16,
        secs,
        repeats,
    )?;
    Ok(true)
}

/// The system of [`component_table`]: bench-echo with a 64 MiB heap, its
/// checkpoint policy in place of `CHECKPOINT`, under echo-checker.
const COMPONENT_SYSTEM: &str = r#"
[system]
name = "bench-checkpoint"

[[component]]
name = "echo"
binary = "kintsugi-bench-echo"
provides = ["bench"]
CHECKPOINT
[component.config]
grow_mib = 64
grow_after_ms = 1
write_pages_per_ms = WRITES

[[component]]
name = "checker"
binary = "kintsugi-echo-checker"
uses = ["bench"]
[component.config]
duration_ms = DURATION
report_ms = 100000
report_file = "REPORT"
"#;

/// One run of [`COMPONENT_SYSTEM`] with `checkpoint` as echo's policy
/// line (none if `None`) and echo writing `writes` pages a millisecond:
/// the checker's calls per second, and the supervisor's summaries of five
/// checkpoints requested 100 ms apart in the run's second half (with its
/// count of periodic checkpoints taken and skipped).
fn component_run(
    checkpoint: Option<&str>,
    writes: u32,
    secs: f64,
    dir: &std::path::Path,
) -> anyhow::Result<(f64, Vec<kintsugi_supervisor::CheckpointSummary>)> {
    let report = dir.join("report.jsonl");
    std::fs::remove_file(&report).ok();
    let text = COMPONENT_SYSTEM
        .replace("CHECKPOINT", checkpoint.unwrap_or_default())
        .replace("WRITES", &writes.to_string())
        .replace("DURATION", &((secs * 1000.0) as u64).to_string())
        .replace("REPORT", &report.display().to_string());
    let system = crate::parse_system("bench-checkpoint (built in)", &text)?;
    let roster = kintsugi_supervisor::Roster::new();
    let asker = {
        let roster = roster.clone();
        let ask = checkpoint.is_some();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs_f64(secs * 0.5));
            (0..5)
                .filter_map(|_| {
                    std::thread::sleep(Duration::from_millis(100));
                    ask.then(|| roster.checkpoint("echo", None).ok()).flatten()
                })
                .collect()
        })
    };
    let options = kintsugi_supervisor::Options {
        stop_when_finished: Some("checker".into()),
        interfaces: kintsugi_interfaces::ALL.to_vec(),
        roster: Some(roster),
        ..Default::default()
    };
    crate::run_collecting(&system, options)?;
    let summaries = asker.join().unwrap_or_default();
    let text = std::fs::read_to_string(&report).with_context(|| format!("{}", report.display()))?;
    let last: serde_json::Value = serde_json::from_str(text.lines().last().unwrap_or("{}"))?;
    anyhow::ensure!(
        last["wrong"] == 0 && last["failed"] == 0,
        "the checker saw errors: {last}"
    );
    let calls = last["calls"].as_f64().context("calls")?;
    Ok((calls / secs, summaries))
}

/// Echo's throughput under its checker with each of `configs` (a label
/// and echo's checkpoint policy line), echo writing `writes` pages a
/// millisecond, with the pause of the checkpoints requested in the runs.
fn component_table(
    title: &str,
    configs: &[(&str, Option<&str>)],
    writes: u32,
    secs: f64,
    repeats: usize,
) -> anyhow::Result<()> {
    println!("### {title} ({secs} s runs, median of {repeats})\n");
    row(&[
        "checkpoints",
        "calls/s",
        "× none",
        "periodic taken",
        "skipped",
        "pause p50 (ms, requested ones)",
        "pages in the pause",
        "pages read ahead",
    ]
    .map(String::from));
    row(&[
        "---", "---:", "---:", "---:", "---:", "---:", "---:", "---:",
    ]
    .map(String::from));
    let dir = std::env::temp_dir().join(format!("kintsugi-bench-ckpt-sys-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let mut none = None;
    for (label, checkpoint) in configs {
        let mut runs = Vec::new();
        let mut summaries = Vec::new();
        for _ in 0..repeats {
            let (rate, s) = component_run(*checkpoint, writes, secs, &dir)?;
            runs.push(rate);
            summaries.extend(s);
        }
        let rate = crate::median_of(&mut runs);
        let base = *none.get_or_insert(rate);
        let of = |f: fn(&kintsugi_supervisor::CheckpointSummary) -> f64| {
            crate::median_of(&mut summaries.iter().map(f).collect::<Vec<_>>())
        };
        let counted = match summaries.last() {
            Some(s) => [
                s.periodic_taken.to_string(),
                s.periodic_skipped.to_string(),
                format!(
                    "{:.3} (n = {})",
                    of(|s| s.pause_us as f64) / 1000.0,
                    summaries.len()
                ),
                format!("{:.0}", of(|s| s.pages as f64)),
                format!("{:.0}", of(|s| s.read_ahead as f64)),
            ],
            None => ["-", "-", "-", "-", "-"].map(String::from),
        };
        let mut cells = vec![
            label.to_string(),
            format!("{rate:.0}"),
            format!("{:.3}", rate / base),
        ];
        cells.extend(counted);
        row(&cells);
    }
    std::fs::remove_dir_all(&dir).ok();
    println!();
    Ok(())
}

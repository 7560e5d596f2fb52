//! Checkpoint recovery (`recovery = "checkpoint"`) of kv, a key-value
//! store with no recovery code of its own, under three client components
//! of two threads each that check every answer against a model:
//!
//! - kv is killed at least 200 times at random instants (SIGKILL and SIGSEGV,
//!   inside requests, between them and inside checkpoints, which are
//!   taken every 20 ms): every new incarnation gets the last checkpoint
//!   and replays the log, and no client sees an error, a lost update, an
//!   update applied twice, or a value that differs from its model;
//! - kv is hung (stopped) four times: the watchdog finds each hang, the
//!   supervisor rolls kv back in place (the same pid, never a reboot) and
//!   it replays its log, and again no client sees anything wrong.

mod common;

use std::path::{Path, PathBuf};
use std::time::Instant;

use common::*;
use serde_json::Value;

/// How kv is checkpointed and how hard its clients drive it.
struct Load {
    /// kv's `checkpoint` and `journal_kib` keys.
    kv: &'static str,
    clients: &'static [&'static str],
    think_us: u64,
}

/// Checkpoints every 20 ms; three clients pausing 100 µs between calls.
const GENTLE: Load = Load {
    kv: "checkpoint = { every_ms = 20 }",
    clients: &["w1", "w2", "w3"],
    think_us: 100,
};

fn kv_system(dir: &Path, seed: u64, watchdog: bool, load: &Load) -> PathBuf {
    let mut toml = String::from("[system]\nname = \"kv-test\"\n");
    if watchdog {
        toml += "\n[watchdog]\nperiod_us = 1000\nstuck_ms = 300\ndefault_bound_us = 100000\n";
    }
    toml += r#"
[[component]]
name = "kv"
binary = "kintsugi-kv"
provides = ["kv"]
recovery = "checkpoint"
restart = { max = 100000, window_ms = 1000 }
"#;
    toml += load.kv;
    toml += "\n";
    for (i, name) in load.clients.iter().enumerate() {
        toml += &format!(
            r#"
[[component]]
name = "{name}"
binary = "kintsugi-kv-workload"
uses = ["kv"]
[component.config]
seed = {}
threads = 2
ops = 0
keys = 48
think_us = {}
"#,
            seed + i as u64,
            load.think_us
        );
    }
    write(dir, "kv.toml", &toml)
}

/// Runs the system under `chaos` until the injections are done; returns
/// stdout (events and reports) and stderr, having checked that it
/// succeeded, that nothing was left behind, and that no replay diverged.
fn run(test: &str, system: &Path, chaos: &[&str], seed: u64) -> (String, String) {
    let tag = unique_tag(test);
    let dir = scratch(&format!("{test}-run"));
    let started = Instant::now();
    let out = run_system(&tag, system)
        .env("XDG_RUNTIME_DIR", &dir)
        .args([
            "--kill",
            "kv",
            "--seed",
            &seed.to_string(),
            "--stop-after-kills",
        ])
        .args(chaos)
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    eprintln!("{test}: ran for {:.2} s", started.elapsed().as_secs_f64());
    assert!(
        out.status.success(),
        "kintsugi run failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(leftovers(&tag).is_empty(), "processes left behind");
    assert!(
        !stdout.contains("replay diverged") && !stderr.contains("replay diverged"),
        "a replay diverged:\n{stderr}"
    );
    (stdout, stderr)
}

/// Every workload's report: no error, no wrong answer, its counter equal
/// to its increments, work done by both threads.
fn reports_clean(stdout: &str, clients: &[&str]) {
    let reports: Vec<Value> = json_lines(stdout)
        .into_iter()
        .filter(|v| v.get("component").is_some())
        .collect();
    let mut names: Vec<&str> = reports
        .iter()
        .map(|r| r["component"].as_str().unwrap())
        .collect();
    names.sort_unstable();
    assert_eq!(names, clients, "one report per workload");
    for r in &reports {
        assert_eq!(r["errors"], 0, "{r}");
        assert_eq!(r["corrupt"], 0, "{r}");
        assert!(r["increments"].as_u64().unwrap() > 0, "{r}");
        assert_eq!(
            r["counter"], r["increments"],
            "no increment lost or doubled: {r}"
        );
        let completed = r["completed"].as_array().unwrap();
        assert!(
            completed.iter().all(|c| c.as_u64().unwrap() > 0),
            "both threads worked: {r}"
        );
    }
}

/// A checkpoint recovery of kv, as the event log tells it.
#[derive(Debug)]
struct Replay {
    kind: String,
    /// Requests replayed.
    entries: u64,
    /// Calls made to put the mappings back.
    layout_calls: u64,
}

/// The checkpoint recoveries of kv in the event log.
fn replays(stdout: &str) -> Vec<Replay> {
    events(stdout)
        .into_iter()
        .filter_map(|e| match e {
            Event::Replayed {
                component,
                kind,
                entries,
                layout_calls,
                ..
            } if component == "kv" => Some(Replay {
                kind,
                entries,
                layout_calls,
            }),
            _ => None,
        })
        .collect()
}

const RESTORED: &str = "restore and replay";

/// A system of kv (its `checkpoint` key `every_ms`) and one client, `w1`
/// (`threads`, `ops`, `think_us`), and a watchdog section if `watchdog`.
fn kv_and_w1(test: &str, seed: u64, every_ms: u32, client: &str, watchdog: &str) -> PathBuf {
    let toml = format!(
        r#"[system]
name = "{test}"
{watchdog}
[[component]]
name = "kv"
binary = "kintsugi-kv"
provides = ["kv"]
recovery = "checkpoint"
checkpoint = {{ every_ms = {every_ms} }}

[[component]]
name = "w1"
binary = "kintsugi-kv-workload"
uses = ["kv"]
[component.config]
seed = {seed}
keys = 16
{client}
"#
    );
    write(&scratch(test), &format!("{test}.toml"), &toml)
}

/// Runs `system` for `seconds`, handing `on_event` each event as it is
/// printed; returns stdout and stderr once the run is over, having
/// checked that it left no process behind.
fn run_watching(
    test: &str,
    system: &Path,
    seconds: u32,
    mut on_event: impl FnMut(Event),
) -> (String, String) {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;
    let tag = unique_tag(test);
    let mut child = run_system(&tag, system)
        .env("XDG_RUNTIME_DIR", scratch(&format!("{test}-run")))
        .args(["--duration", &seconds.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = child.stderr.take().unwrap();
    let stderr = std::thread::spawn(move || {
        let mut text = String::new();
        std::io::Read::read_to_string(&mut err, &mut text).unwrap();
        text
    });
    let mut stdout = String::new();
    for line in BufReader::new(child.stdout.take().unwrap()).lines() {
        let line = line.unwrap();
        stdout += &line;
        stdout += "\n";
        if let Some(event) = events(&line).pop() {
            on_event(event);
        }
    }
    let stderr = stderr.join().unwrap();
    child.wait().unwrap();
    assert!(leftovers(&tag).is_empty(), "processes left behind");
    (stdout, stderr)
}

/// A standby has every thread its incarnation will have once active, so
/// that a checkpoint taken at once after an activation finds them all and
/// restores into any later incarnation. One that found the thread that
/// watches for clients' deaths still to start (it was started after the
/// activation) could be restored into none: every try failed on the
/// thread count, and the ladder dropped kv's state (CI, 2026-12-07).
#[test]
fn a_standby_has_every_thread_its_incarnation_will_have() {
    let seed = seed("kv_threads");
    let system = kv_and_w1(
        "kv_threads",
        seed,
        1000,
        "threads = 1\nops = 0\nthink_us = 1000",
        "",
    );
    let mut counts = None;
    run_watching("kv_threads", &system, 2, |e| match e {
        Event::Started { component, pid, .. } if component == "kv" && counts.is_none() => {
            // Its standby is forked once it is active.
            std::thread::sleep(std::time::Duration::from_millis(500));
            counts = Some((threads(pid), standby_beside(pid).map(threads)));
        }
        _ => {}
    });
    let (live, standby) = counts.expect("kv started");
    assert!(live > 1, "kv runs {live} threads");
    assert_eq!(standby, Some(live), "the standby's threads, the live one's");
}

/// How many threads process `pid` runs.
fn threads(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task")).map_or(0, |d| d.count())
}

/// The other child of process `pid`'s parent (the supervisor) that runs
/// the same program with threads (not its zygote, which runs one).
fn standby_beside(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let parent: u32 = stat
        .rsplit(')')
        .next()?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    let comm = |p: u32| std::fs::read_to_string(format!("/proc/{p}/comm")).ok();
    std::fs::read_to_string(format!("/proc/{parent}/task/{parent}/children"))
        .ok()?
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .find(|&p| p != pid && comm(p) == comm(pid) && threads(p) > 1)
}

/// Sends `signal` to process `pid`.
fn signal(pid: u32, signal: rustix::process::Signal) {
    let pid = rustix::process::Pid::from_raw(pid as i32).unwrap();
    rustix::process::kill_process(pid, signal).unwrap();
}

#[test]
fn kv_keeps_every_update_through_200_crashes() {
    let seed = seed("kv_crashes");
    let dir = scratch("kv-crashes");
    let system = kv_system(&dir, seed, false, &GENTLE);
    let (stdout, _) = run(
        "kv_crashes",
        &system,
        &[
            "--signals",
            "kill,segv",
            "--kills",
            "206",
            "--kill-every",
            "10..40",
        ],
        seed,
    );
    reports_clean(&stdout, GENTLE.clients);
    let crashes = crashes(&stdout, "kv");
    let segv = crashes.iter().filter(|c| c.by(SIGSEGV)).count();
    let busy = crashes.iter().filter(|c| !c.in_flight.is_empty()).count();
    eprintln!(
        "kv_crashes: {} crashes, {segv} by SIGSEGV, {busy} with calls in flight",
        crashes.len()
    );
    // Every signal takes effect: one sent while a checkpoint held kv
    // (its first, ~25 ms after a recovery, makes a system call in each
    // thread) was lost until the freeze read a delivery stop right.
    let injected = events(&stdout)
        .into_iter()
        .filter(|e| matches!(e, Event::Injected { component, .. } if component == "kv"))
        .count();
    assert_eq!(injected, 206);
    assert_eq!(crashes.len(), injected, "a crash per signal");
    assert!(segv > 0 && busy > 0, "{segv} SIGSEGV, {busy} in requests");
    let replays = replays(&stdout);
    assert_eq!(
        replays.len(),
        crashes.len(),
        "each crash recovered from the log"
    );
    let restored = replays.iter().filter(|r| r.kind == RESTORED).count();
    let logged: u64 = replays.iter().map(|r| r.entries).sum();
    eprintln!("kv_crashes: {restored} recoveries restored a checkpoint, {logged} requests replayed in all");
    assert!(restored > 0, "checkpoints were restored");
    assert!(logged > 0, "requests were replayed");
    assert_eq!(reboots(&stdout, "kv"), crashes.len());
    // Every incarnation lays its worker threads out alike, so a restore
    // into a new one finds their stacks in place: one to three calls to
    // remap (one small mapping of a thread started after the activation),
    // not the 25 to 36 that interleaved stacks took.
    let mut remaps: Vec<u64> = replays
        .iter()
        .filter(|r| r.kind == RESTORED)
        .map(|r| r.layout_calls)
        .collect();
    remaps.sort_unstable();
    eprintln!("kv_crashes: calls to remap per restore, sorted: {remaps:?}");
    let median = remaps[remaps.len() / 2];
    assert!(median <= 3, "median {median} calls to remap: {remaps:?}");
}

#[test]
fn a_hung_kv_is_rolled_back_in_place_and_replays_its_log() {
    let seed = seed("kv_hangs");
    let dir = scratch("kv-hangs");
    let system = kv_system(&dir, seed, true, &GENTLE);
    // Well over a second apart (an interval runs from one injection to the
    // next, and finding a hang takes 300 ms): a hang within a second of a
    // rollback is the incarnation's own, and is answered by a reboot.
    let (stdout, _) = run(
        "kv_hangs",
        &system,
        &[
            "--signals",
            "stop",
            "--kills",
            "4",
            "--kill-every",
            "1800..2000",
        ],
        seed,
    );
    reports_clean(&stdout, GENTLE.clients);
    let rolled: Vec<(u32, String)> = events(&stdout)
        .into_iter()
        .filter_map(|e| match e {
            Event::RolledBack {
                component,
                pid,
                detail,
                ..
            } if component == "kv" => Some((pid, detail)),
            _ => None,
        })
        .collect();
    // A SIGSTOP that lands during a periodic checkpoint's freeze takes
    // effect too (it was lost when a step of the freeze took it).
    assert_eq!(rolled.len(), 4, "each hang rolled back:\n{stdout}");
    assert!(
        rolled.iter().all(|(pid, _)| *pid == rolled[0].0),
        "in place, one pid: {rolled:?}"
    );
    assert!(
        rolled.iter().all(|(_, d)| d.contains("hang detected")),
        "{rolled:?}"
    );
    assert_eq!(reboots(&stdout, "kv"), 0, "never rebooted:\n{stdout}");
    assert!(crashes(&stdout, "kv").is_empty());
}

/// Clients at full speed fill a small log (1 MiB) faster than the periodic
/// checkpoints (every second) empty it, so that the log itself asks for
/// checkpoints all the time, deaths included: a new incarnation must not
/// be checkpointed (which cuts the log) before the state that died is
/// restored and its log replayed (it was, once in CI, 2026-11-25, and the
/// clients saw 15,000 operations undone).
#[test]
fn kv_killed_while_its_log_asks_for_checkpoints_loses_nothing() {
    let seed = seed("kv_full_log");
    let dir = scratch("kv-full-log");
    let load = Load {
        kv: "checkpoint = { every_ms = 1000 }\njournal_kib = 1024",
        clients: &["w1", "w2"],
        think_us: 0,
    };
    let system = kv_system(&dir, seed, false, &load);
    let (stdout, _) = run(
        "kv_full_log",
        &system,
        &[
            "--signals",
            "kill",
            "--kills",
            "40",
            "--kill-every",
            "20..60",
        ],
        seed,
    );
    reports_clean(&stdout, load.clients);
    let replays = replays(&stdout);
    let crashes = crashes(&stdout, "kv");
    assert!(crashes.len() >= 37, "{} crashes of 40 kills", crashes.len());
    assert_eq!(replays.len(), crashes.len(), "each crash recovered");
    let restored = replays.iter().filter(|r| r.kind == RESTORED).count();
    eprintln!(
        "kv_full_log: {} crashes, {restored} restored a checkpoint",
        crashes.len()
    );
    assert!(restored > 0, "checkpoints the log asked for were restored");
}

/// A hang that comes back with every restore climbs the ladder: rolled
/// back in place; hung again within a second, rebooted from the last
/// checkpoint; hung again within a second of that recovery and before it
/// served a new request, started afresh with its checkpoint and log
/// dropped (the state is lost, as the clients then see). The test stops
/// kv (SIGSTOP) once, then again as soon as each rollback or recovery is
/// reported, standing for a fault the checkpoints captured; the watchdog
/// finds each stop once a call waits 250 ms.
///
/// The test's stop reaches a recovered incarnation only after the event
/// that reports it has crossed a pipe, so the one client (pausing up to
/// 200 ms between calls, and making an increment's two calls back to back)
/// can have a new request served first; the ladder then rightly takes the
/// next hang for a new fault and climbs again from a rollback (it did in
/// CI, 2026-11-29). The test accepts up to three climbs, each a rollback
/// then a restore, and asserts the last ends in a fresh start.
#[test]
fn a_hang_that_every_restore_brings_back_ends_in_a_fresh_start() {
    let seed = seed("kv_ladder");
    let system = kv_and_w1(
        "kv_ladder",
        seed,
        20,
        "threads = 1\nops = 0\nthink_us = 200000",
        "\n[watchdog]\nperiod_us = 1000\nstuck_ms = 250\ndefault_bound_us = 100000\n",
    );
    let stop = |pid| signal(pid, rustix::process::Signal::STOP);
    let (mut steps, mut first) = (Vec::<String>::new(), None);
    let (stdout, stderr) = run_watching("kv_ladder", &system, 6, |event| match event {
        Event::Started { component, pid, .. } if component == "kv" && first.is_none() => {
            // Stopped once it has served a while.
            first = Some(std::thread::spawn(move || {
                std::thread::sleep(std::time::Duration::from_millis(1000));
                stop(pid);
            }));
        }
        Event::RolledBack { component, pid, .. } if component == "kv" => {
            stop(pid);
            steps.push("rollback".into());
        }
        Event::Replayed {
            component,
            pid,
            kind,
            ..
        } if component == "kv" => {
            if kind == "restore and replay" {
                stop(pid);
            }
            steps.push(kind);
        }
        _ => {}
    });
    first.expect("kv started").join().unwrap();
    let climb = ["rollback", "restore and replay"];
    let (fresh, climbs) = steps.split_last().unzip();
    assert!(
        fresh.is_some_and(|f| f == "fresh start (checkpoint and log dropped)")
            && (1..=3).contains(&(climbs.map_or(0, <[_]>::len) / 2))
            && climbs.unwrap_or_default().chunks(2).all(|c| c == climb),
        "steps {steps:?}\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(stderr.contains("starts afresh"), "{stderr}");
}

/// A component's own `watchdog = { … }`: with the system's `[watchdog]`
/// off, `enabled = true` watches kv alone, and its SIGSTOP is found and
/// rolled back (or rebooted, if no checkpoint was taken yet); with the
/// system's on, `enabled = false` exempts kv, and the same SIGSTOP is
/// never found (the run then continues kv as it stops).
#[test]
fn a_components_own_watchdog_settings_watch_or_exempt_it() {
    let seed = seed("kv_own_watchdog");
    let run_with = |kv: &'static str, system_watchdog: bool| {
        let dir = scratch("kv-own-watchdog");
        let load = Load { kv, ..GENTLE };
        let system = kv_system(&dir, seed, system_watchdog, &load);
        let tag = unique_tag("kv_own_watchdog");
        let out = run_system(&tag, &system)
            .env("XDG_RUNTIME_DIR", scratch("kv_own_watchdog-run"))
            .args(["--kill", "kv", "--seed", &seed.to_string()])
            .args([
                "--signals",
                "stop",
                "--kills",
                "1",
                "--kill-every",
                "200..200",
            ])
            .args(["--duration", "1.5"])
            .output()
            .unwrap();
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{stderr}");
        assert!(leftovers(&tag).is_empty(), "processes left behind");
        // Found: rolled back, or, beside CPU hogs, found before kv's first
        // checkpoint was taken, so that the rollback failed and kv was
        // rebooted instead (the supervisor reports that fault).
        let found = events(&stdout)
            .into_iter()
            .filter(|e| match e {
                Event::RolledBack { component, .. } => component == "kv",
                Event::FaultReported {
                    component, detail, ..
                } => component == "kv" && detail.contains("hang detected"),
                _ => false,
            })
            .count();
        (found, stdout)
    };
    let (found, stdout) = run_with(
        "checkpoint = { every_ms = 20 }\nwatchdog = { enabled = true, stuck_ms = 300 }",
        false,
    );
    assert_eq!(found, 1, "watched alone:\n{stdout}");
    let (found, stdout) = run_with(
        "checkpoint = { every_ms = 20 }\nwatchdog = { enabled = false }",
        true,
    );
    assert_eq!(found, 0, "exempt:\n{stdout}");
}

/// kv as a client of another server: every update is also a line of a
/// changelog file in ramfs (`kv`'s `changelog` key), written through
/// `fs` inside the request. kv is killed 100 times and hung twice; its
/// workload then reads the changelog back and finds one record per
/// update, versions 1, 2, 3… with no gap and none twice (a replay that
/// wrote again, or a restore that lost the descriptor or its offset, would
/// break that), as many as kv's version and as its own updates.
#[test]
fn kv_writing_a_changelog_to_ramfs_keeps_it_exact_through_crashes_and_hangs() {
    let seed = seed("kv_changelog");
    let dir = scratch("kv-changelog");
    let toml = format!(
        r#"[system]
name = "kv-changelog"

[watchdog]
period_us = 1000
stuck_ms = 300
default_bound_us = 100000

[[component]]
name = "ramfs"
binary = "kintsugi-ramfs"
provides = ["fs"]

[[component]]
name = "kv"
binary = "kintsugi-kv"
provides = ["kv"]
uses = ["fs"]
recovery = "checkpoint"
checkpoint = {{ every_ms = 20 }}
restart = {{ max = 100000, window_ms = 1000 }}
[component.config]
changelog = "/kv-changes"

[[component]]
name = "w1"
binary = "kintsugi-kv-workload"
uses = ["kv", "fs"]
[component.config]
seed = {seed}
threads = 3
ops = 0
keys = 48
think_us = 100
changelog = "/kv-changes"
"#
    );
    let system = write(&dir, "kv-changelog.toml", &toml);
    let (stdout, _) = run(
        "kv_changelog",
        &system,
        &[
            "--signals",
            "kill,segv",
            "--kills",
            "100",
            "--kill-every",
            "10..40",
        ],
        seed,
    );
    reports_clean(&stdout, &["w1"]);
    let (hung, _) = run(
        "kv_changelog_hangs",
        &system,
        &[
            "--signals",
            "stop",
            "--kills",
            "2",
            "--kill-every",
            "1500..1800",
        ],
        seed,
    );
    reports_clean(&hung, &["w1"]);
    for out in [&stdout, &hung] {
        let report = json_lines(out)
            .into_iter()
            .find(|v| v.get("component").is_some_and(|c| c == "w1"))
            .expect("w1's report");
        let records = report["changelog_records"].as_u64().expect("records");
        eprintln!(
            "kv_changelog: {records} records, {} updates",
            report["updates"]
        );
        assert!(records > 0 && report["updates"] == records, "{report}");
    }
    assert!(crashes(&stdout, "kv").len() >= 95, "kv was killed");
    // The replays answered kv's calls to ramfs from the log, and none
    // diverged (`run` also checks that no line says so).
    let (mut answered, mut diverged) = (0, 0);
    for e in events(&stdout) {
        if let Event::Replayed {
            component,
            calls,
            diverged: d,
            ..
        } = e
        {
            if component == "kv" {
                answered += calls;
                diverged += d;
            }
        }
    }
    eprintln!("kv_changelog: {answered} calls to ramfs answered from the log");
    assert!(answered > 0, "replays answered calls from the log");
    assert_eq!(diverged, 0);
    let rolled = events(&hung)
        .into_iter()
        .filter(|e| matches!(e, Event::RolledBack { component, .. } if component == "kv"))
        .count();
    assert_eq!(rolled, 2, "the hangs were rolled back:\n{hung}");
}

/// A restored state that crashes by itself at once (as a register flip
/// captured by a checkpoint makes it) is not restored for ever: once its
/// client has finished, the test aborts kv (SIGABRT, a signal the supervisor
/// did not send), then aborts each incarnation its checkpoint recoveries
/// make, within a second of its recovery and before it served anything
/// new; one such crash is a new fault and gets a restore, the second in a
/// row a fresh start.
#[test]
fn a_crash_that_every_restore_brings_back_ends_in_a_fresh_start() {
    let seed = seed("kv_crash_ladder");
    let system = kv_and_w1(
        "kv_crash_ladder",
        seed,
        20,
        "threads = 2\nops = 300\nthink_us = 100",
        "",
    );
    let abort = |pid| signal(pid, rustix::process::Signal::ABORT);
    // A checkpoint-recovered server's threads share one malloc arena
    // (glibc's tunable, set by the supervisor); a client's do not.
    let one_arena = |pid: u32| {
        let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
        environ.split(|b| *b == 0).any(|v| {
            v.strip_prefix(b"GLIBC_TUNABLES=").is_some_and(|t| {
                t.split(|b| *b == b':')
                    .any(|t| t == b"glibc.malloc.arena_max=1")
            })
        })
    };
    let mut arenas = Vec::new();
    let (mut kinds, mut kv) = (Vec::new(), 0);
    let (stdout, stderr) = run_watching("kv_crash_ladder", &system, 6, |event| match event {
        Event::Started { component, pid, .. } if component == "kv" => {
            kv = pid;
            arenas.push((component, one_arena(pid)));
        }
        Event::Started { component, pid, .. } if component == "w1" => {
            arenas.push((component, one_arena(pid)));
        }
        Event::Finished { component, .. } if component == "w1" => {
            // kv is checkpointed every 20 ms: let one be taken idle.
            std::thread::sleep(std::time::Duration::from_millis(100));
            abort(kv);
        }
        Event::Replayed {
            component,
            pid,
            kind,
            ..
        } if component == "kv" => {
            if kinds.len() < 2 {
                abort(pid);
            }
            kinds.push(kind);
        }
        _ => {}
    });
    assert_eq!(
        kinds,
        [
            "restore and replay",
            "restore and replay",
            "fresh start (checkpoint and log dropped)"
        ],
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(
        stderr.contains("within 1000 ms of its checkpoint recovery"),
        "{stderr}"
    );
    assert_eq!(
        arenas,
        [("kv".to_string(), true), ("w1".to_string(), false)],
        "GLIBC_TUNABLES of each at its start"
    );
}

/// Every restore starts kv's workers over: with kv's log and its client
/// running, the test freezes kv and sets the callee-saved registers of
/// every worker waiting in `futex` to non-canonical addresses (a flip
/// into threads that went idle before it showed), and lets it go; the
/// workers crash on them within their bounded wait (100 ms), while
/// checkpoints are taken every 10 ms. kv crashes, its recovery restores
/// the last checkpoint with every worker started at the top of its loop
/// (counted in the `replayed` event), nothing starts afresh, and the
/// client sees every answer right. With the workers resumed instead, five
/// runs of five failed only on that count: the damage did not come back
/// from the checkpoint here (the crash came first, or the restore's
/// resumed wait did not return into the damaged frame), so this test
/// holds the mechanism; the campaign into kv (`docs/reliability.md`) is
/// where a fault captured at a checkpoint shows.
#[test]
fn every_restore_starts_kvs_damaged_idle_workers_over() {
    let seed = seed("kv_captured");
    let system = kv_and_w1(
        "kv_captured",
        seed,
        10,
        "threads = 2\nops = 120\nthink_us = 20000",
        "",
    );
    let mut damaged = None;
    let (stdout, stderr) = run_watching("kv_captured", &system, 8, |event| {
        if let Event::Started { component, pid, .. } = event {
            if component == "kv" && damaged.is_none() {
                damaged = Some(std::thread::spawn(move || {
                    std::thread::sleep(std::time::Duration::from_millis(500));
                    damage_idle_workers(pid)
                }));
            }
        }
    });
    let damaged = damaged.expect("kv started").join().unwrap();
    eprintln!("kv_captured: seed {seed}, {damaged} idle workers damaged");
    assert!(damaged > 0, "no worker was idle in futex");
    let crashes = crashes(&stdout, "kv");
    let replays = replays(&stdout);
    assert!(
        !crashes.is_empty() && crashes.iter().all(|c| c.by(SIGSEGV)),
        "the damage showed as SIGSEGV: {:?}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        crashes.iter().map(|c| &c.exit).collect::<Vec<_>>()
    );
    assert!(
        replays.iter().all(|r| r.kind == RESTORED),
        "every recovery restored the checkpoint, none started afresh: {replays:?}\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    let started_over: Vec<usize> = events(&stdout)
        .into_iter()
        .filter_map(|e| match e {
            Event::Replayed {
                component,
                started_over,
                ..
            } if component == "kv" => Some(started_over),
            _ => None,
        })
        .collect();
    eprintln!("kv_captured: workers started over in each recovery: {started_over:?}");
    reports_clean(&stdout, &["w1"]);
    assert!(
        started_over.iter().all(|&n| n > 0),
        "workers started over in each recovery: {started_over:?}"
    );
}

/// Freezes `pid` (retrying while the supervisor's checkpoint thread holds
/// it) and sets the callee-saved registers of each of its worker threads
/// (named `kv:<slot>`) that waits in `futex` to non-canonical addresses;
/// returns how many.
fn damage_idle_workers(pid: u32) -> usize {
    // A wait the supervisor's freezes interrupted goes on in `restart_syscall`.
    const FUTEX: u64 = 202;
    const RESTART_SYSCALL: u64 = 219;
    let frozen = (0..2000)
        .find_map(|_| {
            kintsugi_checkpoint::Frozen::freeze(pid)
                .inspect_err(|_| std::thread::sleep(std::time::Duration::from_millis(1)))
                .ok()
        })
        .expect("kv frozen");
    let mut damaged = 0;
    for &tid in frozen.tids() {
        let comm = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm")).unwrap();
        let mut regs = frozen.regs(tid).unwrap();
        if !comm.starts_with("kv:") || ![FUTEX, RESTART_SYSCALL].contains(&regs.orig_rax) {
            continue;
        }
        let bad = 0xdead_0000_0000_0000 | u64::from(tid);
        for r in [
            &mut regs.rbx,
            &mut regs.rbp,
            &mut regs.r12,
            &mut regs.r13,
            &mut regs.r14,
            &mut regs.r15,
        ] {
            *r = bad;
        }
        frozen.set_regs(tid, regs).unwrap();
        damaged += 1;
    }
    damaged
}

/// A bit flip in kv's memory that crashes nothing is not kept by a
/// checkpoint: with kv checkpointed every 20 ms and its client working, the
/// test flips one bit of every private copy of a key its client wrote once
/// and left alone (`w1/fill/0/00003` becomes `…00001`, in the map's key and
/// in its value), which breaks the map's order. kv's audit of the next
/// checkpoint finds it; the supervisor takes that checkpoint back and kills
/// kv, which recovers from the one before and replays its log: the client
/// sees every answer right, its untouched keys read back whole at the end,
/// and no audit fails again.
#[test]
fn a_flip_that_breaks_kvs_map_is_found_by_its_audit_and_undone() {
    const KEY: &[u8] = b"w1/fill/0/00003";
    let seed = seed("kv_audit");
    let system = kv_and_w1(
        "kv_audit",
        seed,
        20,
        "threads = 2\nops = 0\nthink_us = 2000\nfill = 8",
        "",
    );
    let mut flipped = None;
    let (stdout, stderr) = run_watching("kv_audit", &system, 5, |event| {
        if let Event::Started { component, pid, .. } = event {
            if component == "kv" && flipped.is_none() {
                flipped = Some(std::thread::spawn(move || {
                    std::thread::sleep(std::time::Duration::from_millis(1500));
                    flip_private_copies(pid, KEY, 0x02)
                }));
            }
        }
    });
    let flipped = flipped.expect("kv started").join().unwrap();
    eprintln!("kv_audit: seed {seed}, {flipped} copies of the key flipped");
    assert!(flipped > 0, "the key is in kv's memory");
    let crashes = crashes(&stdout, "kv");
    assert!(
        crashes.len() == 1 && crashes[0].by(SIGKILL),
        "killed once, after its audit: {:?}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        crashes.iter().map(|c| &c.exit).collect::<Vec<_>>()
    );
    assert_eq!(
        stderr.matches("audit: the state is damaged").count(),
        1,
        "one audit found the damage, none after the recovery\nstderr:\n{stderr}"
    );
    let replays = replays(&stdout);
    assert!(
        replays.len() == 1 && replays[0].kind == RESTORED,
        "recovered from the checkpoint before: {replays:?}\nstderr:\n{stderr}"
    );
    reports_clean(&stdout, &["w1"]);
}

/// Flips bits `mask` of the last byte of every copy of `key` in process
/// `pid`'s private writable memory (never its shared mappings: channels,
/// the request log); returns how many copies.
fn flip_private_copies(pid: u32, key: &[u8], mask: u8) -> usize {
    use std::os::unix::fs::FileExt;
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    let mem = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(format!("/proc/{pid}/mem"))
        .unwrap();
    let mut flipped = 0;
    for line in maps.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let private = fields[1].starts_with("rw") && fields[1].ends_with('p');
        let anonymous = fields.len() < 6 || fields[5] == "[heap]";
        if !private || !anonymous {
            continue;
        }
        let (start, end) = fields[0].split_once('-').unwrap();
        let start = u64::from_str_radix(start, 16).unwrap();
        let end = u64::from_str_radix(end, 16).unwrap();
        let mut bytes = vec![0; (end - start) as usize];
        if mem.read_exact_at(&mut bytes, start).is_err() {
            continue;
        }
        for at in 0..bytes.len().saturating_sub(key.len()) {
            if &bytes[at..at + key.len()] == key {
                let last = start + (at + key.len() - 1) as u64;
                mem.write_all_at(&[key[key.len() - 1] ^ mask], last)
                    .unwrap();
                flipped += 1;
            }
        }
    }
    flipped
}

//! The watchdog end to end: spinner (a server of `spin`) hangs in each way
//! the watchdog must catch while spin-workload calls it and checks every
//! result; each hang is detected (the event names the component, thread,
//! call or section, the bound and the measured value), spinner is rebooted,
//! and the workload finishes with every result right. And no hang is
//! reported for varying work with rare long runs, or for a long declared
//! blocking wait.

mod common;

use std::io::{BufRead, BufReader};
use std::process::Stdio;

use common::*;
use kintsugi_supervisor::{Detection, HangKind};

/// The system: spinner with `spinner_config`, the workload with `workload_config`.
fn system(test: &str, spinner_config: &str, workload_config: &str) -> std::path::PathBuf {
    let dir = scratch(test);
    write(
        &dir,
        "watchdog.toml",
        &format!(
            r#"
[system]
name = "watchdog-test"

[watchdog]
period_us = 1000
stuck_ms = 300
default_bound_us = 100000

[[component]]
name = "spinner"
binary = "kintsugi-spinner"
provides = ["spin"]
slots = 2
restart = {{ max = 100, window_ms = 1000 }}
[component.config]
{spinner_config}

[[component]]
name = "workload"
binary = "kintsugi-spin-workload"
uses = ["spin"]
[component.config]
{workload_config}
"#
        ),
    )
}

/// Runs `system` until the workload finishes; `on_line` sees each stdout
/// line as it comes. Returns stdout after checking the run and the
/// workload's report (`ops` calls, no error, no wrong result).
fn run(test: &str, system: &std::path::Path, ops: u64, mut on_line: impl FnMut(&str)) -> String {
    let tag = unique_tag(test);
    let mut child = run_system(&tag, system)
        .args(["--until-finished", "workload"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = String::new();
    for line in BufReader::new(child.stdout.take().unwrap()).lines() {
        let line = line.unwrap();
        on_line(&line);
        stdout.push_str(&line);
        stdout.push('\n');
    }
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "kintsugi run failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    let report = json_lines(&stdout)
        .into_iter()
        .find(|v| v.get("mismatches").is_some())
        .unwrap_or_else(|| panic!("no workload report in:\n{stdout}\nstderr:\n{stderr}"));
    eprintln!("{test}: {report}");
    assert_eq!(report["ops"], ops, "{report}");
    assert_eq!(
        report["errors"], 0,
        "the workload saw errors: {report}\n{stderr}"
    );
    assert_eq!(report["mismatches"], 0, "wrong results: {report}\n{stderr}");
    assert!(leftovers(&tag).is_empty(), "processes left behind");
    stdout
}

/// The hang detections in the event log.
fn detections(stdout: &str) -> Vec<Detection> {
    faults_reported(stdout, "spinner")
        .iter()
        .map(|d| d.parse().unwrap_or_else(|e| panic!("{e}: {d}")))
        .collect()
}

/// Runs a workload that asks for one hang of `kind` at call 200 of 600, and
/// checks that exactly one hang was detected and spinner rebooted once.
fn one_hang(
    test: &str,
    kind: u32,
    spinner_config: &str,
    workload: &str,
    on_line: impl FnMut(&str),
) -> Detection {
    let seed = seed(test);
    let sys = system(
        test,
        spinner_config,
        &format!(
            "seed = {seed}\nops = 600\nhangs = [{{ at_op = 200, kind = {kind} }}]\n{workload}"
        ),
    );
    let stdout = run(test, &sys, 600, on_line);
    let found = detections(&stdout);
    eprintln!("{test}: {found:?}");
    assert_eq!(found.len(), 1, "one hang, one detection:\n{stdout}");
    assert_eq!(
        reboots(&stdout, "spinner"),
        1,
        "spinner rebooted once:\n{stdout}"
    );
    let d = found.into_iter().next().unwrap();
    assert!(d.tid > 0);
    d
}

#[test]
fn an_infinite_loop_in_an_invocation_is_caught_by_its_stretch_bound() {
    let d = one_hang("watchdog-loop", 1, "", "small_units = [1, 300]", |_| {});
    assert_eq!(d.kind, HangKind::Shd, "{d}");
    assert!(d.thread.starts_with("spin:"), "{d}");
    assert_eq!(d.call.as_deref(), Some("spin.hang"), "{d}");
    assert!(d.measured > d.bound, "{d}");
    // The floor (20 ms) once the monitor has measured a window of stretches,
    // the default bound (100 ms) before: short calls are rarely measured.
    assert!((20..=100).contains(&d.bound.as_millis()), "{d}");
}

#[test]
fn a_wait_nobody_ends_in_an_invocation_is_caught_by_the_timestamp_check() {
    let d = one_hang("watchdog-wait", 2, "", "", |_| {});
    assert_eq!(d.kind, HangKind::Stuck, "{d}");
    assert_eq!(d.call.as_deref(), Some("spin.hang"), "{d}");
    assert!(d.measured >= d.bound && d.bound.as_millis() == 300, "{d}");
}

#[test]
fn a_stopped_thread_is_caught_by_the_timestamp_check() {
    let mut tracer = None;
    let d = one_hang("watchdog-stop", 3, "announce_stall = true", "", |line| {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            return;
        };
        if let Some(tid) = v["stall_tid"].as_u64() {
            tracer = Some(
                kintsugi_inject::hold_until_death(tid as u32).expect("stop the stalling thread"),
            );
        }
    });
    assert_eq!(d.kind, HangKind::Stuck, "{d}");
    assert_eq!(d.call.as_deref(), Some("spin.hang"), "{d}");
    tracer.expect("spinner announced its stall").join().unwrap();
}

#[test]
fn a_client_suspecting_a_faulty_reply_has_the_server_rebooted_once() {
    let test = "suspected_reply";
    let seed = seed(test);
    let sys = system(
        test,
        "",
        &format!("seed = {seed}\nops = 600\nbogus_at_op = 200"),
    );
    let stdout = run(test, &sys, 600, |_| {});
    let reports = faults_reported(&stdout, "spinner");
    assert_eq!(reports.len(), 1, "one suspicion, one report:\n{stdout}");
    assert!(
        reports[0].contains("faulty reply: interface=spin epoch=1"),
        "{}",
        reports[0]
    );
    assert_eq!(
        reboots(&stdout, "spinner"),
        1,
        "spinner rebooted once:\n{stdout}"
    );
    let report = json_lines(&stdout)
        .into_iter()
        .find(|v| v.get("refused").is_some())
        .unwrap();
    assert_eq!(
        report["refused"], 1,
        "the bad call came back refused after the reboot: {report}"
    );
}

#[test]
fn a_section_overrun_is_caught_by_its_check_value() {
    // 400 ms of declared blocking wait first (longer than `stuck`, and no
    // hang): the batch thread meanwhile fills its history.
    // After the hang call, 300 ms more of it: the loop runs on the batch
    // thread, and must be found before the workload ends.
    let d = one_hang(
        "watchdog-section",
        4,
        "batch_every_ms = 2",
        "nap_ms = 400\nnap_after_hang_ms = 300",
        |_| {},
    );
    assert_eq!(d.kind, HangKind::Ahd, "{d}");
    assert_eq!(d.section.as_deref(), Some("batch"), "{d}");
    assert_eq!(d.thread, "batch", "{d}");
    assert!(d.measured > d.bound && d.bound.as_millis() >= 5, "{d}");
}

#[test]
fn varying_work_with_rare_long_runs_and_long_blocking_waits_raise_no_alarm() {
    let seed = seed("watchdog-quiet");
    let sys = system(
        "watchdog-quiet",
        "batch_every_ms = 1\nbatch_units = 300\nlarge_units = 20000\nlarge_every = 40",
        &format!("seed = {seed}\nops = 4000\nsmall_units = [1, 400]\nlarge_units = 20000\nlarge_every = 150\nnap_ms = 700"),
    );
    let stdout = run("watchdog-quiet", &sys, 4000, |_| {});
    assert!(detections(&stdout).is_empty(), "false alarm:\n{stdout}");
    assert_eq!(reboots(&stdout, "spinner"), 0, "{stdout}");
}

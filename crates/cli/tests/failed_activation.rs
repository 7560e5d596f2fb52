//! A component whose every new incarnation fails during initialization
//! (it dies, reports failure, or never becomes ready) after its first one
//! crashed: the supervisor sees each failure at once, reaps the failed
//! process, counts it against the restart policy, gives up after a few in a
//! row (the system stops with GaveUp), and obeys SIGTERM meanwhile.

mod common;

use std::time::{Duration, Instant};

use common::*;

fn system(mode: &str) -> std::path::PathBuf {
    let dir = scratch(&format!("failed-activation-{mode}"));
    write(
        &dir,
        "fragile.toml",
        &format!(
            r#"
[system]
name = "fragile-{mode}"

[[component]]
name = "fragile"
binary = "kintsugi-fragile"
restart = {{ max = 100000, window_ms = 1000 }}
[component.config]
mode = "{mode}"
crash_after_ms = 300
"#
        ),
    )
}

fn gives_up_at_once(mode: &str) {
    let tag = unique_tag(&format!("failed-activation-{mode}"));
    let started = Instant::now();
    let out = run_system(&tag, &system(mode)).output().unwrap();
    let took = started.elapsed();
    let (stdout, stderr) = text(&out);
    assert!(
        !out.status.success(),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    let events = events(&stdout);
    assert!(
        events
            .iter()
            .any(|e| matches!(e, Event::GaveUp { component, .. } if component == "fragile")),
        "{stdout}"
    );
    assert!(
        matches!(events.last(), Some(Event::Stopped { reason }) if reason == "GaveUp(\"fragile\")"),
        "{stdout}"
    );
    // The policy allows 100000 restarts a second: the bound on failed
    // activations in a row is what gave up, long before the 10 s ready timeout.
    assert!(took < Duration::from_secs(8), "took {took:?}\n{stdout}");
    // Epochs 2 to 6: five failed activations in a row, the supervisor's bound.
    let failed = stderr.matches("failing initialization").count();
    assert_eq!(failed, 5, "failed activations:\n{stderr}");
    assert!(
        leftovers(&tag).is_empty(),
        "processes left behind: {:?}",
        leftovers(&tag)
    );
}

#[test]
fn incarnations_that_die_during_init_are_given_up_at_once() {
    gives_up_at_once("abort");
}

#[test]
fn incarnations_that_report_failure_are_given_up_at_once() {
    gives_up_at_once("error");
}

#[test]
fn sigterm_stops_a_supervisor_waiting_for_an_incarnation_that_never_gets_ready() {
    let tag = unique_tag("failed-activation-hang");
    let child = run_system(&tag, &system("hang"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // The first incarnation crashes at 300 ms; its successor hangs in init
    // (the ready timeout is 10 s).
    std::thread::sleep(Duration::from_millis(1500));
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(child.id() as i32).unwrap(),
        rustix::process::Signal::TERM,
    )
    .unwrap();
    let stopped = Instant::now();
    let out = child.wait_with_output().unwrap();
    let (stdout, stderr) = text(&out);
    assert!(
        stopped.elapsed() < Duration::from_secs(5),
        "{stdout}\n{stderr}"
    );
    let events = events(&stdout);
    assert!(
        events
            .iter()
            .any(|e| matches!(e, Event::Crashed { component, .. } if component == "fragile")),
        "{stdout}"
    );
    assert!(
        matches!(events.last(), Some(Event::Stopped { reason }) if reason.starts_with("Signal")),
        "{stdout}\n{stderr}"
    );
    assert!(
        leftovers(&tag).is_empty(),
        "processes left behind: {:?}",
        leftovers(&tag)
    );
}

#[test]
fn a_component_start_timeout_bounds_each_activation() {
    let tag = unique_tag("failed-activation-timeout");
    let dir = scratch("failed-activation-timeout");
    let system = write(
        &dir,
        "fragile.toml",
        r#"
[system]
name = "fragile-timeout"

[[component]]
name = "fragile"
binary = "kintsugi-fragile"
restart = { max = 100000, window_ms = 1000 }
start_timeout_ms = 200
[component.config]
mode = "hang"
crash_after_ms = 100
"#,
    );
    let started = Instant::now();
    let out = run_system(&tag, &system).output().unwrap();
    let took = started.elapsed();
    let (stdout, stderr) = text(&out);
    // Five activations of 200 ms each, not five of the default 10 s.
    assert!(took < Duration::from_secs(8), "took {took:?}\n{stdout}");
    let events = events(&stdout);
    let gave_up = events.iter().find_map(|e| match e {
        Event::GaveUp { reason, .. } => Some(reason.to_string()),
        _ => None,
    });
    let reason = gave_up.unwrap_or_else(|| panic!("not given up:\n{stdout}\n{stderr}"));
    assert!(
        reason.contains("5 new incarnations in a row failed to start")
            && reason.contains("not ready within 200 ms"),
        "{reason}"
    );
    assert!(leftovers(&tag).is_empty());
}

//! Starting and stopping: SIGTERM stops every component cleanly, clients
//! first; no process and no shared memory is left behind.

mod common;

use std::time::{Duration, Instant};

use common::*;

#[test]
fn sigterm_stops_the_system_cleanly_and_leaves_nothing_behind() {
    let tag = unique_tag("lifecycle");
    let system = concat!(env!("CARGO_MANIFEST_DIR"), "/../../systems/demo.toml");
    let shm_before = std::fs::read_dir("/dev/shm")
        .map(|d| d.count())
        .unwrap_or(0);
    let child = run_system(&tag, system.as_ref())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        leftovers(&tag).len() >= 5,
        "supervisor, 2 zygotes, 2 incarnations and standbys run: {:?}",
        leftovers(&tag)
    );
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(child.id() as i32).unwrap(),
        rustix::process::Signal::TERM,
    )
    .unwrap();
    let started = Instant::now();
    let out = child.wait_with_output().unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(started.elapsed() < Duration::from_secs(10));
    assert!(
        matches!(events(&stdout).last(), Some(Event::Stopped { reason }) if reason.starts_with("Signal")),
        "{stdout}"
    );
    assert!(
        stdout.contains("workload: last incarnation ended with exit code 0"),
        "{stdout}"
    );
    let report = workload_report(&stdout);
    assert_eq!(report["errors"], 0, "{report}");
    let left = leftovers(&tag);
    assert!(left.is_empty(), "processes left behind: {left:?}");
    let shm_after = std::fs::read_dir("/dev/shm")
        .map(|d| d.count())
        .unwrap_or(0);
    assert!(shm_after <= shm_before, "files left in /dev/shm");
}

//! ramfs is killed with SIGKILL and SIGSEGV at random instants, hundreds of
//! times, while a workload of three client threads (each on its own channel
//! slot) writes, reads, seeks, truncates, renames and unlinks; the workload
//! must see no error, and every file must match its model byte for byte at
//! the end.

mod common;

use std::path::{Path, PathBuf};

use common::*;

#[test]
fn ramfs_survives_hundreds_of_kills_with_no_error_and_no_lost_byte() {
    ramfs_under_kills("on-demand", 300, "files = 8");
}

/// Names of 2 KB: a listing of more than 32 of them takes more than one
/// `readdir` reply, and is paged through while ramfs is killed (each page
/// a call that a reboot may interrupt); each reboot lists ramfs's records
/// from the vault, 128 of which no longer fit in one message. Every
/// directory starts with its 40 files (beside two CPU hogs the random
/// operations between the kills were too few to fill one), and the 300
/// kills outlast their making.
#[test]
fn ramfs_lists_directories_larger_than_a_reply_across_kills() {
    let stdout = ramfs_under_kills(
        "on-demand",
        300,
        "files = 40\nname_bytes = 2000\nprefill = true",
    );
    let report = workload_report(&stdout);
    // A reply (64 KiB) holds at most 32 names of 2,000 bytes and more.
    assert!(
        report["largest_listing"].as_u64().unwrap() > 32,
        "some listing took more than one reply: {report}"
    );
}

/// The same with eager recovery: at each reboot ramfs upcalls the workload,
/// whose stub rebuilds every open file before ramfs serves anything else.
#[test]
fn eager_ramfs_survives_hundreds_of_kills_with_no_error_and_no_lost_byte() {
    let stdout = ramfs_under_kills("eager", 200, "files = 8");
    let rebuilt: Vec<u64> = events(&stdout)
        .iter()
        .filter_map(|e| match e {
            Event::EagerRecovery { descriptors, .. } => Some(*descriptors),
            _ => None,
        })
        .collect();
    eprintln!(
        "eager recoveries: {}, descriptors: {}",
        rebuilt.len(),
        rebuilt.iter().sum::<u64>()
    );
    // A reboot killed again before its clients answered reports none, so
    // how many do depends on the machine's load; that some did is the point.
    assert!(
        rebuilt.iter().sum::<u64>() > 0,
        "the workload's files were rebuilt eagerly"
    );
}

/// ramfs (four slots, with `ramfs` added to its table) and fs-workload of
/// three threads on three directories each (with `workload` added to its
/// config: `files` names per directory).
fn fs_system(dir: &Path, ramfs: &str, workload: &str) -> PathBuf {
    let toml = format!(
        r#"
[system]
name = "fs-test"

[[component]]
name = "ramfs"
binary = "kintsugi-ramfs"
provides = ["fs"]
slots = 4
{ramfs}

[[component]]
name = "workload"
binary = "kintsugi-fs-workload"
uses = ["fs"]
[component.config]
dirs = 3
threads = 3
{workload}
"#
    );
    write(dir, "fs.toml", &toml)
}

/// Kills ramfs (`recovery` mode) `kills` times under a three-thread
/// workload (`workload` added to its config) and checks every outcome;
/// returns the event log.
fn ramfs_under_kills(recovery: &str, kills: usize, workload: &str) -> String {
    let seed = seed("crash_recovery");
    let dir = scratch("crash");
    let system = fs_system(
        &dir,
        &format!("recovery = \"{recovery}\"\nrestart = {{ max = 100000, window_ms = 1000 }}"),
        &format!("seed = {seed}\nmax_write = 65536\n{workload}"),
    );
    let tag = unique_tag("crash");
    let out = run_system(&tag, &system)
        .args(["--kill", "ramfs", "--signals", "kill,segv"])
        .args([
            "--kills",
            &kills.to_string(),
            // Gaps counted from each reboot: beside two CPU hogs an eager
            // recovery (the clients' upcall threads rebuilding) needs a few
            // ms, and with gaps of at most 8 ms none finished once the
            // supervisor stopped spinning for the standby's readiness.
            "--kill-every",
            "1..30",
            "--seed",
            &seed.to_string(),
            "--stop-after-kills",
        ])
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(
        out.status.success(),
        "kintsugi run failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );

    let crashes = crashes(&stdout, "ramfs");
    let by_kill = crashes.iter().filter(|c| c.by(SIGKILL)).count();
    let by_segv = crashes.iter().filter(|c| c.by(SIGSEGV)).count();
    let mid_write = crashes.iter().filter(|c| c.during("fs.write")).count();
    let reboots = reboots(&stdout, "ramfs");
    eprintln!("{} crashes ({by_kill} SIGKILL, {by_segv} SIGSEGV), {mid_write} during a write, {reboots} reboots", crashes.len());
    assert_eq!(crashes.len(), kills, "every injection must kill ramfs once");
    assert!(by_kill > 0 && by_segv > 0, "both signals were injected");
    assert_eq!(reboots, kills, "every crash is followed by a reboot");
    assert!(
        mid_write > 0,
        "some kills must land in the middle of a write"
    );

    let report = workload_report(&stdout);
    eprintln!("workload report: {report}");
    assert_eq!(report["errors"], 0, "the workload saw errors: {report}");
    // Also no size change that left ramfs's change counters (and epoch)
    // as they were; how many stats saw one depends on the machine's load.
    assert_eq!(report["corrupt"], 0, "ramfs answered wrongly: {report}");
    assert_eq!(
        report["threads"], 3,
        "three client threads, each on its own channel slot: {report}"
    );
    // How many operations fit between the kills depends on the machine's load;
    // that kills landed mid-write (above) shows the two interleaved.
    assert!(
        report["ops"].as_u64().unwrap() > 0,
        "the workload ran: {report}"
    );
    assert!(
        report["verified_files"].as_u64().unwrap() > 0,
        "files were verified: {report}"
    );
    assert!(report["bytes_written"].as_u64().unwrap() > 0);
    assert!(
        leftovers(&tag).is_empty(),
        "processes left behind: {:?}",
        leftovers(&tag)
    );
    let _ = std::fs::remove_dir_all(dir);
    stdout
}

/// When a client dies, its server learns of it and releases what the client
/// held; the client's next incarnation starts over and works.
#[test]
fn a_dead_clients_descriptors_are_released_by_its_server() {
    let seed = seed("client_death");
    let tag = unique_tag("client-death");
    let system = concat!(env!("CARGO_MANIFEST_DIR"), "/../../systems/demo.toml");
    let out = run_system(&tag, system.as_ref())
        .env("KINTSUGI_LOG", "info")
        .args([
            "--kill",
            "workload",
            "--kills",
            "5",
            "--kill-every",
            "100..200",
        ])
        .args([
            "--signals",
            "kill,segv",
            "--seed",
            &seed.to_string(),
            "--stop-after-kills",
        ])
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert_eq!(crashes(&stdout, "workload").len(), 5, "{stdout}");
    let released: Vec<u64> = stderr
        .lines()
        .filter_map(|l| l.split("released ").nth(1)?.split(' ').next()?.parse().ok())
        .collect();
    assert_eq!(
        released.len(),
        5,
        "ramfs hears of every client death: {stderr}"
    );
    assert!(
        released.iter().any(|n| *n > 0),
        "the dead client held descriptors: {released:?}"
    );
    let report = workload_report(&stdout);
    assert_eq!(report["errors"], 0, "{report}");
    assert!(leftovers(&tag).is_empty());
}

/// ramfs publishes change counters that let a client keep a stat (httpd
/// answers from them without calling): without crashes, whose new epochs
/// would hide a missing count, every change of a file's size that a stat
/// sees must have moved the file's counter (or, for a file created,
/// unlinked or renamed, the names' counter).
#[test]
fn ramfs_counts_every_change_a_kept_stat_depends_on() {
    let seed = seed("fs_changes");
    let dir = scratch("fs-changes");
    let system = fs_system(
        &dir,
        "",
        &format!("seed = {seed}\nmax_write = 4096\nops = 20000\nfiles = 8"),
    );
    let tag = unique_tag("fs-changes");
    let out = run_system(&tag, &system)
        .args(["--until-finished", "workload"])
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(
        out.status.success(),
        "kintsugi run failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    let report = workload_report(&stdout);
    eprintln!("workload report: {report}");
    assert_eq!(report["errors"], 0, "the workload saw errors: {report}");
    assert_eq!(report["corrupt"], 0, "a change went uncounted: {report}");
    assert!(
        report["changes_checked"].as_u64().unwrap() > 100,
        "stats after changes were checked: {report}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

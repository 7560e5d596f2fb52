//! Shared helpers for the end-to-end tests: run the real `kintsugi` binary
//! on a system file, with a tag in its environment that every component
//! inherits, so that leftover processes can be found afterwards.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub fn kintsugi(tag: &str) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kintsugi"));
    cmd.env("KINTSUGI_TEST_TAG", tag).env(
        "KINTSUGI_LOG",
        std::env::var("KINTSUGI_TEST_LOG").unwrap_or("warn".into()),
    );
    cmd
}

/// A seed from `KINTSUGI_TEST_SEED` or the clock, printed so that a failure can be replayed.
pub fn seed(test: &str) -> u64 {
    let seed = std::env::var("KINTSUGI_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                % 1_000_000
        });
    eprintln!("{test}: seed {seed} (replay with KINTSUGI_TEST_SEED={seed})");
    seed
}

/// A fresh folder for one test's files, never another call's: tests of
/// one file run in parallel in one process, and two that asked for the
/// same name shared a folder, one removing the other's system file
/// (`crash_recovery.rs`'s two tests, in CI 2026-11-29).
pub fn scratch(test: &str) -> PathBuf {
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!(
        "kintsugi-test-{test}-{}-{call}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

pub fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

pub fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Processes that still carry `tag` in their environment.
pub fn leftovers(tag: &str) -> Vec<u32> {
    let needle = format!("KINTSUGI_TEST_TAG={tag}");
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/environ"))
                .map(|env| env.split(|b| *b == 0).any(|kv| kv == needle.as_bytes()))
                .unwrap_or(false)
        })
        .collect()
}

/// The JSON lines a component printed, parsed (not the supervisor's events:
/// see [`events`]).
pub fn json_lines(stdout: &str) -> Vec<serde_json::Value> {
    stdout
        .lines()
        .filter(|l| l.starts_with('{') && !l.starts_with(EVENT_LINE))
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

pub fn unique_tag(test: &str) -> String {
    format!(
        "{test}-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    )
}

/// The report fs-workload prints when it stops.
pub fn workload_report(stdout: &str) -> serde_json::Value {
    json_lines(stdout)
        .into_iter()
        .find(|v| v.get("verified_files").is_some())
        .unwrap_or_else(|| panic!("no workload report in:\n{stdout}"))
}

pub use kintsugi_supervisor::{Event, Exit};

/// How a line of `--events json` starts.
const EVENT_LINE: &str = "{\"t_us\":";

/// The supervisor's events in the stdout of `kintsugi run --events json`,
/// in order (a line that starts like an event but does not parse fails the
/// test).
pub fn events(log: &str) -> Vec<Event> {
    log.lines()
        .filter(|l| l.starts_with(EVENT_LINE))
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("malformed event {l}: {e}")))
        .collect()
}

/// One death of an incarnation, from the event log.
#[derive(Debug)]
pub struct Crash {
    pub exit: Exit,
    pub in_flight: Vec<String>,
}

impl Crash {
    pub fn by(&self, signal: i32) -> bool {
        self.exit == Exit::Signal(signal)
    }

    pub fn during(&self, call: &str) -> bool {
        self.in_flight.iter().any(|c| c == call)
    }
}

pub const SIGKILL: i32 = 9;
pub const SIGSEGV: i32 = 11;
pub const SIGABRT: i32 = 6;

/// Every crash of `component` in a `--events json` log.
pub fn crashes(log: &str, component: &str) -> Vec<Crash> {
    events(log)
        .into_iter()
        .filter_map(|e| match e {
            Event::Crashed {
                component: c,
                exit,
                in_flight,
                ..
            } if c == component => Some(Crash { exit, in_flight }),
            _ => None,
        })
        .collect()
}

/// How many times a `--events json` log says `component` was rebooted.
pub fn reboots(log: &str, component: &str) -> usize {
    events(log)
        .iter()
        .filter(|e| matches!(e, Event::Rebooted { component: c, .. } if c == component))
        .count()
}

/// The details of the faults reported for `component` (the watchdog's
/// detections among them).
pub fn faults_reported(log: &str, component: &str) -> Vec<String> {
    events(log)
        .into_iter()
        .filter_map(|e| match e {
            Event::FaultReported {
                component: c,
                detail,
                ..
            } if c == component => Some(detail),
            _ => None,
        })
        .collect()
}

/// `kintsugi run SYSTEM --events json`, tagged.
pub fn run_system(tag: &str, system: &Path) -> Command {
    let mut cmd = kintsugi(tag);
    cmd.arg("run").arg(system).args(["--events", "json"]);
    cmd
}

/// The supervisor among `keeper`'s children (its other children are
/// processes of a dead supervisor, about to be reaped).
pub fn supervisor_of(keeper: u32) -> Option<u32> {
    std::fs::read_to_string(format!("/proc/{keeper}/task/{keeper}/children"))
        .ok()?
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .find(|p: &u32| {
            std::fs::read_to_string(format!("/proc/{p}/comm")).is_ok_and(|c| c.trim() == "kintsugi")
        })
}

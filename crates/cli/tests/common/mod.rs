//! Shared helpers for the end-to-end tests: run the real `kintsugi` binary
//! on a system file, with a tag in its environment that every component
//! inherits, so that leftover processes can be found afterwards.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub fn kintsugi(tag: &str) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kintsugi"));
    cmd.env("KINTSUGI_TEST_TAG", tag)
        .env("KINTSUGI_LOG", "warn");
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

/// A fresh folder for one test's files.
pub fn scratch(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kintsugi-test-{test}-{}", std::process::id()));
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

/// The JSON lines a component printed, parsed.
pub fn json_lines(stdout: &str) -> Vec<serde_json::Value> {
    stdout
        .lines()
        .filter(|l| l.starts_with('{'))
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

/// The event log's lines saying that `component` crashed.
pub fn crash_lines<'a>(log: &'a str, component: &str) -> Vec<&'a str> {
    let needle = format!("] {component}: crashed with");
    log.lines().filter(|l| l.contains(&needle)).collect()
}

/// How many times the event log says `component` was rebooted.
pub fn reboots(log: &str, component: &str) -> usize {
    let needle = format!("] {component}: rebooted in");
    log.lines().filter(|l| l.contains(&needle)).count()
}

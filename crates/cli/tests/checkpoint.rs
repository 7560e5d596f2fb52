//! `kintsugi checkpoint` and `kintsugi restore` on a running system, under
//! a checking workload: bench-echo (with a 16 MiB heap, checkpointed every
//! 50 ms, the 2 latest kept as files) serves echo-checker, which checks
//! every byte of every reply. The server is restored in place from its
//! latest checkpoint, then from an image file (same pid both times), then,
//! after it is killed and rebooted, into its new incarnation from the file
//! its dead one left; the checker is restored in place too. Truncated,
//! corrupted and foreign image files are refused with an error naming the
//! file and leave the system as it was. The checker must see no wrong
//! reply and no failed call.
//!
//! Migration (RTCR's): an image exported with `--out` from one system is
//! restored by a second `kintsugi run` in its own network and mount
//! namespaces (`unshare`), with the component's durable memory carried
//! along; its checker finds the first system's heap in the server.
//!
//! TAC's rollback: a server hung inside a call (a loop, then a wait that
//! never ends) is restored in place from its last checkpoint with
//! `--force`, keeping its pid; its workers run the call again, and the
//! client gets every answer right. The same with the watchdog finding the
//! hangs and `on_hang = "rollback"`: rolled back, never rebooted.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

const SYSTEM: &str = r#"
[system]
name = "ckpt"

[[component]]
name = "echo"
binary = "kintsugi-bench-echo"
provides = ["bench"]
restart = { max = 100, window_ms = 1000 }
arena_kib = 4
checkpoint = { every_ms = 50, keep = 2, read_ahead_pages = 0 }  # each read ahead
[component.config]
grow_mib = 16
grow_after_ms = 1

[[component]]
name = "checker"
binary = "kintsugi-echo-checker"
uses = ["bench"]
[component.config]
duration_ms = 120000
report_ms = 50
stop_file = "STOP_FILE"
"#;

struct Running {
    child: Child,
    runtime_dir: PathBuf,
    tag: String,
    system: String,
}

impl Running {
    /// Counter `counter` of `component` in the published roster.
    fn counter(&self, component: &str, counter: &str) -> u64 {
        let path = self
            .runtime_dir
            .join(format!("kintsugi/{}.json", self.system));
        let Some(roster) = std::fs::read_to_string(path)
            .ok()
            .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        else {
            return 0;
        };
        roster["members"]
            .as_array()
            .and_then(|m| m.iter().find(|m| m["name"] == component))
            .and_then(|m| m["counters"].as_array().cloned())
            .and_then(|c| c.into_iter().find(|c| c[0] == counter))
            .and_then(|c| c[1].as_u64())
            .unwrap_or(0)
    }

    fn ctl(&self, args: &[&str]) -> Result<Value, String> {
        let out = kintsugi(&self.tag)
            .env("XDG_RUNTIME_DIR", &self.runtime_dir)
            .args(args)
            .args(["--system", &self.system, "--json"])
            .output()
            .unwrap();
        let (stdout, stderr) = text(&out);
        if !out.status.success() {
            return Err(stderr);
        }
        Ok(serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}")))
    }

    fn pid(&self, component: &str) -> Option<u64> {
        let path = self
            .runtime_dir
            .join(format!("kintsugi/{}.json", self.system));
        let roster: Value = serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()?;
        roster["members"]
            .as_array()?
            .iter()
            .find(|m| m["name"] == component)?["pid"]
            .as_u64()
    }

    /// Waits until `component` serves from a pid other than `not`.
    fn wait_pid(&self, component: &str, not: Option<u64>) -> u64 {
        let until = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(p) = self.pid(component).filter(|&p| Some(p) != not) {
                return p;
            }
            assert!(Instant::now() < until, "{component} never served");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Once echo and its checker serve, its heap grown and a few periodic
    /// checkpoints taken: echo checkpointed into `file`.
    fn export_echo(&self, file: &Path) -> Value {
        self.wait_pid("echo", None);
        self.wait_pid("checker", None);
        std::thread::sleep(Duration::from_millis(400));
        let out = file.to_str().unwrap();
        self.ctl(&["checkpoint", "--component", "echo", "--out", out])
            .unwrap()
    }

    fn checkpoint_dir(&self) -> PathBuf {
        self.runtime_dir.join("kintsugi/ckpt.checkpoints")
    }
}

fn start(test: &str) -> (Running, PathBuf) {
    let dir = scratch(test);
    let (running, _) = start_in(&dir, "run", &[], false);
    (running, dir)
}

/// `kintsugi run` of the system in `dir`, its roster under `dir/run_dir`,
/// its checker stopped by `dir/run_dir/stop`; in new network and mount
/// namespaces with `unshare`.
fn start_in(dir: &Path, run_dir: &str, extra: &[&str], unshare: bool) -> (Running, PathBuf) {
    let runtime_dir = dir.join(run_dir);
    std::fs::create_dir_all(&runtime_dir).unwrap();
    let stop = runtime_dir.join("stop");
    let system = write(dir, "ckpt.toml", &SYSTEM.replace("STOP_FILE", "UNSET"));
    let tag = unique_tag(run_dir);
    let mut cmd = if unshare {
        let mut c = std::process::Command::new("unshare");
        c.args(["--net", "--mount", env!("CARGO_BIN_EXE_kintsugi")])
            .env("KINTSUGI_TEST_TAG", &tag)
            .env("KINTSUGI_LOG", "warn");
        c
    } else {
        kintsugi(&tag)
    };
    let child = cmd
        .arg("run")
        .arg(&system)
        .args(["--events", "json"])
        .env("XDG_RUNTIME_DIR", &runtime_dir)
        .args(["--until-finished", "checker"])
        .arg("--set")
        .arg(format!("checker.stop_file={}", stop.display()))
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    (
        Running {
            child,
            runtime_dir,
            tag,
            system: "ckpt".into(),
        },
        stop,
    )
}

impl Running {
    /// Stops the checker and the system; its stdout, checked: the
    /// checker's every report clean, its last one returned.
    fn finish(self, stop: &Path) -> (String, Value) {
        std::fs::write(stop, "").unwrap();
        let out = self.child.wait_with_output().unwrap();
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{stdout}\n{stderr}");
        let reports = json_lines(&stdout);
        for r in reports.iter().filter(|v| v.get("calls").is_some()) {
            assert_eq!(r["wrong"], 0, "no wrong reply: {r}\n{stderr}");
            assert_eq!(r["failed"], 0, "no failed call: {r}\n{stderr}");
        }
        let last = reports
            .iter()
            .find(|v| v["last"] == true)
            .unwrap_or_else(|| panic!("no final checker report:\n{stdout}\n{stderr}"))
            .clone();
        // Beside two CPU hogs it makes a few hundred calls a second.
        assert!(
            last["calls"].as_u64().unwrap() >= 10,
            "the checker made progress: {last}"
        );
        assert!(leftovers(&self.tag).is_empty());
        (stdout, last)
    }
}

fn field<'a>(v: &'a Value, k: &str) -> &'a Value {
    v.get(k).unwrap_or_else(|| panic!("no `{k}` in {v}"))
}

/// The image files `dir` holds.
/// The image files in `dir` (not a temporary one a checkpoint left).
fn images(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(|e| Some(e.ok()?.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "ksgckpt"))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn checkpoints_and_restores_of_a_serving_component_lose_no_call() {
    let (sys, dir) = start("ckpt_restore");

    let echo = sys.wait_pid("echo", None);
    let file = dir.join("echo.ksgckpt");
    let taken = sys.export_echo(&file);
    assert_eq!(field(&taken, "pid").as_u64(), Some(echo));
    assert!(field(&taken, "threads").as_u64().unwrap() >= 2, "{taken}");
    assert!(
        field(&taken, "image_bytes").as_u64().unwrap() >= 16 << 20,
        "the 16 MiB heap is in the image: {taken}"
    );
    assert!(
        field(&taken, "periodic_taken").as_u64().unwrap() >= 1,
        "{taken}"
    );
    // Read ahead while it served the checker (its worker's stack, at
    // least, written since the last periodic checkpoint).
    assert!(
        field(&taken, "read_ahead").as_u64().unwrap() >= 1,
        "{taken}"
    );
    assert!(file.is_file());

    for (args, kind) in [
        (vec!["restore", "--component", "echo"], "restore in place"),
        (
            vec![
                "restore",
                "--component",
                "echo",
                "--from",
                file.to_str().unwrap(),
            ],
            "restore from file",
        ),
        (vec!["checkpoint", "--component", "checker"], "checkpoint"),
        (
            vec!["restore", "--component", "checker"],
            "restore in place",
        ),
    ] {
        let done = sys.ctl(&args).unwrap_or_else(|e| panic!("{args:?}: {e}"));
        assert_eq!(field(&done, "kind"), kind, "{done}");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(sys.pid("echo"), Some(echo), "restored in place: same pid");

    // Bad files: refused, naming the file; nothing restored.
    let bytes = std::fs::read(&file).unwrap();
    let truncated = write(&dir, "truncated.ksgckpt", "");
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    let corrupted = dir.join("corrupted.ksgckpt");
    let mut flipped = bytes.clone();
    let at = flipped.len() * 2 / 3;
    flipped[at] ^= 0x10;
    std::fs::write(&corrupted, &flipped).unwrap();
    let foreign = dir.join("ckpt.toml");
    for bad in [&truncated, &corrupted, &foreign] {
        let path = bad.to_str().unwrap();
        let err = sys
            .ctl(&["restore", "--component", "echo", "--from", path])
            .expect_err("a bad image is refused");
        assert!(err.contains(path), "the error names the file: {err}");
    }
    assert_eq!(sys.pid("echo"), Some(echo), "untouched by bad files");

    // Into a new incarnation: the dead one's image, from its file.
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(echo as i32).unwrap(),
        rustix::process::Signal::KILL,
    )
    .unwrap();
    let reborn = sys.wait_pid("echo", Some(echo));
    std::thread::sleep(Duration::from_millis(100));
    let done = sys
        .ctl(&[
            "restore",
            "--component",
            "echo",
            "--from",
            file.to_str().unwrap(),
        ])
        .unwrap();
    assert_eq!(
        field(&done, "kind"),
        "restore into a new incarnation",
        "{done}"
    );
    assert_eq!(field(&done, "pid").as_u64(), Some(reborn));
    std::thread::sleep(Duration::from_millis(300));
    let after = sys
        .ctl(&["checkpoint", "--component", "echo"])
        .expect("the restored incarnation checkpoints again");
    assert_eq!(field(&after, "pid").as_u64(), Some(reborn));

    // Counted once the system has stopped: while it runs, a periodic
    // checkpoint may be writing its image under a temporary name, or have
    // renamed it into place and not yet removed the oldest.
    let kept_in = sys.checkpoint_dir();
    sys.finish(&dir.join("run/stop"));
    let kept = images(&kept_in);
    assert!(
        (1..=2).contains(&kept.len()),
        "keep = 2 image files: {kept:?}"
    );
    for f in &kept {
        let size = std::fs::metadata(f).unwrap().len();
        assert!(size > 0, "{}", f.display());
    }
}

#[test]
fn an_image_exported_by_one_system_serves_under_another_in_other_namespaces() {
    let dir = scratch("ckpt_migrate");
    let (a, a_stop) = start_in(&dir, "a", &[], false);
    let file = dir.join("moved.ksgckpt");
    let taken = a.export_echo(&file);
    assert!(field(&taken, "image_bytes").as_u64().unwrap() >= 16 << 20);
    let (a_out, _) = a.finish(&a_stop);
    assert!(a_out.contains(r#""incarnations":1"#), "{a_out}");

    // The second system grows no heap of its own: what it serves with came
    // in the image, and its arena (the incarnation count) with it.
    let restore = format!("echo={}", file.display());
    let (b, b_stop) = start_in(
        &dir,
        "b",
        &["--restore", &restore, "--set", "echo.grow_mib=0"],
        true,
    );
    b.wait_pid("echo", None);
    std::thread::sleep(Duration::from_millis(400));
    let (b_out, last) = b.finish(&b_stop);
    let restored = events(&b_out)
        .into_iter()
        .find_map(|e| match e {
            Event::Restored { pages, .. } => Some(pages),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no restored event:\n{b_out}"));
    assert!(
        restored > 4096,
        "the 16 MiB heap came along: {restored} pages"
    );
    assert_eq!(
        last["heap_mib"], 16,
        "the first system's heap serves: {last}"
    );
    assert!(
        b_out.contains(r#""incarnations":2"#),
        "the arena came along (count 1, then this incarnation): {b_out}"
    );
}

/// The spin workload's run: its 600 answers right, after its 2 hangs;
/// returns its stdout.
fn spin_workload_right(out: &std::process::Output) -> String {
    let (stdout, stderr) = text(out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let report = json_lines(&stdout)
        .into_iter()
        .find(|v| v.get("ops").is_some())
        .unwrap_or_else(|| panic!("no workload report:\n{stdout}\n{stderr}"));
    assert_eq!(report["ops"], 600, "{report}");
    assert_eq!(report["hangs"], 2, "{report}");
    assert_eq!(report["errors"], 0, "{report}\n{stderr}");
    assert_eq!(report["mismatches"], 0, "{report}\n{stderr}");
    stdout
}

const HUNG: &str = r#"
[system]
name = "ckpt-hang"

[[component]]
name = "spinner"
binary = "kintsugi-spinner"
provides = ["spin"]
checkpoint = { every_ms = 20 }

[[component]]
name = "workload"
binary = "kintsugi-spin-workload"
uses = ["spin"]
[component.config]
ops = 600
small_units = [1, 200]
nap_ms = 200
nap_after_hang_ms = 1100
hangs = [{ at_op = 150, kind = 1 }, { at_op = 400, kind = 2 }]
"#;

#[test]
fn a_hung_server_is_rolled_back_in_place_and_runs_the_call_again() {
    let dir = scratch("ckpt_hang");
    let system = write(&dir, "hang.toml", HUNG);
    let runtime_dir = dir.join("run");
    std::fs::create_dir_all(&runtime_dir).unwrap();
    let tag = unique_tag("ckpt_hang");
    let child = run_system(&tag, &system)
        .env("XDG_RUNTIME_DIR", &runtime_dir)
        .args(["--until-finished", "workload"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let sys = Running {
        child,
        runtime_dir,
        tag,
        system: "ckpt-hang".into(),
    };
    let spinner = sys.wait_pid("spinner", None);
    let mut seen = 0;
    for hang in 1..=2 {
        // The hang has begun when spinner stamps its start.
        let until = Instant::now() + Duration::from_secs(60);
        loop {
            let now = sys.counter("spinner", "hang_ns");
            if now != seen && now != 0 {
                seen = now;
                break;
            }
            assert!(Instant::now() < until, "hang {hang} never began");
            std::thread::sleep(Duration::from_millis(10));
        }
        std::thread::sleep(Duration::from_millis(50));
        let refused = sys.ctl(&["restore", "--component", "spinner"]);
        assert!(
            refused.as_ref().is_err_and(|e| e.contains("safe point")),
            "a hung server reaches no safe point: {refused:?}"
        );
        let done = sys
            .ctl(&["restore", "--component", "spinner", "--force"])
            .unwrap_or_else(|e| panic!("hang {hang}: {e}"));
        assert_eq!(field(&done, "kind"), "restore in place", "{done}");
        assert_eq!(field(&done, "pid").as_u64(), Some(spinner), "same pid");
    }
    let out = sys.child.wait_with_output().unwrap();
    let stdout = spin_workload_right(&out);
    assert_eq!(
        reboots(&stdout, "spinner"),
        0,
        "rolled back, never rebooted"
    );
    assert!(leftovers(&sys.tag).is_empty());
}

#[test]
fn the_watchdog_answers_a_hang_by_a_rollback_in_place() {
    let dir = scratch("ckpt_hang_watchdog");
    let described = HUNG
        .replace(
            "checkpoint = { every_ms = 20 }",
            "checkpoint = { every_ms = 20, on_hang = \"rollback\" }",
        )
        .replace(
            "[[component]]\nname = \"spinner\"",
            "[watchdog]\nperiod_us = 1000\nstuck_ms = 300\ndefault_bound_us = 100000\n\n[[component]]\nname = \"spinner\"",
        );
    assert!(described.contains("on_hang") && described.contains("[watchdog]"));
    let system = write(&dir, "hang.toml", &described);
    let tag = unique_tag("ckpt_hang_watchdog");
    let out = run_system(&tag, &system)
        .env("XDG_RUNTIME_DIR", &dir)
        .args(["--until-finished", "workload"])
        .output()
        .unwrap();
    let stdout = spin_workload_right(&out);
    let rolled: Vec<u32> = events(&stdout)
        .into_iter()
        .filter_map(|e| match e {
            Event::RolledBack { pid, .. } => Some(pid),
            _ => None,
        })
        .collect();
    assert_eq!(rolled.len(), 2, "each hang rolled back:\n{stdout}");
    assert_eq!(rolled[0], rolled[1], "in place: one pid");
    assert_eq!(reboots(&stdout, "spinner"), 0, "never rebooted:\n{stdout}");
    assert!(leftovers(&tag).is_empty());
}

#[test]
fn a_bad_image_to_start_from_stops_the_start_before_anything_runs() {
    let dir = scratch("ckpt_bad_start");
    let system = write(&dir, "ckpt.toml", &SYSTEM.replace("STOP_FILE", "UNSET"));
    let bad = write(&dir, "bad.ksgckpt", "not an image\n");
    for (arg, says) in [
        (format!("echo={}", bad.display()), bad.display().to_string()),
        (
            "nosuch=x.ksgckpt".to_string(),
            "no such component".to_string(),
        ),
    ] {
        let tag = unique_tag("ckpt_bad_start");
        let out = kintsugi(&tag)
            .env("XDG_RUNTIME_DIR", &dir)
            .arg("run")
            .arg(&system)
            .args(["--restore", &arg])
            .output()
            .unwrap();
        let (stdout, stderr) = text(&out);
        assert!(!out.status.success(), "{stdout}{stderr}");
        assert!(stderr.contains(&says), "{arg}: {stderr}");
        assert!(!stdout.contains("started"), "nothing started: {stdout}");
        assert!(leftovers(&tag).is_empty());
    }
}

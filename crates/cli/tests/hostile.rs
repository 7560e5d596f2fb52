//! Issue 17's findings as tests: what a hostile user or component tried,
//! refused. The roster: a forged one cannot turn `kintsugi inject` on an
//! unrelated process, and a roster directory open to others is refused.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

fn demo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../systems/demo.toml")
}

/// A process killed and reaped when dropped.
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Reaped {
    fn alive(&mut self) -> bool {
        self.0.try_wait().unwrap().is_none()
    }
}

/// The published roster of `system` under `runtime_dir`, once it names a
/// live pid for `component`.
fn roster(runtime_dir: &Path, system: &str, component: &str) -> Value {
    let path = runtime_dir.join(format!("kintsugi/{system}.json"));
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(v) = std::fs::read_to_string(&path)
            .ok()
            .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        {
            let live = v["members"]
                .as_array()
                .unwrap()
                .iter()
                .any(|m| m["name"] == component && m["pid"].is_u64());
            if live {
                return v;
            }
        }
        assert!(Instant::now() < until, "no roster at {}", path.display());
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn forge(runtime_dir: &Path, name: &str, roster: &Value) -> PathBuf {
    let path = runtime_dir.join(format!("kintsugi/{name}.json"));
    std::fs::write(&path, serde_json::to_vec(roster).unwrap()).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    path
}

fn inject_kill(tag: &str, runtime_dir: &Path, system: &Path) -> (bool, String) {
    let out = kintsugi(tag)
        .env("XDG_RUNTIME_DIR", runtime_dir)
        .args(["inject", "--system"])
        .arg(system)
        .args([
            "--component",
            "ramfs",
            "--kind",
            "signal",
            "--signal",
            "kill",
        ])
        .output()
        .unwrap();
    let (o, e) = text(&out);
    (out.status.success(), format!("{o}{e}"))
}

#[test]
fn a_forged_roster_cannot_aim_the_injector_at_another_process() {
    let tag = unique_tag("forged");
    let dir = scratch("forged");
    let _system = Reaped(
        kintsugi(&tag)
            .env("XDG_RUNTIME_DIR", &dir)
            .args(["run", "--quiet", "--duration", "120"])
            .arg(demo())
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let mut victim = Reaped(Command::new("sleep").arg("120").spawn().unwrap());
    let victim_pid = victim.0.id();
    let real = roster(&dir, "demo", "ramfs");
    let ramfs = |r: &Value| {
        r["members"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["name"] == "ramfs")
            .unwrap()["pid"]
            .as_u64()
            .unwrap()
    };
    let real_pid = ramfs(&real);

    // The victim named as the supervisor: no control socket of its own
    // answers for it.
    let mut as_supervisor = real.clone();
    as_supervisor["supervisor_pid"] = victim_pid.into();
    let path = forge(&dir, "forged-supervisor", &as_supervisor);
    let (ok, out) = inject_kill(&tag, &dir, &path);
    assert!(!ok, "{out}");
    assert!(out.contains("does not confirm"), "{out}");
    assert!(victim.alive(), "the victim was hit: {out}");

    // The victim named as ramfs beside the real supervisor: the pid the
    // supervisor confirms is hit, not the one in the file.
    let mut as_member = real.clone();
    for m in as_member["members"].as_array_mut().unwrap() {
        m["pid"] = victim_pid.into();
    }
    let path = forge(&dir, "forged-member", &as_member);
    let (ok, out) = inject_kill(&tag, &dir, &path);
    assert!(ok, "{out}");
    assert!(out.contains(&format!("pid {real_pid} ")), "{out}");
    assert!(!out.contains(&format!("pid {victim_pid} ")), "{out}");
    assert!(victim.alive(), "the victim was hit: {out}");
    // And ramfs was rebooted.
    let until = Instant::now() + Duration::from_secs(30);
    while ramfs(&roster(&dir, "demo", "ramfs")) == real_pid {
        assert!(Instant::now() < until, "ramfs never rebooted");
        std::thread::sleep(Duration::from_millis(20));
    }

    // A roster that is a symlink to the real one is not followed.
    let link = dir.join("kintsugi/linked.json");
    std::os::unix::fs::symlink(dir.join("kintsugi/demo.json"), &link).unwrap();
    let (ok, out) = inject_kill(&tag, &dir, &link);
    assert!(!ok, "{out}");
}

#[test]
fn a_roster_directory_open_to_others_is_refused() {
    let tag = unique_tag("opendir");
    let dir = scratch("opendir");
    let roster_dir = dir.join("kintsugi");
    std::fs::create_dir(&roster_dir).unwrap();
    std::fs::set_permissions(&roster_dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let out = kintsugi(&tag)
        .env("XDG_RUNTIME_DIR", &dir)
        .args(["run", "--quiet", "--duration", "1"])
        .arg(demo())
        .output()
        .unwrap();
    let (o, e) = text(&out);
    assert!(!out.status.success(), "{o}{e}");
    assert!(e.contains("refusing the roster directory"), "{e}");
    assert!(e.contains("mode 777"), "{e}");
    let (ok, out) = inject_kill(&tag, &dir, Path::new("demo"));
    assert!(
        !ok && out.contains("refusing the roster directory"),
        "{out}"
    );
    assert!(leftovers(&tag).is_empty());
}

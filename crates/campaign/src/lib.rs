//! Fault-injection campaigns (`kintsugi campaign`): runs a system in process with checking workloads,
//! injects faults one at a time into its services, and classifies what
//! each one did (RMK's Tables 4–7, NewtOS's Tables III–IV, C3's register
//! flips), with a table per service and in total, JSON and CSV.
//!
//! Each injection: wait until the target's workloads make progress; note
//! every service's epoch and every workload's counters (`ops`, `errors`,
//! `corrupt`); inject into the target's live incarnation; watch for the
//! observation window and until the target's workloads progress again.
//! A target that stops serving them for `--stall-ms` without being
//! detected is "undetected": the campaign reports it through the roster,
//! so that it is rebooted and the campaign goes on. An injection that left
//! no visible trace is followed by a reboot of the target, so that every
//! injection starts from a fresh incarnation and latent damage cannot be
//! blamed on a later one.

#![forbid(unsafe_code)]

mod fault_args;
mod observe;
mod outcome;
mod record;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use kintsugi_supervisor::{Options, Roster};

pub use fault_args::{seed_or_clock, FaultArgs, Kind};
use observe::{observe, Limits, Watch};
pub use outcome::Outcome;
pub use record::{Campaign, Record};

const CAMPAIGN_SYSTEM: &str = include_str!("../../../systems/campaign.toml");

#[derive(Args, Debug)]
pub struct CampaignArgs {
    /// The system (default: the built-in systems/campaign.toml).
    #[arg(long)]
    pub system: Option<PathBuf>,
    /// The component to inject into, or `all`: every component that
    /// provides an interface to a workload.
    #[arg(long, default_value = "all")]
    pub target: String,
    /// Injections per target.
    #[arg(long, default_value_t = 100)]
    pub faults: u32,
    #[command(flatten)]
    pub fault: FaultArgs,
    /// Seed of the plan and of every injection (default: from the clock; printed).
    #[arg(long)]
    pub seed: Option<u64>,
    /// How long to watch after each injection, in ms.
    #[arg(long, default_value_t = 300)]
    pub window_ms: u64,
    /// No progress of the target's workloads for this long is a hang, in ms.
    #[arg(long, default_value_t = 2000)]
    pub stall_ms: u64,
    /// No progress again within this long after a reboot: the system is lost, in ms.
    #[arg(long, default_value_t = 10000)]
    pub lost_ms: u64,
    /// Write the results to OUT.json and OUT.csv (default: campaign-SEED).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Continue the campaign recorded in this JSON file (same plan and seed).
    #[arg(long, conflicts_with = "seed")]
    pub resume: Option<PathBuf>,
    /// Run only the targets, their workloads and what those use, not the
    /// rest of the system: a campaign into one service then runs at its
    /// speed on a small machine. Other services disturbed: none run.
    #[arg(long)]
    pub alone: bool,
    /// When the system is lost, keep it running for inspection (a
    /// debugger, `/proc`) until Ctrl-C, instead of stopping it.
    #[arg(long)]
    pub hold_on_loss: bool,
}

fn load_system(path: Option<&Path>) -> anyhow::Result<kintsugi_system::System> {
    let mut system = match path {
        Some(p) => kintsugi_system::load(p, &kintsugi_system::search_dirs()),
        None => kintsugi_system::parse_builtin("systems/campaign.toml (built in)", CAMPAIGN_SYSTEM),
    }
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    system.restart_always();
    Ok(system)
}

/// Each service of `system` (a component something uses), in start order,
/// and the components that use it.
fn services_of(system: &kintsugi_system::System) -> (Vec<String>, BTreeMap<String, Vec<String>>) {
    let mut clients: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for c in &system.components {
        for u in &c.uses {
            clients
                .entry(u.server.clone())
                .or_default()
                .push(c.name.clone());
        }
    }
    let services = system
        .components
        .iter()
        .filter(|c| clients.contains_key(&c.name))
        .map(|c| c.name.clone())
        .collect();
    (services, clients)
}

/// Keeps of `system` only `targets`, their clients and every component
/// those use; each keeps its id (configurations name components by id).
fn only_targets(
    system: &mut kintsugi_system::System,
    targets: &[String],
    clients: &BTreeMap<String, Vec<String>>,
) {
    let mut keep = std::collections::BTreeSet::new();
    let mut next: Vec<String> = targets
        .iter()
        .flat_map(|t| std::iter::once(t).chain(&clients[t]))
        .cloned()
        .collect();
    while let Some(name) = next.pop() {
        if keep.insert(name.clone()) {
            let used = system
                .components
                .iter()
                .filter(|c| c.name == name)
                .flat_map(|c| &c.uses);
            next.extend(used.map(|u| u.server.clone()));
        }
    }
    system.components.retain(|c| keep.contains(&c.name));
}

pub fn campaign(args: CampaignArgs) -> anyhow::Result<bool> {
    let mut system = load_system(args.system.as_deref())?;
    let (mut services, mut clients) = services_of(&system);
    let mut camp = match &args.resume {
        Some(path) => {
            let text =
                std::fs::read_to_string(path).with_context(|| format!("{}", path.display()))?;
            serde_json::from_str::<Campaign>(&text)
                .with_context(|| format!("{}", path.display()))?
        }
        None => {
            let targets = match args.target.as_str() {
                "all" => services.clone(),
                t if services.iter().any(|s| s == t) => vec![t.to_string()],
                t => anyhow::bail!(
                    "`{t}` is not a service of system `{}` (one of: {})",
                    system.name,
                    services.join(", ")
                ),
            };
            Campaign {
                seed: seed_or_clock(args.seed),
                system: system.name.clone(),
                kind: args.fault.kind,
                fault: args.fault.fault().to_string(),
                targets,
                faults_per_target: args.faults,
                window_ms: args.window_ms,
                alone: args.alone,
                records: Vec::new(),
            }
        }
    };
    anyhow::ensure!(
        camp.system == system.name && camp.kind == args.fault.kind,
        "the campaign file is of system `{}` and kind {:?}; pass the same --system and --kind",
        camp.system,
        camp.kind
    );
    if camp.alone {
        only_targets(&mut system, &camp.targets, &clients);
        (services, clients) = services_of(&system);
    }
    let out = args
        .out
        .clone()
        .or_else(|| args.resume.clone())
        .unwrap_or_else(|| PathBuf::from(format!("campaign-{}", camp.seed)));
    let plan = camp.plan();
    println!(
        "kintsugi campaign: {} × {} into {} of system `{}`{}, window {} ms, seed {}",
        camp.faults_per_target,
        camp.fault,
        camp.targets.join(", "),
        camp.system,
        match camp.alone {
            true => format!(" (alone: {})", services.join(", ")),
            false => String::new(),
        },
        camp.window_ms,
        camp.seed
    );
    println!("results: {} and .csv", out.with_extension("json").display());

    let roster = Roster::new();
    let events = Arc::new(Mutex::new(Vec::new()));
    let sink = events.clone();
    let options = Options {
        roster: Some(roster.clone()),
        interfaces: kintsugi_interfaces::ALL.to_vec(),
        stop_grace: Duration::from_secs(3),
        // An incarnation whose initialization hangs is replaced within the
        // campaign's patience (its --lost-ms), not after the default 10 s.
        ready_timeout: Duration::from_millis(args.lost_ms / 4),
        ..Options::default()
    };
    let sup_system = system.clone();
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let r = kintsugi_supervisor::run(&sup_system, options, &mut |e| {
            sink.lock().unwrap().push(e.clone())
        });
        let _ = done_tx.send(r);
    });
    let watch = Watch {
        roster,
        events,
        clients,
    };
    // A hang the watchdog finds is found within its `stuck` time (plus a
    // few samples): the window waits for that, or it would be missed.
    let detection = match system.watchdog.enabled {
        true => system.watchdog.stuck + system.watchdog.period * 5,
        false => Duration::ZERO,
    };
    let limits = Limits {
        window: Duration::from_millis(camp.window_ms).max(detection),
        stall: Duration::from_millis(args.stall_ms),
        lost: Duration::from_millis(args.lost_ms),
    };
    // Every service up and serving before the first injection.
    let ready = services
        .iter()
        .all(|s| watch.wait_progress(s, Duration::from_secs(30)));
    let bar = indicatif::ProgressBar::new(plan.len() as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:40} {pos}/{len} {msg} [{elapsed_precise}, eta {eta}]",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar.set_position(camp.records.len() as u64);
    let mut lost = !ready;
    for (index, target) in plan.iter().enumerate().skip(camp.records.len()) {
        if lost {
            break;
        }
        let record = observe(
            &watch,
            target,
            &services,
            &args.fault,
            camp.seed,
            index as u32,
            &limits,
        );
        if watch.interrupted() {
            break; // Ctrl-C: this injection is not counted, --resume redoes it
        }
        lost = record.outcome == Outcome::SystemLost;
        bar.set_message(format!("{target}: {}", record.outcome.label()));
        bar.inc(1);
        camp.records.push(record);
        if camp.records.len() % 25 == 0 || lost {
            camp.save(&out)?;
        }
    }
    bar.finish_and_clear();
    camp.save(&out)?;
    let hold = lost && args.hold_on_loss;
    if hold {
        let last = camp
            .records
            .last()
            .map_or(String::new(), |r| r.diagnosis.join("\n  "));
        println!("system lost; kept running for inspection until Ctrl-C:\n  {last}");
    } else {
        // Stop the system as Ctrl-C would.
        rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::TERM)?;
    }
    // A lost system may keep the supervisor rebooting a component that
    // never becomes ready: wait a bounded time, then leave (components die
    // with this process).
    let wait = match hold {
        true => Duration::MAX,
        false => Duration::from_secs(60),
    };
    let stopped = match done_rx.recv_timeout(wait) {
        Ok(r) => format!("{:?}", r?.reason),
        Err(_) => "did not stop within 60 s of SIGTERM".to_string(),
    };
    if !ready {
        eprintln!("the system's workloads never all made progress; nothing was injected");
    }
    println!("\n{}", camp.table());
    let corrupt: u64 = camp.records.iter().map(|r| r.corrupt).sum();
    println!(
        "{} injections; {} wrong answers caught by the checkers in all; system stopped: {}; seed {}",
        camp.records.len(),
        corrupt,
        stopped,
        camp.seed
    );
    for r in camp
        .records
        .iter()
        .filter(|r| r.outcome == Outcome::SystemLost || !r.collateral.is_empty())
    {
        println!(
            "#{} {} ({}): {:?} {:?}",
            r.index, r.target, r.injection, r.outcome, r.collateral
        );
        for line in &r.diagnosis {
            println!("  {line}");
        }
    }
    let done = camp.records.len() == plan.len();
    Ok(ready && done && !lost)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alone_keeps_the_target_its_workloads_and_their_ids() {
        let mut system = load_system(None).unwrap();
        let ids: BTreeMap<String, u32> = system
            .components
            .iter()
            .map(|c| (c.name.clone(), c.id))
            .collect();
        let (_, clients) = services_of(&system);
        only_targets(&mut system, &["mm".to_string()], &clients);
        let kept: Vec<&str> = system.components.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(kept, ["mm", "mm-sink", "mm-owner"]);
        // The owner names its sink by id: every component keeps its own.
        assert!(system.components.iter().all(|c| ids[&c.name] == c.id));
        assert_eq!(services_of(&system).0, ["mm"]);
    }
}

//! `kintsugi campaign`: runs a system in process with checking workloads,
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

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use kintsugi_inject::{InjectError, Injection};
use kintsugi_supervisor::{Event, FaultReport, Options, Roster};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};

use crate::inject::{seed_or_clock, FaultArgs, Kind};

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

/// How an injection ended, worst first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Outcome {
    /// The restart policy gave up, a workload died, or the target's
    /// workloads did not progress again within --lost-ms.
    SystemLost,
    /// A workload's checker found a wrong answer.
    Corruption,
    /// The target stopped serving or answered errors, and nothing detected
    /// it (the campaign rebooted it).
    Undetected,
    /// The watchdog detected a hang and the target was rebooted.
    HangDetected,
    /// Detected (crash) and rebooted, and a client saw an error.
    RecoveredWithError,
    /// Detected and rebooted; no client saw anything.
    RecoveredTransparently,
    /// No visible effect within the window.
    NotActivated,
    /// No thread of the target was found executing user code.
    NotInjected,
}

const OUTCOMES: [Outcome; 8] = [
    Outcome::NotActivated,
    Outcome::RecoveredTransparently,
    Outcome::RecoveredWithError,
    Outcome::HangDetected,
    Outcome::Corruption,
    Outcome::Undetected,
    Outcome::SystemLost,
    Outcome::NotInjected,
];

impl Outcome {
    fn label(self) -> &'static str {
        match self {
            Outcome::NotActivated => "not activated",
            Outcome::RecoveredTransparently => "recovered transparently",
            Outcome::RecoveredWithError => "recovered, error seen by a client",
            Outcome::HangDetected => "hang detected and recovered",
            Outcome::Corruption => "silent corruption caught by the checker",
            Outcome::Undetected => "undetected",
            Outcome::SystemLost => "system lost",
            Outcome::NotInjected => "not injected (no thread in user code)",
        }
    }

    fn key(self) -> String {
        serde_json::to_value(self)
            .unwrap()
            .as_str()
            .unwrap()
            .to_string()
    }
}

/// One injection's record.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Record {
    pub index: u32,
    pub target: String,
    pub pid: u32,
    pub epoch: u64,
    /// What was injected (thread, register, bit; or why nothing was).
    pub injection: String,
    pub outcome: Outcome,
    /// The target was rebooted this many times while watched (the
    /// campaign's own clearing reboot not counted).
    pub reboots: u64,
    /// Errors and wrong answers its workloads saw.
    pub errors: u64,
    pub corrupt: u64,
    /// Other services rebooted, or their workloads saw errors: injection
    /// must not disturb them.
    pub collateral: Vec<String>,
    /// From the injection to the workloads' progress after recovery, in ms.
    pub recovery_ms: Option<f64>,
    /// Fresh incarnations of the target that did not serve its workloads
    /// within --stall-ms, and that the campaign rebooted again: a recovery
    /// bug, counted apart from the injection's outcome.
    #[serde(default)]
    pub stalls_after_reboot: u32,
    /// What reported the target faulty, other than a crash: the watchdog's
    /// hang detections and clients' suspicions (`faulty reply: …`), in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reports: Vec<String>,
    /// When the system was lost: where every thread of the target and of
    /// its workloads was (`tid name state wchan syscall`, per process).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub diagnosis: Vec<String>,
}

/// The campaign file: its plan and what is done.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Campaign {
    pub seed: u64,
    pub system: String,
    pub kind: Kind,
    pub fault: String,
    pub targets: Vec<String>,
    pub faults_per_target: u32,
    pub window_ms: u64,
    /// Only the targets, their workloads and what those use ran (`--alone`).
    #[serde(default)]
    pub alone: bool,
    pub records: Vec<Record>,
}

impl Campaign {
    /// The order of the injections: each target `faults` times, shuffled by the seed.
    fn plan(&self) -> Vec<String> {
        let mut plan: Vec<String> = (0..self.faults_per_target)
            .flat_map(|_| self.targets.iter().cloned())
            .collect();
        plan.shuffle(&mut rand::rngs::StdRng::seed_from_u64(self.seed));
        plan
    }

    fn save(&self, out: &Path) -> anyhow::Result<()> {
        let json = out.with_extension("json");
        let tmp = out.with_extension("json.tmp");
        std::fs::write(&tmp, serde_json::to_vec_pretty(self)?)
            .with_context(|| format!("{}", tmp.display()))?;
        std::fs::rename(&tmp, &json)?;
        let mut csv = String::from(
            "index,target,pid,epoch,outcome,reboots,errors,corrupt,collateral,recovery_ms,injection\n",
        );
        for r in &self.records {
            csv += &format!(
                "{},{},{},{},{},{},{},{},{},{},\"{}\"\n",
                r.index,
                r.target,
                r.pid,
                r.epoch,
                r.outcome.key(),
                r.reboots,
                r.errors,
                r.corrupt,
                r.collateral.join(" "),
                r.recovery_ms.map_or(String::new(), |v| format!("{v:.3}")),
                r.injection.replace('"', "'")
            );
        }
        std::fs::write(out.with_extension("csv"), csv)?;
        Ok(())
    }

    /// The table per target and in total, as markdown.
    pub fn table(&self) -> String {
        let mut rows: Vec<(String, Vec<&Record>)> = self
            .targets
            .iter()
            .map(|t| {
                (
                    t.clone(),
                    self.records.iter().filter(|r| &r.target == t).collect(),
                )
            })
            .collect();
        rows.push(("**total**".into(), self.records.iter().collect()));
        let mut s = String::from("| target | injected |");
        for o in OUTCOMES {
            s += &format!(" {} |", o.label());
        }
        s += " detected faults recovered | other services disturbed | incarnations that did not serve after a reboot |\n| --- | ---: |";
        s += &" ---: |".repeat(OUTCOMES.len() + 3);
        s += "\n";
        for (name, recs) in rows {
            let count = |o: Outcome| recs.iter().filter(|r| r.outcome == o).count();
            let injected = recs.len() - count(Outcome::NotInjected);
            s += &format!("| {name} | {injected} |");
            for o in OUTCOMES {
                s += &format!(" {} |", count(o));
            }
            let detected = recs
                .iter()
                .filter(|r| r.reboots > 0 || r.outcome == Outcome::HangDetected)
                .count();
            let recovered = recs
                .iter()
                .filter(|r| {
                    (r.reboots > 0 || r.outcome == Outcome::HangDetected)
                        && r.outcome != Outcome::SystemLost
                })
                .count();
            let pct = if detected == 0 {
                100.0
            } else {
                100.0 * recovered as f64 / detected as f64
            };
            let disturbed = recs.iter().filter(|r| !r.collateral.is_empty()).count();
            let stalls: u32 = recs.iter().map(|r| r.stalls_after_reboot).sum();
            s += &format!(" {recovered} of {detected} ({pct:.1} %) | {disturbed} | {stalls} |\n");
        }
        s
    }
}

/// The live system, as the campaign watches it.
struct Watch {
    roster: Arc<Roster>,
    events: Arc<Mutex<Vec<Event>>>,
    /// Each service's workload components.
    clients: BTreeMap<String, Vec<String>>,
}

/// A service's workloads' counters at one instant.
#[derive(Debug, Clone, Copy, Default)]
struct Tally {
    ops: u64,
    errors: u64,
    corrupt: u64,
}

impl Watch {
    fn tally(&self, service: &str) -> Tally {
        let mut t = Tally::default();
        for c in &self.clients[service] {
            t.ops += self.roster.counter(c, "ops");
            t.errors += self.roster.counter(c, "errors");
            t.corrupt += self.roster.counter(c, "corrupt");
        }
        t
    }

    /// Whether every workload of `service` did at least one op since `base`.
    fn progressed(&self, service: &str, base: &BTreeMap<String, u64>) -> bool {
        self.clients[service]
            .iter()
            .all(|c| self.roster.counter(c, "ops") > base[c])
    }

    fn ops_now(&self, service: &str) -> BTreeMap<String, u64> {
        self.clients[service]
            .iter()
            .map(|c| (c.clone(), self.roster.counter(c, "ops")))
            .collect()
    }

    fn epoch(&self, name: &str) -> u64 {
        self.roster.member(name).map_or(0, |m| m.epoch)
    }

    fn events_since(&self, from: usize) -> Vec<Event> {
        self.events.lock().unwrap()[from..].to_vec()
    }

    fn event_count(&self) -> usize {
        self.events.lock().unwrap().len()
    }

    /// Waits until `service`'s workloads all progress, at most `limit`.
    fn wait_progress(&self, service: &str, limit: Duration) -> bool {
        let base = self.ops_now(service);
        let until = Instant::now() + limit;
        while Instant::now() < until {
            if self.progressed(service, &base) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        false
    }

    /// Asks the supervisor to reboot `name`'s live incarnation and waits
    /// for the new one; false if none came within `limit`. With no live
    /// incarnation (the supervisor is rebooting it), waits for the next.
    fn reboot(&self, name: &str, detail: &str, limit: Duration) -> bool {
        let Some(m) = self.roster.member(name) else {
            return false;
        };
        if let Some(pid) = m.pid {
            self.roster.report_fault(FaultReport {
                component: name.into(),
                pid,
                detail: detail.into(),
            });
        }
        let until = Instant::now() + limit;
        while Instant::now() < until {
            if self
                .roster
                .member(name)
                .is_some_and(|n| n.epoch > m.epoch && n.pid.is_some())
            {
                return true;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        false
    }

    /// Reboots `name` until an incarnation serves its workloads within
    /// `limits.stall`, at most [`MAX_CLEARING_REBOOTS`] times; returns how
    /// many reboots it took, or None if none served.
    fn reboot_until_serving(&self, name: &str, detail: &str, limits: &Limits) -> Option<u32> {
        (1..=MAX_CLEARING_REBOOTS).find(|_| {
            self.reboot(name, detail, limits.lost) && self.wait_progress(name, limits.stall)
        })
    }

    /// The supervisor's events since `from` (the last [`DIAGNOSIS_EVENTS`]),
    /// then where the threads of `service` and of its workloads are.
    fn diagnose(&self, service: &str, from: usize) -> Vec<String> {
        let events = self.events_since(from);
        let skip = events.len().saturating_sub(DIAGNOSIS_EVENTS);
        let events = events.into_iter().skip(skip).map(|e| format!("event: {e}"));
        events
            .chain(
                std::iter::once(service)
                    .chain(self.clients[service].iter().map(String::as_str))
                    .flat_map(|name| match self.roster.member(name).and_then(|m| m.pid) {
                        Some(pid) => kintsugi_inject::describe_threads(pid)
                            .into_iter()
                            .map(|t| format!("{name}[{pid}]: {t}"))
                            .collect(),
                        None => vec![format!("{name}: no live incarnation")],
                    }),
            )
            .collect()
    }

    /// Whether the system was stopped by a signal (Ctrl-C), not lost.
    fn interrupted(&self) -> bool {
        let events = self.events.lock().unwrap();
        matches!(events.last(), Some(Event::Stopped { reason }) if reason == "Signal")
    }

    fn lost(&self, events: &[Event]) -> Option<String> {
        events.iter().find_map(|e| match e {
            Event::GaveUp { component, .. } => Some(format!("{component}: restart policy gave up")),
            Event::Finished { component, exit } => Some(format!("{component} ended ({exit})")),
            Event::Stopped { reason } => Some(format!("system stopped: {reason}")),
            _ => None,
        })
    }
}

/// How many of the supervisor's last events a lost system's diagnosis shows.
const DIAGNOSIS_EVENTS: usize = 40;

/// How many times in a row the campaign reboots a target whose fresh
/// incarnations do not serve, before it calls the system lost.
const MAX_CLEARING_REBOOTS: u32 = 3;

/// Settings of one injection's observation.
struct Limits {
    window: Duration,
    stall: Duration,
    lost: Duration,
}

fn observe(
    w: &Watch,
    target: &str,
    services: &[String],
    fault: &FaultArgs,
    seed: u64,
    index: u32,
    limits: &Limits,
) -> Record {
    let fault_kind = fault.fault();
    let mut record = Record {
        index,
        target: target.into(),
        pid: 0,
        epoch: 0,
        injection: String::new(),
        outcome: Outcome::NotInjected,
        reboots: 0,
        errors: 0,
        corrupt: 0,
        collateral: Vec::new(),
        recovery_ms: None,
        stalls_after_reboot: 0,
        reports: Vec::new(),
        diagnosis: Vec::new(),
    };
    // Start from a target that serves its workloads.
    if !w.wait_progress(target, limits.lost) {
        record.outcome = Outcome::SystemLost;
        record.injection = "the target's workloads made no progress before the injection".into();
        record.diagnosis = w.diagnose(target, w.event_count().saturating_sub(DIAGNOSIS_EVENTS));
        return record;
    }
    let epochs: BTreeMap<&str, u64> = services.iter().map(|s| (s.as_str(), w.epoch(s))).collect();
    let tallies: BTreeMap<&str, Tally> =
        services.iter().map(|s| (s.as_str(), w.tally(s))).collect();
    let first_event = w.event_count();
    let Some(member) = w.roster.member(target) else {
        record.injection = "not a component".into();
        return record;
    };
    let Some(pid) = member.pid else {
        record.injection = "no live incarnation".into();
        return record;
    };
    (record.pid, record.epoch) = (pid, member.epoch);
    // A seed per injection: a resumed campaign makes the same choices.
    let mut injector = fault.injector(seed ^ (index as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let injected_at = Instant::now();
    let mut held = None;
    match injector.inject(pid, &fault_kind) {
        Ok(Injection::Hang(h)) => {
            record.injection = format!("thread {} held stopped", h.tid());
            held = Some(h);
        }
        Ok(i) => record.injection = i.to_string(),
        Err(e @ InjectError::NoRunningThread { .. }) => {
            record.injection = e.to_string();
            return record;
        }
        Err(e) => {
            record.injection = e.to_string();
            if w.epoch(target) == member.epoch {
                return record;
            }
        }
    }
    // Watch: the window, then until the workloads progress again.
    let mut stalled_since = Instant::now();
    let mut base = w.ops_now(target);
    // Whether nothing detected the fault and the campaign rebooted the
    // target, and how many reboots were the campaign's.
    let mut campaign_rebooted = false;
    let mut campaign_reboots = 0;
    let mut last_epoch = member.epoch;
    let mut lost = false;
    loop {
        std::thread::sleep(Duration::from_millis(2));
        if let Some(h) = held.as_mut() {
            if h.reap_if_dead() {
                held = None;
            }
        }
        let events = w.events_since(first_event);
        if let Some(why) = w.lost(&events) {
            record.injection += &format!("; {why}");
            lost = true;
            break;
        }
        let epoch = w.epoch(target);
        if epoch != last_epoch {
            // A reboot: progress is measured from the new incarnation.
            last_epoch = epoch;
            stalled_since = Instant::now();
            base = w.ops_now(target);
        }
        if w.progressed(target, &base) {
            stalled_since = Instant::now();
            base = w.ops_now(target);
            if injected_at.elapsed() >= limits.window {
                break;
            }
        }
        if stalled_since.elapsed() >= limits.stall {
            // Not serving: undetected if the injected incarnation still
            // runs; if it was rebooted, its successor does not serve.
            let rebooted = w.epoch(target) != member.epoch;
            match rebooted {
                true => record.stalls_after_reboot += 1,
                false => campaign_rebooted = true,
            }
            drop(held.take());
            let Some(n) =
                w.reboot_until_serving(target, "campaign: no progress and no detection", limits)
            else {
                record.injection +=
                    &format!("; no incarnation served after {MAX_CLEARING_REBOOTS} reboots");
                lost = true;
                break;
            };
            campaign_reboots += n as u64;
            record.stalls_after_reboot += n - 1;
            if campaign_reboots > u64::from(MAX_CLEARING_REBOOTS) {
                // Each fresh incarnation serves a moment, then stalls again:
                // the damage outlives reboots of the target alone.
                record.injection += &format!(
                    "; stalled again after each of {campaign_reboots} reboots by the campaign"
                );
                lost = true;
                break;
            }
            last_epoch = w.epoch(target);
            stalled_since = Instant::now();
            base = w.ops_now(target);
        }
    }
    drop(held);
    let events = w.events_since(first_event);
    record.reports = events
        .iter()
        .filter_map(|e| match e {
            Event::FaultReported {
                component, detail, ..
            } if component == target && !detail.starts_with("campaign:") => Some(detail.clone()),
            _ => None,
        })
        .collect();
    let hang_detected = record
        .reports
        .iter()
        .any(|d| d.starts_with("hang detected:"));
    record.reboots = w.epoch(target) - member.epoch - campaign_reboots;
    if !lost && record.reboots == 0 && campaign_reboots == 0 {
        // No visible effect: clear any latent damage with a fresh incarnation.
        match w.reboot_until_serving(
            target,
            "campaign: a fresh incarnation for the next injection",
            limits,
        ) {
            Some(n) => record.stalls_after_reboot += n - 1,
            None => {
                record.injection +=
                    &format!("; no incarnation served after {MAX_CLEARING_REBOOTS} reboots");
                lost = true;
            }
        }
    }
    if lost {
        record.diagnosis = w.diagnose(target, first_event);
    }
    let after = w.tally(target);
    record.errors = after.errors - tallies[target].errors;
    record.corrupt = after.corrupt - tallies[target].corrupt;
    if record.reboots > 0 || campaign_reboots > 0 {
        record.recovery_ms = Some(injected_at.elapsed().as_secs_f64() * 1e3);
    }
    for s in services.iter().filter(|s| *s != target) {
        let t = w.tally(s);
        if w.epoch(s) != epochs[s.as_str()] {
            record.collateral.push(format!("{s}:rebooted"));
        }
        if t.errors != tallies[s.as_str()].errors || t.corrupt != tallies[s.as_str()].corrupt {
            record.collateral.push(format!("{s}:errors"));
        }
    }
    record.outcome = classify(&Observed {
        lost,
        reboots: record.reboots,
        campaign_rebooted,
        hang_detected,
        errors: record.errors,
        corrupt: record.corrupt,
    });
    record
}

/// What was seen after one injection: the input of [`classify`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Observed {
    /// The system was lost: the restart policy gave up, a workload died, or
    /// the target did not serve again.
    lost: bool,
    /// Reboots of the target that something other than the campaign caused.
    reboots: u64,
    /// The target stopped serving and the campaign had to reboot it.
    campaign_rebooted: bool,
    /// The watchdog reported a hang of the target.
    hang_detected: bool,
    /// Errors and wrong answers the target's workloads counted.
    errors: u64,
    corrupt: u64,
}

/// The outcome of an injection that took place, from what was seen: worst
/// first (a loss, then a wrong answer, then a fault nothing detected).
fn classify(o: &Observed) -> Outcome {
    if o.lost {
        Outcome::SystemLost
    } else if o.corrupt > 0 {
        Outcome::Corruption
    } else if o.campaign_rebooted || (o.reboots == 0 && o.errors > 0) {
        Outcome::Undetected
    } else if o.hang_detected {
        Outcome::HangDetected
    } else if o.reboots > 0 && o.errors > 0 {
        Outcome::RecoveredWithError
    } else if o.reboots > 0 {
        Outcome::RecoveredTransparently
    } else {
        Outcome::NotActivated
    }
}

fn load_system(path: Option<&Path>) -> anyhow::Result<kintsugi_system::System> {
    let mut system = match path {
        Some(p) => crate::run::load(p)?,
        None => crate::bench::parse_system("systems/campaign.toml (built in)", CAMPAIGN_SYSTEM)?,
    };
    for c in &mut system.components {
        c.set_restart(u32::MAX, Duration::from_secs(1));
    }
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

    fn seen(f: impl FnOnce(&mut Observed)) -> Outcome {
        let mut o = Observed::default();
        f(&mut o);
        classify(&o)
    }

    #[test]
    fn each_outcome_from_what_was_seen() {
        assert_eq!(seen(|_| {}), Outcome::NotActivated);
        assert_eq!(seen(|o| o.reboots = 1), Outcome::RecoveredTransparently);
        assert_eq!(
            seen(|o| (o.reboots, o.errors) = (1, 2)),
            Outcome::RecoveredWithError
        );
        assert_eq!(
            seen(|o| (o.reboots, o.hang_detected) = (1, true)),
            Outcome::HangDetected
        );
        assert_eq!(
            seen(|o| o.errors = 1),
            Outcome::Undetected,
            "errors, no reboot"
        );
        assert_eq!(seen(|o| o.campaign_rebooted = true), Outcome::Undetected);
        assert_eq!(seen(|o| o.corrupt = 1), Outcome::Corruption);
        assert_eq!(seen(|o| o.lost = true), Outcome::SystemLost);
    }

    #[test]
    fn the_worst_of_several_signs_wins() {
        let all = |o: &mut Observed| {
            (o.reboots, o.errors, o.corrupt) = (2, 3, 1);
            (o.campaign_rebooted, o.hang_detected) = (true, true);
        };
        assert_eq!(seen(|o| (all(o), o.lost = true).1), Outcome::SystemLost);
        assert_eq!(seen(all), Outcome::Corruption);
        assert_eq!(
            seen(|o| (all(o), o.corrupt = 0).1),
            Outcome::Undetected,
            "a stall the campaign had to clear outweighs a hang report"
        );
        assert_eq!(
            seen(|o| (o.reboots, o.errors, o.hang_detected) = (1, 1, true)),
            Outcome::HangDetected,
            "a detected hang is counted as such, errors or not"
        );
    }
}

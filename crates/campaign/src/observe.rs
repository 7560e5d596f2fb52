//! One injection, watched: wait until the target's workloads make
//! progress, note every service's incarnation count and every workload's counters,
//! inject, then watch for the window and until the workloads progress again
//! (rebooting a target that stopped serving undetected).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kintsugi_inject::{InjectError, Injection};
use kintsugi_supervisor::{Event, FaultReport, Roster};

use crate::fault_args::FaultArgs;
use crate::outcome::{classify, Observed, Outcome};
use crate::record::Record;

/// The live system, as the campaign watches it.
pub(crate) struct Watch {
    pub(crate) roster: Arc<Roster>,
    pub(crate) events: Arc<Mutex<Vec<Event>>>,
    /// Each service's workload components.
    pub(crate) clients: BTreeMap<String, Vec<String>>,
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

    /// How many incarnations of `name` went live: a reboot raises it,
    /// whether it changes the epoch (a micro-reboot) or not (a checkpoint
    /// recovery).
    fn incarnations(&self, name: &str) -> u64 {
        self.roster.member(name).map_or(0, |m| m.incarnations)
    }

    fn events_since(&self, from: usize) -> Vec<Event> {
        self.events.lock().unwrap()[from..].to_vec()
    }

    fn event_count(&self) -> usize {
        self.events.lock().unwrap().len()
    }

    /// Waits until `service`'s workloads all progress, at most `limit`.
    pub(crate) fn wait_progress(&self, service: &str, limit: Duration) -> bool {
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
                hang: false,
            });
        }
        let until = Instant::now() + limit;
        while Instant::now() < until {
            if self
                .roster
                .member(name)
                .is_some_and(|n| n.incarnations > m.incarnations && n.pid.is_some())
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

    /// Lets what a reboot of `service` left its clients to find show in
    /// their counters before they are read: a workload thread learns that a
    /// descriptor does not reopen (say, the fault damaged a vault record the
    /// next incarnation rebuilt from) on its first call after the reboot,
    /// which may come after another thread of the same workload already
    /// progressed. Without this, such errors were counted against the next
    /// injection, into another service, as that service disturbed.
    fn settle(&self, service: &str, limits: &Limits) {
        std::thread::sleep(SETTLE);
        self.wait_progress(service, limits.stall);
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
    pub(crate) fn interrupted(&self) -> bool {
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

/// How many reboots in a row, none followed by progress of the target's
/// workloads, make a crash loop: the damage outlives the target's reboots.
const MAX_UNSERVED_REBOOTS: u32 = 10;

/// How long after the target's last reboot in an injection's watch its
/// clients' counters are read (see [`Watch::settle`]).
const SETTLE: Duration = Duration::from_millis(20);

/// How many of the supervisor's last events a lost system's diagnosis shows.
const DIAGNOSIS_EVENTS: usize = 40;

/// How many times in a row the campaign reboots a target whose fresh
/// incarnations do not serve, before it calls the system lost.
const MAX_CLEARING_REBOOTS: u32 = 3;

/// How many times an injection that found no thread of the target in user
/// code (within the injector's patience, 2 s) is tried before it is
/// recorded as not injected.
const INJECTION_TRIES: u32 = 3;

/// Settings of one injection's observation.
pub(crate) struct Limits {
    pub(crate) window: Duration,
    pub(crate) stall: Duration,
    pub(crate) lost: Duration,
}

pub(crate) fn observe(
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
    let incarnations: BTreeMap<&str, u64> = services
        .iter()
        .map(|s| (s.as_str(), w.incarnations(s)))
        .collect();
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
    let mut held = None;
    let mut tries = 1;
    let (injected_at, injection) = loop {
        let at = Instant::now();
        match injector.inject(pid, &fault_kind) {
            // On a loaded machine the target's threads may spend the whole
            // patience asleep or in system calls: try again.
            Err(InjectError::NoRunningThread { .. }) if tries < INJECTION_TRIES => tries += 1,
            r => break (at, r),
        }
    };
    match injection {
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
            if w.incarnations(target) == member.incarnations {
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
    let mut last_incarnation = member.incarnations;
    // Reboots of the target since its workloads last progressed: a crash
    // loop (each incarnation dies or is found hung before it serves) would
    // otherwise keep the watch going for ever.
    let mut unserved_reboots = 0;
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
        let incarnation = w.incarnations(target);
        if incarnation != last_incarnation {
            // A reboot: progress is measured from the new incarnation.
            last_incarnation = incarnation;
            stalled_since = Instant::now();
            base = w.ops_now(target);
            unserved_reboots += 1;
            if unserved_reboots > MAX_UNSERVED_REBOOTS {
                record.injection += &format!(
                    "; rebooted {unserved_reboots} times in a row without serving its workloads"
                );
                lost = true;
                break;
            }
        }
        if w.progressed(target, &base) {
            unserved_reboots = 0;
            stalled_since = Instant::now();
            base = w.ops_now(target);
            if injected_at.elapsed() >= limits.window {
                break;
            }
        }
        if stalled_since.elapsed() >= limits.stall {
            // Not serving: undetected if the injected incarnation still
            // runs; if it was rebooted, its successor does not serve.
            let rebooted = w.incarnations(target) != member.incarnations;
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
            last_incarnation = w.incarnations(target);
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
    record.reboots = w.incarnations(target) - member.incarnations - campaign_reboots;
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
    if !lost && w.incarnations(target) != member.incarnations {
        w.settle(target, limits);
    }
    let after = w.tally(target);
    record.errors = after.errors - tallies[target].errors;
    record.corrupt = after.corrupt - tallies[target].corrupt;
    if record.reboots > 0 || campaign_reboots > 0 {
        record.recovery_ms = Some(injected_at.elapsed().as_secs_f64() * 1e3);
    }
    for s in services.iter().filter(|s| *s != target) {
        let t = w.tally(s);
        if w.incarnations(s) != incarnations[s.as_str()] {
            record.collateral.push(format!("{s}:rebooted"));
        }
        if t.errors != tallies[s.as_str()].errors || t.corrupt != tallies[s.as_str()].corrupt {
            record.collateral.push(format!("{s}:errors"));
        }
    }
    if !record.collateral.is_empty() && record.diagnosis.is_empty() {
        // What disturbed the others: the supervisor's events since the flip.
        record.diagnosis = w
            .events_since(first_event)
            .iter()
            .map(|e| format!("event: {e}"))
            .collect();
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

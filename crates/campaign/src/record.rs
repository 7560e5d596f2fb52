//! The campaign file: its plan, every injection's record, and the tables,
//! JSON and CSV made of them.

use std::path::Path;

use anyhow::Context;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};

use crate::fault_args::Kind;
use crate::outcome::{Outcome, OUTCOMES};

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
    /// When the system was lost: the supervisor's last events, and where
    /// every thread of the target and of its workloads was (`tid name state
    /// wchan syscall`, per process); when another service was disturbed:
    /// the events since the flip.
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
    pub(crate) fn plan(&self) -> Vec<String> {
        let mut plan: Vec<String> = (0..self.faults_per_target)
            .flat_map(|_| self.targets.iter().cloned())
            .collect();
        plan.shuffle(&mut rand::rngs::StdRng::seed_from_u64(self.seed));
        plan
    }

    pub(crate) fn save(&self, out: &Path) -> anyhow::Result<()> {
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

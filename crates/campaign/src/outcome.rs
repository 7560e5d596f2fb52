//! How an injection ended: a pure classification of what was seen after it,
//! worst first, with the outcome classes of RMK's Tables 4–7 and NewtOS's
//! Tables III–IV.

use serde::{Deserialize, Serialize};

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

pub(crate) const OUTCOMES: [Outcome; 8] = [
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
    pub fn label(self) -> &'static str {
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

    pub(crate) fn key(self) -> String {
        serde_json::to_value(self)
            .unwrap()
            .as_str()
            .unwrap()
            .to_string()
    }
}

/// What was seen after one injection: the input of [`classify`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Observed {
    /// The system was lost: the restart policy gave up, a workload died, or
    /// the target did not serve again.
    pub lost: bool,
    /// Reboots of the target that something other than the campaign caused.
    pub reboots: u64,
    /// The target stopped serving and the campaign had to reboot it.
    pub campaign_rebooted: bool,
    /// The watchdog reported a hang of the target.
    pub hang_detected: bool,
    /// Errors and wrong answers the target's workloads counted.
    pub errors: u64,
    pub corrupt: u64,
}

/// The outcome of an injection that took place, from what was seen: worst
/// first (a loss, then a wrong answer, then a fault nothing detected).
pub(crate) fn classify(o: &Observed) -> Outcome {
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

#[cfg(test)]
mod tests {
    use super::*;

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

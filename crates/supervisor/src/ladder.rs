//! What a hang of a checkpointed component is answered with, escalating
//! as a restored state fails again: TAC's rollback in place first
//! (`seeds/001_68a97066b3f6a3ed.txt` §6); a new incarnation from the last
//! checkpoint if the incarnation hangs again within a second of its
//! rollback; and, for a checkpoint-recovered component whose recovered
//! incarnation hangs within a second too and before serving any new
//! request (see [`at_once`]), a fresh start, its checkpoint and request log dropped. The last step is OTP's escalation to a restart
//! from the initial state: a fault can reach a checkpoint before it shows
//! (a flipped register in an idle worker, captured at the next safe
//! point), and a state that brings its hang back with every restore would
//! otherwise be restored for ever. The state is lost then, and the event
//! log says so. Restores start the workers' loops over (the runtime's
//! `restart.rs`), so a fault captured in an idle worker's registers no
//! longer climbs this far; one captured in memory still does.
//!
//! A hang of a recovered incarnation that has served a new request is a
//! new fault (a fault campaign reboots its target before each injection,
//! so every injection lands within a second of a recovery) and starts at
//! the bottom.
//!
//! A crash is answered the same way at its last step: when two
//! incarnations in a row crash by themselves (a signal of their own making
//! or an exit, not a SIGKILL and not the injector's signal) within a
//! second of their checkpoint recoveries and before serving any new
//! request, the restored state or the replayed log is taken to bring the
//! fault back, and the next recovery starts fresh (a register flip
//! captured by a checkpoint made every restore crash at once: a crash
//! loop no restart policy can end well). Less is not enough: a new fault
//! soon after a recovery (a fault campaign injects one every few hundred
//! ms, into threads that serve) is no reason to drop the state.
//!
//! And a checkpoint that cannot be restored ends there too: two checkpoint
//! recoveries in a row that fail (the restore itself refused or broke
//! down) have the next one start fresh, rather than have the restart
//! policy give up on the component.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use kintsugi_runtime::abi::journal::JournalRegion;

/// A hang within this long of a restore is taken for the restored state's.
pub(crate) const AGAIN: Duration = Duration::from_secs(1);

/// An incarnation that failed, as the ladder weighs it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Failed {
    pub pid: u32,
    /// Requests it and its predecessors served in turn so far (`served`,
    /// logged or not), and whether its replay
    /// was still to finish.
    pub served: u64,
    pub replaying: bool,
}

/// Incarnation `pid` of a component whose log is `journal`, failed now.
pub(crate) fn failed(pid: u32, journal: Option<&JournalRegion>) -> Failed {
    Failed {
        pid,
        served: journal.map_or(0, JournalRegion::served),
        replaying: journal.is_some_and(JournalRegion::replay_pending),
    }
}

/// A crash, as the ladder weighs it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Crash {
    pub failed: Failed,
    /// By a signal of its own making or an exit (see the module doc).
    pub by_itself: bool,
}

/// How a component's state was last put back after a failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum How {
    /// Rolled back in place on a hang.
    RolledBack,
    /// Restored into a new incarnation (checkpoint recovery), its log
    /// counting `served` requests then.
    Recovered { served: u64 },
}

/// The answer to a hang.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HangAnswer {
    RollBack,
    /// Kill it; the reboot restores the last checkpoint as usual.
    Reboot,
    /// Kill it; the reboot starts from the initial state.
    RebootFresh,
}

/// The restores of every component, as the ladder needs them.
#[derive(Debug, Default)]
pub(crate) struct Ladder {
    last: HashMap<String, (u32, Instant, How)>,
    /// Components whose next recovery is to start fresh.
    fresh: HashSet<String>,
    /// Recovered incarnations in a row that crashed by themselves at once.
    quick_crashes: HashMap<String, u32>,
    /// Checkpoint recoveries in a row that failed.
    failed_recoveries: HashMap<String, u32>,
}

impl Ladder {
    /// The answer to a hang of `component`'s incarnation `hung.pid`;
    /// `rollback` says whether its policy rolls hangs back at all.
    pub fn answer(&mut self, component: &str, hung: Failed, rollback: bool) -> HangAnswer {
        let recent = self
            .last
            .get(component)
            .filter(|(last, at, _)| *last == hung.pid && at.elapsed() < AGAIN)
            .map(|(_, _, how)| *how);
        let answer = match (rollback, recent) {
            (false, _) => HangAnswer::Reboot,
            (true, None) => HangAnswer::RollBack,
            (true, Some(How::RolledBack)) => HangAnswer::Reboot,
            (true, Some(how)) if at_once(&how, &hung) => HangAnswer::RebootFresh,
            // It served since its recovery: a new fault.
            (true, Some(How::Recovered { .. })) => HangAnswer::RollBack,
        };
        if answer == HangAnswer::RebootFresh {
            self.fresh.insert(component.to_string());
        }
        answer
    }

    /// A crash of `component`'s incarnation: the second in a row that
    /// came by itself, within a second of its checkpoint recovery and
    /// before any new request was served, has the next recovery start
    /// fresh (see the module doc). Returns whether it does.
    pub fn crashed(&mut self, component: &str, crash: Crash) -> bool {
        let died = crash.failed;
        let quick = crash.by_itself
            && self.last.get(component).is_some_and(|(last, at, how)| {
                *last == died.pid && at.elapsed() < AGAIN && at_once(how, &died)
            });
        let count = self.quick_crashes.entry(component.to_string()).or_default();
        *count = match quick {
            true => *count + 1,
            false => 0,
        };
        let poisoned = *count >= 2;
        if poisoned {
            *count = 0;
            self.fresh.insert(component.to_string());
        }
        poisoned
    }

    /// A checkpoint recovery of `component` failed (its new incarnation
    /// is killed and another one tried): the second in a row has the next
    /// recovery start fresh. The last checkpoint then cannot be restored
    /// into any new incarnation (it was taken of a damaged process), and
    /// trying it again would only use up the restart policy and stop the
    /// system. Returns whether it does.
    pub fn recovery_failed(&mut self, component: &str) -> bool {
        let count = self
            .failed_recoveries
            .entry(component.to_string())
            .or_default();
        *count += 1;
        let again = *count >= 2;
        if again {
            *count = 0;
            self.fresh.insert(component.to_string());
        }
        again
    }

    pub fn rolled_back(&mut self, component: &str, pid: u32) {
        self.note(component, pid, How::RolledBack);
    }

    /// `component`'s incarnation `pid` got its state back from a
    /// checkpoint recovery; its log had counted `served` requests then.
    pub fn recovered(&mut self, component: &str, pid: u32, served: u64) {
        self.failed_recoveries.remove(component);
        self.note(component, pid, How::Recovered { served });
    }

    fn note(&mut self, component: &str, pid: u32, how: How) {
        self.last
            .insert(component.to_string(), (pid, Instant::now(), how));
    }

    /// Whether `component`'s next recovery is to start fresh (not
    /// asking: see [`Ladder::take_fresh`]).
    pub fn fresh_next(&self, component: &str) -> bool {
        self.fresh.contains(component)
    }

    /// Whether `component`'s next recovery is to start fresh (asked once).
    pub fn take_fresh(&mut self, component: &str) -> bool {
        self.fresh.remove(component)
    }
}

/// Whether `failed` came before its incarnation did anything new since it
/// was put back `how`: a checkpoint recovery whose replay had not ended,
/// or after which at most one request was served (the one it failed in:
/// a request is counted before it runs).
fn at_once(how: &How, failed: &Failed) -> bool {
    match how {
        How::Recovered { served } => failed.replaying || failed.served.saturating_sub(*served) <= 1,
        How::RolledBack => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hang_climbs_from_rollback_to_reboot_to_a_fresh_start() {
        let mut l = Ladder::default();
        assert_eq!(l.answer("kv", hung(10, 0), true), HangAnswer::RollBack);
        l.rolled_back("kv", 10);
        assert_eq!(l.answer("kv", hung(10, 0), true), HangAnswer::Reboot);
        assert!(!l.take_fresh("kv"));
        l.recovered("kv", 11, 0);
        assert_eq!(l.answer("kv", hung(11, 0), true), HangAnswer::RebootFresh);
        assert!(l.take_fresh("kv"));
        assert!(!l.take_fresh("kv"), "asked once");
    }

    #[test]
    fn a_hang_after_the_recovered_incarnation_served_is_a_new_fault() {
        let mut l = Ladder::default();
        l.recovered("kv", 11, 100);
        assert_eq!(l.answer("kv", hung(11, 102), true), HangAnswer::RollBack);
        l.recovered("kv", 12, 100);
        assert_eq!(
            l.answer("kv", hung(12, 101), true),
            HangAnswer::RebootFresh,
            "hung in the first request it took"
        );
        assert!(l.take_fresh("kv"));
        l.recovered("kv", 11, 100);
        assert!(!l.fresh_next("kv"));
        let replaying = Failed {
            replaying: true,
            ..hung(11, 250)
        };
        assert_eq!(l.answer("kv", replaying, true), HangAnswer::RebootFresh);
    }

    fn hung(pid: u32, served: u64) -> Failed {
        Failed {
            pid,
            served,
            replaying: false,
        }
    }

    fn crash(pid: u32, by_itself: bool, served: u64) -> Crash {
        Crash {
            failed: hung(pid, served),
            by_itself,
        }
    }

    #[test]
    fn two_crashes_in_a_row_right_after_checkpoint_recoveries_start_fresh_next() {
        let mut l = Ladder::default();
        assert!(!l.crashed("kv", crash(7, true, 0)), "no recovery yet");
        l.recovered("kv", 8, 100);
        assert!(!l.crashed("kv", crash(8, true, 100)), "one is a new fault");
        l.recovered("kv", 9, 100);
        assert!(!l.crashed("kv", crash(9, false, 100)), "killed: no count");
        l.recovered("kv", 10, 100);
        assert!(!l.crashed("kv", crash(10, true, 100)));
        l.recovered("kv", 11, 100);
        assert!(!l.fresh_next("kv"));
        assert!(l.crashed("kv", crash(11, true, 100)), "the second in a row");
        assert!(l.fresh_next("kv"));
        assert!(l.take_fresh("kv"));
        l.rolled_back("kv", 12);
        assert!(
            !l.crashed("kv", crash(12, true, 100)),
            "a rollback is not a recovery"
        );
    }

    #[test]
    fn a_crash_after_the_recovered_incarnation_served_is_a_new_fault() {
        let mut l = Ladder::default();
        l.recovered("kv", 8, 100);
        assert!(!l.crashed("kv", crash(8, true, 100)));
        l.recovered("kv", 9, 100);
        assert!(!l.crashed("kv", crash(9, true, 102)), "it served a request");
        l.recovered("kv", 10, 100);
        assert!(!l.crashed("kv", crash(10, true, 100)));
        l.recovered("kv", 11, 100);
        let replaying = Crash {
            failed: Failed {
                replaying: true,
                ..hung(11, 250)
            },
            by_itself: true,
        };
        assert!(
            l.crashed("kv", replaying),
            "died in its replay: nothing new"
        );
    }

    #[test]
    fn two_failed_checkpoint_recoveries_in_a_row_start_fresh_next() {
        let mut l = Ladder::default();
        assert!(!l.recovery_failed("kv"), "one may be the process's own");
        l.recovered("kv", 8, 0);
        assert!(!l.recovery_failed("kv"), "a recovery between: not in a row");
        assert!(!l.fresh_next("kv"));
        assert!(l.recovery_failed("kv"), "the second in a row");
        assert!(l.take_fresh("kv"));
        assert!(!l.recovery_failed("lock"), "counted per component");
    }

    #[test]
    fn another_incarnation_or_a_policy_without_rollback_starts_at_the_bottom() {
        let mut l = Ladder::default();
        l.recovered("kv", 11, 0);
        assert_eq!(l.answer("kv", hung(12, 0), true), HangAnswer::RollBack);
        assert_eq!(l.answer("kv", hung(11, 0), false), HangAnswer::Reboot);
        assert_eq!(l.answer("lock", hung(11, 0), true), HangAnswer::RollBack);
    }
}

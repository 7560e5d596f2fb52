//! What a hang of a checkpointed component is answered with, escalating
//! as a restored state fails again: TAC's rollback in place first
//! (`seeds/001_68a97066b3f6a3ed.txt` §6); a new incarnation from the last
//! checkpoint if the incarnation hangs again within a second of its
//! rollback; and, for a checkpoint-recovered component whose recovered
//! incarnation hangs within a second too, a fresh start, its checkpoint
//! and request log dropped. The last step is OTP's escalation to a restart
//! from the initial state: a fault can reach a checkpoint before it shows
//! (a flipped register in an idle worker, captured at the next safe
//! point), and a state that brings its hang back with every restore would
//! otherwise be restored for ever. The state is lost then, and the event
//! log says so.
//!
//! A crash is answered the same way at its last step: an incarnation that
//! crashes by itself (a signal of its own making or an exit, not a SIGKILL
//! and not the injector's signal) within a second of its checkpoint
//! recovery is taken to have brought the fault back with the restored
//! state or the replayed log, and the next recovery starts fresh (a
//! register flip captured by a checkpoint made every restore crash at
//! once: a crash loop no restart policy can end well).

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

/// A hang within this long of a restore is taken for the restored state's.
pub(crate) const AGAIN: Duration = Duration::from_secs(1);

/// How a component's state was last put back after a failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum How {
    /// Rolled back in place on a hang.
    RolledBack,
    /// Restored into a new incarnation (checkpoint recovery).
    Recovered,
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
}

impl Ladder {
    /// The answer to a hang of `component`'s incarnation `pid`;
    /// `rollback` says whether its policy rolls hangs back at all.
    pub fn answer(&mut self, component: &str, pid: u32, rollback: bool) -> HangAnswer {
        let recent = self
            .last
            .get(component)
            .filter(|(last, at, _)| *last == pid && at.elapsed() < AGAIN)
            .map(|(_, _, how)| *how);
        let answer = match (rollback, recent) {
            (false, _) => HangAnswer::Reboot,
            (true, None) => HangAnswer::RollBack,
            (true, Some(How::RolledBack)) => HangAnswer::Reboot,
            (true, Some(How::Recovered)) => HangAnswer::RebootFresh,
        };
        if answer == HangAnswer::RebootFresh {
            self.fresh.insert(component.to_string());
        }
        answer
    }

    /// A crash of `component`'s incarnation `pid` by its own doing (see
    /// the module doc): if it came within a second of that incarnation's
    /// checkpoint recovery, its next recovery starts fresh. Returns
    /// whether it does.
    pub fn crashed_by_itself(&mut self, component: &str, pid: u32) -> bool {
        let poisoned = self.last.get(component).is_some_and(|(last, at, how)| {
            *last == pid && at.elapsed() < AGAIN && *how == How::Recovered
        });
        if poisoned {
            self.fresh.insert(component.to_string());
        }
        poisoned
    }

    pub fn rolled_back(&mut self, component: &str, pid: u32) {
        self.note(component, pid, How::RolledBack);
    }

    pub fn recovered(&mut self, component: &str, pid: u32) {
        self.note(component, pid, How::Recovered);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hang_climbs_from_rollback_to_reboot_to_a_fresh_start() {
        let mut l = Ladder::default();
        assert_eq!(l.answer("kv", 10, true), HangAnswer::RollBack);
        l.rolled_back("kv", 10);
        assert_eq!(l.answer("kv", 10, true), HangAnswer::Reboot);
        assert!(!l.take_fresh("kv"));
        l.recovered("kv", 11);
        assert_eq!(l.answer("kv", 11, true), HangAnswer::RebootFresh);
        assert!(l.take_fresh("kv"));
        assert!(!l.take_fresh("kv"), "asked once");
    }

    #[test]
    fn a_crash_right_after_a_checkpoint_recovery_starts_fresh_next() {
        let mut l = Ladder::default();
        assert!(!l.crashed_by_itself("kv", 7), "no recovery yet");
        l.recovered("kv", 8);
        assert!(!l.crashed_by_itself("kv", 7), "another incarnation");
        assert!(!l.fresh_next("kv"));
        assert!(l.crashed_by_itself("kv", 8));
        assert!(l.fresh_next("kv"));
        assert!(l.take_fresh("kv"));
        l.rolled_back("kv", 9);
        assert!(
            !l.crashed_by_itself("kv", 9),
            "a rollback is not a recovery"
        );
    }

    #[test]
    fn another_incarnation_or_a_policy_without_rollback_starts_at_the_bottom() {
        let mut l = Ladder::default();
        l.recovered("kv", 11);
        assert_eq!(l.answer("kv", 12, true), HangAnswer::RollBack);
        assert_eq!(l.answer("kv", 11, false), HangAnswer::Reboot);
        assert_eq!(l.answer("lock", 11, true), HangAnswer::RollBack);
    }
}

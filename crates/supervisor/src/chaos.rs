//! Carrying out a crash schedule ([`kintsugi_inject::Schedule`]) against a
//! component, one fault at a time: the next signal is sent only once the
//! last victim has been replaced by a new incarnation (or visibly survived),
//! so that each injection is one fault and none lands on a process already
//! dying.

use std::time::{Duration, Instant};

use kintsugi_inject::{ChaosPlan, Schedule};
use rustix::process::Signal;

/// How long the injector waits for its last victim to die and be replaced.
pub(crate) const VICTIM_GRACE: Duration = Duration::from_secs(1);

/// The target component as the supervisor sees it now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Target {
    /// An incarnation with this pid is live.
    Live(u32),
    /// Between incarnations (rebooting).
    Down,
    /// It will not run again.
    Retired,
}

pub(crate) struct Chaos {
    schedule: Schedule,
    /// The process last signalled, and when.
    last_victim: Option<(u32, Instant)>,
}

impl Chaos {
    pub(crate) fn new(plan: ChaosPlan) -> Self {
        Self {
            schedule: Schedule::new(plan),
            last_victim: None,
        }
    }

    pub(crate) fn target(&self) -> &str {
        &self.schedule.plan.target
    }

    /// True once the last victim's component runs a new incarnation, is
    /// retired, or the victim visibly survived its signal (the grace passed).
    pub(crate) fn victim_replaced(&self, now: Instant, target: Target) -> bool {
        let Some((victim, at)) = self.last_victim else {
            return true;
        };
        now.duration_since(at) >= VICTIM_GRACE
            || match target {
                Target::Live(pid) => pid != victim,
                Target::Down => false,
                Target::Retired => true,
            }
    }

    /// The signal to send now, if one is due and the last victim is replaced.
    pub(crate) fn due(&mut self, now: Instant, target: Target) -> Option<Signal> {
        if !self.victim_replaced(now, target) {
            return None;
        }
        let sig = self.schedule.due(now)?;
        Some(Signal::from_named_raw(sig as i32).expect("crash signals are named"))
    }

    /// `pid` was rolled back in place (a hang injected into it was found
    /// and answered): the victim is dealt with, as if replaced.
    pub(crate) fn rolled_back(&mut self, pid: u32) {
        if self.last_victim.is_some_and(|(victim, _)| victim == pid) {
            self.last_victim = None;
        }
    }

    /// Records that `pid` was signalled at `at`.
    pub(crate) fn hit(&mut self, pid: u32, at: Instant) {
        self.last_victim = Some((pid, at));
    }

    /// Every injection is made and its victim replaced.
    pub(crate) fn finished(&self, now: Instant, target: Target) -> bool {
        self.schedule.done() && self.victim_replaced(now, target)
    }

    /// When the event loop must wake for the injector: the next injection,
    /// or, while the last victim is still dying, the end of its grace.
    pub(crate) fn wake(&self, now: Instant, target: Target) -> Option<Instant> {
        match self.victim_replaced(now, target) {
            true => self.schedule.deadline(),
            false => self.last_victim.map(|(_, at)| at + VICTIM_GRACE),
        }
    }

    /// How long after its injection `pid`'s death was detected, if the
    /// injector killed it.
    pub(crate) fn after_injection(&self, pid: u32, detected: Instant) -> Option<Duration> {
        self.last_victim
            .filter(|(victim, _)| *victim == pid)
            .map(|(_, at)| detected.duration_since(at))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::sys::signal::Signal as NixSignal;

    fn chaos(count: u32) -> Chaos {
        Chaos::new(ChaosPlan {
            target: "fs".into(),
            signals: vec![NixSignal::SIGSEGV],
            min_interval: Duration::ZERO,
            max_interval: Duration::ZERO,
            count: Some(count),
            seed: 3,
        })
    }

    #[test]
    fn no_second_signal_until_the_victim_is_replaced() {
        let mut c = chaos(3);
        let t = Instant::now() + Duration::from_millis(1);
        assert_eq!(c.due(t, Target::Live(10)), Some(Signal::SEGV));
        c.hit(10, t);
        assert_eq!(c.due(t, Target::Live(10)), None, "victim still live");
        assert_eq!(c.due(t, Target::Down), None, "victim's component rebooting");
        assert_eq!(c.wake(t, Target::Down), Some(t + VICTIM_GRACE));
        assert_eq!(c.due(t, Target::Live(11)), Some(Signal::SEGV), "replaced");
        c.hit(11, t);
        assert_eq!(c.due(t, Target::Retired), Some(Signal::SEGV), "retired");
    }

    #[test]
    fn a_victim_that_survives_its_grace_no_longer_blocks() {
        let mut c = chaos(2);
        let t = Instant::now() + Duration::from_millis(1);
        c.due(t, Target::Live(10)).expect("due");
        c.hit(10, t);
        let later = t + VICTIM_GRACE;
        assert!(c.victim_replaced(later, Target::Live(10)));
        assert_eq!(c.due(later, Target::Live(10)), Some(Signal::SEGV));
    }

    #[test]
    fn finished_waits_for_the_last_victim() {
        let mut c = chaos(1);
        let t = Instant::now() + Duration::from_millis(1);
        c.due(t, Target::Live(10)).expect("due");
        c.hit(10, t);
        assert!(!c.finished(t, Target::Live(10)));
        assert!(c.finished(t, Target::Live(12)));
        assert_eq!(
            c.after_injection(10, t + Duration::from_micros(70)),
            Some(Duration::from_micros(70))
        );
        assert_eq!(c.after_injection(12, t), None, "not a victim");
    }
}

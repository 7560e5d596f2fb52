//! When to crash a component: a seeded schedule of crash signals at random
//! intervals, which the supervisor carries out against a component's live
//! incarnation (`kintsugi run --kill`, the demo, the recovery benchmarks).
//! The same seed gives the same signals at the same gaps, as the fault
//! campaigns of the C3 and SuperGlue evaluations require to be repeatable.

use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// When, what and how often to kill.
#[derive(Debug, Clone)]
pub struct ChaosPlan {
    pub target: String,
    pub signals: Vec<Signal>,
    pub min_interval: Duration,
    pub max_interval: Duration,
    /// Stop injecting after this many (None: until the system stops).
    pub count: Option<u32>,
    pub seed: u64,
}

/// A plan being carried out: which signal is due, and when the next one is.
#[derive(Debug)]
pub struct Schedule {
    pub plan: ChaosPlan,
    rng: StdRng,
    next: Instant,
    pub sent: u32,
}

impl Schedule {
    pub fn new(plan: ChaosPlan) -> Self {
        let mut rng = StdRng::seed_from_u64(plan.seed);
        let next = Instant::now() + Self::gap(&plan, &mut rng);
        Self {
            plan,
            rng,
            next,
            sent: 0,
        }
    }

    fn gap(plan: &ChaosPlan, rng: &mut StdRng) -> Duration {
        let lo = plan.min_interval.as_micros() as u64;
        let hi = plan
            .max_interval
            .as_micros()
            .max(plan.min_interval.as_micros()) as u64;
        Duration::from_micros(rng.gen_range(lo..=hi))
    }

    pub fn done(&self) -> bool {
        self.plan.count.is_some_and(|c| self.sent >= c)
    }

    /// The next injection's instant, if any remain.
    pub fn deadline(&self) -> Option<Instant> {
        (!self.done()).then_some(self.next)
    }

    /// If due, picks the signal to send and schedules the next one.
    pub fn due(&mut self, now: Instant) -> Option<Signal> {
        if self.done() || now < self.next {
            return None;
        }
        let sig = self.plan.signals[self.rng.gen_range(0..self.plan.signals.len())];
        self.sent += 1;
        self.next = now + Self::gap(&self.plan, &mut self.rng);
        Some(sig)
    }
}

/// Parses a crash signal's name (`kill`, `SIGSEGV`, `bus`, `abrt`, `abort`, …).
pub fn parse_signal(name: &str) -> Option<Signal> {
    let n = name.trim().to_ascii_uppercase();
    Some(match n.strip_prefix("SIG").unwrap_or(&n) {
        "KILL" => Signal::SIGKILL,
        "SEGV" => Signal::SIGSEGV,
        "BUS" => Signal::SIGBUS,
        "ABRT" | "ABORT" => Signal::SIGABRT,
        "ILL" => Signal::SIGILL,
        "FPE" => Signal::SIGFPE,
        "TERM" => Signal::SIGTERM,
        // A hang, not a crash: the process stops until continued.
        "STOP" => Signal::SIGSTOP,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_schedule() {
        let plan = ChaosPlan {
            target: "x".into(),
            signals: vec![Signal::SIGKILL, Signal::SIGSEGV],
            min_interval: Duration::ZERO,
            max_interval: Duration::ZERO,
            count: Some(20),
            seed: 7,
        };
        let run = |p: ChaosPlan| {
            let mut c = Schedule::new(p);
            let mut v = Vec::new();
            while let Some(s) = c.due(Instant::now() + Duration::from_secs(1)) {
                v.push(s);
            }
            v
        };
        let a = run(plan.clone());
        assert_eq!(a.len(), 20);
        assert_eq!(a, run(plan));
        assert!(a.contains(&Signal::SIGKILL) && a.contains(&Signal::SIGSEGV));
    }

    #[test]
    fn nothing_is_due_before_its_instant_and_nothing_after_the_count() {
        let plan = ChaosPlan {
            target: "x".into(),
            signals: vec![Signal::SIGKILL],
            min_interval: Duration::from_secs(60),
            max_interval: Duration::from_secs(60),
            count: Some(1),
            seed: 1,
        };
        let mut s = Schedule::new(plan);
        assert_eq!(s.due(Instant::now()), None, "not yet due");
        let at = s.deadline().expect("one remains");
        assert_eq!(s.due(at), Some(Signal::SIGKILL));
        assert!(s.done() && s.deadline().is_none());
        assert_eq!(s.due(at + Duration::from_secs(3600)), None);
    }

    #[test]
    fn signal_names() {
        assert_eq!(parse_signal("sigsegv"), Some(Signal::SIGSEGV));
        assert_eq!(parse_signal("KILL"), Some(Signal::SIGKILL));
        assert_eq!(parse_signal("abort"), Some(Signal::SIGABRT));
        assert_eq!(parse_signal("nope"), None);
    }
}

//! Crash injection for demos and tests: signals sent to a component's live
//! incarnation at random instants, reproducible from a seed.

use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rustix::process::Signal;

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

/// A plan being carried out.
pub struct Chaos {
    pub plan: ChaosPlan,
    rng: StdRng,
    next: Instant,
    pub sent: u32,
}

impl Chaos {
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

/// Parses a signal name (`kill`, `SIGSEGV`, `bus`, `abrt`, …).
pub fn parse_signal(name: &str) -> Option<Signal> {
    let n = name.trim().to_ascii_uppercase();
    Some(match n.strip_prefix("SIG").unwrap_or(&n) {
        "KILL" => Signal::KILL,
        "SEGV" => Signal::SEGV,
        "BUS" => Signal::BUS,
        "ABRT" => Signal::ABORT,
        "ILL" => Signal::ILL,
        "FPE" => Signal::FPE,
        "TERM" => Signal::TERM,
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
            signals: vec![Signal::KILL, Signal::SEGV],
            min_interval: Duration::ZERO,
            max_interval: Duration::ZERO,
            count: Some(20),
            seed: 7,
        };
        let run = |p: ChaosPlan| {
            let mut c = Chaos::new(p);
            let mut v = Vec::new();
            while let Some(s) = c.due(Instant::now() + Duration::from_secs(1)) {
                v.push(s);
            }
            v
        };
        let a = run(plan.clone());
        assert_eq!(a.len(), 20);
        assert_eq!(a, run(plan));
        assert!(a.contains(&Signal::KILL) && a.contains(&Signal::SEGV));
    }

    #[test]
    fn signal_names() {
        assert_eq!(parse_signal("sigsegv"), Some(Signal::SEGV));
        assert_eq!(parse_signal("KILL"), Some(Signal::KILL));
        assert_eq!(parse_signal("nope"), None);
    }
}

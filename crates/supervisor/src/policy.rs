//! The restart policy: at most `max` restarts within any `window`, as in
//! OTP's supervisor intensity and period; a reboot's own limit on
//! consecutive failed activations; and a growing delay before restarting
//! a component that fails the same way again and again (systemd's
//! `RestartSteps`), so that a deterministic failure does not spin.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use kintsugi_system::{Backoff, RestartPolicy};
use serde::{Deserialize, Serialize};

use crate::events::Exit;

#[derive(Debug)]
pub struct RestartWindow {
    max: u32,
    window: Duration,
    recent: VecDeque<Instant>,
    backoff: Option<Backoff>,
    /// The failures in a row that looked alike, and what they looked like.
    streak: (Option<Signature>, u32),
    /// When the current (or last) incarnation went live.
    went_live: Instant,
}

/// Why the supervisor gave up on a component.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", tag = "kind")]
pub enum GiveUpReason {
    /// More restarts within the window than the policy allows.
    Policy {
        restarts: u32,
        max: u32,
        #[serde(rename = "window_ms")]
        window_ms: u64,
    },
    /// New incarnations failed to start this many times in a row.
    Activations { failed: u32, last: String },
    /// A temporary component (`restart.type = "temporary"`) ended.
    Temporary,
}

impl std::fmt::Display for GiveUpReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GiveUpReason::Policy {
                restarts,
                max,
                window_ms,
            } => write!(
                f,
                "restart {restarts} within {window_ms} ms exceeds its restart policy (max {max})"
            ),
            GiveUpReason::Activations { failed, last } => write!(
                f,
                "{failed} new incarnations in a row failed to start (the last: {last})"
            ),
            GiveUpReason::Temporary => f.write_str("a temporary component is never restarted"),
        }
    }
}

/// What a failure looked like, as far as the supervisor can tell a
/// deterministic failure from another: the same exit code, or an abort at
/// the same place. Signals other than SIGABRT have none (see [`Backoff`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Signature {
    Code(i32),
    /// A panic at this site (a hash of file, line and column), or an
    /// abort without a recorded panic (0).
    Abort(u64),
}

impl Signature {
    fn of(exit: Exit, panic_site: u64) -> Option<Self> {
        match exit {
            Exit::Code(c) => Some(Signature::Code(c)),
            Exit::Signal(libc::SIGABRT) => Some(Signature::Abort(panic_site)),
            Exit::Signal(_) => None,
        }
    }
}

impl RestartWindow {
    pub fn new(policy: &RestartPolicy) -> Self {
        Self {
            max: policy.max,
            window: policy.window,
            recent: VecDeque::new(),
            backoff: policy.backoff,
            streak: (None, 0),
            went_live: Instant::now(),
        }
    }

    /// Records a restart at `now`; false if it exceeds the policy.
    pub fn allow(&mut self, now: Instant) -> bool {
        while self
            .recent
            .front()
            .is_some_and(|t| now.duration_since(*t) > self.window)
        {
            self.recent.pop_front();
        }
        self.recent.push_back(now);
        self.recent.len() as u32 <= self.max
    }

    pub fn recent(&self) -> u32 {
        self.recent.len() as u32
    }

    /// Whether a reboot that has seen `failed` activations fail in a row
    /// (the last with `last`) may try another at `now`, else why not. Each
    /// activation counts against the policy, a failed one too; and a
    /// component whose every new incarnation fails is given up after
    /// [`MAX_FAILED_ACTIVATIONS`], whatever its policy allows.
    pub fn attempt(&mut self, now: Instant, failed: u32, last: &str) -> Result<(), GiveUpReason> {
        if failed >= MAX_FAILED_ACTIVATIONS {
            return Err(GiveUpReason::Activations {
                failed,
                last: last.to_string(),
            });
        }
        match self.allow(now) {
            true => Ok(()),
            false => Err(GiveUpReason::Policy {
                restarts: self.recent(),
                max: self.max,
                window_ms: self.window.as_millis() as u64,
            }),
        }
    }

    /// An incarnation went live at `now`.
    pub fn went_live(&mut self, now: Instant) {
        self.went_live = now;
    }

    /// The live incarnation failed at `now` with `exit` (and, if it
    /// panicked, at `panic_site`): how long to wait before restarting it,
    /// and how many failures in a row looked the same.
    pub fn failed(&mut self, now: Instant, exit: Exit, panic_site: u64) -> (Duration, u32) {
        let Some(backoff) = self.backoff else {
            return (Duration::ZERO, 0);
        };
        let lived = now.saturating_duration_since(self.went_live);
        let signature = Signature::of(exit, panic_site);
        self.streak = match (signature, self.streak) {
            (None, _) => (None, 0),
            (Some(s), (Some(last), n)) if s == last && lived < backoff.healthy => (Some(s), n + 1),
            (Some(s), _) => (Some(s), 1),
        };
        (backoff.delay(self.streak.1), self.streak.1)
    }
}

/// Consecutive failed activations after which a reboot gives up.
pub const MAX_FAILED_ACTIVATIONS: u32 = 5;

#[cfg(test)]
mod tests {
    use super::*;

    fn window(max: u32, window: Duration) -> RestartWindow {
        RestartWindow::new(&RestartPolicy {
            max,
            window,
            ..RestartPolicy::default()
        })
    }

    #[test]
    fn gives_up_past_max_within_window_and_forgives_later() {
        let mut w = window(2, Duration::from_millis(100));
        let t = Instant::now();
        assert!(w.allow(t));
        assert!(w.allow(t + Duration::from_millis(10)));
        assert!(!w.allow(t + Duration::from_millis(20)));
        assert!(
            w.allow(t + Duration::from_millis(500)),
            "old restarts leave the window"
        );
    }

    #[test]
    fn a_reboot_gives_up_after_five_failed_activations_even_within_its_policy() {
        let mut w = window(1000, Duration::from_secs(1));
        let t = Instant::now();
        for failed in 0..MAX_FAILED_ACTIVATIONS {
            assert!(
                w.attempt(t, failed, "x").is_ok(),
                "attempt after {failed} failures"
            );
        }
        assert_eq!(
            w.attempt(t, MAX_FAILED_ACTIVATIONS, "died"),
            Err(GiveUpReason::Activations {
                failed: MAX_FAILED_ACTIVATIONS,
                last: "died".into()
            }),
            "not blamed on the policy"
        );
        assert_eq!(
            w.recent(),
            MAX_FAILED_ACTIVATIONS,
            "a refused attempt is not counted"
        );
    }

    #[test]
    fn failed_activations_count_against_the_policy() {
        let mut w = window(3, Duration::from_secs(60));
        let t = Instant::now();
        assert!(w.attempt(t, 0, "").is_ok());
        assert!(w.attempt(t, 1, "").is_ok());
        assert!(w.attempt(t, 2, "").is_ok());
        let e = w.attempt(t, 0, "").unwrap_err();
        assert_eq!(
            e.to_string(),
            "restart 4 within 60000 ms exceeds its restart policy (max 3)"
        );
    }

    #[test]
    fn zero_means_never_restart() {
        assert!(!window(0, Duration::from_secs(1)).allow(Instant::now()));
    }

    #[test]
    fn only_failures_alike_within_the_healthy_time_back_off() {
        let mut w = window(1000, Duration::from_secs(1));
        let t = Instant::now();
        let b = Backoff::default();
        let ms = |d: Duration| d.as_millis() as u64;
        // Three panics at one place restart at once; then 10, 20, 40 ms.
        let delays: Vec<u64> = (0..6)
            .map(|i| {
                w.went_live(t + Duration::from_millis(i));
                ms(w.failed(t + Duration::from_millis(i), Exit::Signal(6), 42)
                    .0)
            })
            .collect();
        assert_eq!(delays, [0, 0, 0, 10, 20, 40]);
        // A panic elsewhere starts a new series.
        assert_eq!(w.failed(t, Exit::Signal(6), 43), (Duration::ZERO, 1));
        // SIGKILL and SIGSEGV never count, and end a series.
        assert_eq!(w.failed(t, Exit::Signal(9), 0), (Duration::ZERO, 0));
        for _ in 0..10 {
            assert_eq!(w.failed(t, Exit::Signal(11), 0).0, Duration::ZERO);
        }
        // An incarnation that stayed up `healthy` ends a series of exit codes.
        for _ in 0..4 {
            w.failed(t, Exit::Code(3), 0);
        }
        assert_eq!(ms(w.failed(t, Exit::Code(3), 0).0), 20);
        w.went_live(t);
        let later = t + b.healthy;
        assert_eq!(w.failed(later, Exit::Code(3), 0), (Duration::ZERO, 1));
        // Without a backoff policy, nothing waits.
        let mut off = RestartWindow::new(&RestartPolicy {
            backoff: None,
            ..RestartPolicy::default()
        });
        for _ in 0..10 {
            assert_eq!(off.failed(t, Exit::Code(1), 0).0, Duration::ZERO);
        }
    }
}

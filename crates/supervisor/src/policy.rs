//! The restart policy: at most `max` restarts within any `window`, as in
//! OTP's supervisor intensity and period; and a reboot's own limit on
//! consecutive failed activations.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

#[derive(Debug)]
pub struct RestartWindow {
    max: u32,
    window: Duration,
    recent: VecDeque<Instant>,
}

impl RestartWindow {
    pub fn new(max: u32, window: Duration) -> Self {
        Self {
            max,
            window,
            recent: VecDeque::new(),
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

    /// Whether a reboot that has seen `failed` activations fail in a row may
    /// try another at `now`. Each activation counts against the policy, a
    /// failed one too; and a component whose every new incarnation fails is
    /// given up after [`MAX_FAILED_ACTIVATIONS`], whatever its policy allows.
    pub fn attempt(&mut self, now: Instant, failed: u32) -> bool {
        failed < MAX_FAILED_ACTIVATIONS && self.allow(now)
    }
}

/// Consecutive failed activations after which a reboot gives up.
pub const MAX_FAILED_ACTIVATIONS: u32 = 5;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gives_up_past_max_within_window_and_forgives_later() {
        let mut w = RestartWindow::new(2, Duration::from_millis(100));
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
        let mut w = RestartWindow::new(1000, Duration::from_secs(1));
        let t = Instant::now();
        for failed in 0..MAX_FAILED_ACTIVATIONS {
            assert!(w.attempt(t, failed), "attempt after {failed} failures");
        }
        assert!(!w.attempt(t, MAX_FAILED_ACTIVATIONS));
        assert_eq!(
            w.recent(),
            MAX_FAILED_ACTIVATIONS,
            "a refused attempt is not counted"
        );
    }

    #[test]
    fn failed_activations_count_against_the_policy() {
        let mut w = RestartWindow::new(3, Duration::from_secs(60));
        let t = Instant::now();
        assert!(w.attempt(t, 0));
        assert!(w.attempt(t, 1));
        assert!(w.attempt(t, 2));
        assert!(!w.attempt(t, 0), "a fourth activation within the window");
    }

    #[test]
    fn zero_means_never_restart() {
        assert!(!RestartWindow::new(0, Duration::from_secs(1)).allow(Instant::now()));
    }
}

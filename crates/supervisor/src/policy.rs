//! The restart policy: at most `max` restarts within any `window`, as in
//! OTP's supervisor intensity and period.

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
}

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
    fn zero_means_never_restart() {
        assert!(!RestartWindow::new(0, Duration::from_secs(1)).allow(Instant::now()));
    }
}

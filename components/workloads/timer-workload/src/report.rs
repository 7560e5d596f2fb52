//! What the workload measures per timer, and the JSON report it prints.

use serde::Serialize;

/// At most this many error messages are kept, per timer and in the report.
const KEEP_ERRORS: usize = 10;

/// One timer's ticks as they are measured.
pub struct Measured {
    pub period_us: u64,
    once: bool,
    start_ns: u64,
    expected_tick: u64,
    /// The last tick `wait` returned (0: none yet).
    pub final_tick: u64,
    waits: u64,
    skipped: u64,
    early: u64,
    lateness_ns: Vec<i64>,
    delay_ns: Vec<i64>,
    errors: u64,
    /// Of the errors, ticks out of order.
    out_of_order: u64,
    first_errors: Vec<String>,
    /// The timer was just replaced ([`Measured::replaced`]).
    replaced: bool,
}

impl Measured {
    pub fn new(period_us: u64, once: bool, expected_tick: u64, start_ns: u64) -> Self {
        Self {
            period_us,
            once,
            start_ns,
            expected_tick,
            final_tick: 0,
            waits: 0,
            skipped: 0,
            early: 0,
            lateness_ns: Vec::new(),
            delay_ns: Vec::new(),
            errors: 0,
            out_of_order: 0,
            first_errors: Vec::new(),
            replaced: false,
        }
    }

    /// Failures so far (errors and early ticks), and how many of them were
    /// wrong answers (early ticks, ticks out of order).
    pub fn failures(&self) -> (u64, u64) {
        (self.errors + self.early, self.out_of_order + self.early)
    }

    pub fn fail(&mut self, what: String) {
        self.errors += 1;
        if self.first_errors.len() < KEEP_ERRORS {
            tracing::error!(period_us = self.period_us, "{what}");
            self.first_errors.push(what);
        }
    }

    /// The timer was replaced by a fresh one armed at the same start: its
    /// first wait may return the tick already seen.
    pub fn replaced(&mut self) {
        self.replaced = true;
    }

    /// `wait` returned tick `k`, and the clock read `now_ns` right after.
    pub fn tick(&mut self, k: u64, now_ns: u64) {
        if std::mem::take(&mut self.replaced) && k == self.final_tick {
            self.waits += 1;
            return;
        }
        if k <= self.final_tick || (self.once && k != 1) {
            self.out_of_order += 1;
            self.fail(format!(
                "wait returned tick {k} after tick {}",
                self.final_tick
            ));
            return;
        }
        // Saturating: a tick from a faulty reply may be far beyond any
        // real one (a flipped high bit).
        let since = |tick: u64| {
            let due = tick
                .saturating_mul(self.period_us.saturating_mul(1000))
                .saturating_add(self.start_ns);
            (i128::from(now_ns) - i128::from(due)).clamp(i64::MIN.into(), i64::MAX.into()) as i64
        };
        let lateness = since(k);
        if lateness < 0 {
            self.early += 1;
            tracing::error!(
                period_us = self.period_us,
                "tick {k} returned {} ns early",
                -lateness
            );
            // Counted, not believed: taken as the last tick, a faulty
            // reply's tick far ahead made every later, right one look out
            // of order, one error a tick for the rest of the run (seen in
            // CI's campaign: a flip of bit 55 of a tick in timer).
            self.waits += 1;
            return;
        }
        self.lateness_ns.push(lateness);
        self.delay_ns.push(since(self.final_tick + 1));
        self.skipped += k - self.final_tick - 1;
        self.waits += 1;
        self.final_tick = k;
    }

    pub fn finish(self) -> TimerReport {
        let (max, p99) = spread_us(self.lateness_ns.clone());
        let (max_delay, p99_delay) = spread_us(self.delay_ns.clone());
        TimerReport {
            period_us: self.period_us,
            once: self.once,
            expected_tick: self.expected_tick,
            final_tick: self.final_tick,
            waits: self.waits,
            skipped: self.skipped,
            early: self.early,
            max_lateness_us: max,
            p99_lateness_us: p99,
            max_delay_us: max_delay,
            p99_delay_us: p99_delay,
            errors: self.errors,
            first_errors: self.first_errors,
            lateness_ns: self.lateness_ns,
            delay_ns: self.delay_ns,
        }
    }
}

/// The largest and the 99th-percentile value, in µs (0 for no values).
fn spread_us(mut ns: Vec<i64>) -> (f64, f64) {
    if ns.is_empty() {
        return (0.0, 0.0);
    }
    ns.sort_unstable();
    let p99 = ns[(ns.len() * 99).div_ceil(100) - 1];
    let us = |v: i64| (v as f64 / 100.0).round() / 10.0;
    (us(ns[ns.len() - 1]), us(p99))
}

/// One timer's outcome. Ticks keep their phase when `waits + skipped ==
/// final_tick` and `final_tick >= expected_tick`.
#[derive(Debug, Serialize)]
pub struct TimerReport {
    pub period_us: u64,
    pub once: bool,
    pub expected_tick: u64,
    pub final_tick: u64,
    pub waits: u64,
    /// Ticks passed over because `wait` returned a later one.
    pub skipped: u64,
    /// Ticks returned before their instant (must be 0).
    pub early: u64,
    /// now − the instant of the tick returned, read right after `wait`
    /// returned. At most about a period: a later wake-up returns a later tick.
    pub max_lateness_us: f64,
    pub p99_lateness_us: f64,
    /// now − the instant of the first tick waited for (`after` + 1): how
    /// late the wake-up was, skipped ticks included.
    pub max_delay_us: f64,
    pub p99_delay_us: f64,
    pub errors: u64,
    pub first_errors: Vec<String>,
    #[serde(skip)]
    lateness_ns: Vec<i64>,
    #[serde(skip)]
    delay_ns: Vec<i64>,
}

/// The workload's report: every timer, and the totals over all of them.
#[derive(Debug, Serialize)]
pub struct Report {
    pub seed: u64,
    pub waits: u64,
    pub skipped: u64,
    pub early: u64,
    pub errors: u64,
    /// Over every tick of every timer.
    pub max_lateness_us: f64,
    pub p99_lateness_us: f64,
    pub max_delay_us: f64,
    pub p99_delay_us: f64,
    pub first_errors: Vec<String>,
    pub timers: Vec<TimerReport>,
}

impl Report {
    pub fn of(seed: u64, timers: Vec<TimerReport>) -> Self {
        let pooled = |of: fn(&TimerReport) -> &Vec<i64>| {
            spread_us(timers.iter().flat_map(|t| of(t).iter().copied()).collect())
        };
        let (max, p99) = pooled(|t| &t.lateness_ns);
        let (max_delay, p99_delay) = pooled(|t| &t.delay_ns);
        Self {
            seed,
            waits: timers.iter().map(|t| t.waits).sum(),
            skipped: timers.iter().map(|t| t.skipped).sum(),
            early: timers.iter().map(|t| t.early).sum(),
            errors: timers.iter().map(|t| t.errors).sum(),
            max_lateness_us: max,
            p99_lateness_us: p99,
            max_delay_us: max_delay,
            p99_delay_us: p99_delay,
            first_errors: timers
                .iter()
                .flat_map(|t| t.first_errors.iter().cloned())
                .take(KEEP_ERRORS)
                .collect(),
            timers,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replaced_timer_may_repeat_the_last_tick_once() {
        let period_us = 1000;
        let at = |k: u64| k * period_us * 1000 + 1;
        let mut m = Measured::new(period_us, false, 0, 0);
        m.tick(5, at(5));
        m.replaced();
        m.tick(5, at(5));
        assert_eq!(
            m.failures(),
            (0, 0),
            "a fresh timer's first wait returned the tick already seen"
        );
        m.tick(5, at(5));
        assert_eq!(
            m.failures(),
            (1, 1),
            "the same tick twice from one timer is out of order"
        );
        m.tick(7, at(7));
        assert_eq!((m.final_tick, m.waits), (7, 3));
    }

    #[test]
    fn a_tick_far_ahead_is_one_wrong_answer_not_the_last_tick() {
        let period_us = 1000;
        let at = |k: u64| k * period_us * 1000 + 1;
        let mut m = Measured::new(period_us, false, 0, 0);
        m.tick(14_833, at(14_833));
        // A reply's tick with bit 55 flipped, as a campaign saw.
        m.tick(14_834 | 1 << 55, at(14_834));
        assert_eq!(m.failures(), (1, 1), "counted once, as early");
        m.tick(14_834, at(14_834));
        m.tick(14_835, at(14_835));
        assert_eq!(m.failures(), (1, 1), "the right ticks after it are fine");
        assert_eq!(m.final_tick, 14_835);
    }
}

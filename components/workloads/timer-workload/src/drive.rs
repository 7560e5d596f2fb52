//! Driving one periodic timer, and a set of one-shot timers, through the
//! `timer` interface while measuring every tick.

use kintsugi_interfaces::timer::{Client, Error, Timer};
use kintsugi_runtime::clock::monotonic_ns as now_ns;
use kintsugi_runtime::counters::WorkloadCounters;
use kintsugi_runtime::CallError;

use crate::report::{Measured, TimerReport};

/// Creates and arms a timer, or records why it could not.
fn armed(client: &Client, m: &mut Measured, start_ns: u64, once: bool) -> Option<Timer> {
    let tm = client
        .create(m.period_us)
        .map_err(|e| m.fail(format!("create({}): {e}", m.period_us)))
        .ok()?;
    match client.arm(tm, start_ns, once) {
        Ok(()) => Some(tm),
        Err(e) => {
            m.fail(format!("arm: {e}"));
            None
        }
    }
}

/// A fresh periodic timer in place of one the server refused: armed at
/// `start_ns` again (its ticks go on from the same start), retried every
/// 10 ms until it works or the run is told to stop (None).
fn rearmed(
    client: &Client,
    m: &mut Measured,
    start_ns: u64,
    stop: &dyn Fn() -> bool,
) -> Option<Timer> {
    while !stop() {
        if let Some(tm) = armed(client, m, start_ns, false) {
            m.replaced();
            return Some(tm);
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    None
}

/// A `wait` that must answer `NotArmed`: on a disarmed timer, or a one-shot
/// timer past its tick.
fn expect_not_armed(client: &Client, tm: Timer, m: &mut Measured, when: &str) {
    match client.wait(tm) {
        Err(CallError::Server(Error::NotArmed)) => {}
        other => m.fail(format!("wait {when}: {other:?}, expected NotArmed")),
    }
}

/// Waits on a periodic timer of `period_us` armed at `start_ns` until it
/// reaches tick `ticks` (0: until stopped), publishing each tick and
/// failure in `counters` (a timer the server refuses is replaced); then
/// disarms it, checks that a wait now answers `NotArmed`, and frees it.
pub fn periodic(
    client: &Client,
    period_us: u64,
    start_ns: u64,
    ticks: u64,
    stop: &dyn Fn() -> bool,
    counters: &WorkloadCounters,
) -> TimerReport {
    let mut m = Measured::new(period_us, false, ticks, start_ns);
    let Some(mut tm) = armed(client, &mut m, start_ns, false) else {
        return m.finish();
    };
    let mut seen = [0; 2];
    let publish = |m: &Measured, seen: &mut [u64; 2]| {
        let (failures, corrupt) = m.failures();
        counters.catch_up(seen, failures, corrupt);
    };
    while (ticks == 0 || m.final_tick < ticks) && !stop() {
        match client.wait(tm) {
            Ok(k) => {
                m.tick(k, now_ns());
                counters.op();
            }
            Err(e) => {
                // Counted; then the timer is replaced by a fresh one armed
                // at the same start (a faulty server may have left a state
                // it refuses for ever, such as a tick its client stub
                // stored from a faulty reply), and the run goes on.
                m.fail(format!("wait after tick {}: {e}", m.final_tick));
                // Published at once: replacing the timer can take a while
                // (its server may be recovering), and a fault campaign
                // blames the injection in whose window the count moves
                // (published after the replacement, a timer error was once
                // counted in the window after a flip into timer, that of
                // an injection into ramfs, which shares nothing with it).
                publish(&m, &mut seen);
                let _ = client.free(tm);
                match rearmed(client, &mut m, start_ns, stop) {
                    Some(fresh) => tm = fresh,
                    None => return m.finish(),
                }
            }
        }
        publish(&m, &mut seen);
    }
    if let Err(e) = client.disarm(tm) {
        m.fail(format!("disarm: {e}"));
    }
    expect_not_armed(client, tm, &mut m, "once disarmed");
    if let Err(e) = client.free(tm) {
        m.fail(format!("free: {e}"));
    }
    m.finish()
}

/// Arms one one-shot timer per delay (in µs, ascending) at `start_ns`, then
/// waits for each in turn: its single tick 1 must come (not early), and a
/// second wait must answer `NotArmed`.
pub fn one_shots(
    client: &Client,
    delays_us: &[u64],
    start_ns: u64,
    stop: &dyn Fn() -> bool,
) -> Vec<TimerReport> {
    let mut timers: Vec<(Measured, Option<Timer>)> = delays_us
        .iter()
        .map(|&d| {
            let mut m = Measured::new(d, true, 1, start_ns);
            let tm = armed(client, &mut m, start_ns, true);
            (m, tm)
        })
        .collect();
    for (m, tm) in &mut timers {
        let Some(tm) = *tm else { continue };
        if stop() {
            break;
        }
        match client.wait(tm) {
            Ok(k) => {
                m.tick(k, now_ns());
                expect_not_armed(client, tm, m, "past a one-shot tick");
            }
            Err(e) => m.fail(format!("wait: {e}")),
        }
        if let Err(e) = client.free(tm) {
            m.fail(format!("free: {e}"));
        }
    }
    timers.into_iter().map(|(m, _)| m.finish()).collect()
}

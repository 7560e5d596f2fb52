//! The timers of one incarnation, per (client component, descriptor id), and
//! the wait for a tick.
//!
//! A waiter holds no lock while it sleeps: it sleeps on its timer's
//! `changes` futex word with a timeout that ends at the tick it waits for,
//! so a `disarm`, `free` or client death wakes it at once and other clients'
//! calls are never held up. Each client thread has its own worker thread
//! here (one per channel slot), so waiters block only themselves.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use kintsugi_interfaces::timer::{self, Error};
use kintsugi_runtime::clock::monotonic_ns as now_ns;
use kintsugi_runtime::{futex, watchdog, Caller};

fn locked<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// An armed timer's schedule.
#[derive(Debug, Clone, Copy)]
struct Arming {
    start_ns: u64,
    once: bool,
}

struct Timer {
    period_ns: u64,
    /// `None` while idle, and once freed.
    arming: Mutex<Option<Arming>>,
    /// Raised, and its sleepers woken, whenever `arming` changes.
    changes: AtomicU32,
}

impl Timer {
    fn set(&self, arming: Option<Arming>) {
        *locked(&self.arming) = arming;
        self.changed();
    }

    fn changed(&self) {
        self.changes.fetch_add(1, Ordering::SeqCst);
        futex::wake_all(&self.changes);
    }

    /// The instant of tick `k`, if it fits the clock.
    fn tick_ns(&self, a: Arming, k: u64) -> Option<u64> {
        k.checked_mul(self.period_ns)?.checked_add(a.start_ns)
    }

    /// Whether `wait` may answer `tick`: after `after`, and reached by
    /// `now`. A correct incarnation computes nothing else; a tick that is
    /// not so was computed with damaged registers or memory (a campaign's
    /// flip made one 6.9 million seconds early), and the client stub's
    /// `above(after)` would let it through.
    fn answerable(&self, a: Arming, after: u64, tick: u64, now: u64) -> bool {
        tick > after && self.tick_ns(a, tick).is_some_and(|due| due <= now)
    }
}

/// Every timer of this incarnation. Descriptor ids are per client (a local
/// namespace), so the key carries the client component.
#[derive(Default)]
pub struct Timers {
    timers: Mutex<HashMap<(u32, u64), Arc<Timer>>>,
    next_id: AtomicU64,
}

impl Timers {
    fn get(&self, caller: &Caller, tm: u64) -> Result<Arc<Timer>, Error> {
        locked(&self.timers)
            .get(&(caller.component, tm))
            .cloned()
            .ok_or(Error::Invalid)
    }
}

impl timer::Server for Timers {
    fn create(&self, caller: &Caller, period_us: u64) -> Result<u64, Error> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed) + 1;
        let timer = Timer {
            period_ns: period_us * 1000,
            arming: Mutex::new(None),
            changes: AtomicU32::new(0),
        };
        locked(&self.timers).insert((caller.component, id), Arc::new(timer));
        Ok(id)
    }

    /// Arms an idle timer (an armed one: `Invalid`; the IDL's state machine
    /// goes idle → armed only). `start_ns` may lie in the past: ticks already
    /// passed are reached at once by the next `wait`, which is how a timer
    /// re-armed after a reboot keeps its phase.
    fn arm(&self, caller: &Caller, tm: u64, start_ns: u64, once: bool) -> Result<(), Error> {
        let timer = self.get(caller, tm)?;
        let arming = Arming { start_ns, once };
        timer.tick_ns(arming, 1).ok_or(Error::Invalid)?;
        let mut current = locked(&timer.arming);
        if current.is_some() {
            return Err(Error::Invalid);
        }
        *current = Some(arming);
        Ok(())
    }

    /// Disarms an armed timer (an idle one: `NotArmed`); its waiters get `NotArmed`.
    fn disarm(&self, caller: &Caller, tm: u64) -> Result<(), Error> {
        let timer = self.get(caller, tm)?;
        if locked(&timer.arming).take().is_none() {
            return Err(Error::NotArmed);
        }
        timer.changed();
        Ok(())
    }

    /// Blocks until the first tick after `after` has passed, and returns the
    /// latest tick reached by then (more than `after + 1` if the caller came
    /// late: the ticks in between were skipped). A one-shot timer has the
    /// single tick 1: `after` = 0 waits for it, `after` ≥ 1 is `NotArmed`
    /// (it will never tick again). An idle timer, or one disarmed or freed
    /// during the wait, is `NotArmed`.
    fn wait(&self, caller: &Caller, tm: u64, after: u64) -> Result<u64, Error> {
        let timer = self.get(caller, tm)?;
        let next = after.checked_add(1).ok_or(Error::Invalid)?;
        loop {
            let seen = timer.changes.load(Ordering::SeqCst);
            let arming = (*locked(&timer.arming)).ok_or(Error::NotArmed)?;
            if arming.once && next > 1 {
                return Err(Error::NotArmed);
            }
            let due = timer.tick_ns(arming, next).ok_or(Error::Invalid)?;
            let now = now_ns();
            if now >= due {
                let tick = match arming.once {
                    true => 1,
                    false => (now - arming.start_ns) / timer.period_ns,
                };
                if !timer.answerable(arming, after, tick, now) {
                    // Answering would hand the client a wrong tick: this
                    // incarnation dies instead, is rebooted, and the wait
                    // is made again.
                    tracing::error!("wait after tick {after}: computed tick {tick}, not reached at {now} ns: this incarnation is damaged; aborting");
                    std::process::abort();
                }
                return Ok(tick);
            }
            let wait = Duration::from_nanos(due - now);
            watchdog::blocking(|| futex::wait(&timer.changes, seen, Some(wait)));
        }
    }

    fn free(&self, caller: &Caller, tm: u64) -> Result<(), Error> {
        let timer = locked(&self.timers)
            .remove(&(caller.component, tm))
            .ok_or(Error::Invalid)?;
        timer.set(None);
        Ok(())
    }

    /// Drops the dead client's timers and wakes whoever waited on them (its
    /// own worker threads here, which then return to their slots).
    fn client_died(&self, client: u32) {
        let mut dead = Vec::new();
        locked(&self.timers).retain(|key, timer| {
            let alive = key.0 != client;
            if !alive {
                dead.push(timer.clone());
            }
            alive
        });
        tracing::debug!(client, released = dead.len(), "timer: client died");
        for timer in dead {
            timer.set(None);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_tick_reached_and_after_the_last_seen_is_answered() {
        let timer = Timer {
            period_ns: 1_000,
            arming: Mutex::new(None),
            changes: AtomicU32::new(0),
        };
        let a = Arming {
            start_ns: 5_000,
            once: false,
        };
        // At 12,500 ns ticks 1 to 7 have come.
        assert!(timer.answerable(a, 6, 7, 12_500));
        assert!(
            timer.answerable(a, 0, 7, 12_500),
            "ticks skipped by a late caller"
        );
        assert!(
            !timer.answerable(a, 7, 7, 12_500),
            "not after the last seen"
        );
        assert!(!timer.answerable(a, 6, 8, 12_500), "not reached yet");
        assert!(
            !timer.answerable(a, 6, 1 << 50, 12_500),
            "far ahead: a flip"
        );
        assert!(
            !timer.answerable(a, 6, u64::MAX, u64::MAX),
            "beyond the clock"
        );
    }
}

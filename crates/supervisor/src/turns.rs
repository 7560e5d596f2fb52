//! Turn counts of the supervisor's own serving threads, for its keeper's
//! heartbeat (issue 17; Minix 3's reincarnation server pings every system
//! server, OSIRIS its recovery server). The event loop's turns alone miss
//! a supervisor whose vault thread is stuck (a flipped bit in its loop, a
//! wait on the wrong descriptor): its components then wait for the vault
//! for ever while the loop turns. So every thread a component's request
//! goes through (each vault thread, the output relay) wakes at least once
//! per heartbeat even when idle and counts a turn; an observer
//! ([`Stalls`]) names a thread whose count stood still too long.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The threads registered, each with its name and count.
#[derive(Default)]
pub(crate) struct Threads {
    counts: Mutex<Vec<(String, Arc<AtomicU64>)>>,
}

impl Threads {
    /// A count for thread `name`, which wakes at least `every` (if none is
    /// given, nobody watches: the count is not registered).
    pub(crate) fn register(self: &Arc<Self>, name: &str, every: Option<Duration>) -> Turns {
        let count = Arc::new(AtomicU64::new(0));
        let threads = every.map(|_| {
            self.lock().push((name.to_string(), count.clone()));
            self.clone()
        });
        Turns {
            count,
            every,
            threads,
        }
    }

    /// Every registered thread's name and count.
    pub(crate) fn snapshot(&self) -> Vec<(String, u64)> {
        self.lock()
            .iter()
            .map(|(n, c)| (n.clone(), c.load(Ordering::Relaxed)))
            .collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<(String, Arc<AtomicU64>)>> {
        self.counts.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One thread's turn count; dropped (the thread ends), it is no longer
/// watched.
pub struct Turns {
    count: Arc<AtomicU64>,
    every: Option<Duration>,
    threads: Option<Arc<Threads>>,
}

impl Turns {
    /// A count nobody watches (a thread that may block for ever).
    pub fn unwatched() -> Self {
        Self {
            count: Arc::default(),
            every: None,
            threads: None,
        }
    }

    /// How long the thread may wait for work before it must turn, as a
    /// `poll`/`epoll_wait` timeout (none: for ever).
    pub fn timeout(&self) -> Option<rustix::event::Timespec> {
        self.every.map(|d| rustix::event::Timespec {
            tv_sec: d.as_secs() as i64,
            tv_nsec: d.subsec_nanos() as i64,
        })
    }

    pub fn turned(&self) {
        self.count.fetch_add(1, Ordering::Relaxed);
    }
}

impl Drop for Turns {
    fn drop(&mut self) {
        if let Some(threads) = &self.threads {
            threads.lock().retain(|(_, c)| !Arc::ptr_eq(c, &self.count));
        }
    }
}

/// An observer's view of the counts: when each last moved.
#[derive(Default)]
pub struct Stalls {
    seen: HashMap<String, (u64, Instant)>,
    /// A stall was logged and has not ended since.
    told: bool,
}

impl Stalls {
    /// Whether a thread's count in `counts` has not moved for `bound`
    /// ([`Stalls::look`]); a stall is logged as an error once, saying
    /// its `consequence`, until it ends.
    pub fn stalled(
        &mut self,
        counts: Vec<(String, u64)>,
        bound: Duration,
        consequence: &str,
    ) -> bool {
        let stalled = self.look(counts, bound);
        if let (Some((thread, for_)), false) = (&stalled, self.told) {
            tracing::error!(
                "supervisor: its thread {thread} has not turned for {} ms; {consequence}",
                for_.as_millis()
            );
        }
        self.told = stalled.is_some();
        self.told
    }

    /// Takes the current `counts`; returns a thread whose count has not
    /// moved for `bound` or more, and for how long.
    pub fn look(
        &mut self,
        counts: Vec<(String, u64)>,
        bound: Duration,
    ) -> Option<(String, Duration)> {
        let now = Instant::now();
        self.seen.retain(|n, _| counts.iter().any(|(c, _)| c == n));
        let mut stalled = None;
        for (name, count) in counts {
            let seen = match self.seen.entry(name.clone()) {
                std::collections::hash_map::Entry::Vacant(v) => {
                    v.insert((count, now));
                    continue;
                }
                std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
            };
            if seen.0 != count {
                *seen = (count, now);
            } else if now.duration_since(seen.1) >= bound && stalled.is_none() {
                stalled = Some((name, now.duration_since(seen.1)));
            }
        }
        stalled
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_that_stops_turning_is_named_and_one_that_ends_is_forgotten() {
        let threads = Arc::new(Threads::default());
        let a = threads.register("a", Some(Duration::from_millis(1)));
        let b = threads.register("b", Some(Duration::from_millis(1)));
        let unwatched = threads.register("c", None);
        assert_eq!(
            threads.snapshot().len(),
            2,
            "an unwatched count is not registered"
        );
        let mut stalls = Stalls::default();
        assert_eq!(
            stalls.look(threads.snapshot(), Duration::ZERO).map(|s| s.0),
            None
        );
        a.turned();
        unwatched.turned();
        let stalled = stalls.look(threads.snapshot(), Duration::ZERO);
        assert_eq!(stalled.map(|s| s.0).as_deref(), Some("b"));
        b.turned();
        assert!(stalls
            .look(threads.snapshot(), Duration::from_secs(60))
            .is_none());
        drop(b);
        assert_eq!(threads.snapshot(), [("a".to_string(), 1)]);
        a.turned();
        assert_eq!(
            stalls
                .look(threads.snapshot(), Duration::ZERO)
                .map(|s| s.0)
                .as_deref(),
            None,
            "a moved since the last look"
        );
        assert_eq!(
            stalls
                .look(threads.snapshot(), Duration::ZERO)
                .map(|s| s.0)
                .as_deref(),
            Some("a")
        );
    }
}

//! The event table: every event's trigger count, in the durable arena.
//!
//! ```text
//! slot payload (arena_slots):  count: u64 | bell: u32 | unused: u32
//! ```
//!
//! `count` is the number of triggers so far; `bell` is the futex word
//! waiters sleep on, raised by every trigger, by `free` and by a client's
//! death, so that no wake-up is missed. A waiter passes the count it has
//! seen and returns as soon as the count is past it: a wait re-issued after
//! a reboot returns at once if the trigger came meanwhile, and a trigger is
//! never lost because the count outlives every incarnation. A trigger whose
//! first attempt counted before the server died counts again when the stub
//! re-issues it: a duplicate, never a loss.

use std::ops::Deref;
use std::sync::atomic::{AtomicU32, Ordering::SeqCst};

use kintsugi_arena_slots::{Deaths, Slot, Slots};
use kintsugi_interfaces::evt::{Error, Server};
use kintsugi_runtime::abi::shm::Region;
use kintsugi_runtime::Caller;
use kintsugi_runtime::{futex, watchdog};

const COUNT: usize = 0;
const BELL: usize = 8;

pub struct Events<A> {
    slots: Slots<A>,
    deaths: Deaths,
}

impl<A: Deref<Target = Region>> Events<A> {
    /// The event table in `arena` (zero at first boot).
    pub fn new(arena: A) -> Self {
        let len = arena.len();
        Self {
            slots: Slots::new(arena, 0, len),
            deaths: Deaths::default(),
        }
    }

    fn event(&self, ev: u64) -> Result<Slot<'_>, Error> {
        self.slots.get(ev).ok_or(Error::NotFound)
    }
}

/// Raises a futex word and wakes everyone asleep on it.
fn ring(bell: &AtomicU32) {
    bell.fetch_add(1, SeqCst);
    futex::wake_all(bell);
}

impl<A: Deref<Target = Region> + Send + Sync + 'static> Server for Events<A> {
    fn create(&self, caller: &Caller, reuse: Option<u64>, name: u64) -> Result<u64, Error> {
        self.slots
            .create(name, reuse, |s| s.u64(COUNT).store(0, SeqCst))
            .map_err(|e| {
                tracing::warn!(client = caller.component, name, "create: {e}");
                Error::NotFound
            })
    }

    fn wait(&self, caller: &Caller, ev: u64, seen: u64) -> Result<u64, Error> {
        let slot = self.event(ev)?;
        let (count, bell) = (slot.u64(COUNT), slot.u32(BELL));
        let deaths = self.deaths.of(caller.component);
        // A client has seen every count up to `seen` from this server: a
        // count below it was lost (a slot rebuilt at zero after a fault
        // damaged the arena). Raised back, the waiter waits for the next
        // trigger instead of for every trigger ever counted again.
        let before = count.fetch_max(seen, SeqCst);
        if before < seen {
            tracing::warn!(
                client = caller.component,
                event = ev,
                before,
                seen,
                "an event's count was behind what a client had seen: raised"
            );
        }
        loop {
            let rung = bell.load(SeqCst);
            let now = count.load(SeqCst);
            if now > seen {
                return Ok(now);
            }
            if self.slots.get(ev).is_none() {
                return Err(Error::NotFound); // freed meanwhile
            }
            if self.deaths.of(caller.component) != deaths {
                tracing::info!(
                    client = caller.component,
                    event = ev,
                    "gave up a wait for a dead client"
                );
                return Err(Error::NotFound);
            }
            watchdog::blocking(|| futex::wait(bell, rung, None));
        }
    }

    fn trigger(&self, _: &Caller, ev: u64) -> Result<u64, Error> {
        let slot = self.event(ev)?;
        let count = slot.u64(COUNT).fetch_add(1, SeqCst) + 1;
        ring(slot.u32(BELL));
        Ok(count)
    }

    fn free(&self, _: &Caller, ev: u64) -> Result<(), Error> {
        let slot = self.event(ev)?;
        if !self.slots.remove(ev) {
            return Err(Error::NotFound);
        }
        ring(slot.u32(BELL)); // its waiters find it gone
        Ok(())
    }

    fn client_died(&self, client: u32) {
        self.deaths.record(client);
        for slot in self.slots.live() {
            ring(slot.u32(BELL)); // the dead client's waits give up
        }
        tracing::info!("woke the waiters of dead client {client}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    const A: Caller = Caller {
        component: 1,
        slot: 0,
    };
    const B: Caller = Caller {
        component: 2,
        slot: 0,
    };
    const BLOCKED: Duration = Duration::from_millis(50);
    const SOON: Duration = Duration::from_secs(5);

    fn boot(arena: &Arc<Region>) -> Arc<Events<Arc<Region>>> {
        Arc::new(Events::new(arena.clone()))
    }

    fn wait_async(
        events: &Arc<Events<Arc<Region>>>,
        who: Caller,
        ev: u64,
        seen: u64,
    ) -> std::sync::mpsc::Receiver<Result<u64, Error>> {
        let (tx, rx) = std::sync::mpsc::channel();
        let events = events.clone();
        std::thread::spawn(move || tx.send(events.wait(&who, ev, seen)).unwrap());
        rx
    }

    #[test]
    fn a_wait_returns_once_the_count_passes_what_it_has_seen() {
        let arena = Arc::new(Region::create("events-test", 4096).unwrap());
        let events = boot(&arena);
        let ev = events.create(&A, None, 5).unwrap();
        assert_eq!(
            events.create(&B, None, 5).unwrap(),
            ev,
            "one event per name"
        );
        let w = wait_async(&events, B, ev, 0);
        assert!(w.recv_timeout(BLOCKED).is_err());
        assert_eq!(events.trigger(&A, ev), Ok(1));
        assert_eq!(w.recv_timeout(SOON).unwrap(), Ok(1));
        assert_eq!(events.trigger(&A, ev), Ok(2));
        assert_eq!(
            events.wait(&B, ev, 0),
            Ok(2),
            "a late waiter returns at once"
        );
    }

    #[test]
    fn counts_survive_a_reboot() {
        let arena = Arc::new(Region::create("events-test", 4096).unwrap());
        let first = boot(&arena);
        let ev = first.create(&A, None, 5).unwrap();
        first.trigger(&A, ev).unwrap();
        drop(first);
        let second = boot(&arena);
        assert_eq!(second.create(&A, Some(ev), 5), Ok(ev));
        assert_eq!(
            second.wait(&B, ev, 0),
            Ok(1),
            "the re-issued wait sees the trigger"
        );
        assert_eq!(second.trigger(&A, ev), Ok(2));
    }

    #[test]
    fn a_count_behind_what_a_client_saw_is_raised_to_it() {
        let arena = Arc::new(Region::create("events-test", 4096).unwrap());
        let events = boot(&arena);
        let ev = events.create(&A, None, 5).unwrap();
        let w = wait_async(&events, B, ev, 1000);
        assert!(w.recv_timeout(BLOCKED).is_err(), "nothing triggered yet");
        assert_eq!(events.trigger(&A, ev), Ok(1001));
        assert_eq!(w.recv_timeout(SOON).unwrap(), Ok(1001));
    }

    #[test]
    fn a_dead_clients_waits_give_up_and_free_wakes_the_rest() {
        let arena = Arc::new(Region::create("events-test", 4096).unwrap());
        let events = boot(&arena);
        let ev = events.create(&A, None, 5).unwrap();
        let a = wait_async(&events, A, ev, 0);
        let b = wait_async(&events, B, ev, 0);
        assert!(a.recv_timeout(BLOCKED).is_err());
        events.client_died(A.component);
        assert_eq!(a.recv_timeout(SOON).unwrap(), Err(Error::NotFound));
        assert!(
            b.recv_timeout(BLOCKED).is_err(),
            "a live client's wait goes on"
        );
        events.free(&A, ev).unwrap();
        assert_eq!(b.recv_timeout(SOON).unwrap(), Err(Error::NotFound));
        assert_eq!(events.trigger(&A, ev), Err(Error::NotFound));
    }
}

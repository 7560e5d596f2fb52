//! `fails` in the IDL, end to end over real shared memory: timer's `wait`
//! fails only with `NotArmed` from a correct server, so the generated
//! client stub takes an `Invalid` for it as a faulty server's reply; and
//! `create` is `infallible`, so any error for it is a faulty reply.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kintsugi_interfaces::timer::{self, Error};
use kintsugi_runtime::stub::{CallError, Caller, Fault, InterfaceError};
use kintsugi_runtime::testing::Loopback;
use kintsugi_runtime::wire::WireError;

/// A timer server whose every tick is due at once: `wait` answers the tick
/// after the one the client has seen. `wrong` replies to `wait` are
/// `Invalid` (a faulty server's), each taking one.
struct Ticks {
    armed: Mutex<HashMap<u64, bool>>,
    next: AtomicU64,
    wrong: Arc<AtomicU64>,
    /// `create`s to answer with `Invalid` (a faulty server's), each taking one.
    refused: Arc<AtomicU64>,
    /// The next `wait` answers a tick this far ahead (a faulty reply that
    /// `above(after)` lets through), once.
    leap: Arc<AtomicU64>,
}

/// Past any clock: `wait` after such a tick is `Invalid`, as timer's
/// own `wait` finds its next tick's instant beyond `u64`.
const FAR: u64 = 1 << 50;

impl Ticks {
    fn new(incarnation: u64, faults: &Faults) -> Arc<Self> {
        Arc::new(Ticks {
            armed: Mutex::default(),
            next: AtomicU64::new(incarnation * 1000),
            wrong: faults.wrong.clone(),
            refused: faults.refused.clone(),
            leap: faults.leap.clone(),
        })
    }
}

impl timer::Server for Ticks {
    fn create(&self, _: &Caller, _period_us: u64) -> Result<u64, Error> {
        let refused = self
            .refused
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |r| r.checked_sub(1));
        if refused.is_ok() {
            return Err(Error::Invalid);
        }
        let id = self.next.fetch_add(1, Ordering::SeqCst) + 1;
        self.armed.lock().unwrap().insert(id, false);
        Ok(id)
    }

    fn arm(&self, _: &Caller, tm: u64, _start_ns: u64, _once: bool) -> Result<(), Error> {
        match self.armed.lock().unwrap().get_mut(&tm) {
            Some(armed @ false) => {
                *armed = true;
                Ok(())
            }
            _ => Err(Error::Invalid),
        }
    }

    fn disarm(&self, _: &Caller, tm: u64) -> Result<(), Error> {
        match self.armed.lock().unwrap().get_mut(&tm) {
            Some(armed @ true) => {
                *armed = false;
                Ok(())
            }
            Some(false) => Err(Error::NotArmed),
            None => Err(Error::Invalid),
        }
    }

    fn wait(&self, _: &Caller, tm: u64, after: u64) -> Result<u64, Error> {
        let wrong = self
            .wrong
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |w| w.checked_sub(1))
            .is_ok();
        let leap = self.leap.swap(0, Ordering::SeqCst);
        match self.armed.lock().unwrap().get(&tm) {
            _ if wrong || after >= FAR => Err(Error::Invalid),
            Some(true) => Ok(after + 1 + leap),
            Some(false) => Err(Error::NotArmed),
            None => Err(Error::Invalid),
        }
    }

    fn free(&self, _: &Caller, tm: u64) -> Result<(), Error> {
        self.armed
            .lock()
            .unwrap()
            .remove(&tm)
            .map(drop)
            .ok_or(Error::Invalid)
    }
}

/// The faults a test has the server make, shared by its incarnations.
#[derive(Clone, Default)]
struct Faults {
    wrong: Arc<AtomicU64>,
    refused: Arc<AtomicU64>,
    leap: Arc<AtomicU64>,
}

/// Plays the watchdog: reboots the server whenever a client suspects the
/// live incarnation, up to epoch `last`.
fn watchdog(lb: &Arc<Loopback>, faults: &Faults, last: u64, stop: &Arc<AtomicBool>) -> impl Drop {
    let (lb, faults, done) = (lb.clone(), faults.clone(), stop.clone());
    let thread = std::thread::spawn(move || {
        while !done.load(Ordering::SeqCst) {
            if lb.suspected() == lb.epoch() && lb.epoch() < last {
                lb.reboot(timer::service(Ticks::new(lb.epoch() + 1, &faults)));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    });
    Stopper(stop.clone(), Some(thread))
}

struct Stopper(Arc<AtomicBool>, Option<std::thread::JoinHandle<()>>);

impl Drop for Stopper {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
        if let Some(t) = self.1.take() {
            t.join().unwrap();
        }
    }
}

#[test]
fn an_error_a_call_never_fails_with_has_the_server_rebooted() {
    let faults = Faults::default();
    let wrong = faults.wrong.clone();
    let lb = Arc::new(Loopback::new(timer::service(Ticks::new(1, &faults))));
    let client = timer::Client::from_connection(lb.watched_connection());
    let stop = Arc::new(AtomicBool::new(false));
    let _watchdog = watchdog(&lb, &faults, u64::MAX, &stop);
    let tm = client.create(1000).unwrap();
    // `NotArmed` is one of `wait`'s own errors: answered, nothing suspected.
    assert_eq!(client.wait(tm), Err(CallError::Server(Error::NotArmed)));
    assert_eq!((lb.epoch(), lb.suspected()), (1, 0));
    client.arm(tm, 0, false).unwrap();
    assert_eq!(client.wait(tm).unwrap(), 1);
    // `Invalid` is not: the server is rebooted, the stub rebuilds the timer
    // (create, arm) on the new incarnation and waits again, from the tick
    // it had seen.
    wrong.store(1, Ordering::SeqCst);
    assert_eq!(client.wait(tm).unwrap(), 2);
    assert_eq!(
        lb.epoch(),
        2,
        "the server that answered `Invalid` was rebooted"
    );
    assert_eq!(wrong.load(Ordering::SeqCst), 0);
    assert_eq!(client.wait(tm).unwrap(), 3);
    // A second fault at once after a sound reply is suspected in turn.
    wrong.store(1, Ordering::SeqCst);
    assert_eq!(client.wait(tm).unwrap(), 4);
    assert_eq!(lb.epoch(), 3, "the second faulty reply was suspected too");
    // A call that declares no `fails` takes any declared error for an
    // answer: `disarm`'s `NotArmed` on an idle timer reboots nothing.
    client.disarm(tm).unwrap();
    assert_eq!(client.disarm(tm), Err(CallError::Server(Error::NotArmed)));
    assert_eq!(lb.epoch(), 3);
}

#[test]
fn any_error_for_an_infallible_call_has_the_server_rebooted() {
    let faults = Faults::default();
    let lb = Arc::new(Loopback::new(timer::service(Ticks::new(1, &faults))));
    let stop = Arc::new(AtomicBool::new(false));
    let _watchdog = watchdog(&lb, &faults, u64::MAX, &stop);
    let client = timer::Client::from_connection(lb.watched_connection());
    faults.refused.store(1, Ordering::SeqCst);
    let tm = client.create(1000).unwrap();
    assert_eq!(
        lb.epoch(),
        2,
        "the server that refused `create` was rebooted"
    );
    assert_eq!(faults.refused.load(Ordering::SeqCst), 0);
    client.arm(tm, 0, false).unwrap();
    assert_eq!(client.wait(tm).unwrap(), 1, "the timer made again serves");
    // Unwatched, the error comes back as a faulty reply, not as an answer.
    let lb = Loopback::new(timer::service(Ticks::new(1, &faults)));
    let client = timer::Client::from_connection(lb.connection());
    faults.refused.store(1, Ordering::SeqCst);
    let code = Error::Invalid.code();
    assert_eq!(
        client.create(1000),
        Err(CallError::Fault(Fault::Decode(WireError::Impossible {
            code
        })))
    );
    assert!(client.create(1000).is_ok());
}

#[test]
fn unwatched_the_impossible_error_is_returned_as_a_faulty_reply() {
    let faults = Faults::default();
    let wrong = faults.wrong.clone();
    let lb = Loopback::new(timer::service(Ticks::new(1, &faults)));
    let client = timer::Client::from_connection(lb.connection());
    let tm = client.create(1000).unwrap();
    client.arm(tm, 0, false).unwrap();
    wrong.store(1, Ordering::SeqCst);
    let code = Error::Invalid.code();
    assert_eq!(
        client.wait(tm),
        Err(CallError::Fault(Fault::Decode(WireError::Impossible {
            code
        })))
    );
    assert_eq!((lb.epoch(), lb.suspected()), (1, 0));
    assert_eq!(client.wait(tm).unwrap(), 1);
}

/// A tick far ahead that a faulty reply left in the stub (`above` lets it
/// through) makes every later `wait` impossible to answer: the first such
/// refusal has the server rebooted once, and the same `wait`, re-issued
/// after the rebuild (whose own calls are answered soundly), is refused
/// again and returned: the request is at fault, and no reboot follows.
#[test]
fn a_wrong_tick_the_stub_kept_costs_one_reboot_not_one_per_rebuild() {
    let faults = Faults::default();
    let lb = Arc::new(Loopback::new(timer::service(Ticks::new(1, &faults))));
    let client = timer::Client::from_connection(lb.watched_connection());
    let stop = Arc::new(AtomicBool::new(false));
    let _watchdog = watchdog(&lb, &faults, 6, &stop);
    let tm = client.create(1000).unwrap();
    client.arm(tm, 0, false).unwrap();
    faults.leap.store(FAR, Ordering::SeqCst);
    assert_eq!(client.wait(tm).unwrap(), FAR + 1, "the leap is kept");
    assert!(matches!(
        client.wait(tm),
        Err(CallError::Fault(Fault::Decode(
            WireError::Impossible { .. }
        )))
    ));
    assert_eq!(lb.epoch(), 2, "one reboot, not one per rebuild");
    // A fresh timer serves.
    let fresh = client.create(1000).unwrap();
    client.arm(fresh, 0, false).unwrap();
    assert_eq!(client.wait(fresh).unwrap(), 1);
    assert_eq!(lb.epoch(), 2);
}

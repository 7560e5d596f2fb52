//! The gate a standby's threads wait at until its incarnation's services
//! exist, and how they are let through at activation without waking them
//! all.
//!
//! A standby starts its worker threads long before it is needed (C3's
//! micro-reboot keeps a rebooted component's threads ready, 004_*.txt
//! §III). Woken together at activation, they cost more than the rest of a
//! small service's initialization: each wake-up is about 8 µs of this VM's
//! time (an inter-processor interrupt to an idle vCPU, a context switch),
//! and lock's 16 workers took 50–190 µs of its 120–250 µs (measured with
//! timestamps around the opening, 2026-12-07). A cascade of wake-ups (each
//! woken worker waking two more) only moved that time from the
//! initialization to what follows it: the same total reboot in
//! `kintsugi bench recovery`.
//!
//! So a worker whose slot holds no request is not woken at all. Each
//! worker waits on a word of its own; at the opening, the gate marks the
//! worker's slot as having a sleeping server and moves the worker, still
//! asleep, from its word onto the slot's state word (`FUTEX_CMP_REQUEUE`),
//! where a worker that found no request sleeps anyway. Its client's next
//! call then wakes it as it would wake any sleeping worker. Only workers
//! with a request already posted are woken. Threads of other kinds (the
//! audit thread, the client-death watcher) wait on one shared word and are
//! all woken.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};

use rustix::thread::futex as sys;

use crate::abi::channel::{state, Edge};
use crate::futex;
use crate::server::RecoveryGate;
use crate::stub::Service;

/// The services of an incarnation by interface name, and its epoch.
pub(crate) type Services = (HashMap<&'static str, Arc<dyn Service>>, u64);

/// One worker: the word it waits on at the gate, and its slot.
struct Worker {
    word: AtomicU32,
    edge: Arc<Edge>,
    slot: u32,
}

/// How a gate lets its workers through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Opening {
    /// Workers with no request stay asleep, moved onto their slots.
    Lazy,
    /// Every worker is woken (a checkpoint-recovered component: its first
    /// worker to run replays the log, whatever its slot holds).
    All,
}

/// Holds a standby's threads until the incarnation's services exist.
pub(crate) struct Gate {
    open: AtomicU32,
    /// Threads that hold their lifeline.
    pub registered: AtomicU32,
    services: OnceLock<Services>,
    workers: Vec<Worker>,
    opening: Opening,
    /// Closed during eager recovery.
    pub recovery: RecoveryGate,
}

/// A worker's word: closed, then open.
const CLOSED: u32 = 0;
const OPEN: u32 = 1;

impl Gate {
    /// A gate for one worker per slot in `slots` (the worker's number is
    /// its place there).
    pub fn new(slots: Vec<(Arc<Edge>, u32)>, opening: Opening) -> Self {
        Self {
            open: AtomicU32::new(CLOSED),
            registered: AtomicU32::new(0),
            services: OnceLock::new(),
            workers: slots
                .into_iter()
                .map(|(edge, slot)| Worker {
                    word: AtomicU32::new(CLOSED),
                    edge,
                    slot,
                })
                .collect(),
            opening,
            recovery: RecoveryGate::default(),
        }
    }

    /// Opens the gate: every thread may pass, and the workers are let
    /// through as [`Opening`] says.
    pub fn open(&self, services: Vec<Arc<dyn Service>>, epoch: u64) {
        let map = services
            .into_iter()
            .map(|s| (s.interface().name, s))
            .collect();
        let _ = self.services.set((map, epoch));
        self.open.store(OPEN, Ordering::SeqCst);
        futex::wake_all(&self.open);
        for w in &self.workers {
            match self.opening {
                Opening::All => {
                    w.word.store(OPEN, Ordering::SeqCst);
                    futex::wake(&w.word, 1);
                }
                Opening::Lazy => w.let_through(),
            }
        }
    }

    /// Waits until the gate is open; returns the services and the epoch.
    pub fn opened(&self) -> &Services {
        wait_open(&self.open);
        self.services.get().expect("gate opened without services")
    }

    /// Every service, once the gate is open.
    pub fn all(&self) -> Vec<Arc<dyn Service>> {
        self.opened().0.values().cloned().collect()
    }

    /// Worker `worker`'s wait: returns its service and the epoch once the
    /// gate has let it through (at once if it is open), with its slot's
    /// sleeping mark cleared.
    pub fn worker_wait(&self, worker: usize, interface: &str) -> (Arc<dyn Service>, u64) {
        let w = &self.workers[worker];
        wait_open(&w.word);
        // Set by the opening if this worker was moved onto its slot; the
        // worker sets it again itself when it next sleeps.
        w.edge
            .slot(w.slot)
            .server_sleeping
            .store(0, Ordering::SeqCst);
        let (map, epoch) = self.opened();
        match map.get(interface) {
            Some(s) => (s.clone(), *epoch),
            // open_services checked this before the gate opened.
            None => unreachable!("no service for a provided interface"),
        }
    }
}

impl Worker {
    /// Wakes this worker if its slot holds a request; else moves it,
    /// asleep, onto the slot's state word, marked as a sleeping server, so
    /// that its client's next call wakes it. A request posted while this
    /// runs is seen by the last check (its client may have found the mark
    /// and woken the slot before the worker was moved there).
    fn let_through(&self) {
        let s = self.edge.slot(self.slot);
        if s.state.load(Ordering::SeqCst) == state::REQUEST {
            self.word.store(OPEN, Ordering::SeqCst);
            futex::wake(&self.word, 1);
            return;
        }
        s.server_sleeping.store(1, Ordering::SeqCst);
        // Open first: a worker not yet asleep then passes at once, and
        // one asleep is moved (the comparison is with the open word).
        self.word.store(OPEN, Ordering::SeqCst);
        let _ = sys::cmp_requeue(&self.word, sys::Flags::empty(), 0, 1, &s.state, OPEN);
        if s.state.load(Ordering::SeqCst) == state::REQUEST {
            // All: its client may sleep on the same word for the reply.
            futex::wake_all(&s.state);
        }
    }
}

/// Sleeps until `word` is open. A wake-up of another word's (a worker
/// moved onto its slot) finds it open.
fn wait_open(word: &AtomicU32) {
    while word.load(Ordering::SeqCst) == CLOSED {
        futex::wait(word, CLOSED, None);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicBool;
    use std::time::{Duration, Instant};

    use super::*;
    use crate::stub::{Caller, Dispatched, InterfaceInfo};

    static NULL: InterfaceInfo = InterfaceInfo {
        name: "null",
        hash: 1,
        functions: &["null"],
        readonly: &[],
    };

    struct Null;

    impl Service for Null {
        fn interface(&self) -> &'static InterfaceInfo {
            &NULL
        }
        fn client_died(&self, _: u32) {}
        fn dispatch(&self, _: &Caller, _: u32, _: &[u8], _: &mut [u8]) -> Dispatched {
            Dispatched::Ok(0)
        }
    }

    /// A gate over `slots` slots of a new edge, a worker thread waiting at
    /// it for each, and a flag each raises once let through; returns once
    /// every worker is asleep.
    fn workers(slots: u32, opening: Opening) -> (Arc<Edge>, Arc<Gate>, Vec<Arc<AtomicBool>>) {
        let edge = Arc::new(Edge::create("gate-test", slots).unwrap());
        let gate = Arc::new(Gate::new(
            (0..slots).map(|s| (edge.clone(), s)).collect(),
            opening,
        ));
        let mut passed = Vec::new();
        for w in 0..slots as usize {
            let (gate, flag) = (gate.clone(), Arc::new(AtomicBool::new(false)));
            let (tid_tx, tid_rx) = std::sync::mpsc::channel();
            let raised = flag.clone();
            std::thread::spawn(move || {
                tid_tx
                    .send(rustix::thread::gettid().as_raw_nonzero().get())
                    .unwrap();
                gate.worker_wait(w, "null");
                raised.store(true, Ordering::SeqCst);
            });
            asleep(tid_rx.recv().unwrap());
            passed.push(flag);
        }
        (edge, gate, passed)
    }

    /// Waits (up to 10 s) until thread `tid` of this process sleeps.
    fn asleep(tid: i32) {
        let path = format!("/proc/self/task/{tid}/stat");
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let stat = std::fs::read_to_string(&path).unwrap();
            // The state follows the parenthesized name.
            let state = stat.rsplit(')').next().unwrap().trim_start().chars().next();
            if state == Some('S') {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "thread {tid} never slept: {stat}"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn passes(flag: &AtomicBool) -> bool {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !flag.load(Ordering::SeqCst) {
            if Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }

    #[test]
    fn a_worker_with_no_request_sleeps_through_the_opening_until_its_client_calls() {
        let (edge, gate, passed) = workers(3, Opening::Lazy);
        // Slot 1 holds a request posted before the opening.
        edge.slot(1).state.store(state::REQUEST, Ordering::SeqCst);
        gate.open(vec![Arc::new(Null)], 7);
        assert!(
            passes(&passed[1]),
            "the worker with a request was not let through"
        );
        // The others were moved onto their slots, asleep, marked so.
        std::thread::sleep(Duration::from_millis(100));
        for idle in [0, 2] {
            assert!(
                !passed[idle].load(Ordering::SeqCst),
                "worker {idle} was woken"
            );
            assert_eq!(
                edge.slot(idle as u32)
                    .server_sleeping
                    .load(Ordering::SeqCst),
                1
            );
        }
        // Slot 2's client calls as any client does: the worker wakes.
        let s = edge.slot(2);
        s.state.store(state::REQUEST, Ordering::SeqCst);
        if s.server_sleeping.load(Ordering::SeqCst) != 0 {
            futex::wake(&s.state, 1);
        }
        assert!(passes(&passed[2]), "the called worker stayed asleep");
        assert_eq!(
            s.server_sleeping.load(Ordering::SeqCst),
            0,
            "its mark stayed"
        );
        assert!(
            !passed[0].load(Ordering::SeqCst),
            "worker 0 was woken by another's call"
        );
        assert_eq!(gate.opened().1, 7);
    }

    #[test]
    fn a_checkpoint_recovered_components_workers_are_all_woken() {
        let (edge, gate, passed) = workers(3, Opening::All);
        gate.open(vec![Arc::new(Null)], 1);
        for (w, flag) in passed.iter().enumerate() {
            assert!(passes(flag), "worker {w} was not let through");
            assert_eq!(
                edge.slot(w as u32).server_sleeping.load(Ordering::SeqCst),
                0
            );
        }
    }

    #[test]
    fn a_worker_that_comes_to_an_open_gate_passes() {
        let edge = Arc::new(Edge::create("gate-test", 1).unwrap());
        let gate = Gate::new(vec![(edge, 0)], Opening::Lazy);
        gate.open(vec![Arc::new(Null)], 3);
        let (service, epoch) = gate.worker_wait(0, "null");
        assert_eq!((service.interface().name, epoch), ("null", 3));
    }
}

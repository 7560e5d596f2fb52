//! Upcalls over real shared memory, with the server's and the client's
//! threads in one process: a handler's answer, a client that dies or is
//! slow to answer, eager recovery behind the gate, and a loopback reboot.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{echo, EchoService, ECHO};
use kintsugi_runtime::abi::channel::{state, Edge};
use kintsugi_runtime::server::{RecoveryGate, SlotWorker};
use kintsugi_runtime::testing::{connection_for_tests, Loopback};
use kintsugi_runtime::upcall::{self, Mailbox, Recover, UpcallError};
use kintsugi_runtime::{Connection, RecoveryScope};

fn live_edge(slots: u32) -> Arc<Edge> {
    let edge = Arc::new(Edge::create("upcall-test", slots).unwrap());
    edge.server_live(1, std::process::id());
    edge
}

#[test]
fn an_upcall_reaches_the_client_handler_and_its_result_comes_back() {
    let edge = live_edge(1);
    let server = Mailbox::new(edge.clone());
    assert_eq!(
        server.call(upcall::UNMAP, [0; 3], Duration::from_secs(1)),
        Err(UpcallError::NotListening),
        "nobody connected yet"
    );
    let conn = connection_for_tests(edge.clone(), &ECHO);
    let seen = Arc::new(Mutex::new(None));
    let s = seen.clone();
    conn.on_upcall(
        upcall::UNMAP,
        Arc::new(move |args| {
            let thread = std::thread::current().name().map(str::to_string);
            *s.lock().unwrap() = Some((thread, args));
            args.iter().sum::<u64>() * 10
        }),
    );
    let answers = std::thread::spawn(move || {
        let timeout = Duration::from_secs(10);
        (
            server.call(upcall::UNMAP, [1, 2, 3], timeout),
            server.call(upcall::UNMAP, [4, 5, 6], timeout),
            server.call(99, [0; 3], timeout),
        )
    })
    .join()
    .unwrap();
    assert_eq!(answers, (Ok(60), Ok(150), Err(UpcallError::Unhandled(99))));
    assert_eq!(
        seen.lock().unwrap().take(),
        Some((Some("upcall:echo".to_string()), [4, 5, 6])),
        "the handler ran in the client's upcall thread"
    );
}

#[test]
fn a_client_that_dies_during_an_upcall_fails_it_at_once() {
    let edge = live_edge(1);
    let conn = connection_for_tests(edge.clone(), &ECHO);
    let (entered_tx, entered) = mpsc::channel();
    let (release, release_rx) = mpsc::channel::<()>();
    let release_rx = Mutex::new(release_rx);
    conn.on_upcall(
        upcall::UNMAP,
        Arc::new(move |_| {
            entered_tx.send(()).unwrap();
            let _ = release_rx.lock().unwrap().recv();
            1
        }),
    );
    let server = Arc::new(Mailbox::new(edge.clone()));
    let s = server.clone();
    let waiting = std::thread::spawn(move || {
        let t = Instant::now();
        (
            s.call(upcall::UNMAP, [0; 3], Duration::from_secs(30)),
            t.elapsed(),
        )
    });
    entered.recv_timeout(Duration::from_secs(10)).unwrap();
    edge.client_down(); // what the supervisor does when the client dies
    let (answer, waited) = waiting.join().unwrap();
    assert_eq!(answer, Err(UpcallError::ClientGone));
    assert!(waited < Duration::from_secs(5), "took {waited:?}");
    assert!(!server.listening());
    assert_eq!(
        server.call(upcall::UNMAP, [0; 3], Duration::from_secs(1)),
        Err(UpcallError::NotListening),
        "the dead incarnation's listener does not count"
    );
    release.send(()).unwrap();
}

#[test]
fn a_slow_client_times_out() {
    let edge = live_edge(1);
    let conn = connection_for_tests(edge.clone(), &ECHO);
    conn.on_upcall(
        upcall::UNMAP,
        Arc::new(|_| {
            std::thread::sleep(Duration::from_millis(300));
            1
        }),
    );
    let server = Mailbox::new(edge);
    let t = Instant::now();
    assert_eq!(
        server.call(upcall::UNMAP, [0; 3], Duration::from_millis(30)),
        Err(UpcallError::Timeout)
    );
    assert!(t.elapsed() < Duration::from_millis(290));
}

/// Rebuilds "descriptors" with a call, and notes what it saw meanwhile.
struct Rebuilder {
    conn: Connection,
    /// Set once the ungated client's call returned.
    other_done: Arc<AtomicBool>,
    /// (in a recovery scope, the other call had returned, my call's answer)
    saw: Mutex<Option<(bool, bool, Vec<u8>)>>,
}

impl Recover for Rebuilder {
    fn recover_all(&self) -> u64 {
        let answer = echo(&self.conn, b"rebuild", None).unwrap();
        *self.saw.lock().unwrap() = Some((
            RecoveryScope::active(),
            self.other_done.load(Ordering::SeqCst),
            answer,
        ));
        3
    }
}

#[test]
fn during_eager_recovery_only_recovering_calls_pass_the_gate() {
    let edge = live_edge(2);
    let gate = Arc::new(RecoveryGate::closed());
    let service = Arc::new(EchoService::default());
    for slot in 0..2 {
        let worker = SlotWorker::new(edge.clone(), slot, 1, Default::default());
        let (gate, service) = (gate.clone(), service.clone());
        std::thread::spawn(move || worker.run_gated(service.as_ref(), 1, &gate));
    }
    let conn = connection_for_tests(edge.clone(), &ECHO);
    let other_done = Arc::new(AtomicBool::new(false));
    let rebuilder: Arc<Rebuilder> = Arc::new(Rebuilder {
        conn: conn.clone(),
        other_done: other_done.clone(),
        saw: Mutex::new(None),
    });
    conn.register_recoverer(Arc::downgrade(&rebuilder) as std::sync::Weak<dyn Recover>);

    // A client thread's ordinary call reaches a worker and waits at the gate.
    let (c, done) = (conn.clone(), other_done.clone());
    let ordinary = std::thread::spawn(move || {
        let answer = echo(&c, b"ordinary", None);
        done.store(true, Ordering::SeqCst);
        answer
    });
    let t = Instant::now();
    while (0..2).all(|i| edge.slot(i).state.load(Ordering::SeqCst) != state::REQUEST) {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the call never arrived"
        );
        std::thread::yield_now();
    }
    std::thread::sleep(Duration::from_millis(50));
    assert!(
        !other_done.load(Ordering::SeqCst),
        "the gate let an ordinary call through"
    );
    assert_eq!(service.calls.load(Ordering::SeqCst), 0);

    let mailbox = Mailbox::new(edge.clone());
    let report = upcall::recover_eagerly(&gate, [&mailbox], 1, Duration::from_secs(10));
    assert_eq!(
        (report.clients, report.descriptors, report.failed),
        (1, 3, 0)
    );
    assert!(gate.is_open());
    assert_eq!(
        rebuilder.saw.lock().unwrap().take(),
        Some((true, false, b"rebuild".to_vec())),
        "the recovering call was served in a recovery scope while the ordinary one waited"
    );
    assert_eq!(ordinary.join().unwrap().unwrap(), b"ordinary");
    assert_eq!(service.calls.load(Ordering::SeqCst), 2);
}

/// Counts its rebuilds; each rebuild is a call to the rebooted server.
struct Counter {
    conn: Connection,
    rebuilt: AtomicU64,
}

impl Recover for Counter {
    fn recover_all(&self) -> u64 {
        assert!(RecoveryScope::active());
        echo(&self.conn, b"again", None).unwrap();
        self.rebuilt.fetch_add(2, Ordering::SeqCst);
        2
    }
}

#[test]
fn loopback_upcall_recover_runs_every_live_recoverer() {
    let lb = Loopback::new(Arc::new(EchoService::default()));
    let conn = lb.connection();
    let counters: Vec<Arc<Counter>> = (0..2)
        .map(|_| {
            let c = Arc::new(Counter {
                conn: conn.clone(),
                rebuilt: AtomicU64::new(0),
            });
            conn.register_recoverer(Arc::downgrade(&c) as std::sync::Weak<dyn Recover>);
            c
        })
        .collect();
    let dropped = Arc::new(Counter {
        conn: lb.connection(),
        rebuilt: AtomicU64::new(0),
    });
    conn.register_recoverer(Arc::downgrade(&dropped) as std::sync::Weak<dyn Recover>);
    drop(dropped);

    let fresh = Arc::new(EchoService::default());
    lb.reboot(fresh.clone());
    assert_eq!(lb.upcall_recover(), Ok(4));
    assert!(counters
        .iter()
        .all(|c| c.rebuilt.load(Ordering::SeqCst) == 2));
    assert_eq!(fresh.calls.load(Ordering::SeqCst), 2);
    assert!(
        !RecoveryScope::active(),
        "the scope stays in the upcall thread"
    );
}

#[test]
fn recovery_scopes_nest() {
    assert!(!RecoveryScope::active());
    let outer = RecoveryScope::enter();
    {
        let _inner = RecoveryScope::enter();
        assert!(RecoveryScope::active());
    }
    assert!(RecoveryScope::active());
    drop(outer);
    assert!(!RecoveryScope::active());
}

/// Notes the server epoch its client saw when asked to recover.
struct EpochProbe {
    conn: Connection,
    saw: AtomicU64,
}

impl Recover for EpochProbe {
    fn recover_all(&self) -> u64 {
        self.saw.store(self.conn.epoch(), Ordering::SeqCst);
        0
    }
}

#[test]
fn eager_recovery_waits_until_the_new_epoch_is_published() {
    let edge = live_edge(1);
    let conn = connection_for_tests(edge.clone(), &ECHO);
    let probe = Arc::new(EpochProbe {
        conn: conn.clone(),
        saw: AtomicU64::new(0),
    });
    conn.register_recoverer(Arc::downgrade(&probe) as std::sync::Weak<dyn Recover>);
    edge.server_down(); // the supervisor, at the crash
    let publisher = {
        let edge = edge.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            edge.server_live(2, std::process::id()); // the supervisor, once ready
        })
    };
    let gate = RecoveryGate::closed();
    let mailbox = Mailbox::new(edge.clone());
    let report = upcall::recover_eagerly(&gate, [&mailbox], 2, Duration::from_secs(10));
    publisher.join().unwrap();
    assert_eq!((report.clients, report.failed), (1, 0));
    assert_eq!(probe.saw.load(Ordering::SeqCst), 2);
    assert!(gate.is_open());
}

//! The invocation protocol over real shared memory: a server in a forked
//! process, a server rebooted under a client (loopback), and workers that
//! take on their callers' priorities.

mod common;

use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc, Mutex};

use common::{echo, EchoService, ECHO};
use kintsugi_runtime::abi::channel::{Edge, CHANGE_COUNTERS};
use kintsugi_runtime::priority::{self, Priority};
use kintsugi_runtime::server::SlotWorker;
use kintsugi_runtime::stub::{
    CallError, Caller, Dispatched, Fault, InterfaceError, InterfaceInfo, ReplyStatus, Service,
};
use kintsugi_runtime::testing::Loopback;
use kintsugi_runtime::wire::{Reader, Writer};
use kintsugi_runtime::Connection;

/// A reply kept by a client stays current until the server publishes a
/// change of a counter it depends on, or reboots.
#[test]
fn change_counters_tell_a_kept_reply_from_a_stale_one() {
    let lb = Loopback::new(Arc::new(EchoService::default()));
    let conn = lb.connection();
    let then = conn.changes();
    assert!(conn.unchanged(&then, &[0, 5]));
    lb.publish_change(7);
    assert!(conn.unchanged(&then, &[0, 5]), "another counter moved");
    assert!(!conn.unchanged(&then, &[5, 7]), "counter 7 moved");
    let then = conn.changes();
    assert!(conn.unchanged(&then, &[5, 7]));
    lb.reboot(Arc::new(EchoService::default()));
    assert!(
        !conn.unchanged(&then, &[5]),
        "a reboot makes every reply stale"
    );
    let now = conn.changes();
    assert!(
        !conn.unchanged(&now, &[CHANGE_COUNTERS]),
        "a counter that does not exist (a faulty reply) has always changed"
    );
    lb.publish_change(CHANGE_COUNTERS); // ignored
    assert!(conn.unchanged(&now, &[0, CHANGE_COUNTERS - 1]));
}

#[test]
fn loopback_round_trip_and_refusal() {
    let lb = Loopback::new(Arc::new(EchoService::default()));
    let conn = lb.connection();
    let big = vec![7u8; 65536];
    assert_eq!(echo(&conn, b"hi", None).unwrap(), b"hi");
    assert_eq!(echo(&conn, &big, None).unwrap(), big);
    let refused = conn.call(9, None, |_| Ok(()), |_| Ok(()));
    assert!(
        matches!(refused, Err(Fault::Refused(ref m)) if m.contains("no function with id 9")),
        "{refused:?}"
    );
}

/// Function 9 is no function of the echo interface: the server stub refuses
/// it as a correct server refuses no generated stub's call.
fn unknown_function(conn: &Connection) -> Result<(), Fault> {
    conn.call(9, None, |_| Ok(()), |_| Ok(()))
}

#[test]
fn an_impossible_reply_has_a_watched_server_rebooted_once() {
    let lb = Arc::new(Loopback::new(Arc::new(EchoService::default())));
    // Unwatched: the refusal is returned, nothing is suspected.
    assert!(matches!(
        unknown_function(&lb.connection()),
        Err(Fault::Refused(_))
    ));
    assert_eq!(lb.suspected(), 0);

    // Watched: the client marks epoch 1 and waits; the test plays the
    // watchdog and reboots it; the call fails as after a reboot (unrun).
    let conn = lb.watched_connection();
    let watchdog = {
        let lb = lb.clone();
        std::thread::spawn(move || {
            while lb.suspected() != 1 {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            lb.reboot(Arc::new(EchoService::default()));
        })
    };
    assert_eq!(unknown_function(&conn), Err(Fault::Stale));
    watchdog.join().unwrap();
    assert_eq!(lb.epoch(), 2);
    // Refused again after the reboot: the request was at fault, not the
    // server; it is returned, and epoch 2 is not suspected (the reboot
    // cleared the suspicion it answered).
    assert!(matches!(unknown_function(&conn), Err(Fault::Refused(_))));
    assert_eq!(lb.suspected(), 0);
    assert_eq!(echo(&conn, b"ok", None).unwrap(), b"ok");

    // After that sound reply a fault is suspected again, and with no
    // watchdog acting the refusal comes back after the wait.
    let started = std::time::Instant::now();
    assert!(matches!(unknown_function(&conn), Err(Fault::Refused(_))));
    assert_eq!(lb.suspected(), 2);
    assert!(started.elapsed() >= std::time::Duration::from_millis(900));
    assert_eq!(lb.epoch(), 2);
}

static COUNTER: InterfaceInfo = InterfaceInfo {
    name: "counter",
    hash: 0xc0c0,
    functions: &["add", "total"],
    readonly: &[1],
};

/// A checkpoint-recovered counter: its state at the log's start is 0 (no
/// checkpoint cut the log), and its next reply can be garbled once, as a
/// fault in the server's encoding would. `add` counts its runs in `runs`,
/// `total` (readonly) in `reads`.
#[derive(Default)]
struct Counter {
    total: Mutex<u64>,
    runs: std::sync::atomic::AtomicU64,
    reads: std::sync::atomic::AtomicU64,
    garble: std::sync::atomic::AtomicBool,
    /// Refuses the next call as out of range, as a flip in its decoder
    /// would: no generated client sends what its server refuses so.
    refuse: std::sync::atomic::AtomicBool,
    /// Answers the next call, once it has run, with `Empty`, an error
    /// `add` never gets from a correct counter (`fails(Overflow)`).
    wrong_error: std::sync::atomic::AtomicBool,
}

/// The counter's errors: `add` fails only with `Overflow`.
#[derive(Debug, Clone, Copy, PartialEq)]
enum CounterError {
    Overflow,
    Empty,
}

impl InterfaceError for CounterError {
    const INTERFACE: &'static str = "counter";
    const ALL: &'static [(Self, &'static str)] =
        &[(Self::Overflow, "overflow"), (Self::Empty, "empty")];
}

impl Service for Counter {
    fn interface(&self) -> &'static InterfaceInfo {
        &COUNTER
    }
    fn client_died(&self, _client: u32) {}
    fn dispatch(&self, _c: &Caller, func: u32, req: &[u8], resp: &mut [u8]) -> Dispatched {
        let (n, runs) = match (func, Reader::new(req).u64()) {
            (0, Ok(n)) => (n, &self.runs),
            (0, Err(e)) => return Dispatched::Refused(e.into()),
            (1, _) => (0, &self.reads),
            (f, _) => {
                return Dispatched::Refused(kintsugi_runtime::stub::Refusal::UnknownFunction(f))
            }
        };
        if self.refuse.swap(false, Ordering::SeqCst) {
            return Dispatched::Refused(kintsugi_runtime::stub::Refusal::OutOfRange("n"));
        }
        runs.fetch_add(1, Ordering::SeqCst);
        let mut total = self.total.lock().unwrap();
        *total += n;
        if self.wrong_error.swap(false, Ordering::SeqCst) {
            return Dispatched::AppError(CounterError::Empty.code());
        }
        if self.garble.swap(false, Ordering::SeqCst) {
            resp[..3].copy_from_slice(&[0x5a; 3]); // three bytes where a u64 is due
            return Dispatched::Ok(3);
        }
        let mut w = Writer::new(resp);
        w.u64(*total).unwrap();
        Dispatched::Ok(w.len())
    }
}

/// `add(n)` as a generated stub makes it: a call interrupted (its fate
/// unknown) or refused as stale is posted again.
fn add(conn: &Connection, n: u64) -> Result<u64, Fault> {
    counter_call(conn, 0, n)
}

/// The counter's readonly `total`, the same way.
fn total(conn: &Connection) -> Result<u64, Fault> {
    counter_call(conn, 1, 0)
}

fn counter_call(conn: &Connection, func: u32, n: u64) -> Result<u64, Fault> {
    loop {
        let got = conn.invoke_failing(
            func,
            None,
            |e: &CounterError| *e == CounterError::Overflow,
            |w| w.u64(n),
            |r| r.u64(),
        );
        match got {
            Err(CallError::Fault(Fault::Interrupted | Fault::Stale)) => continue,
            Err(CallError::Fault(f)) => return Err(f),
            Err(e) => panic!("the counter answered {e:?}"),
            Ok(total) => return Ok(total),
        }
    }
}

/// Plays the watchdog and the checkpoint restore: once the client
/// suspects the server, rolls it back to the log's start (a total of 0).
fn roll_back_when_suspected(
    lb: &Arc<Loopback>,
    counter: &Arc<Counter>,
) -> std::thread::JoinHandle<()> {
    let (lb, counter) = (lb.clone(), counter.clone());
    std::thread::spawn(move || {
        while lb.suspected() != 1 {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        lb.roll_back(|| *counter.total.lock().unwrap() = 0);
    })
}

/// Adds 5 and 7, then 10 with `fault` set on the server (which makes the
/// third call's outcome one no correct server gives), a watchdog rolling
/// the server back when suspected: the client takes the third call's reply
/// from the replay, once, and does not post it again (it would be added
/// twice). `ran` is how many of the three calls the server ran before
/// the rollback.
fn a_replay_answers(fault: impl FnOnce(&Counter), ran: u64) {
    let counter = Arc::new(Counter::default());
    let lb = Arc::new(Loopback::journaled(counter.clone()));
    let conn = lb.watched_connection();
    assert_eq!(add(&conn, 5), Ok(5));
    assert_eq!(add(&conn, 7), Ok(12));
    let watchdog = roll_back_when_suspected(&lb, &counter);
    fault(&counter);
    assert_eq!(add(&conn, 10), Ok(22), "the replay's reply, once");
    watchdog.join().unwrap();
    assert_eq!(*counter.total.lock().unwrap(), 22);
    assert_eq!(
        counter.runs.load(Ordering::SeqCst),
        ran + 3,
        "the calls run, then the three replayed: none posted twice"
    );
    assert_eq!(lb.suspected(), 0);
    assert_eq!(add(&conn, 1), Ok(23));
}

/// A checkpoint-recovered server ran a call and garbled its reply.
#[test]
fn a_garbled_reply_of_a_checkpoint_recovered_server_is_taken_from_its_replay() {
    a_replay_answers(|c| c.garble.store(true, Ordering::SeqCst), 3);
}

/// A checkpoint-recovered server ran a call and answered it with an error
/// the call never gets from a correct server (`fails` in the IDL).
#[test]
fn a_wrong_error_of_a_checkpoint_recovered_server_is_taken_from_its_replay() {
    a_replay_answers(|c| c.wrong_error.store(true, Ordering::SeqCst), 3);
}

/// A checkpoint-recovered server refused a call no correct server
/// refuses (a flip in its decoder, say): the refused call is in its log
/// (logged before it was refused), so its replay runs it.
#[test]
fn a_refusal_no_correct_server_gives_is_taken_from_the_replay() {
    a_replay_answers(|c| c.refuse.store(true, Ordering::SeqCst), 2);
}

/// A `readonly` call is not logged: a rollback's replay runs the adds
/// again and not the reads, and a read whose reply was garbled is posted
/// again (once the server is rolled back) instead of awaiting a replay.
#[test]
fn readonly_calls_are_not_logged_and_a_garbled_one_is_posted_again() {
    let counter = Arc::new(Counter::default());
    let lb = Arc::new(Loopback::journaled(counter.clone()));
    let conn = lb.watched_connection();
    assert_eq!(add(&conn, 5), Ok(5));
    for _ in 0..3 {
        assert_eq!(total(&conn), Ok(5));
    }
    assert_eq!(add(&conn, 7), Ok(12));
    let logged = || lb.log().header().logged.load(Ordering::SeqCst);
    assert_eq!(
        (logged(), lb.log().served()),
        (2, 5),
        "all served, adds logged"
    );
    let watchdog = roll_back_when_suspected(&lb, &counter);
    counter.garble.store(true, Ordering::SeqCst);
    assert_eq!(total(&conn), Ok(12), "posted again after the rollback");
    watchdog.join().unwrap();
    assert_eq!(
        counter.runs.load(Ordering::SeqCst),
        2 + 2,
        "two adds, then the two replayed"
    );
    assert_eq!(
        counter.reads.load(Ordering::SeqCst),
        3 + 2,
        "three reads, the garbled one and its second posting: none replayed"
    );
    assert_eq!(*counter.total.lock().unwrap(), 12);
    assert_eq!(add(&conn, 1), Ok(13));
}

/// With no watchdog to roll the server back, the client takes its slot
/// back and returns the fault, as for any server.
#[test]
fn a_garbled_reply_that_no_rollback_answers_is_returned() {
    let counter = Arc::new(Counter::default());
    let lb = Loopback::journaled(counter.clone());
    let conn = lb.connection();
    assert_eq!(add(&conn, 2), Ok(2));
    counter.garble.store(true, Ordering::SeqCst);
    assert!(matches!(add(&conn, 3), Err(Fault::Decode(_))));
    assert_eq!(lb.suspected(), 0);
    assert_eq!(add(&conn, 4), Ok(9), "the slot serves again");
}

#[test]
fn reboot_raises_epoch_and_stale_calls_are_refused_unrun() {
    let lb = Loopback::new(Arc::new(EchoService::default()));
    let conn = lb.connection();
    assert_eq!(conn.epoch(), 1);
    let fresh = Arc::new(EchoService::default());
    lb.reboot(fresh.clone());
    assert_eq!(conn.epoch(), 2);
    assert_eq!(echo(&conn, b"x", Some(1)), Err(Fault::Stale));
    assert_eq!(
        fresh.calls.load(Ordering::Relaxed),
        0,
        "a stale call must not reach the server"
    );
    assert_eq!(echo(&conn, b"x", Some(2)).unwrap(), b"x");
}

#[test]
fn many_threads_share_a_connection() {
    let lb = Loopback::new(Arc::new(EchoService::default()));
    let conn = lb.connection();
    std::thread::scope(|s| {
        for t in 0..4u8 {
            let conn = conn.clone();
            s.spawn(move || {
                for i in 0..500u32 {
                    let msg = [t, (i % 251) as u8, 0xAB];
                    assert_eq!(echo(&conn, &msg, None).unwrap(), msg);
                }
            });
        }
    });
}

#[test]
fn a_dead_server_fails_the_call_in_flight() {
    // A server process that takes the request and dies without replying.
    let edge = Arc::new(Edge::create("test", 1).unwrap());
    edge.server_live(1, 1);
    // SAFETY: the child only spins on an atomic in shared memory and calls
    // _exit; it touches no lock another test thread could hold.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let s = edge.slot(0);
        while s.state.load(Ordering::SeqCst) != kintsugi_runtime::abi::channel::state::REQUEST {
            std::hint::spin_loop();
        }
        // SAFETY: ends the forked child without running the parent's handlers.
        unsafe { libc::_exit(0) };
    }
    let conn_edge = edge.clone();
    let watcher = std::thread::spawn(move || {
        let mut status = 0;
        // SAFETY: waits for our own child; `status` is a valid out pointer.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        // What the supervisor does when the server's pidfd fires.
        conn_edge.server_down()
    });
    let conn = kintsugi_runtime::testing::connection_for_tests(edge.clone(), &ECHO);
    assert_eq!(echo(&conn, b"lost", None), Err(Fault::Interrupted));
    assert_eq!(watcher.join().unwrap(), vec![0]);
    edge.server_gone();
    assert!(matches!(echo(&conn, b"x", None), Err(Fault::Lost(_))));
}

#[test]
fn a_server_in_another_process_serves() {
    let edge = Arc::new(Edge::create("test", 2).unwrap());
    // SAFETY: the child serves one slot with lock-free code (the echo service
    // takes no lock) and leaves with _exit.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let svc = EchoService::default();
        let w = SlotWorker::new(edge.clone(), 0, 1, Default::default());
        w.run(&svc, 1);
        // SAFETY: ends the forked child without running the parent's handlers.
        unsafe { libc::_exit(0) };
    }
    edge.server_live(1, pid as u32);
    let conn = kintsugi_runtime::testing::connection_for_tests(edge.clone(), &ECHO);
    for i in 0..1000u32 {
        assert_eq!(
            echo(&conn, &i.to_le_bytes(), Some(1)).unwrap(),
            i.to_le_bytes()
        );
    }
    // SAFETY: signals and reaps our own child.
    unsafe {
        libc::kill(pid, libc::SIGKILL);
        libc::waitpid(pid, std::ptr::null_mut(), 0);
    }
}

/// The thread id of the worker that served the call, and the priority it
/// ran the call at.
fn whoami(conn: &Connection) -> (i32, Priority) {
    let (tid, word) = conn
        .call(
            2,
            None,
            |_| Ok(()),
            |r| match r {
                ReplyStatus::Ok(mut r) => Ok((r.u32()? as i32, r.u32()?)),
                ReplyStatus::AppError(_) => unreachable!(),
            },
        )
        .unwrap();
    (tid, Priority::from_word(word).unwrap())
}

/// Calls at `p` and checks that the worker ran the call at `p` and still
/// runs at it (read back with getpriority on its tid).
fn served_at(conn: &Connection, p: Priority) {
    let (tid, during) = whoami(conn);
    assert_eq!(during, p, "priority while serving");
    assert_eq!(priority::of_thread(tid).unwrap(), p, "priority after");
}

#[test]
fn a_worker_adopts_the_callers_priority() {
    let lb = Loopback::new(Arc::new(EchoService::default()));
    let conn = lb.connection();
    // A thread of its own, so that the harness's threads keep their priority.
    std::thread::spawn(move || {
        for nice in [7, 3, 12] {
            priority::apply_to_current_thread(Priority::nice(nice)).unwrap();
            served_at(&conn, Priority::nice(nice));
        }
        let raised = Priority::nice(-5);
        match priority::apply_to_current_thread(raised) {
            Ok(()) => served_at(&conn, raised),
            Err(e) => println!("skipped: raising priority is not permitted here ({e})"),
        }
        let fifo = Priority {
            nice: 0,
            fifo: Some(1),
        };
        priority::apply_to_current_thread(fifo).unwrap();
        let me = rustix::thread::gettid().as_raw_nonzero().get();
        if priority::of_thread(me).unwrap().fifo == Some(1) {
            served_at(&conn, fifo);
            priority::apply_to_current_thread(Priority::nice(4)).unwrap();
            served_at(&conn, Priority::nice(4));
        } else {
            println!("skipped: SCHED_FIFO is not permitted here");
        }
    })
    .join()
    .unwrap();
}

#[test]
fn function_names_are_registered_once_and_read_back_as_identifiers_only() {
    let edge = Edge::create("names", 1).unwrap();
    assert_eq!(edge.function_name(0), None, "nothing registered yet");
    edge.register_functions(&ECHO);
    for (i, name) in ECHO.functions.iter().enumerate() {
        assert_eq!(edge.function_name(i as u32).as_deref(), Some(*name));
    }
    assert_eq!(edge.function_name(ECHO.functions.len() as u32), None);
    assert_eq!(edge.function_name(u32::MAX), None);
    // A second registration (a later incarnation, the other side) changes nothing.
    static OTHER: kintsugi_runtime::stub::InterfaceInfo = kintsugi_runtime::stub::InterfaceInfo {
        name: "other",
        hash: 1,
        functions: &["renamed"],
        readonly: &[],
    };
    edge.register_functions(&OTHER);
    assert_eq!(edge.function_name(0).as_deref(), Some(ECHO.functions[0]));
    // What a faulty peer writes is taken only if it is an identifier.
    edge.header().functions[10].name_once("x; rm -rf /");
    assert_eq!(edge.function_name(10), None);
    edge.header().functions[11].name_once("ok_name");
    assert_eq!(edge.function_name(11).as_deref(), Some("ok_name"));
}

/// Checks its argument, lets a hostile client at the shared request
/// buffer, then uses the argument: answers 1 if what it used is what it
/// checked.
struct CheckThenUse {
    checked: Mutex<mpsc::Sender<()>>,
    written: Mutex<mpsc::Receiver<()>>,
}

impl Service for CheckThenUse {
    fn interface(&self) -> &'static InterfaceInfo {
        &ECHO
    }
    fn client_died(&self, _client: u32) {}
    fn dispatch(&self, _c: &Caller, _func: u32, req: &[u8], resp: &mut [u8]) -> Dispatched {
        let name = match Reader::new(req).bytes() {
            Ok(name) => name,
            Err(e) => return Dispatched::Refused(e.into()),
        };
        // The check.
        if name != b"allowed" {
            return Dispatched::AppError(1);
        }
        self.checked.lock().unwrap().send(()).unwrap();
        self.written.lock().unwrap().recv().unwrap();
        // The use, after the client rewrote its buffer.
        let mut w = Writer::new(resp);
        w.u32(u32::from(name == b"allowed")).unwrap();
        Dispatched::Ok(w.len())
    }
}

/// A server decodes a request from its own copy, taken before it runs: a
/// client that rewrites its request buffer between the server's check of
/// an argument and its use (a name, say) changes nothing the server sees.
#[test]
fn a_client_cannot_change_a_request_after_the_server_checked_it() {
    let (checked, checked_rx) = mpsc::channel();
    let (written_tx, written) = mpsc::channel();
    let svc = CheckThenUse {
        checked: Mutex::new(checked),
        written: Mutex::new(written),
    };
    let edge = Arc::new(Edge::create("check-then-use", 1).unwrap());
    let worker = SlotWorker::new(edge.clone(), 0, 0, Default::default());
    std::thread::spawn(move || worker.run(&svc, 1));
    edge.server_live(1, std::process::id());
    let conn = kintsugi_runtime::testing::connection_for_tests(edge.clone(), &ECHO);
    let client = std::thread::spawn(move || {
        conn.call(
            0,
            Some(1),
            |w| w.bytes(b"allowed"),
            |r| match r {
                ReplyStatus::Ok(mut r) => Ok(r.u32()?),
                ReplyStatus::AppError(e) => Ok(1000 + e),
            },
        )
    });
    checked_rx.recv().unwrap();
    let mut shared = [0u8; 64];
    edge.copy_request(0, &mut shared);
    let at = shared
        .windows(7)
        .position(|w| w == b"allowed")
        .expect("the request in the shared buffer");
    // SAFETY: the test plays a faulty client that writes its request
    // buffer while the server owns it; the server has copied the request
    // out and waits on `written`, so no one reads the buffer meanwhile.
    let buffer = unsafe { edge.request_buffer(0) };
    buffer[at..at + 7].copy_from_slice(b"secret!");
    edge.copy_request(0, &mut shared);
    assert_eq!(&shared[at..at + 7], b"secret!", "the write landed");
    written_tx.send(()).unwrap();
    let used_what_was_checked = client.join().unwrap().unwrap();
    assert_eq!(used_what_was_checked, 1);
}

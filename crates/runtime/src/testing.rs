//! An edge served by worker threads in the calling process: real shared
//! memory and the real slot protocol, without a supervisor. Unit tests of
//! generated stubs use it to simulate micro-reboots and upcalls;
//! benchmarks use [`Edge`] and [`SlotWorker`] across a real fork instead.

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::abi::channel::Edge;
use crate::abi::journal::JournalRegion;
use crate::client::{Connection, Supervision};
use crate::journal::{Journal, Served};
use crate::server::{wake_workers, SlotWorker};
use crate::stub::{InterfaceInfo, Service};
use crate::upcall::{self, Listener, Mailbox, UpcallError};

/// An in-memory store of creation records, for serving global descriptors
/// in a unit test.
pub use crate::records::MemoryStore;

/// How long a loopback upcall waits for the client's answer.
const UPCALL_TIMEOUT: Duration = Duration::from_secs(10);

/// A server incarnation made of threads of this process.
pub struct Loopback {
    edge: Arc<Edge>,
    info: &'static InterfaceInfo,
    /// The client side's upcall registrations, shared by every connection.
    upcalls: Arc<Listener>,
    mailbox: Mailbox,
    current: Mutex<Incarnation>,
    /// The request log of a journaled loopback ([`Loopback::journaled`]).
    journal: Option<Arc<Journal>>,
}

struct Incarnation {
    epoch: u64,
    retire: Arc<AtomicBool>,
    workers: Vec<JoinHandle<()>>,
}

const SLOTS: u32 = 4;

impl Loopback {
    pub fn new(service: Arc<dyn Service>) -> Self {
        Self::with_journal(service, None)
    }

    /// A loopback whose server is checkpoint-recovered (`recovery =
    /// "checkpoint"`): each request is logged before it runs, and
    /// [`Loopback::roll_back`] plays the supervisor's rollback and replay.
    /// Its connections know the server's replay answers a call again.
    pub fn journaled(service: Arc<dyn Service>) -> Self {
        let log = JournalRegion::create("loopback-log", 1 << 20).expect("create a request log");
        Self::with_journal(service, Some(Arc::new(Journal::new(log))))
    }

    fn with_journal(service: Arc<dyn Service>, journal: Option<Arc<Journal>>) -> Self {
        let edge = Arc::new(Edge::create("loopback", SLOTS).expect("create loopback edge"));
        let info = service.interface();
        edge.header()
            .interface_hash
            .store(info.hash, std::sync::atomic::Ordering::Relaxed);
        if let Some(j) = &journal {
            j.set_served(vec![Served {
                edge: edge.clone(),
                service: service.clone(),
                client: 0,
            }]);
        }
        let current = Mutex::new(Self::start(&edge, service, 1, journal.as_ref()));
        Self {
            upcalls: Arc::new(Listener::new(edge.clone(), info.name, None)),
            mailbox: Mailbox::new(edge.clone()),
            edge,
            info,
            current,
            journal,
        }
    }

    /// Plays a rollback of a journaled loopback's idle server, as the
    /// supervisor answers a suspicion: `restore` puts the service's state
    /// back as it was when the log began, the workers are to replay the
    /// log before they serve anything new, and the suspicion is cleared.
    ///
    /// # Panics
    ///
    /// On a loopback that is not [journaled](Loopback::journaled).
    pub fn roll_back(&self, restore: impl FnOnce()) {
        let journal = self.journal.as_ref().expect("a journaled loopback");
        restore();
        journal.log().ask_replay();
        self.edge.clear_suspicion();
        wake_workers(&self.edge);
    }

    /// A journaled loopback's request log.
    ///
    /// # Panics
    ///
    /// On a loopback that is not [journaled](Loopback::journaled).
    pub fn log(&self) -> &JournalRegion {
        self.journal.as_ref().expect("a journaled loopback").log()
    }

    /// Plays a checkpoint of a journaled loopback's idle server: the log's
    /// entries are forgotten, as the supervisor cuts the log once a
    /// checkpoint holds their effects. Call it with no call in flight.
    ///
    /// # Panics
    ///
    /// On a loopback that is not [journaled](Loopback::journaled).
    pub fn cut_log(&self) {
        self.journal
            .as_ref()
            .expect("a journaled loopback")
            .log()
            .cut();
    }

    fn start(
        edge: &Arc<Edge>,
        service: Arc<dyn Service>,
        epoch: u64,
        journal: Option<&Arc<Journal>>,
    ) -> Incarnation {
        let retire = Arc::new(AtomicBool::new(false));
        let workers = (0..SLOTS)
            .map(|slot| {
                let mut worker = SlotWorker::new(edge.clone(), slot, 0, retire.clone());
                worker.journal = journal.map(|j| (j.clone(), 0));
                let service = service.clone();
                std::thread::spawn(move || worker.run(service.as_ref(), epoch))
            })
            .collect();
        edge.server_live(epoch, std::process::id());
        Incarnation {
            epoch,
            retire,
            workers,
        }
    }

    /// A client connection; the first one starts the client's upcall thread.
    pub fn connection(&self) -> Connection {
        self.connect(false)
    }

    /// A connection whose client suspects the server of an impossible reply
    /// (as in a system with a watchdog); the test plays the watchdog.
    pub fn watched_connection(&self) -> Connection {
        self.connect(true)
    }

    fn connect(&self, watched: bool) -> Connection {
        let supervision = Supervision {
            watched,
            replayed: self.journal.is_some(),
        };
        Connection::new(
            self.upcalls.clone(),
            "loopback".into(),
            0,
            self.info,
            supervision,
        )
        .expect("start the loopback upcall thread")
    }

    /// The epoch a watched client suspected ([`crate::abi::channel::EdgeHeader::suspected`]).
    pub fn suspected(&self) -> u64 {
        self.edge
            .header()
            .suspected
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Simulates a micro-reboot: new calls wait, the old incarnation's
    /// workers finish what they hold and stop, a fresh service instance
    /// takes over with the next epoch.
    ///
    /// # Panics
    ///
    /// On a [journaled](Loopback::journaled) loopback, whose replay runs
    /// the service it was made with: it is rolled back instead.
    pub fn reboot(&self, fresh: Arc<dyn Service>) {
        assert!(
            self.journal.is_none(),
            "a journaled loopback is rolled back"
        );
        let mut current = self.current.lock().unwrap();
        self.edge.mark_down();
        current
            .retire
            .store(true, std::sync::atomic::Ordering::SeqCst);
        wake_workers(&self.edge);
        for w in current.workers.drain(..) {
            w.join().expect("loopback worker panicked");
        }
        let epoch = current.epoch + 1;
        *current = Self::start(&self.edge, fresh, epoch, None);
    }

    /// Raises a change counter, as the server would
    /// ([`crate::Runtime::publish_change`]).
    pub fn publish_change(&self, counter: usize) {
        self.edge.publish_change(counter);
    }

    /// The server's current epoch.
    pub fn epoch(&self) -> u64 {
        self.current.lock().unwrap().epoch
    }

    /// Calls the client back as the server would ([`crate::Runtime::upcall`]):
    /// upcall `op` with `args`, answered by the client's upcall thread.
    pub fn upcall(&self, op: u32, args: [u64; 3]) -> Result<u64, UpcallError> {
        self.mailbox.call(op, args, UPCALL_TIMEOUT)
    }

    /// Eager recovery's upcall, typically after [`Loopback::reboot`]: every
    /// recoverer registered on a connection rebuilds its descriptors (in the
    /// client's upcall thread, in a recovery scope); returns how many.
    pub fn upcall_recover(&self) -> Result<u64, UpcallError> {
        self.upcall(upcall::RECOVER, [0; 3])
    }
}

impl Drop for Loopback {
    fn drop(&mut self) {
        let mut current = self.current.lock().unwrap();
        current
            .retire
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.edge.server_gone();
        wake_workers(&self.edge);
        for w in current.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// A client connection on an edge made by hand (tests and benchmarks that
/// play the supervisor themselves), with its own upcall thread: make one per
/// edge, and clone it for more threads.
pub fn connection_for_tests(edge: Arc<Edge>, info: &'static InterfaceInfo) -> Connection {
    Connection::new(
        Arc::new(Listener::new(edge, info.name, None)),
        "test-server".into(),
        0,
        info,
        Supervision::default(),
    )
    .expect("start the upcall thread")
}

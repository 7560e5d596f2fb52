//! An edge served by worker threads in the calling process: real shared
//! memory and the real slot protocol, without a supervisor. Unit tests of
//! generated stubs use it to simulate micro-reboots; benchmarks use
//! [`Edge`] and [`SlotWorker`] across a real fork instead.

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crate::channel::Edge;
use crate::client::Connection;
use crate::server::{wake_workers, SlotWorker};
use crate::stub::Service;

/// A server incarnation made of threads of this process.
pub struct Loopback {
    edge: Arc<Edge>,
    info: &'static crate::stub::InterfaceInfo,
    current: Mutex<Incarnation>,
}

struct Incarnation {
    epoch: u64,
    retire: Arc<AtomicBool>,
    workers: Vec<JoinHandle<()>>,
}

const SLOTS: u32 = 4;

impl Loopback {
    pub fn new(service: Arc<dyn Service>) -> Self {
        let edge = Arc::new(Edge::create("loopback", SLOTS).expect("create loopback edge"));
        let info = service.interface();
        edge.header()
            .interface_hash
            .store(info.hash, std::sync::atomic::Ordering::Relaxed);
        let current = Mutex::new(Self::start(&edge, service, 1));
        Self {
            edge,
            info,
            current,
        }
    }

    fn start(edge: &Arc<Edge>, service: Arc<dyn Service>, epoch: u64) -> Incarnation {
        let retire = Arc::new(AtomicBool::new(false));
        let workers = (0..SLOTS)
            .map(|slot| {
                let worker = SlotWorker {
                    edge: edge.clone(),
                    slot,
                    client: 0,
                    retire: retire.clone(),
                };
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

    pub fn connection(&self) -> Connection {
        Connection::new(self.edge.clone(), "loopback".into(), self.info)
    }

    /// Simulates a micro-reboot: new calls wait, the old incarnation's
    /// workers finish what they hold and stop, a fresh service instance
    /// takes over with the next epoch.
    pub fn reboot(&self, fresh: Arc<dyn Service>) {
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
        *current = Self::start(&self.edge, fresh, epoch);
    }

    /// The server's current epoch.
    pub fn epoch(&self) -> u64 {
        self.current.lock().unwrap().epoch
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
/// play the supervisor themselves).
pub fn connection_for_tests(
    edge: Arc<Edge>,
    info: &'static crate::stub::InterfaceInfo,
) -> Connection {
    Connection::new(edge, "test-server".into(), info)
}

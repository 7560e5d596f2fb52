//! The server side of invocation: one worker thread per channel slot, each
//! waiting for a request, checking its epochs (the server's and the
//! calling incarnation's), telling the service of client deaths it has not
//! heard of yet, passing the [`RecoveryGate`],
//! taking on the caller's priority and handing the request to the
//! interface's server stub. A watched worker ([`crate::watchdog`]) marks
//! each invocation it runs as a stretch, and each request it holds.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;

use crate::abi::channel::{flags, state, status, Edge};
use crate::futex;
use crate::priority;
use crate::stub::{Caller, Dispatched, Service};

/// What a worker needs to serve one slot.
pub struct SlotWorker {
    pub edge: Arc<Edge>,
    pub slot: u32,
    /// Component id of the client this edge belongs to.
    pub client: u32,
    /// When set (and the worker woken), the worker returns between calls.
    pub retire: Arc<AtomicBool>,
}

impl SlotWorker {
    /// Serves the slot until retired; `epoch` is this incarnation's.
    pub fn run(&self, service: &dyn Service, epoch: u64) {
        static OPEN: RecoveryGate = RecoveryGate::opened();
        self.run_gated(service, epoch, &OPEN);
    }

    /// Serves the slot until retired, holding calls that do not carry
    /// [`flags::RECOVERY`] while `gate` is closed. A stale call is refused
    /// at once, gate or not: it runs nothing, and its client goes on to
    /// rebuild its descriptors.
    pub fn run_gated(&self, service: &dyn Service, epoch: u64, gate: &RecoveryGate) {
        let s = self.edge.slot(self.slot);
        let caller = Caller {
            component: self.client,
            slot: self.slot,
        };
        let header = self.edge.header();
        let watch = crate::watchdog::this_worker();
        while self.wait_for_request() {
            // Held here while the supervisor checkpoints this component;
            // a request gone meanwhile (this thread was rolled back to a
            // checkpoint taken just after it saw one) is not served.
            let _serving = self.edge.begin_serving(self.slot);
            if s.state.load(Ordering::SeqCst) != state::REQUEST {
                continue;
            }
            if let Some(w) = watch {
                w.take();
            }
            let req_epoch = s.epoch.load(Ordering::Relaxed);
            let caller_epoch = s.client_epoch.load(Ordering::Relaxed);
            if (req_epoch != 0 && req_epoch != epoch)
                || caller_epoch != header.client_epoch.load(Ordering::SeqCst)
            {
                // Descriptors of another server epoch, or a request left by
                // a client incarnation that has died: run nothing.
                s.status.store(status::STALE, Ordering::Relaxed);
            } else {
                // A client that died and came back is told of first, so its
                // new incarnation never races its old one's release.
                self.edge
                    .tell_client_deaths(|| service.client_died(self.client));
                gate.pass(s.flags.load(Ordering::Relaxed));
                priority::adopt(s.priority.load(Ordering::Relaxed));
                match watch {
                    Some(w) => {
                        w.begin(s.func.load(Ordering::Relaxed));
                        self.handle(service, &caller);
                        w.end();
                    }
                    None => self.handle(service, &caller),
                }
            }
            s.state.store(state::RESPONSE, Ordering::SeqCst);
            if let Some(w) = watch {
                w.release();
            }
            if s.client_sleeping.load(Ordering::SeqCst) != 0 {
                futex::wake(&s.state, 1);
            }
        }
    }

    /// Spins briefly, then sleeps, until a request arrives (true) or the
    /// worker is retired (false).
    fn wait_for_request(&self) -> bool {
        let s = self.edge.slot(self.slot);
        let (_, arrived) =
            futex::spin_until(&s.state, futex::spin_budget(), |v| v == state::REQUEST);
        if arrived {
            return true;
        }
        s.server_sleeping.store(1, Ordering::SeqCst);
        let arrived = loop {
            let v = s.state.load(Ordering::SeqCst);
            if v == state::REQUEST {
                break true;
            }
            if self.retire.load(Ordering::SeqCst) {
                break false;
            }
            futex::wait(&s.state, v, None);
        };
        s.server_sleeping.store(0, Ordering::Relaxed);
        arrived
    }

    fn handle(&self, service: &dyn Service, caller: &Caller) {
        let s = self.edge.slot(self.slot);
        let func = s.func.load(Ordering::Relaxed);
        let len =
            (s.request_len.load(Ordering::Relaxed) as usize).min(crate::abi::channel::BUFFER_SIZE);
        // SAFETY: the slot is in REQUEST, so this worker owns the response
        // buffer until it publishes RESPONSE.
        let response = unsafe { self.edge.response_buffer(self.slot) };
        let dispatched = crate::scratch::with_copy(
            len,
            |private| self.edge.copy_request(self.slot, private),
            |request| service.dispatch(caller, func, request, response),
        );
        let (st, code, resp_len) = match dispatched {
            Dispatched::Ok(n) => (status::OK, 0, n),
            Dispatched::AppError(code) => (status::APP_ERROR, code, 0),
            Dispatched::Refused(why) => {
                tracing::warn!(client = caller.component, func, "refused invocation: {why}");
                let msg = why.to_string();
                let n = msg.len().min(response.len());
                response[..n].copy_from_slice(&msg.as_bytes()[..n]);
                (status::REFUSED, why.code(), n)
            }
        };
        s.status.store(st, Ordering::Relaxed);
        s.code.store(code, Ordering::Relaxed);
        s.response_len.store(resp_len as u32, Ordering::Relaxed);
    }
}

/// Wakes every worker of `edge` so that retired ones return.
pub fn wake_workers(edge: &Edge) {
    for i in 0..edge.slot_count() {
        futex::wake_all(&edge.slot(i).state);
    }
}

/// Holds the calls of clients that are not recovering while a rebooted
/// server recovers eagerly: closed before the incarnation serves, opened
/// once every client has rebuilt its descriptors
/// ([`crate::upcall::recover_eagerly`]).
#[derive(Debug)]
pub struct RecoveryGate {
    /// 1 while closed; a futex.
    closed: AtomicU32,
}

impl Default for RecoveryGate {
    fn default() -> Self {
        Self::opened()
    }
}

impl RecoveryGate {
    pub const fn opened() -> Self {
        Self {
            closed: AtomicU32::new(0),
        }
    }

    pub const fn closed() -> Self {
        Self {
            closed: AtomicU32::new(1),
        }
    }

    pub fn close(&self) {
        self.closed.store(1, Ordering::SeqCst);
    }

    /// Opens the gate and wakes every call held at it.
    pub fn open(&self) {
        self.closed.store(0, Ordering::SeqCst);
        futex::wake_all(&self.closed);
    }

    pub fn is_open(&self) -> bool {
        self.closed.load(Ordering::SeqCst) == 0
    }

    /// Returns at once for a call with `flags::RECOVERY` or an open gate;
    /// otherwise sleeps until the gate opens.
    pub fn pass(&self, call_flags: u32) {
        if call_flags & flags::RECOVERY != 0 {
            return;
        }
        while self.closed.load(Ordering::SeqCst) != 0 {
            futex::wait(&self.closed, 1, None);
        }
    }
}

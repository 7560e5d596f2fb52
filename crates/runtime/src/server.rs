//! The server side of invocation: one worker thread per channel slot, each
//! waiting for a request, checking its epoch and handing it to the
//! interface's server stub.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::channel::{state, status, Edge};
use crate::futex;
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
        let s = self.edge.slot(self.slot);
        let caller = Caller {
            component: self.client,
            slot: self.slot,
        };
        while self.wait_for_request() {
            let req_epoch = s.epoch.load(Ordering::Relaxed);
            if req_epoch != 0 && req_epoch != epoch {
                s.status.store(status::STALE, Ordering::Relaxed);
            } else {
                self.handle(service, &caller);
            }
            s.state.store(state::RESPONSE, Ordering::SeqCst);
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
        let len = (s.request_len.load(Ordering::Relaxed) as usize).min(crate::channel::BUFFER_SIZE);
        // SAFETY: the slot is in REQUEST, so this worker owns both buffers
        // until it publishes RESPONSE.
        let (request, response) = unsafe {
            (
                &self.edge.request_buffer(self.slot)[..len],
                self.edge.response_buffer(self.slot),
            )
        };
        let (st, code, resp_len) = match service.dispatch(caller, func, request, response) {
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

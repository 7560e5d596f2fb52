//! The server side of invocation: one worker thread per channel slot, each
//! waiting for a request, checking its epochs (the server's and the
//! calling incarnation's), telling the service of client deaths it has not
//! heard of yet, passing the [`RecoveryGate`],
//! taking on the caller's priority and handing the request to the
//! interface's server stub. A watched worker ([`crate::watchdog`]) marks
//! each invocation it runs as a stretch, and each request it holds.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::abi::channel::{flags, state, status, Edge, SlotHeader, BUFFER_SIZE};
use crate::futex;
use crate::journal::{Full, Journal};
use crate::priority;
use crate::stub::{Caller, Dispatched, Service};

/// How often a sleeping worker looks at its retirement flag.
const RETIRE_RECHECK: Duration = Duration::from_millis(100);

/// What a worker needs to serve one slot.
pub struct SlotWorker {
    pub edge: Arc<Edge>,
    pub slot: u32,
    /// Component id of the client this edge belongs to.
    pub client: u32,
    /// When set (and the worker woken), the worker returns between calls.
    pub retire: Arc<AtomicBool>,
    /// The request log of a checkpoint-recovered server, with this edge's
    /// place among the provided ones.
    pub(crate) journal: Option<(Arc<Journal>, u32)>,
    /// The address of this worker's slot header, taken when the worker was
    /// made, to check the one it computes before each request against.
    home: usize,
}

/// A reply as the channel carries it: `status::*`, code and bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Reply<'a> {
    pub status: u32,
    pub code: u32,
    pub bytes: &'a [u8],
}

/// Runs one request through `service` into `response`; returns the
/// reply's status, code and length (a refusal's message in `response`).
pub(crate) fn dispatch_raw(
    service: &dyn Service,
    caller: &Caller,
    func: u32,
    request: &[u8],
    response: &mut [u8],
) -> (u32, u32, usize) {
    match service.dispatch(caller, func, request, response) {
        Dispatched::Ok(n) => (status::OK, 0, n),
        Dispatched::AppError(code) => (status::APP_ERROR, code, 0),
        Dispatched::Refused(why) => {
            tracing::warn!(client = caller.component, func, "refused invocation: {why}");
            let msg = why.to_string();
            let n = msg.len().min(response.len());
            response[..n].copy_from_slice(&msg.as_bytes()[..n]);
            (status::REFUSED, why.code(), n)
        }
    }
}

/// Posts `reply` in slot `slot` (which holds a request this thread
/// answers) and wakes its client.
pub(crate) fn publish(edge: &Edge, slot: u32, reply: &Reply<'_>) {
    let s = edge.slot(slot);
    // SAFETY: the slot is in REQUEST and the caller answers it (in turn:
    // its own worker waits for the turn), so it owns the response buffer
    // until RESPONSE is published below.
    let response = unsafe { edge.response_buffer(slot) };
    let n = reply.bytes.len().min(response.len());
    response[..n].copy_from_slice(&reply.bytes[..n]);
    s.status.store(reply.status, Ordering::Relaxed);
    s.code.store(reply.code, Ordering::Relaxed);
    s.response_len.store(n as u32, Ordering::Relaxed);
    s.state.store(state::RESPONSE, Ordering::SeqCst);
    if s.client_sleeping.load(Ordering::SeqCst) != 0 {
        futex::wake(&s.state, 1);
    }
}

impl SlotWorker {
    pub fn new(edge: Arc<Edge>, slot: u32, client: u32, retire: Arc<AtomicBool>) -> Self {
        let home = edge.slot(slot) as *const SlotHeader as usize;
        Self {
            edge,
            slot,
            client,
            retire,
            journal: None,
            home,
        }
    }

    /// Ends the process if the slot header this worker is about to serve
    /// is not its own. A worker that kept its slot's offset in a register
    /// across its waits (the loop before [`SlotWorker::serve_posted`]) and
    /// had a bit of it flipped (SuperGlue's fault) read another place of
    /// the edge as its request and wrote its reply there: its client saw a
    /// wrong answer with nothing detected (ten of 1,000 register flips into
    /// kv). No correct worker computes another address, so the process is
    /// taken for damaged: it aborts, and is recovered. `black_box` makes
    /// the check read both values anew on every request.
    fn check_home(&self, s: &SlotHeader) {
        let here = std::hint::black_box(s as *const SlotHeader as usize);
        if here != std::hint::black_box(self.home) {
            tracing::error!(
                slot = self.slot,
                "a worker's slot is at {here:#x}, not {:#x}: its registers are damaged; aborting",
                self.home
            );
            std::process::abort();
        }
    }

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
        while self.wait_for_request() {
            self.serve_posted(service, epoch, gate);
        }
    }

    /// Serves the request slot `self.slot` holds, if it still does. Not
    /// inlined into the loop, and neither is the wait: the slot's address
    /// is computed anew for each request rather than kept in a register
    /// across the waits, where a flipped bit made the worker serve another
    /// place of the edge with nothing detected ([`SlotWorker::check_home`]).
    #[inline(never)]
    fn serve_posted(&self, service: &dyn Service, epoch: u64, gate: &RecoveryGate) {
        let s = self.edge.slot(self.slot);
        self.check_home(s);
        let watch = crate::watchdog::this_worker();
        // Held here while the supervisor checkpoints this component;
        // a request gone meanwhile (this thread was rolled back to a
        // checkpoint taken just after it saw one, or a replay answered
        // it) is not served.
        let serving = self.edge.begin_serving(self.slot);
        let turn = self.journal.as_ref().map(|(j, _)| j.turn());
        if s.state.load(Ordering::SeqCst) != state::REQUEST {
            return;
        }
        if let Some(w) = watch {
            w.take();
        }
        let req_epoch = s.epoch.load(Ordering::Relaxed);
        let caller_epoch = s.client_epoch.load(Ordering::Relaxed);
        if (req_epoch != 0 && req_epoch != epoch)
            || caller_epoch != self.edge.header().client_epoch.load(Ordering::SeqCst)
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
            if let (Err(Full), Some((journal, _))) =
                (self.handle_watched(service, watch), &self.journal)
            {
                // No room to log it: let a checkpoint cut the log,
                // then serve it (it is still posted).
                if let Some(w) = watch {
                    w.release();
                }
                drop(turn);
                drop(serving);
                journal.wait_for_room();
                return;
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

    /// Runs the request, in a stretch of the watchdog's if it watches.
    fn handle_watched(
        &self,
        service: &dyn Service,
        watch: Option<&crate::watchdog::WorkerEntry>,
    ) -> Result<(), Full> {
        let caller = Caller {
            component: self.client,
            slot: self.slot,
        };
        let Some(w) = watch else {
            return self.handle(service, &caller);
        };
        w.begin(self.edge.slot(self.slot).func.load(Ordering::Relaxed));
        let handled = self.handle(service, &caller);
        w.end();
        handled
    }

    /// Spins briefly, then sleeps, until a request arrives or a replay is
    /// asked for (true), or the worker is retired (false). Not inlined
    /// (see [`SlotWorker::serve_posted`]).
    #[inline(never)]
    fn wait_for_request(&self) -> bool {
        let s = self.edge.slot(self.slot);
        let replay = || {
            self.journal
                .as_ref()
                .is_some_and(|(j, _)| j.replay_pending())
        };
        if replay() {
            return true;
        }
        let (_, arrived) =
            futex::spin_until(&s.state, futex::spin_budget(), 0, |v| v == state::REQUEST);
        if arrived {
            return true;
        }
        // The slot's place was kept in a register across the spin: one
        // flipped there would have this worker mark (and later clear)
        // another word of the edge as its sleep flag (a kv campaign's
        // injection 753: two wrong answers, nothing detected).
        self.check_home(s);
        s.server_sleeping.store(1, Ordering::SeqCst);
        let arrived = loop {
            let v = s.state.load(Ordering::SeqCst);
            if v == state::REQUEST || replay() {
                break true;
            }
            if self.retire.load(Ordering::SeqCst) {
                break false;
            }
            // Bounded: `retire` is not the futex word, so a retirement
            // and its wake between the check above and this wait would
            // otherwise be missed for good (a Loopback reboot beside two
            // CPU hogs hung joining such a worker).
            futex::wait(&s.state, v, Some(RETIRE_RECHECK));
        };
        s.server_sleeping.store(0, Ordering::Relaxed);
        arrived
    }

    /// Runs the slot's request and writes its reply (status, code and
    /// length stored, not yet published); a checkpoint-recovered server
    /// logs it first and its reply after, or refuses to run it without
    /// room in its log. A `readonly` function is not logged: it changes
    /// nothing a replay must rebuild, and a call of it cut short by a
    /// crash is still posted, so the next incarnation serves it (after
    /// its replay: it runs in turn like any other).
    fn handle(&self, service: &dyn Service, caller: &Caller) -> Result<(), Full> {
        let s = self.edge.slot(self.slot);
        let func = s.func.load(Ordering::Relaxed);
        let len = (s.request_len.load(Ordering::Relaxed) as usize).min(BUFFER_SIZE);
        // SAFETY: the slot is in REQUEST, so this worker owns the response
        // buffer until it publishes RESPONSE.
        let response = unsafe { self.edge.response_buffer(self.slot) };
        let logged = match &self.journal {
            Some((journal, _)) if service.interface().is_readonly(func) => {
                journal.count_served();
                None
            }
            journal => journal.as_ref(),
        };
        let (st, code, resp_len) = crate::scratch::with_copy(
            len,
            |private| self.edge.copy_request(self.slot, private),
            |request| match logged {
                None => Ok(dispatch_raw(service, caller, func, request, response)),
                Some((journal, edge)) => {
                    let Some(at) = journal.accept(*edge, self.slot, s, func, request)? else {
                        return Ok(dispatch_raw(service, caller, func, request, response));
                    };
                    // The reply is made in private memory, logged, and
                    // only then copied into the slot: made in the slot, its
                    // stores wait for the client's CPU to give up the
                    // slot's cache lines, and logging it read them back,
                    // waiting for that first, then again for the state
                    // word's line (`docs/benchmarks.md`).
                    let (st, code, n) = crate::scratch::with_buffer(BUFFER_SIZE, |private| {
                        let (st, code, n) = journal
                            .run(at, || dispatch_raw(service, caller, func, request, private));
                        journal.replied(at, st, code, &private[..n]);
                        response[..n].copy_from_slice(&private[..n]);
                        (st, code, n)
                    });
                    Ok((st, code, n))
                }
            },
        )?;
        s.status.store(st, Ordering::Relaxed);
        s.code.store(code, Ordering::Relaxed);
        s.response_len.store(resp_len as u32, Ordering::Relaxed);
        Ok(())
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

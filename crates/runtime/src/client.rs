//! The client side of invocation: a [`Connection`] per used interface, a
//! channel slot per calling thread, and the wait for a reply that never
//! outlives the server. Each call carries the calling thread's priority and
//! whether it rebuilds descriptors ([`RecoveryScope`]); a connection also
//! takes the server's upcalls ([`crate::upcall`]).
//!
//! A reply no correct server gives to a generated stub's call (a refusal
//! of a function id or encoding the stub made, a reply that does not
//! decode) means the server is faulty though alive: in a watched system the
//! client marks the incarnation suspected in the edge header, the
//! supervisor's watchdog reboots it, and the call fails as a reboot makes
//! it fail, so that the stub rebuilds and re-issues it. A thread whose
//! suspicion had its server rebooted suspects no server again until it
//! gets a sound reply, so a client whose own requests are wrong costs its
//! server one reboot, not one per retry (an impossible reply to the
//! re-issued call is the request's own doing, and is returned); a fault
//! that comes later, even within the same second, is suspected in turn.

use std::cell::{Cell, RefCell};
use std::marker::PhantomData;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use crate::abi::channel::{flags, liveness, state, status, Edge, CHANGE_COUNTERS};
use crate::futex;
use crate::journal::{self, Outcome, Outgoing};
use crate::priority;
use crate::stub::{CallError, Fault, InterfaceError, InterfaceInfo, Refusal, ReplyStatus};
use crate::upcall::{Handler, Listener, Recover};
use crate::wire::{Reader, WireError, Writer};

/// How often a sleeping client re-checks the server's liveness; a dead
/// server's clients are woken by the supervisor long before this.
const RECHECK: Duration = Duration::from_millis(100);

/// How long a client waits for the reboot of a server it suspected.
const SUSPECT_WAIT: Duration = Duration::from_secs(1);

thread_local! {
    /// This thread's last suspicion had its server rebooted, and no sound
    /// reply has come to it since.
    static SUSPICION_OPEN: Cell<bool> = const { Cell::new(false) };
}

/// A server's epoch and change counters as a client saw them
/// ([`Connection::changes`]): a reply obtained after they were taken stays
/// true while [`Connection::unchanged`] says so for the counters it depends
/// on. The counters live in the edge, which the server may write: a faulty
/// server can make its client keep a stale reply, as it could send one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Changes {
    epoch: u64,
    counts: [u64; CHANGE_COUNTERS],
}

/// A client's connection to one interface of one server component.
#[derive(Clone)]
pub struct Connection {
    inner: Arc<Inner>,
}

struct Inner {
    edge: Arc<Edge>,
    upcalls: Arc<Listener>,
    server: String,
    server_id: u32,
    info: &'static InterfaceInfo,
    /// Names the connection in a request log ([`crate::journal`]): a hash
    /// of the server's name, the same in every incarnation.
    id: u64,
    supervision: Supervision,
}

/// What the supervisor does for a connection's server.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Supervision {
    /// A watchdog acts on suspicions ([`EdgeHeader::suspected`](crate::abi::channel::EdgeHeader)).
    pub watched: bool,
    /// The server is checkpoint-recovered: a rollback's replay answers a
    /// call again ([`state::REPLAY`]).
    pub replayed: bool,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("interface", &self.inner.info.name)
            .field("server", &self.inner.server)
            .finish()
    }
}

impl Connection {
    /// A connection on the edge `upcalls` listens on; starts its upcall
    /// thread if this is the edge's first connection.
    pub(crate) fn new(
        upcalls: Arc<Listener>,
        server: String,
        server_id: u32,
        info: &'static InterfaceInfo,
        supervision: Supervision,
    ) -> std::io::Result<Self> {
        upcalls.start()?;
        let id = {
            use std::hash::{Hash, Hasher};
            // Fixed keys: the same in every process.
            let mut h = std::collections::hash_map::DefaultHasher::new();
            server.hash(&mut h);
            h.finish()
        };
        Ok(Self {
            inner: Arc::new(Inner {
                edge: upcalls.edge().clone(),
                upcalls,
                server,
                server_id,
                info,
                id,
                supervision,
            }),
        })
    }

    pub fn interface(&self) -> &'static InterfaceInfo {
        self.inner.info
    }

    /// The server component's name.
    pub fn server(&self) -> &str {
        &self.inner.server
    }

    /// The server component's id (its place in the system description,
    /// from 1; 0 outside a system): how the server knows this client's
    /// component among its callers, and how it may be named to a third
    /// (an mm page aliased to it).
    pub fn server_id(&self) -> u32 {
        self.inner.server_id
    }

    /// The server's current epoch (incarnation number); while a
    /// checkpoint-recovered server replays a request, the epoch its next
    /// recorded call on this connection saw.
    pub fn epoch(&self) -> u64 {
        journal::replayed_epoch(self.inner.id).unwrap_or_else(|| self.live_epoch())
    }

    fn live_epoch(&self) -> u64 {
        self.inner.edge.header().epoch.load(Ordering::SeqCst)
    }

    /// The server's epoch and change counters now: what a reply about to
    /// be asked for depends on (take it before the call).
    pub fn changes(&self) -> Changes {
        let h = self.inner.edge.header();
        Changes {
            epoch: h.epoch.load(Ordering::Acquire),
            counts: std::array::from_fn(|i| h.changes[i].load(Ordering::Acquire)),
        }
    }

    /// Whether the server has published no change of `counters` (nor
    /// rebooted) since `then` was taken. A counter that does not exist
    /// (named by a faulty server's reply) has always changed.
    pub fn unchanged(&self, then: &Changes, counters: &[usize]) -> bool {
        let h = self.inner.edge.header();
        counters.iter().all(|&i| {
            h.changes
                .get(i)
                .zip(then.counts.get(i))
                .is_some_and(|(now, &was)| now.load(Ordering::Acquire) == was)
        }) && h.epoch.load(Ordering::Acquire) == then.epoch
    }

    /// Counts descriptors this client rebuilt (shown in the event log).
    pub fn note_recovered(&self, n: u64) {
        self.inner
            .edge
            .header()
            .recovered
            .fetch_add(n, Ordering::Relaxed);
    }

    /// Has `r` rebuild its descriptors when the server asks (the
    /// [`RECOVER`](crate::upcall::RECOVER) upcall of eager recovery). Held
    /// weakly: a dropped recoverer is forgotten.
    pub fn register_recoverer(&self, r: Weak<dyn Recover>) {
        self.inner.upcalls.register_recoverer(r);
    }

    /// Has `h` answer the server's upcall `op` (any but `RECOVER`),
    /// replacing an earlier handler of `op`.
    pub fn on_upcall(&self, op: u32, h: Handler) {
        self.inner.upcalls.on_upcall(op, h);
    }

    /// Invokes `func`. With `epoch: Some(e)` the call carries descriptor ids
    /// of epoch `e`, and a server of another epoch refuses it as
    /// [`Fault::Stale`] without running it.
    pub fn call<T>(
        &self,
        func: u32,
        epoch: Option<u64>,
        encode: impl FnOnce(&mut Writer<'_>) -> Result<(), WireError>,
        mut decode: impl FnMut(ReplyStatus<'_>) -> Result<T, WireError>,
    ) -> Result<T, Fault> {
        // A server's worker that calls on is waiting, not running: the
        // watchdog must not blame a hang of the callee on it.
        let recorder = match journal::outgoing(self.inner.id, func, || self.live_epoch()) {
            Outgoing::Direct => None,
            Outgoing::Record(recorder) => Some(recorder),
            Outgoing::Replayed(Outcome::Reply {
                status,
                code,
                bytes,
            }) => {
                return reply(status, code, &bytes, &mut false)
                    .and_then(|r| decode(r).map_err(Fault::Decode))
            }
            Outgoing::Replayed(Outcome::Fault(fault)) => return Err(fault),
            Outgoing::Refused => return Err(journal::refused()),
        };
        let result = crate::watchdog::blocking(|| {
            self.call_now(func, epoch, encode, decode, recorder.as_ref())
        });
        if let Some(recorder) = recorder {
            recorder.finish(result.as_ref().err());
        }
        result
    }

    /// Invokes `func` as a generated client stub does: `encode` writes the
    /// arguments, `decode` reads the result (all of it: bytes left over are a
    /// decoding fault), and the reply is sorted into the value, one of the
    /// interface's errors, or a fault.
    pub fn invoke<T, E: InterfaceError>(
        &self,
        func: u32,
        epoch: Option<u64>,
        encode: impl FnOnce(&mut Writer<'_>) -> Result<(), WireError>,
        decode: impl FnMut(&mut Reader<'_>) -> Result<T, WireError>,
    ) -> Result<T, CallError<E>> {
        self.invoke_failing(func, epoch, |_| true, encode, decode)
    }

    /// [`Self::invoke`] of a call that a correct server fails only with
    /// the errors `possible` accepts (`fails` in the IDL): any other
    /// declared error is a reply no correct server gives, handled like one
    /// that does not decode (the server suspected, the call's fate unknown).
    pub fn invoke_failing<T, E: InterfaceError>(
        &self,
        func: u32,
        epoch: Option<u64>,
        possible: impl Fn(&E) -> bool,
        encode: impl FnOnce(&mut Writer<'_>) -> Result<(), WireError>,
        mut decode: impl FnMut(&mut Reader<'_>) -> Result<T, WireError>,
    ) -> Result<T, CallError<E>> {
        let reply = self.call(func, epoch, encode, |status| match status {
            ReplyStatus::Ok(mut r) => {
                let value = decode(&mut r)?;
                r.finish()?;
                Ok(Ok(value))
            }
            ReplyStatus::AppError(code) => match E::from_code(code) {
                Some(e) if !possible(&e) => Err(WireError::Impossible { code }),
                _ => Ok(Err(code)),
            },
        });
        match reply {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(code)) => Err(E::from_code(code).map_or_else(
                || {
                    CallError::Fault(Fault::Refused(format!(
                        "error code {code} is not declared by interface `{}`",
                        E::INTERFACE
                    )))
                },
                CallError::Server,
            )),
            Err(fault) => Err(CallError::Fault(fault)),
        }
    }

    fn call_now<T>(
        &self,
        func: u32,
        epoch: Option<u64>,
        encode: impl FnOnce(&mut Writer<'_>) -> Result<(), WireError>,
        mut decode: impl FnMut(ReplyStatus<'_>) -> Result<T, WireError>,
        record: Option<&journal::Recorder>,
    ) -> Result<T, Fault> {
        let edge = &self.inner.edge;
        self.wait_until_up()?;
        let slot = claimed_slot(edge);
        // Held here while the supervisor checkpoints this component.
        let _calling = edge.begin_calling(slot);
        let s = edge.slot(slot);
        {
            // SAFETY: the slot is IDLE and claimed by this thread alone, so the
            // client owns its request buffer.
            let request = unsafe { edge.request_buffer(slot) };
            let mut w = Writer::new(request);
            encode(&mut w).map_err(Fault::Encode)?;
            s.request_len.store(w.len() as u32, Ordering::Relaxed);
        }
        s.func.store(func, Ordering::Relaxed);
        s.epoch.store(epoch.unwrap_or(0), Ordering::Relaxed);
        s.client_epoch.store(
            edge.header().client_epoch.load(Ordering::SeqCst),
            Ordering::Relaxed,
        );
        let call_flags = if RecoveryScope::active() {
            flags::RECOVERY
        } else {
            0
        };
        s.flags.store(call_flags, Ordering::Relaxed);
        s.priority
            .store(priority::current().word(), Ordering::Relaxed);
        s.seq.fetch_add(1, Ordering::Relaxed);
        s.state.store(state::REQUEST, Ordering::SeqCst);
        if s.server_sleeping.load(Ordering::SeqCst) != 0 {
            futex::wake(&s.state, 1);
        }

        let outcome = self.wait_for_reply(slot);
        // Whether the reply is one no correct server gives.
        let mut impossible = false;
        let result = self.take_reply(slot, outcome, &mut decode, record, &mut impossible);
        match result {
            Err(fault @ (Fault::Decode(_) | Fault::Refused(_)))
                if impossible
                    && self.inner.supervision.replayed
                    && !self.inner.info.is_readonly(func) =>
            {
                // The call is in the log (a refusal too: the server stub
                // refused it after logging it): its replay answers it
                // again, once, and posting it again would run it twice
                // (a `readonly` call is not logged, and is posted again).
                match self.await_replay(slot, &fault) {
                    Replay::Answered(outcome) => {
                        let again = &mut false; // the request's own doing now
                        let result = self.take_reply(slot, outcome, &mut decode, record, again);
                        s.state.store(state::IDLE, Ordering::Release);
                        result
                    }
                    Replay::Unanswered => Err(fault),
                    Replay::Lost => Err(Fault::Interrupted),
                }
            }
            result => {
                s.state.store(state::IDLE, Ordering::Release);
                match result {
                    Err(fault) if impossible => Err(self.suspect(fault)),
                    // A rebuild's calls, made on the way to re-issuing the
                    // suspected call, do not close the suspicion: only a
                    // sound reply to a call of the client's own does (a
                    // timer's `wait` with a tick its stub stored from a
                    // faulty reply had timer rebooted every 10 ms, each
                    // rebuild's `create` closing the suspicion before the
                    // same `wait` was refused again: CI, seed 563335).
                    Ok(value) if call_flags & flags::RECOVERY == 0 => {
                        SUSPICION_OPEN.set(false);
                        Ok(value)
                    }
                    other => other,
                }
            }
        }
    }

    /// The value or fault of the call in `slot`, whose wait ended in state
    /// `outcome`; `impossible` is set for a reply no correct server gives.
    fn take_reply<T>(
        &self,
        slot: u32,
        outcome: u32,
        decode: &mut impl FnMut(ReplyStatus<'_>) -> Result<T, WireError>,
        record: Option<&journal::Recorder>,
        impossible: &mut bool,
    ) -> Result<T, Fault> {
        let edge = &self.inner.edge;
        let s = edge.slot(slot);
        if outcome != state::RESPONSE {
            return match edge.header().liveness.load(Ordering::SeqCst) {
                liveness::GONE => Err(self.lost()),
                _ => Err(Fault::Interrupted),
            };
        }
        let len =
            (s.response_len.load(Ordering::Relaxed) as usize).min(crate::abi::channel::BUFFER_SIZE);
        crate::scratch::with_copy(
            len,
            |private| edge.copy_response(slot, private),
            |response| {
                let (status, code) = (
                    s.status.load(Ordering::Relaxed),
                    s.code.load(Ordering::Relaxed),
                );
                if let Some(r) = record {
                    r.stage(status, code, response);
                }
                reply(status, code, response, impossible).and_then(|r| {
                    decode(r).map_err(|e| {
                        *impossible = true;
                        Fault::Decode(e)
                    })
                })
            },
        )
    }

    /// `error` as the call's answer, unless it is `unknown`, the interface's
    /// error for a descriptor the server does not hold, while the client
    /// stub `held` the call's descriptor in the epoch it was made in: a reply
    /// no correct server gives, as its incarnation lost what it handed out
    /// (a fault damaged its table of open descriptors). Has it rebooted or
    /// rolled back like any impossible reply ([`Self::suspect`]) and returns
    /// [`Fault::Stale`], so that the stub makes the call again (it did not
    /// run) on the descriptor rebuilt; `error` if no reboot was made.
    ///
    /// A client that closes a descriptor in one thread while it calls with
    /// it in another can meet the error from a correct server, in the
    /// moment between the server's close and the stub forgetting the
    /// descriptor: a needless reboot then, never a wrong answer.
    pub fn disowned<E: PartialEq>(
        &self,
        error: CallError<E>,
        unknown: E,
        held: bool,
    ) -> CallError<E> {
        if !held || !matches!(&error, CallError::Server(e) if *e == unknown) {
            return error;
        }
        let fault = Fault::Refused("the server does not hold a descriptor it handed out".into());
        match self.reboot_answered(&fault) {
            true => CallError::Fault(Fault::Stale),
            false => error,
        }
    }

    /// After a reply no correct server gives (`fault`): has the watchdog
    /// reboot the live incarnation (see the module's doc) and returns the
    /// fault of a reboot, [`Fault::Stale`] for a refusal (the call did not
    /// run) or [`Fault::Interrupted`] for a reply that does not decode (it
    /// may have). Returns `fault` itself if the reboot was not made
    /// ([`Connection::reboot_answered`]).
    fn suspect(&self, fault: Fault) -> Fault {
        if !self.reboot_answered(&fault) {
            return fault;
        }
        match fault {
            Fault::Decode(_) => Fault::Interrupted,
            _ => Fault::Stale,
        }
    }

    /// Marks the live incarnation suspected of `fault` and waits for the
    /// watchdog's answer: a reboot (which raises the epoch) or a rollback
    /// (which keeps it and clears the suspicion). False in an unwatched
    /// system, while this thread's last suspicion is open (no sound reply
    /// since the reboot it had), or if no answer comes within
    /// [`SUSPECT_WAIT`].
    fn reboot_answered(&self, fault: &Fault) -> bool {
        if !self.inner.supervision.watched || SUSPICION_OPEN.get() {
            return false;
        }
        let h = self.inner.edge.header();
        let epoch = h.epoch.load(Ordering::SeqCst);
        tracing::warn!(server = %self.inner.server, epoch, "{fault}: a faulty server, asking for its reboot");
        h.suspected.store(epoch, Ordering::SeqCst);
        let until = Instant::now() + SUSPECT_WAIT;
        while h.epoch.load(Ordering::SeqCst) == epoch && h.suspected.load(Ordering::SeqCst) == epoch
        {
            if Instant::now() >= until {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        SUSPICION_OPEN.set(true);
        true
    }

    /// After a reply of a checkpoint-recovered server that does not decode
    /// (`fault`): the call ran, and posting it again would run it twice.
    /// The slot is left holding it ([`state::REPLAY`]) while the watchdog
    /// rolls the server back; the replay runs the call again from the
    /// checkpoint and answers it. Gives the slot up (IDLE) if the
    /// suspicion goes unanswered, the server is rebooted instead (its log
    /// gone with its state), or no replay answers within [`SUSPECT_WAIT`].
    fn await_replay(&self, slot: u32, fault: &Fault) -> Replay {
        let s = self.inner.edge.slot(slot);
        let epoch = self.live_epoch();
        s.state.store(state::REPLAY, Ordering::SeqCst);
        let answered = self.reboot_answered(fault);
        let until = Instant::now() + SUSPECT_WAIT;
        s.client_sleeping.store(1, Ordering::SeqCst);
        let given_up = loop {
            if s.state.load(Ordering::SeqCst) != state::REPLAY {
                break false;
            }
            let waited = !answered || self.live_epoch() != epoch || Instant::now() >= until;
            let taken_back = || {
                s.state
                    .compare_exchange(
                        state::REPLAY,
                        state::IDLE,
                        Ordering::SeqCst,
                        Ordering::SeqCst,
                    )
                    .is_ok()
            };
            if waited && taken_back() {
                break true;
            }
            futex::wait(&s.state, state::REPLAY, Some(RECHECK));
        };
        s.client_sleeping.store(0, Ordering::Relaxed);
        match (given_up, answered) {
            (false, _) => Replay::Answered(self.wait_for_reply(slot)),
            (true, false) => Replay::Unanswered,
            (true, true) => Replay::Lost,
        }
    }

    fn lost(&self) -> Fault {
        Fault::Lost(self.inner.server.clone())
    }

    /// Waits while the server reboots; fails if it is gone.
    fn wait_until_up(&self) -> Result<(), Fault> {
        let h = self.inner.edge.header();
        loop {
            match h.liveness.load(Ordering::SeqCst) {
                liveness::LIVE => return Ok(()),
                liveness::GONE => return Err(self.lost()),
                _ => futex::wait(&h.liveness, liveness::DOWN, Some(RECHECK)),
            }
        }
    }

    /// Spins, then sleeps, until the slot leaves REQUEST; returns its state.
    fn wait_for_reply(&self, slot: u32) -> u32 {
        let s = self.inner.edge.slot(slot);
        // The site: this edge's function (what the slot says: a peer
        // that changes it only mixes up this thread's spinning history).
        let edge = Arc::as_ptr(&self.inner.edge) as usize as u32 >> 6;
        let site = edge ^ s.func.load(Ordering::Relaxed).wrapping_mul(0x9e37_79b9);
        let (v, done) = futex::spin_until(&s.state, futex::spin_budget(), site, |v| {
            v != state::REQUEST
        });
        if done {
            return v;
        }
        s.client_sleeping.store(1, Ordering::SeqCst);
        let v = loop {
            let v = s.state.load(Ordering::SeqCst);
            if v != state::REQUEST {
                break v;
            }
            futex::wait(&s.state, state::REQUEST, Some(RECHECK));
        };
        s.client_sleeping.store(0, Ordering::Relaxed);
        v
    }
}

thread_local! {
    /// How many [`RecoveryScope`]s the thread is in.
    static RECOVERING: Cell<u32> = const { Cell::new(0) };
}

/// While a scope is alive, every call the thread makes carries
/// [`flags::RECOVERY`]: it rebuilds descriptors, and passes the gate that
/// holds other calls while a server recovers eagerly. Generated client stubs
/// rebuild descriptors inside one; scopes nest.
#[must_use = "the scope ends when the guard is dropped"]
pub struct RecoveryScope {
    /// Bound to its thread.
    _thread: PhantomData<*const ()>,
}

impl RecoveryScope {
    pub fn enter() -> Self {
        RECOVERING.with(|d| d.set(d.get() + 1));
        Self {
            _thread: PhantomData,
        }
    }

    /// Whether the calling thread is in a recovery scope.
    pub fn active() -> bool {
        RECOVERING.with(Cell::get) != 0
    }
}

impl Drop for RecoveryScope {
    fn drop(&mut self) {
        RECOVERING.with(|d| d.set(d.get() - 1));
    }
}

/// How a call awaiting its replay ([`Connection::await_replay`]) ended.
enum Replay {
    /// The replay claimed it; the slot's state once it answered.
    Answered(u32),
    /// No watchdog acted on the suspicion: the slot is IDLE again.
    Unanswered,
    /// The server was rolled back or rebooted, and no replay answered: the
    /// slot is IDLE again, and the call's fate unknown.
    Lost,
}

/// A slot claimed by the current thread, released when the thread exits.
struct Claim {
    edge: Arc<Edge>,
    slot: u32,
    /// The edge's `claims_round` when it was claimed: a claim of an older
    /// round was voided by the supervisor, and the slot may be another
    /// thread's now.
    round: u64,
}

impl Claim {
    fn valid(&self) -> bool {
        self.edge.header().claims_round.load(Ordering::Acquire) == self.round
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        if self.valid() {
            self.edge
                .header()
                .claimed
                .fetch_and(!(1u64 << self.slot), Ordering::AcqRel);
        }
    }
}

thread_local! {
    static CLAIMS: RefCell<Vec<Claim>> = const { RefCell::new(Vec::new()) };
}

/// This thread's slot on `edge`, claimed on first use. Waits if every slot is
/// taken by other threads.
fn claimed_slot(edge: &Arc<Edge>) -> u32 {
    CLAIMS.with(|claims| {
        let mut claims = claims.borrow_mut();
        if let Some(c) = claims.iter().find(|c| Arc::ptr_eq(&c.edge, edge)) {
            if c.valid() {
                return c.slot;
            }
            // Voided (this thread was restored from a checkpoint): claim anew.
            claims.retain(|c| !Arc::ptr_eq(&c.edge, edge));
        }
        let h = edge.header();
        let round = h.claims_round.load(Ordering::Acquire);
        let all = if edge.slot_count() == 64 {
            u64::MAX
        } else {
            (1u64 << edge.slot_count()) - 1
        };
        let slot = loop {
            let cur = h.claimed.load(Ordering::Acquire);
            let free = !cur & all;
            if free == 0 {
                std::thread::sleep(Duration::from_micros(200));
                continue;
            }
            let slot = free.trailing_zeros();
            if h.claimed
                .compare_exchange(cur, cur | (1 << slot), Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                break slot;
            }
        };
        // A slot left by a crashed incarnation of this client may still hold
        // that incarnation's request: let the server finish with it first.
        while edge.slot(slot).state.load(Ordering::Acquire) == state::REQUEST {
            futex::wait(&edge.slot(slot).state, state::REQUEST, Some(RECHECK));
        }
        // Claims of edges no connection holds any more go (each kept its
        // edge mapped, and made this search longer).
        claims.retain(|c| Arc::strong_count(&c.edge) > 1);
        claims.push(Claim {
            edge: edge.clone(),
            slot,
            round,
        });
        slot
    })
}

/// The most of a refusal's text a client keeps, in bytes.
const REFUSAL_TEXT: usize = 256;

/// A refusal's reason as the server wrote it, for errors and logs: the
/// bytes are the server's, and a faulty one may fill the whole response
/// with anything, so the text is cut at [`REFUSAL_TEXT`] bytes and
/// what is not printable is escaped.
fn refusal_text(response: &[u8]) -> String {
    let kept = &response[..response.len().min(REFUSAL_TEXT)];
    let mut why = String::new();
    for c in String::from_utf8_lossy(kept).chars() {
        match c.is_control() {
            true => why.extend(c.escape_default()),
            false => why.push(c),
        }
    }
    if kept.len() < response.len() {
        why.push_str(&format!(" … ({} bytes)", response.len()));
    }
    why
}

/// What a reply of `status` and `code` says, its bytes copied out as
/// `response`; `impossible` is set for a refusal no correct server gives.
fn reply<'a>(
    status: u32,
    code: u32,
    response: &'a [u8],
    impossible: &mut bool,
) -> Result<ReplyStatus<'a>, Fault> {
    match status {
        status::OK => Ok(ReplyStatus::Ok(Reader::new(response))),
        status::APP_ERROR => Ok(ReplyStatus::AppError(code)),
        status::STALE => Err(Fault::Stale),
        _ => {
            let why = refusal_text(response);
            // A status that is none of the four is a faulty server's too.
            *impossible = status != status::REFUSED || Refusal::is_server_fault(code);
            Err(match code == Refusal::UnknownDescriptor(0).code() {
                true => Fault::NoDescriptor(why),
                false => Fault::Refused(why),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_text_is_kept_short_and_printable() {
        assert_eq!(refusal_text(b"no `f` \"9\""), "no `f` \"9\"");
        let mut garbage = b"malformed: \0\x1b[2J".to_vec();
        garbage.resize(65536, 0xff);
        let why = refusal_text(&garbage);
        assert!(
            why.starts_with("malformed: \\u{0}\\u{1b}[2J\u{fffd}"),
            "{why}"
        );
        assert!(why.ends_with(" … (65536 bytes)"), "{why}");
        assert!(!why.chars().any(char::is_control), "{why}");
        assert!(why.len() < 4 * REFUSAL_TEXT, "{}", why.len());
    }

    #[test]
    fn a_refusal_only_a_faulty_server_gives_is_impossible() {
        let refused = |status, code| {
            let mut impossible = false;
            let fault = reply(status, code, b"why", &mut impossible).err();
            (fault.is_some(), impossible)
        };
        // What a client's own request can cause: a mismatched interface,
        // a descriptor it does not hold; and the transport's limit, a
        // reply too large for a slot.
        for r in [
            Refusal::InterfaceMismatch,
            Refusal::UnknownDescriptor(7),
            Refusal::ReplyTooLarge,
        ] {
            assert_eq!(refused(status::REFUSED, r.code()), (true, false), "{r}");
        }
        for r in [
            Refusal::UnknownFunction(9),
            Refusal::Malformed(WireError::Truncated),
            Refusal::OutOfRange("n"),
            Refusal::Records,
        ] {
            assert_eq!(refused(status::REFUSED, r.code()), (true, true), "{r}");
        }
        // A code no server stub gives, and a status that is none.
        assert_eq!(refused(status::REFUSED, 0x4d8d), (true, true));
        assert_eq!(refused(0x5a5a, 4), (true, true));
    }

    #[test]
    fn a_thread_lets_go_of_the_edges_no_connection_holds() {
        let first = Arc::new(Edge::create("claims-first", 2).unwrap());
        assert_eq!(claimed_slot(&first), 0);
        let gone = Arc::downgrade(&first);
        drop(first);
        // Still kept by this thread's claim until its next claim.
        assert!(gone.upgrade().is_some());
        let second = Arc::new(Edge::create("claims-second", 2).unwrap());
        assert_eq!(claimed_slot(&second), 0);
        assert!(gone.upgrade().is_none(), "the first edge is still mapped");
        assert_eq!(claimed_slot(&second), 0);
        assert_eq!(CLAIMS.with(|c| c.borrow().len()), 1);
    }
}

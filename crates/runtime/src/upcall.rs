//! Upcalls: calls from a server to one of its clients, through a one-entry
//! mailbox in the header of the edge between them.
//!
//! ```text
//!  server (Mailbox)                          client (Listener's thread `upcall:<iface>`)
//!  lock the edge's turn
//!  upcall_seq += 1 (odd), op, args,
//!  upcall_seq += 1 (even), wake ───────────▶ wakes on upcall_seq, reads op and args
//!                                            RECOVER: every registered recoverer, in a
//!                                              RecoveryScope; other ops: their handler
//!  wakes on upcall_ack ◀──────────────────── upcall_status, upcall_result, upcall_ack = seq, wake
//! ```
//!
//! A client incarnation listens on an edge from the moment it first
//! connects to it: it writes `client_epoch + 1` into `upcall_listener`.
//! When the client dies, the supervisor raises `client_epoch` (and wakes
//! the ack futex), so that a server waiting for an answer learns at once
//! that none will come ([`UpcallError::ClientGone`]).
//!
//! Eager recovery ([`recover_eagerly`]) posts [`RECOVER`] to every listening
//! client of a rebooted server at once, and holds every call that does not
//! rebuild descriptors at a [`RecoveryGate`] until all have answered.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use thiserror::Error;

use crate::abi::channel::{liveness, Edge, EdgeHeader};
use crate::client::RecoveryScope;
use crate::futex;
use crate::priority::{self, Priority};
use crate::server::RecoveryGate;

/// Rebuild every descriptor of this server that the client holds; answers
/// the number rebuilt.
pub const RECOVER: u32 = 1;
/// Reserved for the mm service: unmap pages from the client.
pub const UNMAP: u32 = 2;
/// Reserved for the lock service: another component waits for lock
/// `args[0]`, which the client holds by lease; give it back.
pub const LEASE_WANTED: u32 = 3;

/// How an upcall ended, in `upcall_status`.
pub mod status {
    pub const OK: u32 = 0;
    /// The client has no handler for the operation.
    pub const UNHANDLED: u32 = 1;
}

/// How often a server waiting for an answer re-checks that its client lives
/// (the supervisor's wake-up normally tells it at once).
const RECHECK: Duration = Duration::from_millis(10);

/// What a client registers to be told to rebuild its descriptors: a
/// generated client stub.
pub trait Recover: Send + Sync {
    /// Rebuilds every descriptor the stub tracks; returns how many it rebuilt.
    fn recover_all(&self) -> u64;
}

/// A client's handler of one upcall operation: its arguments in, its result out.
pub type Handler = Arc<dyn Fn([u64; 3]) -> u64 + Send + Sync>;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum UpcallError {
    #[error("no edge of interface `{interface}` to client {client}")]
    UnknownEdge { interface: String, client: u32 },
    #[error("the client does not listen for upcalls (it never connected, or it is rebooting)")]
    NotListening,
    #[error("the client incarnation died before it answered")]
    ClientGone,
    #[error("the client did not answer in time")]
    Timeout,
    #[error("the client has no handler for upcall {0}")]
    Unhandled(u32),
}

// ---- client side ----------------------------------------------------------

/// A client's upcall registrations for one used edge, and the thread that
/// serves them (started by the first connection to the edge).
pub(crate) struct Listener {
    edge: Arc<Edge>,
    interface: String,
    /// Taken by the upcall thread (the client component's), if any.
    priority: Option<Priority>,
    recoverers: Mutex<Vec<Weak<dyn Recover>>>,
    handlers: Mutex<HashMap<u32, Handler>>,
    started: AtomicBool,
}

impl Listener {
    pub(crate) fn new(edge: Arc<Edge>, interface: &str, priority: Option<Priority>) -> Self {
        Self {
            edge,
            interface: interface.to_string(),
            priority,
            recoverers: Mutex::default(),
            handlers: Mutex::default(),
            started: AtomicBool::new(false),
        }
    }

    pub(crate) fn edge(&self) -> &Arc<Edge> {
        &self.edge
    }

    pub(crate) fn register_recoverer(&self, r: Weak<dyn Recover>) {
        lock(&self.recoverers).push(r);
    }

    pub(crate) fn on_upcall(&self, op: u32, h: Handler) {
        assert_ne!(op, RECOVER, "RECOVER goes to the registered recoverers");
        lock(&self.handlers).insert(op, h);
    }

    /// Starts listening (once): from now on the server sees this client
    /// incarnation as listening, and upcalls it posts are served.
    pub(crate) fn start(self: &Arc<Self>) -> std::io::Result<()> {
        if self.started.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        let h = self.edge.header();
        // Upcalls posted after the announcement below are newer than `seen`.
        let seen = h.upcall_seq.load(Ordering::SeqCst) & !1;
        h.upcall_listener
            .store(listening_token(h), Ordering::SeqCst);
        let (this, edge) = (Arc::downgrade(self), self.edge.clone());
        let spawned = std::thread::Builder::new()
            .name(format!("upcall:{}", self.interface))
            .stack_size(256 * 1024)
            .spawn(move || listen(&this, &edge, seen));
        if let Err(e) = spawned {
            self.started.store(false, Ordering::SeqCst);
            return Err(e);
        }
        Ok(())
    }

    /// Runs upcall `op`; returns its status and result.
    fn dispatch(&self, op: u32, args: [u64; 3]) -> (u32, u64) {
        if op == RECOVER {
            let recoverers: Vec<Arc<dyn Recover>> = {
                let mut all = lock(&self.recoverers);
                all.retain(|r| r.strong_count() > 0);
                all.iter().filter_map(Weak::upgrade).collect()
            };
            let _recovering = RecoveryScope::enter();
            return (status::OK, recoverers.iter().map(|r| r.recover_all()).sum());
        }
        let handler = lock(&self.handlers).get(&op).cloned();
        match handler {
            Some(h) => (status::OK, h(args)),
            None => {
                tracing::warn!(interface = self.interface, op, "upcall without a handler");
                (status::UNHANDLED, 0)
            }
        }
    }
}

impl Drop for Listener {
    /// Tells the upcall thread to leave: a new even sequence wakes it, and it
    /// finds no listener behind it.
    fn drop(&mut self) {
        if self.started.load(Ordering::SeqCst) {
            let h = self.edge.header();
            h.upcall_seq.fetch_add(2, Ordering::SeqCst);
            futex::wake_all(&h.upcall_seq);
        }
    }
}

/// The value of `upcall_listener` while the current client incarnation listens.
fn listening_token(h: &EdgeHeader) -> u64 {
    h.client_epoch.load(Ordering::SeqCst) + 1
}

/// The upcall thread: waits for posted upcalls and answers each, until its
/// listener is dropped.
fn listen(listener: &Weak<Listener>, edge: &Edge, mut seen: u32) {
    let h = edge.header();
    if let Some(p) = listener.upgrade().and_then(|l| l.priority) {
        if let Err(e) = priority::apply_to_current_thread(p) {
            tracing::warn!("upcall thread priority: {e}");
        }
    }
    loop {
        let seq = h.upcall_seq.load(Ordering::SeqCst);
        if seq == seen || seq & 1 == 1 {
            // Nothing new, or the server is still writing (it wakes us when done).
            futex::wait(&h.upcall_seq, seq, None);
            continue;
        }
        let op = h.upcall_op.load(Ordering::SeqCst);
        let args = [0, 1, 2].map(|i| h.upcall_args[i].load(Ordering::SeqCst));
        if h.upcall_seq.load(Ordering::SeqCst) != seq {
            continue; // overwritten meanwhile by a newer upcall: read that one
        }
        seen = seq;
        let Some(l) = listener.upgrade() else {
            let token = listening_token(h);
            let _ =
                h.upcall_listener
                    .compare_exchange(token, 0, Ordering::SeqCst, Ordering::SeqCst);
            return;
        };
        let (st, result) = l.dispatch(op, args);
        drop(l);
        h.upcall_status.store(st, Ordering::SeqCst);
        h.upcall_result.store(result, Ordering::SeqCst);
        h.upcall_ack.store(seq, Ordering::SeqCst);
        futex::wake_all(&h.upcall_ack);
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

// ---- server side ----------------------------------------------------------

/// The server's end of an edge's upcall mailbox. One upcall at a time per
/// edge: concurrent callers take turns.
pub struct Mailbox {
    edge: Arc<Edge>,
    turn: Mutex<()>,
}

/// An upcall posted and not yet answered; holds the edge's turn.
#[must_use = "an upcall's answer is read with `wait`"]
pub struct Posted<'a> {
    mailbox: &'a Mailbox,
    _turn: MutexGuard<'a, ()>,
    seq: u32,
    op: u32,
    /// `upcall_listener` when posted: the client incarnation asked.
    token: u64,
}

impl Mailbox {
    pub fn new(edge: Arc<Edge>) -> Self {
        Self {
            edge,
            turn: Mutex::new(()),
        }
    }

    /// The edge.
    pub fn edge(&self) -> &Edge {
        &self.edge
    }

    /// The edge's channel slots: one per thread of the client.
    pub fn slot_count(&self) -> u32 {
        self.edge.slot_count()
    }

    /// Whether an incarnation of the client listens for upcalls now.
    pub fn listening(&self) -> bool {
        let h = self.edge.header();
        h.upcall_listener.load(Ordering::SeqCst) == listening_token(h)
    }

    /// Posts upcall `op` and wakes the client's upcall thread; the answer
    /// is read with [`Posted::wait`]. Waits for the turn of an upcall in
    /// progress on this edge.
    pub fn post(&self, op: u32, args: [u64; 3]) -> Result<Posted<'_>, UpcallError> {
        let turn = lock(&self.turn);
        let h = self.edge.header();
        let token = h.upcall_listener.load(Ordering::SeqCst);
        if token != listening_token(h) {
            return Err(UpcallError::NotListening);
        }
        // Odd while writing (a server incarnation that died here left it odd).
        let writing = h.upcall_seq.load(Ordering::SeqCst) | 1;
        h.upcall_seq.store(writing, Ordering::SeqCst);
        h.upcall_op.store(op, Ordering::SeqCst);
        for (word, arg) in h.upcall_args.iter().zip(args) {
            word.store(arg, Ordering::SeqCst);
        }
        let seq = writing.wrapping_add(1);
        h.upcall_seq.store(seq, Ordering::SeqCst);
        futex::wake_all(&h.upcall_seq);
        Ok(Posted {
            mailbox: self,
            _turn: turn,
            seq,
            op,
            token,
        })
    }

    /// Waits until the supervisor has published incarnation `epoch` as the
    /// edge's live server (clients rebuild descriptors for the epoch they
    /// see there); false if `deadline` passes or the server is gone.
    pub fn wait_live(&self, epoch: u64, deadline: Instant) -> bool {
        let h = self.edge.header();
        loop {
            let live = h.liveness.load(Ordering::SeqCst);
            if live == liveness::LIVE && h.epoch.load(Ordering::SeqCst) == epoch {
                return true;
            }
            let now = Instant::now();
            if live == liveness::GONE || now >= deadline {
                return false;
            }
            futex::wait(&h.liveness, live, Some((deadline - now).min(RECHECK)));
        }
    }

    /// Posts upcall `op` and waits at most `timeout` for its result.
    pub fn call(&self, op: u32, args: [u64; 3], timeout: Duration) -> Result<u64, UpcallError> {
        self.post(op, args)?.wait(Instant::now() + timeout)
    }
}

impl Posted<'_> {
    /// Waits until the client answers, dies, or `deadline` passes.
    pub fn wait(self, deadline: Instant) -> Result<u64, UpcallError> {
        let h = self.mailbox.edge.header();
        loop {
            let ack = h.upcall_ack.load(Ordering::SeqCst);
            if ack == self.seq {
                return match h.upcall_status.load(Ordering::SeqCst) {
                    status::OK => Ok(h.upcall_result.load(Ordering::SeqCst)),
                    _ => Err(UpcallError::Unhandled(self.op)),
                };
            }
            if listening_token(h) != self.token
                || h.upcall_listener.load(Ordering::SeqCst) != self.token
            {
                return Err(UpcallError::ClientGone);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(UpcallError::Timeout);
            }
            futex::wait(&h.upcall_ack, ack, Some((deadline - now).min(RECHECK)));
        }
    }
}

/// What an eager recovery did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EagerReport {
    /// Clients that answered.
    pub clients: u32,
    /// Descriptors they rebuilt.
    pub descriptors: u64,
    /// Clients that died, or did not answer in time.
    pub failed: u32,
    pub elapsed: Duration,
}

/// Eager recovery of server incarnation `epoch`: once each edge shows it
/// live, posts [`RECOVER`] to every listening client at once, waits at most
/// `timeout` in all for their answers, then opens `gate` (which the caller
/// closed before serving, so that until now only calls that rebuild
/// descriptors were served).
pub fn recover_eagerly<'a>(
    gate: &RecoveryGate,
    mailboxes: impl IntoIterator<Item = &'a Mailbox>,
    epoch: u64,
    timeout: Duration,
) -> EagerReport {
    let start = Instant::now();
    let deadline = start + timeout;
    let mut report = EagerReport::default();
    let posted: Vec<Posted<'_>> = mailboxes
        .into_iter()
        .filter(|m| {
            let live = m.wait_live(epoch, deadline);
            if !live {
                tracing::warn!("eager recovery: epoch {epoch} was not published in time");
                report.failed += 1;
            }
            live
        })
        .filter_map(|m| m.post(RECOVER, [0; 3]).ok())
        .collect();
    for p in posted {
        match p.wait(deadline) {
            Ok(n) => {
                report.clients += 1;
                report.descriptors += n;
            }
            Err(e) => {
                tracing::warn!("eager recovery: {e}");
                report.failed += 1;
            }
        }
    }
    gate.open();
    report.elapsed = start.elapsed();
    report
}

//! Checkpoint recovery, server side: the request log and its replay
//! (`recovery = "checkpoint"`). Checkpointing with message logging, of
//! which RMK's custom recovery for Apache (log the request, restore a
//! checkpoint, run the request again; `seeds/001_68a97066b3f6a3ed.txt`
//! §6) is the seed: the supervisor checkpoints the server at safe points
//! (`kintsugi-checkpoint`, TAC) and cuts the log each time; after a crash
//! or a hang it restores the last checkpoint and asks for a replay, which
//! runs every logged request again, in log order, before anything new.
//!
//! Replay is exact only if the order of the log is the order the server
//! ran its requests in, and each request's effect depends only on the
//! server's state and the request: so a checkpoint-recovered server runs
//! one request at a time (its workers take turns, [`Journal::turn`]), and
//! the README says what its code must not do (read clocks or random
//! numbers, keep state outside its process, block waiting for another
//! client). A replayed request whose reply differs from the logged one is
//! counted and logged as a divergence.
//!
//! Each entry is logged before its request runs and gets its reply after,
//! so a crash at any instant leaves either an entry with its reply, one
//! without (the request was running: replay runs it and records the
//! reply), or no entry (the request is still posted in its slot, and is
//! served as a new one). A reply reaches the client that waits for it
//! exactly once: the slot's call number and client incarnation are logged
//! with the request, and replay hands a reply over only while the slot
//! still holds that very call.
//!
//! The calls a request makes to other servers are recorded in its entry
//! and answered from there on replay ([`calls`]).
//!
//! A call of a function the interface marks `readonly` is not logged
//! (`server.rs`): it changes nothing a replay must rebuild, so neither its
//! request nor its reply is copied into the log, and replay skips it. It
//! still runs in turn, so never before a replay has ended; cut short by a
//! crash, it is still posted in its slot and the next incarnation serves
//! it as a new one (its client could not have seen a reply).

mod calls;

pub(crate) use calls::{outgoing, refused, replayed_epoch, Outcome, Outgoing, Recorder};

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Instant;

use crate::abi::channel::{state, Edge, SlotHeader, BUFFER_SIZE};
use crate::abi::journal::{entry, padded, JournalRegion, ENTRY_HEAD};
use crate::futex;
use crate::server::{dispatch_raw, publish, Reply};
use crate::stub::{Caller, Service};

/// A request log too full for one more request and its reply.
#[derive(Debug)]
pub(crate) struct Full;

/// One provided edge, as replay needs it.
pub(crate) struct Served {
    pub edge: Arc<Edge>,
    pub service: Arc<dyn Service>,
    /// The client component's id.
    pub client: u32,
}

/// The request log of this incarnation's process.
pub(crate) struct Journal {
    log: Arc<JournalRegion>,
    /// One request at a time, in log order.
    turn: Mutex<()>,
    /// Every provided edge, in boot order: set once the services exist,
    /// before any worker serves.
    served: OnceLock<Vec<Served>>,
}

/// A logged request, read back and checked; its bytes, and its logged
/// reply's, are in the replay's [`Buffers`].
struct Entry {
    edge: usize,
    slot: u32,
    func: u32,
    seq: u64,
    client_epoch: u64,
    request_len: usize,
    /// The reply logged, if it replied.
    reply: Option<Replied>,
    /// The calls it made to other servers, and whether the log ran out of
    /// room for them.
    calls: Vec<calls::Recorded>,
    calls_cut: bool,
    /// Where the entry ends, once replied.
    end: usize,
}

/// A logged reply's status, code and length.
#[derive(Debug, Clone, Copy)]
struct Replied {
    status: u32,
    code: u32,
    len: usize,
}

/// What running a logged request again gave: its reply's status, code
/// and length (the bytes are in the replay's response buffer), where its
/// entry ends, and how its calls to other servers were answered.
struct RanAgain {
    status: u32,
    code: u32,
    len: usize,
    end: usize,
    answered: calls::Answered,
}

/// A replay's buffers, reused from entry to entry (a replay runs
/// thousands): the request read back, its logged reply, and the reply it
/// gives again.
struct Buffers {
    request: Vec<u8>,
    logged: Vec<u8>,
    response: Vec<u8>,
}

impl Buffers {
    fn new() -> Self {
        Self {
            request: vec![0; BUFFER_SIZE],
            logged: vec![0; BUFFER_SIZE],
            response: vec![0; BUFFER_SIZE],
        }
    }
}

impl Journal {
    pub fn new(log: JournalRegion) -> Self {
        Self {
            log: Arc::new(log),
            turn: Mutex::new(()),
            served: OnceLock::new(),
        }
    }

    pub fn set_served(&self, served: Vec<Served>) {
        let _ = self.served.set(served);
    }

    /// The log's shared region (the supervisor's side of it, for tests
    /// that play the supervisor).
    pub fn log(&self) -> &JournalRegion {
        &self.log
    }

    pub fn replay_pending(&self) -> bool {
        self.log.replay_pending()
    }

    /// Waits for this worker's turn to run a request; the first turn after
    /// a restore replays the log.
    pub fn turn(&self) -> MutexGuard<'_, ()> {
        let turn = self.turn.lock().unwrap_or_else(|e| e.into_inner());
        if self.replay_pending() {
            self.replay();
        }
        turn
    }

    /// Logs the request that slot `slot` of provided edge `edge` holds,
    /// before it runs; returns where its entry is (None: the log is
    /// closed, the request runs unlogged). Called in turn.
    pub fn accept(
        &self,
        edge: u32,
        slot: u32,
        s: &SlotHeader,
        func: u32,
        request: &[u8],
    ) -> Result<Option<usize>, Full> {
        if self.log.closed() {
            return Ok(None);
        }
        let h = self.log.header();
        let at = h.end.load(Ordering::Acquire) as usize;
        let reply_at = at + ENTRY_HEAD + padded(request.len());
        // Room for the largest reply, so that the reply always fits.
        if reply_at + BUFFER_SIZE > self.log.capacity() {
            h.wanted.store(1, Ordering::SeqCst);
            return Err(Full);
        }
        if 2 * reply_at > self.log.capacity() {
            h.wanted.store(1, Ordering::SeqCst);
        }
        self.log.write(at + ENTRY_HEAD, request);
        let e = self.log.head(at).ok_or(Full)?;
        e.edge.store(edge, Ordering::Relaxed);
        e.slot.store(slot, Ordering::Relaxed);
        e.func.store(func, Ordering::Relaxed);
        e.seq
            .store(s.seq.load(Ordering::Relaxed), Ordering::Relaxed);
        e.client_epoch
            .store(s.client_epoch.load(Ordering::Relaxed), Ordering::Relaxed);
        e.request_len.store(request.len() as u32, Ordering::Relaxed);
        e.response_len.store(0, Ordering::Relaxed);
        e.calls_len.store(0, Ordering::Relaxed);
        e.calls_cut.store(0, Ordering::Relaxed);
        e.state.store(entry::ACCEPTED, Ordering::Release);
        // Plain stores, not read-modify-writes or fences: only the worker
        // whose turn it is writes the header, and the supervisor reads it
        // with this process frozen or dead, when every store is visible;
        // `Release` keeps the entry's bytes before the counts.
        h.end.store(reply_at as u64, Ordering::Release);
        h.count
            .store(h.count.load(Ordering::Relaxed) + 1, Ordering::Release);
        h.logged
            .store(h.logged.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
        self.count_served();
        Ok(Some(at))
    }

    /// Counts a request served in turn, before it runs (`accept` counts
    /// the ones it logs; a `readonly` call is counted here alone). A plain
    /// store, as in `accept`.
    pub fn count_served(&self) {
        let served = &self.log.header().served;
        served.store(served.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
    }

    /// Runs `f`, the request logged at `at`, recording the calls it makes.
    pub fn run<R>(&self, at: usize, f: impl FnOnce() -> R) -> R {
        calls::recording(&self.log, at, f)
    }

    /// Records the reply (`status`, `code`, `bytes`) of the entry at `at`,
    /// the last one; returns where the entry ends. Called in turn.
    pub fn replied(&self, at: usize, status: u32, code: u32, bytes: &[u8]) -> usize {
        let Some(e) = self.log.head(at) else {
            return at;
        };
        let reply_at = at
            + ENTRY_HEAD
            + padded(e.request_len.load(Ordering::Relaxed) as usize)
            + e.calls_len.load(Ordering::Acquire) as usize;
        self.log.write(reply_at, bytes);
        e.response_len.store(bytes.len() as u32, Ordering::Relaxed);
        e.status.store(status, Ordering::Relaxed);
        e.code.store(code, Ordering::Relaxed);
        e.state.store(entry::REPLIED, Ordering::Release);
        let end = reply_at + padded(bytes.len());
        // In turn, as in `accept`.
        self.log.header().end.store(end as u64, Ordering::Release);
        end
    }

    /// Sleeps until the supervisor cuts the log (after a checkpoint), or
    /// for a while: called outside any turn or call mark, so that the
    /// checkpoint can be taken.
    pub fn wait_for_room(&self) {
        let h = self.log.header();
        let cuts = h.cuts.load(Ordering::SeqCst);
        if h.wanted.load(Ordering::SeqCst) != 0 && !self.log.closed() {
            futex::wait(&h.cuts, cuts, Some(std::time::Duration::from_millis(10)));
        }
    }

    /// Runs every logged request again, in order (see the module doc).
    fn replay(&self) {
        let started = Instant::now();
        let h = self.log.header();
        let Some(served) = self.served.get() else {
            return; // no service yet: nothing was logged by this process
        };
        let count = h.count.load(Ordering::SeqCst);
        let (mut at, mut done) = (0usize, 0u64);
        let mut bufs = Buffers::new();
        let (mut calls_answered, mut diverged) = (0u64, 0u64);
        while done < count {
            let last = done + 1 == count;
            let Some(mut e) = self.entry(at, last, served, &mut bufs) else {
                tracing::error!(
                    entry = done,
                    "request log: entry {done} of {count} is corrupt; replay stops there"
                );
                h.count.store(done, Ordering::SeqCst);
                break;
            };
            let srv = &served[e.edge];
            let request = &bufs.request[..e.request_len];
            let ran = self.run_again(at, &mut e, srv, request, &mut bufs.response);
            let reply = Reply {
                status: ran.status,
                code: ran.code,
                bytes: &bufs.response[..ran.len],
            };
            calls_answered += u64::from(ran.answered.calls);
            diverged += u64::from(ran.answered.diverged);
            let logged = e.reply.map(|l| Reply {
                status: l.status,
                code: l.code,
                bytes: &bufs.logged[..l.len],
            });
            if let Some(logged) = logged.filter(|logged| *logged != reply) {
                diverged += 1;
                tracing::warn!(
                    client = srv.client,
                    func = e.func,
                    entry = done,
                    logged_status = logged.status,
                    "replay diverged: the request's reply differs from the logged one"
                );
            }
            if self.deliver(srv, &e, &reply) {
                h.delivered.fetch_add(1, Ordering::Relaxed);
            }
            at = ran.end;
            done += 1;
        }
        h.end.store(at as u64, Ordering::SeqCst);
        h.replays.fetch_add(1, Ordering::Relaxed);
        h.replayed.fetch_add(done, Ordering::Relaxed);
        h.last_replay_entries.store(done, Ordering::Relaxed);
        h.last_replay_calls.store(calls_answered, Ordering::Relaxed);
        h.last_replay_diverged.store(diverged, Ordering::Relaxed);
        h.divergences.fetch_add(diverged, Ordering::Relaxed);
        h.last_replay_ns
            .store(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
        h.replay.store(0, Ordering::SeqCst);
        // The supervisor waits for it to report the recovery.
        futex::wake_all(&h.replay);
    }

    /// Runs the request logged at `at` (whose bytes are `request`) again;
    /// returns its reply's status, code and length (its bytes in
    /// `response`) and where its entry ends. A request that had replied
    /// gets its calls to other servers answered from the log (a call the
    /// log does not hold is a divergence, counted); the last one, which
    /// was running, runs in full and is recorded anew.
    fn run_again(
        &self,
        at: usize,
        e: &mut Entry,
        srv: &Served,
        request: &[u8],
        response: &mut [u8],
    ) -> RanAgain {
        let caller = Caller {
            component: srv.client,
            slot: e.slot,
        };
        let service = srv.service.as_ref();
        match e.reply {
            Some(_) => {
                let run = || dispatch_raw(service, &caller, e.func, request, response);
                let ((status, code, len), answered) =
                    calls::replaying(std::mem::take(&mut e.calls), e.calls_cut, run);
                RanAgain {
                    status,
                    code,
                    len,
                    end: e.end,
                    answered,
                }
            }
            None => {
                calls::clear(&self.log, at);
                let (status, code, n) = self.run(at, || {
                    dispatch_raw(service, &caller, e.func, request, response)
                });
                RanAgain {
                    status,
                    code,
                    len: n,
                    end: self.replied(at, status, code, &response[..n]),
                    answered: calls::Answered::default(),
                }
            }
        }
    }

    /// Hands `reply` to the call that `e` logged, if its slot still holds
    /// that very call: the crash came before the reply was posted, or its
    /// client could not decode the reply and awaits this replay's
    /// ([`state::REPLAY`], claimed first: the client may give up on it).
    fn deliver(&self, srv: &Served, e: &Entry, reply: &Reply<'_>) -> bool {
        let s = srv.edge.slot(e.slot);
        let same = s.seq.load(Ordering::SeqCst) == e.seq
            && s.client_epoch.load(Ordering::SeqCst) == e.client_epoch;
        let waiting = same
            && (s.state.load(Ordering::SeqCst) == state::REQUEST
                || s.state
                    .compare_exchange(
                        state::REPLAY,
                        state::REQUEST,
                        Ordering::SeqCst,
                        Ordering::SeqCst,
                    )
                    .is_ok());
        if waiting {
            publish(&srv.edge, e.slot, reply);
        }
        waiting
    }

    /// The entry at `at`, checked: a state it may have (no reply only for
    /// the last), an edge and slot that exist, lengths that fit; its
    /// request and logged reply read into `bufs`.
    fn entry(&self, at: usize, last: bool, served: &[Served], bufs: &mut Buffers) -> Option<Entry> {
        let head = self.log.head(at)?;
        let state = head.state.load(Ordering::Acquire);
        let replied = match state {
            entry::REPLIED => true,
            entry::ACCEPTED if last => false,
            _ => return None,
        };
        let edge = head.edge.load(Ordering::Relaxed) as usize;
        let slot = head.slot.load(Ordering::Relaxed);
        if edge >= served.len() || slot >= served[edge].edge.slot_count() {
            return None;
        }
        let request_len = head.request_len.load(Ordering::Relaxed) as usize;
        let response_len = head.response_len.load(Ordering::Relaxed) as usize;
        let calls_len = head.calls_len.load(Ordering::Acquire) as usize;
        if request_len > BUFFER_SIZE
            || response_len > BUFFER_SIZE
            || calls_len > self.log.capacity()
        {
            return None;
        }
        let reply_at = at + ENTRY_HEAD + padded(request_len) + calls_len;
        if !self
            .log
            .read(at + ENTRY_HEAD, &mut bufs.request[..request_len])
        {
            return None;
        }
        let calls = match replied {
            true => calls::read(&self.log, at, calls_len)?,
            false => Vec::new(), // it runs again in full
        };
        let reply = match replied {
            false => None,
            true => {
                if !self.log.read(reply_at, &mut bufs.logged[..response_len]) {
                    return None;
                }
                Some(Replied {
                    status: head.status.load(Ordering::Relaxed),
                    code: head.code.load(Ordering::Relaxed),
                    len: response_len,
                })
            }
        };
        Some(Entry {
            edge,
            slot,
            func: head.func.load(Ordering::Relaxed),
            seq: head.seq.load(Ordering::Relaxed),
            client_epoch: head.client_epoch.load(Ordering::Relaxed),
            request_len,
            reply,
            calls,
            calls_cut: head.calls_cut.load(Ordering::Relaxed) != 0,
            end: reply_at + padded(response_len),
        })
    }
}

//! Calls a checkpoint-recovered server makes to other servers while it
//! runs a logged request: their outcomes are recorded in the request's log
//! entry, and a replay answers them from there instead of making them
//! again (checkpointing with message logging: the results of what the
//! server does not control are logged, so that its replay is
//! deterministic; RMK §6 and `seeds/001_68a97066b3f6a3ed.txt` log the
//! requests, this logs what they asked of others too).
//!
//! So a server that is a client of others stays consistent with them
//! after a restore: the servers it called were not rolled back and keep
//! what it did to them (a file it wrote, a descriptor it opened), and the
//! replay rebuilds its own side of it (its client stubs' descriptor
//! tables, the offsets they track) from the recorded replies, without
//! doing anything twice. The server epochs a stub reads during a replay
//! are the recorded ones too, so its decisions to rebuild a descriptor
//! are the ones it took; once the replay is done, a descriptor of a
//! server that rebooted meanwhile is rebuilt by the stub as usual (C3).
//!
//! What a replay cannot answer from the log, it makes again: the calls of
//! the request that was running when the server died (its entry has no
//! reply, and it runs again in full, its calls included), and the calls
//! after a divergence (a call the log does not hold at that point:
//! counted and logged as a divergence). A request's calls should
//! therefore be idempotent as a whole (write at an explicit offset, not
//! append). A call that finds no room in the log is refused without being
//! made (and refused again on replay).

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::abi::channel::BUFFER_SIZE;
use crate::abi::journal::{call, padded, JournalRegion, CALL_HEAD, ENTRY_HEAD};
use crate::stub::Fault;

/// A recorded call, read back and checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Recorded {
    pub conn: u64,
    pub func: u32,
    pub epoch: u64,
    pub outcome: Outcome,
}

/// What a call came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Outcome {
    Reply {
        status: u32,
        code: u32,
        bytes: Vec<u8>,
    },
    Fault(Fault),
}

/// A replayed request's calls, answered in order.
struct Replay {
    calls: VecDeque<Recorded>,
    /// The log had no room for a call past these: refuse the rest.
    cut: bool,
    /// Calls the log did not hold; made for real.
    diverged: u32,
    /// Calls answered from `calls`.
    answered: u32,
}

// What the calling thread is doing, for the calls it makes: nothing
// (`ACTIVE` false), running the logged request whose entry is at
// `RECORDING` in the log `LOG` holds, or replaying one (`REPLAY`). In
// cells of their own, not one enum: a logged request sets two words
// instead of moving a replay's state in and out of a `RefCell`.
thread_local! {
    /// Whether a request is being logged or replayed: a call outside any
    /// (every call of every other component) tests this one word.
    static ACTIVE: Cell<bool> = const { Cell::new(false) };
    /// The entry of the logged request running.
    static RECORDING: Cell<Option<usize>> = const { Cell::new(None) };
    static REPLAY: RefCell<Option<Replay>> = const { RefCell::new(None) };
    /// The log a recorded request's calls go to: set by the thread's first
    /// logged request and kept, so that a request costs no reference
    /// count of it (two atomic read-modify-writes).
    static LOG: RefCell<Option<Arc<JournalRegion>>> = const { RefCell::new(None) };
}

/// Runs `f`, the logged request whose entry is at `at`, recording the
/// calls it makes.
pub(crate) fn recording<R>(log: &Arc<JournalRegion>, at: usize, f: impl FnOnce() -> R) -> R {
    LOG.with(|kept| {
        let mut kept = kept.borrow_mut();
        if !kept.as_ref().is_some_and(|k| Arc::ptr_eq(k, log)) {
            *kept = Some(log.clone());
        }
    });
    RECORDING.set(Some(at));
    ACTIVE.set(true);
    let r = f();
    ACTIVE.set(false);
    RECORDING.set(None);
    r
}

/// How a replayed request's calls went.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Answered {
    /// Answered from the log.
    pub calls: u32,
    /// Not held by the log at that point (made for real), or held but
    /// never made.
    pub diverged: u32,
}

/// Runs `f`, a replayed request, answering its calls from `calls`.
pub(crate) fn replaying<R>(
    calls: Vec<Recorded>,
    cut: bool,
    f: impl FnOnce() -> R,
) -> (R, Answered) {
    let replay = Replay {
        calls: calls.into(),
        cut,
        diverged: 0,
        answered: 0,
    };
    REPLAY.with(|c| *c.borrow_mut() = Some(replay));
    ACTIVE.set(true);
    let r = f();
    ACTIVE.set(false);
    let answered = match REPLAY.with(|c| c.borrow_mut().take()) {
        Some(Replay {
            calls,
            diverged,
            answered,
            ..
        }) => Answered {
            calls: answered,
            diverged: diverged + calls.len() as u32,
        },
        None => Answered::default(),
    };
    (r, answered)
}

/// What a call about to be made is to do.
pub(crate) enum Outgoing {
    /// No request is being logged or replayed: make it.
    Direct,
    /// Make it, and record its outcome.
    Record(Recorder),
    /// Do not make it: here is its outcome.
    Replayed(Outcome),
    /// Do not make it: the log has no room for its outcome.
    Refused,
}

/// The fault of a call refused for want of room in the log.
pub(crate) fn refused() -> Fault {
    Fault::Refused("the request log has no room for this call's outcome: not made".into())
}

/// What the call of `func` on connection `conn`, whose server is in
/// `epoch` now, is to do.
pub(crate) fn outgoing(conn: u64, func: u32, epoch: impl FnOnce() -> u64) -> Outgoing {
    if !ACTIVE.get() {
        return Outgoing::Direct;
    }
    if let Some(at) = RECORDING.get() {
        return match LOG.with_borrow(|log| {
            let log = log.as_ref()?;
            Some((log.clone(), room(log, at)?))
        }) {
            Some((log, pos)) => Outgoing::Record(Recorder {
                log,
                at,
                pos,
                head: Recorded {
                    conn,
                    func,
                    epoch: epoch(),
                    outcome: Outcome::Fault(Fault::Interrupted),
                },
                staged: Cell::new(None),
            }),
            None => Outgoing::Refused,
        };
    }
    REPLAY.with(|c| match c.borrow_mut().as_mut() {
        None => Outgoing::Direct,
        Some(Replay {
            calls,
            cut,
            diverged,
            answered,
        }) => match calls.front() {
            Some(next) if next.conn == conn && next.func == func => {
                *answered += 1;
                Outgoing::Replayed(calls.pop_front().expect("front exists").outcome)
            }
            None if *cut => Outgoing::Refused,
            _ => {
                // Not the call the log holds next: from here on the
                // request runs for real.
                *diverged += 1 + calls.len() as u32;
                calls.clear();
                *cut = false;
                tracing::warn!(
                    func,
                    "replay diverged: the request makes a call its log does not hold; made"
                );
                Outgoing::Direct
            }
        },
    })
}

/// The server epoch a client stub should see on connection `conn` now:
/// during a replay, the one recorded with the next call on it.
pub(crate) fn replayed_epoch(conn: u64) -> Option<u64> {
    if !ACTIVE.get() {
        return None;
    }
    REPLAY.with(|c| {
        let c = c.borrow();
        let next = c.as_ref()?.calls.front()?;
        (next.conn == conn).then_some(next.epoch)
    })
}

/// Records one call's outcome in the entry being logged.
pub(crate) struct Recorder {
    log: Arc<JournalRegion>,
    /// The entry's offset, and where this call's record goes.
    at: usize,
    pos: usize,
    head: Recorded,
    /// The reply written at `pos` (status, code, length), not yet counted.
    staged: Cell<Option<(u32, u32, usize)>>,
}

impl Recorder {
    /// Writes the reply the call got; counted by [`Recorder::finish`].
    pub fn stage(&self, status: u32, code: u32, bytes: &[u8]) {
        self.log.write(self.pos + CALL_HEAD, bytes);
        self.staged.set(Some((status, code, bytes.len())));
    }

    /// Records the call: its staged reply, or `fault` if it failed (a
    /// reply that did not decode, a server that died).
    pub fn finish(self, fault: Option<&Fault>) {
        let (kind, status, code, len) = match (fault, self.staged.get()) {
            (None, Some((status, code, len))) => (call::REPLY, status, code, len),
            (fault, _) => {
                let fault = fault.cloned().unwrap_or(Fault::Interrupted);
                let json = fault_bytes(&fault);
                self.log.write(self.pos + CALL_HEAD, &json);
                (call::FAULT, 0, 0, json.len())
            }
        };
        let Some(h) = self.log.call_head(self.pos) else {
            return;
        };
        h.func.store(self.head.func, Ordering::Relaxed);
        h.conn.store(self.head.conn, Ordering::Relaxed);
        h.epoch.store(self.head.epoch, Ordering::Relaxed);
        h.status.store(status, Ordering::Relaxed);
        h.code.store(code, Ordering::Relaxed);
        h.len.store(len as u32, Ordering::Relaxed);
        h.kind.store(kind, Ordering::Relaxed);
        if let Some(e) = self.log.head(self.at) {
            let used = self.pos + CALL_HEAD + padded(len) - calls_start(&self.log, self.at);
            e.calls_len.store(used as u32, Ordering::Release);
        }
    }
}

/// A fault as recorded: JSON, at most a reply buffer long.
fn fault_bytes(fault: &Fault) -> Vec<u8> {
    let json = serde_json::to_vec(fault).unwrap_or_default();
    match json.len() <= BUFFER_SIZE {
        true => json,
        false => serde_json::to_vec(&Fault::Refused("(reason too long to log)".into()))
            .unwrap_or_default(),
    }
}

/// Where the calls of the entry at `at` begin.
fn calls_start(log: &JournalRegion, at: usize) -> usize {
    let request_len = log
        .head(at)
        .map_or(0, |e| e.request_len.load(Ordering::Relaxed) as usize);
    at + ENTRY_HEAD + padded(request_len)
}

/// Where the next call of the entry at `at` is recorded, if the log has
/// room for its largest outcome and still for the request's reply; else
/// marks the entry cut and asks for a checkpoint.
fn room(log: &JournalRegion, at: usize) -> Option<usize> {
    let e = log.head(at)?;
    if e.calls_cut.load(Ordering::Relaxed) != 0 {
        return None;
    }
    let pos = calls_start(log, at) + e.calls_len.load(Ordering::Relaxed) as usize;
    if pos + CALL_HEAD + 2 * BUFFER_SIZE <= log.capacity() {
        return Some(pos);
    }
    e.calls_cut.store(1, Ordering::Relaxed);
    log.header().wanted.store(1, Ordering::SeqCst);
    None
}

/// The calls recorded in the entry at `at` (its calls are `len` bytes),
/// checked; None if any is malformed.
pub(crate) fn read(log: &JournalRegion, at: usize, len: usize) -> Option<Vec<Recorded>> {
    let start = calls_start(log, at);
    let end = start.checked_add(len)?;
    let (mut pos, mut out) = (start, Vec::new());
    while pos < end {
        let h = log.call_head(pos)?;
        let n = h.len.load(Ordering::Relaxed) as usize;
        if n > BUFFER_SIZE || pos + CALL_HEAD + padded(n) > end {
            return None;
        }
        let mut bytes = vec![0u8; n];
        if !log.read(pos + CALL_HEAD, &mut bytes) {
            return None;
        }
        let outcome = match h.kind.load(Ordering::Relaxed) {
            call::REPLY => Outcome::Reply {
                status: h.status.load(Ordering::Relaxed),
                code: h.code.load(Ordering::Relaxed),
                bytes,
            },
            call::FAULT => Outcome::Fault(serde_json::from_slice(&bytes).ok()?),
            _ => return None,
        };
        out.push(Recorded {
            conn: h.conn.load(Ordering::Relaxed),
            func: h.func.load(Ordering::Relaxed),
            epoch: h.epoch.load(Ordering::Relaxed),
            outcome,
        });
        pos += CALL_HEAD + padded(n);
    }
    Some(out)
}

/// Forgets the calls recorded in the entry at `at` (it runs again in
/// full).
pub(crate) fn clear(log: &JournalRegion, at: usize) {
    if let Some(e) = log.head(at) {
        e.calls_len.store(0, Ordering::Relaxed);
        e.calls_cut.store(0, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::abi::channel::status;
    use crate::abi::journal::HEADER_SIZE;

    /// A log with one entry at 0 whose request is 5 bytes.
    fn log(bytes: usize) -> Arc<JournalRegion> {
        let log = JournalRegion::create("calls-test", bytes).unwrap();
        let e = log.head(0).unwrap();
        e.request_len.store(5, Ordering::Relaxed);
        Arc::new(log)
    }

    /// Makes a call of `func` on connection 7 as a client stub would:
    /// records `reply` (or `fault`) in record mode.
    fn call(func: u32, outcome: Result<&[u8], Fault>) -> Outgoing {
        let out = outgoing(7, func, || 5);
        if let Outgoing::Record(r) = out {
            match &outcome {
                Ok(bytes) => {
                    r.stage(status::OK, 0, bytes);
                    r.finish(None);
                }
                Err(fault) => r.finish(Some(fault)),
            }
            return Outgoing::Direct;
        }
        out
    }

    fn reply_bytes(out: Outgoing) -> Vec<u8> {
        match out {
            Outgoing::Replayed(Outcome::Reply { bytes, .. }) => bytes,
            _ => panic!("not a replayed reply"),
        }
    }

    #[test]
    fn recorded_calls_are_read_back_and_answer_the_replay_in_order() {
        let log = log(1 << 20);
        let lost = Fault::Lost("ramfs".into());
        recording(&log, 0, || {
            call(3, Ok(b"hello"));
            call(4, Err(lost.clone()));
        });
        let len = log.head(0).unwrap().calls_len.load(Ordering::Relaxed) as usize;
        let calls = read(&log, 0, len).unwrap();
        assert_eq!(calls.len(), 2);
        assert_eq!((calls[0].conn, calls[0].func, calls[0].epoch), (7, 3, 5));
        assert_eq!(calls[1].outcome, Outcome::Fault(lost.clone()));

        let (_, answered) = replaying(calls, false, || {
            assert_eq!(replayed_epoch(7), Some(5), "the recorded epoch");
            assert_eq!(replayed_epoch(8), None, "another connection's own");
            assert_eq!(reply_bytes(outgoing(7, 3, || 99)), b"hello");
            assert!(matches!(
                outgoing(7, 4, || 99),
                Outgoing::Replayed(Outcome::Fault(f)) if f == lost
            ));
            // One more than the log holds: a divergence, made for real.
            assert!(matches!(outgoing(7, 9, || 99), Outgoing::Direct));
        });
        assert_eq!((answered.calls, answered.diverged), (2, 1));
        assert!(
            matches!(outgoing(7, 3, || 0), Outgoing::Direct),
            "no context after"
        );
    }

    #[test]
    fn a_call_the_replay_does_not_make_is_a_divergence() {
        let log = log(1 << 20);
        recording(&log, 0, || {
            call(3, Ok(b"a"));
            call(3, Ok(b"b"));
        });
        let len = log.head(0).unwrap().calls_len.load(Ordering::Relaxed) as usize;
        let calls = read(&log, 0, len).unwrap();
        let (_, answered) = replaying(calls, false, || {
            assert_eq!(reply_bytes(outgoing(7, 3, || 0)), b"a");
        });
        assert_eq!((answered.calls, answered.diverged), (1, 1));
    }

    #[test]
    fn a_call_without_room_is_refused_then_and_on_replay() {
        // Room for the request but not for a call's largest reply and the
        // request's own.
        let log = log(HEADER_SIZE + BUFFER_SIZE + 4096);
        recording(&log, 0, || {
            assert!(matches!(call(3, Ok(b"x")), Outgoing::Refused));
            assert!(matches!(call(3, Ok(b"x")), Outgoing::Refused));
        });
        let e = log.head(0).unwrap();
        assert_eq!(e.calls_cut.load(Ordering::Relaxed), 1);
        assert_eq!(e.calls_len.load(Ordering::Relaxed), 0);
        assert_eq!(
            log.header().wanted.load(Ordering::Relaxed),
            1,
            "asks for a cut"
        );
        let (_, answered) = replaying(Vec::new(), true, || {
            assert!(matches!(outgoing(7, 3, || 0), Outgoing::Refused));
        });
        assert_eq!(answered.diverged, 0);
    }

    #[test]
    fn a_malformed_record_is_refused_whole() {
        let log = log(1 << 20);
        recording(&log, 0, || {
            call(3, Ok(b"hello"));
        });
        let len = log.head(0).unwrap().calls_len.load(Ordering::Relaxed) as usize;
        let at = calls_start(&log, 0);
        log.call_head(at).unwrap().kind.store(77, Ordering::Relaxed);
        assert_eq!(read(&log, 0, len), None, "an unknown kind");
        log.call_head(at)
            .unwrap()
            .kind
            .store(call::REPLY, Ordering::Relaxed);
        log.call_head(at)
            .unwrap()
            .len
            .store(1 << 30, Ordering::Relaxed);
        assert_eq!(read(&log, 0, len), None, "a length past the entry");
        assert_eq!(read(&log, 0, len + 3), None, "a record cut short");
    }
}

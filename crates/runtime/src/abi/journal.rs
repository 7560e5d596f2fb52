//! The request log of a checkpoint-recovered server (`recovery =
//! "checkpoint"`): one memfd region that the supervisor creates once and
//! every incarnation maps, so it outlives them all and is never rolled
//! back by a restore (checkpoints capture private memory only).
//!
//! The log is a header and entries laid end to end, each an [`EntryHead`]
//! followed by the request's bytes, the calls the request made to other
//! servers (each a [`CallHead`] and its outcome's bytes) and, once it
//! ran, the reply's bytes, each padded to 8 bytes. The server appends (one request at a time: a
//! checkpoint-recovered server runs its requests in log order, see
//! `crate::journal`); the supervisor cuts the log after each checkpoint,
//! with the server frozen at a safe point, and asks for a replay after a
//! restore. Nothing here trusts the entries: a faulty incarnation may have
//! written anything into them, so they are read through volatile copies
//! and checked against the region's bounds before use.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use crate::abi::shm::{Region, SharedPod};
use crate::futex;

const MAGIC: u64 = u64::from_le_bytes(*b"ksgjrnl2");
/// Bytes before the first entry.
pub const HEADER_SIZE: usize = 4096;
/// Bytes of an entry's head.
pub const ENTRY_HEAD: usize = std::mem::size_of::<EntryHead>();

/// Bytes of a recorded call's head.
pub const CALL_HEAD: usize = std::mem::size_of::<CallHead>();

/// Entry states.
pub mod entry {
    /// Logged before it ran; no reply recorded.
    pub const ACCEPTED: u32 = 1;
    /// Its reply follows the request.
    pub const REPLIED: u32 = 2;
}

#[repr(C)]
pub struct JournalHeader {
    magic: AtomicU64,
    /// Entries since the last cut.
    pub count: AtomicU64,
    /// Bytes those entries fill after the header.
    pub end: AtomicU64,
    /// Raised at each cut; a futex for a server waiting for room.
    pub cuts: AtomicU32,
    /// 1 from a restore until the server has replayed the log.
    pub replay: AtomicU32,
    /// 1 while the log is more than half full: the supervisor checkpoints
    /// (and so cuts) early.
    pub wanted: AtomicU32,
    /// 1 once the system stops: no checkpoint will cut the log again, so
    /// requests run unlogged (nothing will be recovered either).
    pub closed: AtomicU32,
    /// Totals for the operator: requests logged, replays run, entries
    /// replayed, replies that differed from the logged ones, replies
    /// handed to a client that was still waiting, and the last replay's
    /// duration (ns) and length (entries).
    pub logged: AtomicU64,
    pub replays: AtomicU64,
    pub replayed: AtomicU64,
    pub divergences: AtomicU64,
    pub delivered: AtomicU64,
    pub last_replay_ns: AtomicU64,
    pub last_replay_entries: AtomicU64,
    /// The last replay's calls to other servers answered from the log,
    /// and its divergences.
    pub last_replay_calls: AtomicU64,
    pub last_replay_diverged: AtomicU64,
    /// Requests served in turn, logged or not (a `readonly` call is not
    /// logged), all incarnations together: the supervisor's hang and
    /// crash ladder tells by it whether a recovered incarnation served.
    pub served: AtomicU64,
}
// SAFETY: repr(C), atomics only, all-zero is an empty log.
unsafe impl SharedPod for JournalHeader {}

/// One logged request (what the server's worker saw in the slot).
#[repr(C)]
pub struct EntryHead {
    /// `entry::*`, stored last (Release) when it changes.
    pub state: AtomicU32,
    /// Which provided edge (in boot order) and slot it came on.
    pub edge: AtomicU32,
    pub slot: AtomicU32,
    pub func: AtomicU32,
    /// The slot's call number and the caller's incarnation: a reply is
    /// handed over only to the very call that is still waiting for it.
    pub seq: AtomicU64,
    pub client_epoch: AtomicU64,
    pub request_len: AtomicU32,
    pub response_len: AtomicU32,
    /// `channel::status::*` and code of the reply.
    pub status: AtomicU32,
    pub code: AtomicU32,
    /// Bytes of the calls to other servers recorded after the request.
    pub calls_len: AtomicU32,
    /// 1 once a call found no room in the log: it and every later call of
    /// the request were refused without being made.
    pub calls_cut: AtomicU32,
}

/// Kinds of a recorded call.
pub mod call {
    /// The server's reply: status, code and bytes as they came.
    pub const REPLY: u32 = 1;
    /// The call failed without a reply it could use: the bytes are the
    /// fault (JSON).
    pub const FAULT: u32 = 2;
}

/// A call the logged request made to another server, and its outcome
/// (`crate::journal`'s `calls`).
#[repr(C)]
pub struct CallHead {
    /// `call::*`.
    pub kind: AtomicU32,
    pub func: AtomicU32,
    /// Which connection (a hash of its server's name).
    pub conn: AtomicU64,
    /// The server's epoch when the call was made.
    pub epoch: AtomicU64,
    pub status: AtomicU32,
    pub code: AtomicU32,
    pub len: AtomicU32,
    _pad: AtomicU32,
}
// SAFETY: repr(C), atomics only; every bit pattern is a (possibly invalid,
// and then refused) record.
unsafe impl SharedPod for CallHead {}
// SAFETY: repr(C), atomics only; every bit pattern is a (possibly invalid,
// and then refused) entry.
unsafe impl SharedPod for EntryHead {}

const _: () = assert!(std::mem::size_of::<JournalHeader>() <= HEADER_SIZE);
const _: () = assert!(ENTRY_HEAD.is_multiple_of(8));
const _: () = assert!(CALL_HEAD.is_multiple_of(8));

/// Rounds a length up to the entries' alignment.
pub fn padded(len: usize) -> usize {
    len.next_multiple_of(8)
}

/// One mapped request log.
#[derive(Debug)]
pub struct JournalRegion {
    region: Region,
}

impl JournalRegion {
    /// Creates an empty log of `bytes` (supervisor side).
    pub fn create(name: &str, bytes: usize) -> std::io::Result<Self> {
        assert!(bytes > HEADER_SIZE);
        let region = Region::create(name, bytes)?;
        let j = Self { region };
        j.header().magic.store(MAGIC, Ordering::Release);
        Ok(j)
    }

    /// Adopts a region made by [`JournalRegion::create`] in another process.
    pub fn open(region: Region) -> std::io::Result<Self> {
        let bad = |why: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, why.to_string());
        if region.len() <= HEADER_SIZE {
            return Err(bad("request log region too small"));
        }
        let h: &JournalHeader = region.at(0);
        if h.magic.load(Ordering::Acquire) != MAGIC {
            return Err(bad("not a kintsugi request log"));
        }
        Ok(Self { region })
    }

    pub fn region(&self) -> &Region {
        &self.region
    }

    pub fn header(&self) -> &JournalHeader {
        self.region.at(0)
    }

    /// Bytes entries may fill.
    pub fn capacity(&self) -> usize {
        self.region.len() - HEADER_SIZE
    }

    /// The head of the entry at `at` (bytes after the header), if one fits
    /// there.
    pub fn head(&self, at: usize) -> Option<&EntryHead> {
        let fits = at.is_multiple_of(8) && at.checked_add(ENTRY_HEAD)? <= self.capacity();
        fits.then(|| self.region.at(HEADER_SIZE + at))
    }

    /// The head of the call record at `at`, if one fits there.
    pub fn call_head(&self, at: usize) -> Option<&CallHead> {
        let fits = at.is_multiple_of(8) && at.checked_add(CALL_HEAD)? <= self.capacity();
        fits.then(|| self.region.at(HEADER_SIZE + at))
    }

    /// Copies `dst.len()` bytes of the entry area at `at` out (volatile).
    pub fn read(&self, at: usize, dst: &mut [u8]) -> bool {
        let fits = at
            .checked_add(dst.len())
            .is_some_and(|end| end <= self.capacity());
        if fits {
            self.region.copy_out(HEADER_SIZE + at, dst);
        }
        fits
    }

    /// Writes `src` into the entry area at `at` (volatile).
    pub fn write(&self, at: usize, src: &[u8]) {
        assert!(at + src.len() <= self.capacity(), "log write out of bounds");
        self.region.copy_in(HEADER_SIZE + at, src);
    }

    // ---- supervisor side -------------------------------------------------

    /// Forgets every entry: the checkpoint just taken holds their effects.
    /// Called with the server frozen at a safe point.
    pub fn cut(&self) {
        let h = self.header();
        h.count.store(0, Ordering::SeqCst);
        h.end.store(0, Ordering::SeqCst);
        h.wanted.store(0, Ordering::SeqCst);
        h.cuts.fetch_add(1, Ordering::SeqCst);
        futex::wake_all(&h.cuts);
    }

    /// Has the server replay the log before it serves anything new (after
    /// a restore; called with the server frozen).
    pub fn ask_replay(&self) {
        self.header().replay.store(1, Ordering::SeqCst);
    }

    /// Whether a replay was asked for and is not done.
    pub fn replay_pending(&self) -> bool {
        self.header().replay.load(Ordering::SeqCst) != 0
    }

    /// Ends logging for good (the system stops and takes no more
    /// checkpoints): requests run unlogged, and a server waiting for room
    /// in a full log is woken to run its request.
    pub fn close(&self) {
        let h = self.header();
        h.closed.store(1, Ordering::SeqCst);
        h.cuts.fetch_add(1, Ordering::SeqCst);
        futex::wake_all(&h.cuts);
    }

    /// Whether [`JournalRegion::close`] was called.
    pub fn closed(&self) -> bool {
        self.header().closed.load(Ordering::SeqCst) != 0
    }

    /// Requests served in turn so far, logged or not, all incarnations
    /// together.
    pub fn served(&self) -> u64 {
        self.header().served.load(Ordering::SeqCst)
    }

    /// Whether the server asked for an early checkpoint.
    pub fn wants_checkpoint(&self) -> bool {
        self.header().wanted.load(Ordering::Relaxed) != 0
    }
}

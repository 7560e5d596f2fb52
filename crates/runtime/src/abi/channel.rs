//! Channels: the shared-memory layout of one client→server edge and the
//! protocol both sides follow on it.
//!
//! An edge is one memfd region created by the supervisor for a client
//! component's use of a server's interface. It holds a header (the server's
//! epoch and liveness, which slots are claimed) and a fixed number of slots,
//! one per concurrently calling client thread. Each slot has a state word
//! that is also its futex:
//!
//! ```text
//!  IDLE --client posts--> REQUEST --server replies--> RESPONSE --client reads--> IDLE
//!                            \--supervisor: server died--> FAILED --client reads--> IDLE
//! ```
//!
//! Whoever the state names owns the slot's buffers: the client in IDLE,
//! RESPONSE and FAILED, the server in REQUEST. Request and response have
//! separate buffers, so a server reads its arguments in place while it
//! writes its result.
//!
//! The header also holds a one-entry mailbox for upcalls, calls from the
//! server to the client's upcall thread (see [`crate::upcall`]).

use std::sync::atomic::{compiler_fence, AtomicU32, AtomicU64, Ordering};

use crate::abi::shm::{Region, SharedPod};
use crate::counters::SharedName;
use crate::futex;
use crate::stub::InterfaceInfo;

/// Largest byte payload of one invocation (plus room for the other arguments).
pub const MAX_PAYLOAD: usize = 64 * 1024;
/// Size of each of a slot's request and response buffers.
pub const BUFFER_SIZE: usize = MAX_PAYLOAD + 4096;
/// Most slots an edge can have.
pub const MAX_SLOTS: u32 = 64;
/// Change counters in an edge's header ([`EdgeHeader::changes`]).
pub const CHANGE_COUNTERS: usize = 64;

const MAGIC: u64 = u64::from_le_bytes(*b"kintsug1");
const HEADER_SIZE: usize = 4096;
/// Function names an edge's header holds (larger ids go unnamed).
pub const EDGE_FUNCTIONS: usize = 64;
const SLOT_HEADER_SIZE: usize = 192;
const SLOT_SIZE: usize = SLOT_HEADER_SIZE + 2 * BUFFER_SIZE;

/// Slot states.
pub mod state {
    pub const IDLE: u32 = 0;
    pub const REQUEST: u32 = 1;
    pub const RESPONSE: u32 = 2;
    pub const FAILED: u32 = 3;
    /// The client could not decode the reply of a checkpoint-recovered
    /// server, which ran the call: rather than post it again (it would run
    /// twice), it waits for the rollback it asked for, whose replay runs
    /// the call again and hands its reply to this very call. No worker
    /// serves it; the replay claims it (back to `REQUEST`) to answer it.
    pub const REPLAY: u32 = 4;
}

/// Server liveness, as seen on an edge.
pub mod liveness {
    /// Rebooting: calls wait.
    pub const DOWN: u32 = 0;
    pub const LIVE: u32 = 1;
    /// Gone for good: calls fail with `Fault::Lost`.
    pub const GONE: u32 = 2;
}

/// Bits of a request's `flags` word.
pub mod flags {
    /// The call rebuilds descriptors (made inside a
    /// [`RecoveryScope`](crate::client::RecoveryScope)): it passes the gate
    /// that holds other calls during eager recovery.
    pub const RECOVERY: u32 = 1;
}

/// Response status codes.
pub mod status {
    pub const OK: u32 = 0;
    pub const APP_ERROR: u32 = 1;
    pub const REFUSED: u32 = 2;
    pub const STALE: u32 = 3;
}

#[repr(C)]
pub struct EdgeHeader {
    magic: AtomicU64,
    /// Hash of the interface the server serves on this edge (0 until known).
    pub interface_hash: AtomicU64,
    /// Current server incarnation; raised by the supervisor at each reboot.
    pub epoch: AtomicU64,
    /// Descriptors rebuilt by the client stub, for the event log.
    pub recovered: AtomicU64,
    /// Bitmap of slots claimed by client threads.
    pub claimed: AtomicU64,
    /// `liveness::*`; also a futex for clients waiting out a reboot.
    pub liveness: AtomicU32,
    pub slot_count: AtomicU32,
    /// Process id of the live server incarnation (0 while down).
    pub server_pid: AtomicU32,
    /// Non-zero while the supervisor holds new calls at the server's
    /// workers, for a checkpoint or a recovery: how many holds there are
    /// (a futex; see [`Edge::begin_serving`]).
    pub hold: AtomicU32,
    /// Raised by the supervisor each time the client's incarnation dies.
    pub client_epoch: AtomicU64,
    /// Upcall mailbox (server → client), a sequence lock: the server makes
    /// it odd while it writes `upcall_op` and `upcall_args`, even once they
    /// are posted, and wakes the client's upcall thread (futex).
    pub upcall_seq: AtomicU32,
    pub upcall_op: AtomicU32,
    pub upcall_args: [AtomicU64; 3],
    /// The `upcall_seq` the client finished (futex; woken by the client, and
    /// by the supervisor when the client dies).
    pub upcall_ack: AtomicU32,
    /// `upcall::status::*` of the finished upcall.
    pub upcall_status: AtomicU32,
    pub upcall_result: AtomicU64,
    /// `client_epoch + 1` while an incarnation of the client listens for
    /// upcalls; any other value means nobody does.
    pub upcall_listener: AtomicU64,
    /// The `client_epoch` whose deaths the server's incarnations have told
    /// their service of: a death during a server's reboot is told by the
    /// next incarnation (at least once).
    pub client_deaths_told: AtomicU64,
    /// The server epoch of a reply the client found impossible (a refusal
    /// of a call its generated stub made, a reply that does not decode):
    /// the supervisor's watchdog reboots (or rolls back) that incarnation,
    /// and clears the word when it has.
    pub suspected: AtomicU64,
    /// 1 while the supervisor holds the client's new calls for a
    /// checkpoint of the client (a futex).
    pub client_hold: AtomicU32,
    _pad: AtomicU32,
    /// Raised each time the slot claims are voided: a client thread's
    /// claim of an older round is not its own any more (a checkpoint
    /// restore puts back threads that remember claims).
    pub claims_round: AtomicU64,
    /// Change counters the server publishes to its client, each raised
    /// after a change of what some calls return (what each one counts is
    /// the interface's to say). A client may keep a reply instead of
    /// calling again while the counters it depends on and `epoch` stay the
    /// same: a server that crashed between a change and its count comes
    /// back with another epoch. See [`crate::client::Changes`].
    pub changes: [AtomicU64; CHANGE_COUNTERS],
    /// The interface's function names by id, written by the first stub
    /// (server or client) to use the edge, so that the supervisor can name
    /// calls of interfaces it was not built with. Untrusted: read through
    /// [`Edge::function_name`].
    pub functions: [SharedName; EDGE_FUNCTIONS],
}
// SAFETY: repr(C), atomics only, all-zero is a valid (unset) header.
unsafe impl SharedPod for EdgeHeader {}

#[repr(C)]
pub struct SlotHeader {
    pub state: AtomicU32,
    pub server_sleeping: AtomicU32,
    pub client_sleeping: AtomicU32,
    pub func: AtomicU32,
    pub status: AtomicU32,
    /// Application error or refusal code.
    pub code: AtomicU32,
    pub request_len: AtomicU32,
    pub response_len: AtomicU32,
    /// Epoch the request's descriptors belong to (0: any).
    pub epoch: AtomicU64,
    /// Calls made on this slot (diagnostics: which call a fault hit).
    pub seq: AtomicU64,
    /// `flags::*` of the request.
    pub flags: AtomicU32,
    /// The calling thread's priority ([`crate::priority::Priority::word`]),
    /// which the server's worker adopts while it serves the call.
    pub priority: AtomicU32,
    /// The caller's incarnation (`EdgeHeader::client_epoch` when it called):
    /// a request a dead incarnation left behind is refused unrun.
    pub client_epoch: AtomicU64,
    /// 1 while the client thread that claimed this slot makes a call (see
    /// [`Edge::begin_calling`]), in a cache line of its own: only the
    /// client writes it.
    pub calling: AtomicU32,
    _calling_line: [AtomicU32; 15],
    /// 1 while the server's worker of this slot serves a call (see
    /// [`Edge::begin_serving`]), in a cache line only the worker writes
    /// (sharing one with `calling` cost the spinning null invocation
    /// 0.15 → 0.63 µs p50 in two runs of three).
    pub serving: AtomicU32,
    _serving_line: [AtomicU32; 15],
}
// SAFETY: repr(C), atomics only, all-zero is IDLE.
unsafe impl SharedPod for SlotHeader {}

const _: () = assert!(std::mem::size_of::<SlotHeader>() <= SLOT_HEADER_SIZE);
const _: () = assert!(std::mem::size_of::<EdgeHeader>() <= HEADER_SIZE);

/// One mapped edge.
#[derive(Debug)]
pub struct Edge {
    region: Region,
    slots: u32,
    /// Held (in the server's process) while a client's death is told to
    /// the service, so that it is told once and before any later request.
    telling: std::sync::Mutex<()>,
}

impl Edge {
    /// Bytes an edge with `slots` slots needs.
    pub fn region_size(slots: u32) -> usize {
        HEADER_SIZE + slots as usize * SLOT_SIZE
    }

    /// Creates a new edge (supervisor side), server down, epoch 0.
    pub fn create(name: &str, slots: u32) -> std::io::Result<Self> {
        assert!((1..=MAX_SLOTS).contains(&slots));
        let region = Region::create(name, Self::region_size(slots))?;
        let edge = Self {
            region,
            slots,
            telling: Default::default(),
        };
        let h = edge.header();
        h.slot_count.store(slots, Ordering::Relaxed);
        h.magic.store(MAGIC, Ordering::Release);
        Ok(edge)
    }

    /// Adopts a mapped region created by [`Edge::create`] in another process.
    pub fn open(region: Region) -> std::io::Result<Self> {
        let bad = |why: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, why.to_string());
        if region.len() < HEADER_SIZE {
            return Err(bad("edge region too small"));
        }
        let h: &EdgeHeader = region.at(0);
        if h.magic.load(Ordering::Acquire) != MAGIC {
            return Err(bad("not a kintsugi edge region"));
        }
        let slots = h.slot_count.load(Ordering::Relaxed);
        if slots == 0 || slots > MAX_SLOTS || region.len() < Self::region_size(slots) {
            return Err(bad("edge region has a bad slot count"));
        }
        Ok(Self {
            region,
            slots,
            telling: Default::default(),
        })
    }

    pub fn region(&self) -> &Region {
        &self.region
    }

    pub fn header(&self) -> &EdgeHeader {
        self.region.at(0)
    }

    pub fn slot_count(&self) -> u32 {
        self.slots
    }

    fn slot_offset(&self, slot: u32) -> usize {
        assert!(slot < self.slots);
        HEADER_SIZE + slot as usize * SLOT_SIZE
    }

    pub fn slot(&self, slot: u32) -> &SlotHeader {
        self.region.at(self.slot_offset(slot))
    }

    /// The slot's request buffer, for the client to write.
    ///
    /// # Safety
    /// The caller must own the slot's request buffer under the protocol
    /// (client in IDLE, server in REQUEST) for as long as the slice lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn request_buffer(&self, slot: u32) -> &mut [u8] {
        // SAFETY: exclusivity is the caller's contract; bounds are checked by Region.
        unsafe {
            self.region
                .bytes_mut(self.slot_offset(slot) + SLOT_HEADER_SIZE, BUFFER_SIZE)
        }
    }

    /// Copies the first `dst.len()` bytes of the slot's request out of
    /// shared memory (volatile reads: the client may be writing them, if it
    /// is faulty). How a server reads a request.
    pub fn copy_request(&self, slot: u32, dst: &mut [u8]) {
        assert!(dst.len() <= BUFFER_SIZE, "request longer than its buffer");
        self.region
            .copy_out(self.slot_offset(slot) + SLOT_HEADER_SIZE, dst);
    }

    /// Copies the first `dst.len()` bytes of the slot's response out of
    /// shared memory, as [`Edge::copy_request`]. How a client reads a reply.
    pub fn copy_response(&self, slot: u32, dst: &mut [u8]) {
        assert!(dst.len() <= BUFFER_SIZE, "response longer than its buffer");
        self.region
            .copy_out(self.slot_offset(slot) + SLOT_HEADER_SIZE + BUFFER_SIZE, dst);
    }

    /// The slot's response buffer, for the server to write.
    ///
    /// # Safety
    /// As for [`Edge::request_buffer`]: server in REQUEST, client in RESPONSE.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn response_buffer(&self, slot: u32) -> &mut [u8] {
        // SAFETY: exclusivity is the caller's contract; bounds are checked by Region.
        unsafe {
            self.region.bytes_mut(
                self.slot_offset(slot) + SLOT_HEADER_SIZE + BUFFER_SIZE,
                BUFFER_SIZE,
            )
        }
    }

    // ---- supervisor side -------------------------------------------------

    /// The server died: calls now wait, and every call in flight fails with
    /// `FAILED` so that its client learns at once. Returns the function ids
    /// of the calls that were in flight.
    pub fn server_down(&self) -> Vec<u32> {
        self.mark_down();
        self.fail_in_flight()
    }

    /// New calls wait until the server is live again.
    pub fn mark_down(&self) {
        let h = self.header();
        h.liveness.store(liveness::DOWN, Ordering::SeqCst);
        h.server_pid.store(0, Ordering::Relaxed);
        // What the dead incarnation's workers were serving ends with it.
        self.reset_serving();
        self.clear_suspicion();
    }

    /// The supervisor answered a client's suspicion (a reboot, a rollback):
    /// a client waiting for it goes on, and the watchdog does not answer
    /// it again (a checkpoint recovery or rollback keeps the epoch the
    /// suspicion names).
    pub fn clear_suspicion(&self) {
        self.header().suspected.store(0, Ordering::SeqCst);
    }

    /// Fails every call in flight (its server is dead); returns their function ids.
    pub fn fail_in_flight(&self) -> Vec<u32> {
        let mut in_flight = Vec::new();
        for i in 0..self.slots {
            let s = self.slot(i);
            if s.state
                .compare_exchange(
                    state::REQUEST,
                    state::FAILED,
                    Ordering::SeqCst,
                    Ordering::SeqCst,
                )
                .is_ok()
            {
                in_flight.push(s.func.load(Ordering::Relaxed));
                futex::wake_all(&s.state);
            }
        }
        in_flight
    }

    /// Raises change counter `counter` (see [`EdgeHeader::changes`]); a
    /// counter that does not exist is left alone.
    pub fn publish_change(&self, counter: usize) {
        if let Some(c) = self.header().changes.get(counter) {
            c.fetch_add(1, Ordering::Release);
        }
    }

    /// A new incarnation with `epoch` serves this edge from `pid`.
    pub fn server_live(&self, epoch: u64, pid: u32) {
        let h = self.header();
        h.epoch.store(epoch, Ordering::SeqCst);
        h.server_pid.store(pid, Ordering::Relaxed);
        h.liveness.store(liveness::LIVE, Ordering::SeqCst);
        futex::wake_all(&h.liveness);
    }

    /// The server will not come back: every waiting and future call fails.
    pub fn server_gone(&self) {
        let h = self.header();
        h.liveness.store(liveness::GONE, Ordering::SeqCst);
        futex::wake_all(&h.liveness);
        self.fail_in_flight();
    }

    /// The client died: its threads' slot claims go with it, and its server
    /// will see the client epoch change (an upcall waiting for the dead
    /// client's answer is woken to fail).
    /// Runs `tell` (the service's `client_died`) if the client died since the
    /// server's incarnations last told it, whichever thread gets here first;
    /// the others wait until it has been told.
    pub fn tell_client_deaths(&self, tell: impl FnOnce()) {
        let h = self.header();
        if h.client_deaths_told.load(Ordering::SeqCst) == h.client_epoch.load(Ordering::SeqCst) {
            return;
        }
        let _one = self.telling.lock().unwrap_or_else(|e| e.into_inner());
        let now = h.client_epoch.load(Ordering::SeqCst);
        if h.client_deaths_told.load(Ordering::SeqCst) != now {
            tell();
            h.client_deaths_told.store(now, Ordering::SeqCst);
        }
    }

    pub fn client_down(&self) {
        self.void_claims();
        let h = self.header();
        h.client_epoch.fetch_add(1, Ordering::SeqCst);
        futex::wake_all(&h.upcall_ack);
        // The dead client may have posted a request without waking its worker.
        for i in 0..self.slots {
            futex::wake_all(&self.slot(i).state);
        }
    }

    /// The client's state was put back from a checkpoint (supervisor; the
    /// client is dead or frozen): its slot claims are void, for its
    /// restored threads remember the claims of the checkpoint's time, and
    /// its calls in flight are over. Its server is not told of a death:
    /// the restored client still holds what the server handed out.
    pub fn client_restored(&self) {
        self.void_claims();
        for i in 0..self.slots {
            futex::wake_all(&self.slot(i).state);
        }
    }

    fn void_claims(&self) {
        let h = self.header();
        h.claims_round.fetch_add(1, Ordering::SeqCst);
        h.claimed.store(0, Ordering::SeqCst);
        for i in 0..self.slots {
            let s = self.slot(i);
            s.calling.store(0, Ordering::SeqCst);
            // No thread of the client awaits that replay any more.
            let _ = s.state.compare_exchange(
                state::REPLAY,
                state::IDLE,
                Ordering::SeqCst,
                Ordering::SeqCst,
            );
        }
    }

    // ---- holding calls for a checkpoint -----------------------------------
    //
    // A checkpoint is taken at a safe point, with no call being served or
    // made. A worker (or calling thread) raises its slot's `serving` (or
    // `calling`) flag before it touches the call and lowers it once the
    // call is over; the supervisor reads the flags of a component it has
    // frozen. Freezing stops every thread in the kernel, which drains its
    // stores: the frozen flags are exact, with no fence or atomic
    // read-modify-write on the call's path (the flags are plain stores,
    // kept in program order by compiler fences). The hold word only keeps
    // new calls out while calls in flight drain, so that a safe point comes
    // soon; a thread that reads it late just makes the supervisor try again.

    /// Marks slot `slot`'s worker serving a call until the guard drops,
    /// waiting first while the supervisor holds calls.
    pub fn begin_serving(&self, slot: u32) -> Active<'_> {
        Active::enter(&self.slot(slot).serving, &self.header().hold)
    }

    /// Marks the client thread of slot `slot` making a call until the
    /// guard drops, waiting first while the supervisor holds the client's
    /// calls.
    pub fn begin_calling(&self, slot: u32) -> Active<'_> {
        Active::enter(&self.slot(slot).calling, &self.header().client_hold)
    }

    /// Raises or lowers the hold on the server's workers (supervisor).
    /// Holds count: a checkpoint's hold inside a recovery's leaves the
    /// recovery's in place.
    pub fn hold_serving(&self, on: bool) {
        set_hold(&self.header().hold, on);
    }

    /// Raises or lowers the hold on the client's calls (supervisor).
    pub fn hold_calling(&self, on: bool) {
        set_hold(&self.header().client_hold, on);
    }

    /// No call is being served: the server's every worker was just rolled
    /// back to a checkpoint taken when none was (supervisor).
    pub fn reset_serving(&self) {
        for i in 0..self.slots {
            self.slot(i).serving.store(0, Ordering::SeqCst);
        }
    }

    /// Calls being served now (exact while the server is frozen), a call
    /// awaiting its replay ([`state::REPLAY`]) included while its client's
    /// suspicion is raised: a checkpoint then would cut the logged request
    /// the replay is to run again. (Once the suspicion is answered, the
    /// pending replay keeps checkpoints off; and a client that leaves a
    /// slot so without suspecting cannot hold the server's checkpoints
    /// back, and with them, once its log is full, its other clients.)
    pub fn serving(&self) -> u32 {
        let suspected = self.header().suspected.load(Ordering::SeqCst) != 0;
        (0..self.slots)
            .map(|i| self.slot(i))
            .map(|s| {
                let awaiting = suspected && s.state.load(Ordering::SeqCst) == state::REPLAY;
                s.serving
                    .load(Ordering::SeqCst)
                    .min(1)
                    .max(u32::from(awaiting))
            })
            .sum()
    }

    /// Calls being made now (exact while the client is frozen).
    pub fn calling(&self) -> u32 {
        (0..self.slots)
            .map(|i| self.slot(i).calling.load(Ordering::SeqCst).min(1))
            .sum()
    }

    /// Function ids of the calls in flight right now (for fault reports).
    /// Writes `info`'s function names into the header, where none are yet.
    pub fn register_functions(&self, info: &InterfaceInfo) {
        for (entry, name) in self.header().functions.iter().zip(info.functions) {
            entry.name_once(name);
        }
    }

    /// The name the stubs registered for function `func`, if it is one: a
    /// faulty peer may write anything there, so only an identifier is taken.
    pub fn function_name(&self, func: u32) -> Option<String> {
        let name = self.header().functions.get(func as usize)?.get()?;
        let ident = !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        ident.then_some(name)
    }

    pub fn in_flight(&self) -> Vec<u32> {
        (0..self.slots)
            .map(|i| self.slot(i))
            .filter(|s| s.state.load(Ordering::Acquire) == state::REQUEST)
            .map(|s| s.func.load(Ordering::Relaxed))
            .collect()
    }
}

fn set_hold(word: &AtomicU32, on: bool) {
    match on {
        true => {
            word.fetch_add(1, Ordering::SeqCst);
        }
        false => {
            let was = word.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| v.checked_sub(1));
            if was == Ok(1) {
                futex::wake_all(word);
            }
        }
    }
}

/// One call marked in its slot (see [`Edge::begin_serving`]); the mark
/// goes when this does.
#[must_use]
pub struct Active<'a> {
    flag: &'a AtomicU32,
}

impl<'a> Active<'a> {
    fn enter(flag: &'a AtomicU32, hold: &AtomicU32) -> Self {
        loop {
            flag.store(1, Ordering::Relaxed);
            // Before anything of the call, in program order.
            compiler_fence(Ordering::SeqCst);
            if hold.load(Ordering::Relaxed) == 0 {
                return Self { flag };
            }
            flag.store(0, Ordering::Relaxed);
            loop {
                let held = hold.load(Ordering::Relaxed);
                if held == 0 {
                    break;
                }
                futex::wait(hold, held, None);
            }
        }
    }
}

impl Drop for Active<'_> {
    fn drop(&mut self) {
        // After everything of the call, in program order.
        compiler_fence(Ordering::SeqCst);
        self.flag.store(0, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;
    use std::time::Duration;

    /// A hold keeps new calls out and lets the counted ones finish; the
    /// calls it held go on once it is lowered.
    #[test]
    fn a_hold_keeps_new_calls_out_and_counts_those_in() {
        for (begin, hold, count) in [
            (
                Edge::begin_serving as fn(&Edge, u32) -> Active<'_>,
                Edge::hold_serving as fn(&Edge, bool),
                Edge::serving as fn(&Edge) -> u32,
            ),
            (Edge::begin_calling, Edge::hold_calling, Edge::calling),
        ] {
            let edge = Arc::new(Edge::create("kintsugi-test-hold", 2).unwrap());
            let first = begin(&edge, 0);
            hold(&edge, true);
            let entered = Arc::new(AtomicBool::new(false));
            let late = {
                let (edge, entered) = (edge.clone(), entered.clone());
                std::thread::spawn(move || {
                    let _call = begin(&edge, 1);
                    entered.store(true, Ordering::SeqCst);
                })
            };
            std::thread::sleep(Duration::from_millis(50));
            assert!(
                !entered.load(Ordering::SeqCst),
                "a new call waits at the hold"
            );
            assert_eq!(count(&edge), 1, "only the call already in counts");
            drop(first);
            assert_eq!(count(&edge), 0, "a safe point");
            hold(&edge, false);
            late.join().unwrap();
            assert!(entered.load(Ordering::SeqCst), "the held call went on");
            assert_eq!(count(&edge), 0);
        }
    }

    /// A call awaiting its replay keeps the server from a safe point (a
    /// checkpoint would cut the request the replay is to run) while its
    /// client suspects the server, until the client, dead or restored, no
    /// longer awaits it.
    #[test]
    fn a_call_awaiting_its_replay_counts_as_served_until_its_client_is_gone() {
        let edge = Edge::create("kintsugi-test-replay", 2).unwrap();
        edge.slot(1).state.store(state::REPLAY, Ordering::SeqCst);
        assert_eq!(edge.serving(), 0, "no suspicion raised: not awaited");
        edge.header().suspected.store(1, Ordering::SeqCst);
        assert_eq!(edge.serving(), 1);
        edge.client_restored();
        assert_eq!(edge.slot(1).state.load(Ordering::SeqCst), state::IDLE);
        assert_eq!(edge.serving(), 0, "a safe point");
        edge.slot(0).state.store(state::REPLAY, Ordering::SeqCst);
        edge.client_down();
        assert_eq!(edge.serving(), 0);
    }
}

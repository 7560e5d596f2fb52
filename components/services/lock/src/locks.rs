//! The lock table: every lock's owner, in the durable arena.
//!
//! ```text
//! arena:  lock slots (arena_slots, 32 bytes each)          | release records
//! slot payload:  owner: u32 | seq: u32                      | u64 per (client, channel slot)
//! ```
//!
//! - `owner` is the holder's code, `(component + 1) << 8 | channel slot`
//!   (one channel slot per client thread), or 0 when the lock is free.
//! - `seq` is the futex word waiters sleep on: raised by every release, by
//!   `free` and by a client's death, so that no wake-up is ever missed.
//! - A `take` by the thread the lock already names as its owner succeeds: it
//!   was re-issued by the client stub after a reboot whose first attempt had
//!   taken the lock, or the owner was written wrong under it (a thread
//!   blocked in `take` is not inside its critical section either way).
//! - The release record of a client thread is the id of the last lock it
//!   released (cleared when it takes that lock again). A `release` by a
//!   thread that does not own the lock succeeds if its record names that
//!   lock: the call was re-issued after a reboot and its first attempt had
//!   released it, perhaps to another thread since. So a double release by
//!   the same thread is harmless too; any other release by a non-owner is
//!   refused with `NotOwner`.
//!
//! - A lease names the client component as a whole: its owner code has the
//!   channel slot [`LEASE_SLOT`], which no thread has. Its threads pass the
//!   lock among themselves without calling (the client's `lock_lease`); a
//!   `take` or `lease` of anyone else finds the lease and asks the holder to
//!   give it back ([`AskBack`], the `LEASE_WANTED` upcall), then waits as
//!   for any owner, asking again at every wake-up and owner check. Lease
//!   and unlease re-issued after a reboot find the lease already taken or
//!   already given back, and succeed.
//!
//! The arena outlives every incarnation, so a faulty one (a flipped bit in
//! a register that held an owner code) can leave an owner that no thread
//! is: every reboot would inherit the lock held for ever. An owner code
//! that names no channel slot of any client ([`Callers`]) is therefore
//! cleared: by each new incarnation before it serves, by a `take` that
//! finds it (it checks again every [`OWNER_CHECK`] while it waits), and by
//! a `release` that finds it in place of its caller.
//!
//! When a client component dies, its locks are released and every waiter
//! is woken; a `take` that started before the death gives up (the
//! [`Deaths`] count of its client changed), and one that took the lock just
//! as its client died puts it back.
//!
//! The runtime tells the service of a client's death before it serves any
//! request of the client's next incarnation, and refuses unrun a request a
//! dead incarnation left in the channel, so a lock held by a channel slot
//! in this server incarnation is never its caller's own.

use std::ops::Deref;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::SeqCst};
use std::time::Duration;

use kintsugi_arena_slots::{Deaths, Slot, Slots, SLOT_BYTES};
use kintsugi_interfaces::lock::{Error, Server};
use kintsugi_runtime::abi::shm::Region;
use kintsugi_runtime::{futex, watchdog};
use kintsugi_runtime::{Caller, Callers};

const OWNER: usize = 0;
const SEQ: usize = 4;

/// How often a waiting `take` checks that the lock's owner could exist.
const OWNER_CHECK: Duration = Duration::from_millis(50);

/// Client components with release records (component ids below this).
pub const CLIENTS: usize = 256;
/// Channel slots per client: the system description allows at most 64.
const THREADS: usize = 64;
/// The channel slot of a lease's owner code: a whole component, no thread.
const LEASE_SLOT: u32 = 0xff;

/// Asks client component `holder` to give back its lease of lock `l`.
pub type AskBack = Box<dyn Fn(u32, u64) + Send + Sync>;
/// Bytes of release records at the end of the arena.
pub const RECORD_BYTES: usize = CLIENTS * THREADS * 8;

pub struct Locks<A> {
    slots: Slots<A>,
    /// Where the release records start in the arena.
    records: usize,
    deaths: Deaths,
    /// Every client thread that could own a lock.
    callers: Callers,
    ask_back: AskBack,
}

/// The caller's owner code and its release record's index.
struct Owner {
    code: u32,
    record: usize,
}

impl Owner {
    /// The component a lease's owner code names.
    fn leaseholder(code: u32) -> Option<u32> {
        (code & 0xff == LEASE_SLOT)
            .then(|| (code >> 8).checked_sub(1))
            .flatten()
    }

    /// The client thread an owner code names.
    fn caller(code: u32) -> Option<Caller> {
        let component = (code >> 8).checked_sub(1)?;
        Some(Caller {
            component,
            slot: code & 0xff,
        })
    }

    fn of(caller: &Caller) -> Result<Self, Error> {
        let (component, slot) = (caller.component as usize, caller.slot as usize);
        if component >= CLIENTS || slot >= THREADS {
            tracing::error!(
                component,
                slot,
                "this lock server serves client ids below {CLIENTS}"
            );
            return Err(Error::NotOwner);
        }
        Ok(Self {
            code: ((component as u32 + 1) << 8) | slot as u32,
            record: component * THREADS + slot,
        })
    }

    /// The owner code of a lease to the caller's component.
    fn lease_of(caller: &Caller) -> Result<u32, Error> {
        Self::of(caller).map(|me| me.code | LEASE_SLOT)
    }
}

impl<A: Deref<Target = Region>> Locks<A> {
    /// The lock table in `arena` (zero at first boot), whose locks only
    /// `callers` can own; owners that name none of them are cleared.
    /// Leaseholders are asked to give leases back through `ask_back`.
    pub fn new(arena: A, callers: Callers, ask_back: AskBack) -> anyhow::Result<Self> {
        let len = arena.len();
        anyhow::ensure!(
            len >= RECORD_BYTES + 16 * SLOT_BYTES,
            "the lock server needs an arena of at least {} KiB (arena_kib)",
            (RECORD_BYTES + 16 * SLOT_BYTES).div_ceil(1024)
        );
        let records = len - RECORD_BYTES;
        let locks = Self {
            slots: Slots::new(arena, 0, records),
            records,
            deaths: Deaths::default(),
            callers,
            ask_back,
        };
        for slot in locks.slots.live() {
            locks.clear_impossible_owner(&slot);
        }
        Ok(locks)
    }

    /// Frees `slot` if its owner code names no client thread; true if it did.
    fn clear_impossible_owner(&self, slot: &Slot<'_>) -> bool {
        let held = slot.u32(OWNER).load(SeqCst);
        let possible = match Owner::leaseholder(held) {
            Some(component) => self.callers.has_component(component),
            None => Owner::caller(held).is_some_and(|c| self.callers.contains(c)),
        };
        if held == 0 || possible {
            return false;
        }
        tracing::warn!(
            owner = format_args!("{held:#x}"),
            "cleared a lock owner that is no client thread"
        );
        self.unlock(slot, held)
    }

    /// Waits until lock `l` is free and makes `code` (the caller's thread's,
    /// or its component's lease) its owner; clears the release record
    /// `record` of a thread that takes it. Asks a leaseholder in the way to
    /// give the lock back.
    fn acquire(
        &self,
        caller: &Caller,
        l: u64,
        code: u32,
        record: Option<usize>,
    ) -> Result<(), Error> {
        let slot = self.lock(l)?;
        let (owner, seq) = (slot.u32(OWNER), slot.u32(SEQ));
        let deaths = self.deaths.of(caller.component);
        loop {
            let rung = seq.load(SeqCst);
            if self.slots.get(l).is_none() {
                return Err(Error::NotFound); // freed meanwhile
            }
            if self.deaths.of(caller.component) != deaths {
                tracing::info!(
                    client = caller.component,
                    lock = l,
                    "gave up a take for a dead client"
                );
                return Err(Error::NotOwner);
            }
            match owner.compare_exchange(0, code, SeqCst, SeqCst) {
                Ok(_) => {
                    if let Some(r) = record {
                        let _ = self.record(r).compare_exchange(l, 0, SeqCst, SeqCst);
                    }
                    if self.deaths.of(caller.component) != deaths {
                        // Its client died as it took the lock, perhaps after
                        // client_died looked: put it back.
                        self.unlock(&slot, code);
                        return Err(Error::NotOwner);
                    }
                    return Ok(());
                }
                Err(held) if held == code => return Ok(()),
                Err(_) if self.clear_impossible_owner(&slot) => {}
                Err(held) => {
                    if let Some(holder) = Owner::leaseholder(held) {
                        (self.ask_back)(holder, l);
                    }
                    watchdog::blocking(|| futex::wait(seq, rung, Some(OWNER_CHECK)))
                }
            }
        }
    }

    /// Release record `index` (a client thread's, see [`Owner`]).
    fn record(&self, index: usize) -> &AtomicU64 {
        self.slots.arena().at(self.records + index * 8)
    }

    fn lock(&self, l: u64) -> Result<Slot<'_>, Error> {
        self.slots.get(l).ok_or(Error::NotFound)
    }

    /// Frees `slot` if `owner` holds it, and wakes its waiters.
    fn unlock(&self, slot: &Slot<'_>, owner: u32) -> bool {
        let freed = slot
            .u32(OWNER)
            .compare_exchange(owner, 0, SeqCst, SeqCst)
            .is_ok();
        if freed {
            ring(slot.u32(SEQ));
        }
        freed
    }
}

/// Raises a futex word and wakes everyone asleep on it.
fn ring(seq: &AtomicU32) {
    seq.fetch_add(1, SeqCst);
    futex::wake_all(seq);
}

impl<A: Deref<Target = Region> + Send + Sync + 'static> Server for Locks<A> {
    fn alloc(&self, caller: &Caller, reuse: Option<u64>, name: u64) -> Result<u64, Error> {
        self.slots
            .create(name, reuse, |s| s.u32(OWNER).store(0, SeqCst))
            .map_err(|e| {
                tracing::warn!(client = caller.component, name, "alloc: {e}");
                Error::NotFound
            })
    }

    fn take(&self, caller: &Caller, l: u64) -> Result<(), Error> {
        let me = Owner::of(caller)?;
        self.acquire(caller, l, me.code, Some(me.record))
    }

    fn release(&self, caller: &Caller, l: u64) -> Result<(), Error> {
        let me = Owner::of(caller)?;
        let slot = self.lock(l)?;
        let record = self.record(me.record);
        if slot.u32(OWNER).load(SeqCst) != me.code {
            // Re-issued (the first attempt released it), or its owner had
            // been written wrong.
            return match record.load(SeqCst) == l || self.clear_impossible_owner(&slot) {
                true => Ok(()),
                false => Err(Error::NotOwner),
            };
        }
        // Recorded before the lock is freed: a crash in between leaves it
        // held, and the re-issued release then frees it.
        record.store(l, SeqCst);
        self.unlock(&slot, me.code);
        Ok(())
    }

    fn lease(&self, caller: &Caller, l: u64) -> Result<(), Error> {
        self.acquire(caller, l, Owner::lease_of(caller)?, None)
    }

    fn unlease(&self, caller: &Caller, l: u64) -> Result<(), Error> {
        let code = Owner::lease_of(caller)?;
        // Not held: given back by a first attempt re-issued after a reboot.
        self.unlock(&self.lock(l)?, code);
        Ok(())
    }

    fn free(&self, caller: &Caller, l: u64) -> Result<(), Error> {
        let me = Owner::of(caller)?;
        let slot = self.lock(l)?;
        let held = slot.u32(OWNER).load(SeqCst);
        if held != 0 && held != me.code {
            return Err(Error::NotOwner);
        }
        if !self.slots.remove(l) {
            return Err(Error::NotFound);
        }
        ring(slot.u32(SEQ)); // its waiters find it gone
        Ok(())
    }

    fn client_died(&self, client: u32) {
        self.deaths.record(client);
        let mut released = 0;
        for slot in self.slots.live() {
            let held = slot.u32(OWNER).load(SeqCst);
            if held >> 8 == client + 1 && self.unlock(&slot, held) {
                released += 1;
            } else {
                ring(slot.u32(SEQ)); // its blocked takes give up
            }
        }
        if (client as usize) < CLIENTS {
            for t in 0..THREADS {
                self.record(client as usize * THREADS + t).store(0, SeqCst);
            }
        }
        tracing::info!("released {released} locks of dead client {client}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    const A: Caller = Caller {
        component: 1,
        slot: 0,
    };
    const B: Caller = Caller {
        component: 2,
        slot: 3,
    };

    fn arena() -> Arc<Region> {
        Arc::new(Region::create("locks-test", RECORD_BYTES + 64 * 1024).unwrap())
    }

    /// A and B's components, with four threads each.
    fn callers() -> Callers {
        Callers(vec![(A.component, 4), (B.component, 4)])
    }

    fn boot(arena: &Arc<Region>) -> Arc<Locks<Arc<Region>>> {
        Arc::new(Locks::new(arena.clone(), callers(), Box::new(|_, _| {})).unwrap())
    }

    /// Requests to give a lease back: (leaseholder, lock).
    type Asked = std::sync::mpsc::Receiver<(u32, u64)>;

    /// A lock table whose requests to give leases back arrive on the receiver.
    fn boot_asking(arena: &Arc<Region>) -> (Arc<Locks<Arc<Region>>>, Asked) {
        let (tx, rx) = std::sync::mpsc::channel();
        let tx = std::sync::Mutex::new(tx);
        let ask_back = Box::new(move |holder, l| tx.lock().unwrap().send((holder, l)).unwrap());
        let locks = Locks::new(arena.clone(), callers(), ask_back).unwrap();
        (Arc::new(locks), rx)
    }

    /// Runs `take` for `who` on a thread; the receiver hears its result.
    fn take_async(
        locks: &Arc<Locks<Arc<Region>>>,
        who: Caller,
        l: u64,
    ) -> std::sync::mpsc::Receiver<Result<(), Error>> {
        let (tx, rx) = std::sync::mpsc::channel();
        let locks = locks.clone();
        std::thread::spawn(move || tx.send(locks.take(&who, l)).unwrap());
        rx
    }

    const BLOCKED: Duration = Duration::from_millis(50);
    const SOON: Duration = Duration::from_secs(5);

    #[test]
    fn a_name_is_one_lock_and_take_waits_for_release() {
        let arena = arena();
        let locks = boot(&arena);
        let l = locks.alloc(&A, None, 7).unwrap();
        assert_eq!(locks.alloc(&B, None, 7).unwrap(), l);
        assert_ne!(locks.alloc(&B, None, 8).unwrap(), l);
        locks.take(&A, l).unwrap();
        let b = take_async(&locks, B, l);
        assert!(b.recv_timeout(BLOCKED).is_err(), "B waits while A holds it");
        assert_eq!(locks.release(&B, l), Err(Error::NotOwner));
        locks.release(&A, l).unwrap();
        assert_eq!(b.recv_timeout(SOON).unwrap(), Ok(()));
    }

    #[test]
    fn a_reboot_forgets_no_owner_and_re_issued_calls_succeed() {
        let arena = arena();
        let first = boot(&arena);
        let l = first.alloc(&A, None, 7).unwrap();
        first.take(&A, l).unwrap();
        drop(first);

        // Incarnation 2: the stub rebuilds the lock; A's re-issued take succeeds
        // once, B still has to wait.
        let second = boot(&arena);
        assert_eq!(second.alloc(&A, Some(l), 7).unwrap(), l);
        assert_eq!(
            second.take(&A, l),
            Ok(()),
            "re-issued take whose first attempt took it"
        );
        let b = take_async(&second, B, l);
        assert!(
            b.recv_timeout(BLOCKED).is_err(),
            "the owner survived the reboot"
        );
        second.release(&A, l).unwrap();
        assert_eq!(b.recv_timeout(SOON).unwrap(), Ok(()));

        // A's release is re-issued after another reboot while B holds the lock:
        // it succeeds and leaves B the owner.
        let third = boot(&arena);
        assert_eq!(third.release(&A, l), Ok(()));
        assert_eq!(
            third.release(
                &Caller {
                    component: 1,
                    slot: 1
                },
                l
            ),
            Err(Error::NotOwner)
        );
        let a = take_async(&third, A, l);
        assert!(a.recv_timeout(BLOCKED).is_err(), "B still holds it");
        third.release(&B, l).unwrap();
        assert_eq!(a.recv_timeout(SOON).unwrap(), Ok(()));
    }

    #[test]
    fn a_dead_clients_locks_are_released_and_its_takes_give_up() {
        let arena = arena();
        let locks = boot(&arena);
        let (l, m) = (
            locks.alloc(&A, None, 1).unwrap(),
            locks.alloc(&A, None, 2).unwrap(),
        );
        locks.take(&A, l).unwrap();
        locks.take(&B, m).unwrap();
        let a_waits = take_async(&locks, A, m);
        let b_waits = take_async(&locks, B, l);
        assert!(a_waits.recv_timeout(BLOCKED).is_err());
        locks.client_died(A.component);
        assert_eq!(a_waits.recv_timeout(SOON).unwrap(), Err(Error::NotOwner));
        assert_eq!(b_waits.recv_timeout(SOON).unwrap(), Ok(()));
        // A's next incarnation uses the lock as anyone else does.
        locks.release(&B, m).unwrap();
        locks.take(&A, m).unwrap();
    }

    #[test]
    fn free_wakes_waiters_and_the_name_gets_a_new_lock() {
        let arena = arena();
        let locks = boot(&arena);
        let l = locks.alloc(&A, None, 7).unwrap();
        locks.take(&A, l).unwrap();
        let b = take_async(&locks, B, l);
        assert_eq!(
            locks.free(&B, l),
            Err(Error::NotOwner),
            "only a free lock or its owner's"
        );
        locks.free(&A, l).unwrap();
        assert_eq!(b.recv_timeout(SOON).unwrap(), Err(Error::NotFound));
        assert_eq!(locks.take(&A, l), Err(Error::NotFound));
        let again = locks.alloc(&A, None, 7).unwrap();
        assert_ne!(again, l);
        locks.take(&B, again).unwrap();
    }

    #[test]
    fn a_lease_is_asked_back_by_anyone_else_and_given_back_once() {
        let arena = arena();
        let (locks, asked) = boot_asking(&arena);
        let l = locks.alloc(&A, None, 7).unwrap();
        locks.lease(&A, l).unwrap();
        // Any thread of A's component: the lease is the component's.
        let a1 = Caller { slot: 1, ..A };
        assert_eq!(locks.lease(&a1, l), Ok(()), "a re-issued lease");
        let b = take_async(&locks, B, l);
        assert_eq!(asked.recv_timeout(SOON).unwrap(), (A.component, l));
        assert!(b.recv_timeout(BLOCKED).is_err(), "B waits for the lease");
        assert_eq!(
            locks.release(&A, l),
            Err(Error::NotOwner),
            "no thread owns it"
        );
        locks.unlease(&a1, l).unwrap();
        assert_eq!(b.recv_timeout(SOON).unwrap(), Ok(()));
        // A re-issued unlease finds B the owner and leaves it so.
        assert_eq!(locks.unlease(&A, l), Ok(()));
        // B asked again at each owner check it waited through (a loaded
        // machine may delay the unlease past one): forget those.
        while asked.try_recv().is_ok() {}
        let a = std::thread::spawn({
            let locks = locks.clone();
            move || locks.lease(&A, l)
        });
        std::thread::sleep(BLOCKED);
        assert!(!a.is_finished(), "B's take is no lease: nobody is asked");
        assert!(asked.try_recv().is_err());
        locks.release(&B, l).unwrap();
        assert_eq!(a.join().unwrap(), Ok(()));
    }

    #[test]
    fn a_lease_survives_a_reboot_and_a_dead_holders_lease_is_released() {
        let arena = arena();
        let (first, _) = boot_asking(&arena);
        let l = first.alloc(&A, None, 7).unwrap();
        first.lease(&A, l).unwrap();
        drop(first);
        let (second, asked) = boot_asking(&arena);
        assert_eq!(second.alloc(&B, Some(l), 7).unwrap(), l);
        let b = take_async(&second, B, l);
        assert_eq!(asked.recv_timeout(SOON).unwrap(), (A.component, l));
        assert!(
            b.recv_timeout(BLOCKED).is_err(),
            "the lease survived the reboot"
        );
        second.client_died(A.component);
        assert_eq!(b.recv_timeout(SOON).unwrap(), Ok(()));
    }

    /// Writes an owner code into lock `l`, as a faulty incarnation could.
    fn corrupt_owner(locks: &Locks<Arc<Region>>, l: u64, code: u32) {
        locks.slots.get(l).unwrap().u32(OWNER).store(code, SeqCst);
    }

    #[test]
    fn an_owner_that_is_no_client_thread_is_cleared() {
        let arena = arena();
        let locks = boot(&arena);
        let (l, m, n) = (
            locks.alloc(&A, None, 1).unwrap(),
            locks.alloc(&A, None, 2).unwrap(),
            locks.alloc(&A, None, 3).unwrap(),
        );
        // Component 9 is no client; A has no slot 4; 0x2000_0000 names no one.
        for (lock, code) in [(l, 10 << 8), (m, (2 << 8) | 4), (n, 0x2000_0000)] {
            corrupt_owner(&locks, lock, code);
        }
        drop(locks);
        let locks = boot(&arena);
        for lock in [l, m, n] {
            assert_eq!(locks.slots.get(lock).unwrap().u32(OWNER).load(SeqCst), 0);
        }

        // Written while B waits: B's take finds it within an owner check.
        locks.take(&A, l).unwrap();
        let b = take_async(&locks, B, l);
        assert!(b.recv_timeout(BLOCKED).is_err(), "B waits while A holds it");
        corrupt_owner(&locks, l, (2 << 8) | 63);
        assert_eq!(b.recv_timeout(SOON).unwrap(), Ok(()));

        // Written under its owner: the owner's release frees it.
        corrupt_owner(&locks, l, 0x0100_0000 | (3 << 8));
        assert_eq!(locks.release(&B, l), Ok(()));
        locks.take(&A, l).unwrap();

        // A lease to a client component is possible; to another, it is not.
        locks.release(&A, l).unwrap();
        corrupt_owner(&locks, l, (2 << 8) | LEASE_SLOT);
        assert!(!locks.clear_impossible_owner(&locks.slots.get(l).unwrap()));
        corrupt_owner(&locks, l, (10 << 8) | LEASE_SLOT);
        assert!(locks.clear_impossible_owner(&locks.slots.get(l).unwrap()));
        locks.take(&A, l).unwrap();

        // A possible owner is left alone: another client thread may hold it.
        corrupt_owner(&locks, l, (3 << 8) | 1);
        assert_eq!(locks.release(&A, l), Err(Error::NotOwner));
        let b = take_async(&locks, B, l);
        assert!(b.recv_timeout(BLOCKED).is_err(), "B's slot 1 holds it");
    }
}

//! Lifelines: early, reliable news of a thread's death.
//!
//! Each thread an incarnation's runtime starts owns one lifeline word in the
//! component's control block, registered with the kernel as the only entry of
//! the thread's robust-futex list. When the thread dies, however it dies
//! (SIGKILL included), the kernel marks the word `OWNER_DIED` and wakes a
//! waiter, in `exit_mm_release`, before it tears down the address space. The
//! supervisor therefore learns that an incarnation can no longer run any code
//! as soon as its last lifeline is marked, microseconds after the fatal
//! signal, instead of after the kernel has freed all its memory (about 16 ms
//! for 256 MiB), which is when the pidfd reports the death.
//!
//! Registering replaces glibc's robust list for the thread; kintsugi
//! components do not use robust pthread mutexes.

use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};

use crate::abi::shm::SharedPod;

/// The kernel's `FUTEX_OWNER_DIED` bit.
pub const OWNER_DIED: u32 = 0x4000_0000;
/// The kernel's `FUTEX_WAITERS` bit: set it to be woken at the death.
pub const WAITERS: u32 = 0x8000_0000;
/// The owner's thread id in a lifeline word.
pub const TID_MASK: u32 = 0x3fff_ffff;

/// One thread's lifeline: a robust-list entry followed by its futex word.
#[repr(C)]
pub struct Lifeline {
    /// `struct robust_list.next`: points back at the thread's list head.
    next: AtomicUsize,
    /// Owner tid, plus `OWNER_DIED`/`WAITERS` bits; 0 when unused.
    pub word: AtomicU32,
    _pad: u32,
}
// SAFETY: repr(C), atomics and padding only; all-zero is "unused".
unsafe impl SharedPod for Lifeline {}

/// Offset of the futex word from the list entry, as the kernel expects it.
const FUTEX_OFFSET: isize = std::mem::size_of::<AtomicUsize>() as isize;

/// `struct robust_list_head`.
#[repr(C)]
struct RobustListHead {
    next: usize,
    futex_offset: isize,
    list_op_pending: usize,
}

impl Lifeline {
    /// Whether the owner of this word died (or it was never registered).
    pub fn dead(&self) -> bool {
        let w = self.word.load(Ordering::SeqCst);
        w == 0 || w & OWNER_DIED != 0
    }

    /// Makes this lifeline the calling thread's: the kernel will mark it when
    /// the thread dies. Call once per thread.
    pub fn register(&self) -> std::io::Result<()> {
        // The head must outlive the thread; it is tiny and one per thread.
        let head = Box::leak(Box::new(RobustListHead {
            next: &self.next as *const AtomicUsize as usize,
            futex_offset: FUTEX_OFFSET,
            list_op_pending: 0,
        }));
        // A circular list of one entry: the entry points back at the head.
        self.next
            .store(head as *const RobustListHead as usize, Ordering::SeqCst);
        let tid = rustix::thread::gettid().as_raw_nonzero().get() as u32;
        self.word.store(tid & TID_MASK, Ordering::SeqCst);
        // SAFETY: `head` is a valid robust_list_head that lives for the rest of
        // the process; its one entry is `self.next`, followed at FUTEX_OFFSET by
        // the 32-bit futex word, both in a shared mapping that stays mapped for
        // the process's life. The kernel only reads the list and atomically
        // updates the word.
        let r = unsafe {
            libc::syscall(
                libc::SYS_set_robust_list,
                head as *const RobustListHead,
                std::mem::size_of::<RobustListHead>(),
            )
        };
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::abi::shm::Region;
    use crate::futex;
    use std::time::Duration;

    #[test]
    fn a_dying_thread_marks_its_lifeline_and_wakes_the_waiter() {
        let region = std::sync::Arc::new(Region::create("lifeline-test", 4096).unwrap());
        let r = region.clone();
        let t = std::thread::spawn(move || {
            r.at::<Lifeline>(0).register().unwrap();
            std::thread::sleep(Duration::from_millis(20));
        });
        let line: &Lifeline = region.at(0);
        while line.word.load(Ordering::SeqCst) == 0 {
            std::thread::yield_now();
        }
        assert!(!line.dead());
        let v = line.word.fetch_or(WAITERS, Ordering::SeqCst) | WAITERS;
        futex::wait(&line.word, v, Some(Duration::from_secs(5)));
        assert!(
            line.dead(),
            "woken with the owner dead: {:#x}",
            line.word.load(Ordering::SeqCst)
        );
        t.join().unwrap();
    }
}

//! Worker threads that can start over: after a checkpoint's memory is
//! restored, each worker may begin its loop anew instead of taking back
//! the registers it had at the checkpoint.
//!
//! A checkpoint is taken at a safe point (TAC, `seeds/001_68a97066b3f6a3ed.txt`
//! §6): no worker is serving, so a worker's registers and stack frames
//! hold nothing the server's state needs; everything it serves from lives
//! in the heap. But they may hold a fault: a flipped register of a worker
//! that went idle before the fault showed is captured by the next
//! checkpoint, and every restore of it brings the fault back. Restarting
//! the workers at the top of their loop leaves such a fault behind, as a
//! micro-reboot (Candea et al.) leaves a process's corruption behind,
//! while keeping the heap the checkpoint saved.
//!
//! Each worker line records which thread it is (its thread pointer, the
//! C library's thread control block, which is what the `fs` base register
//! holds on x86-64), where its stack stood when it entered its loop, and
//! the loop itself (a closure kept in this process's memory, so that a
//! restored image holds the one it was taken with); the supervisor learns
//! the table's address, the entry point's and the stacks' size from the
//! control block ([`crate::abi::boot::Restarts`]) and, with the process
//! frozen after a restore, points each thread that is a line's (by its
//! `fs` base, and its stack pointer below the line's top) at
//! [`start_over`], its line as the argument.
//! The frames the worker had are abandoned (nothing they held is
//! dropped: a leak of a few objects per restart).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use crate::abi::boot::{Restarts, WorkerLine, LIFELINES};

/// The size of a worker thread's stack.
pub(crate) const WORKER_STACK: usize = 256 * 1024;

/// A worker's loop, run again on a restart.
type Body = Box<dyn Fn() + Send + Sync>;

/// Per worker line: its thread and where its frames begin (0: no worker).
static LINES: [WorkerLine; LIFELINES] = [const {
    WorkerLine {
        thread: AtomicU64::new(0),
        top: AtomicU64::new(0),
    }
}; LIFELINES];

/// Per worker line: its loop.
static BODIES: [OnceLock<Body>; LIFELINES] = [const { OnceLock::new() }; LIFELINES];

/// Runs `body`, worker line `line`'s loop, recording where it begins so
/// that a restart can run it again from there.
pub(crate) fn run(line: usize, body: Body) {
    let here = 0u8;
    let Some(entry) = LINES.get(line) else {
        return body();
    };
    entry.top.store(&here as *const u8 as u64, Ordering::SeqCst);
    entry.thread.store(thread_pointer(), Ordering::SeqCst);
    BODIES[line].get_or_init(|| body)();
}

/// The calling thread's thread pointer: its C library thread control
/// block, whose address glibc keeps in the `fs` base register on x86-64
/// (and returns as `pthread_self`). Were they ever to differ, no thread
/// would match its line and every worker would resume as before.
fn thread_pointer() -> u64 {
    // SAFETY: `pthread_self` has no preconditions and cannot fail.
    unsafe { libc::pthread_self() as u64 }
}

/// Where a restarted worker begins: its line's loop, on a stack whose old
/// frames are abandoned. Called by no Rust code: the supervisor sets a
/// frozen thread's instruction pointer here (System V: the line in
/// `rdi`, the stack pointer 8 bytes below a 16-byte boundary).
extern "C" fn start_over(line: usize) -> ! {
    if let Some(body) = BODIES.get(line).and_then(OnceLock::get) {
        body();
    }
    // A loop that ends is a worker retired: it waits for the process's end.
    loop {
        std::thread::park();
    }
}

/// Publishes this process's restart point in its control block.
pub(crate) fn publish(restarts: &Restarts) {
    restarts.publish(
        start_over as *const () as u64,
        LINES.as_ptr() as u64,
        WORKER_STACK as u64,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_records_its_thread_where_its_stack_stood_and_its_first_loop() {
        let line = LIFELINES - 1;
        let ran = std::sync::Arc::new(AtomicU64::new(0));
        let r = ran.clone();
        let outer = 0u8;
        run(
            line,
            Box::new(move || {
                r.fetch_add(1, Ordering::SeqCst);
            }),
        );
        let top = LINES[line].top.load(Ordering::SeqCst);
        assert_eq!(LINES[line].thread.load(Ordering::SeqCst), thread_pointer());
        let outer = &outer as *const u8 as u64;
        // On this thread's stack, near this frame (`run` may be inlined
        // into it, so either side of `outer`).
        assert!(
            top != 0 && top.abs_diff(outer) < 4096,
            "{top:#x} {outer:#x}"
        );
        // A second run of the same line keeps the loop it had.
        run(line, Box::new(|| panic!("not this one")));
        assert_eq!(ran.load(Ordering::SeqCst), 2);
    }
}

//! Threads started over after a restore: a thread the process names (by
//! its `fs` base, the thread pointer) whose stack pointer lies below the
//! top the process gives for it is pointed at an entry point, its
//! registers otherwise cleared, instead of resuming where the image had
//! it. The process says which stacks and which entry (kintsugi's runtime:
//! its worker threads, each at the top of its loop, see
//! `kintsugi_runtime`'s `restart.rs`); this module knows nothing of
//! what runs there. It is how a restore leaves behind a fault held in the
//! registers or frames of a thread that was idle at the checkpoint (TAC's
//! safe point, `seeds/001_68a97066b3f6a3ed.txt` §6), keeping the memory.

use std::os::unix::fs::FileExt;

use crate::checkpoint::Checkpointer;
use crate::freeze::Frozen;
use crate::Error;

/// Where threads start over, as the process publishes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StartOver {
    /// The function a thread begins in; its argument (in `rdi`) is the
    /// index of the thread's line.
    pub entry: u64,
    /// The address, in the process, of `lines` pairs of words: a thread's
    /// `fs` base (0: none) and the address its frames begin below.
    pub table: u64,
    pub lines: usize,
    /// A stack's size: a line's thread whose stack pointer lies within
    /// this many bytes below its top is started over.
    pub stack: u64,
}

/// Bytes left free below a stack's top before the new frames.
const MARGIN: u64 = 256;

impl Checkpointer {
    /// Points every thread of `frozen` whose stack pointer lies in one of
    /// the stacks `at` names at `at.entry` (see the module doc); returns
    /// how many were. Called after a restore, before the process runs.
    pub fn start_over(&self, frozen: &Frozen, at: &StartOver) -> Result<usize, Error> {
        let pid = frozen.pid();
        let mut words = vec![0u8; at.lines * 16];
        self.mem()
            .read_exact_at(&mut words, at.table)
            .map_err(|e| Error::Unrestorable {
                pid,
                detail: format!("reading the threads' table at {:#x}: {e}", at.table),
            })?;
        let word = |w: &[u8]| u64::from_ne_bytes(w.try_into().expect("8 bytes"));
        let lines: Vec<Line> = words
            .chunks_exact(16)
            .map(|l| Line {
                thread: word(&l[..8]),
                top: word(&l[8..]),
            })
            .collect();
        let mut started = 0;
        for &tid in frozen.tids() {
            let mut regs = frozen.regs(tid)?;
            let Some(line) = line_of(&lines, at.stack, regs.fs_base, regs.rsp) else {
                continue;
            };
            // Segments and the TLS base stay; every general register is cleared.
            for r in [
                &mut regs.rax,
                &mut regs.rbx,
                &mut regs.rcx,
                &mut regs.rdx,
                &mut regs.rsi,
                &mut regs.rbp,
                &mut regs.r8,
                &mut regs.r9,
                &mut regs.r10,
                &mut regs.r11,
                &mut regs.r12,
                &mut regs.r13,
                &mut regs.r14,
                &mut regs.r15,
            ] {
                *r = 0;
            }
            regs.rip = at.entry;
            regs.rdi = line as u64;
            // As if called: 8 bytes below a 16-byte boundary.
            regs.rsp = ((lines[line].top - MARGIN) & !15) - 8;
            regs.eflags = 0x202; // IF, and the reserved bit
                                 // No system call to restart: the thread was stopped in one.
            regs.orig_rax = u64::MAX;
            frozen.set_regs(tid, regs)?;
            started += 1;
        }
        Ok(started)
    }
}

/// One thread the process names.
#[derive(Debug, Clone, Copy)]
struct Line {
    thread: u64,
    top: u64,
}

/// The line of the thread whose `fs` base is `thread`, if its stack
/// pointer `sp` lies at most `stack` bytes below the line's top.
fn line_of(lines: &[Line], stack: u64, thread: u64, sp: u64) -> Option<usize> {
    lines.iter().position(|l| {
        l.thread != 0 && l.thread == thread && l.top > MARGIN && sp <= l.top && l.top - sp < stack
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_is_its_lines_by_its_thread_pointer_and_below_its_top() {
        let line = |thread, top| Line { thread, top };
        let lines = [line(0, 0), line(0xa000, 0x10_0000), line(0xb000, 0x20_0000)];
        let stack = 0x4_0000;
        assert_eq!(line_of(&lines, stack, 0xa000, 0x0f_ff00), Some(1));
        assert_eq!(line_of(&lines, stack, 0xb000, 0x1f_0000), Some(2));
        assert_eq!(
            line_of(&lines, stack, 0xb000, 0x0f_ff00),
            None,
            "another's stack"
        );
        assert_eq!(
            line_of(&lines, stack, 0xc000, 0x0f_ff00),
            None,
            "no line's thread"
        );
        assert_eq!(
            line_of(&lines, stack, 0xa000, 0x10_0008),
            None,
            "above its top"
        );
        assert_eq!(
            line_of(&lines, stack, 0xa000, 0x0b_0000),
            None,
            "below its stack"
        );
        assert_eq!(line_of(&lines, stack, 0, 0x100), None, "no worker");
    }
}

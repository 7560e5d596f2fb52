//! Threads started over after a restore: a thread whose stack pointer
//! lies in a stack the process names is pointed at an entry point, its
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
    /// index of the stack the thread's stack pointer lay in.
    pub entry: u64,
    /// The address, in the process, of `lines` words: each the address a
    /// stack's frames begin below (0: none).
    pub tops: u64,
    pub lines: usize,
    /// A stack's size: a stack pointer within this many bytes below a top
    /// is in that stack.
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
        let mut words = vec![0u8; at.lines * 8];
        self.mem()
            .read_exact_at(&mut words, at.tops)
            .map_err(|e| Error::Unrestorable {
                pid,
                detail: format!("reading the stacks' table at {:#x}: {e}", at.tops),
            })?;
        let tops: Vec<u64> = words
            .chunks_exact(8)
            .map(|w| u64::from_ne_bytes(w.try_into().expect("8 bytes")))
            .collect();
        let mut started = 0;
        for &tid in frozen.tids() {
            let mut regs = frozen.regs(tid)?;
            let Some(line) = line_of(&tops, at.stack, regs.rsp) else {
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
            regs.rsp = ((tops[line] - MARGIN) & !15) - 8;
            regs.eflags = 0x202; // IF, and the reserved bit
                                 // No system call to restart: the thread was stopped in one.
            regs.orig_rax = u64::MAX;
            frozen.set_regs(tid, regs)?;
            started += 1;
        }
        Ok(started)
    }
}

/// The index of the stack `sp` lies in: at most `stack` bytes below its
/// top.
fn line_of(tops: &[u64], stack: u64, sp: u64) -> Option<usize> {
    tops.iter()
        .position(|&top| top > MARGIN && sp <= top && top - sp < stack)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stack_pointer_is_in_the_stack_whose_top_is_at_most_a_stack_above() {
        let tops = [0, 0x10_0000, 0x20_0000];
        assert_eq!(line_of(&tops, 0x4_0000, 0x0f_ff00), Some(1));
        assert_eq!(line_of(&tops, 0x4_0000, 0x1f_0000), Some(2));
        assert_eq!(line_of(&tops, 0x4_0000, 0x10_0008), None, "above a top");
        assert_eq!(line_of(&tops, 0x4_0000, 0x15_0000), None, "below a stack");
        assert_eq!(line_of(&tops, 0x4_0000, 0x100), None, "no worker");
    }
}

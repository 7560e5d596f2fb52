//! Restoring an image into another process, one that did not take it: a
//! new incarnation of the same program (RTCR's restore into a fresh
//! protection domain, and what a migrated image is restored into). The
//! process must run the same executable with the same layout of code (the
//! same binary and libraries at the same addresses: forked from the same
//! pristine image, or started with address randomization off) and as many
//! threads; the rest is made to match: the break, every private mapping
//! and its contents, every thread's registers, thread `i` of the image
//! going to thread `i` of the process. A process forked from the same
//! pristine image as the image's (a standby) still holds most of what the
//! image holds, shared with that pristine image: a mapping where it has
//! one of the same kind is kept, its pages compared with the image's, and
//! only those that differ are written. kintsugi's runtime starts a
//! component's worker threads one at a time, so that every incarnation
//! puts their stacks at the same addresses and a restore keeps them too
//! (kv under its clients: about 280 pages compared and 150 written, and
//! one to three mappings made anew).
//!
//! What differs between the two processes is the threads' ids and two
//! words per thread that the kernel knows by address: the id the C library
//! keeps in each thread's descriptor (the word the kernel clears when the
//! thread exits, `clear_child_tid`; a checkpoint records its address with
//! `prctl(PR_GET_TID_ADDRESS)`, asked once per thread) and the thread's
//! restartable-sequences area, which the kernel writes the current CPU
//! into on every return to user space (`PTRACE_GET_RSEQ_CONFIGURATION`).
//! Each new thread unregisters its own rseq area and is pointed at the
//! image's id word before the restore (thread stacks may lie elsewhere in
//! the two layouts: the kernel must not write into restored memory by an
//! old address), and afterwards the image's id word gets the new id and
//! the image's rseq area is registered. Kernel state beyond
//! the mappings and registers (descriptors, signal masks and handlers,
//! timers) is the new process's own.

use std::os::unix::fs::FileExt;

use crate::checkpoint::{Checkpointer, Stats};
use crate::freeze::Frozen;
use crate::image::{Image, ThreadState};
use crate::remote::{Crew, Syscall};
use crate::restore::{restore_threads, Memory};
use crate::{sys, Error};

impl Checkpointer {
    /// Restores `image` into this process, which is not the one it was
    /// taken from (see the module doc).
    pub fn restore_new_frozen(&mut self, frozen: &Frozen, image: Image) -> Result<Stats, Error> {
        self.retire_previous();
        let pid = self.pid();
        let exe = self.image().exe.clone();
        // From here on the image is this checkpointer's, whatever fails:
        // [`Checkpointer::into_image`] gives it back.
        self.forget_read_ahead();
        *self.parts().image = image;
        let image = self.image();
        if image.exe != exe {
            return Err(Error::Unrestorable {
                pid,
                detail: format!("the image is of {}, the process runs {exe}", image.exe),
            });
        }
        if image.threads.len() != frozen.tids().len() {
            return Err(Error::ThreadsChanged {
                pid,
                at_checkpoint: image.threads.iter().map(|t| t.tid).collect(),
                now: frozen.tids().to_vec(),
            });
        }
        same_shared_layout(pid, image)?;
        let pairs = thread_pairs(image, frozen);
        self.parts().image.pid = pid;
        let placed = self.leave_own_words(frozen, &pairs)?;
        let stats = self.restore_with(frozen, Memory::Sibling, &pairs)?;
        self.take_image_words(frozen, &pairs, &placed)?;
        // The system calls just made ran in the threads, which the kernel
        // may answer by saving their extended state anew: set it again.
        restore_threads(self.image(), frozen, &pairs)?;
        self.adopt_threads(&pairs);
        Ok(stats)
    }

    /// Before the restore: each thread `new` lets go of the words the
    /// kernel writes in its own layout (its rseq area is unregistered) and
    /// is pointed at the image's thread `old`'s id word (`set_tid_address`
    /// only records the address). Done while their registers are their
    /// own; all threads at once, a call each per round.
    ///
    /// A thread whose descriptor already lies where the image's thread's
    /// does (when the component's incarnations laid their threads out
    /// alike, as kintsugi's runtime makes them) needs neither: its rseq area is the image's, and its
    /// id word, which holds its id, is at the image's id word's address;
    /// in C libraries that keep both in the thread's descriptor, as glibc
    /// does, that is also where the kernel clears it. Returns those
    /// threads (new ids), which [`Self::take_image_words`] leaves
    /// registered.
    fn leave_own_words(
        &mut self,
        frozen: &Frozen,
        pairs: &[(u32, u32)],
    ) -> Result<Vec<u32>, Error> {
        let parts = self.parts();
        let mut unregister = Vec::new();
        let mut point = Vec::new();
        let mut placed = Vec::new();
        for &(old, new) in pairs {
            let own = sys::rseq_config(new as i32).map_err(|e| Error::Kernel {
                what: "PTRACE_GET_RSEQ_CONFIGURATION",
                source: e,
            })?;
            let image = thread(parts.image, old)?;
            let same_rseq = own.address != 0
                && own.address == image.rseq.address
                && own.len == image.rseq.len
                && own.signature == image.rseq.signature;
            if same_rseq && holds_id(parts.mem, image.tid_address, new) {
                placed.push(new);
                continue;
            }
            if own.address != 0 {
                let args = [
                    own.address,
                    own.len as u64,
                    RSEQ_FLAG_UNREGISTER,
                    own.signature as u64,
                    0,
                    0,
                ];
                let call = Syscall::new("rseq(RSEQ_FLAG_UNREGISTER)", libc::SYS_rseq, args);
                unregister.push((new, call));
            }
            let addr = thread(parts.image, old)?.tid_address;
            if addr != 0 {
                let args = [addr, 0, 0, 0, 0, 0];
                point.push((
                    new,
                    Syscall::new("set_tid_address", libc::SYS_set_tid_address, args),
                ));
            }
        }
        let mut crew = Crew::new(frozen, parts.insn);
        crew.run(&unregister)?;
        crew.run(&point)?;
        crew.finish()?;
        Ok(placed)
    }

    /// After the restore: each thread `new`'s id goes into the image's id
    /// word of thread `old` (which must hold `old`), and the image's rseq
    /// area is registered for it (all threads at once) unless it is
    /// `placed` (registered there already).
    fn take_image_words(
        &mut self,
        frozen: &Frozen,
        pairs: &[(u32, u32)],
        placed: &[u32],
    ) -> Result<(), Error> {
        let parts = self.parts();
        let mem_err = |e| Error::proc(&format!("/proc/{}/mem", parts.pid), e);
        let mut register = Vec::new();
        for &(old, new) in pairs {
            let t = thread(parts.image, old)?;
            if t.tid_address != 0 {
                let mut word = [0u8; 4];
                parts
                    .mem
                    .read_exact_at(&mut word, t.tid_address)
                    .map_err(mem_err)?;
                if u32::from_le_bytes(word) != old {
                    return Err(Error::Unrestorable {
                        pid: parts.pid,
                        detail: format!(
                            "thread {old}'s id word at {:#x} holds {} in the image",
                            t.tid_address,
                            u32::from_le_bytes(word)
                        ),
                    });
                }
                parts
                    .mem
                    .write_all_at(&new.to_le_bytes(), t.tid_address)
                    .map_err(mem_err)?;
            }
            if t.rseq.address != 0 && !placed.contains(&new) {
                let args = [
                    t.rseq.address,
                    t.rseq.len as u64,
                    0,
                    t.rseq.signature as u64,
                    0,
                    0,
                ];
                register.push((new, Syscall::new("rseq", libc::SYS_rseq, args)));
            }
        }
        let mut crew = Crew::new(frozen, parts.insn);
        crew.run(&register)?;
        crew.finish()
    }

    /// Makes the image this process's own: its threads renamed, their id
    /// words holding the new ids, so that a later in-place restore or
    /// checkpoint finds what the process has.
    fn adopt_threads(&mut self, pairs: &[(u32, u32)]) {
        let parts = self.parts();
        for &(old, new) in pairs {
            let Some(t) = parts.image.threads.iter_mut().find(|t| t.tid == old) else {
                continue;
            };
            t.tid = new;
            let addr = t.tid_address;
            parts.tid_addresses.insert(new, addr);
            if addr == 0 || old == new {
                continue;
            }
            if let Some((_, area)) = parts.image.areas.range_mut(..=addr).next_back() {
                if addr + 4 <= area.map.end {
                    let at = (addr - area.map.start) as usize;
                    area.data[at..at + 4].copy_from_slice(&new.to_le_bytes());
                }
            }
        }
        parts
            .tid_addresses
            .retain(|tid, _| pairs.iter().any(|&(_, new)| new == *tid));
    }
}

/// Which thread of `frozen` takes which thread of `image` in a restore
/// into a new process (by tid, the image's first): thread `i` of the
/// image goes to thread `i` of the process.
pub fn thread_pairs(image: &Image, frozen: &Frozen) -> Vec<(u32, u32)> {
    image
        .threads
        .iter()
        .map(|t| t.tid)
        .zip(frozen.tids().iter().copied())
        .collect()
}

/// Whether the 4-byte word at `addr` (0: none) of the process whose
/// memory `mem` is holds thread id `tid`.
fn holds_id(mem: &std::fs::File, addr: u64, tid: u32) -> bool {
    let mut word = [0u8; 4];
    addr != 0 && mem.read_exact_at(&mut word, addr).is_ok() && u32::from_le_bytes(word) == tid
}

/// `RSEQ_FLAG_UNREGISTER`.
const RSEQ_FLAG_UNREGISTER: u64 = 1;

fn thread(image: &Image, tid: u32) -> Result<&ThreadState, Error> {
    image
        .threads
        .iter()
        .find(|t| t.tid == tid)
        .ok_or(Error::NoCheckpoint(tid))
}

/// Every shared mapping of the image must be in process `pid` at the same
/// address, with the same size and protection: the restored memory points
/// into them (an edge, the control block), and they are not restored.
fn same_shared_layout(pid: u32, image: &Image) -> Result<(), Error> {
    let now = crate::maps::read(pid)?;
    for m in &image.shared {
        let found = now
            .iter()
            .any(|n| n.start == m.start && n.end == m.end && n.prot == m.prot);
        if !found {
            return Err(Error::Unrestorable {
                pid,
                detail: format!(
                    "the image expects shared mapping {} at {:#x}-{:#x}, which this process does not have there (its system is wired differently, or its address space is randomized)",
                    if m.name.is_empty() { "(anonymous)" } else { &m.name },
                    m.start,
                    m.end
                ),
            });
        }
    }
    Ok(())
}

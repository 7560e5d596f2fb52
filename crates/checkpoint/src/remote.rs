//! System calls made by a stopped thread of another process on our
//! behalf (CRIU's parasite, reduced to single instructions): the thread's
//! registers are saved, set to a system call's number and arguments with
//! the instruction pointer on a `syscall` instruction found in the
//! target's own executable memory, stepped once, and restored. Used for
//! what only the target can do to itself: create its userfaultfd, change
//! its mappings and its program break, and (each thread for itself) its
//! rseq registration and id word.
//!
//! A [`Crew`] makes a batch: each thread's registers are saved once and
//! put back once, and the calls of one round, one per thread, are all
//! stepped before any is collected. Each call still costs a switch into
//! the target and back: on this project's 2-vCPU machines, restoring kv
//! under its clients, a round of 18 calls took 200–550 µs either way,
//! about what one at a time took (`docs/benchmarks.md`).

use std::fs::File;
use std::os::unix::fs::FileExt;

use nix::libc::user_regs_struct;

use crate::freeze::Frozen;
use crate::maps::Mapping;
use crate::Error;

/// The `syscall` instruction.
const SYSCALL: [u8; 2] = [0x0f, 0x05];

/// Finds a `syscall` instruction in an executable mapping of the target.
pub fn find_syscall_insn(pid: u32, maps: &[Mapping]) -> Result<u64, Error> {
    let path = format!("/proc/{pid}/mem");
    let mem = File::open(&path).map_err(|e| Error::proc(&path, e))?;
    // libc's text first: it is certain to hold one.
    let mut exec: Vec<&Mapping> = maps
        .iter()
        .filter(|m| m.prot.exec && m.prot.read && !m.name.starts_with('['))
        .collect();
    exec.sort_by_key(|m| !m.name.contains("libc"));
    let mut buf = vec![0u8; 1 << 20];
    for m in exec {
        let mut at = m.start;
        while at < m.end {
            let n = ((m.end - at) as usize).min(buf.len());
            let Ok(got) = mem.read_at(&mut buf[..n], at) else {
                break;
            };
            if let Some(i) = buf[..got].windows(2).position(|w| w == SYSCALL) {
                return Ok(at + i as u64);
            }
            if got < 2 {
                break;
            }
            // Overlap by one byte so that a pair across the cut is found.
            at += got as u64 - 1;
        }
    }
    Err(Error::Malformed {
        what: format!("process {pid}"),
        detail: "no syscall instruction in its executable memory".into(),
    })
}

/// One system call for a thread of the target to make.
#[derive(Debug, Clone, Copy)]
pub struct Syscall {
    /// What it is for, in errors.
    pub what: &'static str,
    pub nr: i64,
    pub args: [u64; 6],
}

impl Syscall {
    pub fn new(what: &'static str, nr: i64, args: [u64; 6]) -> Self {
        Self { what, nr, args }
    }
}

/// Threads of a frozen process lent out to make system calls on our
/// behalf, several at once (one per thread: a step costs mostly the wait
/// for the thread to run, and those waits overlap). Each thread's
/// registers are saved before its first call and put back by
/// [`Crew::finish`], or when the crew is dropped.
pub struct Crew<'a> {
    frozen: &'a Frozen,
    /// A `syscall` instruction in the target's executable memory.
    insn: u64,
    saved: Vec<(u32, user_regs_struct)>,
}

impl<'a> Crew<'a> {
    pub fn new(frozen: &'a Frozen, insn: u64) -> Self {
        Self {
            frozen,
            insn,
            saved: Vec::new(),
        }
    }

    /// Makes each call in the thread named beside it (the threads
    /// distinct), all at once; returns their results in order, a negative
    /// result as an error naming the call.
    pub fn run(&mut self, calls: &[(u32, Syscall)]) -> Result<Vec<u64>, Error> {
        let mut result = Ok(());
        let mut started = Vec::with_capacity(calls.len());
        for &(tid, call) in calls {
            match self
                .load(tid, call)
                .and_then(|()| self.frozen.start_step(tid))
            {
                Ok(()) => started.push((tid, call)),
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        // Every step started is collected, whatever failed.
        let mut out = Vec::with_capacity(started.len());
        for (tid, call) in started {
            let done = self
                .frozen
                .finish_step(tid)
                .and_then(|()| self.frozen.regs(tid))
                .and_then(|after| self.answer(tid, call, after));
            match done {
                Ok(r) => out.push(r),
                Err(e) => result = result.and(Err(e)),
            }
        }
        result.map(|()| out)
    }

    /// Makes `calls`, spread over the process's threads, as many at once
    /// as it has threads (for calls any thread may make, on disjoint
    /// ranges of memory: their order is not kept).
    pub fn spread(&mut self, calls: &[Syscall]) -> Result<Vec<u64>, Error> {
        let tids = self.frozen.tids();
        let mut out = Vec::with_capacity(calls.len());
        for round in calls.chunks(tids.len().max(1)) {
            let pairs: Vec<(u32, Syscall)> =
                tids.iter().copied().zip(round.iter().copied()).collect();
            out.extend(self.run(&pairs)?);
        }
        Ok(out)
    }

    /// Puts every thread's registers back as they were before its first
    /// call.
    pub fn finish(mut self) -> Result<(), Error> {
        self.put_back()
    }

    /// Sets `tid`'s registers to make `call` from the `syscall`
    /// instruction, saving them first if this is its first call.
    fn load(&mut self, tid: u32, call: Syscall) -> Result<(), Error> {
        let saved = match self.saved.iter().find(|(t, _)| *t == tid) {
            Some(&(_, regs)) => regs,
            None => {
                let regs = self.frozen.regs(tid)?;
                self.saved.push((tid, regs));
                regs
            }
        };
        let mut regs = saved;
        regs.rax = call.nr as u64;
        regs.rdi = call.args[0];
        regs.rsi = call.args[1];
        regs.rdx = call.args[2];
        regs.r10 = call.args[3];
        regs.r8 = call.args[4];
        regs.r9 = call.args[5];
        regs.rip = self.insn;
        // Not inside a system call: no restart logic may rewind this one.
        regs.orig_rax = u64::MAX;
        self.frozen.set_regs(tid, regs)
    }

    /// The result of `call`, made by `tid`, from its registers after it.
    fn answer(&self, tid: u32, call: Syscall, after: user_regs_struct) -> Result<u64, Error> {
        if after.rip != self.insn + 2 {
            return Err(Error::Malformed {
                what: format!("thread {tid}"),
                detail: format!(
                    "injected system call {} at {:#x} stopped at {:#x} (rax {:#x})",
                    call.nr, self.insn, after.rip, after.rax
                ),
            });
        }
        let r = after.rax as i64;
        if (-4095..0).contains(&r) {
            return Err(Error::Remote {
                call: call.what.to_string(),
                pid: self.frozen.pid(),
                source: std::io::Error::from_raw_os_error(-r as i32),
            });
        }
        Ok(r as u64)
    }

    fn put_back(&mut self) -> Result<(), Error> {
        let mut result = Ok(());
        for (tid, regs) in self.saved.drain(..) {
            result = result.and(self.frozen.set_regs(tid, regs));
        }
        result
    }
}

impl Drop for Crew<'_> {
    fn drop(&mut self) {
        // Best effort on the way out of an error; `finish` reports.
        let _ = self.put_back();
    }
}

/// Makes system call `nr` with `args` in thread `tid` of the frozen
/// process, from the `syscall` instruction at `insn`, and puts the
/// thread's registers back; a negative result is an error naming `what`.
pub fn checked(
    frozen: &Frozen,
    tid: u32,
    insn: u64,
    what: &'static str,
    nr: i64,
    args: [u64; 6],
) -> Result<u64, Error> {
    let mut crew = Crew::new(frozen, insn);
    let r = crew.run(&[(tid, Syscall::new(what, nr, args))]);
    let restored = crew.finish();
    let r = r?;
    restored?;
    Ok(r[0])
}

/// Below a thread's stack pointer, past its red zone: where a system
/// call's result is written and read back.
const SCRATCH_BELOW_SP: u64 = 4096;

/// Thread `tid`'s `clear_child_tid` address (`prctl(PR_GET_TID_ADDRESS)`,
/// made by the thread, its answer written to scratch space below its
/// stack pointer and the bytes there put back).
pub fn tid_address(frozen: &Frozen, mem: &File, tid: u32, insn: u64) -> Result<u64, Error> {
    let scratch = (frozen.regs(tid)?.rsp - SCRATCH_BELOW_SP) & !7;
    let mem_err = |e| Error::proc(&format!("/proc/{}/mem", frozen.pid()), e);
    let mut saved = [0u8; 8];
    mem.read_exact_at(&mut saved, scratch).map_err(mem_err)?;
    let args = [libc::PR_GET_TID_ADDRESS as u64, scratch, 0, 0, 0, 0];
    let asked = checked(
        frozen,
        tid,
        insn,
        "prctl(PR_GET_TID_ADDRESS)",
        libc::SYS_prctl,
        args,
    );
    let mut addr = [0u8; 8];
    let read = mem.read_exact_at(&mut addr, scratch).map_err(mem_err);
    mem.write_all_at(&saved, scratch).map_err(mem_err)?;
    asked?;
    read?;
    Ok(u64::from_le_bytes(addr))
}

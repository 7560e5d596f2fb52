//! System calls made by a stopped thread of another process on our
//! behalf (CRIU's parasite, reduced to single instructions): the thread's
//! registers are saved, set to a system call's number and arguments with
//! the instruction pointer on a `syscall` instruction found in the
//! target's own executable memory, stepped once, and restored. Used for
//! what only the target can do to itself: create its userfaultfd, change
//! its mappings and its program break.

use std::fs::File;
use std::os::unix::fs::FileExt;

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

/// Makes system call `nr` with `args` in thread `tid` of the frozen
/// process, from the `syscall` instruction at `insn`; returns its result
/// (a negative errno on failure, as the kernel returns it).
pub fn syscall(
    frozen: &Frozen,
    tid: u32,
    insn: u64,
    nr: i64,
    args: [u64; 6],
) -> Result<i64, Error> {
    let saved = frozen.regs(tid)?;
    let mut regs = saved;
    regs.rax = nr as u64;
    regs.rdi = args[0];
    regs.rsi = args[1];
    regs.rdx = args[2];
    regs.r10 = args[3];
    regs.r8 = args[4];
    regs.r9 = args[5];
    regs.rip = insn;
    // Not inside a system call: no restart logic may rewind this one.
    regs.orig_rax = u64::MAX;
    frozen.set_regs(tid, regs)?;
    let stepped = frozen.step(tid);
    let after = stepped.and_then(|()| frozen.regs(tid));
    // Put the thread back as it was whatever happened.
    let restored = frozen.set_regs(tid, saved);
    let after = after?;
    restored?;
    if after.rip != insn + 2 {
        return Err(Error::Malformed {
            what: format!("thread {tid}"),
            detail: format!(
                "injected system call {nr} at {insn:#x} stopped at {:#x} (rax {:#x})",
                after.rip, after.rax
            ),
        });
    }
    Ok(after.rax as i64)
}

/// [`syscall`], with a negative result turned into an error naming `what`.
pub fn checked(
    frozen: &Frozen,
    tid: u32,
    insn: u64,
    what: &str,
    nr: i64,
    args: [u64; 6],
) -> Result<u64, Error> {
    let r = syscall(frozen, tid, insn, nr, args)?;
    if (-4095..0).contains(&r) {
        return Err(Error::Remote {
            call: what.to_string(),
            pid: frozen.pid(),
            source: std::io::Error::from_raw_os_error(-r as i32),
        });
    }
    Ok(r as u64)
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

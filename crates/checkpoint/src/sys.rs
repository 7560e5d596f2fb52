//! The kernel interfaces that no safe wrapper covers, declared by hand
//! (Debian's headers are older than the kernel): the userfaultfd ioctls
//! (`UFFDIO_API`, `UFFDIO_REGISTER`, `UFFDIO_WRITEPROTECT`), the
//! `PAGEMAP_SCAN` ioctl on `/proc/<pid>/pagemap` (Linux 6.7,
//! `Documentation/admin-guide/mm/pagemap.rst`), and `PTRACE_GETREGSET` /
//! `PTRACE_SETREGSET` for a thread's whole extended register state
//! (`NT_X86_XSTATE`), and `PTRACE_GET_RSEQ_CONFIGURATION` (Linux 5.13).
//! Every call here takes a descriptor or tid and plain
//! data; nothing returns memory borrowed from the kernel.

#![allow(unsafe_code)]

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

// <linux/userfaultfd.h>
const UFFD_API: u64 = 0xAA;
pub const UFFD_FEATURE_WP_UNPOPULATED: u64 = 1 << 13;
pub const UFFD_FEATURE_WP_ASYNC: u64 = 1 << 15;
const UFFDIO_REGISTER_MODE_WP: u64 = 1 << 1;
const UFFDIO_WRITEPROTECT_MODE_WP: u64 = 1 << 0;
/// `UFFD_USER_MODE_ONLY`: the flag that lets an unprivileged process create
/// one (faults from kernel mode are not reported, and with async
/// write-protection none is reported at all).
pub const UFFD_USER_MODE_ONLY: u64 = 1;

#[repr(C)]
#[derive(Default)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

#[repr(C)]
#[derive(Default)]
struct UffdioRange {
    start: u64,
    len: u64,
}

#[repr(C)]
#[derive(Default)]
struct UffdioRegister {
    range: UffdioRange,
    mode: u64,
    ioctls: u64,
}

#[repr(C)]
#[derive(Default)]
struct UffdioWriteprotect {
    range: UffdioRange,
    mode: u64,
}

const fn iowr(ty: u8, nr: u8, size: usize) -> libc::c_ulong {
    ((3u64 << 30) | ((size as u64) << 16) | ((ty as u64) << 8) | nr as u64) as libc::c_ulong
}

const UFFDIO_API: libc::c_ulong = iowr(0xAA, 0x3F, std::mem::size_of::<UffdioApi>());
const UFFDIO_REGISTER: libc::c_ulong = iowr(0xAA, 0x00, std::mem::size_of::<UffdioRegister>());
const UFFDIO_WRITEPROTECT: libc::c_ulong =
    iowr(0xAA, 0x06, std::mem::size_of::<UffdioWriteprotect>());

// <linux/fs.h>
pub const PAGE_IS_WRITTEN: u64 = 1 << 1;
pub const PAGE_IS_PRESENT: u64 = 1 << 3;
pub const PAGE_IS_SWAPPED: u64 = 1 << 4;
pub const PM_SCAN_WP_MATCHING: u64 = 1 << 0;
pub const PM_SCAN_CHECK_WPASYNC: u64 = 1 << 1;

#[repr(C)]
#[derive(Default)]
struct PmScanArg {
    size: u64,
    flags: u64,
    start: u64,
    end: u64,
    walk_end: u64,
    vec: u64,
    vec_len: u64,
    max_pages: u64,
    category_inverted: u64,
    category_mask: u64,
    category_anyof_mask: u64,
    return_mask: u64,
}

/// One run of pages a scan matched: `[start, end)` and their categories.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PageRegion {
    pub start: u64,
    pub end: u64,
    pub categories: u64,
}

const PAGEMAP_SCAN: libc::c_ulong = iowr(b'f', 16, std::mem::size_of::<PmScanArg>());

fn check(ret: libc::c_int) -> io::Result<libc::c_int> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// `UFFDIO_API`: the handshake, asking for `features`; returns what the
/// kernel granted.
pub fn uffd_api(uffd: BorrowedFd<'_>, features: u64) -> io::Result<u64> {
    let mut api = UffdioApi {
        api: UFFD_API,
        features,
        ioctls: 0,
    };
    // SAFETY: `api` is a live, properly sized `struct uffdio_api` that the
    // kernel reads and writes for the duration of the call only.
    check(unsafe { libc::ioctl(uffd.as_raw_fd(), UFFDIO_API, &mut api) })?;
    Ok(api.features)
}

/// `UFFDIO_REGISTER` of `[start, start + len)` for write-protection (the
/// range is in the address space of the process that created `uffd`).
pub fn uffd_register_wp(uffd: BorrowedFd<'_>, start: u64, len: u64) -> io::Result<()> {
    let mut reg = UffdioRegister {
        range: UffdioRange { start, len },
        mode: UFFDIO_REGISTER_MODE_WP,
        ioctls: 0,
    };
    // SAFETY: `reg` is a live `struct uffdio_register`, read and written by
    // the kernel during the call only.
    check(unsafe { libc::ioctl(uffd.as_raw_fd(), UFFDIO_REGISTER, &mut reg) })?;
    Ok(())
}

/// `UFFDIO_WRITEPROTECT`: write-protects `[start, start + len)` (with
/// `UFFD_FEATURE_WP_UNPOPULATED`, pages not yet populated too).
pub fn uffd_write_protect(uffd: BorrowedFd<'_>, start: u64, len: u64) -> io::Result<()> {
    let mut wp = UffdioWriteprotect {
        range: UffdioRange { start, len },
        mode: UFFDIO_WRITEPROTECT_MODE_WP,
    };
    // SAFETY: `wp` is a live `struct uffdio_writeprotect`, used by the
    // kernel during the call only.
    check(unsafe { libc::ioctl(uffd.as_raw_fd(), UFFDIO_WRITEPROTECT, &mut wp) })?;
    Ok(())
}

/// `UFFDIO_WRITEPROTECT` with the mode cleared: lifts the protection of
/// `[start, start + len)`, which asynchronous write-protection then
/// reports as written.
pub fn uffd_unprotect(uffd: BorrowedFd<'_>, start: u64, len: u64) -> io::Result<()> {
    let mut wp = UffdioWriteprotect {
        range: UffdioRange { start, len },
        mode: 0,
    };
    // SAFETY: `wp` is a live `struct uffdio_writeprotect`, used by the
    // kernel during the call only.
    check(unsafe { libc::ioctl(uffd.as_raw_fd(), UFFDIO_WRITEPROTECT, &mut wp) })?;
    Ok(())
}

/// What one `PAGEMAP_SCAN` asks for.
#[derive(Debug, Clone, Copy, Default)]
pub struct Scan {
    pub flags: u64,
    pub category_mask: u64,
    pub category_anyof_mask: u64,
    pub return_mask: u64,
}

/// `PAGEMAP_SCAN` over `[start, end)` of the process whose `pagemap` is
/// open as `pagemap`, appending matching runs to `out`. Runs until the
/// whole range is walked (the kernel stops early when `out`'s spare
/// capacity fills; the walk resumes from where it stopped).
pub fn pagemap_scan(
    pagemap: BorrowedFd<'_>,
    start: u64,
    end: u64,
    scan: Scan,
    out: &mut Vec<PageRegion>,
) -> io::Result<()> {
    const BATCH: usize = 512;
    let mut at = start;
    while at < end {
        out.reserve(BATCH);
        let spare = out.spare_capacity_mut();
        let mut arg = PmScanArg {
            size: std::mem::size_of::<PmScanArg>() as u64,
            flags: scan.flags,
            start: at,
            end,
            vec: spare.as_mut_ptr() as u64,
            vec_len: spare.len() as u64,
            category_mask: scan.category_mask,
            category_anyof_mask: scan.category_anyof_mask,
            return_mask: scan.return_mask,
            ..Default::default()
        };
        // SAFETY: `arg.vec` points at `arg.vec_len` writable, properly
        // aligned `PageRegion`s (the vector's spare capacity), which the
        // kernel fills during the call; `arg` itself is live throughout.
        let n = check(unsafe { libc::ioctl(pagemap.as_raw_fd(), PAGEMAP_SCAN, &mut arg) })?;
        let n = n as usize;
        debug_assert!(n <= spare.len());
        // SAFETY: the kernel initialized the first `n` regions of the spare
        // capacity (its return value), which is within the reservation.
        unsafe { out.set_len(out.len() + n) };
        if arg.walk_end <= at {
            break;
        }
        at = arg.walk_end;
    }
    Ok(())
}

const NT_X86_XSTATE: libc::c_int = 0x202;
/// Large enough for any xsave area x86-64 defines today (AMX included).
pub const XSTATE_MAX: usize = 16 * 1024;

/// A thread's extended register state (`xsave` layout), from
/// `PTRACE_GETREGSET NT_X86_XSTATE`; the thread must be in a ptrace-stop.
pub fn get_xstate(tid: i32) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; XSTATE_MAX];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: `iov` describes `buf`, writable for its whole length; the
    // kernel writes at most `iov_len` bytes and updates `iov_len`.
    let r = unsafe {
        libc::ptrace(
            libc::PTRACE_GETREGSET,
            tid,
            NT_X86_XSTATE as usize as *mut libc::c_void,
            &mut iov as *mut libc::iovec,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    buf.truncate(iov.iov_len);
    Ok(buf)
}

/// Writes back a state from [`get_xstate`] (`PTRACE_SETREGSET`).
pub fn set_xstate(tid: i32, state: &[u8]) -> io::Result<()> {
    let mut iov = libc::iovec {
        iov_base: state.as_ptr() as *mut libc::c_void,
        iov_len: state.len(),
    };
    // SAFETY: `iov` describes `state`, which the kernel only reads for
    // `iov_len` bytes during the call.
    let r = unsafe {
        libc::ptrace(
            libc::PTRACE_SETREGSET,
            tid,
            NT_X86_XSTATE as usize as *mut libc::c_void,
            &mut iov as *mut libc::iovec,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `PTRACE_GET_RSEQ_CONFIGURATION`.
const PTRACE_GET_RSEQ_CONFIGURATION: libc::c_uint = 0x420f;

/// A thread's restartable-sequences registration (`struct
/// ptrace_rseq_configuration`): the area the kernel writes the current
/// CPU into on every return to user space.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RseqConfig {
    pub address: u64,
    pub len: u32,
    pub signature: u32,
    pub flags: u32,
    pub pad: u32,
}

/// Thread `tid`'s rseq registration (address 0: none). The thread must be
/// in a ptrace-stop of ours.
pub fn rseq_config(tid: i32) -> io::Result<RseqConfig> {
    let mut conf = RseqConfig::default();
    // SAFETY: the kernel writes at most `size_of::<RseqConfig>()` bytes
    // (the size passed) into `conf`, which is that large and writable.
    let r = unsafe {
        libc::ptrace(
            PTRACE_GET_RSEQ_CONFIGURATION,
            tid,
            std::mem::size_of::<RseqConfig>(),
            &mut conf as *mut RseqConfig,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(conf)
}

/// Sends `sig` to thread `tid` of process `pid` (`tgkill`).
pub fn tgkill(pid: i32, tid: i32, sig: i32) -> io::Result<()> {
    // SAFETY: tgkill takes three integers and touches no memory of ours.
    let r = unsafe { libc::syscall(libc::SYS_tgkill, pid, tid, sig) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

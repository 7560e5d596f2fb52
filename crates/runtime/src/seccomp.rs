//! A seccomp filter for every component (issue 17, least privilege): an
//! allow list. A component may make the system calls its runtime needs
//! ([`RUNTIME`]: memory, threads, futexes, signals, its sockets to the
//! supervisor, reading files, and what the checkpointer makes it call
//! remotely; files opened for reading only), those its binary declares ([`crate::run_allowing`]: netd's
//! sockets, for one) and those its system description adds (`syscalls =
//! [...]`); any other fails with `EPERM`. Installed at boot on every thread
//! (`TSYNC`), before any worker starts, and inherited by every incarnation
//! the zygote forks; it cannot be lifted (`no_new_privs` is set by the
//! supervisor at exec).
//!
//! `KINTSUGI_SECCOMP=log` in the supervisor's environment makes the filter
//! let every call through and the kernel log those outside the list
//! (`SECCOMP_RET_LOG`: audit records `type=1326`, in `dmesg` or the
//! journal): how an author finds what a component needs.

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};
pub use syscalls::Sysno;

/// What every component may call: what Rust's standard library, glibc and
/// the runtime call (memory, threads, futexes and robust lists, signals,
/// clocks and scheduling, the supervisor's sockets and the descriptors it
/// passes, `/proc/self` and files to read), and what the checkpointer
/// injects (`mmap`, `clone`, `userfaultfd`, `ioctl`, …). Not in it, among
/// others: other processes' memory and tracing, mounts and namespaces,
/// modules, keys, clocks, BPF, performance counters, making sockets
/// (but for a connected pair of its own, `socketpair`),
/// changing the file system (opening a file to write it included),
/// `execve`.
pub const RUNTIME: &[Sysno] = &[
    // Memory.
    Sysno::brk,
    Sysno::mmap,
    Sysno::munmap,
    Sysno::mremap,
    Sysno::mprotect,
    Sysno::madvise,
    Sysno::mlock,
    Sysno::munlock,
    Sysno::msync,
    Sysno::mincore,
    Sysno::memfd_create,
    Sysno::userfaultfd,
    Sysno::membarrier,
    // Threads, processes and their ends.
    Sysno::clone,
    Sysno::clone3,
    Sysno::exit,
    Sysno::exit_group,
    Sysno::set_tid_address,
    Sysno::set_robust_list,
    Sysno::get_robust_list,
    Sysno::rseq,
    Sysno::futex,
    Sysno::gettid,
    Sysno::getpid,
    Sysno::getppid,
    Sysno::getuid,
    Sysno::geteuid,
    Sysno::getgid,
    Sysno::getegid,
    Sysno::getresuid,
    Sysno::getresgid,
    Sysno::getgroups,
    Sysno::prctl,
    Sysno::arch_prctl,
    Sysno::capget,
    Sysno::getrlimit,
    Sysno::prlimit64,
    Sysno::getrusage,
    Sysno::times,
    Sysno::uname,
    Sysno::getrandom,
    Sysno::wait4,
    Sysno::waitid,
    Sysno::kill,
    Sysno::tgkill,
    Sysno::tkill,
    Sysno::pidfd_open,
    Sysno::pidfd_send_signal,
    // Signals.
    Sysno::rt_sigaction,
    Sysno::rt_sigprocmask,
    Sysno::rt_sigreturn,
    Sysno::rt_sigtimedwait,
    Sysno::restart_syscall,
    Sysno::sigaltstack,
    Sysno::pause,
    // Time and scheduling.
    Sysno::clock_gettime,
    Sysno::clock_getres,
    Sysno::clock_nanosleep,
    Sysno::gettimeofday,
    Sysno::nanosleep,
    Sysno::sched_yield,
    Sysno::sched_getaffinity,
    Sysno::sched_setaffinity,
    Sysno::sched_getscheduler,
    Sysno::sched_setscheduler,
    Sysno::sched_getparam,
    Sysno::sched_setparam,
    Sysno::sched_get_priority_max,
    Sysno::sched_get_priority_min,
    Sysno::getpriority,
    Sysno::setpriority,
    // Descriptors: the supervisor's sockets, pipes, eventfds, polling.
    Sysno::read,
    Sysno::write,
    Sysno::readv,
    Sysno::writev,
    Sysno::pread64,
    Sysno::pwrite64,
    Sysno::lseek,
    Sysno::close,
    Sysno::close_range,
    Sysno::dup,
    Sysno::dup2,
    Sysno::dup3,
    Sysno::fcntl,
    Sysno::ioctl,
    Sysno::ftruncate,
    Sysno::fallocate,
    Sysno::fstat,
    Sysno::fstatfs,
    Sysno::sendmsg,
    Sysno::recvmsg,
    Sysno::sendto,
    Sysno::recvfrom,
    Sysno::pipe2,
    // A connected pair of its own, like a pipe: a standby's private
    // socket to its vault (`vault::ahead`).
    Sysno::socketpair,
    Sysno::eventfd2,
    Sysno::poll,
    Sysno::ppoll,
    Sysno::epoll_create1,
    Sysno::epoll_ctl,
    Sysno::epoll_wait,
    Sysno::epoll_pwait,
    Sysno::epoll_pwait2,
    // Files, to read (`open` and `openat` as well, read-only: [`OPENS`]).
    Sysno::newfstatat,
    Sysno::statx,
    Sysno::getdents64,
    Sysno::readlink,
    Sysno::readlinkat,
    Sysno::access,
    Sysno::faccessat,
    Sysno::faccessat2,
    Sysno::getcwd,
];

/// The calls that open a file, with the index of their flags argument: in
/// the runtime's list for reading only (none of [`WRITE_FLAGS`]); a
/// component that writes files declares the call, which then allows any
/// flags.
pub const OPENS: &[(Sysno, u8)] = &[(Sysno::open, 1), (Sysno::openat, 2)];

/// Open flags that let a file be written, created or truncated (`O_TMPFILE`
/// needs `O_WRONLY` or `O_RDWR` too).
pub const WRITE_FLAGS: u64 =
    (libc::O_WRONLY | libc::O_RDWR | libc::O_CREAT | libc::O_TRUNC | libc::O_APPEND) as u64;

/// What unlisted calls meet: `EPERM`, or (`KINTSUGI_SECCOMP=log`) a
/// kernel log record and the call made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Enforce,
    Log,
}

impl Mode {
    /// From `KINTSUGI_SECCOMP` (`log`; anything else enforces).
    pub fn from_env() -> Mode {
        match std::env::var("KINTSUGI_SECCOMP").as_deref() {
            Ok("log") => Mode::Log,
            _ => Mode::Enforce,
        }
    }
}

/// The filter allowing [`RUNTIME`] and `extra`, as a BPF program for this
/// machine's architecture.
pub fn program(extra: &[Sysno], mode: Mode) -> Result<BpfProgram, seccompiler::Error> {
    let mut rules = RUNTIME
        .iter()
        .chain(extra)
        .map(|&nr| (i64::from(nr.id()), Vec::new()))
        .collect::<BTreeMap<_, _>>();
    for &(call, flags) in OPENS {
        if !extra.contains(&call) {
            let read_only = SeccompCondition::new(
                flags,
                SeccompCmpArgLen::Dword,
                SeccompCmpOp::MaskedEq(WRITE_FLAGS),
                0,
            )?;
            rules.insert(
                i64::from(call.id()),
                vec![SeccompRule::new(vec![read_only])?],
            );
        }
    }
    let arch = TargetArch::try_from(std::env::consts::ARCH)?;
    let refused = match mode {
        Mode::Enforce => SeccompAction::Errno(libc::EPERM as u32),
        Mode::Log => SeccompAction::Log,
    };
    let filter = SeccompFilter::new(rules, refused, SeccompAction::Allow, arch)?;
    filter.try_into().map_err(seccompiler::Error::Backend)
}

/// Installs the filter (no extras) on the calling thread alone (and the
/// threads it will create): for measuring what the filter costs beside
/// threads without it (`kintsugi bench ipc`).
pub fn install_on_this_thread() -> Result<(), seccompiler::Error> {
    // Unprivileged, a filter needs no_new_privs (components have it from exec).
    rustix::thread::set_no_new_privs(true).map_err(|e| seccompiler::Error::Seccomp(e.into()))?;
    seccompiler::apply_filter(&program(&[], Mode::Enforce)?)
}

/// Installs the filter allowing `extra` beside [`RUNTIME`] on every thread
/// of this process.
pub fn install(extra: &[Sysno], mode: Mode) -> Result<(), seccompiler::Error> {
    seccompiler::apply_filter_all_threads(&program(extra, mode)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The list names each call once (a repeat would hide a typo's twin).
    #[test]
    fn the_runtime_list_has_no_repeats() {
        let mut seen = std::collections::BTreeSet::new();
        for s in RUNTIME {
            assert!(seen.insert(s.id()), "{s} listed twice");
        }
        for (open, _) in OPENS {
            assert!(
                !RUNTIME.contains(open),
                "{open} would be allowed with any flags"
            );
        }
    }
}

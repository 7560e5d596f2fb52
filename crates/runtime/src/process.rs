//! Process plumbing for the pristine image: forking incarnations as children
//! of the supervisor, and tying every component process's life to it.

use rustix::process::{Resource, Rlimit, Signal};

/// Forks the calling (single-threaded) process with `CLONE_PARENT`: the child
/// becomes a child of our parent, the supervisor, which can then wait for
/// it and read its exit status through a pidfd. Returns the child's pid in
/// the parent and `None` in the child.
pub fn fork_sibling() -> std::io::Result<Option<u32>> {
    let threads = thread_count()?;
    if threads != 1 {
        return Err(std::io::Error::other(format!(
            "the pristine image must be single-threaded to fork, but has {threads} threads"
        )));
    }
    // SAFETY: a raw clone without CLONE_VM behaves like fork(2): the child gets
    // a copy of the address space and continues on a copy of this stack. The
    // process has exactly one thread (checked above), so no lock can be held by
    // a thread that does not exist in the child.
    let ret = unsafe {
        libc::syscall(libc::SYS_clone, (libc::CLONE_PARENT | libc::SIGCHLD) as libc::c_ulong, 0usize, 0usize, 0usize, 0usize)
    };
    match ret {
        -1 => Err(std::io::Error::last_os_error()),
        0 => Ok(None),
        pid => Ok(Some(pid as u32)),
    }
}

/// Number of threads in this process.
pub fn thread_count() -> std::io::Result<usize> {
    Ok(std::fs::read_dir("/proc/self/task")?.count())
}

/// Dies with SIGKILL when the parent (the supervisor) dies, so no component
/// outlives its system; exits at once if the parent is already gone.
pub fn die_with_parent(expected_parent: u32) -> std::io::Result<()> {
    rustix::process::set_parent_process_death_signal(Some(Signal::KILL))?;
    let parent = rustix::process::getppid().map(|p| p.as_raw_nonzero().get() as u32).unwrap_or(0);
    if parent != expected_parent {
        std::process::exit(70);
    }
    Ok(())
}

/// No core files: a crashing component is rebooted in microseconds, and a
/// core dump of it would take milliseconds and disk.
pub fn disable_core_dumps() -> std::io::Result<()> {
    rustix::process::setrlimit(Resource::Core, Rlimit { current: Some(0), maximum: Some(0) })?;
    Ok(())
}

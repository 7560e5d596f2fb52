//! The keeper: a process that shares netd's descriptor table, so that a
//! connection the kernel has accepted but netd has not yet posted to the
//! vault outlives a crash of netd.
//!
//! Between `accept` returning a socket and the vault post that puts it in
//! the supervisor's hands, the socket exists only in netd's descriptor
//! table; when netd dies there, the kernel closes it with the request
//! unread and resets the connection. The keeper is forked with
//! `CLONE_FILES`: the table is shared, so it stays alive while the keeper
//! does, whatever killed netd. The next incarnation takes from the dead
//! one's keeper the sockets of its port that the vault does not know
//! (`pidfd_getfd`), then kills it and forks its own.
//!
//! The keeper does nothing but wait for the supervisor's exit (then it
//! exits too); netd's SIGTERM (a clean stop) kills it first, and the next
//! incarnation kills the keeper of a crashed one. A keeper is named by its
//! pid and start time, so a reused pid is never taken for it. Taking a
//! descriptor from another process needs ptrace access to it (root, or
//! `CAP_SYS_PTRACE` where Yama restricts ptrace).

use std::collections::HashSet;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};

use rustix::process::{Pid, PidfdFlags, PidfdGetfdFlags, Signal};

/// The keeper's pid, for netd's SIGTERM handler (0: none).
static KEEPER: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

/// A keeper, named so that a reused pid is never taken for it: its pid and
/// its start time in clock ticks after boot (`/proc/PID/stat` field 22).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Keeper {
    pub pid: Pid,
    pub start: u64,
}

impl Keeper {
    /// For netd's arena: (pid, start time); a pid of 0 is none.
    pub fn pack(self) -> (u64, u64) {
        (self.pid.as_raw_nonzero().get() as u64, self.start)
    }

    pub fn unpack(pid: u64, start: u64) -> Option<Self> {
        let pid = Pid::from_raw(i32::try_from(pid).ok()?)?;
        Some(Self { pid, start })
    }

    /// A pidfd for it, if that pid is still this keeper (alive or a zombie).
    fn pidfd(self) -> Option<OwnedFd> {
        let fd = rustix::process::pidfd_open(self.pid, PidfdFlags::empty()).ok()?;
        // Checked after opening: from now on the pidfd names this process.
        (start_time(self.pid) == Some(self.start)).then_some(fd)
    }
}

/// A process's start time, from `/proc/PID/stat`.
fn start_time(pid: Pid) -> Option<u64> {
    procfs::process::Process::new(pid.as_raw_nonzero().get())
        .and_then(|p| p.stat())
        .ok()
        .map(|s| s.starttime)
}

/// Forks a keeper sharing this process's descriptor table.
pub fn spawn(supervisor: Pid) -> std::io::Result<Keeper> {
    let watched = rustix::process::pidfd_open(supervisor, PidfdFlags::empty())?;
    let flags = (libc::CLONE_FILES | libc::SIGCHLD) as libc::c_ulong;
    // SAFETY: a raw clone without CLONE_VM behaves like fork(2): the child
    // gets a copy of the address space and continues on a copy of this
    // stack, with only this thread. It calls nothing but async-signal-safe
    // system calls (poll, _exit) before it exits, so no lock another thread
    // held at the fork is ever taken in it.
    let ret = unsafe { libc::syscall(libc::SYS_clone, flags, 0usize, 0usize, 0usize, 0usize) };
    match ret {
        -1 => Err(std::io::Error::last_os_error()),
        0 => keep(watched.as_raw_fd()),
        pid => {
            // The child needs the pidfd open; in the shared table it is.
            std::mem::forget(watched);
            KEEPER.store(pid as i32, std::sync::atomic::Ordering::SeqCst);
            let pid = Pid::from_raw(pid as i32).expect("a child's pid");
            // Our child, not reaped: the pid cannot be reused meanwhile.
            let start = start_time(pid)
                .ok_or_else(|| std::io::Error::other("the keeper has no /proc stat"))?;
            Ok(Keeper { pid, start })
        }
    }
}

/// The keeper's life: until the supervisor exits, or it is killed.
fn keep(supervisor: libc::c_int) -> ! {
    let mut fds = [libc::pollfd {
        fd: supervisor,
        events: libc::POLLIN,
        revents: 0,
    }];
    loop {
        // SAFETY: `fds` is a valid array of one pollfd for the call's duration.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 1, -1) };
        if n > 0 {
            // SAFETY: _exit ends the keeper without running netd's atexit
            // handlers or flushing buffers that belong to netd.
            unsafe { libc::_exit(0) }
        }
    }
}

/// On SIGTERM (a clean stop), kills the keeper, then dies of the signal as
/// netd would have without the handler.
pub fn die_with_stop() -> std::io::Result<()> {
    let handler = || {
        let pid = KEEPER.load(std::sync::atomic::Ordering::SeqCst);
        if pid > 0 {
            // SAFETY: kill(2) is async-signal-safe; `pid` is our keeper.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        signal_hook::low_level::emulate_default_handler(libc::SIGTERM).ok();
    };
    // SAFETY: the handler calls only async-signal-safe functions (kill,
    // and the default action of SIGTERM: terminating the process).
    unsafe { signal_hook::low_level::register(libc::SIGTERM, handler) }?;
    Ok(())
}

/// The socket inode a descriptor refers to.
pub fn inode(fd: BorrowedFd<'_>) -> Option<u64> {
    rustix::fs::fstat(fd).ok().map(|s| s.st_ino)
}

impl Keeper {
    /// The keeper of a dead incarnation, to take descriptors from; killed
    /// when dropped. None if it is gone (or its pid reused).
    pub fn open(self) -> Option<Dying> {
        let pidfd = self.pidfd()?;
        Some(Dying {
            keeper: self,
            pidfd,
        })
    }
}

/// A dead incarnation's keeper, while its descriptors are taken.
pub struct Dying {
    keeper: Keeper,
    pidfd: OwnedFd,
}

impl Drop for Dying {
    fn drop(&mut self) {
        let _ = rustix::process::pidfd_send_signal(&self.pidfd, Signal::KILL);
    }
}

impl Dying {
    /// The socket at `num` in the shared table, if it is still the one of
    /// inode `ino` (not a later one given the same number) and a
    /// connection accepted on `port`.
    pub fn get(&self, num: i32, ino: u64, port: u16) -> Option<OwnedFd> {
        let fd = rustix::process::pidfd_getfd(&self.pidfd, num, PidfdGetfdFlags::empty()).ok()?;
        (inode(fd.as_fd()) == Some(ino) && accepted_on(fd.as_fd(), port)).then_some(fd)
    }

    /// The connected TCP sockets of `port` in the shared table whose inodes
    /// are not in `known`. Lingering (half-closed) connections are left:
    /// netd had closed them.
    pub fn unknown(&self, known: &HashSet<u64>, port: u16) -> Vec<OwnedFd> {
        let mut taken = Vec::new();
        // A socket may be in the table under several numbers: taken once.
        let mut known = known.clone();
        let dir = format!("/proc/{}/fd", self.keeper.pid.as_raw_nonzero());
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let Some(num) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<i32>().ok())
            else {
                continue;
            };
            let Ok(link) = std::fs::read_link(entry.path()) else {
                continue;
            };
            let ino = link
                .to_str()
                .and_then(|l| l.strip_prefix("socket:["))
                .and_then(|l| l.strip_suffix(']'))
                .and_then(|n| n.parse::<u64>().ok());
            let Some(ino) = ino.filter(|i| !known.contains(i)) else {
                continue;
            };
            let Ok(fd) = rustix::process::pidfd_getfd(&self.pidfd, num, PidfdGetfdFlags::empty())
            else {
                continue;
            };
            if accepted_on(fd.as_fd(), port) {
                known.insert(ino);
                taken.push(fd);
            }
        }
        taken
    }
}

/// A connection accepted on `port` and still open both ways, or closed by
/// its peer only.
fn accepted_on(fd: BorrowedFd<'_>, port: u16) -> bool {
    let local = rustix::net::getsockname(fd)
        .ok()
        .and_then(|a| std::net::SocketAddr::try_from(a).ok());
    let listening = rustix::net::sockopt::socket_acceptconn(fd).unwrap_or(true);
    local.is_some_and(|a| a.port() == port)
        && !listening
        && crate::sockinfo::established_or_peer_closed(fd)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::FromRawFd;

    #[test]
    fn a_socket_accepted_in_a_shared_table_outlives_its_process() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let me = rustix::process::getpid();
        let keeper = spawn(me).unwrap();
        let _client = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        let (server, _) = listener.accept().unwrap();
        let ino = inode(server.as_fd()).unwrap();
        // The keeper shares the table: the socket is there under its number
        // (and, once taken, under a second one, since the table is this
        // test's own: taken once all the same).
        let raw = server.as_raw_fd();
        std::mem::forget(server);
        let dying = keeper.open().expect("the keeper lives");
        let named = dying.get(raw, ino, port).expect("taken by its number");
        assert_eq!(inode(named.as_fd()), Some(ino));
        assert!(dying.get(raw, ino + 1, port).is_none(), "another inode");
        assert!(dying.get(raw, ino, port + 1).is_none(), "another port");
        let taken = dying.unknown(&HashSet::new(), port);
        assert_eq!(taken.len(), 1, "the accepted socket, not the listener");
        assert_eq!(inode(taken[0].as_fd()), Some(ino));
        assert!(dying.unknown(&[ino].into(), port).is_empty(), "nothing new");
        drop(dying);
        // SAFETY: `raw` was forgotten above and is closed exactly once here.
        drop(unsafe { OwnedFd::from_raw_fd(raw) });
        // Killed when dropped (then reaped here, its parent).
        let status =
            rustix::process::waitpid(Some(keeper.pid), rustix::process::WaitOptions::empty())
                .unwrap()
                .unwrap();
        assert_eq!(status.1.terminating_signal(), Some(libc::SIGKILL));
    }
}

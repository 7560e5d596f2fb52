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
//! The keeper does nothing but wait for the supervisor's exit; netd's
//! SIGTERM (a clean stop) kills it first, and the next incarnation kills
//! the keeper of a crashed one. When the supervisor dies, netd dies with
//! it (its parent-death signal), and so would what only netd's table
//! holds: once netd is gone, the keeper posts the connections the arena
//! names as not yet posted to netd's vault socket, as netd would have
//! (`post_unposted`), then exits. Under the supervisor's keeper the other
//! end of that socket outlives the supervisor, and the next supervisor
//! applies what waits on it, so those connections reach the next netd
//! with the vault's others. A keeper is named by its
//! pid and start time, so a reused pid is never taken for it. Taking a
//! descriptor from another process needs ptrace access to it (root, or
//! `CAP_SYS_PTRACE` where Yama restricts ptrace).

use std::collections::HashSet;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use kintsugi_runtime::abi::shm::Region;
use kintsugi_runtime::vault::Vault;
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

/// Forks a keeper sharing this process's descriptor table, which says
/// `last_words` as the supervisor dies (once this process is dead too),
/// then exits. `last_words` runs in a child forked from a threaded
/// process: it must not allocate or take a lock.
pub fn spawn(supervisor: Pid, last_words: impl FnOnce()) -> std::io::Result<Keeper> {
    let watched = rustix::process::pidfd_open(supervisor, PidfdFlags::empty())?;
    let flags = (libc::CLONE_FILES | libc::SIGCHLD) as libc::c_ulong;
    // SAFETY: a raw clone without CLONE_VM behaves like fork(2): the child
    // gets a copy of the address space and continues on a copy of this
    // stack, with only this thread. It calls nothing but async-signal-safe
    // system calls (poll, getppid, nanosleep, _exit) and `last_words`,
    // which allocates nothing and takes no lock, before it exits, so no
    // lock another thread held at the fork is ever taken in it.
    let ret = unsafe { libc::syscall(libc::SYS_clone, flags, 0usize, 0usize, 0usize, 0usize) };
    match ret {
        -1 => Err(std::io::Error::last_os_error()),
        0 => keep(watched.as_raw_fd(), last_words),
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

/// How long the keeper waits for its netd to die after the supervisor
/// (of its parent-death signal: at once, unless the machine is loaded).
const NETD_DIES: Duration = Duration::from_secs(1);

/// The keeper's life: until the supervisor exits (then, once its netd is
/// dead, `last_words`), or it is killed.
fn keep(supervisor: libc::c_int, last_words: impl FnOnce()) -> ! {
    let mut fds = [libc::pollfd {
        fd: supervisor,
        events: libc::POLLIN,
        revents: 0,
    }];
    let netd = rustix::process::getppid();
    loop {
        // SAFETY: `fds` is a valid array of one pollfd for the call's duration.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 1, -1) };
        if n > 0 {
            break;
        }
    }
    // Reparented once netd is dead: nothing of it writes the arena or the
    // descriptor table any more.
    let since = Instant::now();
    while rustix::process::getppid() == netd && since.elapsed() < NETD_DIES {
        std::thread::sleep(Duration::from_micros(100));
    }
    last_words();
    // SAFETY: _exit ends the keeper without running netd's atexit
    // handlers or flushing buffers that belong to netd.
    unsafe { libc::_exit(0) }
}

/// A keeper's last words (see [`spawn`]): the connections its netd had
/// accepted and not posted, named in `arena` (`owed`), and the one it was
/// accepting if the kernel had given it (`just_accepted`), posted to
/// netd's vault socket as netd would have posted them. Under the supervisor's
/// keeper the other end of that socket outlives the supervisor, and the
/// next supervisor applies what waits on it (`take_over`): the next netd
/// restores them with every other connection of the previous system's.
/// Without one the post fails, as there is nobody to keep them. Allocates
/// nothing; what fails is not told (telling allocates).
pub fn post_unposted(vault: &Vault, arena: &Region, port: u16) {
    let mut buf = [0u8; 1024];
    let mut key = [0u8; crate::CONN_KEY_LEN];
    for u in crate::owed::named(arena).chain(crate::just_accepted(arena)) {
        // SAFETY: netd is dead (unless it outlived NETD_DIES) and the
        // table is this process's alone: nothing closes the number while
        // it is borrowed here. A number that names nothing, or another
        // socket (a netd that lived on and closed it), fails the checks below
        // (the one being accepted has no inode yet: its number was stored
        // as the kernel gave it, and nothing closed it since).
        let fd = unsafe { BorrowedFd::borrow_raw(u.fd) };
        let same = u.inode == 0 || inode(fd) == Some(u.inode);
        if !same || !accepted_on(fd, port) {
            continue;
        }
        let key = crate::conn_key_in(u.id, &mut key);
        let _ = vault.post_put_unallocated(&mut buf, key, &u.kept(), fd);
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
    use crate::conn::{Holder, Kept};
    use std::os::fd::FromRawFd;

    #[test]
    fn a_socket_accepted_in_a_shared_table_outlives_its_process() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let me = rustix::process::getpid();
        let keeper = spawn(me, || {}).unwrap();
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

    /// The supervisor dies with a connection accepted and not posted, and
    /// another just accepted (its number stored, no slot yet): the keeper
    /// posts both to the vault's socket with their sockets, as netd would
    /// have, and exits.
    #[test]
    fn as_the_supervisor_dies_the_keeper_posts_what_netd_had_not() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let mut supervisor = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let (ours, theirs) = rustix::net::socketpair(
            rustix::net::AddressFamily::UNIX,
            rustix::net::SocketType::SEQPACKET,
            rustix::net::SocketFlags::CLOEXEC,
            None,
        )
        .unwrap();
        let vault = Vault::new(ours);
        let arena = Region::create("netd-keeper-test", crate::owed::ARENA_BYTES).unwrap();
        let _client = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        let (server, _) = listener.accept().unwrap();
        let entry = crate::conn::Entry::new(OwnedFd::from(server), Default::default(), 0);
        let kept = Kept {
            holder: Holder::Worker {
                client: 4,
                worker: 9,
            },
            rb: 0,
            tb: 0,
        };
        let mut owed = crate::owed::Owed::default();
        assert!(owed.accepted(&arena, 0x2a, kept, &entry));
        let _second = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        let (accepting, _) = listener.accept().unwrap();
        for (at, word) in [
            (crate::ARENA_ACCEPTING, 1),
            (crate::ARENA_ACCEPT_ID, 0x2b),
            (crate::ARENA_ACCEPT_CLIENT, 4),
            (crate::ARENA_ACCEPT_WORKER, 10),
            (crate::ARENA_ACCEPTED_FD, accepting.as_raw_fd() as u64 + 1),
        ] {
            arena
                .at::<std::sync::atomic::AtomicU64>(at)
                .store(word, std::sync::atomic::Ordering::SeqCst);
        }
        let pid = Pid::from_raw(supervisor.id() as i32).unwrap();
        let keeper = spawn(pid, || post_unposted(&vault, &arena, port)).unwrap();
        supervisor.kill().unwrap();
        supervisor.wait().unwrap();
        // This test's process (the keeper's "netd") lives on: the keeper
        // waits for it a while, then speaks.
        let status =
            rustix::process::waitpid(Some(keeper.pid), rustix::process::WaitOptions::empty())
                .unwrap()
                .unwrap();
        assert_eq!(status.1.exit_status(), Some(0));
        let second = Kept {
            holder: Holder::Worker {
                client: 4,
                worker: 10,
            },
            ..kept
        };
        for (id, kept, socket) in [
            (0x2a, kept, entry.fd.as_fd()),
            (0x2b, second, accepting.as_fd()),
        ] {
            let (bytes, fds) = kintsugi_runtime::abi::fdpass::recv(&theirs).unwrap();
            let message: kintsugi_runtime::vault::VaultMessage =
                serde_json::from_slice(&bytes).unwrap();
            let kintsugi_runtime::vault::VaultRequest::Post { ops } = message.request else {
                panic!("not a post: {:?}", message.request);
            };
            assert_eq!(ops, [crate::put(id, kept, true)]);
            assert_eq!(fds.len(), 1);
            assert_eq!(inode(fds[0].as_fd()), inode(socket));
        }
        rustix::fs::fcntl_setfl(&theirs, rustix::fs::OFlags::NONBLOCK).unwrap();
        assert!(
            kintsugi_runtime::abi::fdpass::recv(&theirs).is_err(),
            "two posts"
        );
    }
}

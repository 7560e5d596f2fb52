//! Socket activation (systemd's `sd_listen_fds`): the listening sockets a
//! service manager opened for the system and passed at fd 3 onwards
//! (`LISTEN_FDS`, `LISTEN_PID`, `LISTEN_FDNAMES`), claimed once, and put in
//! the vaults of the components whose description asks for them by name
//! (`sockets = { listen = "http" }`) before their first incarnation, where
//! a component that keeps its listener in its vault (netd) finds it as if
//! an earlier incarnation had stored it. The port is then open, and
//! connections queue in the kernel, before any component runs, and across
//! every restart of the supervisor's service.
//!
//! And the descriptors a supervisor started again by its keeper inherits
//! ([`Inherited`]): the whole table of the supervisor that died, which the
//! keeper shared; the vault takes back those its records name.

use std::collections::{BTreeMap, BTreeSet};
use std::os::fd::{BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};

use kintsugi_system::VaultStorage;

/// Set once the passed descriptors are owned here.
static CLAIMED: AtomicBool = AtomicBool::new(false);

/// Sockets passed by a service manager, by name.
#[derive(Debug, Default)]
pub struct Activated(BTreeMap<String, OwnedFd>);

impl Activated {
    /// The descriptors passed to this process (none without `LISTEN_PID`
    /// naming it), each marked close-on-exec; an unnamed one is named
    /// `unknown`, as systemd names it. A second call finds none (the
    /// first owns them).
    pub fn claim() -> std::io::Result<Self> {
        if CLAIMED.swap(true, Ordering::SeqCst) {
            return Ok(Self::default());
        }
        let mut out = BTreeMap::new();
        for (fd, name) in sd_notify::listen_fds_with_names()? {
            // SAFETY: `listen_fds_with_names` yields only descriptors the
            // service manager passed to this very process (`LISTEN_PID`),
            // which nothing else here owns, and CLAIMED makes this the
            // only place that takes them, once.
            let fd = unsafe { OwnedFd::from_raw_fd(fd) };
            if let Some(dup) = out.insert(name.clone(), fd) {
                tracing::warn!(
                    "socket activation: two sockets named {name:?}; the first is closed"
                );
                drop(dup);
            }
        }
        Ok(Self(out))
    }

    /// Takes the socket named `name`, if it was passed.
    pub fn take(&mut self, name: &str) -> Option<OwnedFd> {
        self.0.remove(name)
    }

    /// Names of the sockets no component took.
    pub fn unclaimed(&self) -> impl Iterator<Item = &str> {
        self.0.keys().map(String::as_str)
    }
}

/// The descriptors above stderr a supervisor found in its table when its
/// keeper started it again, owned here until the vault takes those its
/// records name; the rest are closed. Under a keeper without a restart
/// (its first supervisor) there are none, but the vault still logs the
/// descriptors its records hold, for the next.
#[derive(Debug, Default)]
pub struct Inherited {
    fds: BTreeMap<RawFd, OwnedFd>,
    restarted: bool,
}

impl Inherited {
    /// The first supervisor under a keeper: nothing inherited.
    pub fn first() -> Self {
        Self::default()
    }

    /// Every descriptor above stderr in this process's table, owned from
    /// now on. Call it first thing in a supervisor the keeper started
    /// again, before anything of this process opens or owns a descriptor,
    /// and only once.
    pub fn claim() -> std::io::Result<Self> {
        if CLAIMED.swap(true, Ordering::SeqCst) {
            return Err(std::io::Error::other(
                "inherited descriptors claimed twice (socket activation and a keeper's restart are exclusive)",
            ));
        }
        let listed: Vec<RawFd> = std::fs::read_dir("/proc/self/fd")?
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
            .filter(|&fd| fd > 2)
            .collect();
        // The directory's own descriptor was listed and is closed now.
        let mut fds = BTreeMap::new();
        for fd in listed {
            // SAFETY: `fd` was open in this process's table when it was
            // listed and only this call (once, CLAIMED) takes inherited
            // descriptors. Nothing in this process owns it: the keeper that
            // forked us holds no descriptor object of its own, and no code
            // here opened anything before this call, so a number still open
            // now is the inherited one (the listing's directory descriptor,
            // closed since, fails `fcntl_getfd`).
            let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
            if rustix::io::fcntl_getfd(borrowed).is_ok() {
                // SAFETY: as above; from here this map owns it.
                fds.insert(fd, unsafe { OwnedFd::from_raw_fd(fd) });
            }
        }
        Ok(Self {
            fds,
            restarted: true,
        })
    }

    /// A restarted supervisor's inheritance, for tests: `fds` by the
    /// numbers they are to be found at.
    #[cfg(test)]
    pub(crate) fn restarted_with(fds: impl IntoIterator<Item = (RawFd, OwnedFd)>) -> Self {
        Self {
            fds: fds.into_iter().collect(),
            restarted: true,
        }
    }

    /// Whether this supervisor was started again by its keeper.
    pub fn restarted(&self) -> bool {
        self.restarted
    }

    /// How many descriptors are held.
    pub fn len(&self) -> usize {
        self.fds.len()
    }

    pub fn is_empty(&self) -> bool {
        self.fds.is_empty()
    }

    /// Closes every descriptor that no record of the vault in `storage`
    /// names: the dead supervisor's channels, sockets and listeners, before
    /// this one opens its own (a listener still open would keep its port).
    pub fn retain_vault_records(&mut self, storage: &VaultStorage) {
        let keep: BTreeSet<RawFd> = crate::vault::kept_descriptors(&storage.dir);
        self.fds.retain(|fd, _| keep.contains(fd));
    }

    /// Takes descriptor `fd`, if it was inherited.
    pub fn take(&mut self, fd: RawFd) -> Option<OwnedFd> {
        self.fds.remove(&fd)
    }
}

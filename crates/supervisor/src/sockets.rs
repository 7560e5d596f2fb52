//! Socket activation (systemd's `sd_listen_fds`): the listening sockets a
//! service manager opened for the system and passed at fd 3 onwards
//! (`LISTEN_FDS`, `LISTEN_PID`, `LISTEN_FDNAMES`), claimed once, and put in
//! the vaults of the components whose description asks for them by name
//! (`sockets = { listen = "http" }`) before their first incarnation, where
//! a component that keeps its listener in its vault (netd) finds it as if
//! an earlier incarnation had stored it. The port is then open, and
//! connections queue in the kernel, before any component runs, and across
//! every restart of the supervisor's service.

use std::collections::BTreeMap;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};

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

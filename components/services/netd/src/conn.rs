//! A connection as netd keeps it: its socket and stream offsets, what the
//! vault records with it, and whose it is.

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use kintsugi_interfaces::net::Error;
use serde::{Deserialize, Serialize};

/// Who has a connection; recorded in the vault with its socket.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Holder {
    /// A worker thread of a client component serves it.
    Worker { client: u32, worker: u32 },
    /// netd watches it for its next bytes, then hands it to `client` (or
    /// its successor), and closes it after `idle_ms` without a byte.
    Parked { client: u32, idle_ms: u32 },
}

impl Holder {
    pub fn client(self) -> u32 {
        match self {
            Holder::Worker { client, .. } | Holder::Parked { client, .. } => client,
        }
    }
}

/// What the vault keeps with a connection's socket.
#[derive(Serialize, Deserialize, Clone, Copy, Debug)]
pub struct Kept {
    pub holder: Holder,
    /// Where the holder's stream offsets start (nonzero after a hand-over).
    pub rb: u64,
    pub tb: u64,
}

/// Stream positions, in absolute bytes of the TCP stream.
#[derive(Default)]
pub struct Io {
    /// Bytes read out of the kernel's receive queue.
    pub discarded: u64,
    /// Bytes written into the kernel's send queue.
    pub sent: u64,
    /// Where the client's first unanswered request began (its last `recv`'s
    /// `keep`), and `sent` then: where a successor resumes.
    pub rx_mark: u64,
    pub tx_mark: u64,
    /// Where the current client's offsets start.
    pub rb: u64,
    pub tb: u64,
    /// The receive timeout set on the socket, in microseconds (0: none yet).
    pub wait_us: u32,
}

pub struct Entry {
    pub fd: OwnedFd,
    pub io: Mutex<Io>,
    /// Set when the connection changes hands: the next call rebases.
    pub rebase: AtomicBool,
    /// Deaths of its client before it was handed over: a death counted
    /// later orphans it, an earlier one told late does not, and a call
    /// that began before the hand-over is refused.
    pub deaths: AtomicU64,
}

impl Entry {
    pub fn new(fd: OwnedFd, io: Io, deaths: u64) -> Arc<Self> {
        Arc::new(Self {
            fd,
            io: Mutex::new(io),
            rebase: AtomicBool::new(false),
            deaths: AtomicU64::new(deaths),
        })
    }

    /// The stream, unless a call that began when its client had died
    /// `deaths` times finds it handed to a successor since.
    pub fn io(&self, deaths: u64) -> Result<std::sync::MutexGuard<'_, Io>, Error> {
        let io = self.io.lock().unwrap();
        if self.deaths.load(Ordering::SeqCst) > deaths {
            return Err(Error::Closed);
        }
        Ok(io)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    /// Its holder, a worker, knows it.
    Delivered,
    /// In the watch since `since`: ready once more than `skip` bytes are
    /// queued (what its last client saw of its unanswered request).
    Watched { since: Instant, skip: u64 },
    /// In the ready queue, for the next `accept` of its client.
    Ready,
    /// Restored from the vault by this incarnation, its worker's not yet
    /// heard from.
    Restored(Instant),
}

pub struct Slot {
    pub entry: Arc<Entry>,
    pub kept: Kept,
    pub state: State,
}

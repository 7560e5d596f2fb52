//! Where each connection's unanswered request and its response began
//! (`Io::rx_mark`, `tx_mark`), in a memfd netd keeps in its vault. A netd
//! that dies while its client lives learns where to resume from the
//! client's own offsets; when both die with the supervisor (a system
//! restarted by the supervisor's keeper, README "The keeper"), no client's
//! offsets survive, and a response netd had begun would be sent again from
//! its first byte. The kernel says how much of the stream was read and
//! written; these marks say where the response to the first unread
//! request began, so its successor skips what the kernel already has.
//!
//! A slot per connection id modulo [`SLOTS`]: id, receive mark, send mark.
//! A slot is valid only as written whole (its id written last, after a
//! zero), and only while the kernel's count of bytes read equals its
//! receive mark (else the marks moved on after it was written).

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};

use kintsugi_runtime::abi::shm::{Mapping, Region};
use kintsugi_runtime::component::Runtime;

/// The vault key of the marks' memfd.
pub const KEY: &str = "marks";
const SLOTS: usize = 8192;
const WORDS: usize = 3;
const BYTES: usize = SLOTS * WORDS * 8;

pub struct Marks(Mapping);

impl Marks {
    /// The marks the vault kept (`kept`), or new ones, put in the vault if
    /// netd keeps anything there (`tracking`).
    pub fn open(rt: &Runtime, kept: Option<OwnedFd>, tracking: bool) -> anyhow::Result<Self> {
        if let Some(fd) = kept {
            return Ok(Self(Mapping::of_sealed(fd.as_fd(), BYTES)?));
        }
        let region = Region::create("netd-marks", BYTES)?;
        if tracking {
            rt.vault()
                .put(KEY, serde_json::Value::Null, Some(region.fd()))?;
        }
        Ok(Self(region.map_range(0, BYTES)?))
    }

    fn word(&self, id: u64, n: usize) -> &AtomicU64 {
        let slot = (id % SLOTS as u64) as usize;
        self.0.at::<AtomicU64>((slot * WORDS + n) * 8)
    }

    /// Connection `id`'s marks are now `rx` and `tx`.
    pub fn set(&self, id: u64, rx: u64, tx: u64) {
        self.word(id, 0).store(0, Ordering::Release);
        self.word(id, 1).store(rx, Ordering::Release);
        self.word(id, 2).store(tx, Ordering::Release);
        self.word(id, 0).store(id, Ordering::Release);
    }

    /// Connection `id`'s send mark, if its slot holds it whole with the
    /// receive mark `consumed` (what the kernel says was read).
    pub fn sent_mark(&self, id: u64, consumed: u64) -> Option<u64> {
        let whole = self.word(id, 0).load(Ordering::Acquire) == id;
        let current = self.word(id, 1).load(Ordering::Acquire) == consumed;
        (whole && current).then(|| self.word(id, 2).load(Ordering::Acquire))
    }
}

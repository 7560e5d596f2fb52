//! The system-wide monotonic clock in nanoseconds: the same in every
//! process, so components can exchange instants (timer phases, critical
//! sections in tests).

use rustix::time::{clock_gettime, ClockId};

/// CLOCK_MONOTONIC, in nanoseconds.
pub fn monotonic_ns() -> u64 {
    let t = clock_gettime(ClockId::Monotonic);
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

//! timer: periodic and one-shot timers served over the `timer` interface.
//!
//! A timer armed at `start_ns` with period `p` ticks at `start_ns + k·p`
//! (k = 1, 2, …; a one-shot timer only at k = 1) on CLOCK_MONOTONIC, the
//! clock every process on the machine shares. The server keeps nothing that
//! outlives an incarnation: after a crash the clients' stubs replay `create`
//! and `arm` with the original start, so every timer comes back with its
//! phase, and `wait` carries the last tick its caller saw, so a reboot loses
//! no tick and repeats none.

#![forbid(unsafe_code)]

mod timers;

use std::sync::Arc;

use kintsugi_interfaces::timer;
use kintsugi_runtime::Incarnation;

fn main() {
    kintsugi_runtime::run(|rt| {
        tracing::debug!(epoch = rt.epoch(), "timer serving");
        Ok(Incarnation::serve(vec![timer::service(Arc::new(
            timers::Timers::default(),
        ))]))
    })
}

//! evt: serves `crates/interfaces/idl/evt.kidl`, named events that count their
//! triggers.
//!
//! The counts live in the component's durable arena (`arena_kib`), so a
//! micro-reboot loses no trigger: waiters blocked in the failed incarnation
//! are re-issued by their client stubs with the count they have seen and
//! return at once if it has moved (see `events.rs`).

#![forbid(unsafe_code)]

mod events;

use std::sync::Arc;

use kintsugi_arena_slots::Arena;
use kintsugi_interfaces::evt;
use kintsugi_runtime::Incarnation;

fn main() {
    kintsugi_runtime::run(|rt| {
        let events = events::Events::new(Arena::of(rt)?);
        Ok(Incarnation::serve(vec![evt::service(
            Arc::new(events),
            rt.records(),
        )]))
    })
}

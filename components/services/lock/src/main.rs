//! lock: serves `crates/interfaces/idl/lock.kidl`, named locks shared by the threads of
//! several components.
//!
//! Each lock's owner lives in the component's durable arena (`arena_kib`),
//! so a micro-reboot forgets no owner: threads blocked in `take` are
//! re-issued by their client stubs and wait again, and the server stub
//! rebuilds each lock id from its creation record (see `locks.rs` for how
//! re-issued takes and releases are told apart from mistakes).

#![forbid(unsafe_code)]

mod locks;

use std::sync::Arc;

use kintsugi_arena_slots::Arena;
use kintsugi_interfaces::lock;
use kintsugi_runtime::Incarnation;

fn main() {
    kintsugi_runtime::run(|rt| {
        let locks = locks::Locks::new(Arena::of(rt)?, rt.callers())?;
        Ok(Incarnation::serve(vec![lock::service(
            Arc::new(locks),
            rt.records(),
        )]))
    })
}

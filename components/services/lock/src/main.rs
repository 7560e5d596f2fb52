//! lock: serves `crates/interfaces/idl/lock.kidl`, named locks shared by the threads of
//! several components.
//!
//! Each lock's owner lives in the component's durable arena (`arena_kib`),
//! so a micro-reboot forgets no owner: threads blocked in `take` are
//! re-issued by their client stubs and wait again, and the server stub
//! rebuilds each lock id from its creation record (see `locks.rs` for how
//! re-issued takes and releases are told apart from mistakes). A component
//! may hold a lock by lease, which this server asks back by upcall when
//! anyone else wants the lock.

#![forbid(unsafe_code)]

mod locks;

use std::sync::Arc;
use std::time::Duration;

use kintsugi_arena_slots::Arena;
use kintsugi_interfaces::lock;
use kintsugi_runtime::{upcall, Incarnation};

/// How long a leaseholder may take to hear that its lease is wanted (its
/// runtime hands the request to a thread of its own at once).
const ASK_TIMEOUT: Duration = Duration::from_millis(100);

fn main() {
    kintsugi_runtime::run(|rt| {
        let asker = rt.clone();
        let ask_back = Box::new(move |holder: u32, l: u64| {
            let asked = asker.upcall(
                lock::INFO.name,
                holder,
                upcall::LEASE_WANTED,
                [l, 0, 0],
                ASK_TIMEOUT,
            );
            if let Err(e) = asked {
                tracing::debug!(holder, lock = l, "lease not asked back: {e}");
            }
        });
        let locks = locks::Locks::new(Arena::of(rt)?, rt.callers(), ask_back)?;
        Ok(Incarnation::serve(vec![lock::service(
            Arc::new(locks),
            rt.records(),
        )]))
    })
}

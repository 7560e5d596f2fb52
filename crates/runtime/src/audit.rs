//! Audits: a checkpoint-recovered server checks its own state before a
//! checkpoint keeps it.
//!
//! A checkpoint (RMK's TAC, `seeds/001_68a97066b3f6a3ed.txt` §6) keeps
//! whatever the server's memory holds at a safe point, damage included: a
//! bit flip that broke a map's order without crashing anything is kept by
//! every later checkpoint, and every recovery restores it (kv's campaign
//! found one so, `docs/reliability.md`). So, with calls held at the safe
//! point and none in flight, the supervisor asks the component to audit
//! its state before it freezes it; each service's
//! [`audit`](crate::stub::Service::audit) (the generated `Server::audit`,
//! which accepts everything unless the author writes one) checks what it
//! can afford to. If one finds damage, the supervisor kills the process
//! instead of checkpointing it: its recovery restores the last checkpoint,
//! which passed its audit, and replays the requests logged since, which
//! runs the request that met the flip again without it.
//!
//! A thread of the runtime answers (see `component.rs`); it holds a
//! lifeline, so that its death is found like a worker's.

use std::sync::Arc;

use crate::abi::boot::Audits;
use crate::stub::Service;

/// Answers every audit the supervisor asks for, for ever.
pub(crate) fn answer(audits: &Audits, services: &[Arc<dyn Service>]) -> ! {
    audits.answer(|| sound(services))
}

/// Whether every service finds its state sound (each that does not says
/// why, in the log), once the C library's allocator has walked its own
/// lists ([`walk_allocator`]).
fn sound(services: &[Arc<dyn Service>]) -> bool {
    walk_allocator();
    services
        .iter()
        .filter_map(|s| s.audit().err().map(|e| (s.interface().name, e)))
        .inspect(|(interface, e)| {
            tracing::error!(interface, "audit: the state is damaged: {e}");
        })
        .count()
        == 0
}

/// Has glibc's allocator walk its free lists (`mallinfo2`), which checks
/// what it meets (an unaligned chunk aborts the process) and follows every
/// bin's links: damage to the allocator's own metadata shows nothing
/// until `malloc` or `free` next meets it, by which time a checkpoint may
/// hold it and every restore bring it back (kv's heap-flip campaign lost
/// its state so, `docs/reliability.md`). A walk that meets it crashes the
/// process here, during the audit, and the checkpoint is not kept.
fn walk_allocator() {
    // SAFETY: `mallinfo2` takes no argument, reads the allocator's state
    // under its arenas' locks and returns a plain struct by value.
    let _ = unsafe { libc::mallinfo2() };
}

//! mm: the memory manager, served over the `mm` interface.
//!
//! It hands out pages of its pool (`pool_kib`, shared memory every client
//! maps from the server's descriptor and that outlives mm's crashes): a
//! client `grant`s pages, `alias`es them into another component, `locate`s
//! a page it holds to map it (see `kintsugi_interfaces::mm_map`), and
//! `revoke`s a page with every alias below it, which unmaps them in every
//! holder before it returns. Which pool pages are in use, and every page
//! descriptor, live in the arena (`arena_kib`), so a reboot of mm neither
//! loses a grant nor hands its pages out twice, and the clients' mappings
//! are never touched by a crash.

#![forbid(unsafe_code)]

mod arena;
mod server;

use std::sync::Arc;

use kintsugi_interfaces::mm;
use kintsugi_runtime::Incarnation;

fn main() {
    kintsugi_runtime::run(|rt| {
        let server = server::Mm::restore(rt.clone())?;
        tracing::debug!(epoch = rt.epoch(), "mm serving");
        Ok(Incarnation::serve(vec![mm::service(
            Arc::new(server),
            rt.records(),
        )]))
    })
}

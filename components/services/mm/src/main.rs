//! mm: the memory manager, served over the `mm` interface.
//!
//! It hands out pages (up to `pages` in its `[component.config]`, each
//! grant a memfd of its own that mm lends its holders through the state
//! vault, so that it outlives mm's crashes and no component can map a
//! page it does not hold): a client `grant`s pages, `alias`es them into
//! another component, `locate`s a page it holds to map it (see
//! `kintsugi_interfaces::mm_map`), and `revoke`s a page with every alias
//! below it, which unmaps them in every holder before it returns. Which
//! pages are in use, and every page descriptor, live in the arena
//! (`arena_kib`), so a reboot of mm neither loses a grant nor hands its
//! pages out twice, and the clients' mappings are never touched by a crash.

#![forbid(unsafe_code)]

mod arena;
mod server;

use std::sync::Arc;
use std::time::Duration;

use kintsugi_interfaces::mm;
use kintsugi_runtime::Incarnation;

/// How long after its start an incarnation looks for lent records of
/// pages that are gone ([`server::Mm::sweep`]).
const SWEEP_AFTER: Duration = Duration::from_secs(1);

fn main() {
    kintsugi_runtime::run(|rt| {
        let config: server::Config = rt.config()?;
        let server = server::Mm::restore(rt.clone(), &config)?;
        tracing::debug!(epoch = rt.epoch(), "mm serving");
        let server = Arc::new(server);
        let sweeper = server.clone();
        Ok(
            Incarnation::serve(vec![mm::service(server, rt.records())]).then(move || {
                // Records a crash left behind, taken back once the reboot is long done.
                std::thread::sleep(SWEEP_AFTER);
                let n = sweeper.sweep()?;
                if n > 0 {
                    tracing::info!("took back {n} lent records of pages that are gone");
                }
                Ok(())
            }),
        )
    })
}

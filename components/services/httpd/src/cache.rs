//! The file cache's entries: a file in a page granted by mm, mapped here
//! and aliased to netd, which sends responses straight from it
//! (`net.send_page`: the body is not copied through the channel; COMPOSITE's
//! web server passes cbufs the same way).
//!
//! mm revokes a dead netd's aliases (a dead component's pages go with
//! it): the next netd refuses the old alias, and the page is aliased again
//! for it ([`CachePage::realias`]).
//!
//! A page is revoked (with netd's aliases, below it in mm's tree) when its
//! last holder lets it go: the cache, when the file changes, or a worker
//! still sending a response from it. So a response in flight is never cut
//! by a change of its file, and a slow client holds a stale page, never the
//! cache.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use kintsugi_interfaces::mm::{self, Page};
use kintsugi_runtime::client::Changes;

/// A page of the cache, revoked when dropped.
pub struct CachePage {
    mm: &'static mm::Client,
    pub page: Page,
    /// netd's alias of `page` (0: none, netd does not send from pages).
    alias: AtomicU64,
}

impl CachePage {
    pub fn new(mm: &'static mm::Client, page: Page) -> Self {
        Self {
            mm,
            page,
            alias: AtomicU64::new(0),
        }
    }

    /// The alias netd sends from, if any.
    pub fn alias(&self) -> Option<Page> {
        Some(self.alias.load(Ordering::Acquire))
            .filter(|&a| a != 0)
            .map(Page)
    }

    /// Aliases the page to component `netd` (anew: the alias before, if
    /// any, was refused), and keeps that alias.
    pub fn realias(&self, netd: u32) -> Result<Page, kintsugi_runtime::CallError<mm::Error>> {
        let alias = self.mm.alias(self.page, netd)?;
        self.alias.store(alias.0, Ordering::Release);
        Ok(alias)
    }
}

impl Drop for CachePage {
    fn drop(&mut self) {
        if let Err(e) = self.mm.revoke(self.page) {
            tracing::warn!("revoking cache page {:#x}: {e}", self.page.0);
        }
    }
}

/// A cached file: its page; current while ramfs publishes no change of its
/// name or contents since `when`.
#[derive(Clone)]
pub struct Cached {
    pub page: Arc<CachePage>,
    pub len: u64,
    pub when: Changes,
}

impl PartialEq for Cached {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.page, &other.page)
    }
}

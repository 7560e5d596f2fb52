//! The file cache's entries: a file in a page granted by mm, mapped here
//! and aliased to netd, which sends responses straight from it
//! (`net.send_page`: the body is not copied through the channel; COMPOSITE's
//! web server passes cbufs the same way).
//!
//! A page is revoked (with netd's alias, below it in mm's tree) when its
//! last holder lets it go: the cache, when the file changes, or a worker
//! still sending a response from it. So a response in flight is never cut
//! by a change of its file, and a slow client holds a stale page, never the
//! cache.

use std::sync::Arc;

use kintsugi_interfaces::mm::{self, Page};
use kintsugi_runtime::client::Changes;

/// A page of the cache, revoked when dropped.
pub struct CachePage {
    mm: &'static mm::Client,
    pub page: Page,
    /// netd's alias of `page`, if netd may send from it.
    pub alias: Option<Page>,
}

impl CachePage {
    pub fn new(mm: &'static mm::Client, page: Page) -> Self {
        Self {
            mm,
            page,
            alias: None,
        }
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

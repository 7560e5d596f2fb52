//! Responses sent from mm pages: `send_page` and `finish_page` (issue 13's
//! "`sendfile`/`writev` from mm pages rather than copies").
//!
//! httpd keeps its file cache in pages mm granted it, and aliases each
//! cached page to netd. Instead of copying a body into the channel 64 KiB
//! at a time (a call each) and netd copying it out again, httpd names the
//! page, and netd maps it (once: [`Mapper`] keeps the mapping until mm's
//! `UNMAP` upcall drops it) and hands the head and the mapped bytes to one
//! `sendmsg`: the kernel copies them straight into the socket. COMPOSITE's
//! web server passes cbufs the same way.
//!
//! The page stays mapped only while the kernel takes bytes: the send never
//! blocks with the mapper's lock held, so a slow client cannot hold up a
//! revoke (and with it httpd's cache); a full socket is waited for with
//! `poll`, unlocked. Pages are mapped before any byte is sent: a page netd
//! cannot map (revoked, or not aliased to it) is refused with `NotFound`;
//! bytes past the page's end, and every page if netd has no mm, with
//! `Invalid`. Nothing is sent then, so the caller may fall back to
//! copying. mm revokes a dead netd's aliases: its next incarnation refuses
//! them, and httpd aliases the pages again.
//!
//! netd holds every alias made for it, so any client could name any of
//! them: each page is sent only to the connection of the component that
//! aliased it to netd (mm's `origin`, asked once per page), and refused
//! with `NotFound` to every other, so no client reads another's pages
//! through netd.

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, Mutex};

use kintsugi_interfaces::mm::{self, Page};
use kintsugi_interfaces::mm_map::Mapper;
use kintsugi_interfaces::net::Error;
use kintsugi_runtime::Runtime;
use rustix::event::{poll, PollFd, PollFlags};

use crate::io_error;

pub struct Pages {
    client: &'static mm::Client,
    mapper: Mapper<'static>,
    /// Who aliased each page to netd (mm's `origin`; ids are never reused).
    origins: Mutex<HashMap<u64, u32>>,
}

/// Origins kept before those of pages no longer mapped are forgotten.
const ORIGINS_MAX: usize = 4096;

impl Pages {
    /// netd's view of mm's pages, if its system gives it mm (`uses`).
    pub fn connect(rt: &Arc<Runtime>) -> anyhow::Result<Option<Self>> {
        if !rt.uses(mm::INFO.name) {
            return Ok(None);
        }
        // One client for the incarnation's life, which the mapper borrows
        // with the runtime (whose vault lends the pages' memory).
        let client: &'static mm::Client = Box::leak(Box::new(mm::Client::connect(rt)?));
        let rt: &'static Runtime = Box::leak(Box::new(rt.clone()));
        Ok(Some(Self {
            client,
            mapper: Mapper::new(client, rt.vault()),
            origins: Mutex::new(HashMap::new()),
        }))
    }

    /// Whether component `caller` aliased `page` to netd.
    fn aliased_by(&self, page: Page, caller: u32) -> Result<bool, Error> {
        if let Some(&origin) = self.origins.lock().unwrap().get(&page.0) {
            return Ok(origin == caller);
        }
        let origin = self.client.origin(page).map_err(|e| {
            tracing::debug!("page {:#x}: {e}", page.0);
            Error::NotFound
        })?;
        let mut origins = self.origins.lock().unwrap();
        if origins.len() >= ORIGINS_MAX {
            origins.retain(|&p, _| self.mapper.is_mapped(Page(p)));
        }
        origins.insert(page.0, origin);
        Ok(origin == caller)
    }

    /// Sends `head`, then `body` bytes of `page` from byte `offset`,
    /// skipping the first `done` bytes of the whole (the kernel has them
    /// from a call before a reboot), for component `caller`, which must be
    /// the one that aliased the page to netd; `sent` is told of every byte
    /// taken.
    pub fn send(
        &self,
        caller: u32,
        fd: &OwnedFd,
        head: &[u8],
        (page, offset, body): (u64, usize, usize),
        mut done: usize,
        mut sent: impl FnMut(usize),
    ) -> Result<(), Error> {
        let page = Page(page);
        if !self.aliased_by(page, caller)? {
            tracing::debug!(caller, "page {:#x} is not the caller's", page.0);
            return Err(Error::NotFound);
        }
        let mapped = self.mapper.map(page).map_err(|e| {
            tracing::debug!("page {:#x}: {e}", page.0);
            Error::NotFound
        })?;
        if offset.checked_add(body).is_none_or(|end| end > mapped.len) {
            return Err(Error::Invalid);
        }
        let total = head.len() + body;
        while done < total {
            let (h, at) = match head.get(done..) {
                Some(h) if !h.is_empty() => (h, offset),
                _ => (&[][..], offset + done - head.len()),
            };
            let len = total - done - h.len();
            match self.mapper.send(page, at, len, h, fd.as_fd()) {
                Err(e) => {
                    // Revoked meanwhile: the caller died or dropped the page.
                    tracing::debug!("page {:#x}: {e}", page.0);
                    return Err(Error::Closed);
                }
                Ok(Ok(n)) => {
                    done += n;
                    sent(n);
                }
                Ok(Err(e)) => match e.kind() {
                    std::io::ErrorKind::WouldBlock => writable(fd)?,
                    std::io::ErrorKind::Interrupted => {}
                    _ => {
                        tracing::debug!("socket: {e}");
                        return Err(Error::Closed);
                    }
                },
            }
        }
        Ok(())
    }
}

/// Waits until `fd` takes bytes again, or has failed (the next send says how).
fn writable(fd: &OwnedFd) -> Result<(), Error> {
    let mut fds = [PollFd::new(fd, PollFlags::OUT)];
    match poll(&mut fds, None) {
        Ok(_) | Err(rustix::io::Errno::INTR) => Ok(()),
        Err(e) => Err(io_error(e)),
    }
}

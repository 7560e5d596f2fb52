//! The client side of `mm`: maps the pages a component holds, and unmaps
//! them when mm revokes them.
//!
//! [`Mapper::map`] asks mm where a page lies (`locate`: its extent in mm's
//! page space, and a check that this component holds it), borrows the
//! page's memfd from the state vault, where mm lent it to this component
//! alone ([`page_key`], `Vault::borrow`), and maps it; the mapper keeps
//! every mapping in a table. A component can map only the pages granted or
//! aliased to it: the kernel gives it no descriptor of any other. [`Mapper::new`] registers the `UNMAP` upcall handler on the
//! client's connection: when a page is revoked, mm calls it with the
//! extent (offset, length) before `revoke` returns, and the handler drops
//! (munmaps) every kept mapping that overlaps it. Mappings do not depend on
//! mm being alive: they outlive its crashes untouched.
//!
//! The bytes are read and written through the mapper while the table is
//! locked for reading (threads copy at once; a whole word at a time, with
//! volatile accesses, since mm's other holders share the bytes), so an
//! unmap, which locks it for writing, never races an access: a page revoked
//! meanwhile is simply no longer mapped ([`MapError::NotMapped`]). Only [`Mapper::map`]
//! holds the table across a call to mm (`locate`), so that an `UNMAP` of
//! the page it maps waits until the mapping is in the table, then drops it;
//! mm serves `locate` while its revoke waits for that `UNMAP`.

use std::collections::HashMap;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use kintsugi_runtime::abi::shm::Mapping;
use kintsugi_runtime::vault::{Vault, VaultError};
use kintsugi_runtime::{upcall, CallError};

use crate::mm::{self, Page};

#[derive(Debug, thiserror::Error)]
pub enum MapError {
    #[error("mm: {0}")]
    Call(#[from] CallError<mm::Error>),
    #[error("mapping pool bytes {offset}+{len}: {source}")]
    Map {
        offset: u64,
        len: u64,
        source: std::io::Error,
    },
    #[error("borrowing page {page:#x}'s memory: {source}")]
    Borrow { page: u64, source: VaultError },
    #[error("mm lent no memory for page {0:#x} to this component")]
    NotLent(u64),
    #[error("page {0:#x} is not mapped (never mapped, or revoked)")]
    NotMapped(u64),
    #[error("bytes {at}+{len} lie outside page {page:#x} ({size} bytes)")]
    OutOfBounds {
        page: u64,
        at: usize,
        len: usize,
        size: usize,
    },
}

/// The name of the memfds mm makes for its grants (as `/proc/PID/maps`
/// shows a mapping of one: `/memfd:mm-page (deleted)`).
pub const PAGE_MEMFD: &str = "mm-page";

/// The key under which mm lends a page's memfd to its holder (with
/// `kintsugi_runtime::vault::lent_key`): one record per page descriptor,
/// a grant's or an alias's, all holding the grant's memfd.
pub fn page_key(page: u64) -> String {
    format!("page/{page:#x}")
}

/// The page a [`page_key`] names, if it is one.
pub fn parse_page_key(key: &str) -> Option<u64> {
    u64::from_str_radix(key.strip_prefix("page/0x")?, 16).ok()
}

/// Where a page was mapped: its address in this process (for checking the
/// kernel's view, e.g. `/proc/self/maps`; it is never dereferenced) and its
/// length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mapped {
    pub addr: usize,
    pub len: usize,
}

struct Kept {
    offset: u64,
    mapping: Mapping,
}

#[derive(Default)]
struct Table {
    by_page: HashMap<u64, Kept>,
    /// Mappings dropped by `UNMAP` upcalls, ever.
    unmapped: u64,
}

impl Table {
    /// Drops every mapping that overlaps pool bytes `offset..offset+len`.
    fn unmap(&mut self, offset: u64, len: u64) -> u64 {
        let before = self.by_page.len();
        self.by_page.retain(|_, k| {
            let end = k.offset + k.mapping.len() as u64;
            end <= offset || offset + len <= k.offset
        });
        let dropped = (before - self.by_page.len()) as u64;
        self.unmapped += dropped;
        dropped
    }
}

/// Maps pages of mm's pool in this process, and unmaps them on revocation.
pub struct Mapper<'c> {
    client: &'c mm::Client,
    vault: &'c Vault,
    table: Arc<RwLock<Table>>,
}

/// The table, to change it: no read or write of a page meanwhile.
fn lock(table: &RwLock<Table>) -> RwLockWriteGuard<'_, Table> {
    table.write().unwrap_or_else(|e| e.into_inner())
}

/// The table, to use its mappings: others may too, none is unmapped meanwhile.
fn shared(table: &RwLock<Table>) -> RwLockReadGuard<'_, Table> {
    table.read().unwrap_or_else(|e| e.into_inner())
}

impl<'c> Mapper<'c> {
    /// A mapper for the pages `client` holds, whose memory it borrows
    /// from `vault` (the runtime's); from now on mm's `UNMAP` upcalls on
    /// this connection unmap what it mapped. One mapper per connection: a
    /// second would take over the upcalls.
    pub fn new(client: &'c mm::Client, vault: &'c Vault) -> Self {
        let table: Arc<RwLock<Table>> = Arc::default();
        let handler = table.clone();
        client.connection().on_upcall(
            upcall::UNMAP,
            Arc::new(move |[offset, len, _]: [u64; 3]| lock(&handler).unmap(offset, len)),
        );
        Self {
            client,
            vault,
            table,
        }
    }

    /// Maps `page` (which this component must hold) and keeps the mapping
    /// until the page is revoked. Mapping a page twice returns the first
    /// mapping.
    pub fn map(&self, page: Page) -> Result<Mapped, MapError> {
        // Locked across `locate`: an UNMAP for this page waits until the
        // mapping is in the table, and then drops it.
        let mut table = lock(&self.table);
        if let Some(k) = table.by_page.get(&page.0) {
            return Ok(mapped(&k.mapping));
        }
        let extent = self.client.locate(page)?;
        let lent = self
            .vault
            .borrow(mm::INFO.name, &page_key(page.0))
            .map_err(|source| MapError::Borrow {
                page: page.0,
                source,
            })?;
        let fd = lent.and_then(|r| r.fd).ok_or(MapError::NotLent(page.0))?;
        let mapping = usize::try_from(extent.len)
            .map_err(|_| std::io::Error::other("extent out of range"))
            .and_then(|len| Mapping::of_sealed(fd.as_fd(), len))
            .map_err(|source| MapError::Map {
                offset: extent.offset,
                len: extent.len,
                source,
            })?;
        let m = mapped(&mapping);
        table.by_page.insert(
            page.0,
            Kept {
                offset: extent.offset,
                mapping,
            },
        );
        Ok(m)
    }

    /// True while `page` is mapped in this process.
    pub fn is_mapped(&self, page: Page) -> bool {
        shared(&self.table).by_page.contains_key(&page.0)
    }

    /// Mappings that `UNMAP` upcalls have dropped so far.
    pub fn unmapped_by_upcall(&self) -> u64 {
        shared(&self.table).unmapped
    }

    /// Runs `f` on the mapping of `page`, which stays mapped meanwhile.
    fn with<T>(&self, page: Page, f: impl FnOnce(&Mapping) -> T) -> Result<T, MapError> {
        let table = shared(&self.table);
        let k = table
            .by_page
            .get(&page.0)
            .ok_or(MapError::NotMapped(page.0))?;
        Ok(f(&k.mapping))
    }

    fn check(page: Page, m: &Mapping, at: usize, len: usize) -> Result<(), MapError> {
        match at.checked_add(len) {
            Some(end) if end <= m.len() => Ok(()),
            _ => Err(MapError::OutOfBounds {
                page: page.0,
                at,
                len,
                size: m.len(),
            }),
        }
    }

    /// Copies `data` into `page` at byte `at`.
    pub fn write(&self, page: Page, at: usize, data: &[u8]) -> Result<(), MapError> {
        self.with(page, |m| {
            Self::check(page, m, at, data.len())?;
            m.copy_in(at, data);
            Ok(())
        })?
    }

    /// Copies bytes of `page` from byte `at` into `buf`.
    pub fn read(&self, page: Page, at: usize, buf: &mut [u8]) -> Result<(), MapError> {
        self.with(page, |m| {
            Self::check(page, m, at, buf.len())?;
            m.copy_out(at, buf);
            Ok(())
        })?
    }

    /// Sends `head`, then `len` bytes of `page` from byte `at`, on the
    /// socket `fd`, without copying the page (see
    /// [`Mapping::send_after`]); what the kernel took, or its error
    /// (`WouldBlock` when the socket's buffer is full: the page stays
    /// mapped only during the call, so the caller waits for the socket
    /// without holding it, and a revoke is never held up by a slow peer).
    pub fn send(
        &self,
        page: Page,
        at: usize,
        len: usize,
        head: &[u8],
        fd: BorrowedFd<'_>,
    ) -> Result<std::io::Result<usize>, MapError> {
        self.with(page, |m| {
            Self::check(page, m, at, len)?;
            Ok(m.send_after(fd, head, at, len))
        })?
    }

    /// The 32-bit word of `page` at byte `at` (4-aligned, or this panics),
    /// loaded with acquire ordering: what another process stored there with
    /// [`Mapper::store_u32`], and every byte it wrote before.
    pub fn load_u32(&self, page: Page, at: usize) -> Result<u32, MapError> {
        self.with(page, |m| {
            Self::check(page, m, at, 4)?;
            Ok(m.at::<AtomicU32>(at).load(Ordering::Acquire))
        })?
    }

    /// Stores `value` in the 32-bit word of `page` at byte `at` (4-aligned,
    /// or this panics), with release ordering.
    pub fn store_u32(&self, page: Page, at: usize, value: u32) -> Result<(), MapError> {
        self.with(page, |m| {
            Self::check(page, m, at, 4)?;
            m.at::<AtomicU32>(at).store(value, Ordering::Release);
            Ok(())
        })?
    }
}

fn mapped(m: &Mapping) -> Mapped {
    Mapped {
        addr: m.as_ptr() as usize,
        len: m.len(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_keys_parse_back_and_nothing_else_does() {
        for page in [0, 1, 0xabc_0102, u64::MAX] {
            assert_eq!(parse_page_key(&page_key(page)), Some(page));
        }
        for other in [
            "page/12",
            "page/0x",
            "page/0xg",
            "pages/0x1",
            "page/0x1/2",
            "",
        ] {
            assert_eq!(parse_page_key(other), None, "{other}");
        }
    }

    #[test]
    fn an_unmap_drops_exactly_the_overlapping_mappings() {
        let ps = kintsugi_runtime::abi::shm::page_size() as u64;
        let pool =
            kintsugi_runtime::abi::shm::Region::create("mm-map-test", 8 * ps as usize).unwrap();
        let mut t = Table::default();
        for (page, offset) in [(1u64, 0u64), (2, ps), (3, 3 * ps)] {
            let mapping = pool.map_range(offset as usize, ps as usize).unwrap();
            t.by_page.insert(page, Kept { offset, mapping });
        }
        assert_eq!(t.unmap(2 * ps, ps), 0, "nothing lies on the third page");
        assert_eq!(t.unmap(ps / 2, ps), 2, "overlaps the first two");
        assert_eq!(t.by_page.keys().copied().collect::<Vec<_>>(), vec![3]);
        assert_eq!(t.unmapped, 2);
    }
}

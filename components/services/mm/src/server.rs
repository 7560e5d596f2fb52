//! The `mm` server: grants, aliases, locates and revokes pages.
//!
//! A grant's memory is a memfd of its own, sealed at its size, which mm
//! lends to its holder through the state vault (a record under
//! `lent_key(holder, page_key(id))`, `kintsugi_interfaces::mm_map`); an
//! alias lends the same memfd to its holder under its own id. A component
//! can therefore map only what it was granted or aliased, whatever it
//! asks: the kernel gives it no other descriptor (issue 17, after
//! Composite's capability-checked memory mappings). The records outlive
//! mm's crashes as the memory's holders' mappings do; they go when the
//! descriptor is forgotten (a crash in between leaves a record nobody
//! names, never a descriptor without its memory: a record is put before
//! its descriptor is published), and records nobody names are taken back
//! a while after a reboot ([`Mm::sweep`]).
//!
//! The arena ([`crate::arena`]) is the truth about pages and descriptors;
//! this incarnation keeps an index of it in memory, rebuilt from the arena
//! at boot. A descriptor the server stub rebuilds from its creation record
//! (`reuse`) is therefore usually found in place and only checked; it is
//! made again only when a crash cut a revoke short after the arena had
//! forgotten it but before the stub had dropped its records, and the retried
//! revoke then removes it for good.
//!
//! Revoking unmaps before it forgets: for `p` and every alias below it, the
//! holder's runtime is asked by upcall (`UNMAP`, offset, length) to unmap
//! every local mapping of the extent, and the revoke returns only once
//! every holder has answered or is gone. While that runs, the subtree is
//! dying: no one can locate it or alias it any more.
//!
//! When a client component dies, every page it held goes the same way, with
//! every alias made from it (the other holders unmap theirs): a dead
//! component's pages are reclaimed (C3). Their creation records go
//! too, so that nothing rebuilds them; a crash between dropping the records
//! and freeing the arena leaves those pages held by the dead component (a
//! leak, never a page reachable by two grants).

use std::collections::{HashMap, HashSet};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use kintsugi_interfaces::mm::{self, Error, Extent};
use kintsugi_interfaces::mm_map::{page_key, parse_page_key, PAGE_MEMFD};
use kintsugi_runtime::abi::shm::page_size;
use kintsugi_runtime::records::GlobalRecords;
use kintsugi_runtime::upcall::{self, UpcallError};
use kintsugi_runtime::vault::{lent_key, parse_lent_key, VaultError, VaultOp, VaultRecord, LENT};
use kintsugi_runtime::{Caller, Runtime};

use crate::arena::{span, Arena, Desc, Span};

/// How long one holder may take to unmap a revoked extent, and how many
/// times it is asked before its pages are quarantined instead of freed.
const UNMAP_TIMEOUT: Duration = Duration::from_secs(1);
const UNMAP_ATTEMPTS: u32 = 2;

#[derive(Default)]
struct Index {
    /// Every live descriptor, by id, with its arena slot.
    descs: HashMap<u64, (usize, Desc)>,
    free_slots: Vec<usize>,
    /// Subtrees being revoked: their holders are unmapping them.
    dying: HashSet<u64>,
    /// Descriptors whose creation record is known to exist: made or rebuilt
    /// in this incarnation, named through the stub, or checked by `held`.
    recorded: HashSet<u64>,
}

impl Index {
    fn live(&self, id: u64) -> Result<&Desc, Error> {
        match self.descs.get(&id) {
            Some((_, d)) if !self.dying.contains(&id) => Ok(d),
            _ => Err(Error::NotFound),
        }
    }

    /// `id` and every alias below it, parents before children.
    fn subtree(&self, id: u64) -> Vec<u64> {
        let mut children: HashMap<u64, Vec<u64>> = HashMap::new();
        for (_, d) in self.descs.values() {
            children.entry(d.parent).or_default().push(d.id);
        }
        let mut order = vec![id];
        let mut next = 0;
        while next < order.len() {
            if let Some(kids) = children.get(&order[next]) {
                order.extend(kids);
            }
            next += 1;
        }
        order
    }
}

/// mm's `[component.config]`.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Pages it may grant in all (of [`page_size`] bytes each).
    #[serde(default = "default_pages")]
    pub pages: usize,
}

fn default_pages() -> usize {
    1024
}

pub struct Mm {
    rt: Arc<Runtime>,
    arena: Arena,
    records: GlobalRecords,
    index: Mutex<Index>,
    /// The memfds of grants made or borrowed back in this incarnation, by
    /// grant id: what an alias lends too.
    memory: Mutex<HashMap<u64, OwnedFd>>,
}

/// A new grant's memory: `pages` zeroed pages in a memfd sealed at that
/// size, so that none of its holders can shrink it under another's
/// mapping, grow it, or unseal it.
fn memory(pages: usize) -> rustix::io::Result<OwnedFd> {
    use rustix::fs::{MemfdFlags, SealFlags};
    let fd = rustix::fs::memfd_create(PAGE_MEMFD, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
    rustix::fs::ftruncate(&fd, (pages * page_size()) as u64)?;
    rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)?;
    Ok(fd)
}

impl Mm {
    /// Maps the arena, repairs what the last crash left and indexes it.
    pub fn restore(rt: Arc<Runtime>, config: &Config) -> anyhow::Result<Self> {
        if rt.pool().is_some() {
            anyhow::bail!(
                "mm lends each grant a memfd of its own and shares no pool: \
                 remove its pool_kib (every client would map it), and set \
                 [component.config] pages"
            );
        }
        let arena = rt
            .arena()
            .ok_or_else(|| anyhow::anyhow!("mm needs an arena: set arena_kib"))?;
        let arena = Arena::new(arena.map_range(0, arena.len())?, config.pages)?;
        let scan = arena.scan();
        tracing::debug!(
            live = scan.live.len(),
            dropped_orphans = scan.dropped_orphans,
            freed_pages = scan.freed_pages,
            "mm arena scanned"
        );
        let mut index = Index::default();
        let used: HashSet<usize> = scan.live.iter().map(|(s, _)| *s).collect();
        index.free_slots = (0..arena.slots())
            .rev()
            .filter(|s| !used.contains(s))
            .collect();
        index.descs = scan.live.into_iter().map(|(s, d)| (d.id, (s, d))).collect();
        let records = GlobalRecords::new(rt.records(), mm::INFO.name);
        Ok(Self {
            rt,
            arena,
            records,
            index: Mutex::new(index),
            memory: Mutex::default(),
        })
    }

    /// Lends grant `grant`'s memory to `desc`'s holder under `desc`'s id
    /// (the grant itself, or an alias of it); a grant not lent yet gets
    /// new memory.
    fn lend(&self, ix: &Index, grant: u64, desc: Desc) -> Result<(), Error> {
        let mut memory = self.memory.lock().unwrap_or_else(|e| e.into_inner());
        let fd = match memory.get(&grant) {
            Some(fd) => fd.try_clone(),
            None => self.memory_of(ix, grant),
        };
        let fd = fd.map_err(|e| {
            tracing::error!(grant, "a grant's memory: {e}");
            Error::NoMemory
        })?;
        let key = lent_key(desc.holder, &page_key(desc.id));
        let value = serde_json::json!({ "grant": grant });
        if let Err(e) = self.rt.vault().put(&key, value, Some(fd.as_fd())) {
            tracing::warn!(page = desc.id, "lending a page's memory: {e}");
            return Err(Error::NoMemory);
        }
        memory.insert(grant, fd);
        Ok(())
    }

    /// Grant `grant`'s memory as lent to its holder, or new memory if
    /// none was (a grant made before its record, or made again).
    fn memory_of(&self, ix: &Index, grant: u64) -> std::io::Result<OwnedFd> {
        let holder = ix.descs.get(&grant).map(|(_, d)| d.holder);
        if let Some(holder) = holder {
            let key = lent_key(holder, &page_key(grant));
            match self.rt.vault().get(&key) {
                Ok(Some(VaultRecord { fd: Some(fd), .. })) => return Ok(fd),
                Ok(_) => {}
                Err(e) => return Err(std::io::Error::other(e)),
            }
        }
        Ok(memory(span(grant).count)?)
    }

    /// Takes back the records of page descriptors that are gone (lent by
    /// an incarnation that died before publishing the descriptor, or left
    /// by one that died after forgetting it); how many. Run a while after
    /// a reboot, off its path.
    pub fn sweep(&self) -> Result<usize, VaultError> {
        let keys = self.rt.vault().keys(LENT)?;
        // Held from here: a descriptor lent before the listing is
        // published by now (lending and publishing happen under it).
        let ix = self.index();
        let gone: Vec<VaultOp> = unheld(&ix, keys)
            .map(|key| VaultOp::Delete { key })
            .collect();
        let n = gone.len();
        if n > 0 {
            self.rt.vault().post(gone, &[])?;
        }
        Ok(n)
    }

    /// The grant at the root of `id`'s aliases.
    fn grant_of(ix: &Index, mut id: u64) -> u64 {
        while let Some((_, d)) = ix.descs.get(&id) {
            if d.parent == 0 {
                break;
            }
            id = d.parent;
        }
        id
    }

    fn index(&self) -> MutexGuard<'_, Index> {
        self.index.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Publishes a new descriptor.
    fn publish(&self, ix: &mut Index, desc: Desc) -> Result<u64, Error> {
        let slot = ix.free_slots.pop().ok_or(Error::NoMemory)?;
        self.arena.write(slot, desc);
        ix.descs.insert(desc.id, (slot, desc));
        ix.recorded.insert(desc.id);
        Ok(desc.id)
    }

    /// Forgets what `removal` removed (children before their parents),
    /// releasing the pages of the grants among it.
    fn forget(&self, ix: &mut Index, removal: &Removal) {
        let mut unlent = Vec::new();
        let mut memory = self.memory.lock().unwrap_or_else(|e| e.into_inner());
        for &id in removal.ids.iter().rev() {
            if let Some((slot, d)) = ix.descs.remove(&id) {
                self.arena.clear(slot);
                unlent.push(VaultOp::Delete {
                    key: lent_key(d.holder, &page_key(id)),
                });
                memory.remove(&id);
                // The pages go with their grant (an alias's grant keeps them).
                let s = span(id);
                if d.parent == 0 && removal.unconfirmed.contains(&s) {
                    tracing::error!(
                        first = s.first,
                        count = s.count,
                        "a holder never confirmed it unmapped these pages: quarantined for good"
                    );
                    self.arena.quarantine(s);
                } else if d.parent == 0 {
                    self.arena.release(s);
                }
                ix.free_slots.push(slot);
            }
            ix.dying.remove(&id);
            ix.recorded.remove(&id);
        }
        // After the arena: a crash in between leaves records nobody names.
        // Posted: only mm's later requests (ordered after it on its
        // socket) could depend on it; a holder borrowing its own page's
        // memory meanwhile gets what it had.
        if unlent.is_empty() {
            return;
        }
        if let Err(e) = self.rt.vault().post(unlent, &[]) {
            tracing::warn!("taking back revoked pages' memory: {e}");
        }
    }

    /// Asks `holder` to unmap the pages of `s`; true once it has, or
    /// once it is clear it maps nothing (not a listening client, or gone).
    /// A live holder that does not answer is asked again, a few times: a
    /// hung one is the watchdog's to reboot.
    fn unmap_in(&self, holder: u32, s: Span) -> bool {
        let ps = page_size() as u64;
        let args = [s.first as u64 * ps, s.count as u64 * ps, 0];
        for attempt in 1..=UNMAP_ATTEMPTS {
            match self
                .rt
                .upcall(mm::INFO.name, holder, upcall::UNMAP, args, UNMAP_TIMEOUT)
            {
                Ok(_) => return true,
                Err(UpcallError::Timeout) => {
                    tracing::warn!(
                        holder,
                        first = s.first,
                        count = s.count,
                        attempt,
                        "holder slow to unmap"
                    );
                }
                Err(e) => {
                    tracing::debug!(
                        holder,
                        first = s.first,
                        count = s.count,
                        "no unmap needed: {e}"
                    );
                    return true;
                }
            }
        }
        false
    }

    /// Revokes the subtrees rooted at `roots`: marks them dying, so that no
    /// one locates or aliases them any more, and has every holder but
    /// `skip` unmap them. The caller then forgets them.
    fn remove(&self, roots: &[u64], skip: Option<u32>) -> Removal {
        let (ids, holders) = {
            let mut ix = self.index();
            let mut ids = Vec::new();
            for &root in roots {
                if ix.live(root).is_ok() {
                    for id in ix.subtree(root) {
                        if ix.dying.insert(id) {
                            ids.push(id);
                        }
                    }
                }
            }
            // Aliases share their grant's extent: one upcall per holder and extent.
            let holders: HashSet<(u32, Span)> = ids
                .iter()
                .map(|id| (ix.descs[id].1.holder, span(*id)))
                .filter(|&(holder, _)| Some(holder) != skip)
                .collect();
            (ids, holders)
        };
        let unconfirmed = holders
            .into_iter()
            .filter(|&(holder, s)| !self.unmap_in(holder, s))
            .map(|(_, s)| s)
            .collect();
        Removal { ids, unconfirmed }
    }
}

/// The lent records among `keys` whose page descriptor `ix` does not
/// hold for the component it is lent to (keys that are not lent pages
/// stay).
fn unheld(ix: &Index, keys: Vec<String>) -> impl Iterator<Item = String> + '_ {
    keys.into_iter().filter(|key| {
        let Some((holder, page)) = parse_lent_key(key) else {
            return false;
        };
        let Some(id) = parse_page_key(page) else {
            return false;
        };
        !matches!(ix.descs.get(&id), Some((_, d)) if d.holder == holder)
    })
}

/// Subtrees that were marked dying and unmapped, to be forgotten.
#[derive(Default)]
struct Removal {
    /// Parents before their children.
    ids: Vec<u64>,
    /// Extents that some holder never confirmed it unmapped.
    unconfirmed: HashSet<Span>,
}

impl mm::Server for Mm {
    fn grant(&self, caller: &Caller, reuse: Option<u64>, pages: u32) -> Result<u64, Error> {
        let mut ix = self.index();
        let holder = caller.component;
        let id = match reuse {
            Some(id) => {
                let want = Desc {
                    id,
                    parent: 0,
                    holder,
                };
                if let Some(&(_, d)) = ix.descs.get(&id) {
                    ix.recorded.insert(id);
                    return (d == want).then_some(id).ok_or(Error::NotFound);
                }
                // Its revoke was cut short by a crash: make it again, to be revoked again.
                let s = span(id);
                if s.count != pages as usize || !self.arena.is_free(s) {
                    return Err(Error::NotFound);
                }
                id
            }
            None => {
                let s = self
                    .arena
                    .find_free(pages as usize)
                    .ok_or(Error::NoMemory)?;
                if ix.free_slots.is_empty() {
                    return Err(Error::NoMemory);
                }
                self.arena.new_id(s)
            }
        };
        // Claimed and lent before published: a crash in between leaves
        // pages the next scan frees, and a record nobody names.
        self.arena.claim(span(id), id);
        let desc = Desc {
            id,
            parent: 0,
            holder,
        };
        self.lend(&ix, id, desc)
            .and_then(|()| self.publish(&mut ix, desc))
            .inspect_err(|_| self.arena.release(span(id)))
    }

    fn alias(&self, caller: &Caller, reuse: Option<u64>, src: u64, to: u32) -> Result<u64, Error> {
        let mut ix = self.index();
        if ix.live(src)?.holder != caller.component {
            return Err(Error::Denied);
        }
        ix.recorded.insert(src);
        let want = |id| Desc {
            id,
            parent: src,
            holder: to,
        };
        let id = match reuse {
            Some(id) => {
                if let Some(&(_, d)) = ix.descs.get(&id) {
                    ix.recorded.insert(id);
                    return (d == want(id)).then_some(id).ok_or(Error::NotFound);
                }
                if span(id) != span(src) {
                    return Err(Error::NotFound);
                }
                id
            }
            None => {
                if ix.free_slots.is_empty() {
                    return Err(Error::NoMemory);
                }
                self.arena.new_id(span(src))
            }
        };
        self.lend(&ix, Self::grant_of(&ix, src), want(id))?;
        self.publish(&mut ix, want(id))
    }

    fn locate(&self, caller: &Caller, p: u64) -> Result<Extent, Error> {
        let mut ix = self.index();
        if ix.live(p)?.holder != caller.component {
            return Err(Error::Denied);
        }
        ix.recorded.insert(p);
        let ps = page_size() as u64;
        let s = span(p);
        Ok(Extent {
            offset: s.first as u64 * ps,
            len: s.count as u64 * ps,
        })
    }

    fn origin(&self, caller: &Caller, p: u64) -> Result<u32, Error> {
        let mut ix = self.index();
        let d = *ix.live(p)?;
        if d.holder != caller.component {
            return Err(Error::Denied);
        }
        ix.recorded.insert(p);
        match d.parent {
            0 => Ok(d.holder),
            parent => Ok(ix.live(parent)?.holder),
        }
    }

    fn revoke(&self, caller: &Caller, p: u64) -> Result<(), Error> {
        {
            let ix = self.index();
            let mut at = *ix.live(p)?;
            // The holder of `p`, or of any page it was aliased from.
            while at.holder != caller.component {
                match ix.descs.get(&at.parent) {
                    Some((_, d)) => at = *d,
                    None => return Err(Error::Denied),
                }
            }
        }
        let removal = self.remove(&[p], None);
        if removal.ids.is_empty() {
            // A concurrent revoke of the same subtree got there first.
            return Err(Error::NotFound);
        }
        self.forget(&mut self.index(), &removal);
        Ok(())
    }

    fn held(&self, caller: &Caller) -> Result<Vec<u64>, Error> {
        let unsure: Vec<u64> = {
            let ix = self.index();
            ix.descs
                .values()
                .filter(|(_, d)| d.holder == caller.component && ix.live(d.id).is_ok())
                .filter(|(_, d)| !ix.recorded.contains(&d.id))
                .map(|(_, d)| d.id)
                .collect()
        };
        // A descriptor made in an earlier incarnation that has no creation
        // record was never handed out: the crash came between making it and
        // recording it, and its caller asked again. Nobody can name it: free it.
        let mut checked = Vec::new();
        for id in unsure {
            match self.records.fetch("Page", id) {
                Ok(found) => checked.push((id, found.is_some())),
                Err(e) => tracing::warn!(page = id, "creation records: {e}"),
            }
        }
        let mut ix = self.index();
        for (id, recorded) in checked {
            match recorded {
                true => {
                    ix.recorded.insert(id);
                }
                false => {
                    tracing::debug!(
                        page = id,
                        "freeing a page whose creation was never recorded"
                    );
                    let never_mapped = Removal {
                        ids: ix.subtree(id),
                        ..Default::default()
                    };
                    self.forget(&mut ix, &never_mapped);
                }
            }
        }
        let mut held: Vec<u64> = ix
            .descs
            .values()
            .filter(|(_, d)| d.holder == caller.component && ix.live(d.id).is_ok())
            .map(|(_, d)| d.id)
            .collect();
        held.sort_unstable();
        Ok(held)
    }

    fn client_died(&self, client: u32) {
        let roots: Vec<u64> = {
            let ix = self.index();
            ix.descs
                .values()
                .filter(|(_, d)| d.holder == client)
                .map(|(_, d)| d.id)
                .collect()
        };
        if roots.is_empty() {
            return;
        }
        let removal = self.remove(&roots, Some(client));
        // Records first: a crash after this leaks the pages but never lets a
        // stale record rebuild a grant over pages someone else got since.
        if let Err(e) = self.records.closed("Page", &removal.ids) {
            tracing::warn!(client, "dropping the records of a dead client's pages: {e}");
        }
        self.forget(&mut self.index(), &removal);
        tracing::debug!(
            client,
            pages = removal.ids.len(),
            "reclaimed a dead client's pages"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_records_of_pages_gone_or_held_by_another_are_unheld() {
        let mut ix = Index::default();
        for (slot, (id, holder)) in [(0x100, 3), (0x200, 4)].into_iter().enumerate() {
            let d = Desc {
                id,
                parent: 0,
                holder,
            };
            ix.descs.insert(id, (slot, d));
        }
        let keys = [
            lent_key(3, &page_key(0x100)), // held by 3: stays
            lent_key(4, &page_key(0x100)), // 0x100 is 3's: unheld
            lent_key(4, &page_key(0x200)), // held by 4: stays
            lent_key(3, &page_key(0x300)), // no such page: unheld
            lent_key(3, "not-a-page"),     // not mm's: stays
            "lent/x/page/0x100".to_string(),
        ];
        let unheld: Vec<String> = unheld(&ix, keys.to_vec()).collect();
        assert_eq!(unheld, vec![keys[1].clone(), keys[3].clone()]);
    }
}

//! Creation records of global descriptors, kept outside the server.
//!
//! A global descriptor keeps its id across its server's reboots and may be
//! used by components that did not create it, so no single client stub can
//! rebuild it. The generated server stub therefore writes, at creation, a
//! record of the creator and its remembered arguments to a [`RecordStore`]
//! (the state vault, in a running system), and rebuilds a descriptor from its
//! record the first time any client names it in a new incarnation: on demand,
//! in the calling thread, parents before children.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use thiserror::Error;

use crate::stub::{records_unavailable, Caller, Dispatched, Refusal};
use crate::vault::{Vault, VaultOp, VaultRecord, LIST_PAGE};

/// Why creation records could not be read or written.
#[derive(Debug, Error)]
pub enum RecordError {
    /// The store did not answer as asked (the vault refused or failed).
    #[error("creation records: {0}")]
    Unavailable(String),
    /// A record is there but does not decode: a faulty incarnation wrote
    /// it so. No reboot mends it: its descriptor is lost (refused as
    /// unknown), not the server (see [`GlobalRecords::ensure`]).
    #[error("creation records: {0}")]
    Malformed(String),
}

/// Where creation records live: a key-value store that outlives the server.
pub trait RecordStore: Send + Sync {
    fn put(&self, key: &str, value: &[u8]) -> Result<(), RecordError>;
    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, RecordError>;
    /// Removes every key in `keys` at once.
    fn delete(&self, keys: &[String]) -> Result<(), RecordError>;
    /// Every record whose key starts with `prefix`.
    fn list(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, RecordError>;
    /// One page (at most [`LIST_PAGE`] records) of the records whose key
    /// starts with `prefix` and comes after `after`, in key order.
    fn page(
        &self,
        prefix: &str,
        after: Option<&str>,
    ) -> Result<Vec<(String, Vec<u8>)>, RecordError>;
    /// The record under `key`, which starts with `prefix` and comes right
    /// after `after` in key order: a store may read the following records
    /// with it ([`ReadAhead`]); by default, [`RecordStore::get`].
    fn fetch_ahead(
        &self,
        prefix: &str,
        key: &str,
        after: Option<&str>,
    ) -> Result<Option<Vec<u8>>, RecordError> {
        let _ = (prefix, after);
        self.get(key)
    }
}

/// A store that reads creation records a page at a time, for a whole
/// process: rebuilding after a reboot asks for many records, one per
/// descriptor named, and each request to the vault is a round trip to the
/// supervisor (about 15 µs even at `SCHED_FIFO`). So a record not read yet
/// is fetched with the page of records that follows it in key order (ids in
/// order, up to [`LIST_PAGE`]), in the same round trip, and the others wait
/// here. Every write of this process's records goes through this one store
/// ([`crate::Runtime::records`]: mm's server and its generated stub hold
/// two `GlobalRecords` over it) and drops what it wrote from the pages
/// read, once the vault has it; a page read while a write was made is not
/// kept. No one else changes these records: the vault is this component's,
/// and its other incarnations are dead.
pub struct ReadAhead {
    inner: Arc<dyn RecordStore>,
    read: Mutex<HashMap<String, Vec<u8>>>,
    /// Counts writes, so that a page read during one is not kept.
    writes: AtomicU64,
}

impl ReadAhead {
    pub fn new(inner: Arc<dyn RecordStore>) -> Self {
        Self {
            inner,
            read: Mutex::new(HashMap::new()),
            writes: AtomicU64::new(0),
        }
    }

    fn read(&self) -> MutexGuard<'_, HashMap<String, Vec<u8>>> {
        self.read.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// After a write of `keys` reached the store (or failed: it may have).
    fn forget<'a>(&self, keys: impl IntoIterator<Item = &'a str>) {
        self.writes.fetch_add(1, Ordering::SeqCst);
        let mut read = self.read();
        for k in keys {
            read.remove(k);
        }
    }
}

impl RecordStore for ReadAhead {
    fn put(&self, key: &str, value: &[u8]) -> Result<(), RecordError> {
        let done = self.inner.put(key, value);
        self.forget([key]);
        done
    }

    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, RecordError> {
        self.inner.get(key)
    }

    fn delete(&self, keys: &[String]) -> Result<(), RecordError> {
        let done = self.inner.delete(keys);
        self.forget(keys.iter().map(String::as_str));
        done
    }

    fn list(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, RecordError> {
        self.inner.list(prefix)
    }

    fn page(
        &self,
        prefix: &str,
        after: Option<&str>,
    ) -> Result<Vec<(String, Vec<u8>)>, RecordError> {
        self.inner.page(prefix, after)
    }

    fn fetch_ahead(
        &self,
        prefix: &str,
        key: &str,
        after: Option<&str>,
    ) -> Result<Option<Vec<u8>>, RecordError> {
        if let Some(found) = self.read().get(key) {
            return Ok(Some(found.clone()));
        }
        let writes = self.writes.load(Ordering::SeqCst);
        let page = self.inner.page(prefix, after)?;
        let found = page.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone());
        {
            let mut read = self.read();
            // A write since the page was asked for shows here, or drops what
            // it changed with the lock taken after ours.
            if self.writes.load(Ordering::SeqCst) == writes {
                read.extend(page);
            }
        }
        match found {
            Some(found) => Ok(Some(found)),
            // Absent, or left out of the page as malformed: the store's
            // own answer says which.
            None => self.inner.get(key),
        }
    }
}

/// A store in this process's memory, for tests that reboot a server in
/// process (it survives the server object, as the vault survives a server).
#[derive(Default)]
pub struct MemoryStore(Mutex<HashMap<String, Vec<u8>>>);

impl RecordStore for MemoryStore {
    fn put(&self, key: &str, value: &[u8]) -> Result<(), RecordError> {
        self.0.lock().unwrap().insert(key.into(), value.to_vec());
        Ok(())
    }

    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, RecordError> {
        Ok(self.0.lock().unwrap().get(key).cloned())
    }

    fn delete(&self, keys: &[String]) -> Result<(), RecordError> {
        let mut map = self.0.lock().unwrap();
        for k in keys {
            map.remove(k);
        }
        Ok(())
    }

    fn list(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, RecordError> {
        let map = self.0.lock().unwrap();
        Ok(map
            .iter()
            .filter(|(k, _)| k.starts_with(prefix))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect())
    }

    fn page(
        &self,
        prefix: &str,
        after: Option<&str>,
    ) -> Result<Vec<(String, Vec<u8>)>, RecordError> {
        let mut all = self.list(prefix)?;
        all.retain(|(k, _)| after.is_none_or(|a| k.as_str() > a));
        all.sort();
        all.truncate(LIST_PAGE);
        Ok(all)
    }
}

/// Records in the state vault, next to the component's other records, under
/// keys starting with `desc/`; values are the record's bytes in hex.
pub struct VaultRecords(pub Arc<Vault>);

/// The prefix of the keys of descriptors' creation records in a vault:
/// what a server's clients made through it (a supervisor restarted by its
/// keeper drops them, their clients being gone).
pub const VAULT_PREFIX: &str = "desc/";

fn vault_error(e: crate::vault::VaultError) -> RecordError {
    RecordError::Unavailable(e.to_string())
}

impl RecordStore for VaultRecords {
    fn put(&self, key: &str, value: &[u8]) -> Result<(), RecordError> {
        let hex: String = value.iter().map(|b| format!("{b:02x}")).collect();
        self.0
            .put(
                &format!("{VAULT_PREFIX}{key}"),
                serde_json::Value::String(hex),
                None,
            )
            .map_err(vault_error)
    }

    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, RecordError> {
        match self
            .0
            .get(&format!("{VAULT_PREFIX}{key}"))
            .map_err(vault_error)?
        {
            None => Ok(None),
            Some(r) => unhex(&r.value).map(Some),
        }
    }

    fn delete(&self, keys: &[String]) -> Result<(), RecordError> {
        let ops = keys
            .iter()
            .map(|k| VaultOp::Delete {
                key: format!("{VAULT_PREFIX}{k}"),
            })
            .collect();
        self.0.apply(ops, &[]).map_err(vault_error)
    }

    fn list(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, RecordError> {
        let full = format!("{VAULT_PREFIX}{prefix}");
        Ok(unprefixed(self.0.list_prefix(&full).map_err(vault_error)?))
    }

    fn page(
        &self,
        prefix: &str,
        after: Option<&str>,
    ) -> Result<Vec<(String, Vec<u8>)>, RecordError> {
        let full = format!("{VAULT_PREFIX}{prefix}");
        let after = after.map(|a| format!("{VAULT_PREFIX}{a}"));
        let (page, _) = self
            .0
            .list_page(&full, after.as_deref())
            .map_err(vault_error)?;
        Ok(unprefixed(page))
    }
}

/// Vault records as a [`RecordStore`] gives them: keys without `desc/`. A
/// record a faulty incarnation wrote malformed is left out: it is no
/// reason to fail the others (`get` reports it).
fn unprefixed(records: Vec<VaultRecord>) -> Vec<(String, Vec<u8>)> {
    records
        .into_iter()
        .filter_map(|r| {
            Some((
                r.key[VAULT_PREFIX.len()..].to_string(),
                unhex(&r.value).ok()?,
            ))
        })
        .collect()
}

fn unhex(v: &serde_json::Value) -> Result<Vec<u8>, RecordError> {
    let malformed = || RecordError::Malformed(format!("malformed record value {v}"));
    let s = v
        .as_str()
        .filter(|s| s.len() % 2 == 0)
        .ok_or_else(malformed)?;
    // By bytes: a faulty writer's string need not be ASCII.
    s.as_bytes()
        .chunks(2)
        .map(|pair| {
            let digits = std::str::from_utf8(pair).map_err(|_| malformed())?;
            u8::from_str_radix(digits, 16).map_err(|_| malformed())
        })
        .collect()
}

/// How one global descriptor was made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CreationRecord {
    /// The function that created it.
    pub func: u32,
    /// The component that created it: the rebuilt descriptor is its again.
    pub creator: u32,
    pub parent: Option<u64>,
    /// The creation function's arguments, wire-encoded.
    pub args: Vec<u8>,
}

impl CreationRecord {
    fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(17 + self.args.len());
        v.extend_from_slice(&self.func.to_le_bytes());
        v.extend_from_slice(&self.creator.to_le_bytes());
        v.push(self.parent.is_some() as u8);
        v.extend_from_slice(&self.parent.unwrap_or(0).to_le_bytes());
        v.extend_from_slice(&self.args);
        v
    }

    fn decode(b: &[u8]) -> Option<Self> {
        if b.len() < 17 {
            return None;
        }
        let func = u32::from_le_bytes(b[0..4].try_into().ok()?);
        let creator = u32::from_le_bytes(b[4..8].try_into().ok()?);
        let parent = u64::from_le_bytes(b[9..17].try_into().ok()?);
        Some(Self {
            func,
            creator,
            parent: (b[8] == 1).then_some(parent),
            args: b[17..].to_vec(),
        })
    }
}

/// A server stub's view of its global descriptors' records, and of which
/// of them the current incarnation already holds.
pub struct GlobalRecords {
    store: Arc<dyn RecordStore>,
    interface: &'static str,
    /// (descriptor type, id) built or rebuilt in this incarnation.
    known: RwLock<HashSet<(&'static str, u64)>>,
    rebuild: Mutex<()>,
}

impl GlobalRecords {
    pub fn new(store: Arc<dyn RecordStore>, interface: &'static str) -> Self {
        Self {
            store,
            interface,
            known: RwLock::new(HashSet::new()),
            rebuild: Mutex::new(()),
        }
    }

    fn key(&self, kind: &str, id: u64) -> String {
        format!("{}/{kind}/{id:016x}", self.interface)
    }

    fn is_known(&self, kind: &'static str, id: u64) -> bool {
        self.known.read().unwrap().contains(&(kind, id))
    }

    fn mark_known(&self, kind: &'static str, id: u64) {
        self.known.write().unwrap().insert((kind, id));
    }

    /// Held while descriptors are rebuilt, so that each is rebuilt once.
    fn rebuilding(&self) -> MutexGuard<'_, ()> {
        self.rebuild.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Makes sure this incarnation holds descriptor `id` of `kind`,
    /// rebuilding it, parents first, from the creation records of earlier
    /// incarnations: `rebuild(at, record, creator)` replays the record's
    /// creation function with `reuse: Some(at)` for its creator and returns
    /// the id the server gave, which must be `at`.
    pub fn ensure(
        &self,
        kind: &'static str,
        id: u64,
        mut rebuild: impl FnMut(u64, &CreationRecord, &Caller) -> Result<u64, Dispatched>,
    ) -> Result<(), Dispatched> {
        if self.is_known(kind, id) {
            return Ok(());
        }
        let unknown = |at| Dispatched::Refused(Refusal::UnknownDescriptor(at));
        let _one_at_a_time = self.rebuilding();
        let mut chain = Vec::new();
        let mut at = id;
        while !self.is_known(kind, at) {
            let record = match self.fetch(kind, at) {
                Ok(record) => record.ok_or(unknown(at))?,
                // Rebooting the server again would find it malformed again
                // (a loop no client would see the end of): the descriptor
                // is lost, its record dropped, and the caller told.
                Err(RecordError::Malformed(why)) => {
                    eprintln!(
                        "{}: {kind} {at:#x} refused as unknown: {why}",
                        self.interface
                    );
                    let _ = self.store.delete(&[self.key(kind, at)]);
                    return Err(unknown(at));
                }
                Err(e) => return Err(records_unavailable(e)),
            };
            let parent = record.parent;
            chain.push((at, record));
            match parent {
                Some(p) => at = p,
                None => break,
            }
        }
        for (at, record) in chain.into_iter().rev() {
            let creator = Caller {
                component: record.creator,
                slot: u32::MAX,
            };
            if rebuild(at, &record, &creator)? != at {
                return Err(unknown(at));
            }
            self.mark_known(kind, at);
        }
        Ok(())
    }

    /// Records that `caller`'s invocation of creation function `func`, with
    /// arguments `request` (as they came on the wire), made descriptor `id` of
    /// `kind`, a child of `parent`.
    pub fn record_creation(
        &self,
        kind: &'static str,
        id: u64,
        func: u32,
        caller: &Caller,
        parent: Option<u64>,
        request: &[u8],
    ) -> Result<(), Dispatched> {
        let record = CreationRecord {
            func,
            creator: caller.component,
            parent,
            args: request.to_vec(),
        };
        self.created(kind, id, &record).map_err(records_unavailable)
    }

    /// Records a descriptor the server just created.
    fn created(
        &self,
        kind: &'static str,
        id: u64,
        record: &CreationRecord,
    ) -> Result<(), RecordError> {
        self.store.put(&self.key(kind, id), &record.encode())?;
        self.mark_known(kind, id);
        Ok(())
    }

    /// The creation record of descriptor `id` of `kind`, if there is one
    /// (with the records after it, where the store reads ahead).
    pub fn fetch(
        &self,
        kind: &'static str,
        id: u64,
    ) -> Result<Option<CreationRecord>, RecordError> {
        // Keys are `<interface>/<kind>/<id as 16 hex digits>`: the page after
        // the previous id's key starts at this one, if it exists.
        let prefix = format!("{}/{kind}/", self.interface);
        let after = id.checked_sub(1).map(|before| self.key(kind, before));
        match self
            .store
            .fetch_ahead(&prefix, &self.key(kind, id), after.as_deref())?
        {
            None => Ok(None),
            Some(b) => CreationRecord::decode(&b).map(Some).ok_or_else(|| {
                RecordError::Malformed(format!("malformed record of {kind} {id:#x}"))
            }),
        }
    }

    /// Every descendant of `id`, parents before their children.
    pub fn subtree(&self, kind: &str, id: u64) -> Result<Vec<u64>, RecordError> {
        let prefix = format!("{}/{kind}/", self.interface);
        let mut children: HashMap<u64, Vec<u64>> = HashMap::new();
        for (key, value) in self.store.list(&prefix)? {
            // A record a faulty incarnation wrote malformed names no child
            // that can be rebuilt: it is no reason to fail the others.
            let Ok(child) = u64::from_str_radix(&key[prefix.len()..], 16) else {
                continue;
            };
            let Some(record) = CreationRecord::decode(&value) else {
                continue;
            };
            if let Some(parent) = record.parent {
                children.entry(parent).or_default().push(child);
            }
        }
        let mut order = Vec::new();
        let mut next = vec![id];
        while let Some(at) = next.pop() {
            if let Some(kids) = children.get(&at) {
                order.extend(kids);
                next.extend(kids);
            }
        }
        Ok(order)
    }

    /// Forgets closed descriptors.
    pub fn closed(&self, kind: &'static str, ids: &[u64]) -> Result<(), RecordError> {
        let keys: Vec<String> = ids.iter().map(|&id| self.key(kind, id)).collect();
        self.store.delete(&keys)?;
        let mut known = self.known.write().unwrap();
        for &id in ids {
            known.remove(&(kind, id));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A [`MemoryStore`] that counts the requests that would be round trips.
    #[derive(Default)]
    struct Counting {
        store: MemoryStore,
        requests: AtomicU64,
    }

    impl RecordStore for Counting {
        fn put(&self, key: &str, value: &[u8]) -> Result<(), RecordError> {
            self.store.put(key, value)
        }
        fn get(&self, key: &str) -> Result<Option<Vec<u8>>, RecordError> {
            self.requests.fetch_add(1, Ordering::SeqCst);
            self.store.get(key)
        }
        fn delete(&self, keys: &[String]) -> Result<(), RecordError> {
            self.store.delete(keys)
        }
        fn list(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, RecordError> {
            self.requests.fetch_add(1, Ordering::SeqCst);
            self.store.list(prefix)
        }
        fn page(
            &self,
            prefix: &str,
            after: Option<&str>,
        ) -> Result<Vec<(String, Vec<u8>)>, RecordError> {
            self.requests.fetch_add(1, Ordering::SeqCst);
            self.store.page(prefix, after)
        }
    }

    #[test]
    fn records_are_read_a_page_at_a_time_and_closed_ones_are_not_served() {
        let counting = Arc::new(Counting::default());
        let store = Arc::new(ReadAhead::new(counting.clone()));
        let old = GlobalRecords::new(store.clone(), "lock");
        let rec = |creator| CreationRecord {
            func: 0,
            creator,
            parent: None,
            args: vec![creator as u8],
        };
        let count = 300u64;
        for id in 1..=count {
            old.created("Lock", id * 2, &rec(id as u32)).unwrap();
        }
        old.created("Other", 3, &rec(999)).unwrap();
        let new = GlobalRecords::new(store.clone(), "lock");
        let requests = || counting.requests.load(Ordering::SeqCst);
        // Every record, byte for byte, in id order: one request per page.
        for id in 1..=count {
            assert_eq!(new.fetch("Lock", id * 2).unwrap(), Some(rec(id as u32)));
        }
        assert_eq!(requests(), count.div_ceil(LIST_PAGE as u64));
        // A missing id is answered by its page, as missing.
        assert_eq!(new.fetch("Lock", 5).unwrap(), None);
        assert_eq!(new.fetch("Lock", 2 * count + 2).unwrap(), None);
        // Another kind's records are not another's.
        assert_eq!(new.fetch("Other", 3).unwrap(), Some(rec(999)));
        assert_eq!(new.fetch("Lock", 3).unwrap(), None);
        // Two holders of the store (mm's server and its stub): a record one
        // closes or makes again is not served from the pages the other read.
        let stub = GlobalRecords::new(store.clone(), "lock");
        let server = GlobalRecords::new(store.clone(), "lock");
        assert!(stub.fetch("Lock", 2).unwrap().is_some());
        server.closed("Lock", &[4]).unwrap();
        assert_eq!(stub.fetch("Lock", 4).unwrap(), None);
        server.created("Lock", 6, &rec(77)).unwrap();
        assert_eq!(stub.fetch("Lock", 6).unwrap(), Some(rec(77)));
        assert_eq!(stub.fetch("Lock", 8).unwrap(), Some(rec(4)));
    }

    /// A page's creation record, a child of `parent`.
    fn rec(parent: Option<u64>) -> CreationRecord {
        CreationRecord {
            func: 1,
            creator: 7,
            parent,
            args: vec![1, 2, 3],
        }
    }

    #[test]
    fn records_round_trip_and_subtrees_list_parents_first() {
        let store = Arc::new(MemoryStore::default());
        let g = GlobalRecords::new(store.clone(), "mm");
        g.created("Page", 1, &rec(None)).unwrap();
        g.created("Page", 2, &rec(Some(1))).unwrap();
        g.created("Page", 3, &rec(Some(2))).unwrap();
        g.created("Page", 4, &rec(None)).unwrap();
        assert_eq!(g.fetch("Page", 2).unwrap(), Some(rec(Some(1))));
        assert_eq!(g.subtree("Page", 1).unwrap(), vec![2, 3]);
        // A fresh incarnation knows nothing until it rebuilds.
        let fresh = GlobalRecords::new(store, "mm");
        assert!(!fresh.is_known("Page", 1));
        assert!(fresh.fetch("Page", 3).unwrap().is_some());
        fresh.closed("Page", &[1, 2, 3]).unwrap();
        assert_eq!(fresh.fetch("Page", 3).unwrap(), None);
        assert!(fresh.fetch("Page", 4).unwrap().is_some());
    }

    #[test]
    fn a_malformed_record_loses_its_descriptor_not_the_server() {
        let store = Arc::new(MemoryStore::default());
        let g = GlobalRecords::new(store.clone(), "mm");
        g.created("Page", 1, &rec(None)).unwrap();
        g.created("Page", 2, &rec(Some(1))).unwrap();
        // A faulty incarnation wrote page 1's record cut short.
        store.put(&g.key("Page", 1), &[1, 2, 3]).unwrap();
        let fresh = GlobalRecords::new(store.clone(), "mm");
        let mut rebuilt = Vec::new();
        let r = fresh.ensure("Page", 2, |at, _, _| {
            rebuilt.push(at);
            Ok(at)
        });
        // Refused as a descriptor unknown (no server fault, so no reboot
        // that would find it malformed again), nothing rebuilt, and the
        // record dropped; the subtree of page 1 still lists its child.
        assert!(matches!(
            r,
            Err(Dispatched::Refused(Refusal::UnknownDescriptor(1)))
        ));
        assert!(rebuilt.is_empty());
        assert_eq!(store.get(&g.key("Page", 1)).unwrap(), None);
        assert_eq!(fresh.subtree("Page", 1).unwrap(), vec![2]);
    }
}

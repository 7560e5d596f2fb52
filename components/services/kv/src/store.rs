//! The store: keys to values in a `BTreeMap` (key order for `scan`), and a
//! version raised by every update. Deterministic by construction: nothing
//! here reads a clock, a random number or anything outside the map but
//! the changelog's replies, which the request log records, which is what
//! replaying its requests needs.

use std::collections::BTreeMap;
use std::ops::Bound;
use std::sync::{Mutex, MutexGuard};

use kintsugi_interfaces::kv::{self, Error, Pair};
use kintsugi_runtime::wire::ReplyBudget;
use kintsugi_runtime::Caller;

use crate::changelog::{Changelog, Position};

#[derive(Default)]
struct Map {
    entries: BTreeMap<String, Vec<u8>>,
    version: u64,
    /// Where the changelog's next record goes.
    logged: Position,
}

#[derive(Default)]
pub struct Store {
    map: Mutex<Map>,
    changelog: Option<Changelog>,
}

impl Store {
    pub fn new(changelog: Option<Changelog>) -> Self {
        Self {
            map: Mutex::default(),
            changelog,
        }
    }

    /// Empties the store (no key, version 0): the state of a store that
    /// has served nothing, which a restore of its first checkpoint puts
    /// back (`kintsugi bench kv` replays a log over it in process).
    pub fn clear(&self) {
        *self.map() = Map::default();
    }

    fn map(&self) -> MutexGuard<'_, Map> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Counts an update (`op` of `key`), recording it in the changelog
    /// first if there is one; returns the new version. The caller changes
    /// the map only if this succeeds.
    fn update(&self, map: &mut Map, op: &str, key: &str) -> Result<u64, Error> {
        let version = map.version + 1;
        if let Some(log) = &self.changelog {
            let line = format!("{version} {op} {key}\n");
            map.logged = log.append(map.logged, line.as_bytes())?;
        }
        map.version = version;
        Ok(version)
    }

    fn set(&self, map: &mut Map, op: &str, key: &str, value: &[u8]) -> Result<u64, Error> {
        let version = self.update(map, op, key)?;
        map.entries.insert(key.to_string(), value.to_vec());
        Ok(version)
    }
}

impl kv::Server for Store {
    fn put(&self, _: &Caller, key: &str, value: &[u8]) -> Result<u64, Error> {
        self.set(&mut self.map(), "put", key, value)
    }

    fn get(&self, _: &Caller, key: &str, out: &mut [u8]) -> Result<usize, Error> {
        let map = self.map();
        let value = map.entries.get(key).ok_or(Error::NotFound)?;
        out[..value.len()].copy_from_slice(value);
        Ok(value.len())
    }

    fn delete(&self, _: &Caller, key: &str) -> Result<u64, Error> {
        let mut map = self.map();
        if !map.entries.contains_key(key) {
            return Err(Error::NotFound);
        }
        let version = self.update(&mut map, "delete", key)?;
        map.entries.remove(key);
        Ok(version)
    }

    fn cas(
        &self,
        _: &Caller,
        key: &str,
        absent: bool,
        expected: &[u8],
        value: &[u8],
    ) -> Result<u64, Error> {
        let mut map = self.map();
        let matches = match map.entries.get(key) {
            None => absent,
            Some(v) => !absent && v.as_slice() == expected,
        };
        if !matches {
            return Err(Error::Mismatch);
        }
        self.set(&mut map, "cas", key, value)
    }

    fn scan(&self, _: &Caller, from: &str, limit: u32) -> Result<Vec<Pair>, Error> {
        let map = self.map();
        let mut reply = ReplyBudget::list();
        Ok(map
            .entries
            .range::<str, _>((Bound::Included(from), Bound::Unbounded))
            .take(limit as usize)
            .take_while(|(k, v)| reply.take(&[k.len(), v.len()]))
            .map(|(k, v)| Pair {
                key: k.clone(),
                value: v.clone(),
            })
            .collect())
    }

    fn stats(&self, _: &Caller) -> Result<Vec<u64>, Error> {
        let map = self.map();
        Ok(vec![map.version, map.entries.len() as u64])
    }

    fn client_died(&self, _: u32) {}

    /// The map's keys in strict order, and every one found where a search
    /// looks for it: what a `BTreeMap` damaged by a flip during an insert
    /// breaks, with nothing crashing (kv's campaign, seed 20). And every
    /// value's bytes read where the map says they are: a flipped pointer
    /// to them that leads out of the heap crashes the audit, not a later
    /// `free` after the checkpoint kept it (kv's heap-flip campaign).
    fn audit(&self) -> Result<(), String> {
        let map = self.map();
        let mut keys = 0;
        let mut last: Option<&String> = None;
        let mut read = 0u8;
        for (key, value) in &map.entries {
            read ^= value.iter().fold(0, |a, b| a ^ b);
            if last.is_some_and(|l| l >= key) {
                return Err(format!("key {key:?} follows {last:?}: out of order"));
            }
            if !map.entries.get(key).is_some_and(|v| std::ptr::eq(v, value)) {
                return Err(format!("key {key:?} is not where a search finds it"));
            }
            last = Some(key);
            keys += 1;
        }
        std::hint::black_box(read);
        match keys == map.entries.len() {
            true => Ok(()),
            false => Err(format!(
                "{keys} keys, but the map counts {}",
                map.entries.len()
            )),
        }
    }
}

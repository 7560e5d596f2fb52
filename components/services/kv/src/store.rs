//! The store: keys to values in a `BTreeMap` (key order for `scan`), and a
//! version raised by every update. Deterministic by construction: nothing
//! here reads a clock, a random number or anything outside the map, which
//! is what replaying its requests needs.

use std::collections::BTreeMap;
use std::ops::Bound;
use std::sync::{Mutex, MutexGuard};

use kintsugi_interfaces::kv::{self, Error, Pair};
use kintsugi_runtime::Caller;

/// Reply bytes `scan` fills at most (a reply buffer holds 64 KiB).
const SCAN_BYTES: usize = 48 * 1024;

#[derive(Default)]
struct Map {
    entries: BTreeMap<String, Vec<u8>>,
    version: u64,
}

impl Map {
    fn set(&mut self, key: &str, value: &[u8]) -> u64 {
        self.entries.insert(key.to_string(), value.to_vec());
        self.version += 1;
        self.version
    }
}

#[derive(Default)]
pub struct Store {
    map: Mutex<Map>,
}

impl Store {
    fn map(&self) -> MutexGuard<'_, Map> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl kv::Server for Store {
    fn put(&self, _: &Caller, key: &str, value: &[u8]) -> Result<u64, Error> {
        Ok(self.map().set(key, value))
    }

    fn get(&self, _: &Caller, key: &str, out: &mut [u8]) -> Result<usize, Error> {
        let map = self.map();
        let value = map.entries.get(key).ok_or(Error::NotFound)?;
        out[..value.len()].copy_from_slice(value);
        Ok(value.len())
    }

    fn delete(&self, _: &Caller, key: &str) -> Result<u64, Error> {
        let mut map = self.map();
        map.entries.remove(key).ok_or(Error::NotFound)?;
        map.version += 1;
        Ok(map.version)
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
        Ok(map.set(key, value))
    }

    fn scan(&self, _: &Caller, from: &str, limit: u32) -> Result<Vec<Pair>, Error> {
        let map = self.map();
        let mut bytes = 0;
        Ok(map
            .entries
            .range::<str, _>((Bound::Included(from), Bound::Unbounded))
            .take(limit as usize)
            .take_while(|(k, v)| {
                bytes += k.len() + v.len() + 16;
                bytes <= SCAN_BYTES
            })
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
}

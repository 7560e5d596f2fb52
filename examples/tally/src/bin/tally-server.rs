//! The tally server. Every total lives in the state vault (one record per
//! key, with the last `seq` applied for each client thread), so a new
//! incarnation loses nothing. With `panic_every = N` in its configuration,
//! the Nth `add` of each incarnation panics in its worker thread *after* the
//! vault took the new total and before the reply: the runtime turns the panic
//! into a crash (this crate is built with unwinding), the supervisor reboots
//! the server, the client stub re-sends the call, and the server answers it
//! from the vault as a duplicate.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use kintsugi_runtime::{Caller, Incarnation, Runtime};
use serde::{Deserialize, Serialize};
use tally_example::tally::{self, Error};

#[derive(Deserialize, Default)]
#[serde(default)]
struct Config {
    panic_every: u64,
}

/// One key's record in the vault.
#[derive(Serialize, Deserialize, Default, Clone)]
struct Entry {
    total: u64,
    /// "component:slot" -> the last seq applied for that client thread.
    applied: HashMap<String, u64>,
}

struct Tally {
    rt: Arc<Runtime>,
    entries: Mutex<HashMap<u32, Entry>>,
    adds: AtomicU64,
    panic_every: u64,
}

fn vault_key(key: u32) -> String {
    format!("tally/{key}")
}

impl Tally {
    fn restore(rt: &Arc<Runtime>, panic_every: u64) -> anyhow::Result<Self> {
        let mut entries = HashMap::new();
        for record in rt.vault().list_prefix("tally/")? {
            if let Some(key) = record.key.strip_prefix("tally/") {
                entries.insert(key.parse()?, serde_json::from_value(record.value)?);
            }
        }
        Ok(Self {
            rt: rt.clone(),
            entries: Mutex::new(entries),
            adds: AtomicU64::new(0),
            panic_every,
        })
    }
}

impl tally::Server for Tally {
    fn add(&self, caller: &Caller, key: u32, amount: u32, seq: u64) -> Result<u64, Error> {
        let thread = format!("{}:{}", caller.component, caller.slot);
        let mut entries = self.entries.lock().expect("a panic aborts the process");
        let entry = entries.entry(key).or_default();
        if entry.applied.get(&thread).is_some_and(|&last| last >= seq) {
            return Ok(entry.total); // a re-sent call: applied before the crash
        }
        let mut next = entry.clone();
        next.total = next
            .total
            .checked_add(u64::from(amount))
            .ok_or(Error::Full)?;
        next.applied.insert(thread, seq);
        let value = serde_json::to_value(&next).map_err(|_| Error::Full)?;
        self.rt
            .vault()
            .put(&vault_key(key), value, None)
            .map_err(|_| Error::Full)?;
        *entry = next;
        let n = self.adds.fetch_add(1, Ordering::Relaxed) + 1;
        if self.panic_every > 0 && n % self.panic_every == 0 {
            panic!("tally: planned panic at add {n} of this incarnation");
        }
        Ok(entry.total)
    }

    fn total(&self, _caller: &Caller, key: u32) -> Result<u64, Error> {
        let entries = self.entries.lock().expect("a panic aborts the process");
        Ok(entries.get(&key).map_or(0, |e| e.total))
    }
}

fn main() {
    kintsugi_runtime::run(|rt| {
        let config: Config = rt.config()?;
        let server = Tally::restore(rt, config.panic_every)?;
        Ok(Incarnation::serve(vec![tally::service(Arc::new(server))]))
    })
}

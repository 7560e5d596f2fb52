//! Hygiene of the generated code (`tests/idl/shadow.kidl`): an interface
//! whose types are named `Box`, `Vec` and `Ok` and whose arguments are named
//! `r`, `retry`, `caller`, `entry`, `n0`, `box_now` (the stubs' own locals
//! and std's and the runtime's names) compiles, serves, and recovers its
//! descriptors across a reboot with every value intact.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use kintsugi_runtime::testing::{Loopback, MemoryStore};
use kintsugi_runtime::Caller;
use kintsugi_runtime::RecordStore;

#[allow(dead_code)]
mod shadow {
    include!(concat!(env!("OUT_DIR"), "/test_idl/shadow.rs"));
}

/// An open box: its name, owner tag, data and position.
type OpenBox = (String, u32, Vec<u8>, u64);

#[derive(Default)]
struct Server {
    next: AtomicU64,
    boxes: Mutex<HashMap<u64, OpenBox>>,
    oks: Mutex<HashMap<u64, u64>>,
}

impl Server {
    fn new(incarnation: u64) -> Arc<Self> {
        let s = Self::default();
        s.next.store(incarnation * 100, Ordering::SeqCst);
        Arc::new(s)
    }

    fn with<T>(&self, id: u64, f: impl FnOnce(&mut OpenBox) -> T) -> Result<T, shadow::Error> {
        self.boxes
            .lock()
            .unwrap()
            .get_mut(&id)
            .map(f)
            .ok_or(shadow::Error::Gone)
    }
}

impl shadow::Server for Server {
    fn open(&self, _: &Caller, retry: &str, caller: u32) -> Result<u64, shadow::Error> {
        let id = self.next.fetch_add(1, Ordering::SeqCst);
        let data = format!("{retry}:{caller}:").into_bytes();
        self.boxes
            .lock()
            .unwrap()
            .insert(id, (retry.into(), caller, data, 0));
        Ok(id)
    }

    fn write(&self, _: &Caller, r: u64, entry: &[u8]) -> Result<u32, shadow::Error> {
        self.with(r, |b| {
            let at = b.3 as usize;
            b.2.truncate(at);
            b.2.extend_from_slice(entry);
            b.3 += entry.len() as u64;
            entry.len() as u32
        })
    }

    fn seek(&self, _: &Caller, w: u64, t: u64) -> Result<u64, shadow::Error> {
        self.with(w, |b| {
            b.3 = t;
            t
        })
    }

    fn where_at(
        &self,
        _: &Caller,
        e: u64,
        n0: u64,
        current: &shadow::Vec,
    ) -> Result<shadow::Vec, shadow::Error> {
        let (name, pos) = self.with(e, |b| (b.0.clone(), b.3))?;
        assert_eq!(n0, pos, "`from` passes the tracked position");
        Ok(shadow::Vec {
            r: pos + current.r,
            ret: format!("{name}/{}", current.ret),
        })
    }

    fn close(&self, _: &Caller, box_now: u64) -> Result<(), shadow::Error> {
        self.boxes
            .lock()
            .unwrap()
            .remove(&box_now)
            .map(|_| ())
            .ok_or(shadow::Error::Gone)
    }

    fn make(&self, _: &Caller, reuse: Option<u64>, some: u64) -> Result<u64, shadow::Error> {
        let id = reuse.unwrap_or_else(|| self.next.fetch_add(1, Ordering::SeqCst));
        self.oks.lock().unwrap().insert(id, some);
        Ok(id)
    }

    fn value_of(&self, _: &Caller, ok: u64) -> Result<u64, shadow::Error> {
        self.oks
            .lock()
            .unwrap()
            .get(&ok)
            .copied()
            .ok_or(shadow::Error::Gone)
    }

    fn drop_ok(&self, _: &Caller, ok: u64) -> Result<(), shadow::Error> {
        self.oks
            .lock()
            .unwrap()
            .remove(&ok)
            .map(|_| ())
            .ok_or(shadow::Error::Gone)
    }
}

#[test]
fn names_that_shadow_std_the_runtime_and_the_stubs_locals_work_across_a_reboot() {
    let store: Arc<dyn RecordStore> = Arc::new(MemoryStore::default());
    let lb = Loopback::new(shadow::service(Server::new(1), store.clone()));
    let client = shadow::Client::from_connection(lb.connection());
    let b: shadow::Box = client.open("notes", 7).unwrap();
    assert_eq!(client.write(b, b"abc").unwrap(), 3);
    assert_eq!(client.seek(b, 1).unwrap(), 1);
    let ok: shadow::Ok = client.make(42).unwrap();
    let here = shadow::Vec {
        r: 10,
        ret: "x".into(),
    };
    assert_eq!(
        client.where_at(b, &here).unwrap(),
        shadow::Vec {
            r: 11,
            ret: "notes/x".into()
        }
    );

    lb.reboot(shadow::service(Server::new(2), store));
    // The box is reopened with its remembered arguments and its position
    // restored; the global `Ok` keeps its id and value.
    assert_eq!(
        client.where_at(b, &here).unwrap(),
        shadow::Vec {
            r: 11,
            ret: "notes/x".into()
        },
        "rebuilt at its position"
    );
    assert_eq!(client.write(b, b"Z").unwrap(), 1);
    assert_eq!(client.value_of(ok).unwrap(), 42);
    client.drop_ok(ok).unwrap();
    client.close(b).unwrap();
    assert_eq!(client.tracked_boxs(), 0);
}

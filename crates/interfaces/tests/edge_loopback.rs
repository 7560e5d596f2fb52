//! The generator's less travelled paths, end to end: records in lists,
//! nested lists, record arguments, every kind of `replay` literal, two
//! tracked fields restored by two functions, calls on two descriptors, and an
//! interface without errors or descriptors (`tests/idl/*.kidl`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use kintsugi_runtime::testing::Loopback;
use kintsugi_runtime::{CallError, Caller, Fault, InterfaceError};

mod common;
use common::Log;

#[allow(dead_code)] // `connect()` and the like are not needed here.
mod edge {
    include!(concat!(env!("OUT_DIR"), "/test_idl/edge.rs"));
}

#[allow(dead_code)]
mod bare {
    include!(concat!(env!("OUT_DIR"), "/test_idl/bare.rs"));
}

use edge::{Error, Item};

struct EdgeServer {
    log: Arc<Log>,
    next: AtomicU64,
    /// Cursor id -> (pos, mark).
    cursors: Mutex<HashMap<u64, (u64, u64)>>,
    locks: Mutex<Vec<u64>>,
}

impl EdgeServer {
    fn new(log: &Arc<Log>, incarnation: u64) -> Arc<Self> {
        Arc::new(EdgeServer {
            log: log.clone(),
            next: AtomicU64::new(incarnation * 100),
            cursors: Mutex::default(),
            locks: Mutex::default(),
        })
    }

    fn cursor<T>(&self, c: u64, f: impl FnOnce(&mut (u64, u64)) -> T) -> Result<T, Error> {
        self.cursors
            .lock()
            .unwrap()
            .get_mut(&c)
            .map(f)
            .ok_or(Error::Worse)
    }
}

fn item(id: u64) -> Item {
    Item {
        id,
        name: format!("n{id}"),
        blob: vec![id as u8; 3],
        flag: id.is_multiple_of(2),
        small: 7,
        delta: -(id as i64),
        count: 9,
    }
}

impl edge::Server for EdgeServer {
    #[allow(clippy::too_many_arguments)]
    fn begin(
        &self,
        _: &Caller,
        name: &str,
        key: &[u8],
        item: &Item,
        tags: &[String],
        mode: u8,
        flag: bool,
        label: &str,
        raw: &[u8],
        level: i64,
    ) -> Result<u64, Error> {
        self.log.push(format!(
            "begin {name} {key:?} {} {tags:?} {mode} {flag} {label} {raw:?} {level}",
            item.name
        ));
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.cursors.lock().unwrap().insert(id, (0, 0));
        Ok(id)
    }

    fn step(&self, _: &Caller, c: u64, by: u32) -> Result<u32, Error> {
        self.cursor(c, |(pos, _)| {
            *pos += by as u64;
            by
        })
    }

    fn blob(&self, _: &Caller, c: u64, out: &mut [u8]) -> Result<usize, Error> {
        self.cursor(c, |(pos, _)| {
            *pos += 3;
            out[..3].copy_from_slice(b"abc");
            3
        })
    }

    fn go(&self, _: &Caller, c: u64, to: u64) -> Result<(), Error> {
        self.log.push(format!("go {to}"));
        self.cursor(c, |(pos, _)| *pos = to)
    }

    fn mark(&self, _: &Caller, c: u64, m: u64) -> Result<u64, Error> {
        self.log.push(format!("mark {m}"));
        self.cursor(c, |(_, mark)| {
            *mark = m;
            m
        })
    }

    fn where_is(&self, _: &Caller, c: u64) -> Result<Vec<u64>, Error> {
        self.cursor(c, |(pos, mark)| vec![*pos, *mark])
    }

    fn lock(&self, _: &Caller) -> Result<u64, Error> {
        self.log.push("lock".into());
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.locks.lock().unwrap().push(id);
        Ok(id)
    }

    fn both(&self, _: &Caller, c: u64, l: u64) -> Result<Vec<Vec<Item>>, Error> {
        if !self.locks.lock().unwrap().contains(&l) {
            return Err(Error::Bad);
        }
        let pos = self.cursor(c, |(pos, _)| *pos)?;
        Ok(vec![vec![], vec![item(pos), item(l)]])
    }

    fn unlock(&self, _: &Caller, l: u64, force: bool) -> Result<(), Error> {
        self.log.push(format!("unlock {force}"));
        let mut locks = self.locks.lock().unwrap();
        let at = locks.iter().position(|x| *x == l).ok_or(Error::Bad)?;
        locks.remove(at);
        Ok(())
    }

    fn items(
        &self,
        _: &Caller,
        filter: &[Item],
        nested: &[Vec<u64>],
        one: &Item,
    ) -> Result<Vec<Item>, Error> {
        let mut out: Vec<Item> = filter.to_vec();
        out.extend(nested.iter().flatten().map(|&id| item(id)));
        out.push(one.clone());
        Ok(out)
    }

    fn get(&self, _: &Caller, id: i64) -> Result<Item, Error> {
        Ok(Item {
            delta: id,
            ..item(id.unsigned_abs())
        })
    }

    fn ping(&self, _: &Caller) -> Result<(), Error> {
        Err(Error::Bad)
    }
}

#[test]
fn replay_literals_two_fields_and_two_descriptors() {
    let log = Arc::new(Log::default());
    let lb = Loopback::new(edge::service(EdgeServer::new(&log, 1)));
    let c = edge::Client::from_connection(lb.connection());

    let tags = vec!["t1".to_string(), "t2".to_string()];
    let cur = c
        .begin("cur", b"k", &item(5), &tags, 9, false, "label", b"raw", -5)
        .unwrap();
    assert_eq!(c.step(cur, 4).unwrap(), 4);
    assert_eq!(c.blob(cur).unwrap(), b"abc");
    assert_eq!(c.mark(cur, 42).unwrap(), 42);
    assert_eq!(c.where_is(cur).unwrap(), [7, 42]);
    let lock = c.lock().unwrap();
    assert_eq!(c.both(cur, lock).unwrap()[1][0], item(7));
    assert_eq!((c.tracked_cursors(), c.tracked_locks()), (1, 1));
    log.take();

    lb.reboot(edge::service(EdgeServer::new(&log, 2)));
    // Both descriptors are rebuilt: the cursor with its remembered arguments,
    // the replay literals, and both tracked fields.
    let got = c.both(cur, lock).unwrap();
    assert_eq!(got[1][0].id, 7);
    assert_eq!(
        log.take(),
        [
            "begin cur [107] n5 [\"t1\", \"t2\"] 3 true x [121, 122] -5",
            "go 7",
            "mark 42",
            "lock",
        ]
    );
    assert_eq!(c.where_is(cur).unwrap(), [7, 42]);

    // The go() restore function is also callable; it sets the field.
    c.go(cur, 0).unwrap();
    lb.reboot(edge::service(EdgeServer::new(&log, 3)));
    log.take();
    assert_eq!(c.where_is(cur).unwrap(), [0, 42]);
    assert_eq!(
        log.take(),
        [
            "begin cur [107] n5 [\"t1\", \"t2\"] 3 true x [121, 122] -5",
            "mark 42"
        ]
    );

    // A terminal call on a descriptor from a past epoch stays local.
    lb.reboot(edge::service(EdgeServer::new(&log, 4)));
    c.unlock(lock, true).unwrap();
    assert!(log.take().is_empty());
    assert_eq!(c.tracked_locks(), 0);
    assert_eq!(c.both(cur, lock), Err(CallError::BadDescriptor(lock.0)));
}

#[test]
fn lists_records_and_ranges() {
    let log = Arc::new(Log::default());
    let lb = Loopback::new(edge::service(EdgeServer::new(&log, 1)));
    let c = edge::Client::from_connection(lb.connection());
    let got = c
        .items(
            &[item(1), item(2)],
            &[vec![3], vec![], vec![4, 5]],
            &item(6),
        )
        .unwrap();
    let ids: Vec<u64> = got.iter().map(|i| i.id).collect();
    assert_eq!(ids, [1, 2, 3, 4, 5, 6]);
    assert_eq!(got[0], item(1));
    assert_eq!(c.get(-100).unwrap().delta, -100);
    assert!(
        matches!(c.get(101), Err(CallError::Fault(Fault::Refused(why))) if why.contains("`id`"))
    );
    let cur = c
        .begin(
            "c",
            b"12345678",
            &Item::default(),
            &[],
            0,
            false,
            "",
            b"",
            0,
        )
        .unwrap();
    assert!(
        matches!(c.step(cur, 0), Err(CallError::Fault(Fault::Refused(why))) if why.contains("`by`"))
    );
    assert!(matches!(
        c.begin("c", b"123456789", &Item::default(), &[], 0, false, "", b"", 0),
        Err(CallError::Fault(Fault::Refused(why))) if why.contains("`key`")
    ));
    assert!(matches!(
        c.begin("c", b"", &Item::default(), &[], 0, false, "", b"", 6),
        Err(CallError::Fault(Fault::Refused(why))) if why.contains("`level`")
    ));
    assert_eq!(c.ping(), Err(CallError::Server(Error::Bad)));
    assert_eq!(Error::Worse.to_string(), "worse");
}

struct Adder;

impl bare::Server for Adder {
    fn add(&self, _: &Caller, a: u64, b: u64) -> Result<u64, bare::Error> {
        Ok(a.wrapping_add(b))
    }
}

#[test]
fn an_interface_without_errors_or_descriptors() {
    let lb = Loopback::new(bare::service(Arc::new(Adder)));
    let c = bare::Client::from_connection(lb.connection());
    assert_eq!(c.add(2, 3).unwrap(), 5);
    lb.reboot(bare::service(Arc::new(Adder)));
    assert_eq!(c.add(u64::MAX, 1).unwrap(), 0);
    assert_eq!(bare::Error::from_code(1), None);
}

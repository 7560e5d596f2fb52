//! The full recovery model end to end over a real channel, with servers
//! rebooted in process (`tests/idl/tree.kidl`, `tests/idl/machine.kidl`):
//! global descriptors rebuilt by the server stub from creation records,
//! parents before children, a subtree closed after a reboot; a state machine
//! replayed into its state by the client stub; fields passed with `from` and
//! kept with `store`; eager recovery through the recovery upcall.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use kintsugi_runtime::testing::{Loopback, MemoryStore};
use kintsugi_runtime::RecordStore;
use kintsugi_runtime::{CallError, Caller, Fault};

mod common;
use common::Log;

#[allow(dead_code)]
mod tree {
    include!(concat!(env!("OUT_DIR"), "/test_idl/tree.rs"));
}

#[allow(dead_code)]
mod machine {
    include!(concat!(env!("OUT_DIR"), "/test_idl/machine.rs"));
}

/// A tree of nodes; ids come from a counter that starts high in each
/// incarnation, so a rebuilt node can only have its id through `reuse`.
/// A node's parent, tag and creator.
type Node = (Option<u64>, u64, u32);

struct TreeServer {
    log: Arc<Log>,
    next: AtomicU64,
    /// id -> (parent, tag, creator)
    nodes: Mutex<HashMap<u64, Node>>,
}

impl TreeServer {
    fn new(log: &Arc<Log>, incarnation: u64) -> Arc<Self> {
        Arc::new(Self {
            log: log.clone(),
            next: AtomicU64::new(incarnation * 1000),
            nodes: Mutex::new(HashMap::new()),
        })
    }

    fn add(&self, reuse: Option<u64>, parent: Option<u64>, tag: u64, creator: u32) -> u64 {
        let id = reuse.unwrap_or_else(|| self.next.fetch_add(1, Ordering::SeqCst));
        self.nodes
            .lock()
            .unwrap()
            .insert(id, (parent, tag, creator));
        id
    }
}

impl tree::Server for TreeServer {
    fn root(&self, c: &Caller, reuse: Option<u64>, tag: u64) -> Result<u64, tree::Error> {
        self.log.push(format!("root {tag} reuse={reuse:?}"));
        Ok(self.add(reuse, None, tag, c.component))
    }

    fn child(
        &self,
        c: &Caller,
        reuse: Option<u64>,
        up: u64,
        tag: u64,
        mode: u32,
    ) -> Result<u64, tree::Error> {
        if !self.nodes.lock().unwrap().contains_key(&up) {
            return Err(tree::Error::Missing);
        }
        self.log
            .push(format!("child {tag} of {up} mode={mode} reuse={reuse:?}"));
        Ok(self.add(reuse, Some(up), tag, c.component))
    }

    fn tag(&self, _: &Caller, n: u64) -> Result<u64, tree::Error> {
        let nodes = self.nodes.lock().unwrap();
        nodes.get(&n).map(|x| x.1).ok_or(tree::Error::Missing)
    }

    fn cut(&self, _: &Caller, n: u64) -> Result<(), tree::Error> {
        let mut nodes = self.nodes.lock().unwrap();
        let mut gone: HashSet<u64> = [n].into();
        loop {
            let more: Vec<u64> = nodes
                .iter()
                .filter(|(id, (p, _, _))| {
                    !gone.contains(id) && p.is_some_and(|p| gone.contains(&p))
                })
                .map(|(id, _)| *id)
                .collect();
            if more.is_empty() {
                break;
            }
            gone.extend(more);
        }
        let mut cut: Vec<u64> = gone.iter().copied().collect();
        cut.sort();
        for id in &cut {
            nodes.remove(id);
        }
        self.log.push(format!("cut {cut:?}"));
        Ok(())
    }
}

#[test]
fn global_descriptors_keep_their_ids_and_are_rebuilt_parents_first_by_the_server() {
    let log = Arc::new(Log::default());
    let store: Arc<dyn RecordStore> = Arc::new(MemoryStore::default());
    let lb = Loopback::new(tree::service(TreeServer::new(&log, 1), store.clone()));
    let client = tree::Client::from_connection(lb.connection());
    let root = client.root(10).unwrap();
    let mid = client.child(root, 20, 3).unwrap();
    let leaf = client.child(mid, 30, 3).unwrap();
    let other = client.root(40).unwrap();
    assert_eq!((root.0, mid.0, leaf.0, other.0), (1000, 1001, 1002, 1003));
    log.take();

    lb.reboot(tree::service(TreeServer::new(&log, 2), store.clone()));
    // A component that never created the leaf names it by its global id.
    let stranger = tree::Client::from_connection(lb.connection());
    assert_eq!(stranger.tag(tree::Node(leaf.0)).unwrap(), 30);
    assert_eq!(
        log.take(),
        [
            "root 10 reuse=Some(1000)",
            "child 20 of 1000 mode=7 reuse=Some(1001)",
            "child 30 of 1001 mode=7 reuse=Some(1002)",
        ],
        "parents first, same ids, `replay(7)` for mode"
    );
    assert_eq!(client.tag(mid).unwrap(), 20);
    assert!(log.take().is_empty(), "rebuilt once");

    lb.reboot(tree::service(TreeServer::new(&log, 3), store.clone()));
    client.cut(root).unwrap();
    let seen = log.take();
    assert_eq!(seen.len(), 4, "{seen:?}");
    assert_eq!(
        seen[3], "cut [1000, 1001, 1002]",
        "the whole subtree, rebuilt first"
    );
    // Closed ids are gone for good; an id nobody created is refused.
    lb.reboot(tree::service(TreeServer::new(&log, 4), store));
    match client.tag(leaf) {
        Err(CallError::Fault(Fault::NoDescriptor(why))) => assert!(why.contains("0x3ea"), "{why}"),
        other => panic!("a closed node answered {other:?}"),
    }
    assert_eq!(client.tag(other).unwrap(), 40);
}

/// Units with a level, a speed and a poll counter.
struct MachineServer {
    log: Arc<Log>,
    next: AtomicU64,
    /// id -> (state, polls)
    units: Mutex<HashMap<u64, (&'static str, u64)>>,
}

impl MachineServer {
    fn new(log: &Arc<Log>, incarnation: u64) -> Arc<Self> {
        Arc::new(Self {
            log: log.clone(),
            next: AtomicU64::new(incarnation * 100),
            units: Mutex::new(HashMap::new()),
        })
    }

    fn step(
        &self,
        m: u64,
        from: &str,
        to: &'static str,
        what: String,
    ) -> Result<(), machine::Error> {
        let mut units = self.units.lock().unwrap();
        let unit = units.get_mut(&m).ok_or(machine::Error::Wrong)?;
        if unit.0 != from {
            return Err(machine::Error::Wrong);
        }
        unit.0 = to;
        self.log.push(what);
        Ok(())
    }
}

impl machine::Server for MachineServer {
    fn make(&self, _: &Caller, tag: u64) -> Result<u64, machine::Error> {
        let id = self.next.fetch_add(1, Ordering::SeqCst);
        self.units.lock().unwrap().insert(id, ("off", 0));
        self.log.push(format!("make {tag}"));
        Ok(id)
    }

    fn prime(&self, _: &Caller, m: u64, level: u32) -> Result<(), machine::Error> {
        self.step(m, "off", "ready", format!("prime {level}"))
    }

    fn start(&self, _: &Caller, m: u64, speed: &str) -> Result<(), machine::Error> {
        self.step(m, "ready", "running", format!("start {speed}"))
    }

    fn stop(&self, _: &Caller, m: u64) -> Result<(), machine::Error> {
        self.step(m, "running", "ready", "stop".into())
    }

    fn poll(&self, _: &Caller, m: u64, since: u64) -> Result<u64, machine::Error> {
        let mut units = self.units.lock().unwrap();
        let unit = units.get_mut(&m).ok_or(machine::Error::Wrong)?;
        unit.1 += 1;
        Ok(since + 10)
    }

    fn scrap(&self, _: &Caller, m: u64) -> Result<(), machine::Error> {
        self.units.lock().unwrap().remove(&m);
        Ok(())
    }
}

#[test]
fn the_client_stub_replays_the_transitions_into_each_descriptors_state() {
    let log = Arc::new(Log::default());
    let lb = Loopback::new(machine::service(MachineServer::new(&log, 1)));
    let client = machine::Client::from_connection(lb.connection());
    let idle = client.make(1).unwrap();
    let ready = client.make(2).unwrap();
    client.prime(ready, 5).unwrap();
    let running = client.make(3).unwrap();
    client.prime(running, 6).unwrap();
    client.start(running, "fast").unwrap();
    // `poll` passes the tracked `seen` and stores what it returns.
    assert_eq!(client.poll(running).unwrap(), 10);
    assert_eq!(client.poll(running).unwrap(), 20);
    log.take();

    lb.reboot(machine::service(MachineServer::new(&log, 2)));
    client.stop(running).unwrap();
    assert_eq!(log.take(), ["make 3", "prime 6", "start fast", "stop"]);
    assert_eq!(
        client.poll(running).unwrap(),
        30,
        "`seen` survives the reboot"
    );
    client.start(ready, "slow").unwrap();
    assert_eq!(log.take(), ["make 2", "prime 5", "start slow"]);
    client.prime(idle, 1).unwrap();
    assert_eq!(log.take(), ["make 1", "prime 1"]);
}

#[test]
fn eager_recovery_rebuilds_every_descriptor_through_the_upcall() {
    let log = Arc::new(Log::default());
    let lb = Loopback::new(machine::service(MachineServer::new(&log, 1)));
    let client = machine::Client::from_connection(lb.connection());
    let units: Vec<_> = (0..5).map(|t| client.make(t).unwrap()).collect();
    client.prime(units[4], 9).unwrap();
    log.take();

    lb.reboot(machine::service(MachineServer::new(&log, 2)));
    assert_eq!(lb.upcall_recover().unwrap(), 5);
    let mut seen = log.take();
    seen.sort();
    assert_eq!(
        seen,
        ["make 0", "make 1", "make 2", "make 3", "make 4", "prime 9"]
    );
    client.start(units[4], "now").unwrap();
    assert_eq!(
        log.take(),
        ["start now"],
        "nothing left to rebuild on demand"
    );
    drop(client);
    lb.reboot(machine::service(MachineServer::new(&log, 3)));
    assert_eq!(
        lb.upcall_recover().unwrap(),
        0,
        "a dropped client recovers nothing"
    );
}

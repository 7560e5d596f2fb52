//! Which of the vault's records the next incarnation can rebuild its tree
//! from. A faulty incarnation may have written records that make no sense
//! (a key that is no inode, a node whose parent is missing or a file, a
//! name taken twice, a file without contents): such a record must not stop
//! every later incarnation from starting, so it is set aside, quarantined
//! under its own key with the reason, and the tree is built from the rest.
//! What it described is lost to clients, which a checking workload reports.

use std::collections::{BTreeMap, HashSet};
use std::os::fd::OwnedFd;

use kintsugi_runtime::vault::VaultRecord;
use serde::Deserialize;

use crate::tree::{NodeRecord, ROOT};

/// The prefix under which quarantined records are kept.
pub const QUARANTINE: &str = "quarantine/";

/// A node the tree can be rebuilt with.
pub struct Restorable {
    pub ino: u64,
    pub meta: NodeRecord,
    /// The file's contents (files only).
    pub data: Option<OwnedFd>,
}

/// The vault's records, sorted.
pub struct Sorted {
    /// Parents before their children.
    pub nodes: Vec<Restorable>,
    /// Records to quarantine, and why.
    pub rejected: Vec<(VaultRecord, String)>,
    /// Records quarantined by an earlier incarnation.
    pub quarantined: usize,
}

/// The key of the record of inode `ino`.
pub fn key(ino: u64) -> String {
    format!("{ino:016x}")
}

/// Splits `records` into the nodes of a consistent tree and the rest.
pub fn sort(records: Vec<VaultRecord>) -> Sorted {
    let mut rejected = Vec::new();
    let mut quarantined = 0;
    let mut parsed: BTreeMap<u64, (NodeRecord, VaultRecord)> = BTreeMap::new();
    for rec in records {
        if rec.key.starts_with(QUARANTINE) {
            quarantined += 1;
            continue;
        }
        match parse(&rec) {
            Ok((ino, meta)) => {
                parsed.insert(ino, (meta, rec));
            }
            Err(why) => rejected.push((rec, why)),
        }
    }
    // A node is kept once its parent is the root or a kept directory and its
    // name is free there; in rounds, so that parents come before children.
    let mut dirs = HashSet::from([ROOT]);
    let mut names = HashSet::new();
    let mut nodes = Vec::new();
    loop {
        let ready: Vec<u64> = parsed
            .iter()
            .filter(|(_, (meta, _))| dirs.contains(&meta.parent))
            .map(|(ino, _)| *ino)
            .collect();
        if ready.is_empty() {
            break;
        }
        for ino in ready {
            let (meta, rec) = parsed.remove(&ino).expect("listed");
            if !names.insert((meta.parent, meta.name.clone())) {
                let why = format!("name `{}` is taken in directory {}", meta.name, meta.parent);
                rejected.push((rec, why));
                continue;
            }
            if meta.dir {
                dirs.insert(ino);
            }
            let data = rec.fd;
            nodes.push(Restorable { ino, meta, data });
        }
    }
    // The rest hang from no directory of the tree (or from each other).
    for (_, (meta, rec)) in parsed {
        let why = format!("its parent {} is not a directory of the tree", meta.parent);
        rejected.push((rec, why));
    }
    Sorted {
        nodes,
        rejected,
        quarantined,
    }
}

/// A record's inode and metadata, if they make sense on their own.
fn parse(rec: &VaultRecord) -> Result<(u64, NodeRecord), String> {
    let ino = u64::from_str_radix(&rec.key, 16)
        .ok()
        .filter(|ino| key(*ino) == rec.key)
        .ok_or("its key is no inode number")?;
    if ino <= ROOT {
        return Err(format!("inode {ino} is reserved"));
    }
    let meta =
        NodeRecord::deserialize(&rec.value).map_err(|e| format!("malformed metadata: {e}"))?;
    if meta.name.is_empty() || meta.name.contains('/') || meta.name == "." || meta.name == ".." {
        return Err(format!("invalid name {:?}", meta.name));
    }
    match (meta.dir, rec.fd.is_some()) {
        (false, false) => Err("a file without contents".into()),
        (true, true) => Err("a directory with contents".into()),
        _ => Ok((ino, meta)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn rec(key: &str, value: serde_json::Value, file: bool) -> VaultRecord {
        let fd = file.then(|| {
            rustix::fs::memfd_create("ramfs-test", rustix::fs::MemfdFlags::CLOEXEC).unwrap()
        });
        VaultRecord {
            key: key.into(),
            value,
            fd,
        }
    }

    fn node(parent: u64, name: &str, dir: bool) -> serde_json::Value {
        json!({ "parent": parent, "name": name, "dir": dir })
    }

    #[test]
    fn a_consistent_tree_is_kept_whole() {
        let sorted = sort(vec![
            rec(&key(2), node(ROOT, "d", true), false),
            rec(&key(3), node(2, "f", false), true),
            rec(&key(4), node(ROOT, "g", false), true),
            rec(
                "quarantine/0000000000000009",
                json!({"why": "earlier"}),
                false,
            ),
        ]);
        let inos: Vec<u64> = sorted.nodes.iter().map(|n| n.ino).collect();
        assert_eq!(inos, [2, 4, 3], "parents before their children");
        assert!(sorted.nodes.iter().all(|n| n.meta.dir != n.data.is_some()));
        assert!(sorted.rejected.is_empty());
        assert_eq!(sorted.quarantined, 1);
    }

    #[test]
    fn records_a_faulty_incarnation_could_write_are_rejected_with_their_subtrees() {
        let sorted = sort(vec![
            rec(&key(2), node(ROOT, "d", true), false),
            rec(&key(3), node(2, "ok", false), true),
            rec("not-hex", node(ROOT, "x", false), true),
            rec(&key(1), node(ROOT, "root?", true), false),
            rec(&key(5), json!({"parent": "two"}), true),
            rec(&key(6), node(0x100002, "lost", true), false), // parent flipped
            rec(&key(7), node(6, "child-of-lost", false), true),
            rec(&key(8), node(3, "under-a-file", false), true),
            rec(&key(9), node(2, "ok", false), true), // name taken
            rec(&key(10), node(ROOT, "empty", false), false),
            rec(&key(11), node(12, "cycle-a", true), false),
            rec(&key(12), node(11, "cycle-b", true), false),
            rec(&key(13), node(ROOT, "a/b", false), true),
        ]);
        let kept: Vec<u64> = sorted.nodes.iter().map(|n| n.ino).collect();
        assert_eq!(kept, [2, 3]);
        let mut rejected: Vec<&str> = sorted
            .rejected
            .iter()
            .map(|(r, _)| r.key.as_str())
            .collect();
        rejected.sort();
        let mut expected: Vec<String> = [1, 5, 6, 7, 8, 9, 10, 11, 12, 13].map(key).to_vec();
        expected.push("not-hex".into());
        expected.sort();
        assert_eq!(rejected, expected);
        assert!(sorted.rejected.iter().all(|(_, why)| !why.is_empty()));
    }
}

//! The file tree, its open files, and how both map onto the state vault.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::ops::Bound;
use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Mutex};

use kintsugi_interfaces::fs::{self, Error, Stat};
use kintsugi_interfaces::fs_changes::{FIRST_FILE, NAMES};
use kintsugi_runtime::abi::channel::CHANGE_COUNTERS;
use kintsugi_runtime::vault::{Listing, VaultOp, VaultRecord};
use kintsugi_runtime::wire::ReplyBudget;
use kintsugi_runtime::{Caller, Runtime};
use serde::{Deserialize, Serialize};

use crate::restore::{self, key};

pub const ROOT: u64 = 1;

/// What the vault keeps per node (the memfd rides along for files).
#[derive(Debug, Serialize, Deserialize)]
pub struct NodeRecord {
    pub parent: u64,
    pub name: String,
    pub dir: bool,
}

enum Kind {
    Dir(BTreeMap<String, u64>),
    File(Arc<File>),
}

struct Node {
    parent: u64,
    name: String,
    kind: Kind,
}

struct OpenFile {
    ino: u64,
    data: Arc<File>,
    offset: u64,
}

#[derive(Default)]
struct State {
    nodes: HashMap<u64, Node>,
    next_ino: u64,
    /// Open files per (client component, descriptor id): a local namespace.
    open: HashMap<(u32, u64), OpenFile>,
    next_fd: u64,
}

pub struct RamFs {
    rt: Arc<Runtime>,
    state: Mutex<State>,
}

/// The change counter of file `ino`'s contents (`Stat::counter`).
fn counter_of(ino: u64) -> usize {
    FIRST_FILE + (ino % (CHANGE_COUNTERS - FIRST_FILE) as u64) as usize
}

fn io_err(e: std::io::Error) -> Error {
    if damaged(&e) {
        // Answering `NoSpace` would hide the damage from everyone: this
        // incarnation dies instead, is rebooted, and its client's call is
        // made again.
        tracing::error!("ramfs I/O: {e}: a buffer of this incarnation's is unmapped, so its memory or registers are damaged; aborting");
        std::process::abort();
    }
    tracing::error!("ramfs I/O: {e}");
    Error::NoSpace
}

/// Whether an I/O error says this incarnation is damaged: `EFAULT`, the
/// kernel finding a buffer ramfs passed it unmapped, which a correct ramfs
/// never does (seen in a campaign: a flipped pointer in a `write`).
fn damaged(e: &std::io::Error) -> bool {
    e.raw_os_error() == Some(rustix::io::Errno::FAULT.raw_os_error())
}

/// Splits an absolute path into its names; rejects `.`/`..`/empty names.
fn split(path: &str) -> Result<Vec<&str>, Error> {
    let rest = path.strip_prefix('/').ok_or(Error::Invalid)?;
    if rest.is_empty() {
        return Ok(Vec::new());
    }
    let names: Vec<&str> = rest.split('/').collect();
    if names
        .iter()
        .any(|n| n.is_empty() || *n == "." || *n == "..")
    {
        return Err(Error::Invalid);
    }
    Ok(names)
}

/// The tree built from the vault's records, and the records it could not
/// use. A standby builds it ahead ([`kintsugi_runtime::vault::prepare_ahead`]),
/// so it must not touch the vault: the incarnation quarantines.
pub struct Built {
    state: State,
    rejected: Vec<(VaultRecord, String)>,
    quarantined: usize,
}

impl Built {
    pub fn from_records(records: Vec<VaultRecord>) -> Self {
        let mut state = State {
            next_ino: ROOT + 1,
            next_fd: 1,
            ..Default::default()
        };
        state.nodes.insert(
            ROOT,
            Node {
                parent: ROOT,
                name: String::new(),
                kind: Kind::Dir(BTreeMap::new()),
            },
        );
        let sorted = restore::sort(records);
        for n in sorted.nodes {
            let kind = match n.data {
                Some(fd) => Kind::File(Arc::new(File::from(fd))),
                None => Kind::Dir(BTreeMap::new()),
            };
            state
                .children_mut(n.meta.parent)
                .insert(n.meta.name.clone(), n.ino);
            state.nodes.insert(
                n.ino,
                Node {
                    parent: n.meta.parent,
                    name: n.meta.name,
                    kind,
                },
            );
            state.next_ino = state.next_ino.max(n.ino.saturating_add(1));
        }
        Self {
            state,
            rejected: sorted.rejected,
            quarantined: sorted.quarantined,
        }
    }
}

impl RamFs {
    /// Rebuilds the tree from the vault (empty on the first incarnation),
    /// or takes it as its standby built it if the vault has not changed
    /// since. Records it cannot use are quarantined and logged, not fatal:
    /// see [`crate::restore`].
    pub fn restore(rt: Arc<Runtime>) -> anyhow::Result<Self> {
        let built = match rt.vault().list_prepared::<Built>()? {
            Listing::Prepared(built) => built,
            Listing::Records(records) => Built::from_records(records),
        };
        for (rec, why) in built.rejected {
            tracing::error!(key = rec.key, value = %rec.value, "quarantining a vault record: {why}");
            quarantine(&rt, rec, &why);
        }
        if built.quarantined > 0 {
            tracing::warn!("{} vault records are in quarantine", built.quarantined);
        }
        Ok(Self {
            rt,
            state: Mutex::new(built.state),
        })
    }
}

/// Moves `rec` under [`restore::QUARANTINE`], with `why`, in one vault
/// request; if the vault refuses, the record stays where it is and the next
/// incarnation sets it aside again.
fn quarantine(rt: &Runtime, rec: VaultRecord, why: &str) {
    let ops = vec![
        VaultOp::Put {
            key: format!("{}{}", restore::QUARANTINE, rec.key),
            value: serde_json::json!({ "why": why, "record": rec.value }),
            fd: rec.fd.is_some(),
        },
        VaultOp::Delete { key: rec.key },
    ];
    let fds: Vec<_> = rec.fd.iter().map(|fd| fd.as_fd()).collect();
    if let Err(e) = rt.vault().apply(ops, &fds) {
        tracing::error!("cannot quarantine a vault record: {e}");
    }
}

impl RamFs {
    /// Tells the clients that what `counter` counts has changed; after the
    /// change, so that a stat taken before it is seen as stale.
    fn changed(&self, counter: usize) {
        self.rt.publish_change(fs::INFO.name, counter);
    }

    /// Records a new node in the vault, then links it into the tree: a
    /// crash in between leaves it in the vault only, and the next
    /// incarnation links it. A file's contents live in a file the vault
    /// makes (a memfd, or a file in the vault's directory when the system
    /// keeps it on disk), returned.
    fn create(
        &self,
        st: &mut State,
        parent: u64,
        name: &str,
        dir: bool,
    ) -> Result<Option<Arc<File>>, Error> {
        let ino = st.next_ino;
        let record = NodeRecord {
            parent,
            name: name.to_string(),
            dir,
        };
        let value = serde_json::to_value(&record).unwrap();
        let vault_err = |e| io_err(std::io::Error::other(e));
        let (kind, data) = if dir {
            self.rt
                .vault()
                .put(&key(ino), value, None)
                .map_err(vault_err)?;
            (Kind::Dir(BTreeMap::new()), None)
        } else {
            let fd = self
                .rt
                .vault()
                .create_file(&key(ino), value)
                .map_err(vault_err)?;
            let data = Arc::new(File::from(fd));
            (Kind::File(data.clone()), Some(data))
        };
        st.next_ino += 1;
        st.children_mut(parent).insert(name.to_string(), ino);
        st.nodes.insert(
            ino,
            Node {
                parent,
                name: name.to_string(),
                kind,
            },
        );
        Ok(data)
    }
}

impl State {
    fn lookup(&self, path: &str) -> Result<u64, Error> {
        let mut ino = ROOT;
        for name in split(path)? {
            match &self.nodes[&ino].kind {
                Kind::Dir(children) => ino = *children.get(name).ok_or(Error::NotFound)?,
                Kind::File(_) => return Err(Error::NotDir),
            }
        }
        Ok(ino)
    }

    /// The parent directory's inode and the last name of `path`.
    fn parent_of<'p>(&self, path: &'p str) -> Result<(u64, &'p str), Error> {
        let names = split(path)?;
        let (last, dirs) = names.split_last().ok_or(Error::Invalid)?;
        let mut ino = ROOT;
        for name in dirs {
            match &self.nodes[&ino].kind {
                Kind::Dir(children) => ino = *children.get(*name).ok_or(Error::NotFound)?,
                Kind::File(_) => return Err(Error::NotDir),
            }
        }
        match self.nodes[&ino].kind {
            Kind::Dir(_) => Ok((ino, last)),
            Kind::File(_) => Err(Error::NotDir),
        }
    }

    fn child(&self, dir: u64, name: &str) -> Option<u64> {
        match &self.nodes[&dir].kind {
            Kind::Dir(children) => children.get(name).copied(),
            Kind::File(_) => None,
        }
    }

    fn children_mut(&mut self, dir: u64) -> &mut BTreeMap<String, u64> {
        match &mut self.nodes.get_mut(&dir).expect("parent exists").kind {
            Kind::Dir(children) => children,
            Kind::File(_) => unreachable!("parent_of returns directories only"),
        }
    }

    fn open_file(&mut self, caller: &Caller, fd: u64) -> Result<&mut OpenFile, Error> {
        self.open
            .get_mut(&(caller.component, fd))
            .ok_or(Error::BadFd)
    }
}

/// Open flags, as the `fs` interface defines them.
const CREATE: u32 = kintsugi_interfaces::fs_flags::CREATE;
const TRUNCATE: u32 = kintsugi_interfaces::fs_flags::TRUNCATE;

impl fs::Server for RamFs {
    fn open(&self, caller: &Caller, path: &str, flags: u32) -> Result<u64, Error> {
        let mut st = self.state.lock().unwrap();
        let (ino, data) = match st.lookup(path) {
            Ok(ino) => match &st.nodes[&ino].kind {
                Kind::File(data) => (ino, data.clone()),
                Kind::Dir(_) => return Err(Error::IsDir),
            },
            Err(Error::NotFound) if flags & CREATE != 0 => {
                let (parent, name) = st.parent_of(path)?;
                let ino = st.next_ino;
                let data = self
                    .create(&mut st, parent, name, false)?
                    .expect("a file has its data");
                self.changed(NAMES);
                (ino, data)
            }
            Err(e) => return Err(e),
        };
        if flags & TRUNCATE != 0 {
            data.set_len(0).map_err(io_err)?;
            self.changed(counter_of(ino));
        }
        let fd = st.next_fd;
        st.next_fd += 1;
        let file = OpenFile {
            ino,
            data,
            offset: 0,
        };
        st.open.insert((caller.component, fd), file);
        Ok(fd)
    }

    fn read(&self, caller: &Caller, fd: u64, len: u32, out: &mut [u8]) -> Result<usize, Error> {
        let (data, offset) = {
            let mut st = self.state.lock().unwrap();
            let f = st.open_file(caller, fd)?;
            (f.data.clone(), f.offset)
        };
        let want = (len as usize).min(out.len());
        let mut n = 0;
        while n < want {
            match data
                .read_at(&mut out[n..want], offset + n as u64)
                .map_err(io_err)?
            {
                0 => break,
                k => n += k,
            }
        }
        let mut st = self.state.lock().unwrap();
        st.open_file(caller, fd)?.offset = offset + n as u64;
        Ok(n)
    }

    fn write(&self, caller: &Caller, fd: u64, data: &[u8]) -> Result<u32, Error> {
        let (file, offset, ino) = {
            let mut st = self.state.lock().unwrap();
            let f = st.open_file(caller, fd)?;
            (f.data.clone(), f.offset, f.ino)
        };
        file.write_all_at(data, offset).map_err(io_err)?;
        self.changed(counter_of(ino));
        let mut st = self.state.lock().unwrap();
        st.open_file(caller, fd)?.offset = offset + data.len() as u64;
        Ok(data.len() as u32)
    }

    fn seek(&self, caller: &Caller, fd: u64, pos: u64) -> Result<u64, Error> {
        let mut st = self.state.lock().unwrap();
        st.open_file(caller, fd)?.offset = pos;
        Ok(pos)
    }

    fn truncate(&self, caller: &Caller, fd: u64, len: u64) -> Result<(), Error> {
        let mut st = self.state.lock().unwrap();
        let f = st.open_file(caller, fd)?;
        f.data.set_len(len).map_err(io_err)?;
        self.changed(counter_of(f.ino));
        Ok(())
    }

    fn close(&self, caller: &Caller, fd: u64) -> Result<(), Error> {
        let mut st = self.state.lock().unwrap();
        st.open
            .remove(&(caller.component, fd))
            .map(|_| ())
            .ok_or(Error::BadFd)
    }

    fn stat(&self, _caller: &Caller, path: &str) -> Result<Stat, Error> {
        let st = self.state.lock().unwrap();
        let ino = st.lookup(path)?;
        Ok(match &st.nodes[&ino].kind {
            Kind::Dir(children) => Stat {
                size: children.len() as u64,
                is_dir: true,
                counter: NAMES as u32,
            },
            Kind::File(data) => Stat {
                size: data.metadata().map_err(io_err)?.len(),
                is_dir: false,
                counter: counter_of(ino) as u32,
            },
        })
    }

    fn unlink(&self, _caller: &Caller, path: &str) -> Result<(), Error> {
        let mut st = self.state.lock().unwrap();
        let ino = st.lookup(path)?;
        if ino == ROOT {
            return Err(Error::Invalid);
        }
        if let Kind::Dir(children) = &st.nodes[&ino].kind {
            if !children.is_empty() {
                return Err(Error::NotEmpty);
            }
        }
        self.rt
            .vault()
            .delete(&key(ino))
            .map_err(|e| io_err(std::io::Error::other(e)))?;
        let node = st.nodes.remove(&ino).expect("looked up");
        st.children_mut(node.parent).remove(&node.name);
        self.changed(NAMES);
        Ok(())
    }

    fn mkdir(&self, _caller: &Caller, path: &str) -> Result<(), Error> {
        let mut st = self.state.lock().unwrap();
        let (parent, name) = st.parent_of(path)?;
        if st.child(parent, name).is_some() {
            return Err(Error::Exists);
        }
        self.create(&mut st, parent, name, true)?;
        self.changed(NAMES);
        Ok(())
    }

    fn rename(&self, _caller: &Caller, from: &str, to: &str) -> Result<(), Error> {
        let mut st = self.state.lock().unwrap();
        let ino = st.lookup(from)?;
        if ino == ROOT {
            return Err(Error::Invalid);
        }
        let (to_parent, to_name) = st.parent_of(to)?;
        // A directory cannot move into its own subtree.
        let mut up = to_parent;
        while up != ROOT {
            if up == ino {
                return Err(Error::Invalid);
            }
            up = st.nodes[&up].parent;
        }
        let replaced = st.child(to_parent, to_name);
        if replaced == Some(ino) {
            return Ok(());
        }
        let is_dir = matches!(st.nodes[&ino].kind, Kind::Dir(_));
        if let Some(old) = replaced {
            if is_dir || matches!(st.nodes[&old].kind, Kind::Dir(_)) {
                return Err(Error::Exists);
            }
        }
        let record = NodeRecord {
            parent: to_parent,
            name: to_name.to_string(),
            dir: is_dir,
        };
        let mut ops = vec![VaultOp::Put {
            key: key(ino),
            value: serde_json::to_value(&record).unwrap(),
            fd: false,
        }];
        if let Some(old) = replaced {
            ops.push(VaultOp::Delete { key: key(old) });
        }
        self.rt
            .vault()
            .apply(ops, &[])
            .map_err(|e| io_err(std::io::Error::other(e)))?;
        if let Some(old) = replaced {
            st.nodes.remove(&old);
        }
        let node = st.nodes.get_mut(&ino).expect("looked up");
        let old_parent = node.parent;
        let old_name = std::mem::replace(&mut node.name, to_name.to_string());
        node.parent = to_parent;
        st.children_mut(old_parent).remove(&old_name);
        st.children_mut(to_parent).insert(to_name.to_string(), ino);
        self.changed(NAMES);
        Ok(())
    }

    fn client_died(&self, client: u32) {
        let mut st = self.state.lock().unwrap();
        let before = st.open.len();
        st.open.retain(|(owner, _), _| *owner != client);
        let released = before - st.open.len();
        tracing::info!("released {released} descriptors of dead client {client}");
    }

    fn readdir(&self, _caller: &Caller, path: &str, after: &str) -> Result<Vec<String>, Error> {
        let st = self.state.lock().unwrap();
        let ino = st.lookup(path)?;
        match &st.nodes[&ino].kind {
            Kind::Dir(children) => Ok(page_after(children, after)),
            Kind::File(_) => Err(Error::NotDir),
        }
    }
}

/// The names of `children` after `after`, in order, as many as one reply
/// holds.
fn page_after(children: &BTreeMap<String, u64>, after: &str) -> Vec<String> {
    let mut reply = ReplyBudget::list();
    children
        .range::<str, _>((Bound::Excluded(after), Bound::Unbounded))
        .map(|(name, _)| name)
        .take_while(|name| reply.take(&[name.len()]))
        .cloned()
        .collect()
}

#[cfg(test)]
mod tests {
    use rustix::io::Errno;
    use std::collections::BTreeMap;
    use std::io::Error;

    use kintsugi_runtime::wire::{Writer, MAX_REPLY};

    #[test]
    fn a_directory_larger_than_a_reply_is_listed_in_pages_that_each_fit() {
        // 600 names of 200 to 299 bytes: about 150 KiB, three replies' worth.
        let children: BTreeMap<String, u64> = (0..600u64)
            .map(|i| {
                (
                    format!("{i:03}-{}", "x".repeat(196 + (i as usize * 7) % 100)),
                    i,
                )
            })
            .collect();
        let (mut listed, mut pages) = (Vec::<String>::new(), 0);
        loop {
            let after = listed.last().map_or("", String::as_str);
            let page = super::page_after(&children, after);
            if page.is_empty() {
                break;
            }
            pages += 1;
            // The page encodes into one reply, and one more name would not have.
            let mut buf = vec![0u8; MAX_REPLY];
            let mut w = Writer::new(&mut buf);
            w.u32(page.len() as u32).unwrap();
            for name in &page {
                w.str(name).unwrap();
            }
            if let Some((next, _)) = children
                .range::<str, _>((
                    std::ops::Bound::Excluded(page.last().unwrap().as_str()),
                    std::ops::Bound::Unbounded,
                ))
                .next()
            {
                assert!(w.str(next).is_err(), "page {pages} stopped short");
            }
            listed.extend(page);
        }
        assert!(pages >= 3, "{pages} pages");
        assert!(
            listed.iter().eq(children.keys()),
            "every name once, in order"
        );
        assert!(super::page_after(&BTreeMap::new(), "").is_empty());
    }

    #[test]
    fn only_an_unmapped_buffer_says_the_incarnation_is_damaged() {
        let os = |e: Errno| Error::from_raw_os_error(e.raw_os_error());
        assert!(super::damaged(&os(Errno::FAULT)));
        // What a full or failing disk answers stays an error for the client.
        assert!(!super::damaged(&os(Errno::NOSPC)));
        assert!(!super::damaged(&os(Errno::IO)));
        assert!(!super::damaged(&Error::other("the vault refused")));
    }
}

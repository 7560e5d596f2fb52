//! The workload's operations and the model they are checked against.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use kintsugi_interfaces::fs::{self, Client, File};
use kintsugi_interfaces::fs_changes::NAMES;
use kintsugi_interfaces::fs_flags::CREATE;
use kintsugi_runtime::client::Changes;
use kintsugi_runtime::counters::Failures;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use crate::Config;

/// A stat's answer, with ramfs's change counters taken before it.
struct Known {
    size: u64,
    counter: u32,
    when: Changes,
}

struct Handle {
    path: String,
    fd: File,
    offset: u64,
}

#[derive(Debug, Default, Clone, Serialize)]
pub struct Report {
    pub threads: usize,
    pub seed: u64,
    pub ops: u64,
    /// Calls that failed, and answers the model found wrong.
    #[serde(flatten)]
    pub failures: Failures,
    pub bytes_written: u64,
    pub bytes_read: u64,
    pub verified_files: u64,
    pub verified_bytes: u64,
    pub descriptors_open_at_end: usize,
    /// Stats of a file whose size had changed since its last stat: each
    /// time, ramfs's change counters must have moved too.
    pub changes_checked: u64,
    /// The most names one listing of a directory found.
    pub largest_listing: usize,
}

pub struct Workload<'a> {
    fs: &'a Client,
    rng: StdRng,
    files: BTreeMap<String, Vec<u8>>,
    dirs: BTreeSet<String>,
    open: Vec<Handle>,
    names: Vec<String>,
    max_write: usize,
    max_open: usize,
    report: Report,
    /// The last stat of each path.
    known: HashMap<String, Known>,
    /// Paths created, unlinked or renamed (from or to) since their last stat.
    renamed: HashSet<String>,
}

impl<'a> Workload<'a> {
    /// Thread `thread`'s workload: its own directories, model and random stream.
    pub fn new(fs: &'a Client, config: &Config, thread: usize) -> anyhow::Result<Self> {
        let mut dirs = BTreeSet::new();
        let mut names = Vec::new();
        for d in 0..config.dirs.max(1) {
            let dir = format!("/t{thread}d{d}");
            clear(fs, &dir)?;
            for f in 0..config.files.max(1) {
                names.push(format!("{dir}/f{f:-<pad$}", pad = config.name_bytes));
            }
            dirs.insert(dir);
        }
        let mut files = BTreeMap::new();
        if config.prefill {
            for name in &names {
                let fd = fs
                    .open(name, CREATE)
                    .map_err(|e| anyhow::anyhow!("open {name}: {e}"))?;
                fs.close(fd)
                    .map_err(|e| anyhow::anyhow!("close {name}: {e}"))?;
                files.insert(name.clone(), Vec::new());
            }
        }
        Ok(Self {
            fs,
            rng: StdRng::seed_from_u64(config.seed.wrapping_add(thread as u64)),
            renamed: files.keys().cloned().collect(),
            files,
            dirs,
            open: Vec::new(),
            names,
            max_write: config.max_write.clamp(1, 65536),
            max_open: config.max_open.max(1),
            known: HashMap::new(),
            report: Report {
                seed: config.seed,
                ..Default::default()
            },
        })
    }

    fn fail(&mut self, what: String) {
        self.report.failures.error(what);
    }

    /// A call answered, wrongly.
    fn corrupt(&mut self, what: String) {
        self.report.failures.corrupt(what);
    }

    /// Failures so far.
    pub fn failures(&self) -> &Failures {
        &self.report.failures
    }

    fn is_open(&self, path: &str) -> bool {
        self.open.iter().any(|h| h.path == path)
    }

    /// One random operation, checked.
    pub fn step(&mut self) {
        self.report.ops += 1;
        let roll = self.rng.gen_range(0..100);
        if self.open.is_empty() || (roll < 10 && self.open.len() < self.max_open) {
            return self.open_one();
        }
        let h = self.rng.gen_range(0..self.open.len());
        match roll {
            0..=39 => self.write(h),
            40..=64 => self.read(h),
            65..=72 => self.seek(h),
            73..=75 => self.truncate(h),
            76..=82 => self.close(h),
            83..=87 => self.stat(),
            88..=91 => self.readdir(),
            92..=95 => self.unlink(),
            _ => self.rename(),
        }
    }

    fn open_one(&mut self) {
        let path = self.names[self.rng.gen_range(0..self.names.len())].clone();
        match self.fs.open(&path, CREATE) {
            Ok(fd) => {
                if !self.files.contains_key(&path) {
                    self.renamed.insert(path.clone());
                }
                self.files.entry(path.clone()).or_default();
                self.open.push(Handle {
                    path,
                    fd,
                    offset: 0,
                });
            }
            Err(e) => self.fail(format!("open {path}: {e}")),
        }
    }

    fn write(&mut self, h: usize) {
        let len = if self.rng.gen_bool(0.05) {
            self.max_write
        } else {
            self.rng.gen_range(1..=self.max_write.min(4096))
        };
        let data: Vec<u8> = (0..len).map(|_| self.rng.gen()).collect();
        let (path, fd, offset) = (
            self.open[h].path.clone(),
            self.open[h].fd,
            self.open[h].offset,
        );
        match self.fs.write(fd, &data) {
            Ok(n) if n as usize == len => {
                let file = self.files.get_mut(&path).expect("open files are modelled");
                let end = offset as usize + len;
                if file.len() < end {
                    file.resize(end, 0);
                }
                file[offset as usize..end].copy_from_slice(&data);
                self.open[h].offset += len as u64;
                self.report.bytes_written += len as u64;
            }
            Ok(n) => self.corrupt(format!("write {path}@{offset}: wrote {n} of {len}")),
            Err(e) => self.fail(format!("write {path}@{offset}: {e}")),
        }
    }

    fn read(&mut self, h: usize) {
        let len = self.rng.gen_range(1..=self.max_write) as u32;
        let (path, fd, offset) = (
            self.open[h].path.clone(),
            self.open[h].fd,
            self.open[h].offset,
        );
        let file = &self.files[&path];
        let start = (offset as usize).min(file.len());
        let end = (start + len as usize).min(file.len());
        let expected = file[start..end].to_vec();
        match self.fs.read(fd, len) {
            Ok(got) if got == expected => {
                self.open[h].offset += got.len() as u64;
                self.report.bytes_read += got.len() as u64;
            }
            Ok(got) => {
                let at = got
                    .iter()
                    .zip(&expected)
                    .position(|(a, b)| a != b)
                    .unwrap_or(got.len().min(expected.len()));
                self.corrupt(format!(
                    "read {path}@{offset}+{len}: got {} bytes, expected {}; first difference at byte {at}",
                    got.len(),
                    expected.len()
                ));
                self.open[h].offset += got.len() as u64;
                self.resync_file(&path);
            }
            Err(e) => self.fail(format!("read {path}@{offset}: {e}")),
        }
    }

    fn seek(&mut self, h: usize) {
        let size = self.files[&self.open[h].path].len() as u64;
        let pos = self.rng.gen_range(0..=size + 64);
        match self.fs.seek(self.open[h].fd, pos) {
            Ok(p) if p == pos => self.open[h].offset = pos,
            Ok(p) => self.corrupt(format!(
                "seek {} to {pos}: server says {p}",
                self.open[h].path
            )),
            Err(e) => self.fail(format!("seek {}: {e}", self.open[h].path)),
        }
    }

    fn truncate(&mut self, h: usize) {
        let path = self.open[h].path.clone();
        let size = self.files[&path].len() as u64;
        let len = self.rng.gen_range(0..=size);
        match self.fs.truncate(self.open[h].fd, len) {
            Ok(()) => self.files.get_mut(&path).unwrap().truncate(len as usize),
            Err(e) => self.fail(format!("truncate {path} to {len}: {e}")),
        }
    }

    fn close(&mut self, h: usize) {
        let handle = self.open.swap_remove(h);
        if let Err(e) = self.fs.close(handle.fd) {
            self.fail(format!("close {}: {e}", handle.path));
        }
    }

    fn stat(&mut self) {
        let Some(path) = self.pick_file() else { return };
        let size = self.files[&path].len() as u64;
        let conn = self.fs.connection();
        // A new file at the path moves the names' counter; new contents, the file's.
        let renamed = self.renamed.remove(&path);
        if let Some(k) = self.known.get(&path).filter(|k| k.size != size) {
            self.report.changes_checked += 1;
            let counter = if renamed { NAMES } else { k.counter as usize };
            if conn.unchanged(&k.when, &[counter]) {
                let was = k.size;
                self.corrupt(format!(
                    "stat {path}: its size went from {was} to {size}, but ramfs's change counters stayed"
                ));
            }
        }
        let when = conn.changes();
        match self.fs.stat(&path) {
            Ok(s) if s.size == size && !s.is_dir => {
                let counter = s.counter;
                self.known.insert(
                    path,
                    Known {
                        size,
                        counter,
                        when,
                    },
                );
            }
            Ok(s) => {
                self.corrupt(format!("stat {path}: {s:?}, expected size {size}"));
                self.resync_file(&path);
            }
            Err(e) => self.fail(format!("stat {path}: {e}")),
        }
    }

    fn readdir(&mut self) {
        let dirs: Vec<String> = self.dirs.iter().cloned().collect();
        let dir = &dirs[self.rng.gen_range(0..dirs.len())];
        let expected = self.listing(dir);
        match self.fs.readdir_all(dir) {
            Ok(names) if names == expected => {
                self.report.largest_listing = self.report.largest_listing.max(names.len());
            }
            Ok(names) => {
                self.corrupt(format!("readdir {dir}: {names:?}, expected {expected:?}"));
                self.resync_dir(dir, &names);
            }
            Err(e) => self.fail(format!("readdir {dir}: {e}")),
        }
    }

    /// After a wrong answer about `path`'s contents, counted once: the
    /// model takes what ramfs holds now, so that later checks judge later
    /// calls, not the same damage again (in a campaign, errors of one
    /// fault counted in the windows of the injections after it).
    fn resync_file(&mut self, path: &str) {
        match self.read_whole(path) {
            Ok(contents) => {
                self.files.insert(path.to_string(), contents);
            }
            Err(e) => self.fail(format!("reading {path} again after a wrong answer: {e}")),
        }
        self.known.remove(path);
        self.renamed.insert(path.to_string());
    }

    /// After a listing of `dir` that differs from the model's, counted
    /// once: a name the model does not have (a file that should not
    /// exist) is unlinked, and a file ramfs lost leaves the model unless
    /// a descriptor holds it.
    fn resync_dir(&mut self, dir: &str, names: &[String]) {
        let listed: BTreeSet<String> = names.iter().map(|n| format!("{dir}/{n}")).collect();
        for path in &listed {
            if !self.files.contains_key(path) {
                if let Err(e) = self.fs.unlink(path) {
                    self.fail(format!("unlink {path}, a file that should not exist: {e}"));
                }
            }
        }
        let prefix = format!("{dir}/");
        let lost: Vec<String> = self
            .files
            .keys()
            .filter(|p| p.starts_with(&prefix) && !listed.contains(*p) && !self.is_open(p))
            .cloned()
            .collect();
        for path in lost {
            self.files.remove(&path);
            self.known.remove(&path);
        }
        self.renamed.extend(listed);
    }

    fn listing(&self, dir: &str) -> Vec<String> {
        let prefix = format!("{dir}/");
        self.files
            .keys()
            .filter_map(|p| p.strip_prefix(&prefix))
            .map(str::to_string)
            .collect()
    }

    /// A modelled file that no descriptor holds open.
    fn pick_file(&mut self) -> Option<String> {
        let closed: Vec<&String> = self.files.keys().filter(|p| !self.is_open(p)).collect();
        (!closed.is_empty()).then(|| closed[self.rng.gen_range(0..closed.len())].clone())
    }

    fn unlink(&mut self) {
        let Some(path) = self.pick_file() else { return };
        match self.fs.unlink(&path) {
            Ok(()) => {
                self.files.remove(&path);
                self.renamed.insert(path);
            }
            Err(e) => self.fail(format!("unlink {path}: {e}")),
        }
    }

    fn rename(&mut self) {
        let Some(from) = self.pick_file() else { return };
        let to = self.names[self.rng.gen_range(0..self.names.len())].clone();
        if to == from || self.is_open(&to) {
            return;
        }
        match self.fs.rename(&from, &to) {
            Ok(()) => {
                let data = self.files.remove(&from).unwrap();
                self.files.insert(to.clone(), data);
                self.renamed.extend([from, to]);
            }
            Err(e) => self.fail(format!("rename {from} -> {to}: {e}")),
        }
    }

    /// Closes everything and verifies every file and directory.
    pub fn finish(mut self) -> Report {
        while !self.open.is_empty() {
            self.close(0);
        }
        for dir in self.dirs.clone() {
            let expected = self.listing(&dir);
            match self.fs.readdir_all(&dir) {
                Ok(names) if names == expected => {
                    self.report.largest_listing = self.report.largest_listing.max(names.len());
                }
                Ok(names) => self.corrupt(format!(
                    "final readdir {dir}: {names:?}, expected {expected:?}"
                )),
                Err(e) => self.fail(format!("final readdir {dir}: {e}")),
            }
        }
        for (path, expected) in self.files.clone() {
            match self.read_whole(&path) {
                Ok(got) if got == expected => {
                    self.report.verified_files += 1;
                    self.report.verified_bytes += got.len() as u64;
                }
                Ok(got) => self.corrupt(format!(
                    "final {path}: {} bytes differ from the model's {}",
                    got.len(),
                    expected.len()
                )),
                Err(e) => self.fail(format!("final read {path}: {e}")),
            }
        }
        self.report
    }

    fn read_whole(&self, path: &str) -> Result<Vec<u8>, kintsugi_runtime::CallError<fs::Error>> {
        let fd = self.fs.open(path, 0)?;
        let mut out = Vec::new();
        loop {
            let chunk = self.fs.read(fd, 65536)?;
            if chunk.is_empty() {
                break;
            }
            out.extend_from_slice(&chunk);
        }
        self.fs.close(fd)?;
        Ok(out)
    }
}

impl Report {
    /// Adds another thread's report to this one.
    pub fn merge(&mut self, other: Report) {
        self.threads += 1;
        self.ops += other.ops;
        self.failures.merge(other.failures);
        self.bytes_written += other.bytes_written;
        self.bytes_read += other.bytes_read;
        self.verified_files += other.verified_files;
        self.verified_bytes += other.verified_bytes;
        self.changes_checked += other.changes_checked;
        self.largest_listing = self.largest_listing.max(other.largest_listing);
    }
}

/// Makes `dir` an empty directory: a rebooted workload starts from a clean
/// slate, since its model of the files did not survive.
fn clear(fs: &Client, dir: &str) -> anyhow::Result<()> {
    match fs.mkdir(dir) {
        Ok(()) => Ok(()),
        Err(kintsugi_runtime::CallError::Server(fs::Error::Exists)) => {
            for name in fs
                .readdir_all(dir)
                .map_err(|e| anyhow::anyhow!("readdir {dir}: {e}"))?
            {
                let path = format!("{dir}/{name}");
                fs.unlink(&path)
                    .map_err(|e| anyhow::anyhow!("unlink {path}: {e}"))?;
            }
            Ok(())
        }
        Err(e) => Err(anyhow::anyhow!("mkdir {dir}: {e}")),
    }
}

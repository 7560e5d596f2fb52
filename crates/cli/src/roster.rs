//! The roster a running system publishes, and the private directory it
//! lives in: `$XDG_RUNTIME_DIR/kintsugi`, else `/tmp/kintsugi-<uid>`.
//!
//! Nothing in it is trusted blindly (issue 17, "a roster that cannot be
//! forged"): the directory must be a real directory owned by this user
//! with no access for anyone else (created so, refused otherwise); files
//! are written through a fresh temporary file (`O_EXCL | O_NOFOLLOW`,
//! mode 0600) renamed into place, and read without following a symlink;
//! and the pids a command acts on are not taken from the file at all but
//! asked of the supervisor over its control socket, whose peer credentials
//! must name the supervisor the file names and this user, and each one is
//! checked to descend from that supervisor (see [`Verified`]).

use std::fs::OpenOptions;
use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use kintsugi_supervisor::Roster;
use serde::{Deserialize, Serialize};

/// One component in a published roster.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PublishedMember {
    pub name: String,
    pub pid: Option<u32>,
    pub epoch: u64,
    pub provides: Vec<String>,
    pub counters: Vec<(String, u64)>,
}

/// What `kintsugi run` publishes about the system it runs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Published {
    pub system: String,
    pub supervisor_pid: u32,
    pub members: Vec<PublishedMember>,
}

/// The roster directory's path (not checked: see [`private_dir`]).
fn dir_path() -> PathBuf {
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(d) => PathBuf::from(d).join("kintsugi"),
        None => PathBuf::from(format!(
            "/tmp/kintsugi-{}",
            rustix::process::geteuid().as_raw()
        )),
    }
}

/// The roster directory, created (mode 0700) if absent; refused unless it
/// is a directory, not a symlink, owned by this user, with no access for
/// group or others.
pub fn private_dir() -> anyhow::Result<PathBuf> {
    let dir = dir_path();
    check_private(&dir)?;
    Ok(dir)
}

/// Creates `dir` (0700) if absent; refuses it unless it is private to
/// this user.
fn check_private(dir: &Path) -> anyhow::Result<()> {
    let why =
        kintsugi_supervisor::private::refusal(dir).with_context(|| format!("{}", dir.display()))?;
    match why {
        Some(why) => anyhow::bail!(
            "refusing the roster directory {}: {why}; remove it, or set XDG_RUNTIME_DIR to a private directory",
            dir.display()
        ),
        None => Ok(()),
    }
}

/// Replaces `path` (in a private directory) with `bytes`, atomically: a
/// new temporary file, never an existing one or a symlink's target, then
/// a rename.
pub fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let tmp = path.with_file_name(format!(
        ".{name}.{}.{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    let written = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(O_NOFOLLOW)
        .open(&tmp)
        .and_then(|mut f| f.write_all(bytes));
    match written.and_then(|()| std::fs::rename(&tmp, path)) {
        Ok(()) => Ok(()),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}

/// Reads `path` if it is a regular file of this user (a symlink is not followed).
fn read_private(path: &Path) -> anyhow::Result<String> {
    let mut file = OpenOptions::new()
        .read(true)
        .custom_flags(O_NOFOLLOW)
        .open(path)
        .with_context(|| {
            format!(
                "{}: no published roster; is the system running under `kintsugi run`?",
                path.display()
            )
        })?;
    let meta = file.metadata()?;
    let me = rustix::process::geteuid().as_raw();
    anyhow::ensure!(
        meta.is_file() && meta.uid() == me,
        "{}: refused: not a regular file owned by uid {me}",
        path.display()
    );
    let mut text = String::new();
    file.read_to_string(&mut text)?;
    Ok(text)
}

/// `open(2)`'s flag that refuses a symbolic link as the last component.
const O_NOFOLLOW: i32 = rustix::fs::OFlags::NOFOLLOW.bits() as i32;

/// The roster file of `system` (a name, a system file or a roster file).
pub fn roster_file(system: &str) -> anyhow::Result<PathBuf> {
    let p = Path::new(system);
    if p.extension().is_some_and(|e| e == "json") {
        return Ok(p.to_path_buf());
    }
    let name = if p.extension().is_some_and(|e| e == "toml") {
        crate::run::load(p)?.name
    } else {
        system.to_string()
    };
    Ok(private_dir()?.join(format!("{name}.json")))
}

/// The roster file of the only system running (under this user).
pub fn only_running() -> anyhow::Result<PathBuf> {
    let dir = private_dir()?;
    let running: Vec<PathBuf> = std::fs::read_dir(&dir)?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .filter(|p| read_roster(p).is_ok())
        .collect();
    match running.as_slice() {
        [one] => Ok(one.clone()),
        [] => anyhow::bail!(
            "no system is running under `kintsugi run` ({})",
            dir.display()
        ),
        many => anyhow::bail!(
            "{} systems are running; name one: {}",
            many.len(),
            many.iter()
                .filter_map(|p| p.file_stem()?.to_str())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// The published roster at `path`, as written (names, counters): for
/// display only; act on pids through [`Verified`].
pub fn read_roster(path: &Path) -> anyhow::Result<Published> {
    let text = read_private(path)?;
    let published: Published =
        serde_json::from_str(&text).with_context(|| format!("{}", path.display()))?;
    anyhow::ensure!(
        Path::new(&format!("/proc/{}", published.supervisor_pid)).exists(),
        "{}: its supervisor (pid {}) is gone",
        path.display(),
        published.supervisor_pid
    );
    Ok(published)
}

/// A running system's supervisor, confirmed through its control socket,
/// and its live components as the supervisor itself reports them.
pub struct Verified {
    pub system: String,
    pub supervisor_pid: u32,
    /// Name, pid (if one is live), epoch and provided interfaces.
    pub members: Vec<PublishedMember>,
}

impl Verified {
    /// Asks the supervisor named by the roster at `path` for its members.
    pub fn ask(path: &Path) -> anyhow::Result<Self> {
        let published = read_roster(path)?;
        let members = crate::control::members(&published.system, published.supervisor_pid)
            .with_context(|| format!("{}: its supervisor does not confirm it", path.display()))?;
        let members = members
            .into_iter()
            .map(|(name, pid, epoch)| PublishedMember {
                provides: published
                    .members
                    .iter()
                    .find(|m| m.name == name)
                    .map(|m| m.provides.clone())
                    .unwrap_or_default(),
                name,
                pid,
                epoch,
                counters: Vec::new(),
            })
            .collect();
        Ok(Self {
            system: published.system,
            supervisor_pid: published.supervisor_pid,
            members,
        })
    }

    /// Whether `pid` is (still) a descendant of this supervisor: checked
    /// right before it is signalled, so that a pid reused since the answer
    /// is not hit.
    pub fn owns(&self, pid: u32) -> bool {
        let mut p = pid;
        for _ in 0..16 {
            match parent_of(p) {
                Some(pp) if pp == self.supervisor_pid => return true,
                Some(pp) if pp > 1 => p = pp,
                _ => return false,
            }
        }
        false
    }
}

/// The parent of `pid`, from `/proc/<pid>/stat`.
fn parent_of(pid: u32) -> Option<u32> {
    let stat = procfs::process::Process::new(pid as i32)
        .and_then(|p| p.stat())
        .ok()?;
    u32::try_from(stat.ppid).ok()
}

/// Keeps `<roster dir>/<system>.json` up to date while a system runs:
/// rewritten (atomically) on every event that changes a live process and
/// every 100 ms for the counters; removed when the system stops.
pub struct Publisher {
    roster: Arc<Roster>,
    path: PathBuf,
    system: String,
    provides: Vec<(String, Vec<String>)>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Publisher {
    pub fn start(system: &kintsugi_system::System, roster: Arc<Roster>) -> anyhow::Result<Self> {
        let dir = private_dir()?;
        let mut p = Self {
            roster,
            path: dir.join(format!("{}.json", system.name)),
            system: system.name.clone(),
            provides: system
                .components
                .iter()
                .map(|c| (c.name.clone(), c.provides.clone()))
                .collect(),
            stop: Arc::new(AtomicBool::new(false)),
            thread: None,
        };
        let (writer, stop) = (p.writer(), p.stop.clone());
        p.thread = Some(std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                writer();
                std::thread::sleep(Duration::from_millis(100));
            }
        }));
        Ok(p)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn writer(&self) -> impl Fn() + Send + 'static {
        let (roster, path, system, provides) = (
            self.roster.clone(),
            self.path.clone(),
            self.system.clone(),
            self.provides.clone(),
        );
        move || {
            let members = roster
                .members()
                .into_iter()
                .map(|m| PublishedMember {
                    counters: roster.counters(&m.name),
                    provides: provides
                        .iter()
                        .find(|(n, _)| *n == m.name)
                        .map(|(_, p)| p.clone())
                        .unwrap_or_default(),
                    name: m.name,
                    pid: m.pid,
                    epoch: m.epoch,
                })
                .collect();
            let published = Published {
                system: system.clone(),
                supervisor_pid: std::process::id(),
                members,
            };
            if let Ok(text) = serde_json::to_vec_pretty(&published) {
                let _ = write_private(&path, &text);
            }
        }
    }

    /// Rewrites the file now if `e` changed a live process.
    pub fn on(&self, e: &kintsugi_supervisor::Event) {
        use kintsugi_supervisor::Event::*;
        if matches!(
            e,
            Started { .. } | Rebooted { .. } | Crashed { .. } | GaveUp { .. }
        ) {
            (self.writer())();
        }
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("kintsugi-roster-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn a_directory_open_to_others_or_a_symlink_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let d = scratch("open");
        std::fs::create_dir(&d).unwrap();
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
        let e = check_private(&d).unwrap_err().to_string();
        assert!(e.contains("mode 755"), "{e}");
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700)).unwrap();
        check_private(&d).unwrap();
        let link = scratch("link");
        std::os::unix::fs::symlink(&d, &link).unwrap();
        let e = check_private(&link).unwrap_err().to_string();
        assert!(e.contains("symbolic link"), "{e}");
        std::fs::remove_file(&link).unwrap();
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn writing_replaces_a_symlink_and_never_writes_through_it() {
        let d = scratch("write");
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new().mode(0o700).create(&d).unwrap();
        let victim = d.join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        let path = d.join("sys.json");
        std::os::unix::fs::symlink(&victim, &path).unwrap();
        write_private(&path, b"{}").unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        assert_eq!(std::fs::read(&path).unwrap(), b"{}");
        let meta = std::fs::symlink_metadata(&path).unwrap();
        assert!(meta.is_file());
        assert_eq!(meta.mode() & 0o777, 0o600);
        // Reading refuses a symlink.
        std::fs::remove_file(&path).unwrap();
        std::os::unix::fs::symlink(&victim, &path).unwrap();
        assert!(read_private(&path).is_err());
        std::fs::remove_dir_all(&d).unwrap();
    }
}

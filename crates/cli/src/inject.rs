//! `kintsugi inject`: puts faults into a system that `kintsugi run` runs,
//! found through the roster file it publishes; and that roster file.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use kintsugi_campaign::{seed_or_clock, FaultArgs};
use kintsugi_inject::Injection;
use kintsugi_supervisor::Roster;
use rand::Rng;
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

/// Where running systems publish their rosters: `$XDG_RUNTIME_DIR/kintsugi`,
/// else `/tmp/kintsugi-<uid>`.
pub fn roster_dir() -> PathBuf {
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(d) => PathBuf::from(d).join("kintsugi"),
        None => PathBuf::from(format!(
            "/tmp/kintsugi-{}",
            rustix::process::getuid().as_raw()
        )),
    }
}

/// Keeps `<roster_dir>/<system>.json` up to date while a system runs:
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
        let dir = roster_dir();
        std::fs::create_dir_all(&dir).with_context(|| format!("{}", dir.display()))?;
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
            let tmp = path.with_extension(format!("json.{}", std::process::id()));
            if let Ok(text) = serde_json::to_vec_pretty(&published) {
                if std::fs::write(&tmp, text).is_ok() {
                    let _ = std::fs::rename(&tmp, &path);
                }
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

#[derive(Args, Debug)]
pub struct InjectArgs {
    /// The running system: its name (as published by `kintsugi run`), its
    /// system file, or a published roster file.
    #[arg(long)]
    pub system: String,
    /// The component to inject into, or `random` (one providing an interface).
    #[arg(long, default_value = "random")]
    pub component: String,
    #[command(flatten)]
    pub fault: FaultArgs,
    /// Inject every this many ms (default: once).
    #[arg(long, conflicts_with = "every_tick")]
    pub every_ms: Option<u64>,
    /// Inject at every tick (--tick-us) at which a thread of the target is
    /// executing user code, as C3 did at timer ticks.
    #[arg(long)]
    pub every_tick: bool,
    /// How many injections, with --every-ms or --every-tick.
    #[arg(long, default_value_t = 1)]
    pub count: u32,
    /// Seed for every choice (default: from the clock; printed).
    #[arg(long)]
    pub seed: Option<u64>,
    /// For --kind hang: release the thread after this many ms if its
    /// component has not been rebooted by then (default: hold it until then).
    #[arg(long)]
    pub hold_ms: Option<u64>,
}

/// The roster file of `system` (a name, a system file or a roster file).
pub(crate) fn roster_file(system: &str) -> anyhow::Result<PathBuf> {
    let p = Path::new(system);
    if p.extension().is_some_and(|e| e == "json") {
        return Ok(p.to_path_buf());
    }
    let name = if p.extension().is_some_and(|e| e == "toml") {
        crate::run::load(p)?.name
    } else {
        system.to_string()
    };
    Ok(roster_dir().join(format!("{name}.json")))
}

pub(crate) fn read_roster(path: &Path) -> anyhow::Result<Published> {
    let text = std::fs::read_to_string(path).with_context(|| {
        format!(
            "{}: no published roster; is the system running under `kintsugi run`?",
            path.display()
        )
    })?;
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

pub fn inject(args: InjectArgs) -> anyhow::Result<bool> {
    let path = roster_file(&args.system)?;
    let seed = seed_or_clock(args.seed);
    let mut injector = args.fault.injector(seed);
    let fault = args.fault.fault();
    let schedule = match (args.every_ms, args.every_tick) {
        (Some(ms), _) => format!("every {ms} ms"),
        (None, true) => format!("at every tick ({} µs)", args.fault.tick_us),
        (None, false) => "once".to_string(),
    };
    let count = if args.every_ms.is_some() || args.every_tick {
        args.count
    } else {
        1
    };
    println!(
        "inject: {fault} into {} of `{}`, {schedule}, {count} in all, seed {seed}",
        args.component,
        path.display()
    );
    let (mut done, mut failed) = (0u32, 0u32);
    while done < count {
        let roster = read_roster(&path)?;
        let candidates: Vec<&PublishedMember> = roster
            .members
            .iter()
            .filter(|m| match args.component.as_str() {
                "random" => !m.provides.is_empty(),
                name => m.name == name,
            })
            .collect();
        anyhow::ensure!(
            !candidates.is_empty(),
            "`{}` is not a component of system `{}`",
            args.component,
            roster.system
        );
        let target = candidates[injector.rng().gen_range(0..candidates.len())];
        let Some(pid) = target.pid else {
            std::thread::sleep(Duration::from_millis(10));
            continue;
        };
        let started = Instant::now();
        match injector.inject(pid, &fault) {
            Ok(Injection::Hang(mut held)) => {
                println!(
                    "{}: pid {pid} epoch {}: thread {} held stopped",
                    target.name,
                    target.epoch,
                    held.tid()
                );
                let until = args.hold_ms.map(|ms| started + Duration::from_millis(ms));
                while !held.reap_if_dead() {
                    if until.is_some_and(|u| Instant::now() >= u) {
                        held.release()?;
                        println!(
                            "{}: released after {} ms",
                            target.name,
                            started.elapsed().as_millis()
                        );
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                done += 1;
            }
            Ok(i) => {
                println!("{}: pid {pid} epoch {}: {i}", target.name, target.epoch);
                done += 1;
            }
            Err(kintsugi_inject::InjectError::Gone(_)) => continue,
            Err(e) => {
                eprintln!("{}: pid {pid}: {e}", target.name);
                failed += 1;
                anyhow::ensure!(
                    failed < 10 + count,
                    "giving up after {failed} failed attempts"
                );
                if args.every_ms.is_none() && !args.every_tick {
                    return Ok(false);
                }
            }
        }
        if done < count {
            match args.every_ms {
                Some(ms) => {
                    std::thread::sleep(Duration::from_millis(ms).saturating_sub(started.elapsed()))
                }
                None => std::thread::sleep(Duration::from_micros(args.fault.tick_us)),
            }
        }
    }
    Ok(true)
}

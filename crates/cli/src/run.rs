//! `kintsugi run`, `kintsugi demo` and `kintsugi check`.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use kintsugi_supervisor::journald::{self, Journal};
use kintsugi_supervisor::stats::Summary;
use kintsugi_supervisor::{parse_signal, ChaosPlan, Event, Options};

use crate::keeper::{Kept, Pinger};

/// The demo's system, built in so that the demo runs from anywhere.
const DEMO_SYSTEM: &str = include_str!("../../../systems/demo.toml");

#[derive(Args, Debug, Clone)]
pub struct ChaosArgs {
    /// Kill this component's live incarnation at random instants.
    #[arg(long)]
    pub kill: Option<String>,
    /// How many kills (default: until the system stops).
    #[arg(long)]
    pub kills: Option<u32>,
    /// Interval between kills in ms, as MIN..MAX.
    #[arg(long, default_value = "50..500")]
    pub kill_every: String,
    /// Signals to choose from, comma-separated (`stop` injects a hang:
    /// the process stops, and its watchdog must find it).
    #[arg(long, default_value = "kill,segv")]
    pub signals: String,
    /// Seed for the kill schedule (default: from the clock; printed).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop the system once the kills are done.
    #[arg(long)]
    pub stop_after_kills: bool,
}

#[derive(Args, Debug)]
pub struct RunArgs {
    /// The system description.
    pub system: PathBuf,
    #[command(flatten)]
    pub chaos: ChaosArgs,
    /// Stop after this many seconds.
    #[arg(long)]
    pub duration: Option<f64>,
    /// Stop when this component ends by itself.
    #[arg(long)]
    pub until_finished: Option<String>,
    /// Print only faults and the summary, not every reboot.
    #[arg(long, short)]
    pub quiet: bool,
    /// How events are printed: `text` lines, or one JSON object per line
    /// (`{"t_us": …, "event": "rebooted", …}`, durations in µs).
    #[arg(long, value_enum, default_value_t = EventFormat::Text)]
    pub events: EventFormat,
    /// Detect deaths only through pidfds, not lifelines (for comparison).
    #[arg(long)]
    pub no_lifelines: bool,
    /// Serve Prometheus metrics at http://ADDR/metrics (a loopback
    /// address, e.g. 127.0.0.1:9464; port 0 picks one, logged).
    #[arg(long)]
    pub metrics: Option<std::net::SocketAddr>,
    /// Set a key of a component's config, overriding the system file:
    /// `COMPONENT.KEY=VALUE`, VALUE read as JSON if it is JSON, else as a
    /// string (`--set netd.port=8080 --set httpd.docroot=/srv/www`).
    #[arg(long = "set", value_name = "COMPONENT.KEY=VALUE", value_parser = Setting::parse)]
    pub settings: Vec<Setting>,
    /// Start COMPONENT from an image file that `kintsugi checkpoint --out`
    /// wrote (here or under another supervisor): its vault records and
    /// durable memory are put in place before it starts, its memory and
    /// threads restored once it serves. Repeatable.
    #[arg(long = "restore", value_name = "COMPONENT=FILE", value_parser = parse_restore)]
    pub restores: Vec<(String, PathBuf)>,
}

/// One `--set COMPONENT.KEY=VALUE`.
#[derive(Debug, Clone)]
pub struct Setting {
    component: String,
    key: String,
    value: serde_json::Value,
}

impl Setting {
    fn parse(s: &str) -> Result<Self, String> {
        let (path, value) = s
            .split_once('=')
            .ok_or_else(|| format!("`{s}`: expected COMPONENT.KEY=VALUE"))?;
        let (component, key) = path
            .split_once('.')
            .filter(|(c, k)| !c.is_empty() && !k.is_empty())
            .ok_or_else(|| format!("`{path}`: expected COMPONENT.KEY"))?;
        let value = serde_json::from_str(value).unwrap_or_else(|_| value.into());
        Ok(Self {
            component: component.into(),
            key: key.into(),
            value,
        })
    }

    fn apply(&self, system: &mut kintsugi_system::System) -> anyhow::Result<()> {
        let name = system.name.clone();
        system
            .component_mut(&self.component)
            .with_context(|| {
                format!(
                    "--set: system `{name}` has no component `{}`",
                    self.component
                )
            })?
            .set_config(&self.key, self.value.clone());
        Ok(())
    }
}

#[derive(Args, Debug)]
pub struct DemoArgs {
    /// How long to run, in seconds.
    #[arg(long, default_value_t = 10.0)]
    pub duration: f64,
    #[arg(long)]
    pub seed: Option<u64>,
}

pub(crate) fn load(path: &Path) -> anyhow::Result<kintsugi_system::System> {
    kintsugi_system::load(path, &kintsugi_system::search_dirs()).map_err(|e| anyhow::anyhow!("{e}"))
}

pub fn chaos_plan(args: &ChaosArgs) -> anyhow::Result<Option<ChaosPlan>> {
    let Some(target) = &args.kill else {
        return Ok(None);
    };
    let (lo, hi) = args
        .kill_every
        .split_once("..")
        .and_then(|(a, b)| Some((a.trim().parse::<f64>().ok()?, b.trim().parse::<f64>().ok()?)))
        .with_context(|| {
            format!(
                "--kill-every `{}`: expected MIN..MAX in milliseconds",
                args.kill_every
            )
        })?;
    let signals = args
        .signals
        .split(',')
        .map(|s| parse_signal(s).with_context(|| format!("--signals: unknown signal `{s}`")))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
    });
    println!(
        "chaos: killing {target} with {} every {lo}..{hi} ms, seed {seed}",
        args.signals
    );
    Ok(Some(ChaosPlan {
        target: target.clone(),
        signals,
        min_interval: Duration::from_secs_f64(lo / 1e3),
        max_interval: Duration::from_secs_f64(hi / 1e3),
        count: args.kills,
        seed,
    }))
}

/// How the event log is printed.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventFormat {
    Text,
    Json,
}

/// One line of `--events json`: the event and when it happened, since the
/// start and on the wall clock (Unix time in ms, for joining other logs).
#[derive(serde::Serialize)]
struct Stamped<'a> {
    t_us: u64,
    unix_ms: u64,
    #[serde(flatten)]
    event: &'a Event,
}

/// Prints events as a live log and tallies reboots.
struct Log {
    start: Instant,
    quiet: bool,
    format: EventFormat,
    reboots: Vec<Duration>,
    injected: u32,
    injected_busy: u32,
    /// Set once stdout is gone (a reader such as `head` closed the pipe):
    /// the system runs on, and the log is no longer written.
    closed: bool,
    /// With the logs in systemd's journal, events (with their fields) and
    /// the summary go there as entries, not to stdout.
    journal: Option<Arc<Journal>>,
}

impl Log {
    /// Writes one line to stdout, unless it is gone: a closed pipe must not
    /// take the supervisor, and with it every component, down.
    /// A line of the event log; in the journal, a notice with the
    /// `COMPONENT` it is about, if any.
    fn line(&mut self, component: Option<&str>, text: &str) {
        if let Some(j) = &self.journal {
            let mut entry = journald::Entry::new(journald::Priority::Notice, text);
            if let Some(c) = component {
                entry.field("COMPONENT", c);
            }
            let _ = j.send(&entry);
            return;
        }
        if self.closed {
            return;
        }
        let mut out = std::io::stdout().lock();
        if let Err(e) = writeln!(out, "{text}").and_then(|()| out.flush()) {
            self.closed = true;
            tracing::warn!("the event log's output is gone ({e}); the system runs on without it");
        }
    }

    fn new(quiet: bool, format: EventFormat, journal: Option<Arc<Journal>>) -> Self {
        Self {
            start: Instant::now(),
            quiet,
            format,
            reboots: Vec::new(),
            injected: 0,
            injected_busy: 0,
            closed: false,
            journal,
        }
    }

    fn on(&mut self, e: &Event) {
        match e {
            Event::Rebooted { took, .. } => self.reboots.push(*took),
            Event::Injected { in_flight, .. } => {
                self.injected += 1;
                self.injected_busy += !in_flight.is_empty() as u32;
            }
            _ => {}
        }
        let routine = matches!(
            e,
            Event::Rebooted { .. }
                | Event::Injected { .. }
                | Event::Crashed { .. }
                | Event::Recovered { .. }
                | Event::EagerRecovery { .. }
        );
        if self.quiet && routine {
            return;
        }
        if let Some(j) = &self.journal {
            let _ = j.send(&journald::event_entry(e));
            return;
        }
        let t = self.start.elapsed();
        match self.format {
            EventFormat::Text => self.line(None, &format!("[{:>10.6}] {e}", t.as_secs_f64())),
            EventFormat::Json => match serde_json::to_string(&Stamped {
                t_us: t.as_micros() as u64,
                unix_ms: std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis() as u64),
                event: e,
            }) {
                Ok(line) => self.line(None, &line),
                Err(err) => tracing::error!("event not serializable: {err}"),
            },
        }
    }

    fn summary(&mut self) {
        let took: Vec<f64> = self
            .reboots
            .iter()
            .map(|d| d.as_nanos() as f64 / 1e3)
            .collect();
        let Some(s) = Summary::of(&took) else { return };
        let text = format!(
            "{} reboots: p50 {:.0} µs, p99 {:.0} µs, max {:.0} µs; {} of {} injections hit a call in flight",
            s.n, s.p50, s.p99, s.max, self.injected_busy, self.injected
        );
        self.line(None, &text);
    }
}

fn interfaces() -> Vec<&'static kintsugi_runtime::stub::InterfaceInfo> {
    kintsugi_interfaces::ALL.to_vec()
}

fn execute(
    system: &kintsugi_system::System,
    options: Options,
    quiet: bool,
    format: EventFormat,
    metrics: Option<std::net::SocketAddr>,
    kept: Option<Kept>,
) -> anyhow::Result<bool> {
    let journal = journal()?;
    let mut log = Log::new(quiet, format, journal.clone());
    // Publish the roster for `kintsugi inject` (and other observers).
    let roster = options.roster.clone().unwrap_or_default();
    let options = Options {
        roster: Some(roster.clone()),
        checkpoint_dir: Some(
            crate::roster::private_dir()?.join(format!("{}.checkpoints", system.name)),
        ),
        journal,
        ..options
    };
    let publisher = crate::roster::Publisher::start(system, roster.clone())?;
    tracing::info!("roster published at {}", publisher.path().display());
    let heartbeat = [
        crate::notify::Notifier::heartbeat(),
        kept.as_ref().map(|k| k.heartbeat),
    ]
    .into_iter()
    .flatten()
    .min();
    let control = crate::control::Control::start(&system.name, roster.clone(), heartbeat)
        .inspect_err(|e| tracing::warn!("no checkpoint control socket: {e:#}"))
        .ok();
    let metrics = metrics
        .map(|addr| crate::metrics::Metrics::start(addr, roster.clone(), heartbeat))
        .transpose()?;
    let mut notifier = crate::notify::Notifier::start(system.components.len(), roster.clone());
    let (keeper, _pinger) = match kept {
        Some(k) => {
            if k.generation > 0 {
                tracing::warn!(
                    "supervisor generation {} started by its keeper: {} inherited descriptors kept for the vault",
                    k.generation,
                    k.inherited.len()
                );
            }
            let pinger = Pinger::start(k.beat, roster.clone(), k.heartbeat);
            (Some(k.inherited), Some(pinger))
        }
        None => (None, None),
    };
    let options = Options {
        heartbeat,
        keeper,
        ..options
    };
    let report = kintsugi_supervisor::run(system, options, &mut |e| {
        log.on(e);
        publisher.on(e);
        notifier.on(e);
        if let Some(m) = &metrics {
            m.on(e);
        }
    })?;
    drop(notifier);
    drop(metrics);
    drop(control);
    drop(publisher);
    log.summary();
    for last in &report.exits {
        let name = &last.component;
        let how = match last.injected {
            true => " (the injector's last fault, before the stop reached it)",
            false => "",
        };
        log.line(
            Some(name),
            &format!("{name}: last incarnation ended with {}{how}", last.exit),
        );
    }
    Ok(report.success())
}

/// A connection to systemd's journal if the logs go there
/// (`--log-format journal`, or found through `JOURNAL_STREAM`).
fn journal() -> anyhow::Result<Option<Arc<Journal>>> {
    if std::env::var("KINTSUGI_LOG_FORMAT").as_deref() != Ok("journal") {
        return Ok(None);
    }
    let journal =
        Journal::connect().with_context(|| format!("no journal at {}", journald::SOCKET))?;
    Ok(Some(Arc::new(journal)))
}

fn parse_restore(s: &str) -> Result<(String, PathBuf), String> {
    let (name, file) = s
        .split_once('=')
        .ok_or_else(|| format!("`{s}`: expected COMPONENT=FILE"))?;
    let file = std::env::current_dir()
        .map_err(|e| e.to_string())?
        .join(file);
    Ok((name.to_string(), file))
}

pub fn run(args: RunArgs) -> anyhow::Result<bool> {
    let mut system = load(&args.system)?;
    for setting in &args.settings {
        setting.apply(&mut system)?;
    }
    match system.keeper {
        Some(policy) => {
            let args = &args;
            crate::keeper::keep(&mut system, policy, |system, kept| {
                supervise(system, args, Some(kept))
            })
        }
        None => supervise(&system, &args, None),
    }
}

/// Runs `system` as `args` say, under a keeper if `kept`.
fn supervise(
    system: &kintsugi_system::System,
    args: &RunArgs,
    kept: Option<Kept>,
) -> anyhow::Result<bool> {
    let options = Options {
        chaos: chaos_plan(&args.chaos)?,
        stop_after_chaos: args.chaos.stop_after_kills,
        stop_when_finished: args.until_finished.clone(),
        duration: args.duration.map(Duration::from_secs_f64),
        interfaces: interfaces(),
        lifelines: !args.no_lifelines,
        // An image is taken once: a supervisor its keeper restarted finds
        // what it became in the vault.
        restores: match &kept {
            Some(k) if k.generation > 0 => Vec::new(),
            _ => args.restores.clone(),
        },
        sockets: kintsugi_supervisor::Activated::claim()?,
        ..Options::default()
    };
    execute(system, options, args.quiet, args.events, args.metrics, kept)
}

pub fn demo(args: DemoArgs) -> anyhow::Result<bool> {
    let system = kintsugi_system::parse_builtin("systems/demo.toml (built in)", DEMO_SYSTEM)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    println!("kintsugi demo: ramfs serves a workload that verifies every byte; ramfs is killed at random.");
    let chaos = ChaosArgs {
        kill: Some("ramfs".into()),
        kills: None,
        kill_every: "20..300".into(),
        signals: "kill,segv,bus,abrt".into(),
        seed: args.seed,
        stop_after_kills: false,
    };
    let options = Options {
        chaos: chaos_plan(&chaos)?,
        duration: Some(Duration::from_secs_f64(args.duration)),
        interfaces: interfaces(),
        ..Options::default()
    };
    execute(&system, options, false, EventFormat::Text, None, None)
}

pub fn check(path: &Path) -> anyhow::Result<bool> {
    let system = load(path)?;
    println!(
        "{}: system `{}` is valid; start order:",
        path.display(),
        system.name
    );
    for c in &system.components {
        let uses: Vec<String> = c
            .uses
            .iter()
            .map(|u| format!("{}@{}", u.interface, u.server))
            .collect();
        println!(
            "  {} ({}) provides [{}] uses [{}], reboot {}, restart at most {} in {} ms",
            c.name,
            c.binary.display(),
            c.provides.join(", "),
            uses.join(", "),
            c.reboot,
            c.restart.max,
            c.restart.window.as_millis()
        );
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::Setting;

    #[test]
    fn a_setting_names_a_component_a_key_and_a_json_or_string_value() {
        let s = Setting::parse("netd.port=8080").unwrap();
        assert_eq!((s.component.as_str(), s.key.as_str()), ("netd", "port"));
        assert_eq!(s.value, serde_json::json!(8080));
        let s = Setting::parse("httpd.docroot=/srv/a=b").unwrap();
        assert_eq!(s.value, serde_json::json!("/srv/a=b"));
        assert_eq!(
            Setting::parse("x.flag=true").unwrap().value,
            serde_json::json!(true)
        );
        for bad in ["netd.port", "port=1", ".port=1", "netd.=1"] {
            assert!(Setting::parse(bad).is_err(), "{bad}");
        }
    }
}

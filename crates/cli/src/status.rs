//! `kintsugi status`, `kintsugi stop` and `kintsugi restart` on a system
//! that `kintsugi run` runs (issue 18), in the spirit of `systemctl
//! status` and `kubectl get pods`: asked of the supervisor over its
//! control socket, which only its user can reach ([`crate::control`]).

use std::time::{Duration, Instant};

use clap::Args;
use kintsugi_supervisor::{Roster, State};
use serde::{Deserialize, Serialize};

use crate::control::{Answer, Request};

/// One component, as `kintsugi status` shows it.
#[derive(Debug, Serialize, Deserialize)]
pub struct ComponentStatus {
    pub name: String,
    pub state: State,
    pub pid: Option<u32>,
    pub epoch: u64,
    pub restarts: u64,
    /// How long it has been in its state.
    pub for_ms: u64,
    pub last_exit: Option<String>,
    pub reboot_p50_us: Option<u64>,
    pub reboot_p99_us: Option<u64>,
    /// How many reboots the percentiles are taken over.
    pub reboots_sampled: usize,
    pub recovered: u64,
    pub hangs: u64,
    pub gave_up: Option<String>,
    /// What its vault holds: records, bytes (keys and values), descriptors.
    pub vault_records: u64,
    pub vault_bytes: u64,
    pub vault_fds: u64,
    pub counters: Vec<(String, u64)>,
    /// Its last lines on stderr (log lines, panic messages), oldest first.
    #[serde(default)]
    pub last_lines: Vec<String>,
}

/// A running system, as `kintsugi status` shows it.
#[derive(Debug, Serialize, Deserialize)]
pub struct SystemStatus {
    pub system: String,
    pub supervisor_pid: u32,
    pub uptime_ms: u64,
    pub components: Vec<ComponentStatus>,
}

impl SystemStatus {
    /// The status of system `name` from its supervisor's roster.
    pub fn of(name: &str, roster: &Roster, started: Instant) -> Self {
        let components = roster
            .members()
            .into_iter()
            .map(|m| {
                let h = &m.health;
                let reboots = h.reboots();
                let vault = roster.vault_use(&m.name);
                ComponentStatus {
                    vault_records: vault.records,
                    vault_bytes: vault.bytes,
                    vault_fds: vault.fds,
                    counters: roster.counters(&m.name),
                    last_lines: roster.last_lines(&m.name),
                    state: h.state,
                    pid: m.pid,
                    epoch: m.epoch,
                    restarts: h.restarts,
                    for_ms: h.for_how_long().as_millis() as u64,
                    last_exit: h.last_exit.as_ref().map(|(exit, why)| match why.as_str() {
                        "" => exit.to_string(),
                        why => format!("{exit} ({why})"),
                    }),
                    reboot_p50_us: reboots.map(|r| r.p50.round() as u64),
                    reboot_p99_us: reboots.map(|r| r.p99.round() as u64),
                    reboots_sampled: reboots.map_or(0, |r| r.n),
                    recovered: h.recovered,
                    hangs: h.hangs,
                    gave_up: h.gave_up.clone(),
                    name: m.name,
                }
            })
            .collect();
        Self {
            system: name.to_string(),
            supervisor_pid: std::process::id(),
            uptime_ms: started.elapsed().as_millis() as u64,
            components,
        }
    }

    /// A table, one line per component, then each one's counters.
    pub fn render(&self) -> String {
        let mut out = format!(
            "system {} (supervisor pid {}), up {}\n",
            self.system,
            self.supervisor_pid,
            human(Duration::from_millis(self.uptime_ms))
        );
        let rows: Vec<[String; 9]> = self.components.iter().map(row).collect();
        let head = [
            "COMPONENT",
            "STATE",
            "PID",
            "EPOCH",
            "RESTARTS",
            "FOR",
            "REBOOT p50/p99 (n)",
            "RECOVERED",
            "HANGS",
        ]
        .map(String::from);
        let widths: Vec<usize> = (0..head.len())
            .map(|i| {
                std::iter::once(&head)
                    .chain(&rows)
                    .map(|r| r[i].chars().count())
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        for r in std::iter::once(&head).chain(&rows) {
            let cells: Vec<String> = r
                .iter()
                .zip(&widths)
                .map(|(c, w)| format!("{c:<w$}"))
                .collect();
            out.push_str(cells.join("  ").trim_end());
            out.push('\n');
        }
        for c in &self.components {
            let mut notes = Vec::new();
            if let Some(e) = &c.last_exit {
                notes.push(format!("last exit: {e}"));
            }
            if let Some(g) = &c.gave_up {
                notes.push(format!("given up: {g}"));
            }
            if c.vault_records > 0 {
                notes.push(format!(
                    "vault: {} records, {} bytes, {} descriptors",
                    c.vault_records, c.vault_bytes, c.vault_fds
                ));
            }
            if !c.counters.is_empty() {
                let counters: Vec<String> =
                    c.counters.iter().map(|(n, v)| format!("{n}={v}")).collect();
                notes.push(counters.join(" "));
            }
            if !notes.is_empty() {
                out.push_str(&format!("  {}: {}\n", c.name, notes.join("; ")));
            }
        }
        for c in self.components.iter().filter(|c| !c.last_lines.is_empty()) {
            let skip = c.last_lines.len().saturating_sub(SHOWN_LINES);
            out.push_str(&format!("\n{} (last lines):\n", c.name));
            for line in &c.last_lines[skip..] {
                out.push_str(&format!("  {line}\n"));
            }
        }
        out
    }
}

/// How many of each component's last lines the text form shows (`--json`
/// has all that the supervisor keeps).
const SHOWN_LINES: usize = 5;

fn row(c: &ComponentStatus) -> [String; 9] {
    let or_dash = |v: Option<String>| v.unwrap_or_else(|| "-".into());
    let reboot = match (c.reboot_p50_us, c.reboot_p99_us) {
        (Some(a), Some(b)) => format!("{a}/{b} µs ({})", c.reboots_sampled),
        _ => "-".into(),
    };
    [
        c.name.clone(),
        serde_json::to_value(c.state)
            .ok()
            .and_then(|v| v.as_str().map(String::from))
            .unwrap_or_default(),
        or_dash(c.pid.map(|p| p.to_string())),
        c.epoch.to_string(),
        c.restarts.to_string(),
        human(Duration::from_millis(c.for_ms)),
        reboot,
        c.recovered.to_string(),
        c.hangs.to_string(),
    ]
}

/// `1.5 s`, `3 min 20 s`, `2 h 5 min`.
fn human(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0..60 => format!("{:.1} s", d.as_secs_f64()),
        60..3600 => format!("{} min {} s", s / 60, s % 60),
        _ => format!("{} h {} min", s / 3600, s % 3600 / 60),
    }
}

#[derive(Args, Debug)]
pub struct StatusArgs {
    /// The running system: its name or its system file (default: the only
    /// one running).
    pub system: Option<String>,
    /// Print the status as one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct StopArgs {
    /// The running system (default: the only one running).
    pub system: Option<String>,
    /// How long to wait for the system to stop, in seconds.
    #[arg(long, default_value_t = 60)]
    pub wait_s: u64,
}

#[derive(Args, Debug)]
pub struct RestartArgs {
    /// The component to restart (killed and micro-rebooted, as on a crash).
    pub component: String,
    /// The running system (default: the only one running).
    #[arg(long)]
    pub system: Option<String>,
}

/// What the supervisor said it did, and its pid.
fn said(system: Option<&str>, request: &Request) -> anyhow::Result<(String, u32)> {
    match crate::control::ask_system(system, request)? {
        Answer::Said(text, pid) => Ok((text, pid)),
        Answer::Error(e) => anyhow::bail!("{e}"),
        _ => anyhow::bail!("an answer to another question"),
    }
}

pub fn status(args: StatusArgs) -> anyhow::Result<bool> {
    let status = match crate::control::ask_system(args.system.as_deref(), &Request::Status)? {
        Answer::Status(s) => s,
        Answer::Error(e) => anyhow::bail!("{e}"),
        _ => anyhow::bail!("an answer to another question"),
    };
    match args.json {
        true => println!("{}", serde_json::to_string(&status)?),
        false => print!("{}", status.render()),
    }
    Ok(true)
}

pub fn stop(args: StopArgs) -> anyhow::Result<bool> {
    let (said, pid) = said(args.system.as_deref(), &Request::Stop)?;
    println!("{said}");
    // Its pidfd turns readable when it exits (a zombie counts as exited).
    let pidfd = rustix::process::Pid::from_raw(pid as i32)
        .and_then(|p| rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty()).ok());
    if let Some(pidfd) = pidfd {
        let mut fds = [rustix::event::PollFd::new(
            &pidfd,
            rustix::event::PollFlags::IN,
        )];
        let wait = rustix::time::Timespec {
            tv_sec: args.wait_s as i64,
            tv_nsec: 0,
        };
        let n = rustix::event::poll(&mut fds, Some(&wait))?;
        anyhow::ensure!(
            n > 0,
            "the supervisor (pid {pid}) has not stopped after {} s",
            args.wait_s
        );
    }
    println!("stopped");
    Ok(true)
}

pub fn restart(args: RestartArgs) -> anyhow::Result<bool> {
    let request = Request::Restart {
        component: args.component,
    };
    let (text, _) = said(args.system.as_deref(), &request)?;
    println!("{text}");
    Ok(true)
}

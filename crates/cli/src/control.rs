//! `kintsugi checkpoint` and `kintsugi restore` on a system that `kintsugi
//! run` runs, like CRIU's `dump` and `restore --display-stats`: the running
//! `kintsugi run` listens on a Unix socket beside its roster file
//! (`<roster dir>/<system>.<supervisor pid>.sock`, mode 0600: one per run,
//! so that runs of same-named systems never take each other's; the roster
//! file names the pid), takes one JSON request per connection and answers
//! with one JSON line, the supervisor's [`CheckpointSummary`] or an error.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use clap::Args;
use kintsugi_supervisor::{CheckpointSummary, FaultReport, Roster};

use crate::serve::{Server, MAX_SERVED};
use crate::status::SystemStatus;
use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", tag = "op")]
pub(crate) enum Request {
    Checkpoint {
        component: String,
        out: Option<PathBuf>,
    },
    Restore {
        component: String,
        from: Option<PathBuf>,
        #[serde(default)]
        force: bool,
    },
    /// The live components: name, pid, epoch.
    Members,
    /// Every component's state and history.
    Status,
    /// Stop the system, as SIGTERM would.
    Stop,
    /// Kill the live incarnation of `component`, which is rebooted.
    Restart { component: String },
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum Answer {
    Done(CheckpointSummary),
    Status(SystemStatus),
    /// What was done, and the supervisor's pid.
    Said(String, u32),
    Members(Vec<(String, Option<u32>, u64)>),
    Error(String),
}

/// The listening socket of a running system; removed when dropped.
pub struct Control {
    path: PathBuf,
    /// Serves each connection on a thread of its own (`serve.rs`).
    _server: Server,
}

/// The control socket of the run of system `name` by supervisor `pid`.
fn socket_path(name: &str, pid: u32) -> anyhow::Result<PathBuf> {
    crate::roster::private_dir().map(|d| d.join(format!("{name}.{pid}.sock")))
}

impl Control {
    /// Listens on the control socket; its accepting thread turns at least
    /// every `heartbeat`.
    pub fn start(
        system: &str,
        roster: Arc<Roster>,
        heartbeat: Option<std::time::Duration>,
    ) -> anyhow::Result<Self> {
        let started = std::time::Instant::now();
        let name = system.to_string();
        let path = socket_path(system, std::process::id())?;
        // Left by an earlier process with this pid that did not stop cleanly.
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).with_context(|| format!("{}", path.display()))?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
        let server = Server::start(
            "control",
            listener,
            roster.thread_turns("control", heartbeat),
            move |conn| serve(conn, &name, &roster, started),
            |conn| {
                let busy = format!("busy: {MAX_SERVED} requests are being served; try again");
                reply(&conn, &Answer::Error(busy));
            },
        )?;
        Ok(Self {
            path,
            _server: server,
        })
    }
}

impl Drop for Control {
    fn drop(&mut self) {
        // First: no client finds the socket while its server stops.
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Writes an answer as one JSON line.
fn reply(conn: &UnixStream, answer: &Answer) {
    let mut text = serde_json::to_string(answer).unwrap_or_default();
    text.push('\n');
    let mut conn = conn;
    let _ = conn.write_all(text.as_bytes());
}

/// Answers one connection's request.
fn serve(conn: UnixStream, system: &str, roster: &Roster, started: std::time::Instant) {
    let mut line = String::new();
    let mut reader = BufReader::new(&conn);
    // A client that sends nothing must not hold the socket for ever.
    let _ = conn.set_read_timeout(Some(std::time::Duration::from_secs(5)));
    let answer = match reader.read_line(&mut line) {
        Err(e) => Answer::Error(format!("reading the request: {e}")),
        Ok(_) => match serde_json::from_str::<Request>(&line) {
            Err(e) => Answer::Error(format!("malformed request: {e}")),
            Ok(Request::Checkpoint { component, out }) => {
                answer(roster.checkpoint(&component, out))
            }
            Ok(Request::Restore {
                component,
                from,
                force,
            }) => answer(roster.restore(&component, from, force)),
            Ok(Request::Status) => Answer::Status(SystemStatus::of(system, roster, started)),
            Ok(Request::Stop) => {
                roster.request_stop();
                Answer::Said(format!("stopping system `{system}`"), std::process::id())
            }
            Ok(Request::Restart { component }) => restart(roster, &component),
            Ok(Request::Members) => Answer::Members(
                roster
                    .members()
                    .into_iter()
                    .map(|m| (m.name, m.pid, m.epoch))
                    .collect(),
            ),
        },
    };
    reply(&conn, &answer);
}

/// Has the supervisor kill `component`'s live incarnation and reboot it.
fn restart(roster: &Roster, component: &str) -> Answer {
    match roster.member(component) {
        None => Answer::Error(format!("no component `{component}` in this system")),
        Some(m) => match m.pid {
            None => Answer::Error(format!("`{component}` has no live incarnation to restart")),
            Some(pid) => {
                roster.report_fault(FaultReport {
                    component: component.to_string(),
                    pid,
                    detail: "restart requested (kintsugi restart)".into(),
                    hang: false,
                });
                Answer::Said(
                    format!("{component}: restarting (pid {pid}, epoch {})", m.epoch),
                    std::process::id(),
                )
            }
        },
    }
}

fn answer(r: Result<CheckpointSummary, String>) -> Answer {
    match r {
        Ok(s) => Answer::Done(s),
        Err(e) => Answer::Error(e),
    }
}

#[derive(Args, Debug)]
pub struct CheckpointArgs {
    /// The running system: its name or its system file.
    #[arg(long)]
    pub system: String,
    #[arg(long)]
    pub component: String,
    /// Also write the image to this file.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Print the summary as one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct RestoreArgs {
    /// The running system: its name or its system file.
    #[arg(long)]
    pub system: String,
    #[arg(long)]
    pub component: String,
    /// Restore this image file (taken from this incarnation: in place; from
    /// an earlier one: into this one) instead of the latest checkpoint.
    #[arg(long)]
    pub from: Option<PathBuf>,
    /// Do not wait for a safe point (a hung component never reaches one):
    /// calls it is serving are run again by its rolled-back workers. Its
    /// own calls and vault requests must still be over.
    #[arg(long)]
    pub force: bool,
    /// Print the summary as one JSON object.
    #[arg(long)]
    pub json: bool,
}

pub fn checkpoint(args: CheckpointArgs) -> anyhow::Result<bool> {
    let out = args.out.as_deref().map(absolute).transpose()?;
    let request = Request::Checkpoint {
        component: args.component,
        out,
    };
    ask(&args.system, &request, args.json)
}

pub fn restore(args: RestoreArgs) -> anyhow::Result<bool> {
    let from = args.from.as_deref().map(absolute).transpose()?;
    let request = Request::Restore {
        component: args.component,
        from,
        force: args.force,
    };
    ask(&args.system, &request, args.json)
}

/// `path` as the supervisor, which may run elsewhere, must see it.
fn absolute(path: &Path) -> anyhow::Result<PathBuf> {
    Ok(std::env::current_dir()?.join(path))
}

fn ask(system: &str, request: &Request, json: bool) -> anyhow::Result<bool> {
    match ask_system(Some(system), request)? {
        Answer::Done(s) if json => println!("{}", serde_json::to_string(&s)?),
        Answer::Done(s) => println!("{}", describe(&s)),
        Answer::Error(e) => anyhow::bail!("{e}"),
        _ => anyhow::bail!("an answer to another question"),
    }
    Ok(true)
}

/// Sends `request` to the supervisor of `system` (a name or a system
/// file; default: the only system running) and returns its answer.
pub(crate) fn ask_system(system: Option<&str>, request: &Request) -> anyhow::Result<Answer> {
    let path = match system {
        Some(s) => crate::roster::roster_file(s)?,
        None => crate::roster::only_running()?,
    };
    let published = crate::roster::read_roster(&path)?;
    exchange(&published.system, published.supervisor_pid, request)
}

/// The live components of system `name` as its supervisor `pid` reports them.
pub fn members(name: &str, pid: u32) -> anyhow::Result<Vec<(String, Option<u32>, u64)>> {
    match exchange(name, pid, &Request::Members)? {
        Answer::Members(m) => Ok(m),
        Answer::Error(e) => anyhow::bail!("{e}"),
        _ => anyhow::bail!("an answer to another question"),
    }
}

/// Sends `request` to the control socket of system `name`'s supervisor
/// `pid`, after checking that the socket's peer is that process, run by
/// this user; and reads the answer.
fn exchange(name: &str, pid: u32, request: &Request) -> anyhow::Result<Answer> {
    let path = socket_path(name, pid)?;
    let mut conn = UnixStream::connect(&path).with_context(|| {
        format!(
            "{}: is system `{name}` running under `kintsugi run`?",
            path.display()
        )
    })?;
    let peer = rustix::net::sockopt::socket_peercred(&conn)?;
    let me = rustix::process::geteuid();
    anyhow::ensure!(
        peer.pid.as_raw_nonzero().get() as u32 == pid && peer.uid == me,
        "{}: answered by pid {} of uid {}, not supervisor {pid} of uid {}",
        path.display(),
        peer.pid.as_raw_nonzero(),
        peer.uid.as_raw(),
        me.as_raw()
    );
    let mut text = serde_json::to_string(request)?;
    text.push('\n');
    conn.write_all(text.as_bytes())?;
    let mut line = String::new();
    BufReader::new(&conn).read_line(&mut line)?;
    serde_json::from_str::<Answer>(&line)
        .with_context(|| format!("an answer that does not parse: {line:?}"))
}

/// One line, like CRIU's `--display-stats`.
fn describe(s: &CheckpointSummary) -> String {
    let kib = |b: u64| b as f64 / 1024.0;
    let mut line = format!(
        "{} of `{}` (pid {}): {} pages ({:.0} KiB) in {} mappings ({} new), {} threads; held {} µs; {:.1} ms in all ({} µs waiting for a safe point); image #{} holds {:.0} KiB",
        s.kind,
        s.component,
        s.pid,
        s.pages,
        kib(s.bytes),
        s.areas,
        s.new_areas,
        s.threads,
        s.pause_us,
        s.total_us as f64 / 1000.0,
        s.waited_us,
        s.seq,
        kib(s.image_bytes),
    );
    if s.audit_us > 0 {
        line.push_str(&format!(
            "; audited by the component in {} µs, its calls held",
            s.audit_us
        ));
    }
    if s.read_ahead > 0 {
        line.push_str(&format!(
            "; {} more pages read ahead while it ran",
            s.read_ahead
        ));
    }
    if let Some(f) = &s.file {
        line.push_str(&format!("; file {}", f.display()));
    }
    line.push_str(&format!(
        "; periodic checkpoints: {} taken, {} skipped",
        s.periodic_taken, s.periodic_skipped
    ));
    line
}

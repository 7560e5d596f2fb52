//! Checkpoints of running components at safe points (RMK's TAC,
//! `seeds/001_68a97066b3f6a3ed.txt` §6; RTCR's hot and cold storage,
//! `seeds/003_88af2f40302460e3.txt`), taken by one thread of the
//! supervisor with `kintsugi-checkpoint`: periodically for components whose
//! description asks for it, and on request (`kintsugi checkpoint`,
//! `kintsugi restore`) for any component.
//!
//! A safe point is a moment when the component has no invocation in flight
//! on any edge it serves or uses and no vault request unanswered or reply
//! unread ([`Quiet`]). It is found without the component's help: the edges
//! and the vault are looked at first, the process is then frozen (every
//! thread in a ptrace-stop) and they are looked at again; a call that
//! arrives meanwhile waits in its slot until the process runs again, which
//! is how new calls are held while the checkpoint is taken. Channels, the
//! vault and durable memory are shared mappings, outside every checkpoint:
//! they are never rolled back.
//!
//! The latest checkpoint of each incarnation stays in this thread's memory
//! (hot storage: it survives the component); with `keep` in the policy the
//! latest `keep` are also written to image files (cold storage), as is any
//! checkpoint asked for with `--out`.

use std::collections::{BTreeMap, VecDeque};
use std::fs::File;
use std::os::fd::OwnedFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kintsugi_checkpoint::{file, Checkpointer, Frozen, Image, StartOver, Stats};
use kintsugi_runtime::abi::boot::{ControlBlock, Verdict, LIFELINES};
use kintsugi_runtime::abi::channel::Edge;
use kintsugi_runtime::abi::journal::JournalRegion;
use kintsugi_runtime::abi::lifeline::{Lifeline, TID_MASK};
use kintsugi_runtime::abi::shm::Region;
use kintsugi_system::{CheckpointPolicy, DEFAULT_READ_AHEAD_PAGES};
use serde::Serialize;

use crate::mailbox::Mailbox;
use crate::vault::{ExportedRecord, VaultActivity, VaultStore};

/// How long a periodic checkpoint waits for a safe point before it is
/// skipped (and counted): new calls wait this long at most, so that a long
/// call in flight (a blocking wait) costs the others little at every
/// attempt.
const PERIODIC_HOLD: Duration = Duration::from_millis(2);
/// How long a requested checkpoint or restore waits for one.
const REQUESTED_HOLD: Duration = Duration::from_secs(2);
/// How long a checkpoint waits for a component's audit of its state (its
/// calls are held meanwhile).
const AUDIT_WAIT: Duration = Duration::from_millis(50);

/// What a component looks like from outside when it is at a safe point.
pub(crate) struct Quiet {
    /// Edges it serves: no request may be posted or being served.
    pub served: Vec<Arc<Edge>>,
    /// Edges it uses: no request may be posted, nor a reply unread.
    pub used: Vec<Arc<Edge>>,
    pub vault: Arc<VaultActivity>,
    /// The supervisor's end of its vault socket (requests queue here).
    pub vault_sock: OwnedFd,
    /// A duplicate of the component's end (replies queue here).
    pub vault_peer: OwnedFd,
    /// Its control block, whose watchdog entries a rollback makes agree
    /// with the threads it rolled back.
    pub control: Arc<Region>,
    /// Raised at each freeze and at each thaw, for the watchdog (both run
    /// every thread a little, a stopped one too: no progress of a hung
    /// one).
    pub freezes: Arc<AtomicU64>,
}

impl Quiet {
    /// Whether nothing is in flight between the component and anyone.
    fn holds(&self) -> bool {
        self.served.iter().all(|e| e.serving() == 0) && self.own_quiet()
    }

    /// What stands in the way of a safe point, for an error message.
    fn busy(&self) -> String {
        let serving: u32 = self.served.iter().map(|e| e.serving()).sum();
        let calling: u32 = self.used.iter().map(|e| e.calling()).sum();
        let taking = self.vault.taking.load(Ordering::SeqCst);
        let done = self.vault.done.load(Ordering::SeqCst);
        format!(
            "{serving} calls being served, {calling} being made, {} vault requests unanswered{}{}",
            taking - done.min(taking),
            if queued(&self.vault_sock) {
                ", a vault request queued"
            } else {
                ""
            },
            if queued(&self.vault_peer) {
                ", a vault reply unread"
            } else {
                ""
            },
        )
    }

    /// Whether the component has no call of its own in flight and no
    /// vault exchange: what a forced restore needs (the calls it serves
    /// are run again by the workers it rolls back).
    fn own_quiet(&self) -> bool {
        let taking = self.vault.taking.load(Ordering::SeqCst);
        self.used.iter().all(|e| e.calling() == 0)
            && !queued(&self.vault_sock)
            && self.vault.done.load(Ordering::SeqCst) == taking
            && self.vault.taking.load(Ordering::SeqCst) == taking
            && !queued(&self.vault_peer)
    }

    /// Holds new calls to and from the component until dropped: calls in
    /// flight finish, new ones wait in their slots (server side) or before
    /// they post (client side).
    fn hold(&self) -> Held<'_> {
        for e in &self.served {
            e.hold_serving(true);
        }
        for e in &self.used {
            e.hold_calling(true);
        }
        Held(self)
    }
}

/// Calls held for a checkpoint (see [`Quiet::hold`]).
struct Held<'a>(&'a Quiet);

/// A freeze of the component, counted for the watchdog at both edges:
/// when it begins and when this is dropped, after the process was let go
/// (under load a thaw can end well after the freeze began, past the
/// watchdog's shadow of the freeze, and a stopped thread's CPU time moves
/// in it: counted only at the freeze, every checkpoint of a stopped kv
/// restarted the watchdog's clock, and its hang was found late or, with
/// checkpoints every 20 ms, not at all).
struct Counted<'a>(&'a AtomicU64);

impl<'a> Counted<'a> {
    fn begin(freezes: &'a AtomicU64) -> Self {
        freezes.fetch_add(1, Ordering::SeqCst);
        Self(freezes)
    }
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// The component's threads held still by the checkpoint thread; the
/// freeze is counted (fields drop in order: the process is let go, then
/// the thaw counted).
struct Freeze<'a> {
    frozen: Frozen,
    _counted: Counted<'a>,
}

impl<'a> Freeze<'a> {
    fn new(pid: u32, freezes: &'a AtomicU64) -> Result<Self, String> {
        let counted = Counted::begin(freezes);
        let frozen = Frozen::freeze(pid).map_err(|e| e.to_string())?;
        Ok(Self {
            frozen,
            _counted: counted,
        })
    }
}

impl std::ops::Deref for Freeze<'_> {
    type Target = Frozen;

    fn deref(&self) -> &Frozen {
        &self.frozen
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        for e in &self.0.served {
            e.hold_serving(false);
        }
        for e in &self.0.used {
            e.hold_calling(false);
        }
    }
}

/// Whether a message waits on the socket (peeked, never taken).
fn queued(sock: &OwnedFd) -> bool {
    let mut b = [0u8; 1];
    let flags = rustix::net::RecvFlags::PEEK | rustix::net::RecvFlags::DONTWAIT;
    !matches!(
        rustix::net::recv(sock, &mut b, flags),
        Err(rustix::io::Errno::AGAIN)
    )
}

/// The summary of one checkpoint or restore (`kintsugi checkpoint` and
/// `kintsugi restore` print it).
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct Summary {
    pub component: String,
    pub pid: u32,
    /// `checkpoint`, `restore in place`, `restore from file`, `restore into
    /// a new incarnation`.
    pub kind: String,
    /// How many checkpoints the incarnation's image has absorbed.
    pub seq: u64,
    pub areas: usize,
    pub new_areas: usize,
    /// Pages copied with the component held still (a restore: written).
    pub pages: u64,
    /// Pages a checkpoint read ahead while the component ran.
    #[serde(default)]
    pub read_ahead: u64,
    /// Pages a restore into a new incarnation compared with the image to
    /// find the ones to write.
    #[serde(default)]
    pub compared: u64,
    /// System calls a restore made the component run to put its mappings
    /// back (`brk`, `mmap`, `mprotect`, `munmap`).
    #[serde(default)]
    pub layout_calls: u64,
    pub bytes: u64,
    pub threads: usize,
    /// Of those, a restore's: worker threads started over at the top of
    /// their loops rather than resumed.
    #[serde(default)]
    pub started_over: usize,
    /// How long the component was held still, µs.
    pub pause_us: u64,
    /// From the request to the answer (waiting for a safe point and
    /// writing the file included), µs.
    pub total_us: u64,
    /// Waiting for the safe point, µs.
    pub waited_us: u64,
    /// A checkpoint's audit by the component (its calls held), µs.
    #[serde(default)]
    pub audit_us: u64,
    /// Memory the image holds.
    pub image_bytes: u64,
    /// The file written or read, if any.
    pub file: Option<PathBuf>,
    /// Periodic checkpoints of this component taken and skipped (no safe
    /// point in time) so far.
    pub periodic_taken: u64,
    pub periodic_skipped: u64,
    /// A checkpoint recovery's replay: requests run again, and how long
    /// it took, µs (0 and 0 for anything else).
    #[serde(default)]
    pub replayed: u64,
    #[serde(default)]
    pub replay_us: u64,
    /// Of the replayed requests' calls to other servers: answered from
    /// the log, and divergences (calls the log did not hold, replies that
    /// differed from the logged ones).
    #[serde(default)]
    pub replayed_calls: u64,
    #[serde(default)]
    pub diverged: u64,
}

/// Asks the checkpoint thread for something; the answer comes back on
/// `reply`.
pub(crate) enum Command {
    /// A standby of the component waits in `pid`: attach to it now, so
    /// that neither its recovery nor its first checkpoint waits for that.
    Standby { name: String, pid: u32 },
    /// An incarnation of the component serves from `pid`.
    Live { name: String, pid: u32 },
    /// The component has no live incarnation.
    Down { name: String },
    Take {
        name: String,
        out: Option<PathBuf>,
        reply: Sender<Result<Summary, String>>,
    },
    Restore {
        name: String,
        from: Option<PathBuf>,
        /// Without waiting for a safe point (see [`restore`]).
        force: bool,
        reply: Sender<Result<Summary, String>>,
    },
    /// Checkpoint recovery of a new incarnation, whose served edges the
    /// supervisor holds (see [`recover`]).
    Recover {
        name: String,
        /// Drop the last checkpoint and the log instead (see `ladder.rs`).
        fresh: bool,
        reply: Sender<Result<Summary, String>>,
    },
}

/// Attachment names of an exported image: the component's vault records
/// (postcard of [`ExportedRecord`]s) and its durable memory.
const VAULT: &str = "kintsugi.vault";
const ARENA: &str = "kintsugi.arena";
const POOL: &str = "kintsugi.pool";

/// What a component keeps outside its process, exported with an image
/// file and imported by a supervisor that restores it (RTCR's
/// marshalling for migration).
pub(crate) struct Kept {
    pub vault: VaultStore,
    /// Its durable memory's memfds.
    pub arena: Option<File>,
    pub pool: Option<File>,
}

impl Kept {
    /// The attachments of an exported image.
    fn export(&self, name: &str) -> Result<BTreeMap<String, Vec<u8>>, String> {
        let records = self.vault.export(name)?;
        let mut out = BTreeMap::new();
        out.insert(
            VAULT.to_string(),
            postcard::to_stdvec(&records).map_err(|e| e.to_string())?,
        );
        for (key, file) in [(ARENA, &self.arena), (POOL, &self.pool)] {
            if let Some(f) = file {
                let len = f.metadata().map_err(|e| e.to_string())?.len();
                let mut bytes = vec![0u8; len as usize];
                f.read_exact_at(&mut bytes, 0).map_err(|e| e.to_string())?;
                out.insert(key.to_string(), bytes);
            }
        }
        Ok(out)
    }

    /// Puts an image's attachments in place, before the component's first
    /// incarnation starts: its vault records, and its durable memory (which
    /// must have the size the image's had).
    pub fn import(
        &self,
        name: &str,
        attachments: &BTreeMap<String, Vec<u8>>,
    ) -> Result<(), String> {
        if let Some(bytes) = attachments.get(VAULT) {
            let records: Vec<ExportedRecord> =
                postcard::from_bytes(bytes).map_err(|e| format!("vault records: {e}"))?;
            self.vault.import(name, records)?;
        }
        for (key, file) in [(ARENA, &self.arena), (POOL, &self.pool)] {
            let (Some(bytes), Some(f)) = (attachments.get(key), file) else {
                if attachments.contains_key(key) != file.is_some() {
                    return Err(format!(
                        "{key}: the image has {} it, the system description {}",
                        if attachments.contains_key(key) {
                            ""
                        } else {
                            "no"
                        },
                        if file.is_some() { "gives one" } else { "none" }
                    ));
                }
                continue;
            };
            let len = f.metadata().map_err(|e| e.to_string())?.len();
            if len != bytes.len() as u64 {
                return Err(format!(
                    "{key}: {} bytes in the image, {len} in this system",
                    bytes.len()
                ));
            }
            f.write_all_at(bytes, 0).map_err(|e| e.to_string())?;
        }
        Ok(())
    }
}

/// One component as the checkpoint thread keeps it.
pub(crate) struct Tracked {
    pub name: String,
    pub policy: Option<CheckpointPolicy>,
    pub quiet: Quiet,
    pub kept: Kept,
    /// The request log of a checkpoint-recovered component.
    journal: Option<Arc<JournalRegion>>,
    /// Its last checkpoint, kept from the incarnation that died, for the
    /// next one.
    last: Option<Image>,
    /// A checkpoint-recovered component between the death of an
    /// incarnation and the recovery of the next: the log belongs to the
    /// state that died, so no checkpoint may be taken (it would cut the
    /// log) until [`recover`] has restored that state and replayed it.
    recovering: bool,
    incarnation: Holder,
    /// Attached to the standby that waits to be the next incarnation.
    standby: Option<Box<Checkpointer>>,
    next_due: Option<Instant>,
    taken: u64,
    skipped: u64,
    /// Periodic checkpoints skipped since the last one taken.
    skipped_in_a_row: u32,
    /// Cold copies written for `keep`, oldest first.
    files: VecDeque<PathBuf>,
}

/// The checkpoint thread's hold on a component's live incarnation.
enum Holder {
    Down,
    /// Not attached yet (attaching freezes it once, to take a userfaultfd).
    Live(u32),
    Attached(Box<Checkpointer>),
}

impl Holder {
    fn pid(&self) -> Option<u32> {
        match self {
            Holder::Down => None,
            Holder::Live(pid) => Some(*pid),
            Holder::Attached(c) => Some(c.pid()),
        }
    }

    fn attached(&mut self, freezes: &AtomicU64) -> Result<&mut Checkpointer, String> {
        if let Holder::Live(pid) = *self {
            // Attaching freezes the process once.
            let c = {
                let _counted = Counted::begin(freezes);
                Checkpointer::attach(pid)
            };
            let c = c.map_err(|e| e.to_string())?;
            *self = Holder::Attached(Box::new(c));
        }
        match self {
            Holder::Attached(c) => Ok(c),
            _ => Err("the component has no live incarnation".into()),
        }
    }
}

impl Tracked {
    pub fn new(
        name: String,
        policy: Option<CheckpointPolicy>,
        quiet: Quiet,
        kept: Kept,
        journal: Option<Arc<JournalRegion>>,
    ) -> Self {
        Self {
            name,
            policy,
            quiet,
            kept,
            journal,
            last: None,
            recovering: false,
            incarnation: Holder::Down,
            standby: None,
            next_due: None,
            taken: 0,
            skipped: 0,
            skipped_in_a_row: 0,
            files: VecDeque::new(),
        }
    }

    /// Refuses a checkpoint or a restore while a new incarnation waits for
    /// its checkpoint recovery.
    fn not_recovering(&self) -> Result<(), String> {
        match self.recovering {
            true => Err(format!(
                "`{}` is being recovered from its last checkpoint and log",
                self.name
            )),
            false => Ok(()),
        }
    }
}

/// The checkpoint thread: serves `commands` until the mailbox is closed.
pub(crate) fn serve(mut comps: Vec<Tracked>, dir: PathBuf, commands: Arc<Mailbox<Command>>) {
    // How often a full request log is looked for.
    let poll = match comps.iter().any(|c| c.journal.is_some()) {
        true => Duration::from_millis(5),
        false => Duration::from_secs(3600),
    };
    loop {
        let now = Instant::now();
        let due = comps.iter().filter_map(|c| c.next_due).min();
        let wait = due.map_or(poll, |d| d.saturating_duration_since(now).min(poll));
        let Some(taken) = commands.take(wait) else {
            return;
        };
        for cmd in taken {
            handle(&mut comps, cmd);
        }
        let now = Instant::now();
        let full = |c: &Tracked| {
            c.next_due.is_some() && c.journal.as_ref().is_some_and(|j| j.wants_checkpoint())
        };
        for c in comps
            .iter_mut()
            .filter(|c| c.next_due.is_some_and(|d| d <= now) || full(c))
        {
            periodic(c, &dir);
        }
    }
}

fn handle(comps: &mut [Tracked], cmd: Command) {
    match cmd {
        Command::Standby { name, pid } => {
            if let Ok(c) = find(comps, &name) {
                // Attaching freezes the standby once, for about a
                // millisecond (seizing its threads, taking a userfaultfd):
                // done here while it waits, not when it is needed.
                let attached = {
                    let _counted = Counted::begin(&c.quiet.freezes);
                    Checkpointer::attach(pid)
                };
                c.standby = match attached {
                    Ok(ready) => Some(Box::new(ready)),
                    Err(e) => {
                        // It attaches when it goes live instead.
                        tracing::debug!("{name}: standby {pid} not attached: {e}");
                        None
                    }
                };
            }
        }
        Command::Live { name, pid } => {
            if let Ok(c) = find(comps, &name) {
                c.incarnation = match c.standby.take() {
                    Some(ready) if ready.pid() == pid => Holder::Attached(ready),
                    _ => Holder::Live(pid),
                };
                if !c.recovering {
                    c.next_due = c.policy.map(|p| Instant::now() + p.every);
                }
            }
        }
        Command::Down { name } => {
            if let Ok(c) = find(comps, &name) {
                let gone = std::mem::replace(&mut c.incarnation, Holder::Down);
                c.recovering = c.journal.is_some();
                if let (Holder::Attached(ckpt), Some(_)) = (gone, &c.journal) {
                    // Its last checkpoint (or the one it was restored
                    // from) is the next incarnation's.
                    if ckpt.image().seq > 0 {
                        c.last = Some(ckpt.into_image());
                    }
                }
                c.next_due = None;
            }
        }
        Command::Recover { name, fresh, reply } => {
            let answer = find(comps, &name).and_then(|c| recover(c, fresh));
            let _ = reply.send(answer);
        }
        Command::Take { name, out, reply } => {
            let answer = find(comps, &name).and_then(|c| take(c, out, REQUESTED_HOLD));
            let _ = reply.send(answer);
        }
        Command::Restore {
            name,
            from,
            force,
            reply,
        } => {
            let answer = find(comps, &name).and_then(|c| restore(c, from.as_deref(), force));
            let _ = reply.send(answer);
        }
    }
}

fn find<'a>(comps: &'a mut [Tracked], name: &str) -> Result<&'a mut Tracked, String> {
    comps
        .iter_mut()
        .find(|c| c.name == name)
        .ok_or_else(|| format!("no component `{name}` in this system"))
}

/// A periodic checkpoint, written to a file too when the policy keeps
/// some.
fn periodic(c: &mut Tracked, dir: &Path) {
    let Some(policy) = c.policy else { return };
    c.next_due = Some(Instant::now() + policy.every);
    if policy.keep > 0 {
        if let Err(e) = std::fs::create_dir_all(dir) {
            tracing::warn!("{}: {e}", dir.display());
        }
    }
    let out = (policy.keep > 0).then(|| {
        let pid = c.incarnation.pid().unwrap_or(0);
        dir.join(format!("{}-{pid}-{}.ksgckpt", c.name, c.taken + 1))
    });
    match take(c, out.clone(), PERIODIC_HOLD) {
        Ok(_) => {
            c.taken += 1;
            c.skipped_in_a_row = 0;
            if let Some(path) = out {
                c.files.push_back(path);
                while c.files.len() > policy.keep as usize {
                    if let Some(old) = c.files.pop_front() {
                        let _ = std::fs::remove_file(old);
                    }
                }
            }
        }
        Err(e) => {
            c.skipped += 1;
            c.skipped_in_a_row = c.skipped_in_a_row.saturating_add(1);
            let retry = RETRY_FIRST.saturating_mul(2u32.saturating_pow(c.skipped_in_a_row - 1));
            c.next_due = Some(Instant::now() + retry.min(policy.every));
            tracing::debug!("periodic checkpoint of {} skipped: {e}", c.name);
        }
    }
}

/// How soon a skipped periodic checkpoint is tried again, doubled with
/// each skip in a row up to the period. Not a whole period: a checkpoint
/// due at once after a replay (the log then holds what was replayed) that
/// found no safe point would otherwise wait that long, and one killed
/// every 20–60 ms beside two CPU hogs was never checkpointed again
/// (2026-12-07).
const RETRY_FIRST: Duration = Duration::from_millis(5);

/// Holds the component's calls and waits up to `hold` for a safe point;
/// returns the process frozen at it, with the hold (to be dropped after
/// the process is let go) and how long the wait took.
fn at_safe_point<'a>(
    quiet: &'a Quiet,
    name: &str,
    pid: u32,
    hold: Duration,
) -> Result<(Freeze<'a>, Held<'a>, Duration), String> {
    at_point(quiet, name, pid, hold, Quiet::holds, "safe point")
}

/// Asks a checkpoint-recovered component, just checkpointed and let go
/// with its calls still held, to audit its state (the runtime's
/// `audit.rs`): the state the checkpoint copied, since nothing has run a
/// request since. One found damaged is killed (the caller takes the
/// checkpoint back: the component recovers from the one before, which
/// passed its audit, and replays its log, which runs the request that met
/// the damage again), and so is one that lost the thread that answers.
fn audited(quiet: &Quiet, name: &str, pid: u32) -> Result<(), String> {
    let ctl: &ControlBlock = quiet.control.at(0);
    let gone = || lost_thread(&quiet.control, pid);
    let why = match ctl.audits.ask(AUDIT_WAIT, gone) {
        Verdict::Sound => return Ok(()),
        Verdict::Damaged => "its audit found its state damaged",
        Verdict::Unanswered if gone() => "it lost a runtime thread (or died) during its audit",
        Verdict::Unanswered => {
            return Err(format!(
                "`{name}` did not answer its audit within {} ms",
                AUDIT_WAIT.as_millis()
            ))
        }
    };
    // Frozen, so that it is not reaped (nor its pid reused) before the
    // kill; one that died already is not there to freeze.
    if let Ok(_frozen) = Freeze::new(pid, &quiet.freezes) {
        kill_process(pid);
    }
    tracing::warn!(component = %name, pid, "{why}: killed, to recover from its last checkpoint and its log");
    Err(format!(
        "`{name}` (pid {pid}): {why}: killed, to recover from its last checkpoint and its log"
    ))
}

/// [`at_safe_point`] for a forced restore: only the component's own calls
/// and vault exchanges must be over; calls it serves may be in flight (a
/// hung one, say).
fn at_forced_point<'a>(
    quiet: &'a Quiet,
    name: &str,
    pid: u32,
    hold: Duration,
) -> Result<(Freeze<'a>, Held<'a>, Duration), String> {
    at_point(
        quiet,
        name,
        pid,
        hold,
        Quiet::own_quiet,
        "point without a call or vault request of its own in flight",
    )
}

fn at_point<'a>(
    quiet: &'a Quiet,
    name: &str,
    pid: u32,
    hold: Duration,
    ready: fn(&Quiet) -> bool,
    what: &str,
) -> Result<(Freeze<'a>, Held<'a>, Duration), String> {
    let started = Instant::now();
    let held = quiet.hold();
    let mut backoff = Duration::from_micros(5);
    loop {
        if ready(quiet) {
            let frozen = Freeze::new(pid, &quiet.freezes)?;
            if ready(quiet) {
                return Ok((frozen, held, started.elapsed()));
            }
            drop(frozen);
        }
        if started.elapsed() >= hold {
            return Err(format!(
                "`{name}` reached no {what} within {} ms ({})",
                hold.as_millis(),
                quiet.busy()
            ));
        }
        std::thread::sleep(backoff);
        backoff = (backoff * 2).min(Duration::from_millis(1));
    }
}

/// A checkpoint taken at a safe point.
struct AtSafePoint {
    stats: Stats,
    /// How long the component was held still.
    pause: Duration,
    /// How long the safe point took to come.
    waited: Duration,
    /// How long the component's audit took.
    audit: Duration,
    /// What the component keeps outside, as of the checkpoint (if a file
    /// is to be written).
    exported: Option<Result<BTreeMap<String, Vec<u8>>, String>>,
}

/// Takes a checkpoint at a safe point; writes the image to `out` if given.
/// When the component has likely written the policy's `read_ahead_pages`
/// or more since its latest checkpoint (at the rate it wrote before it;
/// [`DEFAULT_READ_AHEAD_PAGES`] without a policy: below about that many,
/// the scan a read-ahead adds likely costs more than the copy it takes
/// out of the pause, a choice not measured), the pages written since are
/// read ahead while the component runs, before it is held: the pause then
/// copies only those written after.
fn take(c: &mut Tracked, out: Option<PathBuf>, hold: Duration) -> Result<Summary, String> {
    let started = Instant::now();
    let pid = c
        .incarnation
        .pid()
        .ok_or("the component has no live incarnation")?;
    c.not_recovering()?;
    let ckpt = c.incarnation.attached(&c.quiet.freezes)?;
    // A checkpoint its audit finds damaged is taken back.
    ckpt.keep_previous(c.journal.is_some());
    // Holds the component at a safe point and checkpoints it; cuts its log.
    let at_point = |ckpt: &mut Checkpointer| -> Result<AtSafePoint, String> {
        let (frozen, held, waited) = at_safe_point(&c.quiet, &c.name, pid, hold)?;
        if lost_thread(&c.quiet.control, pid) {
            // A checkpoint would keep the loss for every restore.
            kill_process(pid);
            return Err(format!(
                "`{}` (pid {pid}) lost a runtime thread (a worker ended while the process lives): killed, to recover from its last checkpoint",
                c.name
            ));
        }
        if c.journal.as_ref().is_some_and(|j| j.replay_pending()) {
            // Its state is not whole until the log is replayed, and a
            // checkpoint would cut the log.
            return Err(format!("`{}` has not replayed its log yet", c.name));
        }
        let stats = ckpt.checkpoint_frozen(&frozen).map_err(|e| e.to_string());
        // What it keeps outside, as of the same instant.
        let exported = match (&stats, &out) {
            (Ok(_), Some(_)) => Some(c.kept.export(&c.name)),
            _ => None,
        };
        let pause = frozen.held();
        drop(frozen);
        // A checkpoint-recovered component audits what was just copied,
        // its calls still held: damage is never kept, nor the log cut.
        let audit = Instant::now();
        let stats = match (stats, &c.journal) {
            (Ok(stats), Some(journal)) => match audited(&c.quiet, &c.name, pid) {
                Ok(()) => {
                    // The checkpoint holds every logged request's effect:
                    // the calls are held, so none has run since the copy
                    // (a worker let go marks its slot before it reads the
                    // hold, which it now sees raised).
                    journal.cut();
                    Ok(stats)
                }
                Err(e) => {
                    ckpt.take_back();
                    Err(e)
                }
            },
            (stats, _) => stats,
        };
        let audit = audit.elapsed();
        drop(held);
        Ok(AtSafePoint {
            stats: stats?,
            pause,
            waited,
            audit,
            exported,
        })
    };
    let from = c
        .policy
        .map_or(DEFAULT_READ_AHEAD_PAGES, |p| p.read_ahead_pages);
    let AtSafePoint {
        mut stats,
        pause,
        waited,
        audit,
        exported,
    } = match ckpt.expected_pages() >= from {
        true => ckpt.with_read_ahead(at_point)?,
        false => at_point(ckpt)?,
    };
    stats.pause = pause;
    if let (Some(path), Some(exported)) = (&out, exported) {
        *ckpt.attachments_mut() = exported?;
        let written = file::write(ckpt.image(), path);
        ckpt.attachments_mut().clear();
        written.map_err(|e| format!("{}: {e}", path.display()))?;
    }
    let mut done = summary(c, "checkpoint", stats, waited, started, out);
    done.audit_us = audit.as_micros() as u64;
    Ok(done)
}

/// Restores the incarnation in place from its latest checkpoint, or from
/// an image file: one taken from this incarnation is restored in place,
/// one taken from an earlier incarnation (or exported elsewhere) into this
/// new one. Nothing is touched unless the file reads whole and matches.
///
/// `force` does not wait for a safe point (TAC's rollback of a hung
/// incarnation, which never reaches one): calls being served are rolled
/// back with the workers serving them, which find them still posted and
/// run them again; the component's own calls and vault exchanges must
/// still be over (their replies would reach threads that no longer wait
/// for them).
fn restore(c: &mut Tracked, from: Option<&Path>, force: bool) -> Result<Summary, String> {
    let started = Instant::now();
    let image = from
        .map(|path| file::read(path).map_err(|e| e.to_string()))
        .transpose()?;
    let pid = c
        .incarnation
        .pid()
        .ok_or("the component has no live incarnation")?;
    c.not_recovering()?;
    let ckpt = c.incarnation.attached(&c.quiet.freezes)?;
    if let Some(image) = &image {
        if image.exe != ckpt.image().exe {
            return Err(format!(
                "{}: the image is of {}, `{}` runs {}",
                from.map(|p| p.display().to_string()).unwrap_or_default(),
                image.exe,
                c.name,
                ckpt.image().exe
            ));
        }
    } else if ckpt.image().seq == 0 {
        return Err(format!("`{}` (pid {pid}) has no checkpoint yet", c.name));
    }
    if force {
        // A process stopped by a signal (a hang `kintsugi run --signals
        // stop` injects) runs again, to be frozen and rolled back.
        continue_process(pid);
    }
    let (frozen, held, waited) = match force {
        false => at_safe_point(&c.quiet, &c.name, pid, REQUESTED_HOLD)?,
        true => at_forced_point(&c.quiet, &c.name, pid, REQUESTED_HOLD)?,
    };
    let ckpt = c.incarnation.attached(&c.quiet.freezes)?;
    let (kind, stats): (&str, Result<Stats, _>) = match image {
        None => ("restore in place", ckpt.restore_frozen(&frozen)),
        Some(image) if image.pid == pid => (
            "restore from file",
            ckpt.restore_image_frozen(&frozen, image),
        ),
        Some(image) => (
            "restore into a new incarnation",
            ckpt.restore_new_frozen(&frozen, image),
        ),
    };
    let mut started_over = 0;
    if stats.is_ok() {
        started_over = start_workers_over(&c.quiet.control, ckpt, &frozen, &c.name);
        rolled_back(c, pid);
    }
    let pause = frozen.held();
    drop(frozen);
    drop(held);
    wake_for_replay(c);
    if stats.is_err() && kind == "restore into a new incarnation" {
        // The checkpointer now holds the foreign image: attach anew.
        c.incarnation = Holder::Live(pid);
    }
    // The hot image keeps memory only.
    if let Holder::Attached(ckpt) = &mut c.incarnation {
        ckpt.attachments_mut().clear();
    }
    let mut stats = stats.map_err(|e| e.to_string())?;
    stats.pause = pause;
    let mut done = summary(c, kind, stats, waited, started, from.map(Path::to_path_buf));
    done.started_over = started_over;
    Ok(done)
}

/// After a restore, with the process still frozen: its workers start
/// their loops over (the runtime's `restart.rs`), so that what their
/// registers and frames held at the checkpoint, a safe point where they
/// serve nothing, is left behind, a captured fault with it; the memory
/// stays the image's. Returns how many did (0 if the component published
/// no restart point, or on failure, when the rest resume where the image
/// had them: either way is a valid state).
fn start_workers_over(control: &Region, ckpt: &Checkpointer, frozen: &Frozen, name: &str) -> usize {
    let ctl: &ControlBlock = control.at(0);
    let r = &ctl.restarts;
    let at = StartOver {
        entry: r.entry.load(Ordering::Acquire),
        table: r.lines.load(Ordering::Relaxed),
        lines: LIFELINES,
        stack: r.stack.load(Ordering::Relaxed),
    };
    if at.entry == 0 {
        return 0;
    }
    ckpt.start_over(frozen, &at).unwrap_or_else(|e| {
        tracing::warn!(component = %name, "its workers resume where the checkpoint had them: {e}");
        0
    })
}

/// After a restore, with the process still frozen: every worker is back
/// where it was at the checkpoint, a safe point, so none is serving and
/// none in a stretch (sections other threads were in are not put back:
/// see the README); a checkpoint-recovered component is to replay its log.
fn rolled_back(c: &Tracked, pid: u32) {
    for e in &c.quiet.served {
        e.reset_serving();
        e.clear_suspicion();
    }
    for e in &c.quiet.used {
        e.client_restored();
    }
    let ctl: &ControlBlock = c.quiet.control.at(0);
    for w in ctl.watch.workers.iter() {
        if w.pid.load(Ordering::Relaxed) == pid {
            w.rolled_back();
        }
    }
    if let Some(journal) = &c.journal {
        journal.ask_replay();
    }
}

/// After a restore of incarnation `died`'s image into process `pid`: a
/// worker entry that still names a thread of `died` (its new thread had
/// not registered when it was frozen: workers register once their
/// component has initialized, and the restore may come first) names the
/// thread that took its place (`pairs`: the image's thread, the
/// process's), which runs on past its registration and never makes it.
/// Left so, the watchdog passed over the entry, and a hang of the
/// restored incarnation went unseen.
fn adopt_worker_entries(c: &Tracked, died: u32, pid: u32, pairs: &[(u32, u32)]) {
    let ctl: &ControlBlock = c.quiet.control.at(0);
    let mut adopted = 0;
    for w in ctl.watch.workers.iter() {
        let owner = w.pid.load(Ordering::Relaxed);
        if owner != died && owner != pid {
            continue;
        }
        let tid = w.tid.load(Ordering::Relaxed);
        if let Some(&(_, new)) = pairs.iter().find(|&&(old, _)| old == tid) {
            w.tid.store(new, Ordering::Relaxed);
            w.pid.store(pid, Ordering::Relaxed);
            adopted += 1;
        }
    }
    if adopted > 0 {
        tracing::debug!(component = %c.name, pid, "{adopted} watchdog worker entries adopted from {died}");
    }
}

/// Sends SIGCONT to `pid` (harmless if it was not stopped).
fn continue_process(pid: u32) {
    signal(pid, rustix::process::Signal::CONT);
}

/// Sends SIGKILL to `pid`, frozen by this thread (so not reaped, and its
/// pid not reused, meanwhile).
fn kill_process(pid: u32) {
    signal(pid, rustix::process::Signal::KILL);
}

fn signal(pid: u32, signal: rustix::process::Signal) {
    if let Some(p) = rustix::process::Pid::from_raw(pid as i32) {
        let _ = rustix::process::kill_process(p, signal);
    }
}

/// Whether a runtime thread of process `pid` (its main thread or a
/// worker, each holding a lifeline of the bank whose first line `pid`'s
/// main thread holds) has died while the process lives: a fault (a flipped
/// frame pointer can make a worker return from its loop) that leaves the
/// worker's slot unserved, and that a checkpoint would capture, so that
/// no new incarnation, which has all its threads, could be restored from
/// it (kv's register-flip campaign lost its system so, 2026-11-29).
fn lost_thread(control: &Region, pid: u32) -> bool {
    let ctl: &ControlBlock = control.at(0);
    (0..ctl.lifelines.len())
        .map(|bank| ctl.bank(bank))
        .find(|lines| {
            lines
                .first()
                .is_some_and(|l| l.word.load(Ordering::SeqCst) & TID_MASK == pid)
        })
        .is_some_and(|lines| lines.iter().any(Lifeline::dead))
}

/// Wakes a checkpoint-recovered component's workers, once it runs again,
/// to replay its log.
fn wake_for_replay(c: &Tracked) {
    if c.journal.is_some() {
        for e in &c.quiet.served {
            kintsugi_runtime::server::wake_workers(e);
        }
    }
}

/// Checkpoint recovery of a new incarnation (`recovery = "checkpoint"`),
/// whose served edges the supervisor holds: the last checkpoint of the
/// incarnation that died is restored into it (none if it died before its
/// first: the new one starts where the log starts), it is asked to replay
/// the log, and the supervisor's hold is let go. On failure the hold
/// stays, for the incarnation is to be killed.
///
/// `fresh` drops the last checkpoint and cuts the log instead: the new
/// incarnation keeps its initial state (the state that died is lost).
fn recover(c: &mut Tracked, fresh: bool) -> Result<Summary, String> {
    let started = Instant::now();
    let journal = c
        .journal
        .clone()
        .ok_or_else(|| format!("`{}` is not checkpoint-recovered", c.name))?;
    let pid = c
        .incarnation
        .pid()
        .ok_or("the component has no live incarnation")?;
    if fresh {
        c.last = None;
        journal.cut();
        recovered(c);
        let mut done = summary(c, FRESH, Stats::default(), Duration::ZERO, started, None);
        done.pid = pid;
        return Ok(done);
    }
    let outcome = match c.last.take() {
        None => {
            journal.ask_replay();
            let stats = Stats::default();
            let mut done = summary(c, "replay", stats, Duration::ZERO, started, None);
            done.pid = pid;
            Ok(done)
        }
        Some(image) => restore_last(c, pid, image, started),
    };
    let mut done = outcome?;
    let replay_started = Instant::now();
    recovered(c);
    wake_for_replay(c);
    if wait_replayed(&journal, pid) {
        done.replay_us = replay_started.elapsed().as_micros() as u64;
        let h = journal.header();
        done.replayed = h.last_replay_entries.load(Ordering::SeqCst);
        done.replayed_calls = h.last_replay_calls.load(Ordering::SeqCst);
        done.diverged = h.last_replay_diverged.load(Ordering::SeqCst);
        if done.replayed > 0 && c.next_due.is_some() {
            // What was just replayed is in the log still: a crash before
            // the next checkpoint would replay it again. The next one is
            // due now.
            c.next_due = Some(Instant::now());
        }
    }
    done.total_us = started.elapsed().as_micros() as u64;
    Ok(done)
}

/// The recovery's state is in place (restored with its log to replay,
/// which a checkpoint waits for, or dropped): periodic checkpoints go on,
/// and the supervisor's hold on the calls to it is let go.
fn recovered(c: &mut Tracked) {
    c.recovering = false;
    c.next_due = c.policy.map(|p| Instant::now() + p.every);
    for e in &c.quiet.served {
        e.hold_serving(false);
    }
}

/// The kind of a recovery that dropped the state (see `ladder.rs`).
pub(crate) const FRESH: &str = "fresh start (checkpoint and log dropped)";

/// How long a recovery waits for the replay it asked for: a longer one
/// goes on after the reboot is reported.
const REPLAY_WAIT: Duration = Duration::from_secs(2);

/// How often a wait for a replay looks whether its process still lives.
const REPLAY_RECHECK: Duration = Duration::from_millis(1);

/// Waits until process `pid` has replayed its log (true), died, or taken
/// [`REPLAY_WAIT`].
fn wait_replayed(journal: &JournalRegion, pid: u32) -> bool {
    let until = Instant::now() + REPLAY_WAIT;
    let alive = || std::path::Path::new(&format!("/proc/{pid}")).exists();
    while journal.replay_pending() {
        if Instant::now() >= until || !alive() {
            return false;
        }
        // Woken when the replay ends; bounded, to notice a death.
        kintsugi_runtime::futex::wait(&journal.header().replay, 1, Some(REPLAY_RECHECK));
    }
    true
}

/// Restores `image`, the last checkpoint of the incarnation that died,
/// into the new incarnation `pid`; kept for the next try if that fails.
fn restore_last(
    c: &mut Tracked,
    pid: u32,
    image: Image,
    started: Instant,
) -> Result<Summary, String> {
    if let Err(e) = c.incarnation.attached(&c.quiet.freezes) {
        c.last = Some(image);
        return Err(e);
    }
    // Its last threads may still be starting: wait for as many as the image has.
    let (frozen, held, waited) = loop {
        let point = match at_safe_point(&c.quiet, &c.name, pid, REQUESTED_HOLD) {
            Ok(point) => point,
            Err(e) => {
                c.last = Some(image);
                return Err(e);
            }
        };
        if point.0.tids().len() >= image.threads.len() || started.elapsed() >= REQUESTED_HOLD {
            break point;
        }
        drop(point);
        std::thread::sleep(Duration::from_micros(200));
    };
    let ckpt = c.incarnation.attached(&c.quiet.freezes)?;
    let (died, pairs) = (
        image.pid,
        kintsugi_checkpoint::thread_pairs(&image, &frozen),
    );
    let stats = ckpt.restore_new_frozen(&frozen, image);
    let mut started_over = 0;
    if stats.is_ok() {
        started_over = start_workers_over(&c.quiet.control, ckpt, &frozen, &c.name);
        adopt_worker_entries(c, died, pid, &pairs);
        rolled_back(c, pid);
    }
    let pause = frozen.held();
    drop(frozen);
    drop(held);
    match stats {
        Ok(mut stats) => {
            stats.pause = pause;
            let mut done = summary(c, "restore and replay", stats, waited, started, None);
            done.started_over = started_over;
            Ok(done)
        }
        Err(e) => {
            if let Holder::Attached(ckpt) = std::mem::replace(&mut c.incarnation, Holder::Live(pid))
            {
                c.last = Some(ckpt.into_image());
            }
            Err(e.to_string())
        }
    }
}

fn summary(
    c: &mut Tracked,
    kind: &str,
    stats: Stats,
    waited: Duration,
    started: Instant,
    file: Option<PathBuf>,
) -> Summary {
    let (seq, image_bytes, pid) = match &c.incarnation {
        Holder::Attached(ck) => (ck.image().seq, ck.image().populated_bytes(), ck.pid()),
        _ => (0, 0, 0),
    };
    Summary {
        component: c.name.clone(),
        pid,
        kind: kind.to_string(),
        seq,
        areas: stats.areas,
        new_areas: stats.new_areas,
        pages: stats.pages,
        read_ahead: stats.read_ahead,
        compared: stats.compared,
        layout_calls: stats.layout_calls,
        bytes: stats.bytes,
        threads: stats.threads,
        pause_us: stats.pause.as_micros() as u64,
        total_us: started.elapsed().as_micros() as u64,
        waited_us: waited.as_micros() as u64,
        audit_us: 0,
        image_bytes,
        file,
        periodic_taken: c.taken,
        periodic_skipped: c.skipped,
        replayed: 0,
        replay_us: 0,
        replayed_calls: 0,
        diverged: 0,
        started_over: 0,
    }
}

/// Starts the checkpoint thread; it runs until `commands` is closed.
pub(crate) fn start(
    comps: Vec<Tracked>,
    dir: PathBuf,
    commands: Arc<Mailbox<Command>>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("checkpoints".into())
        .spawn(move || serve(comps, dir, commands))
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::thread::JoinHandle;

    use super::*;

    /// A thread that holds lifeline `line` of bank 1 until `end` is
    /// dropped: its tid, `end` and its handle.
    fn holder(control: &Arc<Region>, line: usize) -> (u32, mpsc::Sender<()>, JoinHandle<()>) {
        let (tid_tx, tid_rx) = mpsc::channel();
        let (end, ended) = mpsc::channel::<()>();
        let control = control.clone();
        let handle = std::thread::spawn(move || {
            let ctl: &ControlBlock = control.at(0);
            ctl.lifelines[1][line]
                .register()
                .expect("register a lifeline");
            let tid = rustix::thread::gettid().as_raw_nonzero().get() as u32;
            tid_tx.send(tid).expect("send the tid");
            let _ = ended.recv();
        });
        (tid_rx.recv().expect("a tid"), end, handle)
    }

    #[test]
    fn a_runtime_thread_that_ended_while_its_process_lives_is_lost() {
        let size = std::mem::size_of::<ControlBlock>();
        let control = Arc::new(Region::create("lost-thread", size).expect("a control block"));
        let ctl: &ControlBlock = control.at(0);
        ctl.lifeline_count[1].store(2, Ordering::SeqCst);
        let (main, end_main, main_thread) = holder(&control, 0);
        let (_, end_worker, worker) = holder(&control, 1);
        assert!(!lost_thread(&control, main), "both alive");
        drop(end_worker);
        worker.join().expect("the worker ends");
        assert!(lost_thread(&control, main), "the worker ended");
        assert!(
            !lost_thread(&control, main ^ 1),
            "no bank is another process's"
        );
        drop(end_main);
        main_thread.join().expect("the main thread ends");
    }
}

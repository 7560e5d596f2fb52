//! netd: the network daemon. It owns a TCP listener on 127.0.0.1 and the
//! connections it accepts, serving them over the `net` interface.
//!
//! The state vault holds the listener and every accepted socket (posted
//! without waiting, before `accept` returns), so a crash of netd loses no
//! connection: the next incarnation takes them back from the vault and
//! learns each stream's offsets from the kernel (`sockinfo`). Clients pass
//! their stream offsets with every call, so a re-issued call neither loses
//! nor repeats a byte:
//!
//! - `recv(seen, keep)` first discards what lies before the client's first
//!   unanswered request (`keep`) and then reads with `MSG_PEEK` from `seen`:
//!   bytes leave the kernel only once a later call confirms that the client
//!   answered the request they belong to.
//! - `send(at)` skips the bytes of `data` the kernel already has.
//!
//! A connection is handed to one worker thread of one client. Conn ids come
//! from a counter in netd's durable arena, so they grow across reboots; an
//! `accept` re-issued after a reboot first gets the connection a dead
//! incarnation accepted for that worker but never reported (an id above the
//! worker's `last`). When a client dies, its connections are handed to its
//! successor's workers, with stream offsets rebased to the `keep` of the
//! dead one's last `recv` (its first unanswered request), so the successor
//! serves that request again and its response skips what the kernel
//! already took. A call of the dead incarnation still in flight finds the
//! connection handed over and touches nothing.
//!
//! With `tracking = false` (for comparison), netd keeps nothing in the vault
//! and reads without `MSG_PEEK`: what recovery costs, turned off.

#![deny(unsafe_code)]

#[allow(unsafe_code)] // each block has a SAFETY comment (README: unsafe)
mod sockinfo;

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kintsugi_interfaces::net::{self, Error};
use kintsugi_runtime::vault::{Vault, VaultOp};
use kintsugi_runtime::{Caller, Incarnation, Runtime};
use rustix::net::{RecvFlags, SendFlags, Shutdown};
use serde::Deserialize;

/// Vault key of the listening socket.
const LISTENER: &str = "listen";
/// Vault key prefix of connections.
const CONN: &str = "c/";
/// How long `accept` waits on the listener between looks at handed-over connections.
const POLL: Duration = Duration::from_millis(20);
/// The most a client may hold of a stream without having answered it: more
/// than a socket's receive queue holds (`tcp_rmem`'s default maximum is
/// 6 MiB), so no correct client reaches it.
const MAX_UNANSWERED: usize = 16 << 20;
/// A connection restored from the vault that no client claims for this long
/// was closed by a call that died with the previous incarnation.
const UNCLAIMED: Duration = Duration::from_secs(2);

#[derive(Deserialize)]
struct Config {
    /// Port on 127.0.0.1 (0: any free port, published as counter `port`).
    port: u16,
    #[serde(default = "yes")]
    tracking: bool,
    #[serde(default = "backlog")]
    backlog: i32,
}

fn yes() -> bool {
    true
}

fn backlog() -> i32 {
    1024
}

/// What the vault keeps with a connection's socket.
#[derive(serde::Serialize, Deserialize, Clone, Copy)]
struct Kept {
    /// Client component and worker it was handed to.
    client: u32,
    worker: u32,
    /// Where the client's stream offsets start (nonzero after a hand-over).
    rb: u64,
    tb: u64,
}

/// Stream positions, in absolute bytes of the TCP stream.
#[derive(Default)]
struct Io {
    /// Bytes read out of the kernel's receive queue.
    discarded: u64,
    /// Bytes written into the kernel's send queue.
    sent: u64,
    /// Where the client's first unanswered request began (its last `recv`'s
    /// `keep`), and `sent` then: where a successor resumes.
    rx_mark: u64,
    tx_mark: u64,
    /// Where the current client's offsets start.
    rb: u64,
    tb: u64,
}

struct Entry {
    fd: OwnedFd,
    io: Mutex<Io>,
    /// Set when the connection changes hands: the next call rebases.
    rebase: AtomicBool,
    /// Deaths of its client before it was handed over: a death counted
    /// later orphans it, an earlier one told late does not, and a call
    /// that began before the hand-over is refused.
    deaths: AtomicU64,
}

impl Entry {
    fn new(fd: OwnedFd, io: Io, deaths: u64) -> Arc<Self> {
        Arc::new(Self {
            fd,
            io: Mutex::new(io),
            rebase: AtomicBool::new(false),
            deaths: AtomicU64::new(deaths),
        })
    }

    /// The stream, unless a call that began when its client had died
    /// `deaths` times finds it handed to a successor since.
    fn io(&self, deaths: u64) -> Result<std::sync::MutexGuard<'_, Io>, Error> {
        let io = self.io.lock().unwrap();
        if self.deaths.load(Ordering::SeqCst) > deaths {
            return Err(Error::Closed);
        }
        Ok(io)
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum State {
    /// Its client knows it.
    Delivered,
    /// Its client died: for the next `accept` of the client's successor.
    Orphaned,
    /// Restored from the vault by this incarnation, not yet claimed.
    Restored(Instant),
}

struct Slot {
    entry: Arc<Entry>,
    kept: Kept,
    state: State,
}

#[derive(Default)]
struct Table {
    conns: HashMap<u64, Slot>,
    /// Deaths seen per client, so an `accept` outlived by its caller hands nothing to it.
    deaths: HashMap<u32, u64>,
    /// The `last` each worker passed to `accept`, per (client, worker).
    last: HashMap<(u32, u32), u64>,
    /// Closed connections, drained until the peer closes (or `UNCLAIMED`
    /// passes), so that late bytes do not make the kernel reset them and
    /// drop the last response.
    lingering: Vec<(Arc<Entry>, Instant)>,
}

struct Netd {
    rt: Arc<Runtime>,
    listener: OwnedFd,
    tracking: bool,
    table: Mutex<Table>,
}

fn io_error(e: rustix::io::Errno) -> Error {
    tracing::debug!("socket: {e}");
    Error::Closed
}

impl Netd {
    fn vault(&self) -> &Vault {
        self.rt.vault()
    }

    fn post(&self, ops: Vec<VaultOp>, fd: Option<&OwnedFd>) {
        if !self.tracking {
            return;
        }
        let fds: Vec<_> = fd.iter().map(|f| f.as_fd()).collect();
        if let Err(e) = self.vault().post(ops, &fds) {
            tracing::warn!("vault: {e}");
        }
    }

    fn keep(&self, id: u64, kept: Kept, fd: Option<&OwnedFd>) {
        let value = serde_json::to_value(kept).expect("serializes");
        let op = VaultOp::Put {
            key: conn_key(id),
            value,
            fd: fd.is_some(),
        };
        self.post(vec![op], fd);
    }

    /// A new connection id: ids grow across reboots (the counter is in the arena).
    fn next_id(&self) -> u64 {
        let arena = self.rt.arena().expect("checked at start");
        arena.at::<AtomicU64>(0).fetch_add(1, Ordering::SeqCst) + 1
    }

    /// A connection, and how many deaths of the caller's component netd knows of.
    fn entry(&self, caller: &Caller, id: u64) -> Result<(Arc<Entry>, u64), Error> {
        let t = self.table.lock().unwrap();
        let deaths = t.deaths.get(&caller.component).copied().unwrap_or(0);
        let entry = t.conns.get(&id).ok_or(Error::NotFound)?.entry.clone();
        Ok((entry, deaths))
    }

    /// A connection already accepted that this worker should take, if any.
    fn handed(&self, t: &mut Table, caller: &Caller, worker: u32, last: u64) -> Option<u64> {
        let me = (caller.component, worker);
        let orphan = t
            .conns
            .iter()
            .filter(|(_, s)| s.kept.client == caller.component && s.state == State::Orphaned)
            .map(|(id, _)| *id)
            .min();
        let deaths = t.deaths.get(&caller.component).copied().unwrap_or(0);
        if let Some(id) = orphan {
            let slot = t.conns.get_mut(&id).expect("present");
            slot.entry.deaths.store(deaths, Ordering::SeqCst);
            slot.state = State::Delivered;
            slot.kept.worker = worker;
            slot.entry.rebase.store(true, Ordering::SeqCst);
            return Some(id);
        }
        let unreported = t
            .conns
            .iter()
            .filter(|(id, s)| {
                matches!(s.state, State::Restored(_))
                    && (s.kept.client, s.kept.worker) == me
                    && **id > last
            })
            .map(|(id, _)| *id)
            .min()?;
        let slot = t.conns.get_mut(&unreported).expect("present");
        slot.state = State::Delivered;
        slot.entry.deaths.store(deaths, Ordering::SeqCst);
        Some(unreported)
    }

    /// Closes connections restored from the vault that nobody claimed: their
    /// `close` died with the previous incarnation.
    fn reap(&self) {
        let mut t = self.table.lock().unwrap();
        t.lingering
            .retain(|(e, since)| since.elapsed() < UNCLAIMED && !drained(&e.fd));
        let last = t.last.clone();
        let dead: Vec<u64> = t
            .conns
            .iter()
            .filter(|(id, s)| match s.state {
                State::Restored(since) => {
                    since.elapsed() > UNCLAIMED
                        && last
                            .get(&(s.kept.client, s.kept.worker))
                            .is_some_and(|l| l >= id)
                }
                _ => false,
            })
            .map(|(id, _)| *id)
            .collect();
        for id in dead {
            if let Some(slot) = t.conns.remove(&id) {
                tracing::debug!(id, "closing a connection nobody claimed");
                let _ = rustix::net::shutdown(&slot.entry.fd, Shutdown::Both);
                self.post(vec![VaultOp::Delete { key: conn_key(id) }], None);
            }
        }
    }

    /// The connection's offsets start where its new client's request began.
    fn rebase(&self, id: u64, e: &Entry, io: &mut Io) {
        if !e.rebase.swap(false, Ordering::SeqCst) {
            return;
        }
        io.rb = io.rx_mark;
        io.tb = io.tx_mark;
        let kept = {
            let mut t = self.table.lock().unwrap();
            let Some(slot) = t.conns.get_mut(&id) else {
                return;
            };
            slot.kept.rb = io.rb;
            slot.kept.tb = io.tb;
            slot.kept
        };
        self.keep(id, kept, None);
    }
}

/// Reads the front of the receive queue, leaving it there.
fn peek(fd: &OwnedFd, out: &mut [u8], flags: RecvFlags) -> Result<usize, Error> {
    loop {
        match rustix::net::recv(fd, &mut *out, flags | RecvFlags::PEEK) {
            Ok((n, _)) => return Ok(n),
            Err(rustix::io::Errno::INTR) => {}
            Err(err) => return Err(io_error(err)),
        }
    }
}

/// Reads what is readable now; true once the peer has closed its side.
fn drained(fd: &OwnedFd) -> bool {
    let mut scratch = [0u8; 4096];
    loop {
        match rustix::net::recv(fd, &mut scratch, RecvFlags::DONTWAIT) {
            Ok((0, _)) => return true,
            Ok(_) | Err(rustix::io::Errno::INTR) => {}
            Err(rustix::io::Errno::AGAIN) => return false,
            Err(_) => return true,
        }
    }
}

fn conn_key(id: u64) -> String {
    format!("{CONN}{id:016x}")
}

impl net::Server for Netd {
    fn acceptor(&self, _: &Caller, worker: u32) -> Result<u64, Error> {
        Ok(u64::from(worker))
    }

    fn accept(&self, caller: &Caller, a: u64, last: u64) -> Result<u64, Error> {
        let worker = a as u32;
        let deaths = {
            let mut t = self.table.lock().unwrap();
            t.last.insert((caller.component, worker), last);
            if let Some(id) = self.handed(&mut t, caller, worker, last) {
                return Ok(id);
            }
            t.deaths.get(&caller.component).copied().unwrap_or(0)
        };
        loop {
            let mut fds = [rustix::event::PollFd::new(
                &self.listener,
                rustix::event::PollFlags::IN,
            )];
            let timeout = rustix::time::Timespec {
                tv_sec: 0,
                tv_nsec: POLL.as_nanos() as i64,
            };
            match rustix::event::poll(&mut fds, Some(&timeout)) {
                Ok(_) | Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(io_error(e)),
            }
            let accepted =
                match rustix::net::accept_with(&self.listener, rustix::net::SocketFlags::CLOEXEC) {
                    Ok(fd) => Some(fd),
                    Err(rustix::io::Errno::AGAIN | rustix::io::Errno::INTR) => None,
                    Err(e) => {
                        tracing::warn!("accept: {e}");
                        None
                    }
                };
            let mut t = self.table.lock().unwrap();
            let died = t.deaths.get(&caller.component).copied().unwrap_or(0) != deaths;
            if let Some(fd) = accepted {
                let id = self.next_id();
                let kept = Kept {
                    client: caller.component,
                    worker,
                    rb: 0,
                    tb: 0,
                };
                // Queued on the vault's socket before anyone hears of it.
                self.keep(id, kept, Some(&fd));
                let _ = rustix::net::sockopt::set_tcp_nodelay(&fd, true);
                let entry = Entry::new(fd, Io::default(), deaths);
                // A caller that died meanwhile never hears of it: its successor will.
                let state = if died {
                    State::Orphaned
                } else {
                    State::Delivered
                };
                t.conns.insert(id, Slot { entry, kept, state });
                if let Ok(c) = self.rt.counter("accepted") {
                    c.add(1);
                }
                return if died { Err(Error::Closed) } else { Ok(id) };
            }
            if died {
                return Err(Error::Closed);
            }
            if let Some(id) = self.handed(&mut t, caller, worker, last) {
                return Ok(id);
            }
        }
    }

    fn adopt(&self, _: &Caller, id: u64) -> Result<u64, Error> {
        let mut t = self.table.lock().unwrap();
        let slot = t.conns.get_mut(&id).ok_or(Error::NotFound)?;
        if let State::Restored(_) = slot.state {
            slot.state = State::Delivered;
        }
        Ok(id)
    }

    fn recv(
        &self,
        caller: &Caller,
        c: u64,
        seen: u64,
        keep: u64,
        max: u32,
        out: &mut [u8],
    ) -> Result<usize, Error> {
        let (e, deaths) = self.entry(caller, c)?;
        let mut io = e.io(deaths)?;
        self.rebase(c, &e, &mut io);
        let max = (max as usize).min(out.len());
        if !self.tracking {
            return loop {
                match rustix::net::recv(&e.fd, &mut out[..max], RecvFlags::empty()) {
                    Ok((n, _)) => break Ok(n),
                    Err(rustix::io::Errno::INTR) => {}
                    Err(err) => break Err(io_error(err)),
                }
            };
        }
        let want = io.rb + keep;
        if keep > seen || want < io.discarded {
            return Err(Error::Invalid);
        }
        let mut scratch = [0u8; 4096];
        while io.discarded < want {
            let n = ((want - io.discarded) as usize).min(scratch.len());
            match rustix::net::recv(&e.fd, &mut scratch[..n], RecvFlags::empty()) {
                Ok((0, _)) => return Err(Error::Invalid),
                Ok((n, _)) => io.discarded += n as u64,
                Err(rustix::io::Errno::INTR) => {}
                Err(err) => return Err(io_error(err)),
            }
        }
        io.rx_mark = io.discarded;
        io.tx_mark = io.sent;
        // The client already has `skip` bytes of its unanswered request;
        // no more than a socket can queue (a faulty client must not make
        // netd allocate what it asks for).
        let skip = usize::try_from(seen - keep)
            .ok()
            .filter(|&s| s <= MAX_UNANSWERED)
            .ok_or(Error::Invalid)?;
        if skip == 0 {
            return peek(&e.fd, &mut out[..max], RecvFlags::empty());
        }
        let mut queued = vec![0u8; skip + max];
        // Waits for a byte past `skip` (fewer: the stream ended), then takes what is there.
        if peek(&e.fd, &mut queued[..skip + 1], RecvFlags::WAITALL)? <= skip {
            return Ok(0);
        }
        let n = peek(&e.fd, &mut queued, RecvFlags::DONTWAIT)?;
        out[..n - skip].copy_from_slice(&queued[skip..n]);
        Ok(n - skip)
    }

    fn send(&self, caller: &Caller, c: u64, at: u64, data: &[u8]) -> Result<u32, Error> {
        let (e, deaths) = self.entry(caller, c)?;
        let mut io = e.io(deaths)?;
        self.rebase(c, &e, &mut io);
        let start = io.tb + at;
        if start > io.sent {
            return Err(Error::Invalid);
        }
        let mut done = ((io.sent - start) as usize).min(data.len());
        while done < data.len() {
            match rustix::net::send(&e.fd, &data[done..], SendFlags::NOSIGNAL) {
                Ok(n) => {
                    done += n;
                    io.sent += n as u64;
                }
                Err(rustix::io::Errno::INTR) => {}
                Err(err) => return Err(io_error(err)),
            }
        }
        Ok(data.len() as u32)
    }

    fn shutdown(&self, caller: &Caller, c: u64) -> Result<(), Error> {
        let (e, deaths) = self.entry(caller, c)?;
        // Not under the stream's lock, which a blocked `recv` holds.
        if e.deaths.load(Ordering::SeqCst) > deaths {
            return Err(Error::Closed);
        }
        let _ = rustix::net::shutdown(&e.fd, Shutdown::Both);
        Ok(())
    }

    fn close(&self, _: &Caller, c: u64) -> Result<(), Error> {
        let slot = self
            .table
            .lock()
            .unwrap()
            .conns
            .remove(&c)
            .ok_or(Error::NotFound)?;
        // Unread bytes at close would make the kernel reset the connection
        // (and drop the response still queued): read them first, and only
        // then let the vault forget it, so that a crash in between never
        // closes a socket with unread bytes.
        let _ = rustix::net::shutdown(&slot.entry.fd, Shutdown::Write);
        let done = drained(&slot.entry.fd);
        self.post(vec![VaultOp::Delete { key: conn_key(c) }], None);
        if !done {
            let mut t = self.table.lock().unwrap();
            t.lingering.push((slot.entry, Instant::now()));
        }
        Ok(())
    }

    fn client_died(&self, client: u32) {
        let mut t = self.table.lock().unwrap();
        let deaths = {
            let d = t.deaths.entry(client).or_default();
            *d += 1;
            *d
        };
        t.last.retain(|(c, _), _| *c != client);
        for slot in t
            .conns
            .values_mut()
            .filter(|s| s.kept.client == client && s.entry.deaths.load(Ordering::SeqCst) < deaths)
        {
            slot.state = State::Orphaned;
        }
    }
}

/// The listener and connections the vault kept, or a new listener.
fn restore(rt: &Arc<Runtime>, config: &Config) -> anyhow::Result<(OwnedFd, Table)> {
    let mut listener = None;
    let mut table = Table::default();
    let now = Instant::now();
    for record in rt.vault().list()? {
        let Some(fd) = record.fd else { continue };
        if record.key == LISTENER {
            listener = Some(fd);
        } else if let Some(hex) = record.key.strip_prefix(CONN) {
            let id = u64::from_str_radix(hex, 16)?;
            let kept: Kept = serde_json::from_value(record.value)?;
            let o = sockinfo::offsets(fd.as_fd()).unwrap_or(sockinfo::Offsets {
                consumed: 0,
                written: 0,
            });
            let io = Io {
                discarded: o.consumed,
                sent: o.written,
                rx_mark: o.consumed,
                tx_mark: o.written,
                rb: kept.rb,
                tb: kept.tb,
            };
            let entry = Entry::new(fd, io, 0);
            let state = State::Restored(now);
            table.conns.insert(id, Slot { entry, kept, state });
        }
    }
    let listener = match listener {
        Some(l) => l,
        None => {
            let l = std::net::TcpListener::bind(("127.0.0.1", config.port))?;
            let fd = OwnedFd::from(l);
            rustix::net::listen(&fd, config.backlog)?;
            rt.vault()
                .put(LISTENER, serde_json::Value::Null, Some(fd.as_fd()))?;
            fd
        }
    };
    rustix::fs::fcntl_setfl(&listener, rustix::fs::OFlags::NONBLOCK)?;
    Ok((listener, table))
}

fn main() {
    kintsugi_runtime::run(|rt| {
        let config: Config = rt.config()?;
        if rt.arena().is_none() {
            anyhow::bail!("netd needs an arena (arena_kib) for its connection ids");
        }
        let (listener, table) = restore(rt, &config)?;
        let port = rustix::net::getsockname(&listener)
            .ok()
            .and_then(|a| std::net::SocketAddr::try_from(a).ok())
            .map_or(0, |a| a.port());
        rt.counter("port")?.set(u64::from(port));
        rt.counter("restored")?.set(table.conns.len() as u64);
        tracing::debug!(port, restored = table.conns.len(), "netd ready");
        let netd = Arc::new(Netd {
            rt: rt.clone(),
            listener,
            tracking: config.tracking,
            table: Mutex::new(table),
        });
        let reaper = Arc::downgrade(&netd);
        std::thread::Builder::new()
            .name("reaper".into())
            .spawn(move || loop {
                std::thread::sleep(Duration::from_millis(250));
                match reaper.upgrade() {
                    Some(n) => n.reap(),
                    None => return,
                }
            })?;
        Ok(Incarnation::serve(vec![net::service(netd)]))
    })
}

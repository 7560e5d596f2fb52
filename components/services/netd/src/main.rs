//! netd: the network daemon. It owns a TCP listener on 127.0.0.1 and the
//! connections it accepts, serving them over the `net` interface.
//!
//! The state vault holds the listener and every accepted socket (posted
//! without waiting, many connections to a message: `owed`), so a crash of
//! netd loses no connection: the next incarnation takes them back from the
//! vault and learns each stream's offsets from the kernel (`sockinfo`). A
//! socket accepted but not yet posted survives in the keeper, a process
//! sharing netd's descriptor table (`keeper`), named in netd's arena
//! (`owed`). Clients pass
//! their stream offsets with every call, so a re-issued call neither loses
//! nor repeats a byte:
//!
//! - `recv(seen, keep)` first discards what lies before the client's first
//!   unanswered request (`keep`) and then reads with `MSG_PEEK` from `seen`:
//!   bytes leave the kernel only once a later call confirms that the client
//!   answered the request they belong to.
//! - `send(at)` skips the bytes of `data` the kernel already has.
//!
//! A connection is handed to one worker thread of one client at a time. A
//! worker does not wait on a connection that sends nothing: `recv` waits
//! at most `wait_us`, and the worker then parks the connection, giving it
//! back to netd, which watches it (epoll) and hands it out again from
//! `accept` once it has bytes the client has not seen (or the peer
//! closed), with offsets rebased to the start of its unanswered request;
//! a parked connection silent for the client's idle time is closed. Idle
//! and slow connections therefore hold no worker (`watch`, `table`). One
//! `accept` thread at a time waits on the listener and the parked
//! connections; the others wait for it to hand over that role or a ready
//! connection, so a new connection wakes one thread (leader/followers).
//!
//! Conn ids come from a counter in netd's durable arena, so they grow
//! across reboots; an `accept` re-issued after a reboot first gets the
//! connection a dead incarnation accepted for that worker but never
//! reported (an id above the worker's `last`). When a client dies, its
//! connections are handed to its successor's workers like parked ones,
//! rebased to the `keep` of the dead one's last `recv` (its first
//! unanswered request), so the successor serves that request again and its
//! response skips what the kernel already took. A call of the dead
//! incarnation still in flight finds the connection handed over and
//! touches nothing.
//!
//! With `tracking = false` (for comparison), netd keeps nothing in the vault
//! and reads without `MSG_PEEK`: what recovery costs, turned off. Bytes a
//! client has read are then gone from the kernel, so a connection can be
//! parked only between requests.

#![deny(unsafe_code)]

mod conn;
#[allow(unsafe_code)] // each block has a SAFETY comment (README: unsafe)
mod keeper;
mod marks;
mod owed;
mod pages;
#[allow(unsafe_code)] // each block has a SAFETY comment (README: unsafe)
mod sockinfo;
mod table;
mod watch;

use std::collections::HashSet;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::Context;
use kintsugi_interfaces::net::{self, Error};
use kintsugi_runtime::vault::{Vault, VaultOp};
use kintsugi_runtime::{Caller, Incarnation, Runtime, Sysno};
use rustix::net::{RecvFlags, SendFlags, Shutdown};
use serde::Deserialize;

use conn::{Entry, Holder, Io, Kept, Slot, State};
use marks::Marks;
use owed::{Owed, Unposted};
use pages::Pages;
use table::Table;
use watch::{Event, Watch};

/// Offsets in netd's arena: the connection id counter; the flag set while
/// an accepted connection may not be in the vault yet, and the client it
/// is for; the keeper of the incarnation (`keeper.rs`: pid, start time);
/// the connection being accepted: its id, worker, and descriptor number
/// plus one once the kernel has given it (see [`just_accepted`]).
const ARENA_NEXT_ID: usize = 0;
const ARENA_ACCEPTING: usize = 8;
const ARENA_ACCEPT_CLIENT: usize = 16;
const ARENA_KEEPER_PID: usize = 24;
const ARENA_KEEPER_START: usize = 32;
const ARENA_ACCEPT_ID: usize = 40;
const ARENA_ACCEPT_WORKER: usize = 48;
const ARENA_ACCEPTED_FD: usize = 56;
/// Vault key of the listening socket.
const LISTENER: &str = "listen";
/// Vault key prefix of connections.
const CONN: &str = "c/";
/// How long the leading `accept` thread waits on the watch before it looks
/// at deaths and idle times again.
const POLL: Duration = Duration::from_millis(20);
/// How long a following `accept` thread sleeps between looks (it is woken
/// when there is something for it).
const FOLLOW: Duration = Duration::from_millis(100);
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
    /// Connections owed to the vault before a post (1..=64); those owed
    /// are held by netd's keeper meanwhile (`keeper.rs`).
    #[serde(default = "post_every")]
    post_every: usize,
}

fn post_every() -> usize {
    owed::FLUSH_AT
}

fn yes() -> bool {
    true
}

fn backlog() -> i32 {
    1024
}

struct Netd {
    rt: Arc<Runtime>,
    listener: OwnedFd,
    tracking: bool,
    table: Mutex<Table>,
    /// Wakes `accept` threads waiting for a ready connection or the lead.
    wake: Condvar,
    watch: Watch,
    /// mm's pages, if netd uses mm: bodies sent without a copy.
    pages: Option<Pages>,
    /// Records the vault is owed (`owed`): posted many to a message.
    owed: Mutex<Owed>,
    /// Each connection's marks, kept for a successor of a dead system.
    marks: Marks,
}

fn io_error(e: rustix::io::Errno) -> Error {
    match e {
        rustix::io::Errno::AGAIN => Error::Again,
        e => {
            tracing::debug!("socket: {e}");
            Error::Closed
        }
    }
}

impl Netd {
    fn vault(&self) -> &Vault {
        self.rt.vault()
    }

    fn arena(&self) -> &kintsugi_runtime::abi::shm::Region {
        self.rt.arena().expect("checked at start")
    }

    /// Posts `ops` to the vault, after what it is owed (`owed`).
    fn post(&self, ops: Vec<VaultOp>, fd: Option<&OwnedFd>) {
        if self.tracking {
            self.post_owing(self.owed.lock().unwrap(), ops, fd);
        }
    }

    /// [`Netd::post`] under the lock of what is owed, held until the post
    /// is made: posts reach the vault in the order they are made.
    fn post_owing(&self, mut owed: MutexGuard<'_, Owed>, ops: Vec<VaultOp>, fd: Option<&OwnedFd>) {
        let mut due = owed.take();
        let fds: Vec<_> = (due.sockets.iter().map(|e| e.fd.as_fd()))
            .chain(fd.map(|f| f.as_fd()))
            .collect();
        let mut all = std::mem::take(&mut due.ops);
        all.extend(ops);
        if !all.is_empty() {
            if let Err(e) = self.vault().post(all, &fds) {
                tracing::warn!("vault: {e}");
            }
        }
        owed.posted(self.arena(), &due);
    }

    /// Posts what the vault is owed if enough is.
    fn post_if_full(&self) {
        let owed = self.owed.lock().unwrap();
        if owed.full() {
            self.post_owing(owed, Vec::new(), None);
        }
    }

    /// The vault forgets connection `id` with a later post. Meanwhile the
    /// vault holds the socket open (netd has shut it down): a crash in
    /// between restores it, and the new incarnation's reaper closes it as
    /// unclaimed.
    fn forget(&self, id: u64) {
        if self.tracking {
            self.owed.lock().unwrap().ended(id);
            self.post_if_full();
        }
    }

    /// The vault is owed connection `id`'s first record, just accepted.
    fn owe(&self, id: u64, kept: Kept, entry: &Arc<Entry>) {
        if !self.tracking {
            return;
        }
        let named = (self.owed.lock().unwrap()).accepted(self.arena(), id, kept, entry);
        if named {
            self.post_if_full();
        } else {
            self.post(vec![put(id, kept, true)], Some(&entry.fd));
        }
    }

    fn keep(&self, id: u64, kept: Kept, fd: Option<&OwnedFd>) {
        self.post(vec![put(id, kept, fd.is_some())], fd);
    }

    /// A new connection id: ids grow across reboots (the counter is in the arena).
    fn next_id(&self) -> u64 {
        self.arena()
            .at::<AtomicU64>(ARENA_NEXT_ID)
            .fetch_add(1, Ordering::SeqCst)
            + 1
    }

    /// Set while connection `id` for `worker` of `client` may be accepted
    /// and not yet be in the vault; an incarnation that finds it set takes
    /// the connection from its predecessor's keeper, and a keeper that
    /// finds it set as the supervisor dies posts it ([`just_accepted`]).
    fn accepting(&self, accept: Option<(u64, u32, u32)>) {
        let word = |at: usize| self.arena().at::<AtomicU64>(at);
        match accept {
            Some((id, client, worker)) => {
                word(ARENA_ACCEPTED_FD).store(0, Ordering::SeqCst);
                word(ARENA_ACCEPT_ID).store(id, Ordering::SeqCst);
                word(ARENA_ACCEPT_CLIENT).store(u64::from(client), Ordering::SeqCst);
                word(ARENA_ACCEPT_WORKER).store(u64::from(worker), Ordering::SeqCst);
                word(ARENA_ACCEPTING).store(1, Ordering::SeqCst);
            }
            None => {
                word(ARENA_ACCEPTING).store(0, Ordering::SeqCst);
                word(ARENA_ACCEPTED_FD).store(0, Ordering::SeqCst);
            }
        }
    }

    /// A connection, and how many deaths of the caller's component netd
    /// knows of. A connection restored from the vault is claimed by the
    /// first call its client makes on it: a client whose `adopt` made the
    /// descriptor without a call (`named_by`) as this netd came up has not
    /// re-adopted it.
    fn entry(&self, caller: &Caller, id: u64) -> Result<(Arc<Entry>, u64), Error> {
        let mut t = self.table.lock().unwrap();
        let deaths = t.deaths_of(caller.component);
        let slot = t.conns.get(&id).ok_or(Error::NotFound)?;
        let entry = slot.entry.clone();
        if matches!(slot.state, State::Restored(_)) && slot.kept.holder.client() == caller.component
        {
            t.claim(id, &self.watch);
        }
        Ok((entry, deaths))
    }

    /// Ends a connection netd no longer hands out: unread bytes at close
    /// would make the kernel reset it (and drop the response still queued),
    /// so they are read first, and only then does the vault forget it, so
    /// that a crash in between never closes a socket with unread bytes.
    fn finish(&self, id: u64, entry: Arc<Entry>) {
        let _ = rustix::net::shutdown(&entry.fd, Shutdown::Write);
        let done = drained(&entry.fd);
        self.forget(id);
        if !done {
            let mut t = self.table.lock().unwrap();
            t.lingering.push((entry, Instant::now()));
        }
    }

    /// Closes connections restored from the vault that nobody claimed (their
    /// `close` died with the previous incarnation), and forgets lingering
    /// ones that drained.
    fn reap(&self) {
        let dead = {
            let mut t = self.table.lock().unwrap();
            t.lingering
                .retain(|(e, since)| since.elapsed() < UNCLAIMED && !drained(&e.fd));
            t.unclaimed(UNCLAIMED)
        };
        for (id, slot) in dead {
            tracing::debug!(id, "closing a connection nobody claimed");
            let _ = rustix::net::shutdown(&slot.entry.fd, Shutdown::Both);
            self.forget(id);
        }
        if !self.owed.lock().unwrap().is_empty() {
            self.post(Vec::new(), None);
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

    /// How many of the `len` bytes a send at the client's offset `at`
    /// carries the kernel already has (a call re-issued after a reboot).
    fn already_sent(
        &self,
        c: u64,
        e: &Entry,
        io: &mut Io,
        at: u64,
        len: usize,
    ) -> Result<usize, Error> {
        self.rebase(c, e, io);
        let start = io.tb + at;
        if start > io.sent {
            return Err(Error::Invalid);
        }
        Ok(((io.sent - start) as usize).min(len))
    }

    /// Reads the receive queue up to the client's `keep` (bytes of requests
    /// it has answered) and marks where its unanswered request begins.
    fn discard_to(
        &self,
        id: u64,
        e: &Entry,
        io: &mut Io,
        seen: u64,
        keep: u64,
    ) -> Result<(), Error> {
        let want = io.rb + keep;
        if keep > seen || want < io.discarded {
            return Err(Error::Invalid);
        }
        let mut scratch = [0u8; 4096];
        while io.discarded < want {
            let n = ((want - io.discarded) as usize).min(scratch.len());
            match rustix::net::recv(&e.fd, &mut scratch[..n], RecvFlags::DONTWAIT) {
                Ok((0, _)) => return Err(Error::Invalid),
                Ok((n, _)) => io.discarded += n as u64,
                Err(rustix::io::Errno::INTR) => {}
                // Bytes the client saw are queued: it claims more than it saw.
                Err(rustix::io::Errno::AGAIN) => return Err(Error::Invalid),
                Err(err) => return Err(io_error(err)),
            }
        }
        // Requests taken off the stream were answered whole: the next
        // response begins at what was sent. When none was (the first call
        // on a connection, or on one restored mid-response, where `sent`
        // holds part of the response being sent again), the marks stay.
        if io.discarded > io.rx_mark {
            io.rx_mark = io.discarded;
            io.tx_mark = io.sent;
        }
        self.marks.set(id, io.rx_mark, io.tx_mark);
        Ok(())
    }

    /// A thread leaves `accept` (with a connection, or because its caller
    /// died): if no other thread waits on the watch, a follower takes over.
    fn leave(&self, t: MutexGuard<'_, Table>) {
        let lead = !t.leading;
        drop(t);
        if lead {
            self.wake.notify_one();
        }
    }

    /// Waits on the watch as the leader, then sorts what woke it: watched
    /// connections with new bytes become ready (and a follower is woken for
    /// each), silent ones past their idle time are closed. True if a
    /// connection waits on the listener.
    fn lead(&self, mut t: MutexGuard<'_, Table>) -> (MutexGuard<'_, Table>, bool) {
        t.leading = true;
        drop(t);
        let events = self.watch.wait(POLL);
        let mut t = self.table.lock().unwrap();
        t.leading = false;
        let mut listener = false;
        for event in events {
            match event {
                Event::Listener => listener = true,
                Event::Conn { id, closed } => {
                    if t.woken(id, closed, &self.watch) {
                        self.wake.notify_one();
                    }
                }
            }
        }
        let expired = t.expired(&self.watch);
        if !expired.is_empty() {
            drop(t);
            for (id, slot) in expired {
                tracing::debug!(id, "closing a parked connection: idle");
                self.finish(id, slot.entry);
            }
            t = self.table.lock().unwrap();
        }
        (t, listener)
    }

    /// Accepts a connection for `worker` of `client`, owed to the vault
    /// (named in the arena) before anyone hears of it; none if there was
    /// none. Called under the table's lock, so the caller cannot be found
    /// dead meanwhile.
    fn accept_new(&self, t: &mut Table, client: u32, worker: u32, deaths: u64) -> Option<u64> {
        // An id is wasted when there was nothing to accept.
        let id = self.next_id();
        let kept = Kept {
            holder: Holder::Worker { client, worker },
            rb: 0,
            tb: 0,
        };
        // Between the kernel's accept and the arena's slot, a crash leaves
        // the socket in the keeper with only this flag, and its number once
        // stored, to tell of it.
        self.accepting(Some((id, client, worker)));
        let fd = match rustix::net::accept_with(&self.listener, rustix::net::SocketFlags::CLOEXEC) {
            Ok(fd) => {
                let number = fd.as_raw_fd() as u64 + 1;
                self.arena()
                    .at::<AtomicU64>(ARENA_ACCEPTED_FD)
                    .store(number, Ordering::SeqCst);
                fd
            }
            Err(e) => {
                self.accepting(None);
                if !matches!(e, rustix::io::Errno::AGAIN | rustix::io::Errno::INTR) {
                    tracing::warn!("accept: {e}");
                }
                return None;
            }
        };
        let _ = rustix::net::sockopt::set_tcp_nodelay(&fd, true);
        let entry = Entry::new(fd, Io::default(), deaths);
        self.owe(id, kept, &entry);
        self.accepting(None);
        let state = State::Delivered;
        t.conns.insert(id, Slot { entry, kept, state });
        if let Ok(c) = self.rt.counter("accepted") {
            c.add(1);
        }
        // Should the caller die before it hears of it, `client_died` finds
        // it delivered and hands it to the successor.
        Some(id)
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

/// True once the peer has closed its side (or the socket failed).
fn peer_closed(fd: &OwnedFd) -> bool {
    let mut fds = [rustix::event::PollFd::new(
        fd,
        rustix::event::PollFlags::RDHUP,
    )];
    let zero = rustix::time::Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    match rustix::event::poll(&mut fds, Some(&zero)) {
        Ok(_) => !fds[0].revents().is_empty(),
        Err(_) => true,
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
    conn_key_in(id, &mut [0; CONN_KEY_LEN]).to_string()
}

/// A connection's key's length: [`CONN`] and 16 hex digits.
const CONN_KEY_LEN: usize = CONN.len() + 16;

/// [`conn_key`] written into `buf`, allocating nothing (netd's keeper).
fn conn_key_in(id: u64, buf: &mut [u8; CONN_KEY_LEN]) -> &str {
    use std::io::Write;
    write!(&mut buf[..], "{CONN}{id:016x}").expect("fits its length");
    std::str::from_utf8(buf).expect("ASCII")
}

/// The vault operation that records connection `id`.
fn put(id: u64, kept: Kept, fd: bool) -> VaultOp {
    let value = serde_json::to_value(kept).expect("serializes");
    VaultOp::Put {
        key: conn_key(id),
        value,
        fd,
    }
}

/// Sets how long a blocking read of the socket waits, unless already set.
fn set_wait(fd: &OwnedFd, io: &mut Io, wait_us: u32) -> Result<(), Error> {
    if io.wait_us != wait_us {
        let d = Duration::from_micros(u64::from(wait_us));
        rustix::net::sockopt::set_socket_timeout(fd, rustix::net::sockopt::Timeout::Recv, Some(d))
            .map_err(io_error)?;
        io.wait_us = wait_us;
    }
    Ok(())
}

impl net::Server for Netd {
    fn acceptor(&self, _: &Caller, worker: u32) -> Result<u64, Error> {
        Ok(u64::from(worker))
    }

    fn accept(&self, caller: &Caller, a: u64, last: u64) -> Result<u64, Error> {
        let (client, worker) = (caller.component, a as u32);
        let mut t = self.table.lock().unwrap();
        t.last.insert((client, worker), last);
        let deaths = t.deaths_of(client);
        loop {
            if t.deaths_of(client) != deaths {
                // Its caller is gone: another thread takes over the lead.
                self.leave(t);
                return Err(Error::Closed);
            }
            if let Some(id) = t.unreported(client, worker, last) {
                self.leave(t);
                return Ok(id);
            }
            if let Some(id) = t.take_ready(client) {
                let kept = t.deliver(id, client, worker);
                self.leave(t);
                self.keep(id, kept, None);
                return Ok(id);
            }
            if t.leading {
                t = self.wake.wait_timeout(t, FOLLOW).unwrap().0;
                continue;
            }
            let listener;
            (t, listener) = self.lead(t);
            if listener && t.deaths_of(client) == deaths {
                if let Some(id) = self.accept_new(&mut t, client, worker, deaths) {
                    self.leave(t);
                    return Ok(id);
                }
            }
        }
    }

    fn adopt(&self, _: &Caller, id: u64) -> Result<u64, Error> {
        let mut t = self.table.lock().unwrap();
        if !t.claim(id, &self.watch) {
            return Err(Error::NotFound);
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
        wait_us: u32,
        out: &mut [u8],
    ) -> Result<usize, Error> {
        let (e, deaths) = self.entry(caller, c)?;
        let mut io = e.io(deaths)?;
        self.rebase(c, &e, &mut io);
        set_wait(&e.fd, &mut io, wait_us)?;
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
        self.discard_to(c, &e, &mut io, seen, keep)?;
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
        // Waits for a byte past `skip`, then takes what is there. Fewer:
        // the stream ended, or the wait did.
        if peek(&e.fd, &mut queued[..skip + 1], RecvFlags::WAITALL)? <= skip {
            return if peer_closed(&e.fd) {
                Ok(0)
            } else {
                Err(Error::Again)
            };
        }
        let n = peek(&e.fd, &mut queued, RecvFlags::DONTWAIT)?;
        out[..n - skip].copy_from_slice(&queued[skip..n]);
        Ok(n - skip)
    }

    fn send(&self, caller: &Caller, c: u64, at: u64, data: &[u8]) -> Result<u32, Error> {
        let (e, deaths) = self.entry(caller, c)?;
        let mut io = e.io(deaths)?;
        let mut done = self.already_sent(c, &e, &mut io, at, data.len())?;
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

    fn send_page(
        &self,
        caller: &Caller,
        c: u64,
        at: u64,
        head: &[u8],
        page: u64,
        offset: u32,
        total: u32,
    ) -> Result<u32, Error> {
        let pages = self.pages.as_ref().ok_or(Error::Invalid)?;
        let body = (total as usize)
            .checked_sub(head.len())
            .ok_or(Error::Invalid)?;
        let (e, deaths) = self.entry(caller, c)?;
        let mut io = e.io(deaths)?;
        let done = self.already_sent(c, &e, &mut io, at, total as usize)?;
        let body = (page, offset as usize, body);
        let caller = caller.component;
        pages.send(caller, &e.fd, head, body, done, |n| io.sent += n as u64)?;
        Ok(total)
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

    fn park(
        &self,
        caller: &Caller,
        c: u64,
        seen: u64,
        keep: u64,
        idle_ms: u32,
    ) -> Result<(), Error> {
        let (e, deaths) = self.entry(caller, c)?;
        let (kept, skip) = {
            let mut io = e.io(deaths)?;
            self.rebase(c, &e, &mut io);
            if self.tracking {
                self.discard_to(c, &e, &mut io, seen, keep)?;
            } else if seen != keep {
                // The bytes it saw are gone from the kernel.
                return Err(Error::Invalid);
            }
            let skip = seen - keep;
            if skip > MAX_UNANSWERED as u64 {
                return Err(Error::Invalid);
            }
            // Its next holder starts at the unanswered request.
            io.rb = io.rx_mark;
            io.tb = io.sent;
            let mut t = self.table.lock().unwrap();
            let slot = t.conns.get_mut(&c).ok_or(Error::NotFound)?;
            slot.kept = Kept {
                holder: Holder::Parked {
                    client: caller.component,
                    idle_ms,
                },
                rb: io.rb,
                tb: io.tb,
            };
            (slot.kept, skip)
        };
        self.keep(c, kept, None);
        let mut t = self.table.lock().unwrap();
        if t.watch_or_ready(c, skip, false, &self.watch) {
            drop(t);
            self.wake.notify_one();
        }
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
        self.finish(c, slot.entry);
        Ok(())
    }

    fn finish(&self, caller: &Caller, c: u64, at: u64, data: &[u8]) -> Result<(), Error> {
        self.send(caller, c, at, data)?;
        self.close(caller, c)
    }

    fn finish_page(
        &self,
        caller: &Caller,
        c: u64,
        at: u64,
        head: &[u8],
        page: u64,
        offset: u32,
        total: u32,
    ) -> Result<(), Error> {
        self.send_page(caller, c, at, head, page, offset, total)?;
        self.close(caller, c)
    }

    fn client_died(&self, client: u32) {
        self.table.lock().unwrap().client_died(client, &self.watch);
        // Its threads waiting in `accept` return; orphans with bytes are ready.
        self.wake.notify_all();
    }
}

/// Takes over from the previous incarnation's keeper, and forks this one's.
/// The connections the previous incarnation accepted and had not yet
/// posted to the vault (`owed`) are in its keeper's descriptor table,
/// named in the arena: taken from there as if the vault had kept them
/// (counted in `kept_unposted`). If it died between the kernel's accept and
/// the arena's slot, the connection it accepted is taken too, as a parked
/// connection of the client it was for (counted in `kept_in_accept`).
fn keep_descriptors(
    rt: &Arc<Runtime>,
    listener: &OwnedFd,
    table: &mut Table,
    watch: &Watch,
    port: u16,
    marks: &Marks,
) -> anyhow::Result<()> {
    let arena = rt.arena().expect("checked at start");
    let slot = |at: usize| arena.at::<AtomicU64>(at);
    let died_accepting = slot(ARENA_ACCEPTING).swap(0, Ordering::SeqCst) != 0;
    let unposted = owed::left_behind(arena);
    let previous = keeper::Keeper::unpack(
        slot(ARENA_KEEPER_PID).load(Ordering::SeqCst),
        slot(ARENA_KEEPER_START).load(Ordering::SeqCst),
    );
    // Killed when dropped, once its descriptors are taken.
    if let Some(dying) = previous.and_then(keeper::Keeper::open) {
        let mut taken = 0;
        for u in unposted {
            if table.conns.contains_key(&u.id) {
                continue; // posted after all: the vault had it
            }
            if let Some(fd) = dying.get(u.fd, u.inode, port) {
                restore_unposted(rt, table, u, fd, marks);
                taken += 1;
            }
        }
        if taken > 0 {
            tracing::info!(
                "took {taken} connections not yet in the vault from the dead incarnation's keeper"
            );
        }
        rt.counter("kept_unposted")?.add(taken);
        if died_accepting {
            let known: HashSet<u64> = std::iter::once(listener.as_fd())
                .chain(table.conns.values().map(|s| s.entry.fd.as_fd()))
                .filter_map(keeper::inode)
                .collect();
            let client = slot(ARENA_ACCEPT_CLIENT).load(Ordering::SeqCst) as u32;
            for fd in dying.unknown(&known, port) {
                let id = slot(ARENA_NEXT_ID).fetch_add(1, Ordering::SeqCst) + 1;
                tracing::warn!(
                    id,
                    "took a connection accepted by a dead incarnation from its keeper"
                );
                adopt_kept(rt, table, watch, id, fd, client);
                rt.counter("kept_in_accept")?.add(1);
            }
        }
    }
    keeper::die_with_stop()?;
    let supervisor = rustix::process::getppid().context("netd has no parent")?;
    let last_words = {
        let rt = rt.clone();
        move || keeper::post_unposted(rt.vault(), rt.arena().expect("checked at start"), port)
    };
    let (pid, start) = keeper::spawn(supervisor, last_words)?.pack();
    slot(ARENA_KEEPER_START).store(start, Ordering::SeqCst);
    slot(ARENA_KEEPER_PID).store(pid, Ordering::SeqCst);
    Ok(())
}

/// The connection the arena names as being accepted, once the kernel has
/// given its descriptor and before its slot in the arena (`owed`) names
/// it: what a keeper posts, with the slots' connections, as the supervisor
/// dies. Allocates nothing.
fn just_accepted(arena: &kintsugi_runtime::abi::shm::Region) -> Option<Unposted> {
    let word = |at: usize| arena.at::<AtomicU64>(at).load(Ordering::SeqCst);
    if word(ARENA_ACCEPTING) == 0 {
        return None;
    }
    let fd = i32::try_from(word(ARENA_ACCEPTED_FD).checked_sub(1)?).ok()?;
    let id = word(ARENA_ACCEPT_ID);
    if id == 0 || owed::named(arena).any(|u| u.id == id) {
        return None; // none accepted, or named by its slot already
    }
    Some(Unposted {
        id,
        client: u32::try_from(word(ARENA_ACCEPT_CLIENT)).ok()?,
        worker: u32::try_from(word(ARENA_ACCEPT_WORKER)).ok()?,
        fd,
        inode: 0,
    })
}

/// A connection the previous incarnation accepted for a worker and had not
/// posted, restored as one from the vault is (and posted now).
fn restore_unposted(rt: &Arc<Runtime>, table: &mut Table, u: Unposted, fd: OwnedFd, marks: &Marks) {
    let kept = u.kept();
    if let Err(e) = rt.vault().post(vec![put(u.id, kept, true)], &[fd.as_fd()]) {
        tracing::warn!("vault: {e}");
    }
    let slot = restored(u.id, fd, kept, Instant::now(), marks);
    table.conns.insert(u.id, slot);
}

/// A connection nobody has heard of, into the vault and the watch, for
/// `client`'s next `accept`.
fn adopt_kept(
    rt: &Arc<Runtime>,
    table: &mut Table,
    watch: &Watch,
    id: u64,
    fd: OwnedFd,
    client: u32,
) {
    let kept = Kept {
        holder: Holder::Parked {
            client,
            idle_ms: table::ORPHAN_IDLE_MS,
        },
        rb: 0,
        tb: 0,
    };
    if let Err(e) = rt.vault().post(vec![put(id, kept, true)], &[fd.as_fd()]) {
        tracing::warn!("vault: {e}");
    }
    let _ = rustix::net::sockopt::set_tcp_nodelay(&fd, true);
    let entry = Entry::new(fd, Io::default(), 0);
    let state = State::Delivered;
    table.conns.insert(id, Slot { entry, kept, state });
    table.watch_or_ready(id, 0, false, watch);
}

/// The listener and connections the vault kept, or a new listener, and the
/// watch (with the parked connections in it, or ready).
fn restore(rt: &Arc<Runtime>, config: &Config) -> anyhow::Result<(OwnedFd, Table, Watch, Marks)> {
    let mut listener = None;
    let mut marks = None;
    let mut conns = Vec::new();
    let mut table = Table::default();
    let now = Instant::now();
    let mut parked = Vec::new();
    for record in rt.vault().list()? {
        let Some(fd) = record.fd else { continue };
        if record.key == LISTENER {
            listener = Some(fd);
        } else if record.key == marks::KEY {
            marks = Some(fd);
        } else if let Some(hex) = record.key.strip_prefix(CONN) {
            let read = u64::from_str_radix(hex, 16)
                .map_err(|e| e.to_string())
                .and_then(|id| {
                    serde_json::from_value::<Kept>(record.value)
                        .map(|kept| (id, kept))
                        .map_err(|e| e.to_string())
                });
            match read {
                Ok((id, kept)) => {
                    if let Holder::Parked { .. } = kept.holder {
                        parked.push(id);
                    }
                    conns.push((id, fd, kept));
                }
                // A record that does not read (a bit flipped in the vault
                // as it was kept) costs its connection, not netd's start.
                Err(e) => {
                    tracing::error!(
                        key = record.key,
                        "a connection's record does not read ({e}): closed"
                    );
                    rt.vault().delete(&record.key)?;
                }
            }
        }
    }
    let marks = Marks::open(rt, marks, config.tracking)?;
    for (id, fd, kept) in conns {
        table.conns.insert(id, restored(id, fd, kept, now, &marks));
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
    let watch = Watch::new(&listener)?;
    // What their client saw is not known: any byte makes them ready, and
    // the client parks them again if it is not enough.
    for id in parked {
        table.watch_or_ready(id, 0, false, &watch);
    }
    // A first incarnation that finds connections held by workers restores
    // a previous system's (a supervisor restarted by its keeper, README
    // "The keeper"), whose clients all start anew: each is handed out as
    // a dead client's, at the start of its unanswered request.
    if rt.epoch() == 1 {
        let clients: HashSet<u32> = table
            .conns
            .values()
            .filter_map(|s| match s.kept.holder {
                Holder::Worker { client, .. } => Some(client),
                Holder::Parked { .. } => None,
            })
            .collect();
        for client in clients {
            table.client_died(client, &watch);
        }
    }
    Ok((listener, table, watch, marks))
}

/// A connection a previous incarnation held, restored: its stream offsets
/// from the kernel, its holder's where `kept` says they start, and where
/// the response to its unread request began as `marks` say (else: where
/// the kernel's bytes end).
fn restored(id: u64, fd: OwnedFd, kept: Kept, now: Instant, marks: &Marks) -> Slot {
    let o = sockinfo::offsets(fd.as_fd()).unwrap_or(sockinfo::Offsets {
        consumed: 0,
        written: 0,
    });
    let tx_mark = marks
        .sent_mark(id, o.consumed)
        .filter(|&m| m <= o.written)
        .unwrap_or(o.written);
    let io = Io {
        discarded: o.consumed,
        sent: o.written,
        rx_mark: o.consumed,
        tx_mark,
        rb: kept.rb,
        tb: kept.tb,
        wait_us: 0,
    };
    let entry = Entry::new(fd, io, 0);
    let state = State::Restored(now);
    Slot { entry, kept, state }
}

/// What netd calls beyond the runtime's list: its listener, the
/// connections it accepts, and (its keeper) a dead incarnation's
/// descriptors.
const SYSCALLS: &[Sysno] = &[
    Sysno::socket,
    Sysno::bind,
    Sysno::listen,
    Sysno::accept4,
    Sysno::setsockopt,
    Sysno::getsockopt,
    Sysno::getsockname,
    Sysno::getpeername,
    Sysno::shutdown,
    Sysno::pidfd_getfd,
];

fn main() {
    kintsugi_runtime::run_allowing(SYSCALLS, |rt| {
        let config: Config = rt.config()?;
        if rt.arena().is_none_or(|a| a.len() < owed::ARENA_BYTES) {
            anyhow::bail!(
                "netd needs an arena (arena_kib) of at least {} bytes, for its connection ids and the connections not yet in the vault",
                owed::ARENA_BYTES
            );
        }
        if !(1..=owed::SLOTS).contains(&config.post_every) {
            anyhow::bail!(
                "netd: post_every {} is out of range (1..={})",
                config.post_every,
                owed::SLOTS
            );
        }
        let (listener, table, watch, marks) = restore(rt, &config)?;
        // New ids above every restored one: an arena begun anew (a system
        // restarted by the supervisor's keeper) would count from 0.
        if let (Some(arena), Some(&max)) = (rt.arena(), table.conns.keys().max()) {
            arena
                .at::<AtomicU64>(ARENA_NEXT_ID)
                .fetch_max(max, Ordering::SeqCst);
        }
        let port = rustix::net::getsockname(&listener)
            .ok()
            .and_then(|a| std::net::SocketAddr::try_from(a).ok())
            .map_or(0, |a| a.port());
        rt.counter("port")?.set(u64::from(port));
        rt.counter("restored")?.set(table.conns.len() as u64);
        let mut table = table;
        keep_descriptors(rt, &listener, &mut table, &watch, port, &marks)?;
        tracing::debug!(port, restored = table.conns.len(), "netd ready");
        let netd = Arc::new(Netd {
            rt: rt.clone(),
            listener,
            tracking: config.tracking,
            table: Mutex::new(table),
            wake: Condvar::new(),
            watch,
            pages: Pages::connect(rt)?,
            owed: Mutex::new(Owed::posting_every(config.post_every)),
            marks,
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

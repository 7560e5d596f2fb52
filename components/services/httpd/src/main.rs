//! httpd: an HTTP/1.1 server of static files, built of components.
//!
//! Every request crosses several of them: netd (accept, recv, send,
//! and `finish` for the last bytes of a response that closes the
//! connection: the connection itself; a cached file's response is one
//! `send_page`/`finish_page`, which netd sends from the file's mm page
//! without a copy, see `cache.rs`), ramfs (`stat`, and open/read/close when a
//! file is not cached; a stat and a cached file are kept while the change
//! counters ramfs publishes say they are current, so a cached file costs no
//! call), lock (the file cache is shared by the workers under
//! a lock of the lock server, which httpd holds by lease: its workers pass
//! it among themselves without a call until another component wants it), mm (cached files lie in pages granted by mm
//! and mapped here), evt (the access log: a worker that queues the first
//! line of a batch triggers an event the log writer waits on, which appends
//! the batch to a log file in ramfs, at most every `log_every_ms`) and timer (a periodic timer drives the
//! send timeout: a peer that does not take a response's bytes within
//! `idle_ms` is disconnected). Each worker thread serves one connection at
//! a time, and only while it has bytes: a worker waits at most `linger_us`
//! for a connection's next bytes, then parks it with netd (`net.park`),
//! which hands it out again once more bytes arrive and closes it when it
//! stays silent for what is left of `idle_ms`. A request must arrive whole
//! within `idle_ms` of its first byte. So idle, slow and stalled
//! connections hold no worker. The system gives each edge a channel slot
//! per thread. Requests served are counted in counter `requests`; those
//! netd sent from a page in `sent_from_pages`, and pages netd refused (so
//! the response was copied) in `pages_refused`.
//!
//! With `docroot` set, the first incarnation copies that directory into
//! ramfs under `/www` (and marks it done), so later incarnations and a crash
//! during the copy find it complete.

#![forbid(unsafe_code)]

mod cache;
mod http;

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use kintsugi_interfaces::fs_changes::NAMES;
use kintsugi_interfaces::lock_lease::{Leased, Leases};
use kintsugi_interfaces::mm_map::Mapper;
use kintsugi_interfaces::{evt, fs, fs_flags, lock, mm, net, timer};
use kintsugi_runtime::client::Changes;
use kintsugi_runtime::{CallError, Incarnation, Runtime};
use serde::Deserialize;

use cache::{CachePage, Cached};
use http::{Method, Parse};

/// Where the document root lives in ramfs.
const ROOT: &str = "/www";
/// Written once the document root is complete in ramfs.
const LOADED: &str = "/www.loaded";
/// The access log in ramfs; emptied when it passes `LOG_MAX`.
const LOG: &str = "/access.log";
const LOG_MAX: u64 = 4 << 20;
/// Largest chunk of a file read from ramfs or sent to netd at once.
const CHUNK: usize = 65536;
/// Largest file cached (what one grant of mm may hold: 256 pages).
const CACHE_MAX: u64 = 256 * 4096;

#[derive(Deserialize)]
struct Config {
    #[serde(default = "workers")]
    workers: u32,
    /// Connections idle this long, or whose request has not arrived whole
    /// this long after it began, are closed.
    #[serde(default = "idle_ms")]
    idle_ms: u64,
    /// How long a worker waits for a connection's next bytes before it
    /// parks the connection with netd (and serves others meanwhile).
    #[serde(default = "linger_us")]
    linger_us: u64,
    /// A host directory copied into ramfs at the first start.
    #[serde(default)]
    docroot: Option<String>,
    /// The name of the file cache's lock in the lock server.
    #[serde(default = "cache_lock")]
    cache_lock: u64,
    /// The name of the access log's event in the event server.
    #[serde(default = "log_event")]
    log_event: u64,
    /// The log writer appends at most this often: lines queued meanwhile
    /// join the batch without waking it again.
    #[serde(default = "log_every_ms")]
    log_every_ms: u64,
    /// Cached files are sent by netd from their mm pages (`net.send_page`),
    /// not copied to it; off, or netd without mm: copied.
    #[serde(default = "yes")]
    send_pages: bool,
}

fn yes() -> bool {
    true
}

fn workers() -> u32 {
    16
}

fn idle_ms() -> u64 {
    5000
}

fn linger_us() -> u64 {
    2000
}

fn cache_lock() -> u64 {
    0x6874_7470
}

fn log_every_ms() -> u64 {
    5
}

fn log_event() -> u64 {
    0x0068_7474_706c_6f67
}

/// A file found: its ramfs path, and its cached page if the response is
/// to be sent from it.
struct Found {
    path: String,
    page: Option<Cached>,
}

/// A stat of ramfs, current while ramfs publishes no change of the path's
/// names or of the file's contents since `when`.
struct Known {
    stat: fs::Stat,
    when: Changes,
}

/// Stats kept; all are forgotten when there would be more.
const KNOWN_MAX: usize = 4096;

/// The connection a worker is sending to, and since when.
type Waiting = Mutex<Option<(net::Conn, Instant)>>;

/// Parked connections with a request not yet whole kept before their
/// starts are pruned.
const PARTIAL_MAX: usize = 4096;

/// What a worker parks a connection with: where its request begins and
/// since when it has been arriving, if it has begun.
fn parked(r: &Reading) -> After {
    After::Park {
        keep: r.keep(),
        partial: (!r.buf.is_empty()).then_some(r.since),
    }
}

struct Httpd {
    rt: Arc<Runtime>,
    net: net::Client,
    fs: fs::Client,
    /// Stats by ramfs path, which spare a call to ramfs while current.
    known: Mutex<HashMap<String, Known>>,
    /// The file cache's lock in the lock server, by lease.
    cache_lock: Leased,
    /// Files by ramfs path; filled and read under `cache_lock`.
    cache: Mutex<HashMap<String, Cached>>,
    mm: &'static mm::Client,
    pages: Mapper<'static>,
    /// Whether netd sends bodies from cached pages (`net.send_page`); off
    /// for the incarnation once netd refuses one (it has no mm).
    send_pages: AtomicBool,
    events: evt::Client,
    log_event: evt::Evt,
    log_every: Duration,
    /// Access log lines not written yet.
    log: Mutex<Vec<u8>>,
    waiting: Vec<Waiting>,
    /// Since when parked connections' requests have been arriving, by id.
    partial: Mutex<HashMap<u64, Instant>>,
    idle: Duration,
    linger: Duration,
}

/// A connection's bytes not answered yet, and the clocks of its request.
struct Reading {
    c: net::Conn,
    /// What has arrived and is not answered yet, ending at stream offset `got`.
    buf: Vec<u8>,
    got: u64,
    /// Since when the connection is idle, or its current request has been
    /// arriving: a request must be complete within `idle` of it, however
    /// slowly its bytes trickle in (slowloris), or the connection is closed.
    since: Instant,
    /// Since when this worker waits for the connection's bytes: after
    /// `linger` it parks the connection rather than wait longer.
    held: Instant,
}

impl Reading {
    /// Where the first unanswered request begins.
    fn keep(&self) -> u64 {
        self.got - self.buf.len() as u64
    }
}

/// What a worker does with a connection it stops serving.
enum After {
    Close,
    /// Nothing: its last response closed it.
    Closed,
    /// Gives it back to netd until more bytes arrive; `partial`: since when
    /// the request not yet whole has been arriving.
    Park {
        keep: u64,
        partial: Option<Instant>,
    },
}

/// What waiting for a connection's next bytes gave.
enum More {
    Bytes,
    Ended,
    Park,
}

impl Httpd {
    /// Serves a connection's requests until it closes, or sends nothing
    /// for `linger` (then it is parked with netd).
    /// `body` is the worker's buffer for response bodies.
    fn serve_conn(
        &self,
        worker: usize,
        id: u64,
        c: net::Conn,
        body: &mut Vec<u8>,
    ) -> anyhow::Result<After> {
        let now = Instant::now();
        let since = self.partial.lock().unwrap().remove(&id).unwrap_or(now);
        let mut r = Reading {
            c,
            buf: Vec::new(),
            got: 0,
            since,
            held: now,
        };
        loop {
            let req = loop {
                let more = match http::parse(&r.buf) {
                    Parse::Partial => self.more(&mut r)?,
                    Parse::Done(req) => break req,
                    Parse::Fail(status) => {
                        let body = http::reason(status).as_bytes();
                        self.respond(worker, c, status, "text/plain", body, false, false)?;
                        return Ok(After::Closed);
                    }
                };
                match more {
                    More::Bytes => {}
                    More::Ended => return Ok(After::Close),
                    More::Park => return Ok(parked(&r)),
                }
            };
            let total = req.head_len + req.body as usize;
            while r.buf.len() < total {
                match self.more(&mut r)? {
                    More::Bytes => {}
                    More::Ended => return Ok(After::Close),
                    More::Park => return Ok(parked(&r)),
                }
            }
            r.buf.drain(..total);
            let status = self.answer(worker, c, &req, body)?;
            self.log(&req, status);
            self.count("requests");
            if !req.keep_alive {
                return Ok(After::Closed);
            }
            r.since = Instant::now();
            r.held = r.since;
        }
    }

    /// Responds to a whole request; its status. The file's contents are
    /// read into `body`, which the worker keeps from one request to the
    /// next (a new buffer per request cost a page fault per 4 KiB and a
    /// `memset` of the whole file: 7 % of all CPU with 1 MiB files).
    fn answer(
        &self,
        worker: usize,
        c: net::Conn,
        req: &http::Request,
        body: &mut Vec<u8>,
    ) -> anyhow::Result<u16> {
        let head_only = req.method == Method::Head;
        let keep_alive = req.keep_alive;
        let from_page = !head_only && self.send_pages.load(Ordering::Relaxed);
        let (status, ctype, page) = match req.method {
            Method::Other => (405, "text/plain", None),
            Method::Get | Method::Head => match self.file(&req.path, body, from_page)? {
                Some(f) => (200, http::content_type(&f.path), f.page),
                None => (404, "text/plain", None),
            },
        };
        if let Some(cached) = page {
            if self.answer_from_page(worker, c, ctype, &cached, keep_alive)? {
                return Ok(200);
            }
            // Refused: copied to netd instead.
            body.resize(cached.len as usize, 0);
            self.pages.read(cached.page.page, 0, body)?;
        }
        let sent = match status {
            200 => &body[..],
            _ => http::reason(status).as_bytes(),
        };
        self.respond(worker, c, status, ctype, sent, head_only, keep_alive)?;
        if body.capacity() as u64 > CACHE_MAX {
            *body = Vec::new(); // a file too large to cache: not kept
        }
        Ok(status)
    }

    /// Waits up to what is left of `linger` for the connection's next bytes.
    fn more(&self, r: &mut Reading) -> Result<More, CallError<net::Error>> {
        if r.since.elapsed() > self.idle {
            return Ok(More::Ended); // a request arriving too slowly
        }
        let Some(wait) = self.linger.checked_sub(r.held.elapsed()) else {
            return Ok(More::Park);
        };
        let wait_us = (wait.as_micros() as u32).max(1);
        match self.net.recv(r.c, r.keep(), CHUNK as u32, wait_us) {
            Ok(data) if data.is_empty() => Ok(More::Ended),
            Ok(data) => {
                r.got += data.len() as u64;
                r.buf.extend_from_slice(&data);
                Ok(More::Bytes)
            }
            Err(CallError::Server(net::Error::Again)) => Ok(More::Park),
            Err(e) => Err(e),
        }
    }

    /// Sends a response: its head and, unless `head_only`, the body; with
    /// its last bytes it closes the connection, unless `keep_alive`.
    #[allow(clippy::too_many_arguments)]
    fn respond(
        &self,
        worker: usize,
        c: net::Conn,
        status: u16,
        ctype: &str,
        body: &[u8],
        head_only: bool,
        keep_alive: bool,
    ) -> Result<(), CallError<net::Error>> {
        let mut first = http::head(status, ctype, body.len() as u64, keep_alive).into_bytes();
        let body = if head_only { &[][..] } else { body };
        let n = body.len().min(CHUNK - first.len());
        first.extend_from_slice(&body[..n]);
        let chunks = std::iter::once(&first[..]).chain(body[n..].chunks(CHUNK));
        let last = 1 + body[n..].len().div_ceil(CHUNK);
        for (i, chunk) in chunks.enumerate() {
            let end = i + 1 == last && !keep_alive;
            self.send(worker, c, chunk, end)?;
        }
        Ok(())
    }

    /// Answers a GET of a cached file from its page; false if netd refused
    /// the page twice (its alias renewed in between), or has no mm.
    fn answer_from_page(
        &self,
        worker: usize,
        c: net::Conn,
        ctype: &str,
        cached: &Cached,
        keep_alive: bool,
    ) -> Result<bool, CallError<net::Error>> {
        for _ in 0..2 {
            match self.respond_page(worker, c, ctype, cached, keep_alive) {
                Err(CallError::Server(e @ (net::Error::Invalid | net::Error::NotFound))) => {
                    if !self.refused_page(cached, e) {
                        return Ok(false);
                    }
                }
                sent => {
                    sent?;
                    self.count("sent_from_pages");
                    return Ok(true);
                }
            }
        }
        Ok(false)
    }

    /// Sends a whole response to a GET of a cached file: its head, and its
    /// body from the cached page, which netd sends without a copy through
    /// the channel (one call, whatever the size).
    fn respond_page(
        &self,
        worker: usize,
        c: net::Conn,
        ctype: &str,
        cached: &Cached,
        keep_alive: bool,
    ) -> Result<(), CallError<net::Error>> {
        let alias = (cached.page.alias()).ok_or(CallError::Server(net::Error::Invalid))?;
        let head = http::head(200, ctype, cached.len, keep_alive).into_bytes();
        let total = (head.len() as u64 + cached.len) as u32;
        self.sending(worker, c, || match keep_alive {
            true => self.net.send_page(c, &head, alias.0, 0, total).map(drop),
            false => self.net.finish_page(c, &head, alias.0, 0, total),
        })
    }

    /// netd sent nothing from `cached`'s page: it has no mm (`Invalid`:
    /// bodies are copied to it from now on), or not this alias (`NotFound`:
    /// mm revoked it when a netd died). Whether to try again: the page
    /// aliased anew for the netd of now.
    fn refused_page(&self, cached: &Cached, e: net::Error) -> bool {
        self.count("pages_refused");
        if e == net::Error::Invalid {
            tracing::warn!("netd sends no mm pages: responses are copied to it");
            self.send_pages.store(false, Ordering::Relaxed);
            return false;
        }
        let netd = self.net.connection().server_id();
        match cached.page.realias(netd) {
            Ok(_) => true,
            Err(e) => {
                tracing::debug!("aliasing cache page {:#x}: {e}", cached.page.page.0);
                false
            }
        }
    }

    /// Sends bytes (the last ones, closing the connection, if `end`).
    fn send(
        &self,
        worker: usize,
        c: net::Conn,
        data: &[u8],
        end: bool,
    ) -> Result<(), CallError<net::Error>> {
        self.sending(worker, c, || match end {
            true => self.net.finish(c, data),
            false => self.net.send(c, data).map(drop),
        })
    }

    /// Runs `send` with the connection in `worker`'s waiting slot for the
    /// reaper, which ends it if the peer does not take the bytes within
    /// `idle`.
    fn sending(
        &self,
        worker: usize,
        c: net::Conn,
        send: impl FnOnce() -> Result<(), CallError<net::Error>>,
    ) -> Result<(), CallError<net::Error>> {
        *self.waiting[worker].lock().unwrap() = Some((c, Instant::now()));
        let sent = send();
        *self.waiting[worker].lock().unwrap() = None;
        sent
    }

    /// The ramfs path of the file `path` names, and its cached page if
    /// `from_page` and netd may send from it; else its contents read into
    /// `body`. None if there is no such file.
    fn file(
        &self,
        path: &str,
        body: &mut Vec<u8>,
        from_page: bool,
    ) -> anyhow::Result<Option<Found>> {
        let mut at = format!("{ROOT}{path}");
        if at.ends_with('/') {
            at.push_str("index.html");
        }
        let mut stat = match self.stat(&at) {
            Ok(s) => s,
            Err(CallError::Server(fs::Error::NotFound | fs::Error::NotDir)) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        if stat.is_dir {
            at.push_str("/index.html");
            stat = match self.stat(&at) {
                Ok(s) if !s.is_dir => s,
                Ok(_) | Err(CallError::Server(fs::Error::NotFound)) => return Ok(None),
                Err(e) => return Err(e.into()),
            };
        }
        let held = self.cache_lock.take()?;
        let hit = self.cache.lock().unwrap().get(&at).cloned();
        let current = hit
            .as_ref()
            .filter(|c| c.len == stat.size && self.current(&c.when, &stat));
        let cached = match current {
            Some(c) if from_page && c.page.alias().is_some() => {
                let page = Some(c.clone());
                return Ok(Some(Found { path: at, page }));
            }
            Some(c) => {
                // Only the bytes past the buffer's last length are zeroed.
                body.resize(c.len as usize, 0);
                self.pages.read(c.page.page, 0, body).is_ok()
            }
            None => false,
        };
        drop(held);
        if cached {
            return Ok(Some(Found {
                path: at,
                page: None,
            }));
        }
        let when = self.fs.connection().changes();
        let data = match self.read(&at) {
            Ok(d) => d,
            Err(CallError::Server(fs::Error::NotFound)) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let held = self.cache_lock.take()?;
        let cached = self.cache(&at, &data, hit, when);
        drop(held);
        if let Err(e) = cached {
            tracing::debug!("not cached: {at}: {e}");
        }
        *body = data;
        Ok(Some(Found {
            path: at,
            page: None,
        }))
    }

    /// Puts `data` in a page of its own from mm, in place of `stale`.
    /// Called under `cache_lock`.
    fn cache(
        &self,
        at: &str,
        data: &[u8],
        stale: Option<Cached>,
        when: Changes,
    ) -> anyhow::Result<()> {
        if self.cache.lock().unwrap().get(at) != stale.as_ref() {
            return Ok(()); // another worker cached it meanwhile
        }
        if stale.is_some() {
            // Revoked once no worker sends from it any more.
            self.cache.lock().unwrap().remove(at);
        }
        if data.is_empty() || data.len() as u64 > CACHE_MAX {
            return Ok(());
        }
        let granted = self.mm.grant(data.len().div_ceil(4096) as u32)?;
        // Revoked on drop: also if what follows fails.
        let page = CachePage::new(self.mm, granted);
        self.pages.map(granted)?;
        self.pages.write(granted, 0, data)?;
        let netd = self.net.connection().server_id();
        if self.send_pages.load(Ordering::Relaxed) && netd != 0 {
            page.realias(netd)?;
        }
        let page = Arc::new(page);
        let len = data.len() as u64;
        self.cache
            .lock()
            .unwrap()
            .insert(at.to_string(), Cached { page, len, when });
        Ok(())
    }

    /// Whether ramfs has published no change since `when` of what `stat`
    /// depends on: the names, and the contents of the file it describes.
    fn current(&self, when: &Changes, stat: &fs::Stat) -> bool {
        let counters = [NAMES, stat.counter as usize];
        self.fs.connection().unchanged(when, &counters)
    }

    /// Stats `path` in ramfs, or answers from a stat still current.
    fn stat(&self, path: &str) -> Result<fs::Stat, CallError<fs::Error>> {
        if let Some(k) = self.known.lock().unwrap().get(path) {
            if self.current(&k.when, &k.stat) {
                return Ok(k.stat.clone());
            }
        }
        let when = self.fs.connection().changes();
        let stat = self.fs.stat(path)?;
        let mut known = self.known.lock().unwrap();
        if known.len() >= KNOWN_MAX {
            known.clear();
        }
        let k = Known {
            stat: stat.clone(),
            when,
        };
        known.insert(path.to_string(), k);
        Ok(stat)
    }

    /// Adds one to counter `name`.
    fn count(&self, name: &str) {
        if let Ok(n) = self.rt.counter(name) {
            n.add(1);
        }
    }

    /// Queues an access log line; the first line of a batch wakes the
    /// writer. A line the writer cannot keep up with is dropped.
    fn log(&self, req: &http::Request, status: u16) {
        let first = {
            let mut log = self.log.lock().unwrap();
            let first = log.is_empty();
            if (log.len() as u64) < LOG_MAX {
                // Escaped: a decoded `%0a` must not forge a line.
                let path = req.path.escape_default();
                let _ = writeln!(log, "\"{:?} {path}\" {status}", req.method);
            }
            first
        };
        if first {
            if let Err(e) = self.events.trigger(self.log_event) {
                tracing::warn!("access log event: {e}");
            }
        }
    }

    /// Appends each batch of queued lines to the access log in ramfs.
    fn write_log(&self) -> anyhow::Result<()> {
        let f = self.fs.open(LOG, fs_flags::CREATE)?;
        let mut size = self.fs.stat(LOG)?.size;
        self.fs.seek(f, size)?;
        loop {
            self.events.wait(self.log_event)?;
            // Lets the batch grow: one wake-up (an evt trigger and wait,
            // an fs write) per interval instead of per few requests.
            std::thread::sleep(self.log_every);
            let batch = std::mem::take(&mut *self.log.lock().unwrap());
            if size + batch.len() as u64 > LOG_MAX {
                self.fs.truncate(f, 0)?;
                size = self.fs.seek(f, 0)?;
            }
            for chunk in batch.chunks(CHUNK) {
                self.fs.write(f, chunk)?;
            }
            size += batch.len() as u64;
        }
    }

    fn read(&self, path: &str) -> Result<Vec<u8>, CallError<fs::Error>> {
        let f = self.fs.open(path, 0)?;
        let mut out = Vec::new();
        let read = loop {
            match self.fs.read(f, CHUNK as u32) {
                Ok(d) if d.is_empty() => break Ok(()),
                Ok(d) => out.extend_from_slice(&d),
                Err(e) => break Err(e),
            }
        };
        let _ = self.fs.close(f);
        read.map(|()| out)
    }

    /// A worker: takes connections from netd and serves them, one at a time.
    fn work(&self, worker: usize) {
        let acceptor = loop {
            match self.net.acceptor(worker as u32) {
                Ok(a) => break a,
                Err(e) => {
                    tracing::warn!("acceptor: {e}");
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        };
        let mut body = Vec::new();
        loop {
            let id = match self.net.accept(acceptor) {
                Ok(id) => id,
                Err(e) => {
                    tracing::debug!("accept: {e}");
                    continue;
                }
            };
            let c = match self.net.adopt(id) {
                Ok(c) => c,
                Err(e) => {
                    tracing::debug!("adopt {id}: {e}");
                    continue;
                }
            };
            let after = self
                .serve_conn(worker, id, c, &mut body)
                .unwrap_or_else(|e| {
                    tracing::debug!("connection {id}: {e:#}");
                    After::Close
                });
            match after {
                After::Closed => continue,
                After::Park { keep, partial } => match self.park(id, c, keep, partial) {
                    Ok(()) => continue,
                    // With netd's tracking off, only between requests.
                    Err(e) => tracing::debug!("park {id}: {e}"),
                },
                After::Close => {}
            }
            let _ = self.net.close(c);
        }
    }

    /// Parks a connection with netd for what is left of its idle time; a
    /// request not yet whole keeps its start for when it comes back.
    fn park(
        &self,
        id: u64,
        c: net::Conn,
        keep: u64,
        partial: Option<Instant>,
    ) -> Result<(), CallError<net::Error>> {
        let since = partial.unwrap_or_else(Instant::now);
        let left = self.idle.saturating_sub(since.elapsed());
        let idle_ms = (left.as_millis() as u32).max(1);
        if let Some(since) = partial {
            let mut starts = self.partial.lock().unwrap();
            // Connections netd closed while parked are forgotten here too.
            if starts.len() >= PARTIAL_MAX {
                starts.retain(|_, s| s.elapsed() <= self.idle);
            }
            starts.insert(id, since);
        }
        self.net.park(c, keep, idle_ms)
    }

    /// Ends connections whose peer has not taken a response's bytes for
    /// longer than `idle`, on a timer's ticks.
    fn reap_idle(&self, timers: &timer::Client) -> anyhow::Result<()> {
        let period = (self.idle.as_micros() as u64 / 4).max(1000);
        let tm = timers.create(period)?;
        timers.arm(tm, kintsugi_runtime::clock::monotonic_ns(), false)?;
        loop {
            timers.wait(tm)?;
            for w in &self.waiting {
                let w = w.lock().unwrap();
                if let Some((c, since)) = *w {
                    if since.elapsed() > self.idle {
                        let _ = self.net.shutdown(c);
                    }
                }
            }
        }
    }
}

/// Copies the document root into ramfs. Only regular files and
/// directories are copied: a symbolic link is followed only if what it
/// names lies inside the document root (a link to `/etc/shadow` is not an
/// escape), and dangling links, links that loop, FIFOs, sockets and devices
/// are skipped with a warning, as are files that cannot be read, so that
/// no docroot can keep httpd from starting.
fn load(fsc: &fs::Client, docroot: &Path) -> anyhow::Result<u64> {
    let root = docroot
        .canonicalize()
        .with_context(|| format!("docroot {}", docroot.display()))?;
    let mut visited = vec![root.clone()];
    load_dir(fsc, &root, &root, ROOT, &mut visited)
}

fn load_dir(
    fsc: &fs::Client,
    root: &Path,
    from: &Path,
    to: &str,
    visited: &mut Vec<std::path::PathBuf>,
) -> anyhow::Result<u64> {
    fsc.mkdir(to).or_else(|e| match e {
        CallError::Server(fs::Error::Exists) => Ok(()),
        e => Err(e),
    })?;
    let mut files = 0;
    let mut entries: Vec<_> = std::fs::read_dir(from)
        .with_context(|| format!("docroot {}", from.display()))?
        .collect::<Result<_, _>>()?;
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let name = e.file_name().to_string_lossy().into_owned();
        let at = format!("{to}/{name}");
        let path = e.path();
        // Where it leads, inside the root, and what it is there.
        let Some((real, meta)) = path
            .canonicalize()
            .ok()
            .filter(|real| real.starts_with(root))
            .and_then(|real| Some((real.clone(), std::fs::metadata(&real).ok()?)))
        else {
            tracing::warn!(
                "docroot: skipped {} (dangling, or outside the docroot)",
                path.display()
            );
            continue;
        };
        if meta.is_dir() {
            if visited.contains(&real) {
                tracing::warn!("docroot: skipped {} (a loop)", path.display());
                continue;
            }
            visited.push(real.clone());
            files += load_dir(fsc, root, &real, &at, visited)?;
            visited.pop();
        } else if meta.is_file() {
            let Ok(data) = std::fs::read(&real) else {
                tracing::warn!("docroot: skipped {} (unreadable)", path.display());
                continue;
            };
            let f = fsc.open(&at, fs_flags::CREATE | fs_flags::TRUNCATE)?;
            for chunk in data.chunks(CHUNK) {
                fsc.write(f, chunk)?;
            }
            fsc.close(f)?;
            files += 1;
        } else {
            tracing::warn!("docroot: skipped {} (not a regular file)", path.display());
        }
    }
    Ok(files)
}

fn main() {
    kintsugi_runtime::run(|rt| {
        let config: Config = rt.config()?;
        let rt = rt.clone();
        Ok(Incarnation::main(move || {
            let fsc = fs::Client::connect(&rt)?;
            if let Some(dir) = &config.docroot {
                if let Err(CallError::Server(fs::Error::NotFound)) = fsc.stat(LOADED) {
                    let n = load(&fsc, Path::new(dir))?;
                    fsc.close(fsc.open(LOADED, fs_flags::CREATE)?)?;
                    tracing::info!("loaded {n} files from {dir} into ramfs");
                }
            }
            let leases = Leases::new(lock::Client::connect(&rt)?)?;
            let cache_lock = leases.lease(leases.client().alloc(config.cache_lock)?);
            // One mm client for the incarnation's life, which its mapper
            // borrows with the runtime (whose vault lends the pages' memory).
            let mm: &'static mm::Client = Box::leak(Box::new(mm::Client::connect(&rt)?));
            let rt_static: &'static Runtime = Box::leak(Box::new(rt.clone()));
            let events = evt::Client::connect(&rt)?;
            let log_event = events.create(config.log_event)?;
            let httpd = Arc::new(Httpd {
                net: net::Client::connect(&rt)?,
                fs: fsc,
                known: Mutex::new(HashMap::new()),
                cache_lock,
                cache: Mutex::new(HashMap::new()),
                mm,
                pages: Mapper::new(mm, rt_static.vault()),
                send_pages: AtomicBool::new(config.send_pages),
                events,
                log_event,
                log_every: Duration::from_millis(config.log_every_ms),
                log: Mutex::new(Vec::new()),
                waiting: (0..config.workers).map(|_| Mutex::new(None)).collect(),
                partial: Mutex::new(HashMap::new()),
                idle: Duration::from_millis(config.idle_ms),
                linger: Duration::from_micros(config.linger_us),
                rt: rt.clone(),
            });
            for name in ["requests", "sent_from_pages", "pages_refused"] {
                rt.counter(name)?;
            }
            for w in 0..config.workers as usize {
                let h = httpd.clone();
                std::thread::Builder::new()
                    .name(format!("worker:{w}"))
                    .spawn(move || h.work(w))?;
            }
            let h = httpd.clone();
            std::thread::Builder::new()
                .name("log".into())
                .spawn(move || {
                    if let Err(e) = h.write_log() {
                        tracing::error!("access log: {e:#}");
                    }
                })?;
            let timers = timer::Client::connect(&rt)?;
            let h = httpd.clone();
            std::thread::Builder::new()
                .name("idle".into())
                .spawn(move || {
                    if let Err(e) = h.reap_idle(&timers) {
                        tracing::error!("idle timeouts: {e:#}");
                    }
                })?;
            while !rt.stop_requested() {
                std::thread::sleep(Duration::from_millis(50));
            }
            Ok(())
        }))
    })
}

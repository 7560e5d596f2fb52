//! The web server of systems/web.toml, end to end over real TCP: HTTP/1.1
//! behaviour, and zero failed requests with every body verified byte for
//! byte while netd, httpd and each system component httpd uses are crashed,
//! and `kintsugi bench web` run briefly.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;

/// The crash test and the benchmark each load the machine: one at a time.
static HEAVY: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn system() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../systems/web.toml")
}

/// A small deterministic generator for file contents and choices.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// A document root of files from 0 bytes to 10 MiB; returns (url path, contents).
fn docroot(dir: &Path, seed: u64) -> Vec<(String, Vec<u8>)> {
    let mut rng = Rng(seed | 1);
    let mut files = Vec::new();
    std::fs::create_dir_all(dir.join("sub")).unwrap();
    for (name, len) in [
        ("index.html", 120),
        ("empty.txt", 0),
        ("one.txt", 1),
        ("page.html", 4000),
        ("sub/mid.bin", 70_000),
        ("sub/big.bin", 300_000),
        ("sub/4k.bin", 4096),
        ("sub/64k.bin", 65536),
        ("sub/1m.bin", 1 << 20),
        // Larger than mm's pool (8 MiB): never cached, read from ramfs each time.
        ("sub/10m.bin", 10 << 20),
    ] {
        let data: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        std::fs::write(dir.join(name), &data).unwrap();
        files.push((format!("/{name}"), data));
    }
    files
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Starts the web system; returns once it accepts connections. Its roster
/// is in the directory above `root` (the test's own: `kintsugi status`
/// there names this system, not another test's).
#[allow(
    clippy::zombie_processes,
    reason = "returned to the caller, which waits for it; killed and waited for on a timeout"
)]
fn start(tag: &str, root: &Path, port: u16, extra: &[String]) -> Child {
    start_system(tag, &system(), root, port, extra)
}

/// [`start`] with another system file.
#[allow(
    clippy::zombie_processes,
    reason = "returned to the caller, which waits for it; killed and waited for on a timeout"
)]
fn start_system(tag: &str, system: &Path, root: &Path, port: u16, extra: &[String]) -> Child {
    let mut child = run_system(tag, system)
        .env("XDG_RUNTIME_DIR", root.parent().unwrap())
        .arg("--set")
        .arg(format!(
            "httpd.docroot={}",
            root.canonicalize().unwrap().display()
        ))
        .arg("--set")
        .arg(format!("netd.port={port}"))
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) {
            // Ready once the document root is loaded.
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            if request(&mut s, "GET", "/index.html", true).is_ok_and(|r| r.status == 200) {
                return child;
            }
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the web system did not start");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

struct Response {
    status: u16,
    head: String,
    body: Vec<u8>,
}

/// Reads one response; `head_only` for a HEAD request.
fn read_response(s: &mut TcpStream, head_only: bool) -> std::io::Result<Response> {
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        if s.read(&mut byte)? == 0 {
            return Err(std::io::Error::other(format!(
                "end of stream inside a response head: {:?}",
                String::from_utf8_lossy(&buf)
            )));
        }
        buf.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&buf).into_owned();
    let status = head
        .get(9..12)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("a malformed response head: {head:?}")))?;
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("Content-Length: "))
        .ok_or_else(|| std::io::Error::other("no Content-Length"))?
        .trim()
        .parse()
        .map_err(std::io::Error::other)?;
    let mut body = vec![0u8; if head_only { 0 } else { len }];
    s.read_exact(&mut body)?;
    Ok(Response { status, head, body })
}

fn request(s: &mut TcpStream, method: &str, path: &str, keep: bool) -> std::io::Result<Response> {
    let conn = if keep { "keep-alive" } else { "close" };
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: t\r\nConnection: {conn}\r\n\r\n"
    )?;
    read_response(s, method == "HEAD")
}

fn stop(child: Child) -> String {
    let _ = rustix::process::kill_process(
        rustix::process::Pid::from_child(&child),
        rustix::process::Signal::TERM,
    );
    let out = child.wait_with_output().unwrap();
    text(&out).0
}

#[test]
fn a_hostile_docroot_is_served_without_escape_or_crash_loop() {
    let tag = unique_tag("web-docroot");
    let dir = scratch("web-docroot");
    let www = dir.join("www");
    std::fs::create_dir_all(www.join("sub")).unwrap();
    std::fs::write(www.join("index.html"), b"home").unwrap();
    std::fs::write(www.join("sub/f.txt"), b"inside").unwrap();
    let link =
        |target: &str, name: &str| std::os::unix::fs::symlink(target, www.join(name)).unwrap();
    link("/nonexistent/x", "dangling");
    link("/etc/passwd", "outside");
    link("sub", "dirlink");
    link(".", "loop");
    let fifo = www.join("pipe");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(made.success(), "mkfifo");
    let port = free_port();
    let child = start(&tag, &www, port, &[]);
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    for (path, status, body) in [
        ("/index.html", 200, &b"home"[..]),
        ("/dirlink/f.txt", 200, b"inside"),
        ("/sub/f.txt", 200, b"inside"),
        ("/outside", 404, b"Not Found"),
        ("/dangling", 404, b"Not Found"),
        ("/pipe", 404, b"Not Found"),
        ("/loop/index.html", 404, b"Not Found"),
    ] {
        let r = request(&mut s, "GET", path, true).unwrap();
        assert_eq!((r.status, r.body.as_slice()), (status, body), "{path}");
    }
    let log = stop(child);
    assert!(crashes(&log, "httpd").is_empty(), "httpd crashed:\n{log}");
    assert!(leftovers(&tag).is_empty());
}

#[test]
fn requests_that_never_finish_arriving_do_not_freeze_the_server() {
    let tag = unique_tag("web-slow");
    let dir = scratch("web-slow");
    let files = docroot(&dir.join("www"), 11);
    let port = free_port();
    let idle = ["--set".to_string(), "httpd.idle_ms=500".to_string()];
    let child = start(&tag, &dir.join("www"), port, &idle);
    // More stalled requests than httpd has workers (16): heads that stop
    // short, and a body announced but never sent.
    let mut stalled: Vec<TcpStream> = (0..20)
        .map(|i| {
            let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
            let partial: &[u8] = match i % 2 {
                0 => b"GET / HTTP/1.1\r\nHost: x\r\n",
                _ => b"POST / HTTP/1.1\r\nContent-Length: 1000000\r\n\r\nabc",
            };
            s.write_all(partial).unwrap();
            s
        })
        .collect();
    // A normal client is answered: the stalled ones are ended `idle_ms`
    // after their requests began, however long they hold on.
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let r = request(&mut s, "GET", &files[2].0, false).unwrap();
    assert_eq!((r.status, &r.body), (200, &files[2].1));
    for (i, s) in stalled.iter_mut().enumerate() {
        let mut rest = Vec::new();
        assert!(
            s.read_to_end(&mut rest).is_ok(),
            "stalled request {i} was ended"
        );
        assert!(rest.is_empty(), "stalled request {i} got {rest:?}");
    }
    let log = stop(child);
    assert!(crashes(&log, "httpd").is_empty(), "httpd crashed:\n{log}");
    assert!(leftovers(&tag).is_empty());
}

/// Raises this process's descriptor limit (inherited by the system it
/// starts) to what the test needs, within the hard limit.
fn descriptors(need: u64) {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let mut l = getrlimit(Resource::Nofile);
    if l.current.is_some_and(|c| c < need) {
        l.current = Some(l.maximum.map_or(need, |m| m.min(need * 2)));
        setrlimit(Resource::Nofile, l).unwrap();
    }
    let now = getrlimit(Resource::Nofile).current;
    assert!(
        now.is_none_or(|c| c >= need),
        "descriptor limit {now:?} < {need}"
    );
}

/// Idle, slowloris and stalled connections, far more than httpd has
/// workers and held open, do not keep a normal client from being answered
/// within 1 s, before and across a crash of httpd; nor are they answered.
#[test]
fn idle_slow_and_stalled_clients_do_not_starve_a_normal_one() {
    let _heavy = HEAVY.lock().unwrap_or_else(|p| p.into_inner());
    descriptors(4000);
    let tag = unique_tag("web-hostile");
    let dir = scratch("web-hostile");
    let files = docroot(&dir.join("www"), 13);
    let port = free_port();
    // Long timeouts, so that none of them is ended during the test; one
    // crash of httpd, after they are all connected.
    let extra = [
        "--set",
        "httpd.idle_ms=60000",
        "--kill",
        "httpd",
        "--kills",
        "1",
        "--kill-every",
        "6000..6500",
        "--signals",
        "segv",
    ]
    .map(String::from);
    let child = start(&tag, &dir.join("www"), port, &extra);
    let connect = || {
        let s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_nonblocking(true).unwrap();
        s
    };
    let started = Instant::now();
    let idle: Vec<TcpStream> = (0..2000).map(|_| connect()).collect();
    let mut stalled: Vec<TcpStream> = (0..16).map(|_| connect()).collect();
    for (i, s) in stalled.iter_mut().enumerate() {
        let partial: &[u8] = match i % 2 {
            0 => b"GET / HTTP/1.1\r\nHost: x\r\n",
            _ => b"POST / HTTP/1.1\r\nContent-Length: 1000000\r\n\r\nabc",
        };
        s.write_all(partial).unwrap();
    }
    let mut slow: Vec<TcpStream> = (0..200).map(|_| connect()).collect();
    for s in &mut slow {
        s.write_all(b"GET / HTTP/1.1\r\n").unwrap();
    }
    eprintln!("2216 hostile connections open in {:?}", started.elapsed());
    // Slowloris: a header line on each connection every 200 ms, for ever.
    let done = Arc::new(AtomicBool::new(false));
    let trickle = {
        let done = done.clone();
        std::thread::spawn(move || {
            let mut n = 0u64;
            while !done.load(Ordering::SeqCst) {
                for s in &mut slow {
                    let _ = write!(s, "X-{n}: y\r\n");
                }
                n += 1;
                std::thread::sleep(Duration::from_millis(200));
            }
            slow
        })
    };
    // The normal client: a request on a new connection and two on a
    // kept-alive one, each answered within 1 s, until well past the crash.
    let mut slowest = Duration::ZERO;
    let mut served = 0;
    while started.elapsed() < Duration::from_secs(11) {
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        for (keep, (path, data)) in [(true, &files[3]), (true, &files[4]), (false, &files[0])] {
            let t = Instant::now();
            let r = request(&mut s, "GET", path, keep).unwrap();
            let took = t.elapsed();
            assert_eq!((r.status, &r.body), (200, data), "{path}");
            assert!(took < Duration::from_secs(1), "{path} took {took:?}");
            slowest = slowest.max(took);
            served += 1;
        }
    }
    done.store(true, Ordering::SeqCst);
    let slow = trickle.join().unwrap();
    // Still open, and unanswered.
    for s in idle.iter().chain(&stalled).chain(&slow) {
        let mut byte = [0u8; 1];
        let got = (&*s).read(&mut byte);
        assert!(
            got.as_ref()
                .is_err_and(|e| e.kind() == std::io::ErrorKind::WouldBlock),
            "a hostile connection got {got:?}"
        );
    }
    let log = stop(child);
    eprintln!("{served} requests, the slowest answered in {slowest:?}");
    assert_eq!(crashes(&log, "httpd").len(), 1, "{log}");
    assert!(leftovers(&tag).is_empty());
}

/// httpd's counter `name`, from `kintsugi status` of the system whose
/// roster is in `dir`.
fn counter(tag: &str, dir: &Path, component: &str, name: &str) -> u64 {
    let out = kintsugi(tag)
        .env("XDG_RUNTIME_DIR", dir)
        .args(["status", "web", "--json"])
        .output()
        .unwrap();
    let (o, e) = text(&out);
    assert!(out.status.success(), "{o}{e}");
    let status: serde_json::Value = serde_json::from_str(&o).unwrap();
    let found = status["components"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == component)
        .unwrap_or_else(|| panic!("no {component} in {o}"));
    found["counters"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c[0] == name)
        .and_then(|c| c[1].as_u64())
        .unwrap_or_else(|| panic!("no counter {name} in {found}"))
}

/// Restarts `component` of the web system whose roster is in `dir`.
fn restart(tag: &str, dir: &Path, component: &str) {
    let out = kintsugi(tag)
        .env("XDG_RUNTIME_DIR", dir)
        .args(["restart", component])
        .output()
        .unwrap();
    let (o, e) = text(&out);
    assert!(out.status.success(), "restart {component}: {o}{e}");
}

/// Cached files go out from their mm pages (`net.send_page`: netd sends
/// the head and the page in one `sendmsg`, nothing copied through the
/// channel). mm revokes a dead netd's aliases: the next netd refuses each
/// once, httpd caches the file again with an alias for it, and every body
/// stays right; a rebooted mm has httpd's aliases rebuilt by its stub, and
/// a rebooted httpd makes new ones.
#[test]
fn cached_files_are_sent_from_mm_pages_across_reboots() {
    let tag = unique_tag("web-pages");
    let dir = scratch("web-pages");
    let files = docroot(&dir.join("www"), seed("web-pages"));
    let cached: Vec<_> = files
        .iter()
        .filter(|(_, d)| !d.is_empty() && d.len() <= 1 << 20)
        .collect();
    let port = free_port();
    let child = start(&tag, &dir.join("www"), port, &[]);
    let fetch_all = |keep: bool| {
        for (path, data) in &cached {
            let mut s = connect(port).unwrap();
            let r = request(&mut s, "GET", path, keep).unwrap();
            assert_eq!((r.status, r.body.len()), (200, data.len()), "{path}");
            assert!(r.body == *data, "{path}: the body differs");
        }
    };
    let httpd_counter = |name| counter(&tag, &dir, "httpd", name);
    // A round whose every response netd sent from a page, within three
    // (the first after a start or a netd reboot fills or renews the cache;
    // a change ramfs publishes meanwhile, such as the access log's
    // creation, has files read and cached again).
    let from_pages = || {
        (0..3).any(|_| {
            let before = httpd_counter("sent_from_pages");
            fetch_all(false);
            httpd_counter("sent_from_pages") - before == cached.len() as u64
        })
    };
    fetch_all(true);
    assert!(from_pages(), "no round sent from pages after the start");
    for component in ["netd", "mm", "httpd", "netd"] {
        let refused = httpd_counter("pages_refused");
        restart(&tag, &dir, component);
        fetch_all(true);
        assert!(
            from_pages(),
            "no round sent from pages after {component}'s reboot"
        );
        let now = httpd_counter("pages_refused");
        eprintln!("after {component}'s reboot: pages refused {refused} -> {now}");
        if component == "netd" {
            assert!(now > refused, "the new netd refused the dead one's aliases");
        }
    }
    stop(child);
}

/// A netd that does not use mm refuses every page: httpd copies the
/// responses to it from then on, each body still right.
#[test]
fn a_netd_without_mm_has_responses_copied() {
    let tag = unique_tag("web-no-pages");
    let dir = scratch("web-no-pages");
    let files = docroot(&dir.join("www"), seed("web-no-pages"));
    let web = std::fs::read_to_string(system()).unwrap();
    let uses = "uses = [\"mm\"]                 # sends cached files";
    assert!(
        web.contains(uses),
        "systems/web.toml no longer gives netd mm"
    );
    let without = write(&dir, "web.toml", &web.replace(uses, "# no mm: copies"));
    let port = free_port();
    let child = start_system(&tag, &without, &dir.join("www"), port, &[]);
    for _ in 0..3 {
        for (path, data) in &files {
            let mut s = connect(port).unwrap();
            let r = request(&mut s, "GET", path, false).unwrap();
            assert_eq!((r.status, r.body.len()), (200, data.len()), "{path}");
            assert!(r.body == *data, "{path}: the body differs");
        }
    }
    let httpd_counter = |name| counter(&tag, &dir, "httpd", name);
    assert_eq!(httpd_counter("sent_from_pages"), 0);
    assert_eq!(
        httpd_counter("pages_refused"),
        1,
        "refused once, then not asked"
    );
    stop(child);
}

#[test]
fn http_behaviour() {
    let tag = unique_tag("web-http");
    let dir = scratch("web-http");
    let files = docroot(&dir.join("www"), 7);
    let port = free_port();
    let child = start(&tag, &dir.join("www"), port, &[]);
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    // Keep-alive: every file on one connection, then HEAD, 404 and 405 on it too.
    for (path, data) in &files {
        let r = request(&mut s, "GET", path, true).unwrap();
        assert_eq!((r.status, &r.body), (200, data), "{path}");
        assert!(r.head.contains("Connection: keep-alive"));
    }
    let r = request(&mut s, "GET", "/", true).unwrap();
    assert_eq!(r.body, files[0].1, "/ is /index.html");
    let r = request(&mut s, "HEAD", "/sub/big.bin", true).unwrap();
    assert_eq!(r.status, 200);
    assert!(r.head.contains("Content-Length: 300000"), "{}", r.head);
    assert_eq!(
        request(&mut s, "GET", "/missing", true).unwrap().status,
        404
    );
    assert_eq!(request(&mut s, "GET", "/sub/", true).unwrap().status, 404);
    write!(
        s,
        "POST /index.html HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello"
    )
    .unwrap();
    let r = read_response(&mut s, false).unwrap();
    assert_eq!(r.status, 405);
    assert!(r.head.contains("Allow: GET, HEAD"));
    // Two pipelined requests in one segment.
    write!(
        s,
        "GET /one.txt HTTP/1.1\r\n\r\nGET /page.html HTTP/1.1\r\n\r\n"
    )
    .unwrap();
    assert_eq!(read_response(&mut s, false).unwrap().body, files[2].1);
    assert_eq!(read_response(&mut s, false).unwrap().body, files[3].1);
    // Paths are normalized within the root; bare-LF lines are accepted.
    for path in [
        "//one.txt",
        "/./one.txt",
        "/sub/../one.txt",
        "/sub//..//one.txt",
    ] {
        let r = request(&mut s, "GET", path, true).unwrap();
        assert_eq!((r.status, &r.body), (200, &files[2].1), "{path}");
    }
    write!(s, "GET /one.txt HTTP/1.1\nHost: t\n\n").unwrap();
    assert_eq!(
        read_response(&mut s, false).unwrap().body,
        files[2].1,
        "bare LF"
    );
    // Connection: close, HTTP/1.0 and errors end the connection after the response.
    for (req, status) in [
        ("GET /one.txt HTTP/1.1\r\nConnection: close\r\n\r\n", 200),
        ("GET /one.txt HTTP/1.0\r\n\r\n", 200),
        ("GET /x HTTP/1.1\r\nContent-Length: 99999999\r\n\r\n", 413),
        ("GARBAGE\r\n\r\n", 400),
        ("GET /../etc/passwd HTTP/1.1\r\n\r\n", 400),
        ("GET / HTTP/1.1\r\nbroken header\r\n\r\n", 400),
        // HTTP/0.9 (no blank line follows): answered at once.
        ("GET /one.txt\r\n", 400),
        // What smuggles a request past a proxy.
        (
            "POST / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello",
            400,
        ),
        ("POST / HTTP/1.1\r\nContent-Length: +5\r\n\r\nhello", 400),
        (
            "GET / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            400,
        ),
    ] {
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(req.as_bytes()).unwrap();
        let r = read_response(&mut s, false).unwrap();
        assert_eq!(r.status, status, "{req:?}");
        assert!(r.head.contains("Connection: close"), "{req:?}");
        let mut rest = Vec::new();
        assert_eq!(
            s.read_to_end(&mut rest).unwrap(),
            0,
            "{req:?}: closed after the response"
        );
    }
    // A head that never ends: 413 once it passes 16 KiB.
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(b"GET / HTTP/1.1\r\n").unwrap();
    let _ = s.write_all(&vec![b'a'; 20_000]);
    assert_eq!(read_response(&mut s, false).unwrap().status, 413);
    stop(child);
    assert!(leftovers(&tag).is_empty());
}

/// What [`clients`] saw.
#[derive(Default)]
struct Served {
    /// Requests answered with the right bytes.
    requests: u64,
    failures: Vec<String>,
    /// Requests on a reused keep-alive connection that the server closed
    /// before any byte of the response, answered right when retried once on
    /// a new connection, as HTTP clients retry an idempotent request
    /// (RFC 9112, 9.3.1).
    retried: Vec<String>,
}

/// Fetches `path` on `s` and checks the body.
fn fetch(s: &mut TcpStream, path: &str, data: &[u8], keep: bool) -> Result<(), String> {
    let r = request(s, "GET", path, keep).map_err(|e| e.to_string())?;
    if r.status != 200 || r.body != data {
        return Err(format!(
            "status {}, {} bytes differ",
            r.status,
            r.body.len()
        ));
    }
    Ok(())
}

fn connect(port: u16) -> Result<TcpStream, String> {
    let s = TcpStream::connect(("127.0.0.1", port)).map_err(|e| format!("connect: {e}"))?;
    s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
    Ok(s)
}

/// Clients that fetch random files, half on keep-alive connections, and
/// check every body.
fn clients(
    port: u16,
    files: &[(String, Vec<u8>)],
    threads: usize,
    for_: Duration,
    seed: u64,
) -> Served {
    let done = Arc::new(AtomicBool::new(false));
    let count = Arc::new(AtomicU64::new(0));
    let files = Arc::new(files.to_vec());
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let (done, count, files) = (done.clone(), count.clone(), files.clone());
            std::thread::spawn(move || {
                let mut rng = Rng(seed.wrapping_mul(31).wrapping_add(t as u64) | 1);
                let (mut failures, mut retried) = (Vec::new(), Vec::new());
                while !done.load(Ordering::Relaxed) {
                    let burst = if rng.next().is_multiple_of(2) { 1 } else { 5 };
                    let mut attempt = || -> Result<(), String> {
                        let mut s = connect(port)?;
                        for i in 0..burst {
                            let (path, data) = &files[(rng.next() % files.len() as u64) as usize];
                            let keep = i + 1 < burst;
                            match fetch(&mut s, path, data, keep) {
                                Ok(()) => {}
                                Err(e) if i > 0 && e.ends_with("response head: \"\"") => {
                                    // Closed before any byte, on a reused connection.
                                    s = connect(port)?;
                                    fetch(&mut s, path, data, keep).map_err(|e2| {
                                        format!("{path}, retried after `{e}`: {e2}")
                                    })?;
                                    retried.push(format!(
                                        "{path} (request {i} on its connection): {e}"
                                    ));
                                }
                                Err(e) => {
                                    return Err(format!(
                                        "{path} (request {i} on its connection): {e}"
                                    ))
                                }
                            }
                            count.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok(())
                    };
                    if let Err(e) = attempt() {
                        failures.push(e);
                    }
                }
                (failures, retried)
            })
        })
        .collect();
    std::thread::sleep(for_);
    done.store(true, Ordering::Relaxed);
    let mut served = Served {
        requests: 0,
        failures: Vec::new(),
        retried: Vec::new(),
    };
    for h in handles {
        let (failures, retried) = h.join().unwrap();
        served.failures.extend(failures);
        served.retried.extend(retried);
    }
    served.requests = count.load(Ordering::Relaxed);
    served
}

#[test]
fn no_request_fails_while_components_crash() {
    let _heavy = HEAVY.lock().unwrap_or_else(|p| p.into_inner());
    let seed = seed("web-crash");
    let dir = scratch("web-crash");
    let files = docroot(&dir.join("www"), seed);
    // The test client writes each request in several pieces, so requests
    // often arrive split: a crash of httpd between the pieces is covered.
    for (i, component) in ["netd", "httpd", "ramfs", "lock", "evt", "mm", "timer"]
        .into_iter()
        .enumerate()
    {
        let tag = unique_tag(&format!("web-crash-{component}"));
        let port = free_port();
        let chaos = [
            "--kill",
            component,
            "--kills",
            "4",
            "--kill-every",
            "250..600",
            "--signals",
            "kill,segv",
        ]
        .map(String::from);
        let mut extra = chaos.to_vec();
        extra.extend(["--seed".to_string(), (seed + i as u64).to_string()]);
        let child = start(&tag, &dir.join("www"), port, &extra);
        let Served {
            requests: served,
            failures,
            retried,
        } = clients(
            port,
            &files,
            6,
            Duration::from_millis(3500),
            seed + i as u64,
        );
        let log = stop(child);
        let crashes = crashes(&log, component).len();
        eprintln!(
            "{component}: {crashes} crashes, {served} requests verified, {} failed, {} retried on a new connection: {retried:?}",
            failures.len(),
            retried.len()
        );
        assert!(crashes >= 3, "{component} crashed {crashes} times:\n{log}");
        assert!(
            failures.is_empty(),
            "{component}: {} failed requests: {:?}\n{log}",
            failures.len(),
            &failures[..failures.len().min(5)]
        );
        assert!(served >= 50, "{component}: only {served} requests");
        assert!(leftovers(&tag).is_empty());
    }
}

/// netd killed every 100–200 ms under many new connections: some kills
/// land between the kernel's accept and the vault post, where only the
/// keeper's shared descriptor table saves the connection.
#[test]
fn netd_killed_often_resets_no_connection() {
    let _heavy = HEAVY.lock().unwrap_or_else(|p| p.into_inner());
    let seed = seed("web-netd-often");
    let dir = scratch("web-netd-often");
    let files = docroot(&dir.join("www"), seed);
    // Small files only: many connections per second.
    let small: Vec<_> = files.into_iter().filter(|(_, d)| d.len() <= 4096).collect();
    let tag = unique_tag("web-netd-often");
    let port = free_port();
    let chaos = [
        "--kill",
        "netd",
        "--kills",
        "40",
        "--kill-every",
        "100..200",
        "--signals",
        "kill",
    ]
    .map(String::from);
    let mut extra = chaos.to_vec();
    extra.extend(["--seed".to_string(), seed.to_string()]);
    let child = start(&tag, &dir.join("www"), port, &extra);
    let Served {
        requests: served,
        failures,
        retried,
    } = clients(port, &small, 8, Duration::from_millis(7000), seed);
    // Connections accepted and not yet posted to the vault (netd posts many
    // to a message), taken from a dead incarnation's keeper.
    let unposted = counter(&tag, &dir, "netd", "kept_unposted");
    let log = stop(child);
    let crashes = crashes(&log, "netd").len();
    let kept = log
        .matches("took a connection accepted by a dead incarnation")
        .count();
    eprintln!(
        "netd: {crashes} crashes, {kept} connections taken from a keeper in accept, {unposted} not yet in the vault, {served} requests verified, {} failed, {} retried on a new connection: {retried:?}",
        failures.len(),
        retried.len()
    );
    assert!(crashes >= 20, "netd crashed {crashes} times:\n{log}");
    assert!(
        unposted > 0,
        "no kill found a connection not yet in the vault:\n{log}"
    );
    // A keep-alive connection closed before a response is a loss HTTP
    // clients retry; it is not yet gone (issue 13: about 1 request in
    // 2,000 under these 40 kills, in 1 run of 3), so it is counted and
    // bounded here, and every retried request must then be answered right.
    assert!(
        retried.len() <= 5,
        "{} requests retried: {retried:?}",
        retried.len()
    );
    assert!(
        failures.is_empty(),
        "{} failed requests: {:?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
    assert!(served >= 500, "only {served} requests");
    assert!(
        leftovers(&tag).is_empty(),
        "a keeper or component outlived the system"
    );
}

/// The supervisor stopped (SIGSTOP, as a hang would stop it) 100 times for
/// 5–40 ms while clients fetch files and check every byte: requests cross
/// netd, httpd and the services through shared memory, not through the
/// supervisor, so none fails; and once it runs again the supervisor takes
/// none of the time it was stopped for a hang of a component, so nothing
/// is rebooted (every component keeps its pid).
#[test]
fn the_supervisor_stopped_again_and_again_fails_no_request_and_reboots_nothing() {
    let _heavy = HEAVY.lock().unwrap_or_else(|p| p.into_inner());
    let seed = seed("web-supervisor-stopped");
    let dir = scratch("web-supervisor-stopped");
    let files = docroot(&dir.join("www"), seed);
    let tag = unique_tag("web-supervisor-stopped");
    let port = free_port();
    let child = start(&tag, &dir.join("www"), port, &[]);
    let supervisor = rustix::process::Pid::from_child(&child);
    let mut rng = Rng(seed | 1);
    // (running, stopped) in ms, 100 times.
    let plan: Vec<(u64, u64)> = (0..100)
        .map(|_| (10 + rng.next() % 31, 5 + rng.next() % 36))
        .collect();
    let total: u64 = plan.iter().map(|(r, s)| r + s).sum();
    let stopper = std::thread::spawn(move || {
        for (running, stopped) in plan {
            std::thread::sleep(Duration::from_millis(running));
            rustix::process::kill_process(supervisor, rustix::process::Signal::STOP).unwrap();
            std::thread::sleep(Duration::from_millis(stopped));
            rustix::process::kill_process(supervisor, rustix::process::Signal::CONT).unwrap();
        }
    });
    let served = clients(port, &files, 6, Duration::from_millis(total + 500), seed);
    stopper.join().unwrap();
    let log = stop(child);
    let events = events(&log);
    let unexpected: Vec<_> = events
        .iter()
        .filter(|e| {
            !matches!(
                e,
                Event::Started { .. } | Event::Finished { .. } | Event::Stopped { .. }
            )
        })
        .collect();
    eprintln!(
        "100 stops over {total} ms: {} requests verified, {} failed, {} retried on a new connection",
        served.requests,
        served.failures.len(),
        served.retried.len()
    );
    assert!(
        served.failures.is_empty() && served.retried.is_empty(),
        "failed: {:?}, retried: {:?}",
        &served.failures[..served.failures.len().min(5)],
        served.retried
    );
    assert!(unexpected.is_empty(), "{unexpected:?}\n{log}");
    let started = events
        .iter()
        .filter(|e| matches!(e, Event::Started { .. }))
        .count();
    assert_eq!(started, 7, "one incarnation per component:\n{log}");
    assert!(served.requests >= 100, "only {} requests", served.requests);
    assert!(leftovers(&tag).is_empty());
}

/// The web system under a keeper (`[system] keeper = { hang_ms = 300 }`)
/// in `dir`; its output read as it comes (a hundred restarts print more
/// than a pipe holds).
struct KeptWeb {
    seed: u64,
    /// Its directory (the roster's too), the files it serves and their
    /// bytes, its processes' tag and its port.
    dir: PathBuf,
    files: Vec<(String, Vec<u8>)>,
    tag: String,
    port: u16,
    child: Child,
    stdout: std::thread::JoinHandle<String>,
    stderr: std::thread::JoinHandle<String>,
}

impl KeptWeb {
    /// The web system under a keeper, serving a new document root, its
    /// scratch names taken from `name`.
    fn start(name: &str) -> Self {
        Self::with(name, &[], "")
    }

    /// The same, with these settings (`--set`), and `more` at the end of
    /// the system's description (`{seed}` in it replaced by the seed).
    fn with(name: &str, settings: &[&str], more: &str) -> Self {
        let seed = seed(name);
        let dir = scratch(name);
        let files = docroot(&dir.join("www"), seed);
        let tag = unique_tag(name);
        let port = free_port();
        let text = std::fs::read_to_string(system()).unwrap();
        let text = text.replacen("[system]\n", "[system]\nkeeper = { hang_ms = 300 }\n", 1)
            + &more.replace("{seed}", &seed.to_string());
        let system = write(&dir, "web.toml", &text);
        let sets: Vec<String> = settings
            .iter()
            .flat_map(|s| ["--set".to_string(), s.to_string()])
            .collect();
        let mut child = start_system(&tag, &system, &dir.join("www"), port, &sets);
        let drain = |from: Option<Box<dyn Read + Send>>| {
            let mut from = from.expect("piped");
            std::thread::spawn(move || {
                let mut text = String::new();
                let _ = from.read_to_string(&mut text);
                text
            })
        };
        let stdout = drain(child.stdout.take().map(|o| Box::new(o) as _));
        let stderr = drain(child.stderr.take().map(|e| Box::new(e) as _));
        Self {
            seed,
            dir,
            files,
            tag,
            port,
            child,
            stdout,
            stderr,
        }
    }

    fn keeper(&self) -> u32 {
        self.child.id()
    }

    /// Stops it as a service manager would (SIGTERM to the keeper): its
    /// exit, stdout and stderr.
    fn stop(mut self) -> (std::process::ExitStatus, String, String) {
        let _ = rustix::process::kill_process(
            rustix::process::Pid::from_child(&self.child),
            rustix::process::Signal::TERM,
        );
        let status = self.child.wait().unwrap();
        (
            status,
            self.stdout.join().unwrap(),
            self.stderr.join().unwrap(),
        )
    }
}

/// Sends `sig` to the supervisor under `keeper` and waits for the next
/// (`what` names the fault in a failure): the old one's pid, and how long
/// the next took to appear.
fn signal_supervisor(keeper: u32, sig: rustix::process::Signal, what: &str) -> (u32, Duration) {
    let old = supervisor_of(keeper).expect("a supervisor runs");
    let at = Instant::now();
    let pid = rustix::process::Pid::from_raw(old as i32).unwrap();
    rustix::process::kill_process(pid, sig).unwrap();
    let deadline = at + Duration::from_secs(20);
    while supervisor_of(keeper).is_none_or(|p| p == old) {
        assert!(Instant::now() < deadline, "no supervisor after {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
    (old, at.elapsed())
}

/// SIGKILLs the supervisor under `keeper` and waits for the next.
fn kill_supervisor(keeper: u32, what: &str) {
    signal_supervisor(keeper, rustix::process::Signal::KILL, what);
}

/// Issue 17: connections netd has accepted and not yet posted to the vault
/// as the supervisor dies (netd posting 64 to a message here, or at its
/// reaper's tick of 250 ms, so that most deaths find some), each holding
/// half a request (httpd's workers wait 10 s for the rest, so that they
/// hold them rather than park them with netd, a post). netd dies with
/// the supervisor; its keeper, which shares its descriptor table, posts
/// them to netd's vault socket before it exits; the supervisor's keeper
/// holds the other end, and the next supervisor applies what waits there.
/// Each connection, given the rest of its request after the restart, is
/// answered byte for byte.
#[test]
fn connections_not_yet_in_the_vault_outlive_the_supervisor() {
    let _heavy = HEAVY.lock().unwrap_or_else(|p| p.into_inner());
    let web = KeptWeb::with(
        "web-unposted",
        &["netd.post_every=64", "httpd.linger_us=10000000"],
        "",
    );
    let (port, keeper) = (web.port, web.keeper());
    let (page, body) = web.files[3].clone();
    let rounds = 4;
    for round in 0..rounds {
        let mut halves: Vec<TcpStream> = (0..8).map(|_| connect(port).unwrap()).collect();
        for s in &mut halves {
            write!(s, "GET {page} HTTP/1.1\r\nHost: t\r\n").unwrap();
        }
        // Accepted, handed to httpd's workers, and owed to the vault.
        std::thread::sleep(Duration::from_millis(30));
        kill_supervisor(keeper, &format!("round {round}"));
        for (i, s) in halves.iter_mut().enumerate() {
            let answered =
                write!(s, "Connection: close\r\n\r\n").and_then(|()| read_response(s, false));
            match answered {
                Ok(r) => assert!(
                    r.status == 200 && r.body == body,
                    "round {round}, connection {i}: status {}, {} bytes differ",
                    r.status,
                    r.body.len()
                ),
                Err(e) => panic!("round {round}, connection {i}: {e}"),
            }
        }
    }
    let tag = web.tag.clone();
    let (status, stdout, log) = web.stop();
    assert!(status.success(), "{status:?}\n{stdout}\n{log}");
    // The rounds' deaths found connections not yet posted (else this test
    // shows nothing): the next supervisor applied what netd's keeper sent.
    let applied = log
        .matches("requests left unread by the dead supervisor applied")
        .count();
    eprintln!("{rounds} supervisor deaths with 8 half requests each: {applied} found posts left");
    assert!(applied > 0, "no death found a connection owed:\n{log}");
    assert!(leftovers(&tag).is_empty(), "{:?}", leftovers(&tag));
}

/// Issue 17: a response cut by the supervisor's death, twice, its client
/// reading slowly: httpd and netd die with the supervisor with part of a
/// 10 MiB body in the kernel; the next httpd sends the response again from
/// its first byte, and the next netd skips what the kernel already has, so
/// the client reads one response byte for byte. On a new connection (the
/// connection's first request) and on a keep-alive one whose first request
/// was answered (netd's marks say where the second's response began). The
/// second death comes while the next incarnations are sending it again:
/// netd's marks must still say where it began (they once moved to the
/// kernel's count at the new httpd's first call, and the third
/// incarnation sent the whole response again after what was sent).
#[test]
fn a_response_cut_by_the_supervisors_death_goes_on_byte_for_byte() {
    let _heavy = HEAVY.lock().unwrap_or_else(|p| p.into_inner());
    let web = KeptWeb::start("web-cut-response");
    let (port, keeper) = (web.port, web.keeper());
    let (small, small_body) = web.files[3].clone();
    let (big, body) = web
        .files
        .iter()
        .max_by_key(|(_, d)| d.len())
        .cloned()
        .unwrap();
    assert!(body.len() >= 8 << 20, "a large file: {} bytes", body.len());
    for (round, first) in [(0, true), (1, false), (2, true), (3, false)] {
        // A small receive buffer: the response cannot all be in the kernel.
        let sock = rustix::net::socket(
            rustix::net::AddressFamily::INET,
            rustix::net::SocketType::STREAM,
            None,
        )
        .unwrap();
        rustix::net::sockopt::set_socket_recv_buffer_size(&sock, 64 << 10).unwrap();
        let to = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        rustix::net::connect(&sock, &to).unwrap();
        let mut s = TcpStream::from(sock);
        s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
        if !first {
            fetch(&mut s, &small, &small_body, true).unwrap();
        }
        write!(
            s,
            "GET {big} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut all = Vec::new();
        for death in 0..2 {
            let mut part = vec![0u8; 256 << 10];
            s.read_exact(&mut part).unwrap();
            all.extend(part);
            // The next incarnations have begun sending it again.
            std::thread::sleep(Duration::from_millis(200));
            kill_supervisor(keeper, &format!("round {round}, death {death}"));
        }
        s.read_to_end(&mut all).unwrap();
        let head = all.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
        let got = &all[head..];
        let differ = got.iter().zip(&body).position(|(a, b)| a != b);
        assert!(
            got.len() == body.len() && differ.is_none(),
            "round {round} (first request: {first}): {} body bytes of {}, first difference at {differ:?}",
            got.len(),
            body.len()
        );
    }
    let tag = web.tag.clone();
    let (status, stdout, log) = web.stop();
    assert!(status.success(), "{status:?}\n{stdout}\n{log}");
    assert!(leftovers(&tag).is_empty(), "{:?}", leftovers(&tag));
}

/// Six checking clients, in turns of 500 ms, for as long as `driver`
/// runs; then two more for 300 ms (the last turn: something is served
/// after the driver's last fault). What they served, the last turn's
/// apart, and what the driver returned.
fn serve_while<T>(
    port: u16,
    files: &[(String, Vec<u8>)],
    seed: u64,
    driver: std::thread::JoinHandle<T>,
) -> (Served, Served, std::thread::Result<T>) {
    let mut served = Served::default();
    let mut turn = 0;
    while !driver.is_finished() {
        let more = clients(port, files, 6, Duration::from_millis(500), seed ^ turn);
        served.requests += more.requests;
        served.failures.extend(more.failures);
        served.retried.extend(more.retried);
        turn += 1;
    }
    let driven = driver.join();
    let last = clients(port, files, 2, Duration::from_millis(300), seed);
    (served, last, driven)
}

/// The demo's file workload in its durable mode beside the web system, on
/// the same ramfs: it writes `/durable/f-0`, `f-1`, … (each as `tmp`, then
/// renamed) and, at each start, checks that the files are there with no
/// gap, byte for byte.
const DURABLE_WORKLOAD: &str = r#"
[[component]]
name = "workload"
binary = "kintsugi-fs-workload"
uses = ["fs"]
[component.config]
durable = true
ops = 3000
seed = {seed}
"#;

/// The durable workload's reports in the system's output, in order: each
/// start's check found every file whose rename had been answered before
/// it, byte for byte (else a panic). How many starts checked files an
/// earlier one had written, and the highest file answered.
fn durable_checks(stdout: &str) -> (usize, Option<u64>) {
    let (mut starts, mut answered) = (0, None::<u64>);
    for line in stdout.lines() {
        if !line.starts_with("{\"component\":\"workload\"") {
            continue;
        }
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if let Some(n) = v.get("durable_written").and_then(|n| n.as_u64()) {
            answered = Some(answered.map_or(n, |a| a.max(n)));
        }
        if let Some(k) = v.get("durable_found").and_then(|k| k.as_u64()) {
            let errors = v["errors"].as_array().map_or(0, Vec::len);
            assert_eq!(errors, 0, "files lost or wrong: {line}");
            if let Some(a) = answered {
                assert!(k > a, "{k} files found, but f-{a}'s rename was answered");
            }
            starts += usize::from(answered.is_some());
        }
    }
    (starts, answered)
}

/// What `ab` counted over its runs.
#[derive(Debug, Default)]
struct AbCount {
    runs: u32,
    complete: u64,
    /// Failed (connect, receive, length, exceptions), of which a length
    /// other than the first response's, and non-2xx responses.
    failed: u64,
    wrong_length: u64,
    non_2xx: u64,
    /// The output of runs that ended in an error.
    errors: Vec<String>,
}

/// Apache's `ab -r -c 4 -n 500` fetching `path` on `port`, a new
/// connection per request, run after run until `stop`.
fn ab_until(port: u16, path: String, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<AbCount> {
    std::thread::spawn(move || {
        let mut count = AbCount::default();
        // "Failed requests:        2" and, under it, "(Connect: 0,
        // Receive: 2, Length: 0, Exceptions: 0)": the number after `name`
        // on the first line that begins with `line`.
        let field = |out: &str, line: &str, name: &str| {
            out.lines()
                .find(|l| l.trim_start().starts_with(line))
                .and_then(|l| Some(l.split_once(name)?.1))
                .and_then(|v| v.split([' ', ',', ')']).find(|w| !w.is_empty()))
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
        };
        while !stop.load(Ordering::Relaxed) {
            let out = std::process::Command::new("ab")
                .args(["-r", "-q", "-s", "20", "-c", "4", "-n", "500"])
                .arg(format!("http://127.0.0.1:{port}{path}"))
                .output()
                .unwrap();
            let (stdout, stderr) = text(&out);
            count.runs += 1;
            let total = |name: &str| field(&stdout, name, name);
            count.complete += total("Complete requests:");
            count.failed += total("Failed requests:");
            count.wrong_length += field(&stdout, "(Connect:", "Length:");
            count.non_2xx += total("Non-2xx responses:");
            if !out.status.success() {
                count.errors.push(format!("{stdout}{stderr}"));
            }
        }
        count
    })
}

/// `KINTSUGI_TEST_ROUNDS`, else `default`.
fn rounds(default: usize) -> usize {
    std::env::var("KINTSUGI_TEST_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(default)
}

/// After a fault into the supervisor: waits for another supervisor if
/// `old` is dead, then checks that a new connection and `idle` (a
/// keep-alive connection opened before the first fault) are answered byte
/// for byte. Whether the supervisor was replaced, and the requests that
/// failed (`idle` is then opened again). A new connection that fails is
/// followed by another: the system is lost if that one fails too (a
/// panic).
fn serving_after(
    keeper: u32,
    old: u32,
    port: u16,
    idle: &mut TcpStream,
    (page, body): (&str, &[u8]),
    what: &str,
) -> (bool, Vec<String>) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while dead(old) && supervisor_of(keeper).is_none_or(|p| p == old) {
        assert!(Instant::now() < deadline, "no supervisor after {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut failed = Vec::new();
    let new = || fetch(&mut connect(port)?, page, body, false);
    if let Err(e) = new() {
        failed.push(format!("a new connection after {what}: {e}"));
        new().unwrap_or_else(|e| panic!("the system is lost after {what}: {failed:?}, then {e}"));
    }
    if let Err(e) = fetch(idle, page, body, true) {
        failed.push(format!("the idle connection after {what}: {e}"));
        *idle = connect(port).unwrap();
        fetch(idle, page, body, true).unwrap();
    }
    (supervisor_of(keeper) != Some(old), failed)
}

/// Whether process `pid` is gone or a zombie.
fn dead(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| Some(s.rsplit(')').next()?.trim_start().starts_with(['Z', 'X'])))
        .unwrap_or(true)
}

/// Issue 17: the supervisor SIGKILLed, SIGSEGVed and stopped for good (a
/// hang) again and again while six clients fetch files and check every
/// byte. Its keeper starts another each time, which takes back from the
/// descriptor table the keeper shared what the vault's records hold
/// (netd's listener and connections, ramfs's files); every component
/// starts again under it, once. After every death: a keep-alive connection
/// opened before the first and idle across all of them, and a new one,
/// are answered byte for byte; one restart per death, each stop found as
/// a hang; and no request of the six clients, nor of Apache's `ab` beside
/// them (a new connection per request), is answered wrong or fails, those
/// in flight at a death included (netd's marks say where a response
/// began; requests the components sent to the dead supervisor are applied
/// by the next; the connections netd had not yet posted, its keeper posts
/// as it goes); and the demo's file workload, in its durable mode on the
/// same ramfs, finds at each start every file whose rename was answered,
/// byte for byte. A reset is allowed once per dozen deaths, as a margin: 30
/// runs of 12 deaths beside two CPU hogs (2026-12-07) had none, in 15,012
/// checked requests and 660,000 of ab's, but a run of 60 deaths fetching
/// 10 MiB files on keep-alive connections reset two (cause not found).
/// `KINTSUGI_TEST_ROUNDS` sets the rounds of each kind (4).
#[test]
fn the_supervisor_killed_again_and_again_is_restarted_by_its_keeper_and_loses_no_system() {
    let _heavy = HEAVY.lock().unwrap_or_else(|p| p.into_inner());
    let web = KeptWeb::with("web-keeper", &[], DURABLE_WORKLOAD);
    let (seed, port, keeper, files) = (web.seed, web.port, web.keeper(), web.files.clone());
    let tag = web.tag.clone();
    let rounds = rounds(4);
    let mut rng = Rng(seed | 1);
    let mut plan: Vec<(rustix::process::Signal, u64)> = [
        rustix::process::Signal::KILL,
        rustix::process::Signal::SEGV,
        rustix::process::Signal::STOP,
    ]
    .into_iter()
    .flat_map(|sig| std::iter::repeat_n(sig, rounds))
    .map(|sig| (sig, 100 + rng.next() % 300))
    .collect();
    for i in (1..plan.len()).rev() {
        plan.swap(i, (rng.next() % (i as u64 + 1)) as usize);
    }
    let (page, body) = files[3].clone();
    let mut idle = connect(port).unwrap();
    fetch(&mut idle, &page, &body, true).unwrap();
    // Apache's ab beside the checking clients, where it is installed.
    let stop_ab = Arc::new(AtomicBool::new(false));
    let ab = installed("ab").then(|| ab_until(port, page.clone(), stop_ab.clone()));
    let killer = std::thread::spawn(move || {
        let mut restarts = Vec::new();
        for (sig, after) in plan {
            std::thread::sleep(Duration::from_millis(after));
            let at = Instant::now();
            let (old, new) = signal_supervisor(keeper, sig, &format!("{sig:?}"));
            let (_, failed) = serving_after(
                keeper,
                old,
                port,
                &mut idle,
                (&page, &body),
                &format!("{sig:?}"),
            );
            assert!(failed.is_empty(), "{failed:?}");
            restarts.push((sig, new, at.elapsed()));
        }
        restarts
    });
    let (served, last, restarts) = serve_while(port, &files, seed, killer);
    stop_ab.store(true, Ordering::Relaxed);
    let ab = ab.map(|ab| ab.join().unwrap());
    let (status, stdout, log) = web.stop();
    let Ok(restarts) = restarts else {
        panic!("the killer failed (above); the system's log:\n{stdout}\n{log}");
    };
    eprintln!(
        "{} supervisor deaths: {} requests verified, {} failed {:?}, {} retried on a new connection; (signal, new supervisor ms, serving again ms): {:?}",
        restarts.len(),
        served.requests + last.requests,
        served.failures.len() + last.failures.len(),
        served.failures.iter().chain(&last.failures).collect::<Vec<_>>(),
        served.retried.len(),
        restarts
            .iter()
            .map(|(s, n, d)| format!("{s:?} {:.1} {:.1}", n.as_secs_f64() * 1e3, d.as_secs_f64() * 1e3))
            .collect::<Vec<_>>()
    );
    match &ab {
        Some(ab) => eprintln!("ab: {ab:?}"),
        None => eprintln!("ab: not installed (.ci/run installs it)"),
    }
    assert!(
        status.success(),
        "the keeper's exit: {status:?}\n{stdout}\n{log}"
    );
    // ab's failures are its connect and receive errors (resets): a wrong
    // length or status is a wrong answer.
    if let Some(ab) = &ab {
        assert!(
            ab.complete > 0 && ab.wrong_length == 0 && ab.non_2xx == 0 && ab.errors.is_empty(),
            "ab: {ab:?}"
        );
    }
    let failures = served.failures.len()
        + last.failures.len()
        + ab.as_ref().map_or(0, |ab| ab.failed as usize);
    assert!(
        failures <= rounds * 3 / 12
            && served
                .failures
                .iter()
                .chain(&last.failures)
                .all(|f| f.contains("reset by peer")),
        "failed: {:?} {:?}\n{log}",
        &served.failures[..served.failures.len().min(5)],
        last.failures
    );
    assert!(last.requests > 0, "nothing served after the last restart");
    let (starts, answered) = durable_checks(&stdout);
    eprintln!(
        "the durable workload: {starts} starts checked the files earlier ones wrote, f-0..=f-{answered:?} answered"
    );
    assert!(
        starts > 0,
        "the workload checked {starts} starts and had {answered:?} answered:\n{stdout}"
    );
    let generations = log.matches("started by its keeper").count();
    assert_eq!(generations, 3 * rounds, "one restart per death:\n{log}");
    assert_eq!(
        log.matches("hung (its loop did not turn)").count(),
        rounds,
        "each stop found as a hang:\n{log}"
    );
    assert!(!log.contains("quarantined"), "{log}");
    assert!(leftovers(&tag).is_empty(), "{:?}", leftovers(&tag));
}

/// Issue 17: register bit flips into the supervisor itself (C3's and
/// SuperGlue's fault, `kintsugi inject --component supervisor`: one bit of
/// one register of a thread caught executing user code) under its keeper,
/// while six clients fetch files and check every byte. A flip the
/// supervisor does not survive kills it (SIGSEGV, SIGBUS, an abort, a
/// panic) or stops one of its serving threads (a vault thread, the output
/// relay, the event loop), which its keeper finds as a hang; either way
/// the keeper starts another. After every flip the system serves: a new
/// connection and an idle keep-alive one are answered byte for byte (no
/// system lost). No request of the six clients is answered wrong; a flip
/// can lose one connection, counted and bounded here: one whose post the
/// vault thread was handling when the flip hit it (read, not yet logged,
/// or logged as a frame the flip corrupted, which the next supervisor
/// quarantines), which the next supervisor closes; or one whose
/// descriptor a flipped thread closed by mistake (the supervisor's
/// threads share one descriptor table). Such losses come at about 3 per
/// 100 flips (31 in a run of 1,000, docs/reliability.md), sometimes two at
/// one flip: the bound is a tenth of the flips plus 3, so that 12 flips
/// fail it only for a rate far above that. `KINTSUGI_TEST_ROUNDS` sets
/// the flips (12).
#[test]
fn register_flips_into_the_supervisor_lose_no_system_and_lose_few_requests() {
    let _heavy = HEAVY.lock().unwrap_or_else(|p| p.into_inner());
    let web = KeptWeb::start("web-supervisor-flips");
    let (seed, port, keeper, files) = (web.seed, web.port, web.keeper(), web.files.clone());
    let (tag, dir) = (web.tag.clone(), web.dir.clone());
    let flips = rounds(12);
    let (page, body) = files[3].clone();
    let mut idle = connect(port).unwrap();
    fetch(&mut idle, &page, &body, true).unwrap();
    let (inject_tag, roster_dir) = (tag.clone(), dir.clone());
    let injector = std::thread::spawn(move || {
        let mut rng = Rng(seed | 1);
        let (mut injected, mut replaced, mut missed) = (Vec::new(), 0, 0);
        let mut checks = Vec::new();
        while injected.len() < flips {
            let old = supervisor_of(keeper).expect("a supervisor runs");
            let out = kintsugi(&inject_tag)
                .env("XDG_RUNTIME_DIR", &roster_dir)
                .args(["inject", "--system", "web", "--component", "supervisor"])
                .args(["--kind", "register", "--patience-ms", "2000", "--seed"])
                .arg((seed + injected.len() as u64 + missed).to_string())
                .output()
                .unwrap();
            let (stdout, stderr) = text(&out);
            if !out.status.success() {
                // No thread of the supervisor ran user code within the
                // patience: nothing was injected.
                assert!(stderr.contains("executing user code"), "{stdout}{stderr}");
                missed += 1;
                continue;
            }
            std::thread::sleep(Duration::from_millis(100 + rng.next() % 200));
            let what = format!("flip {} ({})", injected.len(), stdout.trim());
            let (new, failed) = serving_after(keeper, old, port, &mut idle, (&page, &body), &what);
            replaced += usize::from(new);
            checks.extend(failed);
            injected.push(stdout.lines().last().unwrap_or_default().to_string());
        }
        (injected, replaced, missed, checks)
    });
    let (served, last, injected) = serve_while(port, &files, seed, injector);
    let (status, stdout, log) = web.stop();
    let Ok((injected, replaced, missed, checks)) = injected else {
        panic!("the injector failed (above); the system's log:\n{stdout}\n{log}");
    };
    let generations = log.matches("started by its keeper").count();
    let hangs = log.matches("hung (its loop did not turn)").count();
    let quarantined = log.matches("quarantined").count();
    let unread = log.matches("record does not read").count();
    let failures: Vec<&String> = served
        .failures
        .iter()
        .chain(&last.failures)
        .chain(&checks)
        .collect();
    eprintln!(
        "{} flips into the supervisor ({missed} tries found no thread in user code): {replaced} replaced it ({generations} restarts, {hangs} found as hangs); {quarantined} log frames quarantined, {unread} connection records that did not read closed; {} requests verified, {} failed: {failures:?}, {} retried on a new connection",
        injected.len(),
        served.requests + last.requests,
        failures.len(),
        served.retried.len(),
    );
    assert!(
        status.success(),
        "the keeper's exit: {status:?}\n{stdout}\n{log}"
    );
    assert!(
        failures
            .iter()
            .all(|f| !f.contains("differ") && !f.contains("malformed")),
        "a wrong answer: {failures:?}\n{log}"
    );
    assert!(
        failures.len() <= flips / 10 + 3,
        "{} failed requests in {flips} flips: {failures:?}\n{log}",
        failures.len()
    );
    assert!(last.requests > 0, "nothing served after the last flip");
    assert!(leftovers(&tag).is_empty(), "{:?}", leftovers(&tag));
}

fn installed(tool: &str) -> bool {
    std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {tool}"))
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// `kintsugi bench web` with small counts: every configuration measured,
/// the faults injected, the plot written, every server it started stopped.
#[test]
fn bench_web_runs_briefly() {
    let _heavy = HEAVY.lock().unwrap_or_else(|p| p.into_inner());
    let missing: Vec<_> = ["nginx", "apache2", "ab", "wrk"]
        .into_iter()
        .filter(|t| !installed(t))
        .collect();
    if !missing.is_empty() {
        eprintln!("skipped: {missing:?} not installed (.ci/run installs them)");
        return;
    }
    let tag = unique_tag("web-bench");
    let dir = scratch("web-bench");
    let plot = dir.join("web.svg");
    let child = kintsugi(&tag)
        .args([
            "bench",
            "web",
            "--requests",
            "300",
            "--repeats",
            "2",
            "--wrk-secs",
            "1",
            "--file-bytes",
            "1024,65536",
        ])
        .args(["--fault-secs", "4", "--fault-every", "1", "--plot"])
        .arg(&plot)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // nginx and Apache keep the bench's scratch directory in their command lines.
    let configs = format!("kintsugi-bench-web-{}", child.id());
    let out = child.wait_with_output().unwrap();
    let (stdout, stderr) = text(&out);
    // Exit status 1: requests failed under faults (which the crash test
    // above rules out for its clients; see the README for ab's); 2: an error.
    assert!(
        matches!(out.status.code(), Some(0 | 1)),
        "{stdout}\n{stderr}"
    );
    for size in ["files of 1024 bytes", "files of 65536 bytes"] {
        assert!(stdout.contains(size), "no table {size:?}:\n{stdout}");
    }
    for row in [
        "| nginx | ab",
        "| nginx | wrk",
        "| Apache | ab",
        "| Apache | wrk",
        "| kintsugi, tracking on | ab",
        "| kintsugi, tracking off | wrk",
        "| kintsugi, tracking on, faults |",
    ] {
        assert!(stdout.contains(row), "no row {row:?}:\n{stdout}");
    }
    let faults = stdout
        .lines()
        .find(|l| l.starts_with("faults: "))
        .expect("a faults line");
    assert!(
        faults.contains("netd@") && faults.contains("httpd@"),
        "{faults}"
    );
    let svg = std::fs::read_to_string(&plot).unwrap();
    assert!(
        svg.starts_with("<svg") && svg.contains("kill netd"),
        "{}",
        &svg[..svg.len().min(200)]
    );
    assert!(!stderr.contains("did not stop"), "{stderr}");
    let left: Vec<String> = std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| std::fs::read(e.ok()?.path().join("cmdline")).ok())
        .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
        .filter(|c| c.contains(&configs))
        .collect();
    assert!(left.is_empty(), "servers left running: {left:?}");
    assert!(leftovers(&tag).is_empty());
}

/// Socket activation: the listener a service manager opened (here the
/// test, passing it at fd 3 with `LISTEN_FDS`, `LISTEN_PID` and
/// `LISTEN_FDNAMES` as systemd sets them) is netd's from the start: a
/// request sent before the system ran waits in the kernel's backlog and is
/// answered, and the port in netd's config is never bound.
#[test]
fn netd_serves_the_listener_a_service_manager_passed() {
    let tag = unique_tag("web-activation");
    let dir = scratch("web-activation");
    let root = dir.join("root");
    let files = docroot(&root, 11);
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let configured = free_port();
    let mut early = TcpStream::connect(("127.0.0.1", port)).unwrap();
    early
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    write!(
        early,
        "GET /page.html HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let inner = run_system(&tag, &system());
    let mut cmd = std::process::Command::new("bash");
    cmd.arg("-c")
        .arg(r#"exec 3<&0 0</dev/null; LISTEN_PID=$$ LISTEN_FDS=1 LISTEN_FDNAMES=http exec "$@""#)
        .arg("bash")
        .arg(inner.get_program())
        .args(inner.get_args())
        .arg("--set")
        .arg(format!(
            "httpd.docroot={}",
            root.canonicalize().unwrap().display()
        ))
        .arg("--set")
        .arg(format!("netd.port={configured}"))
        .env("XDG_RUNTIME_DIR", &dir)
        .stdin(Stdio::from(std::os::fd::OwnedFd::from(listener)))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in inner.get_envs() {
        match v {
            Some(v) => cmd.env(k, v),
            None => cmd.env_remove(k),
        };
    }
    let child = cmd.spawn().unwrap();
    let answer = read_response(&mut early, false);
    let refused = TcpStream::connect(("127.0.0.1", configured)).is_err();
    let _ = rustix::process::kill_process(
        rustix::process::Pid::from_child(&child),
        rustix::process::Signal::TERM,
    );
    let out = child.wait_with_output().unwrap();
    let (_, stderr) = text(&out);
    let answer = answer.unwrap_or_else(|e| panic!("{e}\n{stderr}"));
    let page = &files.iter().find(|(p, _)| p == "/page.html").unwrap().1;
    assert_eq!(answer.status, 200, "{stderr}");
    assert!(answer.body == *page, "the page, byte for byte");
    assert!(refused, "netd.port was bound too");
    assert!(leftovers(&tag).is_empty(), "processes left behind");
}

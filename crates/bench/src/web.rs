//! `kintsugi bench web`: the SuperGlue web benchmark (Figure 7). nginx,
//! Apache httpd and kintsugi's web server (systems/web.toml, with recovery
//! tracking on and off) serve the same files on 127.0.0.1; `ab` and `wrk`
//! (keep-alive) measure each; then kintsugi serves `ab` for a while with a
//! SIGKILL every few seconds into a different system component (round
//! robin, through the roster's live pids) while httpd's `requests` counter
//! is sampled every 100 ms. Prints a markdown table and writes an SVG plot
//! of throughput over time with the faults marked. Every server it starts
//! is stopped when it ends, also on an error or Ctrl-C.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use kintsugi_supervisor::{Event, Options, Roster};

const WEB_SYSTEM: &str = include_str!("../../../systems/web.toml");
/// How often the fault run samples httpd's `requests` counter.
const SAMPLE: Duration = Duration::from_millis(100);

#[derive(Args, Debug)]
pub struct WebArgs {
    /// Requests per `ab` run.
    #[arg(long, default_value_t = 50_000)]
    pub requests: u64,
    /// `ab` runs per server and configuration.
    #[arg(long, default_value_t = 5)]
    pub repeats: u32,
    /// Concurrent connections of `ab` and `wrk`.
    #[arg(long, default_value_t = 10)]
    pub concurrency: u32,
    /// Seconds of each `wrk` run (0: no `wrk` runs).
    #[arg(long, default_value_t = 10)]
    pub wrk_secs: u32,
    /// Seconds of the run with faults (the default leaves room for one
    /// fault into each of the seven components).
    #[arg(long, default_value_t = 75)]
    pub fault_secs: u32,
    /// Seconds between faults.
    #[arg(long, default_value_t = 10.0)]
    pub fault_every: f64,
    /// Components the fault run kills, round robin (default: every one,
    /// netd and httpd first).
    #[arg(long, value_delimiter = ',')]
    pub fault_into: Vec<String>,
    /// Sizes of the files served, in bytes: one table per size (the fault
    /// run serves the first).
    #[arg(long, value_delimiter = ',', default_value = "1024")]
    pub file_bytes: Vec<usize>,
    /// Where the SVG plot goes.
    #[arg(long, default_value = "web-bench.svg")]
    pub plot: PathBuf,
}

/// A server process this command started; stopped (SIGTERM, then SIGKILL)
/// when dropped.
struct Server {
    name: &'static str,
    child: Child,
}

impl Server {
    /// Fails once the process has exited (or on Ctrl-C).
    fn alive(&mut self, stop: &Interrupt) -> anyhow::Result<()> {
        stop.check()?;
        if let Some(status) = self.child.try_wait()? {
            let mut err = String::new();
            if let Some(mut e) = self.child.stderr.take() {
                let _ = std::io::Read::read_to_string(&mut e, &mut err);
            }
            bail!("{} exited ({status}): {}", self.name, err.trim());
        }
        Ok(())
    }

    fn spawn(name: &'static str, cmd: &mut Command) -> anyhow::Result<Self> {
        // Its own process group: a Ctrl-C reaches this command, which stops it.
        let child = std::os::unix::process::CommandExt::process_group(cmd, 0)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {name}"))?;
        Ok(Self { name, child })
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let pid = rustix::process::Pid::from_child(&self.child);
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        eprintln!("{} did not stop on SIGTERM: killed", self.name);
    }
}

/// The bench's scratch directory, removed when dropped.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// kintsugi's web server running in process, with the roster's live view.
struct Kintsugi {
    roster: Arc<Roster>,
    events: Arc<Mutex<Vec<Event>>>,
    thread: Option<std::thread::JoinHandle<anyhow::Result<()>>>,
}

impl Kintsugi {
    fn start(docroot: &Path, port: u16, tracking: bool) -> anyhow::Result<Self> {
        let mut system = crate::parse_system("systems/web.toml", WEB_SYSTEM)?;
        let netd = system.component_mut("netd").context("web.toml has netd")?;
        netd.set_config("port", port.into());
        netd.set_config("tracking", tracking.into());
        let docroot = docroot.canonicalize().context("the docroot")?;
        system
            .component_mut("httpd")
            .context("web.toml has httpd")?
            .set_config("docroot", docroot.to_string_lossy().into_owned().into());
        let roster = Roster::new();
        let events = Arc::new(Mutex::new(Vec::new()));
        let options = Options {
            roster: Some(roster.clone()),
            interfaces: kintsugi_interfaces::ALL.to_vec(),
            component_stdout: kintsugi_supervisor::ComponentStdout::Stderr,
            ..Options::default()
        };
        let sink = events.clone();
        let thread = std::thread::Builder::new()
            .name("supervisor".into())
            .spawn(move || {
                let report = kintsugi_supervisor::run(&system, options, &mut |e| {
                    sink.lock().unwrap().push(e.clone())
                })?;
                anyhow::ensure!(report.success(), "kintsugi's web server: {report:?}");
                Ok(())
            })?;
        Ok(Self {
            roster,
            events,
            thread: Some(thread),
        })
    }

    /// Fails once the system has stopped (or on Ctrl-C).
    fn alive(&self, stop: &Interrupt) -> anyhow::Result<()> {
        stop.check()?;
        if self.thread.as_ref().is_none_or(|t| t.is_finished()) {
            bail!("kintsugi's web server stopped");
        }
        Ok(())
    }

    /// Stops the system; its outcome.
    fn stop(mut self) -> anyhow::Result<()> {
        self.roster.request_stop();
        self.thread
            .take()
            .expect("running")
            .join()
            .expect("supervisor thread")
    }

    /// Components rebooted since the start, in order.
    fn reboots(&self) -> Vec<String> {
        self.events
            .lock()
            .unwrap()
            .iter()
            .filter_map(|e| match e {
                Event::Rebooted { component, .. } => Some(component.clone()),
                _ => None,
            })
            .collect()
    }
}

impl Drop for Kintsugi {
    fn drop(&mut self) {
        if let Some(t) = self.thread.take() {
            self.roster.request_stop();
            let _ = t.join();
        }
    }
}

/// One load generator run.
#[derive(Debug, Clone, Copy)]
struct Measured {
    rps: f64,
    failed: u64,
    /// What the machine did per request besides the load generator.
    cost: Cost,
}

/// The whole machine's busy CPU time and context switches so far
/// (`/proc/stat`), and the CPU time of the commands this process has
/// waited for (the load generators).
#[derive(Debug, Clone, Copy, Default)]
struct Usage {
    busy_us: f64,
    switches: f64,
    children_us: f64,
}

impl Usage {
    fn now() -> Self {
        let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
        let mut u = Usage::default();
        for line in stat.lines() {
            let mut words = line.split_whitespace();
            match words.next() {
                // user nice system idle iowait irq softirq steal ...: busy
                // is all but idle, iowait and steal, in USER_HZ (100) ticks.
                Some("cpu") => {
                    let t: Vec<f64> = words.filter_map(|w| w.parse().ok()).collect();
                    let busy = [0, 1, 2, 5, 6]
                        .iter()
                        .filter_map(|&i| t.get(i))
                        .sum::<f64>();
                    u.busy_us = busy * 10_000.0;
                }
                Some("ctxt") => {
                    u.switches = words.next().and_then(|w| w.parse().ok()).unwrap_or(0.0)
                }
                _ => {}
            }
        }
        if let Ok(r) = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_CHILDREN)
        {
            let us = |t: nix::sys::time::TimeVal| t.tv_sec() as f64 * 1e6 + t.tv_usec() as f64;
            u.children_us = us(r.user_time()) + us(r.system_time());
        }
        u
    }

    /// What happened since `before`, per request of `requests`.
    fn per_request(self, before: Usage, requests: f64) -> Cost {
        let n = requests.max(1.0);
        Cost {
            cpu_us: ((self.busy_us - before.busy_us) - (self.children_us - before.children_us))
                .max(0.0)
                / n,
            switches: (self.switches - before.switches) / n,
        }
    }
}

/// Per request, on the whole machine but the load generator: CPU time
/// (µs; 10 ms ticks, so runs of thousands of requests) and context
/// switches (the load generator's included).
#[derive(Debug, Clone, Copy, Default)]
struct Cost {
    cpu_us: f64,
    switches: f64,
}

/// Set on Ctrl-C (or SIGTERM): the bench stops at the next step.
struct Interrupt(Arc<AtomicBool>);

impl Interrupt {
    fn install() -> anyhow::Result<Self> {
        let flag = Arc::new(AtomicBool::new(false));
        for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
            signal_hook::flag::register(sig, flag.clone())?;
        }
        Ok(Self(flag))
    }

    fn check(&self) -> anyhow::Result<()> {
        if self.0.load(Ordering::SeqCst) {
            bail!("interrupted");
        }
        Ok(())
    }
}

/// Runs a load generator to its end, or kills it on Ctrl-C.
fn output_of(cmd: &mut Command, stop: &Interrupt) -> anyhow::Result<String> {
    let program = cmd.get_program().to_string_lossy().into_owned();
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("running {program} (apt-get install apache2-utils wrk)"))?;
    fn drain(mut from: impl std::io::Read + Send + 'static) -> std::thread::JoinHandle<String> {
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = from.read_to_string(&mut s);
            s
        })
    }
    let out = drain(child.stdout.take().expect("piped"));
    let err = drain(child.stderr.take().expect("piped"));
    loop {
        if let Some(status) = child.try_wait()? {
            let (text, err) = (out.join().expect("reader"), err.join().expect("reader"));
            if !status.success() {
                bail!("{program} failed ({status}): {}{}", err.trim(), text.trim());
            }
            return Ok(text);
        }
        if stop.check().is_err() {
            let _ = child.kill();
            let _ = child.wait();
            stop.check()?;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The number after `label` on the line that starts with it.
fn field(text: &str, label: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.trim_start().strip_prefix(label))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.trim_end_matches(',').parse().ok())
}

/// `ab -n requests -c concurrency` (or for `secs` seconds); failed
/// requests include non-2xx responses.
fn ab(url: &str, args: &WebArgs, secs: Option<u32>, stop: &Interrupt) -> anyhow::Result<Measured> {
    let mut cmd = Command::new("ab");
    cmd.arg("-q")
        .arg("-r")
        .arg("-c")
        .arg(args.concurrency.to_string());
    match secs {
        // ab ends at whichever comes first; its per-request table is
        // allocated for `-n` but only touched as it fills.
        Some(s) => cmd
            .arg("-t")
            .arg(s.to_string())
            .arg("-n")
            .arg((u64::from(s) * 200_000).to_string()),
        None => cmd.arg("-n").arg(args.requests.to_string()),
    };
    let before = Usage::now();
    let text = output_of(cmd.arg(url), stop)?;
    let rps = field(&text, "Requests per second:")
        .with_context(|| format!("ab printed no rate:\n{text}"))?;
    let failed = field(&text, "Failed requests:").unwrap_or(0.0)
        + field(&text, "Non-2xx responses:").unwrap_or(0.0);
    let requests = field(&text, "Complete requests:").unwrap_or(0.0);
    Ok(Measured {
        rps,
        failed: failed as u64,
        cost: Usage::now().per_request(before, requests),
    })
}

/// `wrk` with keep-alive connections; failed requests are socket errors and
/// non-2xx/3xx responses.
fn wrk(url: &str, args: &WebArgs, stop: &Interrupt) -> anyhow::Result<Measured> {
    let threads = args.concurrency.clamp(1, 2);
    let before = Usage::now();
    let text = output_of(
        Command::new("wrk")
            .arg("-t")
            .arg(threads.to_string())
            .arg("-c")
            .arg(args.concurrency.to_string())
            .arg("-d")
            .arg(format!("{}s", args.wrk_secs))
            .arg(url),
        stop,
    )?;
    let rps =
        field(&text, "Requests/sec:").with_context(|| format!("wrk printed no rate:\n{text}"))?;
    let mut failed = field(&text, "Non-2xx or 3xx responses:").unwrap_or(0.0);
    if let Some(line) = text
        .lines()
        .find(|l| l.trim_start().starts_with("Socket errors:"))
    {
        failed += line
            .split(',')
            .filter_map(|p| p.split_whitespace().last()?.parse::<f64>().ok())
            .sum::<f64>();
    }
    // "  123456 requests in 5.00s, …"
    let requests = text
        .lines()
        .find_map(|l| l.trim_start().split_once(" requests in "))
        .and_then(|(n, _)| n.trim().parse().ok())
        .unwrap_or(0.0);
    Ok(Measured {
        rps,
        failed: failed as u64,
        cost: Usage::now().per_request(before, requests),
    })
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Waits until `port` serves `/index.html` with status 200; `alive` fails
/// once the server is gone.
fn wait_ready(
    name: &str,
    port: u16,
    alive: &mut dyn FnMut() -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
            use std::io::{Read, Write};
            s.set_read_timeout(Some(Duration::from_secs(2)))?;
            let _ = s.write_all(b"GET /index.html HTTP/1.0\r\n\r\n");
            let mut head = [0u8; 12];
            if s.read_exact(&mut head).is_ok() && &head[9..12] == b"200" {
                return Ok(());
            }
        }
        alive()?;
        if Instant::now() > deadline {
            bail!("{name} did not serve /index.html on 127.0.0.1:{port} within 20 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A server's error log, for an error message.
fn log_of(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    format!("{}: {}", path.display(), text.trim())
}

fn start_nginx(dir: &Path, docroot: &Path, port: u16, stop: &Interrupt) -> anyhow::Result<Server> {
    let d = dir.display();
    let conf = format!(
        "daemon off;\nworker_processes auto;\npid {d}/nginx.pid;\nerror_log {d}/nginx-error.log;\n\
         events {{ worker_connections 1024; }}\n\
         http {{\n  access_log off;\n  sendfile on;\n  keepalive_requests 1000000;\n  default_type text/html;\n\
           client_body_temp_path {d}/nginx-body;\n  proxy_temp_path {d}/nginx-proxy;\n  fastcgi_temp_path {d}/nginx-fastcgi;\n\
           uwsgi_temp_path {d}/nginx-uwsgi;\n  scgi_temp_path {d}/nginx-scgi;\n\
           server {{ listen 127.0.0.1:{port}; root {}; }}\n}}\n",
        docroot.display()
    );
    let path = dir.join("nginx.conf");
    std::fs::write(&path, conf)?;
    let mut s = Server::spawn(
        "nginx",
        Command::new("nginx")
            .arg("-p")
            .arg(dir)
            .arg("-e")
            .arg(dir.join("nginx-error.log"))
            .arg("-c")
            .arg(&path),
    )?;
    wait_ready("nginx", port, &mut || s.alive(stop))
        .with_context(|| log_of(&dir.join("nginx-error.log")))?;
    Ok(s)
}

fn start_apache(dir: &Path, docroot: &Path, port: u16, stop: &Interrupt) -> anyhow::Result<Server> {
    let d = dir.display();
    let m = "/usr/lib/apache2/modules";
    let user = if rustix::process::geteuid().is_root() {
        "User nobody\nGroup nogroup\n"
    } else {
        ""
    };
    let conf = format!(
        "ServerRoot {d}\nServerName localhost\nListen 127.0.0.1:{port}\nPidFile {d}/apache.pid\n\
         ErrorLog {d}/apache-error.log\nDefaultRuntimeDir {d}\nMutex file:{d} default\n\
         LoadModule mpm_event_module {m}/mod_mpm_event.so\n\
         LoadModule authz_core_module {m}/mod_authz_core.so\nLoadModule dir_module {m}/mod_dir.so\n\
         LoadModule mime_module {m}/mod_mime.so\n{user}\
         TypesConfig /dev/null\nAddType text/html .html\nKeepAlive On\nMaxKeepAliveRequests 0\nDocumentRoot {r}\n\
         <Directory {r}>\n  Require all granted\n</Directory>\nDirectoryIndex index.html\n",
        r = docroot.display()
    );
    let path = dir.join("apache.conf");
    std::fs::write(&path, conf)?;
    let mut s = Server::spawn(
        "Apache",
        Command::new("apache2")
            .arg("-f")
            .arg(&path)
            .arg("-D")
            .arg("FOREGROUND"),
    )?;
    wait_ready("Apache", port, &mut || s.alive(stop))
        .with_context(|| log_of(&dir.join("apache-error.log")))?;
    Ok(s)
}

/// One row of the table.
struct Row {
    server: String,
    tool: &'static str,
    /// The size of the file served.
    bytes: usize,
    runs: Vec<Measured>,
}

impl Row {
    fn mean(&self) -> f64 {
        self.runs.iter().map(|m| m.rps).sum::<f64>() / self.runs.len() as f64
    }

    fn stddev(&self) -> f64 {
        let m = self.mean();
        let n = self.runs.len() as f64;
        (self.runs.iter().map(|r| (r.rps - m).powi(2)).sum::<f64>() / (n - 1.0).max(1.0)).sqrt()
    }

    fn failed(&self) -> u64 {
        self.runs.iter().map(|m| m.failed).sum()
    }

    /// The runs' mean cost per request.
    fn cost(&self) -> Cost {
        let n = self.runs.len() as f64;
        Cost {
            cpu_us: self.runs.iter().map(|m| m.cost.cpu_us).sum::<f64>() / n,
            switches: self.runs.iter().map(|m| m.cost.switches).sum::<f64>() / n,
        }
    }
}

/// Throughput over time of one configuration, from the `requests` counter.
struct Series {
    name: String,
    /// (seconds since the start, requests per second in the last sample period)
    points: Vec<(f64, f64)>,
    /// (seconds since the start, component) of each fault.
    faults: Vec<(f64, String)>,
}

/// Samples httpd's `requests` counter every 100 ms until `done`.
fn sample(roster: &Roster, done: &AtomicBool) -> Vec<(f64, f64)> {
    let start = Instant::now();
    let mut last = roster.counter("httpd", "requests");
    let mut points = Vec::new();
    let mut next = start + SAMPLE;
    while !done.load(Ordering::SeqCst) {
        std::thread::sleep(next.saturating_duration_since(Instant::now()));
        let now = roster.counter("httpd", "requests");
        let t = next.duration_since(start).as_secs_f64();
        points.push((t, now.saturating_sub(last) as f64 / SAMPLE.as_secs_f64()));
        last = now;
        next += SAMPLE;
    }
    points
}

pub fn web(args: WebArgs) -> anyhow::Result<bool> {
    anyhow::ensure!(
        args.repeats >= 1 && args.requests >= 1,
        "--repeats and --requests must be at least 1"
    );
    anyhow::ensure!(args.fault_every > 0.0, "--fault-every must be positive");
    anyhow::ensure!(!args.file_bytes.is_empty(), "--file-bytes needs a size");
    if std::env::var_os("KINTSUGI_LOG").is_none() {
        // The components' logs would tear the progress bar.
        std::env::set_var("KINTSUGI_LOG", "warn");
    }
    let stop = Interrupt::install()?;
    let scratch =
        Scratch(std::env::temp_dir().join(format!("kintsugi-bench-web-{}", std::process::id())));
    let dir = &scratch.0;
    let docroot = dir.join("www");
    std::fs::create_dir_all(&docroot)?;
    // nginx's and Apache's workers run as nobody: they must read the files.
    std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    // What `wait_ready` asks for.
    std::fs::write(docroot.join("index.html"), b"kintsugi web bench\n")?;
    for &bytes in &args.file_bytes {
        let body: Vec<u8> = (0..bytes)
            .map(|i| b"kintsugi web bench\n"[i % 19])
            .collect();
        std::fs::write(docroot.join(file_of(bytes)), &body)?;
    }
    println!(
        "kintsugi bench web: ab -n {} -c {} x {} and wrk -c {} for {} s (keep-alive) against nginx, Apache and",
        args.requests, args.concurrency, args.repeats, args.concurrency, args.wrk_secs
    );
    println!(
        "kintsugi's web server (tracking on and off), all serving files of {:?} bytes on 127.0.0.1; then kintsugi under",
        args.file_bytes
    );
    let into = match args.fault_into.is_empty() {
        true => "a different system component".to_string(),
        false => args.fault_into.join(", "),
    };
    println!(
        "ab for {} s with a SIGKILL every {} s into {into}.\n",
        args.fault_secs, args.fault_every
    );
    let wrk_runs = u64::from(args.wrk_secs > 0);
    let sizes = args.file_bytes.len() as u64;
    let steps = 4 * sizes * (u64::from(args.repeats) + wrk_runs) + 1;
    let bar = ProgressBar::new(steps).with_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} {msg}")
            .expect("template")
            .progress_chars("=> "),
    );
    let mut rows: Vec<Row> = Vec::new();
    let mut series: Vec<Series> = Vec::new();
    // Runs ab `repeats` times and wrk once against `port`, per file size.
    let measure = |name: &str, port: u16, rows: &mut Vec<Row>| -> anyhow::Result<()> {
        for &bytes in &args.file_bytes {
            let url = url_of(port, bytes);
            let mut runs = Vec::new();
            for i in 0..args.repeats {
                bar.set_message(format!(
                    "{name}, {bytes} B: ab run {}/{}",
                    i + 1,
                    args.repeats
                ));
                runs.push(ab(&url, &args, None, &stop)?);
                bar.inc(1);
            }
            rows.push(Row {
                server: name.to_string(),
                tool: "ab",
                bytes,
                runs,
            });
            if args.wrk_secs > 0 {
                bar.set_message(format!("{name}, {bytes} B: wrk"));
                let run = wrk(&url, &args, &stop)?;
                rows.push(Row {
                    server: name.to_string(),
                    tool: "wrk",
                    bytes,
                    runs: vec![run],
                });
                bar.inc(1);
            }
        }
        Ok(())
    };
    for (name, start) in [
        (
            "nginx",
            start_nginx as fn(&Path, &Path, u16, &Interrupt) -> anyhow::Result<Server>,
        ),
        ("Apache", start_apache),
    ] {
        stop.check()?;
        bar.set_message(format!("starting {name}"));
        let port = free_port()?;
        let server = start(dir, &docroot, port, &stop)?;
        measure(name, port, &mut rows)?;
        drop(server);
    }
    for tracking in [true, false] {
        stop.check()?;
        let name = format!("kintsugi, tracking {}", if tracking { "on" } else { "off" });
        bar.set_message(format!("starting {name}"));
        let port = free_port()?;
        let k = Kintsugi::start(&docroot, port, tracking)?;
        wait_ready(&name, port, &mut || k.alive(&stop))?;
        let done = AtomicBool::new(false);
        let points = std::thread::scope(|s| {
            let sampler = s.spawn(|| sample(&k.roster, &done));
            let r = measure(&name, port, &mut rows);
            done.store(true, Ordering::SeqCst);
            r.map(|()| sampler.join().expect("sampler"))
        })?;
        series.push(Series {
            name,
            points,
            faults: Vec::new(),
        });
        k.stop()?;
    }
    stop.check()?;
    let faults = fault_run(&args, &docroot, &stop, &bar)?;
    bar.inc(1);
    bar.finish_and_clear();
    let (fault_row, fault_series, reboots) = faults;
    rows.push(fault_row);
    series.push(fault_series);
    print_table(&rows, &args);
    let ok = print_faults(&rows, &series, &reboots, &args);
    plot(&args.plot, &series, &rows)?;
    println!("\nplot: {}", args.plot.display());
    Ok(ok)
}

/// kintsugi under `ab` for `fault_secs` with a SIGKILL every `fault_every`
/// seconds into the next system component, round robin.
fn fault_run(
    args: &WebArgs,
    docroot: &Path,
    stop: &Interrupt,
    bar: &ProgressBar,
) -> anyhow::Result<(Row, Series, Vec<String>)> {
    let port = free_port()?;
    let k = Kintsugi::start(docroot, port, true)?;
    wait_ready("kintsugi", port, &mut || k.alive(stop))?;
    // netd and httpd first, then the system services in start order.
    let mut victims: Vec<String> = k.roster.members().into_iter().map(|m| m.name).collect();
    victims.sort_by_key(|v| [v != "netd", v != "httpd"]);
    if !args.fault_into.is_empty() {
        if let Some(unknown) = args.fault_into.iter().find(|v| !victims.contains(v)) {
            bail!(
                "--fault-into {unknown}: the web system has {}",
                victims.join(", ")
            );
        }
        victims.clone_from(&args.fault_into);
    }
    let done = AtomicBool::new(false);
    let injected: Mutex<Vec<(f64, String)>> = Mutex::new(Vec::new());
    let start = Instant::now();
    let (run, points) = std::thread::scope(|s| {
        let sampler = s.spawn(|| sample(&k.roster, &done));
        let injector = s.spawn(|| {
            let mut next = Duration::from_secs_f64(args.fault_every);
            let mut i = 0;
            while !done.load(Ordering::SeqCst) {
                if start.elapsed() < next {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                }
                let name = &victims[i % victims.len()];
                i += 1;
                next += Duration::from_secs_f64(args.fault_every);
                if let Some(pid) = k.roster.member(name).and_then(|m| m.pid) {
                    let pid = rustix::process::Pid::from_raw(pid as i32).expect("a pid");
                    if rustix::process::kill_process(pid, rustix::process::Signal::KILL).is_ok() {
                        injected
                            .lock()
                            .unwrap()
                            .push((start.elapsed().as_secs_f64(), name.clone()));
                    }
                }
                bar.set_message(format!("kintsugi with faults: killed {name}"));
            }
        });
        bar.set_message("kintsugi with faults");
        let run = ab(
            &url_of(port, args.file_bytes[0]),
            args,
            Some(args.fault_secs),
            stop,
        );
        done.store(true, Ordering::SeqCst);
        injector.join().expect("injector");
        run.map(|r| (r, sampler.join().expect("sampler")))
    })?;
    let reboots = k.reboots();
    k.stop()?;
    let faults = injected.into_inner().unwrap();
    let row = Row {
        server: "kintsugi, tracking on, faults".into(),
        tool: "ab -t",
        bytes: args.file_bytes[0],
        runs: vec![run],
    };
    let series = Series {
        name: "kintsugi, faults".into(),
        points,
        faults,
    };
    Ok((row, series, reboots))
}

/// The file of `bytes` bytes in the docroot.
fn file_of(bytes: usize) -> String {
    format!("{bytes}.html")
}

fn url_of(port: u16, bytes: usize) -> String {
    format!("http://127.0.0.1:{port}/{}", file_of(bytes))
}

/// The mean of the row of `server` and `tool` for files of `bytes`.
fn mean_of(rows: &[Row], server: &str, tool: &str, bytes: usize) -> Option<f64> {
    rows.iter()
        .find(|r| r.server == server && r.tool == tool && r.bytes == bytes)
        .map(Row::mean)
}

/// One table per file size.
fn print_table(rows: &[Row], args: &WebArgs) {
    for &bytes in &args.file_bytes {
        println!("\nfiles of {bytes} bytes:\n");
        let sized: Vec<&Row> = rows.iter().filter(|r| r.bytes == bytes).collect();
        print_sized(rows, &sized, bytes, args);
    }
}

fn print_sized(rows: &[Row], sized: &[&Row], bytes: usize, args: &WebArgs) {
    let base = |server: &str, tool: &str| mean_of(rows, server, tool, bytes);
    println!(
        "| server | load | runs | req/s (mean ± sd) | vs nginx | vs Apache | failed requests | CPU µs per request | context switches per request |"
    );
    println!("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for r in sized {
        // The fault run is compared with the servers' ab figures.
        let tool = if r.tool == "wrk" { "wrk" } else { "ab" };
        let ratio = |b: Option<f64>| b.map_or("–".into(), |b| format!("{:.2}", r.mean() / b));
        let load = match r.tool {
            "ab" => format!("ab -n {} -c {}", args.requests, args.concurrency),
            "wrk" => format!(
                "wrk -c {}, {} s, keep-alive",
                args.concurrency, args.wrk_secs
            ),
            _ => format!(
                "ab -c {} for {} s, kill every {} s",
                args.concurrency, args.fault_secs, args.fault_every
            ),
        };
        let sd = match r.runs.len() {
            1 => String::new(),
            _ => format!(" ± {:.0}", r.stddev()),
        };
        // Under faults the incarnations killed and reaped (by the
        // supervisor, in this process) count as waited-for commands.
        let cost = match r.tool {
            "ab" | "wrk" => {
                let c = r.cost();
                format!("{:.0} | {:.1}", c.cpu_us, c.switches)
            }
            _ => "– | –".to_string(),
        };
        println!(
            "| {} | {load} | {} | {:.0}{sd} | {} | {} | {} | {cost} |",
            r.server,
            r.runs.len(),
            r.mean(),
            ratio(base("nginx", tool)),
            ratio(base("Apache", tool)),
            r.failed(),
        );
    }
}

/// Tracking cost and the fault run's figures against the targets; false
/// if a request failed under faults.
fn print_faults(rows: &[Row], series: &[Series], reboots: &[String], args: &WebArgs) -> bool {
    let sizes = &args.file_bytes;
    println!();
    for &bytes in sizes {
        for tool in ["ab", "wrk"] {
            if let (Some(on), Some(off)) = (
                mean_of(rows, "kintsugi, tracking on", tool, bytes),
                mean_of(rows, "kintsugi, tracking off", tool, bytes),
            ) {
                println!(
                    "tracking cost ({tool}, {bytes} B): {:.1} % (target ≤ 5 %)",
                    (1.0 - on / off) * 100.0
                );
            }
        }
    }
    let mean = |server: &str, tool: &str| mean_of(rows, server, tool, sizes[0]);
    let faulted = series.last().expect("the fault run");
    let fault_row = rows.last().expect("the fault run");
    let names: Vec<String> = faulted
        .faults
        .iter()
        .map(|(t, c)| format!("{c}@{t:.1}s"))
        .collect();
    println!(
        "faults: {} ({}); reboots seen: {}",
        faulted.faults.len(),
        names.join(", "),
        reboots.len()
    );
    // The first sample is partial (ab started during it); so is any that
    // ends after ab's time limit (counted from the sampler's start, which
    // comes before ab's): there may be two, by how the periods fall.
    let steady: Vec<f64> = faulted
        .points
        .iter()
        .skip(1)
        .filter(|p| p.0 <= f64::from(args.fault_secs))
        .map(|p| p.1)
        .collect();
    if let (Some(base), false) = (mean("kintsugi, tracking on", "ab"), steady.is_empty()) {
        let m = steady.iter().sum::<f64>() / steady.len() as f64;
        let low = steady.iter().filter(|v| **v < m / 2.0).count();
        let longest = steady
            .split(|v| *v >= m / 2.0)
            .map(<[f64]>::len)
            .max()
            .unwrap_or(0);
        let loss = (1.0 - fault_row.mean() / base) * 100.0;
        let against = match loss >= 0.0 {
            true => format!("{loss:.1} % below"),
            false => format!("{:.1} % above", -loss),
        };
        println!(
            "under faults: {:.0} req/s by ab, {against} the run without faults (target: at most 3 % below); \
             {} failed requests (target 0);\n  of {} 100 ms samples (mean {m:.0} req/s), {low} under half the mean, \
             longest dip {} ms (target: none longer than 50 ms)",
            fault_row.mean(),
            fault_row.failed(),
            steady.len(),
            longest * SAMPLE.as_millis() as usize
        );
    }
    fault_row.failed() == 0
}

fn plot(path: &Path, series: &[Series], rows: &[Row]) -> anyhow::Result<()> {
    use plotters::prelude::*;
    let draw = || -> Result<(), Box<dyn std::error::Error>> {
        let root = SVGBackend::new(path, (1000, 520)).into_drawing_area();
        root.fill(&WHITE)?;
        let x_max = series
            .iter()
            .flat_map(|s| s.points.last().map(|p| p.0))
            .fold(1.0, f64::max);
        // The fault run serves the first size; so does its baseline.
        let first = rows.last().map_or(0, |r| r.bytes);
        let level = |server: &str| mean_of(rows, server, "ab", first);
        let y_max = series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.1))
            .chain(["nginx", "Apache"].into_iter().filter_map(level))
            .fold(1.0, f64::max)
            * 1.1;
        let mut chart = ChartBuilder::on(&root)
            .caption(
                "throughput over time (100 ms samples; faults marked)",
                ("sans-serif", 20),
            )
            .margin(10)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(0.0..x_max, 0.0..y_max)?;
        chart
            .configure_mesh()
            .x_desc("seconds since the configuration's first request")
            .y_desc("requests per second")
            .draw()?;
        let colors = [BLUE, GREEN, RED, MAGENTA, CYAN];
        for (i, s) in series.iter().enumerate() {
            let color = colors[i % colors.len()];
            chart
                .draw_series(LineSeries::new(
                    s.points.iter().copied(),
                    color.stroke_width(1),
                ))?
                .label(s.name.clone())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
            for (t, c) in &s.faults {
                chart.draw_series(LineSeries::new(
                    vec![(*t, 0.0), (*t, y_max)],
                    BLACK.mix(0.5),
                ))?;
                chart.draw_series(std::iter::once(Text::new(
                    format!("kill {c}"),
                    (*t, y_max * 0.97),
                    ("sans-serif", 12),
                )))?;
            }
        }
        for (server, color) in [
            ("nginx", RGBColor(120, 120, 120)),
            ("Apache", RGBColor(200, 140, 0)),
        ] {
            if let Some(y) = level(server) {
                chart
                    .draw_series(LineSeries::new(
                        vec![(0.0, y), (x_max, y)],
                        color.stroke_width(2),
                    ))?
                    .label(format!("{server} (mean of ab runs)"))
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
            }
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::LowerRight)
            .draw()?;
        root.present()?;
        Ok(())
    };
    draw().map_err(|e| anyhow::anyhow!("plot {}: {e}", path.display()))
}

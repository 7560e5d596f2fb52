//! `kintsugi bench recovery` (C3's Table I on this machine) and `kintsugi
//! bench interference` (does recovering other clients' descriptors delay a
//! high-priority client?). Both run the supervisor in process on an
//! embedded system file, with `components/bench/recovery-driver` as the client,
//! and print markdown tables.

use std::path::PathBuf;
use std::time::Duration;

use kintsugi_supervisor::{Event, Options};
use kintsugi_system::{RecoveryMode, System};

use crate::{kill_repeatedly, parse_system, run_collecting};
use kintsugi_supervisor::stats::Summary;

const TABLE1_SYSTEM: &str = include_str!("../../../systems/bench-table1.toml");
const INTERFERENCE_SYSTEM: &str = include_str!("../../../systems/bench-interference.toml");

/// The services of Table I: the name the driver knows, and the component.
const SERVICES: [(&str, &str); 5] = [
    ("fs", "ramfs"),
    ("lock", "lock"),
    ("evt", "evt"),
    ("timer", "timer"),
    ("mm", "mm"),
];

/// A scratch file (a driver's JSON lines, or a holder's announcement), removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(what: &str) -> Self {
        let path =
            std::env::temp_dir().join(format!("kintsugi-bench-{what}-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        Self(path)
    }

    fn value(&self) -> serde_json::Value {
        self.0.display().to_string().into()
    }

    fn lines(&self) -> anyhow::Result<Vec<serde_json::Value>> {
        let text = std::fs::read_to_string(&self.0)
            .map_err(|e| anyhow::anyhow!("{}: {e}", self.0.display()))?;
        Ok(text
            .lines()
            .map(serde_json::from_str)
            .collect::<Result<_, _>>()?)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A number at `path` (keys separated by '.') of a JSON line.
fn num(v: &serde_json::Value, path: &str) -> anyhow::Result<f64> {
    path.split('.')
        .try_fold(v, |v, k| v.get(k))
        .and_then(serde_json::Value::as_f64)
        .ok_or_else(|| anyhow::anyhow!("driver line without `{path}`: {v}"))
}

fn summary(what: &str, samples: &[f64]) -> anyhow::Result<Summary> {
    Summary::of(samples).ok_or_else(|| anyhow::anyhow!("no samples of {what}"))
}

/// The reboots of `component`: (memory restoration, init) in µs.
fn reboots(events: &[Event], component: &str) -> Vec<(f64, f64)> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Rebooted {
                component: c,
                took,
                init,
                ..
            } if c == component => Some((
                took.saturating_sub(*init).as_nanos() as f64 / 1e3,
                init.as_nanos() as f64 / 1e3,
            )),
            _ => None,
        })
        .collect()
}

/// One service's figures from one run of the recovery benchmark.
struct ServiceRow {
    service: &'static str,
    call: String,
    /// Micro-reboots: memory and execution re-initialization, and their sum (µs).
    memory: Summary,
    init: Summary,
    total: Summary,
    /// Per round, per descriptor (µs): first call, steady call, for each thread.
    hp_first: Vec<f64>,
    hp_steady: Vec<f64>,
    be_first: Vec<f64>,
    be_steady: Vec<f64>,
    /// Per round, the median descriptor's first and steady call (µs).
    hp_first_p50: Vec<f64>,
    hp_steady_p50: Vec<f64>,
    be_timed: Vec<f64>,
    priorities: (f64, f64),
    /// Means of the fastest 90 % of per-call times (ns).
    tracked: f64,
    raw: f64,
    null: f64,
}

impl ServiceRow {
    /// Runs the driver against `service` (served by `component`) with `kills` reboots.
    fn measure(
        service: &'static str,
        component: &str,
        kills: u32,
        descriptors: usize,
        hogs: usize,
        hp_fifo: Option<u8>,
    ) -> anyhow::Result<Self> {
        let out = Scratch::new(&format!("table1-{service}"));
        let mut system = parse_system("systems/bench-table1.toml", TABLE1_SYSTEM)?;
        let driver = system
            .component_mut("driver")
            .expect("bench-table1.toml has driver");
        driver.set_config("service", service.into());
        driver.set_config("descriptors", descriptors.into());
        driver.set_config("kills", kills.into());
        driver.set_config("hogs", hogs.into());
        if let Some(fifo) = hp_fifo {
            driver.set_config("hp_fifo", fifo.into());
        }
        driver.set_config("out", out.value());
        // A round lasts up to about 200 ms after a reboot; the next kill
        // comes later, so that none lands in a round (which would spoil it)
        // and no reboot competes with the hogs.
        let every = (Duration::from_millis(400), Duration::from_millis(600));
        let events = kill_repeatedly(
            &system,
            component,
            kills,
            every,
            Some("driver".into()),
            true,
        )?;
        let lines = out.lines()?;
        let (memory, init): (Vec<f64>, Vec<f64>) = reboots(&events, component).into_iter().unzip();
        let total: Vec<f64> = memory.iter().zip(&init).map(|(m, i)| m + i).collect();
        let rounds: Vec<&serde_json::Value> =
            lines.iter().filter(|l| l["kind"] == "round").collect();
        let column = |key: &str| -> anyhow::Result<Vec<f64>> {
            rounds.iter().map(|r| num(r, key)).collect()
        };
        let first = rounds
            .first()
            .ok_or_else(|| anyhow::anyhow!("{service}: no recovery round was measured"))?;
        let overhead = lines
            .iter()
            .find(|l| l["kind"] == "overhead")
            .ok_or_else(|| anyhow::anyhow!("{service}: the driver measured no overhead"))?;
        Ok(Self {
            service,
            call: overhead["call"].as_str().unwrap_or("?").to_string(),
            memory: summary("reboots", &memory)?,
            init: summary("reboots", &init)?,
            total: summary("reboots", &total)?,
            hp_first: column("hp.first_us")?,
            hp_steady: column("hp.steady_us")?,
            be_first: column("be.first_us")?,
            be_steady: column("be.steady_us")?,
            hp_first_p50: column("hp.first_p50_us")?,
            hp_steady_p50: column("hp.steady_p50_us")?,
            be_timed: column("be.measured")?,
            priorities: (num(first, "hp.nice")?, num(first, "be.nice")?),
            tracked: num(overhead, "tracked_ns")?,
            raw: num(overhead, "raw_ns")?,
            null: num(overhead, "null_ns")?,
        })
    }

    /// Per-descriptor recovery: the median over rounds of first − steady.
    fn recovery(first: &[f64], steady: &[f64]) -> f64 {
        let d: Vec<f64> = first.iter().zip(steady).map(|(f, s)| f - s).collect();
        Summary::of(&d).map_or(f64::NAN, |s| s.p50)
    }

    fn p50(v: &[f64]) -> f64 {
        Summary::of(v).map_or(f64::NAN, |s| s.p50)
    }
}

pub fn recovery(
    kills: u32,
    descriptors: usize,
    hogs: Option<usize>,
    hp_fifo: Option<u8>,
) -> anyhow::Result<bool> {
    anyhow::ensure!(
        kills > 0 && descriptors > 0,
        "--kills and --descriptors must be positive"
    );
    let hogs = hogs.unwrap_or_else(|| std::thread::available_parallelism().map_or(2, usize::from));
    let rows = SERVICES
        .into_iter()
        .map(|(service, component)| {
            ServiceRow::measure(service, component, kills, descriptors, hogs, hp_fifo)
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let (hp_nice, be_nice) = rows[0].priorities;
    println!("kintsugi bench recovery: per service, {kills} SIGKILLs at random instants while a client uses it.");
    println!("Micro-reboot: from the death's detection to the new incarnation's readiness, split into memory");
    println!(
        "re-initialization (waking the pristine warm standby) and execution re-initialization (the"
    );
    let hp = match hp_fifo {
        Some(p) => format!("SCHED_FIFO {p}"),
        None => format!("nice {hp_nice}"),
    };
    println!("component's init). Per-descriptor recovery: after each reboot a high-priority thread ({hp})");
    println!("and a best-effort thread (nice {be_nice}), each holding {descriptors} descriptors through a stub of its own,");
    println!("call each of them twice, at once, while {hogs} CPU hogs (nice 0) spin; the first call rebuilds the");
    println!("descriptor, and the difference to the second is its recovery (per descriptor, median over rounds).");
    println!("After 150 ms the hogs stop and each thread ends its pass, so a starved one times only some of its");
    println!("descriptors. Tracking overhead: the call through the generated stub against the same invocation");
    println!("through a raw `Connection::call`, means of the fastest 90 % of per-call times on the same connection; the null");
    println!("invocation (`bench.null`) of the same run gives the scale.\n");
    println!("| service | call | micro-reboot p50 µs: memory | execution (init) | total | recovery µs per descriptor: high priority | best effort | tracked ns | raw ns | tracking overhead ns | % of raw call | null invocation ns | overhead per invocation, % of null |");
    println!("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for r in &rows {
        // "take + release" is two invocations.
        let invocations = r.call.split(" + ").count() as f64;
        println!(
            "| {} | {} | {:.1} | {:.1} | {:.1} | {:.2} | {:.2} | {:.0} | {:.0} | {:+.0} | {:+.1} % | {:.0} | {:+.1} % |",
            r.service,
            r.call,
            r.memory.p50,
            r.init.p50,
            r.total.p50,
            ServiceRow::recovery(&r.hp_first, &r.hp_steady),
            ServiceRow::recovery(&r.be_first, &r.be_steady),
            r.tracked,
            r.raw,
            r.tracked - r.raw,
            (r.tracked - r.raw) / r.raw * 100.0,
            r.null,
            (r.tracked - r.raw) / invocations / r.null * 100.0,
        );
    }
    println!("\nThe recovery rounds in detail: per descriptor, medians over rounds of each round's mean (and, for the");
    println!("high-priority thread, of its median descriptor, which leaves out one-off delays such as waking the");
    println!("server's worker at the start of a pass).\n");
    println!("| service | rounds | high priority: first call µs | steady call µs | median descriptor: first call µs | steady call µs | best effort: first call µs | steady call µs | descriptors timed |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for r in &rows {
        let p50 = ServiceRow::p50;
        println!(
            "| {} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.0} |",
            r.service,
            r.hp_first.len(),
            p50(&r.hp_first),
            p50(&r.hp_steady),
            p50(&r.hp_first_p50),
            p50(&r.hp_steady_p50),
            p50(&r.be_first),
            p50(&r.be_steady),
            p50(&r.be_timed),
        );
    }
    Ok(true)
}

/// Runs `system` until `component` ends by itself; returns the events.
fn run_until_finished(system: &System, component: &str) -> anyhow::Result<Vec<Event>> {
    let options = Options {
        stop_when_finished: Some(component.into()),
        interfaces: kintsugi_interfaces::ALL.to_vec(),
        ..Options::default()
    };
    run_collecting(system, options)
}

pub fn interference(rounds: u32, sizes: &[usize]) -> anyhow::Result<bool> {
    anyhow::ensure!(
        rounds > 0 && !sizes.is_empty(),
        "--rounds and --descriptors must be given"
    );
    println!("kintsugi bench interference: a high-priority client (nice -10) crashes the bench server {rounds} times and");
    println!("times its first call after each crash (a `touch` of its own descriptor: reboot, rebuild, call), while two");
    println!("best-effort clients (nice 19) hold descriptors they do not use. With `recovery = \"eager\"` the new");
    println!("incarnation asks every client to rebuild all its descriptors and holds other calls until they are done;");
    println!("with `recovery = \"on-demand\"` a descriptor is rebuilt only when its holder next uses it.\n");
    println!("| descriptors held by best-effort clients | recovery | first call p50 µs | first call max µs | micro-reboot p50 µs | eager recovery p50 µs (descriptors rebuilt) |");
    println!("| ---: | --- | ---: | ---: | ---: | ---: |");
    for &size in sizes {
        for mode in [RecoveryMode::OnDemand, RecoveryMode::Eager] {
            let out = Scratch::new("interference");
            let ready = [Scratch::new("holder-a"), Scratch::new("holder-b")];
            let mut system = parse_system("systems/bench-interference.toml", INTERFERENCE_SYSTEM)?;
            system
                .component_mut("echo")
                .expect("bench-interference.toml has echo")
                .recovery = mode;
            for (holder, (file, n)) in ["holder-a", "holder-b"]
                .into_iter()
                .zip(ready.iter().zip([size - size / 2, size / 2]))
            {
                let h = system
                    .component_mut(holder)
                    .expect("bench-interference.toml has two holders");
                h.set_config("descriptors", n.into());
                h.set_config("ready", file.value());
            }
            let hp = system
                .component_mut("hp")
                .expect("bench-interference.toml has hp");
            hp.set_config("rounds", rounds.into());
            hp.set_config(
                "wait_for",
                serde_json::Value::Array(ready.iter().map(Scratch::value).collect()),
            );
            hp.set_config("out", out.value());
            let events = run_until_finished(&system, "hp")?;
            let first: Vec<f64> = out
                .lines()?
                .iter()
                .filter(|l| l["kind"] == "first-call")
                .map(|l| num(l, "first_us"))
                .collect::<anyhow::Result<_>>()?;
            let first = summary("first calls", &first)?;
            let reboot: Vec<f64> = reboots(&events, "echo")
                .iter()
                .map(|(m, i)| m + i)
                .collect();
            let eager: Vec<(f64, u64)> = events
                .iter()
                .filter_map(|e| match e {
                    Event::EagerRecovery {
                        took, descriptors, ..
                    } => Some((took.as_nanos() as f64 / 1e3, *descriptors)),
                    _ => None,
                })
                .collect();
            let eager = match Summary::of(&eager.iter().map(|e| e.0).collect::<Vec<_>>()) {
                Some(s) => format!(
                    "{:.0} ({})",
                    s.p50,
                    eager.iter().map(|e| e.1).max().unwrap_or(0)
                ),
                None => "–".into(),
            };
            println!(
                "| {size} | {} | {:.0} | {:.0} | {:.0} | {eager} |",
                mode.as_str(),
                first.p50,
                first.max,
                summary("reboots", &reboot)?.p50,
            );
        }
    }
    Ok(true)
}

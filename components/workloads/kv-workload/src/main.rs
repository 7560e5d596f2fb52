//! kv-workload: its threads use kv as a store of their own and check every
//! answer against a model of it.
//!
//! Thread `t` of component `c` owns the keys `c/t/0` to `c/t/{keys-1}`
//! and no one else writes them, so its model (a `BTreeMap`) says exactly
//! what every `get`, `delete`, `cas` and `scan` of them must answer; each
//! value names its key and the operation that wrote it, so a value left
//! by a lost update, or written twice, is told apart. Every update's
//! reply carries the store's version, which must rise with each of the
//! thread's updates. Besides, every thread increments the counter key
//! `c/counter` with compare-and-swap (read, then swap in the next value;
//! on a mismatch, read again): at the end the counter must equal the
//! increments that succeeded, all threads together, which an update lost
//! or applied twice by a recovery would break. A final scan of each
//! thread's keys must match its model whole.
//!
//! With `changelog = "/path"` (kv configured with the same changelog, and
//! this component kv's only client), it also reads kv's changelog through
//! `fs` at the end: one line per update, versions 1, 2, 3… with no gap
//! and none twice, as many as kv's version and as this component's
//! successful updates; so an update whose record a recovery lost, or
//! wrote twice, is found.
//!
//! It publishes the counters `ops`, `errors` and `corrupt`, and prints a
//! JSON report once its operations are done (or, with `ops = 0`, once the
//! system asks it to stop); it fails if anything went wrong.

#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use kintsugi_interfaces::fs;
use kintsugi_interfaces::kv::{self, Error};
use kintsugi_runtime::counters::{Failures, WorkloadCounters};
use kintsugi_runtime::{CallError, Incarnation, Sysno};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub seed: u64,
    /// Client threads, each on its own channel slot.
    pub threads: usize,
    /// Operations per thread (0: until the system stops it; a stop
    /// request does not cut a counted run short).
    pub ops: u64,
    /// Keys each thread owns.
    pub keys: u32,
    /// Keys each thread writes once before its operations (`c/fill/t/i`),
    /// never touches again and reads back at the end: state that stays
    /// still, for a test that damages it in kv's memory.
    pub fill: u32,
    /// Longest value, bytes (values are 8..=value_max bytes).
    pub value_max: usize,
    /// Longest pause between operations, µs (drawn from 0..=think_us).
    pub think_us: u64,
    /// A file to write the report to as well (for benchmarks, whose
    /// components share the supervisor's stdout).
    pub report: Option<std::path::PathBuf>,
    /// kv's changelog, read back through `fs` and checked at the end.
    pub changelog: Option<String>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            seed: 1,
            threads: 2,
            ops: 2000,
            keys: 64,
            fill: 0,
            value_max: 256,
            think_us: 100,
            report: None,
            changelog: None,
        }
    }
}

#[derive(Debug, Default, Serialize)]
struct Report {
    component: String,
    seed: u64,
    threads: usize,
    /// Operations each thread completed.
    completed: Vec<u64>,
    /// From the threads' start to the last one's end, ms.
    elapsed_ms: f64,
    /// Counter increments that succeeded, all threads together, and the
    /// counter's final value.
    increments: u64,
    counter: u64,
    /// Updates that succeeded, all threads together, and the changelog's
    /// records (with a changelog).
    updates: u64,
    changelog_records: Option<u64>,
    #[serde(flatten)]
    failures: Failures,
}

/// One thread's view of its keys, and what it checks.
struct Checker<'a> {
    client: &'a kv::Client,
    prefix: String,
    thread: usize,
    model: BTreeMap<String, Vec<u8>>,
    /// The fill keys and their values.
    still: BTreeMap<String, Vec<u8>>,
    /// The store's version after this thread's last update.
    version: u64,
    /// Updates that succeeded.
    updates: u64,
    failures: Failures,
    op: u64,
}

impl Checker<'_> {
    fn key(&self, k: u32) -> String {
        format!("{}{k:05}", self.prefix)
    }

    /// A value that names its key and the operation that wrote it.
    fn value(&self, key: &str, rng: &mut StdRng, max: usize) -> Vec<u8> {
        let mut v = format!("{key}#{}#{}:", self.thread, self.op).into_bytes();
        let len = rng.gen_range(8..=max.max(8));
        while v.len() < len {
            v.push(b'a' + (v.len() % 26) as u8);
        }
        v
    }

    fn wrong(&mut self, what: String) {
        let at = format!("thread {} op {}: ", self.thread, self.op);
        self.failures.corrupt(at + &what);
    }

    fn failed(&mut self, call: &str, e: CallError<Error>) {
        let at = format!("thread {} op {}: {call}: {e}", self.thread, self.op);
        self.failures.error(at);
    }

    /// An update's reply: the version must have risen.
    fn updated(&mut self, call: &str, version: u64) {
        if version <= self.version {
            self.wrong(format!(
                "{call}: the store's version went from {} to {version}",
                self.version
            ));
        }
        self.version = version;
        self.updates += 1;
    }

    /// Checks one answer against the model: `Ok(Some(v))` a value,
    /// `Ok(None)` NotFound.
    fn expect(&mut self, call: &str, key: &str, got: Result<Option<Vec<u8>>, CallError<Error>>) {
        let want = self.model.get(key).or_else(|| self.still.get(key)).cloned();
        match got {
            Ok(got) if got == want => {}
            Ok(got) => self.wrong(format!(
                "{call}({key}): {} where the model has {}",
                show(got.as_deref()),
                show(want.as_deref())
            )),
            Err(e) => self.failed(call, e),
        }
    }

    fn step(&mut self, rng: &mut StdRng, config: &Config) {
        self.op += 1;
        let key = self.key(rng.gen_range(0..config.keys.max(1)));
        match rng.gen_range(0..100) {
            0..=34 => {
                let value = self.value(&key, rng, config.value_max);
                match self.client.put(&key, &value) {
                    Ok(v) => {
                        self.updated("put", v);
                        self.model.insert(key, value);
                    }
                    Err(e) => self.failed("put", e),
                }
            }
            35..=64 => {
                let got = not_found_as_none(self.client.get(&key));
                self.expect("get", &key, got);
            }
            65..=74 => match (self.client.delete(&key), self.model.remove(&key)) {
                (Ok(v), Some(_)) => self.updated("delete", v),
                (Err(CallError::Server(Error::NotFound)), None) => {}
                (Ok(_), None) => self.wrong(format!("delete({key}) found a key the model lacks")),
                (Err(CallError::Server(Error::NotFound)), Some(_)) => {
                    self.wrong(format!("delete({key}): not found, but the model has it"))
                }
                (Err(e), _) => self.failed("delete", e),
            },
            75..=89 => self.cas(rng, config, key),
            _ => self.scan(rng, config),
        }
    }

    /// A compare-and-swap that must succeed (expecting what the model
    /// has) or, one time in four, fail (expecting something else).
    fn cas(&mut self, rng: &mut StdRng, config: &Config, key: String) {
        let current = self.model.get(&key).cloned();
        let honest = rng.gen_range(0..4) != 0;
        let (absent, expected) = match (&current, honest) {
            (None, true) => (true, Vec::new()),
            (Some(v), true) => (false, v.clone()),
            (None, false) => (false, b"nothing".to_vec()),
            (Some(_), false) => (true, Vec::new()),
        };
        let value = self.value(&key, rng, config.value_max);
        match (self.client.cas(&key, absent, &expected, &value), honest) {
            (Ok(v), true) => {
                self.updated("cas", v);
                self.model.insert(key, value);
            }
            (Err(CallError::Server(Error::Mismatch)), false) => {}
            (Ok(_), false) => self.wrong(format!("cas({key}) swapped on a wrong expectation")),
            (Err(CallError::Server(Error::Mismatch)), true) => {
                self.wrong(format!("cas({key}) refused the model's value"))
            }
            (Err(e), _) => self.failed("cas", e),
        }
    }

    /// A scan from one of this thread's keys, checked against the model's
    /// keys from there: this thread's keys sort together, so the first
    /// `limit` of them from `from` on come first (other components' and
    /// threads' keys may follow, and are left out).
    fn scan(&mut self, rng: &mut StdRng, config: &Config) {
        let from = self.key(rng.gen_range(0..config.keys.max(1)));
        let limit = rng.gen_range(1..=16u32);
        match self.client.scan(&from, limit) {
            Ok(pairs) => {
                let mine: Vec<(String, Vec<u8>)> = pairs
                    .into_iter()
                    .filter(|p| p.key.starts_with(&self.prefix))
                    .map(|p| (p.key, p.value))
                    .collect();
                let want: Vec<(String, Vec<u8>)> = self
                    .model
                    .range(from.clone()..)
                    .take(limit as usize)
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect();
                if mine != want {
                    self.wrong(format!(
                        "scan({from}, {limit}): keys {:?}, the model's {:?}",
                        mine.iter().map(|p| &p.0).collect::<Vec<_>>(),
                        want.iter().map(|p| &p.0).collect::<Vec<_>>()
                    ));
                }
            }
            Err(e) => self.failed("scan", e),
        }
    }

    /// Writes the thread's fill keys.
    fn fill(&mut self, rng: &mut StdRng, config: &Config, component: &str) {
        for i in 0..config.fill {
            let key = format!("{component}/fill/{}/{i:05}", self.thread);
            let value = self.value(&key, rng, config.value_max);
            match self.client.put(&key, &value) {
                Ok(v) => {
                    self.updated("fill put", v);
                    self.still.insert(key, value);
                }
                Err(e) => self.failed("fill put", e),
            }
        }
    }

    /// Every key of the thread, its fill keys too, read back at the end.
    fn verify_all(&mut self, config: &Config) {
        let keys: Vec<String> = (0..config.keys.max(1))
            .map(|k| self.key(k))
            .chain(self.still.keys().cloned())
            .collect();
        for key in keys {
            let got = not_found_as_none(self.client.get(&key));
            self.expect("final get", &key, got);
        }
    }
}

fn not_found_as_none(
    r: Result<Vec<u8>, CallError<Error>>,
) -> Result<Option<Vec<u8>>, CallError<Error>> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(CallError::Server(Error::NotFound)) => Ok(None),
        Err(e) => Err(e),
    }
}

fn show(v: Option<&[u8]>) -> String {
    match v {
        None => "no value".into(),
        Some(v) => format!("{:?}", String::from_utf8_lossy(&v[..v.len().min(40)])),
    }
}

/// Increments the component's counter once with compare-and-swap;
/// returns whether it did.
fn increment(client: &kv::Client, key: &str, failures: &mut Failures) -> bool {
    for _ in 0..1000 {
        let current = match client.get(key) {
            Ok(v) => Some(parse(&v)),
            Err(CallError::Server(Error::NotFound)) => None,
            Err(e) => {
                failures.error(format!("counter get: {e}"));
                return false;
            }
        };
        let next = (current.unwrap_or(0) + 1).to_string();
        let expected = current.map(|c| c.to_string()).unwrap_or_default();
        match client.cas(key, current.is_none(), expected.as_bytes(), next.as_bytes()) {
            Ok(_) => return true,
            Err(CallError::Server(Error::Mismatch)) => continue,
            Err(e) => {
                failures.error(format!("counter cas: {e}"));
                return false;
            }
        }
    }
    failures.error("counter: 1000 compare-and-swaps lost the race".into());
    false
}

fn parse(v: &[u8]) -> u64 {
    std::str::from_utf8(v)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(u64::MAX)
}

/// What one thread did: operations completed, and its failures.
fn work(
    client: &kv::Client,
    config: &Config,
    component: &str,
    thread: usize,
    counters: &WorkloadCounters,
    increments: &AtomicU64,
    stop: &(dyn Fn() -> bool + Sync),
) -> (u64, u64, Failures) {
    let mut rng = StdRng::seed_from_u64(
        config
            .seed
            .wrapping_mul(1_000_003)
            .wrapping_add(thread as u64),
    );
    let mut c = Checker {
        client,
        prefix: format!("{component}/{thread}/"),
        thread,
        model: BTreeMap::new(),
        still: BTreeMap::new(),
        version: 0,
        updates: 0,
        failures: Failures::default(),
        op: 0,
    };
    let counter = format!("{component}/counter");
    let mut seen = [0; 2];
    c.fill(&mut rng, config, component);
    while c.op < config.ops || (config.ops == 0 && !stop()) {
        counters.publish(&mut seen, &c.failures);
        c.step(&mut rng, config);
        if rng.gen_range(0..8) == 0 && increment(client, &counter, &mut c.failures) {
            increments.fetch_add(1, Ordering::SeqCst);
        }
        counters.op();
        if config.think_us > 0 {
            std::thread::sleep(Duration::from_micros(rng.gen_range(0..=config.think_us)));
        }
    }
    c.verify_all(config);
    counters.publish(&mut seen, &c.failures);
    (c.op, c.updates, c.failures)
}

/// Reads kv's changelog whole through `fs`.
fn read_changelog(fs: &fs::Client, path: &str) -> Result<Vec<u8>, String> {
    let file = fs.open(path, 0).map_err(|e| format!("open {path}: {e}"))?;
    let mut bytes = Vec::new();
    loop {
        let chunk = fs
            .read(file, 65536)
            .map_err(|e| format!("read {path}: {e}"))?;
        if chunk.is_empty() {
            break;
        }
        bytes.extend_from_slice(&chunk);
    }
    fs.close(file).map_err(|e| format!("close {path}: {e}"))?;
    Ok(bytes)
}

/// Checks the changelog against kv's version and this component's
/// updates (see the module doc); returns its records.
fn check_changelog(
    fs: &fs::Client,
    path: &str,
    client: &kv::Client,
    updates: u64,
    failures: &mut Failures,
) -> u64 {
    let bytes = match read_changelog(fs, path) {
        Ok(b) => b,
        Err(e) => {
            failures.error(format!("changelog: {e}"));
            return 0;
        }
    };
    let text = String::from_utf8_lossy(&bytes);
    let mut records = 0u64;
    for line in text.lines() {
        let version = line.split(' ').next().and_then(|v| v.parse::<u64>().ok());
        if version != Some(records + 1) {
            failures.corrupt(format!(
                "changelog: record {} is {line:?}, not version {}",
                records + 1,
                records + 1
            ));
            return records;
        }
        records += 1;
    }
    let version = client.stats().ok().and_then(|s| s.first().copied());
    if version != Some(records) || records != updates {
        failures.corrupt(format!(
            "changelog: {records} records, kv's version {version:?}, {updates} updates made"
        ));
    }
    records
}

fn main() {
    // Its report file is written whole, then renamed into place.
    kintsugi_runtime::run_allowing(&[Sysno::openat, Sysno::rename], |rt| {
        let config: Config = rt.config()?;
        let client = kv::Client::connect(rt)?;
        let fs = match config.changelog {
            Some(_) => Some(fs::Client::connect(rt)?),
            None => None,
        };
        let component = rt.name().to_string();
        let rt = rt.clone();
        Ok(Incarnation::main(move || {
            let counters = rt.workload_counters()?;
            let threads = config.threads.max(1);
            let increments = AtomicU64::new(0);
            let stop = || rt.stop_requested();
            tracing::info!(
                seed = config.seed,
                threads,
                ops = config.ops,
                "kv-workload starting"
            );
            let started = std::time::Instant::now();
            let runs: Vec<(u64, u64, Failures)> = std::thread::scope(|s| {
                let handles: Vec<_> = (0..threads)
                    .map(|t| {
                        let (client, config, component) = (&client, &config, &component);
                        let (counters, increments, stop) = (&counters, &increments, &stop);
                        s.spawn(move || {
                            work(client, config, component, t, counters, increments, stop)
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().expect("kv-workload thread panicked"))
                    .collect()
            });
            let mut report = Report {
                component: component.clone(),
                seed: config.seed,
                threads,
                increments: increments.load(Ordering::SeqCst),
                elapsed_ms: started.elapsed().as_secs_f64() * 1e3,
                ..Report::default()
            };
            for (done, updates, failures) in runs {
                report.completed.push(done);
                report.updates += updates;
                report.failures.merge(failures);
            }
            report.updates += report.increments;
            report.counter = match client.get(&format!("{component}/counter")) {
                Ok(v) => parse(&v),
                Err(CallError::Server(Error::NotFound)) => 0,
                Err(e) => {
                    report.failures.error(format!("final counter get: {e}"));
                    0
                }
            };
            if report.counter != report.increments {
                report.failures.corrupt(format!(
                    "the counter reads {} after {} increments",
                    report.counter, report.increments
                ));
            }
            if let (Some(fs), Some(path)) = (&fs, &config.changelog) {
                let (updates, failures) = (report.updates, &mut report.failures);
                let records = check_changelog(fs, path, &client, updates, failures);
                report.changelog_records = Some(records);
            }
            let line = serde_json::to_string(&report)?;
            println!("{line}");
            if let Some(path) = &config.report {
                let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
                std::fs::write(&tmp, &line)?;
                std::fs::rename(&tmp, path)?;
            }
            Ok(report.failures.check()?)
        }))
    })
}

//! The durable mode (`durable = true`), for a system whose vault is kept
//! on disk: files that must outlive the whole system, the supervisor
//! included. It writes `/durable/f-0`, `f-1`, … in order, each first as
//! `/durable/tmp` and then renamed, with contents that follow from the
//! seed and the number, and prints `{"durable_written": n}` once `f-n`'s
//! rename was answered. At start it checks what an earlier run left: the
//! files must be `f-0` to `f-(k-1)` with no gap, each byte for byte, and
//! it prints `{"durable_found": k, "errors": […]}` before writing on
//! from `f-k`, until stopped or, with `ops` set, until `f-(ops-1)`
//! exists (each file holds a descriptor of the vault, whose quota bounds
//! them). A test kills everything at random instants and checks that `k`
//! never falls below what was answered.

use kintsugi_interfaces::fs::{self, Client};
use kintsugi_interfaces::fs_flags::{CREATE, TRUNCATE};
use kintsugi_runtime::{CallError, Runtime};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::Config;

const DIR: &str = "/durable";
const TMP: &str = "/durable/tmp";

/// What `f-n` holds: 1 to 8,000 bytes from the seed and `n`.
pub fn contents(seed: u64, n: u64) -> Vec<u8> {
    let mut rng = StdRng::seed_from_u64(seed ^ n.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let len = rng.gen_range(1..=8_000);
    (0..len).map(|_| rng.gen()).collect()
}

fn call<T>(what: &str, r: Result<T, CallError<fs::Error>>) -> anyhow::Result<T> {
    r.map_err(|e| anyhow::anyhow!("{what}: {e}"))
}

/// Checks what is there, then writes on until told to stop, or until
/// `config.ops` files exist if that is not 0.
pub fn run(fs: &Client, rt: &Runtime, config: &Config) -> anyhow::Result<()> {
    let Config {
        seed,
        max_write,
        ops: max_files,
        ..
    } = *config;
    let found = check(fs, seed)?;
    let errors = &found.errors;
    println!(
        "{}",
        serde_json::json!({ "durable_found": found.count, "errors": errors })
    );
    anyhow::ensure!(errors.is_empty(), "{} files differ", errors.len());
    let counters = rt.workload_counters()?;
    let mut seen = [0; 2];
    let failures = kintsugi_runtime::counters::Failures::default();
    let mut n = found.count;
    while !rt.stop_requested() && (max_files == 0 || n < max_files) {
        let bytes = contents(seed, n);
        let fd = call("open tmp", fs.open(TMP, CREATE | TRUNCATE))?;
        for chunk in bytes.chunks(max_write.clamp(1, 65536)) {
            let wrote = call("write tmp", fs.write(fd, chunk))?;
            anyhow::ensure!(wrote as usize == chunk.len(), "short write");
        }
        call("close tmp", fs.close(fd))?;
        call("rename tmp", fs.rename(TMP, &format!("{DIR}/f-{n}")))?;
        println!("{}", serde_json::json!({ "durable_written": n }));
        counters.op();
        counters.publish(&mut seen, &failures);
        n += 1;
    }
    Ok(())
}

struct Found {
    count: u64,
    errors: Vec<String>,
}

/// The files an earlier run left, checked; a half-written `tmp` removed.
fn check(fs: &Client, seed: u64) -> anyhow::Result<Found> {
    match fs.mkdir(DIR) {
        Ok(()) | Err(CallError::Server(fs::Error::Exists)) => {}
        Err(e) => anyhow::bail!("mkdir {DIR}: {e}"),
    }
    let mut numbers = Vec::new();
    let mut errors = Vec::new();
    for name in call("readdir", fs.readdir_all(DIR))? {
        if name == "tmp" {
            call("unlink tmp", fs.unlink(TMP))?;
            continue;
        }
        match name.strip_prefix("f-").and_then(|n| n.parse::<u64>().ok()) {
            Some(n) => numbers.push(n),
            None => errors.push(format!("{DIR}/{name}: not written by this workload")),
        }
    }
    numbers.sort_unstable();
    for (i, &n) in numbers.iter().enumerate() {
        if n != i as u64 {
            errors.push(format!("{DIR}/f-{i} is missing (f-{n} is there)"));
            break;
        }
    }
    for &n in &numbers {
        let path = format!("{DIR}/f-{n}");
        let got = read_whole(fs, &path)?;
        let want = contents(seed, n);
        if got != want {
            let at = got.iter().zip(&want).position(|(a, b)| a != b);
            errors.push(format!(
                "{path}: {} bytes, {} expected, first difference at {at:?}",
                got.len(),
                want.len()
            ));
        }
    }
    Ok(Found {
        count: numbers.len() as u64,
        errors,
    })
}

fn read_whole(fs: &Client, path: &str) -> anyhow::Result<Vec<u8>> {
    let fd = call(path, fs.open(path, 0))?;
    let mut out = Vec::new();
    loop {
        let chunk = call(path, fs.read(fd, 65536))?;
        if chunk.is_empty() {
            break;
        }
        out.extend_from_slice(&chunk);
    }
    call(path, fs.close(fd))?;
    Ok(out)
}

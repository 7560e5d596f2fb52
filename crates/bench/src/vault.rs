//! `kintsugi bench vault`: what keeping the vault on disk costs ramfs
//! (`[system] vault = { dir, fsync }`, `crates/supervisor/src/vault/disk.rs`).
//! fs-workload's durable mode creates files as fast as it can (each: open
//! `tmp` with CREATE|TRUNCATE, 1–8,000 bytes written, close, rename: two
//! vault requests, one of which makes a file); the files made in a run of
//! `kintsugi run … --duration` are counted, with the vault in memory (the
//! baseline), on disk with `fsync = "never"` and with `"always"`.

use std::process::Command;

use anyhow::Context;

const SYSTEM: &str = r#"
[system]
name = "bench-vault"
VAULT

[[component]]
name = "ramfs"
binary = "kintsugi-ramfs"
provides = ["fs"]
vault_quota = { fds = 1000000 }

[[component]]
name = "workload"
binary = "kintsugi-fs-workload"
uses = ["fs"]
[component.config]
durable = true
seed = 7
"#;

/// Files one run of `secs` seconds made with `vault` (a `[system]` line).
fn files_made(dir: &std::path::Path, vault: &str, secs: f64) -> anyhow::Result<u64> {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir)?;
    let system = dir.join("bench-vault.toml");
    std::fs::write(&system, SYSTEM.replace("VAULT", vault))?;
    let kintsugi = std::env::current_exe()?.with_file_name("kintsugi");
    let out = Command::new(&kintsugi)
        .arg("run")
        .arg(&system)
        .args(["--duration", &secs.to_string()])
        .env("KINTSUGI_LOG", "warn")
        .output()
        .with_context(|| format!("running {}", kintsugi.display()))?;
    anyhow::ensure!(
        out.status.success(),
        "the system failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last = stdout
        .lines()
        .filter(|l| l.starts_with("{\"component\":\"workload\""))
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v.get("durable_written")?.as_u64())
        .max();
    Ok(last.map_or(0, |n| n + 1))
}

pub fn vault(secs: f64, repeats: usize) -> anyhow::Result<bool> {
    let dir = std::env::temp_dir().join(format!("kintsugi-bench-vault-{}", std::process::id()));
    let kinds = [
        ("in memory (baseline)", String::new()),
        (
            "on disk, fsync = \"never\"",
            "vault = { dir = \"state\", fsync = \"never\" }".to_string(),
        ),
        (
            "on disk, fsync = \"always\"",
            "vault = { dir = \"state\", fsync = \"always\" }".to_string(),
        ),
    ];
    // Runs alternate between the kinds, so that a slow spell of the
    // machine does not fall on one only.
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); kinds.len()];
    for _ in 0..repeats.max(1) {
        for (i, (_, vault)) in kinds.iter().enumerate() {
            rates[i].push(files_made(&dir, vault, secs)? as f64 / secs);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    println!("## ramfs file creation by where the vault is kept\n");
    println!(
        "{} runs of {secs} s each (the start, about 0.1 s, included); files made per second\n",
        repeats.max(1)
    );
    println!("| vault | runs | median files/s | min | max | × memory |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: |");
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let base = median(&mut rates[0].clone());
    for ((name, _), mut r) in kinds.iter().zip(rates) {
        let m = median(&mut r);
        println!(
            "| {name} | {} | {m:.0} | {:.0} | {:.0} | {:.2} |",
            r.len(),
            r[0],
            r[r.len() - 1],
            if base > 0.0 { m / base } else { 0.0 }
        );
    }
    Ok(true)
}

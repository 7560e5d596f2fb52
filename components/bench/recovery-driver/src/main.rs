//! recovery-driver: the client side of `kintsugi bench recovery` (C3's
//! Table I) and `kintsugi bench interference`. Its `role` config picks what
//! it does:
//!
//! - `table1` ([`table1`]): holds descriptors of one service (fs, lock, evt,
//!   timer or mm) in a high-priority and a best-effort thread; after each
//!   reboot of the service (by the supervisor's injector) both time the
//!   first call on each of their descriptors, which rebuilds it, against a
//!   steady-state call, while CPU hogs compete; at the end it times the
//!   service's representative call through the tracking stub and through a
//!   raw connection call, and a null invocation for scale.
//! - `holder` ([`interference`]): a best-effort client that creates many
//!   `bench` descriptors and then only holds them.
//! - `hp` ([`interference`]): a high-priority client that crashes the bench
//!   server and times its own first invocation after each crash.
//!
//! Every measurement is appended as one JSON line to the file `out`.

#![forbid(unsafe_code)]

mod interference;
mod subjects;
mod table1;

use std::io::Write;

use kintsugi_runtime::{Incarnation, Sysno};
use serde::{Deserialize, Serialize};

#[derive(Debug, Deserialize)]
#[serde(tag = "role", rename_all = "kebab-case")]
enum Config {
    Table1(table1::Config),
    Holder(interference::HolderConfig),
    Hp(interference::HpConfig),
}

/// Appends `value` as one JSON line to the file `path`.
fn emit(path: &str, value: &impl Serialize) -> anyhow::Result<()> {
    let line = serde_json::to_string(value)? + "\n";
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| anyhow::anyhow!("{path}: {e}"))?
        .write_all(line.as_bytes())?;
    Ok(())
}

fn main() {
    // It appends its results to files the benchmark reads (`emit`).
    kintsugi_runtime::run_allowing(&[Sysno::openat], |rt| {
        let rt = rt.clone();
        Ok(match rt.config()? {
            Config::Table1(c) => Incarnation::main(move || table1::run(&rt, c)),
            Config::Holder(c) => Incarnation::main(move || interference::hold(&rt, c)),
            Config::Hp(c) => Incarnation::main(move || interference::hp(&rt, c)),
        })
    })
}

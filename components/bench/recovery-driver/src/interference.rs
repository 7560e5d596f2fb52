//! The `holder` and `hp` roles of `kintsugi bench interference`: does the
//! recovery of other clients' descriptors delay a high-priority client's
//! first invocation after a fault?
//!
//! Best-effort holders create their `bench` descriptors, announce it with a
//! file, and then only hold them. The high-priority client waits for every
//! announcement, then, each round, crashes the bench server (`crash`,
//! through the raw connection so that the stub does not re-issue it) and
//! times its next call, a `touch` of its own descriptor. With an eager
//! server, that call waits at the recovery gate until every holder has
//! rebuilt all its descriptors; on demand, no holder rebuilds anything
//! until it next uses a descriptor.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kintsugi_interfaces::bench;
use kintsugi_runtime::{Fault, Runtime};
use serde::{Deserialize, Serialize};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HolderConfig {
    descriptors: usize,
    /// A file to create once every descriptor exists.
    ready: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HpConfig {
    rounds: usize,
    /// The holders' `ready` files.
    wait_for: Vec<String>,
    out: String,
    #[serde(default = "default_ready_timeout_ms")]
    ready_timeout_ms: u64,
}

fn default_ready_timeout_ms() -> u64 {
    120_000
}

/// One fault and the first call after it, as written to `out`.
#[derive(Serialize)]
struct FirstCall {
    kind: &'static str,
    round: usize,
    /// The server's epoch the call was served in.
    epoch: u64,
    /// From the crash's return to the first call's return.
    first_us: f64,
    /// The calling thread's nice value.
    nice: i32,
}

pub fn hold(rt: &Arc<Runtime>, c: HolderConfig) -> anyhow::Result<()> {
    let client = bench::Client::connect(rt)?;
    for i in 0..c.descriptors {
        client.make(i as u64)?;
    }
    std::fs::write(&c.ready, c.descriptors.to_string())
        .map_err(|e| anyhow::anyhow!("{}: {e}", c.ready))?;
    tracing::info!(descriptors = c.descriptors, "holding");
    // The stub (and its descriptors) must live on: it answers the eager
    // server's recovery upcalls.
    while !rt.stop_requested() {
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(client);
    Ok(())
}

pub fn hp(rt: &Arc<Runtime>, c: HpConfig) -> anyhow::Result<()> {
    let client = bench::Client::connect(rt)?;
    let obj = client.make(0)?;
    let tid = rustix::thread::gettid().as_raw_nonzero().get();
    let nice = kintsugi_runtime::priority::of_thread(tid)?.nice;
    let deadline = Instant::now() + Duration::from_millis(c.ready_timeout_ms);
    while !c.wait_for.iter().all(|f| std::path::Path::new(f).exists()) {
        anyhow::ensure!(
            Instant::now() < deadline,
            "the holders were not ready within {} ms",
            c.ready_timeout_ms
        );
        if rt.stop_requested() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    for round in 0..c.rounds {
        // Let the supervisor fork the next standby; then warm up, since
        // calls right after an idle spell run slower on these machines.
        std::thread::sleep(Duration::from_millis(50));
        let warm_until = Instant::now() + Duration::from_millis(20);
        while Instant::now() < warm_until {
            client.null()?;
        }
        crash(&client)?;
        let t = Instant::now();
        client.touch(obj, 1)?;
        let first_us = t.elapsed().as_secs_f64() * 1e6;
        crate::emit(
            &c.out,
            &FirstCall {
                kind: "first-call",
                round,
                epoch: client.connection().epoch(),
                first_us,
                nice,
            },
        )?;
    }
    Ok(())
}

/// Crashes the server once: a raw `crash`, which the server dies in.
fn crash(client: &bench::Client) -> anyhow::Result<()> {
    match client
        .connection()
        .call(bench::FN_CRASH, None, |_| Ok(()), |_| Ok(()))
    {
        Err(Fault::Interrupted) => Ok(()),
        other => anyhow::bail!("bench.crash did not crash the server: {other:?}"),
    }
}

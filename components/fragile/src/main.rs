//! fragile: a component for the supervisor's tests of failed reboots. Its
//! first incarnation starts, runs for `crash_after_ms`, then aborts; every
//! later incarnation fails during initialization, as one does whose state
//! the crash left unusable: `mode = "abort"` dies (SIGABRT) before it
//! reports, `"error"` reports the failure, `"hang"` never becomes ready.

#![forbid(unsafe_code)]

use std::time::Duration;

use kintsugi_runtime::Incarnation;
use serde::Deserialize;

#[derive(Debug, Deserialize)]
#[serde(rename_all = "kebab-case")]
enum Mode {
    Abort,
    Error,
    Hang,
}

#[derive(Debug, Deserialize)]
struct Config {
    mode: Mode,
    #[serde(default = "crash_after_ms")]
    crash_after_ms: u64,
}

fn crash_after_ms() -> u64 {
    200
}

fn main() {
    kintsugi_runtime::run(|rt| {
        let config: Config = rt.config()?;
        if rt.epoch() > 1 {
            tracing::warn!(epoch = rt.epoch(), ?config.mode, "failing initialization");
            match config.mode {
                Mode::Abort => std::process::abort(),
                Mode::Error => anyhow::bail!("the state my predecessor left is unusable"),
                Mode::Hang => loop {
                    std::thread::park();
                },
            }
        }
        Ok(Incarnation::main(move || {
            std::thread::sleep(Duration::from_millis(config.crash_after_ms));
            std::process::abort()
        }))
    })
}

//! kv: an in-memory key-value store served over the `kv` interface.
//!
//! It is written as any Rust service would be, a `BTreeMap` behind a
//! mutex, with no vault, arena, durable memory or recovery annotations
//! (its interface marks `get`, `scan` and `stats` `readonly`, a fact of
//! the interface that spares the request log those calls):
//! what keeps its data through crashes and hangs is the system
//! description's `recovery = "checkpoint"`, under which the supervisor
//! checkpoints it at safe points and the runtime logs every request it
//! serves, so that a new incarnation gets the last checkpoint and replays
//! the requests served since (`kintsugi_runtime`'s journal; issue 16).
//! Without it, a crash loses every key, which is what its tests compare
//! against.
//!
//! With `changelog = "/path"` in its config (and `uses = ["fs"]`) it also
//! writes every update as a line of a file in ramfs (`changelog.rs`): a
//! checkpoint-recovered server that is itself a client.

#![forbid(unsafe_code)]

use std::sync::Arc;

use kintsugi_interfaces::{fs, kv};
use kintsugi_kv::{Changelog, Store};
use serde::Deserialize;

#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct Config {
    /// A file (in the `fs` server it uses) to write every update to.
    changelog: Option<String>,
}

fn main() {
    kintsugi_runtime::run(|rt| {
        let config: Config = rt.config()?;
        let changelog = match config.changelog {
            Some(path) => Some(Changelog::new(fs::Client::connect(rt)?, path)),
            None => None,
        };
        tracing::debug!(epoch = rt.epoch(), "kv serving");
        Ok(kintsugi_runtime::Incarnation::serve(vec![kv::service(
            Arc::new(Store::new(changelog)),
        )]))
    })
}

//! mm-workload: two client components of `mm` that check what it promises
//! across its crashes, in rounds.
//!
//! The **owner** grants a few pages, fills each with seeded bytes through
//! its own mapping, aliases each into the **sink** (whose component id its
//! config names) and publishes the aliases' ids on a control page it shares
//! with the sink (itself a page the owner granted and aliased to the sink;
//! the sink finds it as the newest page it holds that carries the magic
//! word and names another of its pages as the keeper). The sink maps
//! every alias, checks its bytes against the same seeded stream, and
//! acknowledges; the owner then revokes its grants, checks that its own
//! mappings are gone (mapper table and `/proc/self/maps`), and says so; the
//! sink checks the same of its mappings of the aliases, which the revokes
//! must have unmapped by upcall before returning. A long-lived page (the
//! keeper), mapped once by both at the start, is checked every round and at
//! the end: mappings outlive mm's crashes.
//!
//! Neither gives up: a failed round is counted and the next one starts.
//! If the sink stops answering (a faulty mm lost or garbled the shared
//! pages), the owner starts over with a new control page and keeper after
//! a few failed rounds, and marks the old control page so that a sink
//! still watching it looks for the new one.
//!
//! On SIGTERM (or after `rounds` rounds) each prints a JSON report on
//! stdout and exits 0 only if nothing differed and no call failed.

#![forbid(unsafe_code)]

mod owner;
mod protocol;
mod sink;

use kintsugi_interfaces::mm;
use kintsugi_interfaces::mm_map::Mapper;
use kintsugi_runtime::Incarnation;
use serde::Deserialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Owner,
    Sink,
}

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub role: Role,
    pub seed: u64,
    /// The owner's: the sink's component id (its place in the system description, from 1).
    pub sink: u32,
    /// The sink's: the owner's component id, which mm's `origin` must name
    /// for every alias (0: not checked).
    pub owner: u32,
    /// Grants per round (at most 64).
    pub grants: usize,
    /// Pages per grant: from 1 to this.
    pub max_pages: u32,
    /// Pages of the long-lived keeper.
    pub keeper_pages: u32,
    /// Stop after this many rounds (0: run until told to stop).
    pub rounds: u64,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            role: Role::Owner,
            seed: 42,
            sink: 0,
            owner: 0,
            grants: 4,
            max_pages: 4,
            keeper_pages: 4,
            rounds: 0,
        }
    }
}

fn main() {
    kintsugi_runtime::run(|rt| {
        let config: Config = rt.config()?;
        anyhow::ensure!(
            (1..=protocol::MAX_GRANTS).contains(&config.grants),
            "grants must be 1 to {}",
            protocol::MAX_GRANTS
        );
        anyhow::ensure!(
            (1..=256).contains(&config.max_pages) && (1..=256).contains(&config.keeper_pages),
            "max_pages and keeper_pages must be 1 to 256 (what one grant may ask)"
        );
        anyhow::ensure!(
            config.role == Role::Sink || config.sink != 0,
            "the owner needs the sink's component id (config `sink`)"
        );
        let client = mm::Client::connect(rt)?;
        let rt = rt.clone();
        Ok(Incarnation::main(move || {
            tracing::info!(role = ?config.role, seed = config.seed, "mm-workload starting");
            let mapper = Mapper::new(&client, rt.vault());
            let env = protocol::Env {
                rt: &rt,
                client: &client,
                mapper: &mapper,
                config: &config,
            };
            let (report, failures) = match config.role {
                Role::Owner => {
                    let r = owner::run(&env);
                    (serde_json::to_string(&r)?, r.tally)
                }
                Role::Sink => {
                    let r = sink::run(&env);
                    (serde_json::to_string(&r)?, r.tally)
                }
            };
            println!("{report}");
            Ok(failures.check()?)
        }))
    })
}

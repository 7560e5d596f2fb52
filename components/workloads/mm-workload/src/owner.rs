//! The owner: grants, fills, aliases into the sink, publishes, revokes.

use std::collections::HashSet;

use kintsugi_interfaces::mm::Page;
use kintsugi_interfaces::mm_map::Mapped;
use kintsugi_runtime::abi::shm::page_size;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use crate::protocol::*;

#[derive(Debug, Default, Serialize)]
pub struct Report {
    pub role: &'static str,
    pub seed: u64,
    /// Rounds whose pages the sink verified and whose revokes it checked.
    pub rounds: u64,
    pub grants: u64,
    pub aliases: u64,
    pub revokes: u64,
    /// Own mappings checked gone (mapper and kernel) right after their revoke.
    pub unmaps_checked: u64,
    /// Mappings this process's UNMAP handler dropped.
    pub unmapped_by_upcall: u64,
    /// Pages held but never returned to this owner (a creation re-issued
    /// after a crash, whose first attempt had taken effect): revoked.
    pub duplicates_revoked: u64,
    /// Times the owner started over after the sink stopped answering.
    pub restarts: u64,
    pub keeper_checks: u64,
    /// The keeper, mapped at the start, held its bytes at the very end.
    pub keeper_intact_at_end: bool,
    #[serde(flatten)]
    pub tally: Failures,
}

/// A page granted this round, as mapped here.
struct Granted {
    page: Page,
    mapped: Mapped,
}

struct Owner<'e, 'a> {
    env: &'e Env<'a>,
    rng: StdRng,
    control: Page,
    keeper: Page,
    keeper_len: usize,
    /// Control pages and keepers left when the owner started over: kept
    /// (revoking them would look to the sink like this owner's end).
    retired: Vec<Page>,
    report: Report,
}

impl Report {
    fn new(seed: u64) -> Self {
        Self {
            role: "owner",
            seed,
            ..Default::default()
        }
    }
}

pub fn run(env: &Env<'_>) -> Report {
    let mut owner = match Owner::start(env) {
        Ok(o) => o,
        Err(e) => {
            let mut report = Report::new(env.config.seed);
            report.tally.error(format!("setting up: {e:#}"));
            return report;
        }
    };
    let mut round = 1u64;
    let mut seen = [0; 2];
    let mut failed_in_a_row = 0;
    while !env.stopping() && (env.config.rounds == 0 || round <= env.config.rounds) {
        match owner.round(round) {
            Ok(true) => {
                failed_in_a_row = 0;
                owner.report.rounds += 1;
                env.publish(&owner.report.tally, &mut seen, true);
            }
            Ok(false) => break,
            Err(e) => {
                // An error a client sees (say, a descriptor whose creation
                // record a faulty mm corrupted): counted, and the next
                // round starts afresh; the sink follows the published round.
                owner.report.tally.error(format!("round {round}: {e:#}"));
                env.publish(&owner.report.tally, &mut seen, false);
                failed_in_a_row += 1;
                if failed_in_a_row >= START_OVER_AFTER {
                    failed_in_a_row = 0;
                    if let Err(e) = owner.start_over() {
                        owner.report.tally.error(format!("starting over: {e:#}"));
                    }
                }
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
        }
        round += 1;
    }
    // After every crash of mm: the first mapping still holds the first bytes.
    let (keeper, len) = (owner.keeper, owner.keeper_len);
    match env.check_keeper(keeper, len, &mut owner.report.tally) {
        Ok(intact) => owner.report.keeper_intact_at_end = intact,
        Err(e) => owner
            .report
            .tally
            .error(format!("checking the keeper: {e:#}")),
    }
    owner.report.keeper_checks += 1;
    owner.report.unmapped_by_upcall = env.mapper.unmapped_by_upcall();
    owner.report
}

impl<'e, 'a> Owner<'e, 'a> {
    /// Makes the control page (aliased to the sink first of all) and the keeper.
    fn start(env: &'e Env<'a>) -> anyhow::Result<Self> {
        let sink = env.config.sink;
        let control = env.client.grant(1)?;
        env.mapper.map(control)?;
        env.client.alias(control, sink)?;
        let keeper = env.client.grant(env.config.keeper_pages)?;
        let keeper_len = env.mapper.map(keeper)?.len;
        env.mapper.write(
            keeper,
            0,
            &pattern(env.config.seed, KEEPER_ROUND, 0, keeper_len),
        )?;
        let keeper_alias = env.client.alias(keeper, sink)?;
        env.store_u64(control, AT_KEEPER, keeper_alias.0)?;
        env.mapper.store_u32(control, AT_MAGIC, MAGIC)?;
        Ok(Self {
            env,
            rng: StdRng::seed_from_u64(env.config.seed),
            control,
            keeper,
            keeper_len,
            retired: Vec::new(),
            report: Report::new(env.config.seed),
        })
    }

    /// A new control page and keeper, after the sink stopped answering; a
    /// sink that still sees the old control page is told to look for them.
    fn start_over(&mut self) -> anyhow::Result<()> {
        let _ = self.env.mapper.store_u32(self.control, AT_MOVED, 1);
        let fresh = Owner::start(self.env)?;
        self.retired.extend([self.control, self.keeper]);
        (self.control, self.keeper, self.keeper_len) =
            (fresh.control, fresh.keeper, fresh.keeper_len);
        self.report.restarts += 1;
        tracing::warn!(
            restarts = self.report.restarts,
            "the sink stopped answering: started over"
        );
        Ok(())
    }

    /// One round; false if told to stop before it completed.
    fn round(&mut self, round: u64) -> anyhow::Result<bool> {
        let env = self.env;
        let r = round as u32;
        self.revoke_duplicates()?;
        let mut granted = Vec::new();
        for i in 0..env.config.grants {
            let pages = self.rng.gen_range(1..=env.config.max_pages);
            let page = env.client.grant(pages)?;
            self.report.grants += 1;
            let mapped = env.mapper.map(page)?;
            anyhow::ensure!(
                mapped.len == pages as usize * page_size(),
                "grant of {pages} pages located as {} bytes",
                mapped.len
            );
            env.mapper.write(
                page,
                0,
                &pattern(env.config.seed, round, i as u64, mapped.len),
            )?;
            let alias = env.client.alias(page, env.config.sink)?;
            self.report.aliases += 1;
            env.store_u64(self.control, AT_ALIASES + 8 * i, alias.0)?;
            granted.push(Granted { page, mapped });
        }
        env.mapper
            .store_u32(self.control, AT_COUNT, granted.len() as u32)?;
        env.mapper.store_u32(self.control, AT_PUBLISHED, r)?;
        if !env.wait_for(self.control, AT_ACKED, r, Some(SINK_PATIENCE))? {
            return Ok(false);
        }
        for g in &granted {
            // Revoking the grant revokes the sink's alias too, and unmaps both.
            self.env.client.revoke(g.page)?;
            self.report.revokes += 1;
            env.check_unmapped(g.page, g.mapped, &mut self.report.tally)?;
            self.report.unmaps_checked += 1;
        }
        env.mapper.store_u32(self.control, AT_REVOKED, r)?;
        if !env.wait_for(self.control, AT_CHECKED, r, Some(SINK_PATIENCE))? {
            return Ok(false);
        }
        env.check_keeper(self.keeper, self.keeper_len, &mut self.report.tally)?;
        self.report.keeper_checks += 1;
        Ok(true)
    }

    /// Revokes the pages mm says this owner holds that it never got back
    /// (between rounds it holds only the control pages and the keepers).
    fn revoke_duplicates(&mut self) -> anyhow::Result<()> {
        let mine: HashSet<u64> = [self.control, self.keeper]
            .iter()
            .chain(&self.retired)
            .map(|p| p.0)
            .collect();
        for id in self.env.client.held()? {
            if !mine.contains(&id) {
                self.env.client.revoke(Page(id))?;
                self.report.duplicates_revoked += 1;
            }
        }
        Ok(())
    }
}

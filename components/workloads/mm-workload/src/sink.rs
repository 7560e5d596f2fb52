//! The sink: maps and verifies the owner's aliases, then checks that their
//! revokes left no mapping behind.

use std::collections::HashSet;
use std::time::Duration;

use kintsugi_interfaces::mm::Page;
use kintsugi_interfaces::mm_map::Mapped;
use serde::Serialize;

use crate::protocol::*;

#[derive(Debug, Default, Serialize)]
pub struct Report {
    pub role: &'static str,
    pub seed: u64,
    /// Rounds verified, and checked after their revokes.
    pub rounds: u64,
    pub aliases_mapped: u64,
    /// Aliases whose every byte was the owner's.
    pub aliases_verified: u64,
    /// Aliases mm said the owner had made (`origin`), when `owner` is set.
    pub origins_verified: u64,
    pub bytes_verified: u64,
    /// Aliases checked gone (mapper and kernel) once their revoke had returned.
    pub revokes_checked: u64,
    /// Mappings this process's UNMAP handler dropped.
    pub unmapped_by_upcall: u64,
    pub keeper_checks: u64,
    /// The keeper, mapped at the start, held its bytes at the very end.
    pub keeper_intact_at_end: bool,
    /// The owner ended, and mm reclaimed its pages: the control page and
    /// the keeper were unmapped here by upcall (mapper and kernel agree).
    pub owner_pages_reclaimed: bool,
    /// Times the owner started over and the sink found its new pages.
    pub owner_restarts_followed: u64,
    #[serde(flatten)]
    pub tally: Failures,
}

/// The pages the owner shares with the sink for the whole run, as mapped here.
struct Shared {
    control: Page,
    control_at: Mapped,
    keeper: Page,
    keeper_at: Mapped,
    keeper_len: usize,
}

/// Why the rounds ended.
enum End {
    /// Told to stop, or done with the rounds configured.
    Stopped,
    /// The control page was unmapped under the sink: the owner ended and mm
    /// reclaimed its pages.
    OwnerGone,
    /// The owner started over with a new control page ([`AT_MOVED`]).
    Moved,
}

/// How long the sink waits for mm to unmap all of an owner's pages once the
/// first is gone.
const RECLAIM_DEADLINE: Duration = Duration::from_secs(10);

pub fn run(env: &Env<'_>) -> Report {
    let mut report = Report {
        role: "sink",
        seed: env.config.seed,
        ..Default::default()
    };
    // The owner's pages, and how the rounds with them ended.
    let mut ended = None;
    while let Some(shared) = find_shared(env, &mut report) {
        match rounds(env, &shared, &mut report) {
            Ok(End::Moved) => report.owner_restarts_followed += 1,
            end => {
                ended = Some((shared, end));
                break;
            }
        }
    }
    if let Some((shared, end)) = ended {
        match end {
            Ok(End::Stopped) => {
                // After every crash of mm: the first mapping still holds the first bytes.
                match env.check_keeper(shared.keeper, shared.keeper_len, &mut report.tally) {
                    Ok(intact) => report.keeper_intact_at_end = intact,
                    Err(e) => report.tally.error(format!("checking the keeper: {e:#}")),
                }
                report.keeper_checks += 1;
            }
            Ok(End::OwnerGone) => {
                // mm reclaims the owner's pages one after the other: the
                // control page's unmapping told us, the keeper's may follow.
                env.wait_unmapped(shared.keeper, RECLAIM_DEADLINE);
                let before = report.tally.errors;
                let checked = env
                    .check_unmapped(shared.control, shared.control_at, &mut report.tally)
                    .and_then(|()| {
                        env.check_unmapped(shared.keeper, shared.keeper_at, &mut report.tally)
                    });
                match checked {
                    Ok(()) => report.owner_pages_reclaimed = report.tally.errors == before,
                    Err(e) => report
                        .tally
                        .error(format!("checking the owner's pages: {e:#}")),
                }
            }
            Ok(End::Moved) => {} // followed above
            Err(e) => report.tally.error(format!("{e:#}")),
        }
    }
    report.unmapped_by_upcall = env.mapper.unmapped_by_upcall();
    report
}

/// The control page (the oldest page the sink holds: the owner aliases it
/// before anything else) and the keeper it names, mapped; `None` if told to
/// stop before the owner made them.
/// The control page and the keeper: the newest page this sink holds that
/// carries [`MAGIC`], has not been left by the owner, and names as keeper
/// another page the sink holds (a page of round data may carry anything).
/// Waits until the owner has made them; a failed look is counted once.
fn find_shared(env: &Env<'_>, report: &mut Report) -> Option<Shared> {
    let mut counted = false;
    loop {
        match look_for_shared(env) {
            Ok(Some(shared)) => return Some(shared),
            Ok(None) => {}
            Err(e) if !counted => {
                report
                    .tally
                    .error(format!("finding the owner's pages: {e:#}"));
                counted = true;
            }
            Err(_) => {}
        }
        if env.stopping() {
            return None;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// One look through the held pages, newest first; a page that cannot be
/// looked at is passed over, and the first such failure returned if no
/// page qualified.
fn look_for_shared(env: &Env<'_>) -> anyhow::Result<Option<Shared>> {
    let held = env.client.held()?;
    let mut failed = None;
    for &id in held.iter().rev() {
        match shared_at(env, Page(id), &held) {
            Ok(Some(shared)) => return Ok(Some(shared)),
            Ok(None) => {}
            Err(e) => failed = failed.or(Some(e)),
        }
    }
    failed.map_or(Ok(None), Err)
}

/// The shared pages if `control` is the owner's current control page.
fn shared_at(env: &Env<'_>, control: Page, held: &[u64]) -> anyhow::Result<Option<Shared>> {
    let control_at = env.mapper.map(control)?;
    if env.mapper.load_u32(control, AT_MAGIC)? != MAGIC || env.moved(control) {
        return Ok(None);
    }
    let keeper = Page(env.load_u64(control, AT_KEEPER)?);
    if keeper == control || !held.contains(&keeper.0) {
        return Ok(None);
    }
    let keeper_at = env.mapper.map(keeper)?;
    Ok(Some(Shared {
        control,
        control_at,
        keeper,
        keeper_at,
        keeper_len: keeper_at.len,
    }))
}

fn rounds(env: &Env<'_>, shared: &Shared, report: &mut Report) -> anyhow::Result<End> {
    let control = shared.control;
    let mut round = 1u32;
    let mut seen = [0; 2];
    loop {
        env.publish(&report.tally, &mut seen, false);
        env.check_keeper(shared.keeper, shared.keeper_len, &mut report.tally)?;
        report.keeper_checks += 1;
        if env.config.rounds != 0 && u64::from(round) > env.config.rounds {
            return Ok(End::Stopped);
        }
        match env.wait_for(control, AT_PUBLISHED, round, None) {
            // The owner skips the rounds it could not finish.
            Ok(true) => round = env.mapper.load_u32(control, AT_PUBLISHED)?,
            Ok(false) => return Ok(End::Stopped),
            Err(_) if !env.mapper.is_mapped(control) => return Ok(End::OwnerGone),
            Err(_) if env.moved(control) => return Ok(End::Moved),
            Err(e) => return Err(e),
        }
        match serve_round(env, control, round, report) {
            Ok(true) => {}
            Ok(false) => return Ok(End::Stopped),
            Err(_) if !env.mapper.is_mapped(control) => return Ok(End::OwnerGone),
            Err(_) if env.moved(control) => return Ok(End::Moved),
            Err(e) => {
                // An error a client sees (say, an alias mm no longer knows
                // after a faulty incarnation): counted; the round is
                // acknowledged so that the owner goes on to the next.
                report.tally.error(format!("round {round}: {e:#}"));
                let _ = env.mapper.store_u32(control, AT_ACKED, round);
                let _ = env.mapper.store_u32(control, AT_CHECKED, round);
                round += 1;
                continue;
            }
        }
        report.rounds += 1;
        env.publish(&report.tally, &mut seen, true);
        round += 1;
    }
}

/// One round after the owner published it: map and verify the aliases,
/// acknowledge, then check that the owner's revokes unmapped them; false if
/// told to stop meanwhile.
fn serve_round(
    env: &Env<'_>,
    control: Page,
    round: u32,
    report: &mut Report,
) -> anyhow::Result<bool> {
    let n = env.mapper.load_u32(control, AT_COUNT)? as usize;
    anyhow::ensure!(n <= MAX_GRANTS, "round {round}: {n} aliases published");
    let aliases = (0..n)
        .map(|i| env.load_u64(control, AT_ALIASES + 8 * i).map(Page))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let held: HashSet<u64> = env.client.held()?.into_iter().collect();
    let mut mapped: Vec<(Page, Mapped)> = Vec::new();
    for (i, &alias) in aliases.iter().enumerate() {
        if !held.contains(&alias.0) {
            report.tally.corrupt(format!(
                "round {round}: mm does not list alias {:#x} among the sink's pages",
                alias.0
            ));
        }
        let m = env.mapper.map(alias)?;
        report.aliases_mapped += 1;
        if env.config.owner != 0 {
            match env.client.origin(alias)? {
                from if from == env.config.owner => report.origins_verified += 1,
                from => report.tally.corrupt(format!(
                    "round {round}: mm says alias {:#x} came from component {from}, not the owner ({})",
                    alias.0, env.config.owner
                )),
            }
        }
        if env.verify(alias, m.len, u64::from(round), i as u64)? {
            report.aliases_verified += 1;
            report.bytes_verified += m.len as u64;
        } else {
            report.tally.corrupt(format!(
                "round {round}: alias {:#x} ({} bytes) does not hold the owner's bytes",
                alias.0, m.len
            ));
        }
        mapped.push((alias, m));
    }
    env.mapper.store_u32(control, AT_ACKED, round)?;
    // The owner revokes, or gives the round up after an error and
    // publishes the next one (its first step revokes what is left).
    loop {
        if env.mapper.load_u32(control, AT_REVOKED)? >= round {
            break;
        }
        if env.mapper.load_u32(control, AT_PUBLISHED)? > round {
            return Ok(true);
        }
        if env.stopping() {
            return Ok(false);
        }
        anyhow::ensure!(!env.moved(control), "the owner started over");
        std::thread::sleep(POLL);
    }
    // Every revoke has returned: every mapping of these aliases must be gone.
    for (alias, m) in mapped {
        env.check_unmapped(alias, m, &mut report.tally)?;
        report.revokes_checked += 1;
    }
    env.mapper.store_u32(control, AT_CHECKED, round)?;
    Ok(true)
}

//! `kintsugi inject`: puts faults into a system that `kintsugi run` runs,
//! found through the roster file it publishes, into the pids its
//! supervisor confirms (see [`crate::roster::Verified`]); or into that
//! supervisor itself (`--component supervisor`), which a keeper restarts
//! (issue 17: the supervisor flipped like any component).

use std::time::{Duration, Instant};

use clap::Args;
use kintsugi_campaign::{seed_or_clock, FaultArgs};
use kintsugi_inject::Injection;
use rand::Rng;

use crate::roster::{roster_file, PublishedMember, Verified};

#[derive(Args, Debug)]
pub struct InjectArgs {
    /// The running system: its name (as published by `kintsugi run`), its
    /// system file, or a published roster file.
    #[arg(long)]
    pub system: String,
    /// The component to inject into, `random` (one providing an
    /// interface), or `supervisor` (the system's supervisor process).
    #[arg(long, default_value = "random")]
    pub component: String,
    #[command(flatten)]
    pub fault: FaultArgs,
    /// Inject every this many ms (default: once).
    #[arg(long, conflicts_with = "every_tick")]
    pub every_ms: Option<u64>,
    /// Inject at every tick (--tick-us) at which a thread of the target is
    /// executing user code, as C3 did at timer ticks.
    #[arg(long)]
    pub every_tick: bool,
    /// How many injections, with --every-ms or --every-tick.
    #[arg(long, default_value_t = 1)]
    pub count: u32,
    /// Seed for every choice (default: from the clock; printed).
    #[arg(long)]
    pub seed: Option<u64>,
    /// For --kind hang: release the thread after this many ms if its
    /// component has not been rebooted by then (default: hold it until then).
    #[arg(long)]
    pub hold_ms: Option<u64>,
}

pub fn inject(args: InjectArgs) -> anyhow::Result<bool> {
    let path = roster_file(&args.system)?;
    let seed = seed_or_clock(args.seed);
    let mut injector = args.fault.injector(seed);
    let fault = args.fault.fault();
    let schedule = match (args.every_ms, args.every_tick) {
        (Some(ms), _) => format!("every {ms} ms"),
        (None, true) => format!("at every tick ({} µs)", args.fault.tick_us),
        (None, false) => "once".to_string(),
    };
    let count = if args.every_ms.is_some() || args.every_tick {
        args.count
    } else {
        1
    };
    println!(
        "inject: {fault} into {} of `{}`, {schedule}, {count} in all, seed {seed}",
        args.component,
        path.display()
    );
    let (mut done, mut failed) = (0u32, 0u32);
    let mut answered = Instant::now();
    let mut told = false;
    while done < count {
        let roster = match Verified::ask(&path) {
            Ok(r) => r,
            // A supervisor restarted by its keeper answers again soon.
            Err(e) if path.exists() && answered.elapsed() < REASK => {
                if !std::mem::replace(&mut told, true) {
                    eprintln!(
                        "{e:#}; asking again for {} s (a keeper restarting it?)",
                        REASK.as_secs()
                    );
                }
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
            Err(e) => return Err(e),
        };
        (answered, told) = (Instant::now(), false);
        let Some(target) = Target::choose(&roster, &args.component, injector.rng())? else {
            // Gone since the supervisor answered (a crash, a reboot): ask again.
            std::thread::sleep(Duration::from_millis(1));
            continue;
        };
        let (pid, name) = (target.pid, target.name.as_str());
        let started = Instant::now();
        match injector.inject(pid, &fault) {
            Ok(Injection::Hang(mut held)) => {
                println!(
                    "{name}: pid {pid}{}: thread {} held stopped",
                    target.epoch,
                    held.tid()
                );
                let until = args.hold_ms.map(|ms| started + Duration::from_millis(ms));
                while !held.reap_if_dead() {
                    if until.is_some_and(|u| Instant::now() >= u) {
                        held.release()?;
                        println!(
                            "{name}: released after {} ms",
                            started.elapsed().as_millis()
                        );
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                done += 1;
            }
            Ok(i) => {
                println!("{name}: pid {pid}{}: {i}", target.epoch);
                done += 1;
            }
            Err(kintsugi_inject::InjectError::Gone(_)) => continue,
            Err(e) => {
                eprintln!("{name}: pid {pid}: {e}");
                failed += 1;
                anyhow::ensure!(
                    failed < 10 + count,
                    "giving up after {failed} failed attempts"
                );
                if args.every_ms.is_none() && !args.every_tick {
                    return Ok(false);
                }
            }
        }
        if done < count {
            match args.every_ms {
                Some(ms) => {
                    std::thread::sleep(Duration::from_millis(ms).saturating_sub(started.elapsed()))
                }
                None => std::thread::sleep(Duration::from_micros(args.fault.tick_us)),
            }
        }
    }
    Ok(true)
}

/// How long a supervisor that does not answer while its roster is
/// published (restarted by its keeper) is asked again before `inject`
/// gives up.
const REASK: Duration = Duration::from_secs(30);

/// The process to inject into, as its supervisor confirmed it.
struct Target {
    name: String,
    pid: u32,
    /// `epoch N` of a component; empty for the supervisor.
    epoch: String,
}

impl Target {
    /// `component` of `roster` (or a random one providing an interface,
    /// or the supervisor); `None` if it has no live process that the
    /// supervisor still owns (it died meanwhile); an error if there is
    /// no such component or its pid is not the supervisor's.
    fn choose(
        roster: &Verified,
        component: &str,
        rng: &mut impl Rng,
    ) -> anyhow::Result<Option<Self>> {
        if component == "supervisor" {
            // Confirmed by the control socket's peer: the supervisor itself.
            return Ok(Some(Self {
                name: "supervisor".to_string(),
                pid: roster.supervisor_pid,
                epoch: String::new(),
            }));
        }
        let candidates: Vec<&PublishedMember> = roster
            .members
            .iter()
            .filter(|m| match component {
                "random" => !m.provides.is_empty(),
                name => m.name == name,
            })
            .collect();
        anyhow::ensure!(
            !candidates.is_empty(),
            "`{component}` is not a component of system `{}`",
            roster.system
        );
        let member = candidates[rng.gen_range(0..candidates.len())];
        let Some(pid) = member.pid else {
            return Ok(None);
        };
        if !roster.owns(pid) {
            if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
                return Ok(None);
            }
            anyhow::bail!(
                "{}: pid {pid} is not a process of supervisor {}; refusing to inject",
                member.name,
                roster.supervisor_pid
            );
        }
        Ok(Some(Self {
            name: member.name.clone(),
            pid,
            epoch: format!(" epoch {}", member.epoch),
        }))
    }
}

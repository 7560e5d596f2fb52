//! evt-workload: one thread that either triggers a named event or waits on
//! it, sharing the event with every other component that names it.
//!
//! - `role = "trigger"`: triggers `triggers` times, pausing a random
//!   0..=`gap_us` µs before each, and reports how many triggers were
//!   acknowledged and the highest count a trigger returned (the last
//!   trigger to count returns the event's final count).
//! - `role = "wait"`: waits until the count reaches `expected` (the sum of
//!   every triggerer's `triggers`: a lost trigger leaves it waiting), and
//!   reports how many waits returned and the last count seen. Every wait
//!   must return a count past the previous one.
//!
//! A checker subtracts the acknowledged triggers from the final count to
//! find the duplicates that re-issued triggers may add. A stop request does
//! not cut a run short, but `triggers = 0` and `expected = 0` run until
//! stopped (for campaigns: list the waiters after the triggerers, so that
//! they are stopped first and their last wait still returns). Each
//! publishes the counters `ops` (triggers acknowledged, waits returned),
//! `errors` and `corrupt` (waits that returned a count not past the last).

#![forbid(unsafe_code)]

use std::time::Duration;

use kintsugi_interfaces::evt;
use kintsugi_runtime::counters::{Failures, WorkloadCounters};
use kintsugi_runtime::Incarnation;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

#[derive(Debug, Deserialize)]
#[serde(tag = "role", rename_all = "lowercase", deny_unknown_fields)]
pub enum Config {
    Trigger {
        seed: u64,
        /// The event's name: every component that names it shares it.
        event: u64,
        /// How many (0: until stopped).
        triggers: u64,
        /// Longest pause before each trigger, in µs.
        gap_us: u64,
    },
    Wait {
        event: u64,
        /// The count to wait for (0: wait until stopped).
        expected: u64,
    },
}

#[derive(Debug, Serialize)]
struct Report {
    component: String,
    #[serde(flatten)]
    outcome: Outcome,
    #[serde(flatten)]
    errors: Failures,
}

#[derive(Debug, Serialize)]
#[serde(tag = "role", rename_all = "lowercase")]
enum Outcome {
    Trigger {
        /// Triggers acknowledged.
        triggers: u64,
        /// The highest count a trigger returned.
        max_count: u64,
    },
    Wait {
        /// Waits that returned.
        waits: u64,
        /// The last count a wait returned.
        final_count: u64,
    },
}

/// Where a run publishes its counts, and whether it was asked to stop.
struct Env<'a> {
    counters: WorkloadCounters<'a>,
    seen: [u64; 2],
    stop: &'a dyn Fn() -> bool,
}

impl Env<'_> {
    fn op(&mut self, errors: &Failures) {
        self.counters.op();
        self.publish(errors);
    }

    fn publish(&mut self, errors: &Failures) {
        self.counters.publish(&mut self.seen, errors);
    }
}

fn trigger(
    client: &evt::Client,
    env: &mut Env,
    errors: &mut Failures,
    seed: u64,
    event: u64,
    triggers: u64,
    gap_us: u64,
) -> Outcome {
    let (mut acknowledged, mut max_count) = (0, 0);
    let mut rng = StdRng::seed_from_u64(seed);
    match client.create(event) {
        Err(e) => errors.error(format!("create({event}): {e}")),
        Ok(ev) => {
            let mut i = 0;
            while i < triggers || (triggers == 0 && !(env.stop)()) {
                i += 1;
                std::thread::sleep(Duration::from_micros(rng.gen_range(0..=gap_us)));
                match client.trigger(ev) {
                    Ok(count) => {
                        acknowledged += 1;
                        max_count = max_count.max(count);
                        env.op(errors);
                    }
                    Err(e) => {
                        errors.error(format!("trigger {i}: {e}"));
                        env.publish(errors);
                    }
                }
            }
        }
    }
    Outcome::Trigger {
        triggers: acknowledged,
        max_count,
    }
}

fn wait(
    client: &evt::Client,
    env: &mut Env,
    errors: &mut Failures,
    event: u64,
    expected: u64,
) -> Outcome {
    let (mut waits, mut last) = (0, 0);
    match client.create(event) {
        Err(e) => errors.error(format!("create({event}): {e}")),
        Ok(ev) => {
            while last < expected || (expected == 0 && !(env.stop)()) {
                match client.wait(ev) {
                    Ok(count) => {
                        waits += 1;
                        if count <= last {
                            errors.corrupt(format!("wait returned {count} after {last}"));
                        }
                        last = last.max(count);
                        env.op(errors);
                    }
                    Err(e) => {
                        errors.error(format!("wait after {last}: {e}"));
                        env.publish(errors);
                        break;
                    }
                }
            }
        }
    }
    Outcome::Wait {
        waits,
        final_count: last,
    }
}

fn main() {
    kintsugi_runtime::run(|rt| {
        let config: Config = rt.config()?;
        let client = evt::Client::connect(rt)?;
        let component = rt.name().to_string();
        let rt = rt.clone();
        Ok(Incarnation::main(move || {
            tracing::info!(?config, "evt-workload starting");
            let stop = || rt.stop_requested();
            let mut env = Env {
                counters: rt.workload_counters()?,
                seen: [0; 2],
                stop: &stop,
            };
            let mut errors = Failures::default();
            let outcome = match config {
                Config::Trigger {
                    seed,
                    event,
                    triggers,
                    gap_us,
                } => trigger(
                    &client,
                    &mut env,
                    &mut errors,
                    seed,
                    event,
                    triggers,
                    gap_us,
                ),
                Config::Wait { event, expected } => {
                    wait(&client, &mut env, &mut errors, event, expected)
                }
            };
            let report = Report {
                component,
                outcome,
                errors,
            };
            println!("{}", serde_json::to_string(&report)?);
            Ok(report.errors.check()?)
        }))
    })
}

#[cfg(test)]
mod tests {
    use super::Config;

    #[test]
    fn the_role_picks_the_fields() {
        let t: Config = serde_json::from_str(
            r#"{"role":"trigger","seed":1,"event":2,"triggers":3,"gap_us":4}"#,
        )
        .unwrap();
        assert!(matches!(
            t,
            Config::Trigger {
                triggers: 3,
                gap_us: 4,
                ..
            }
        ));
        let w: Config = serde_json::from_str(r#"{"role":"wait","event":2,"expected":6}"#).unwrap();
        assert!(matches!(w, Config::Wait { expected: 6, .. }));
        assert!(serde_json::from_str::<Config>(
            r#"{"role":"wait","event":2,"expected":6,"triggers":1}"#
        )
        .is_err());
        assert!(serde_json::from_str::<Config>(r#"{"role":"shout","event":2}"#).is_err());
    }
}

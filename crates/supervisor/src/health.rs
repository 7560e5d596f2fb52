//! What an operator asks of a running component (issue 18, `kintsugi
//! status`): its state, since when, how it last ended, how often it was
//! restarted and how long its reboots took, what its clients rebuilt and
//! how many hangs were found. Kept by the roster from the supervisor's own
//! events ([`Health::observe`]), so that it says exactly what the event
//! log says.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::events::{Event, Exit};

/// Where a component stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum State {
    /// Being exec'd and initialized for the first time.
    Starting,
    Live,
    /// Its incarnation died; a new one is being started (or waits for its
    /// backoff delay).
    Rebooting,
    /// It finished by itself.
    Finished,
    /// The supervisor gave up on it.
    Failed,
}

/// The reboot times kept for percentiles: the latest this many.
pub const REBOOTS_KEPT: usize = 1024;

/// One component's health.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Health {
    pub state: State,
    /// When it entered its state.
    pub since: Instant,
    /// Reboots so far (rollbacks in place not counted).
    pub restarts: u64,
    /// How its last incarnation ended, and why if the supervisor knows.
    pub last_exit: Option<(Exit, String)>,
    /// The latest reboots' durations, in µs, oldest first.
    pub reboot_us: VecDeque<u64>,
    /// Descriptors its clients rebuilt after its reboots.
    pub recovered: u64,
    /// Hangs the watchdog found in it (rolled back or rebooted).
    pub hangs: u64,
    /// Why it was given up, if it was.
    pub gave_up: Option<String>,
    /// Why the supervisor is killing its incarnation (a fault reported),
    /// for the crash that follows.
    killing_for: Option<String>,
}

impl Default for Health {
    fn default() -> Self {
        Self {
            state: State::Starting,
            since: Instant::now(),
            restarts: 0,
            last_exit: None,
            reboot_us: VecDeque::new(),
            recovered: 0,
            hangs: 0,
            gave_up: None,
            killing_for: None,
        }
    }
}

impl Health {
    /// Takes in `e`, an event about this component.
    pub(crate) fn observe(&mut self, e: &Event) {
        let now = Instant::now();
        let mut enter = |state: State| {
            self.state = state;
            self.since = now;
        };
        match e {
            Event::Started { .. } => enter(State::Live),
            Event::Crashed {
                exit, in_flight, ..
            } => {
                enter(State::Rebooting);
                let during = match in_flight.as_slice() {
                    [] => String::new(),
                    calls => format!("during {}", calls.join(", ")),
                };
                let why = self.killing_for.take().unwrap_or(during);
                self.last_exit = Some((*exit, why));
            }
            Event::Rebooted { took, .. } => {
                enter(State::Live);
                self.restarts += 1;
                if self.reboot_us.len() == REBOOTS_KEPT {
                    self.reboot_us.pop_front();
                }
                self.reboot_us.push_back(took.as_micros() as u64);
            }
            Event::Finished { exit, .. } => {
                enter(State::Finished);
                self.last_exit = Some((*exit, "finished".into()));
            }
            Event::GaveUp { reason, .. } => {
                enter(State::Failed);
                self.gave_up = Some(reason.to_string());
            }
            Event::FaultReported { detail, hang, .. } => {
                self.hangs += u64::from(*hang);
                self.killing_for = Some(detail.clone());
            }
            Event::RolledBack { .. } => self.hangs += 1,
            Event::GroupRestarted { group, because, .. } => {
                self.killing_for = Some(format!("restarted with {because}, group {group}"));
            }
            Event::Recovered { descriptors, .. } => self.recovered += descriptors,
            _ => {}
        }
    }

    /// How long it has been in its state.
    pub fn for_how_long(&self) -> Duration {
        self.since.elapsed()
    }

    /// Percentiles of the kept reboot times, in µs, with their count.
    pub fn reboots(&self) -> Option<crate::stats::Summary> {
        let v: Vec<f64> = self.reboot_us.iter().map(|&us| us as f64).collect();
        crate::stats::Summary::of(&v)
    }
}

/// The component an event concerns, if one.
pub(crate) fn component_of(e: &Event) -> Option<&str> {
    match e {
        Event::Started { component, .. }
        | Event::Crashed { component, .. }
        | Event::Rebooted { component, .. }
        | Event::Finished { component, .. }
        | Event::GaveUp { component, .. }
        | Event::FaultReported { component, .. }
        | Event::RolledBack { component, .. }
        | Event::GroupRestarted { component, .. } => Some(component),
        Event::Recovered { server, .. } => Some(server),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_move_the_state_and_count() {
        let mut h = Health::default();
        let c = || "x".to_string();
        h.observe(&Event::Started {
            component: c(),
            pid: 1,
            boot: Duration::from_micros(5),
        });
        assert_eq!(h.state, State::Live);
        for took in [300, 100, 200] {
            h.observe(&Event::Crashed {
                component: c(),
                pid: 1,
                epoch: 1,
                exit: Exit::Signal(9),
                in_flight: vec!["fs.read".into()],
                after_injection: None,
            });
            assert_eq!(h.state, State::Rebooting);
            h.observe(&Event::Rebooted {
                component: c(),
                epoch: 2,
                pid: 2,
                took: Duration::from_micros(took),
                init: Duration::ZERO,
            });
        }
        assert_eq!((h.state, h.restarts), (State::Live, 3));
        assert_eq!(
            h.last_exit,
            Some((Exit::Signal(9), "during fs.read".into()))
        );
        let r = h.reboots().unwrap();
        assert_eq!((r.p50.round(), r.p99.round(), r.n), (200.0, 300.0, 3));
        assert!(Health::default().reboots().is_none());
    }
}

//! What the supervisor reports while a system runs: the live event log,
//! as text (`Display`) or as one JSON object per event (`serde`, with
//! `"event"` naming the variant and durations in microseconds, `…_us`).

use std::fmt;
use std::time::Duration;

use kintsugi_system::GiveUpAction;
use serde::{Deserialize, Serialize};

use crate::policy::GiveUpReason;

/// How a process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Exit {
    Code(i32),
    Signal(i32),
}

impl fmt::Display for Exit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Exit::Code(c) => write!(f, "exit code {c}"),
            Exit::Signal(s) => write!(f, "{}", signal_name(*s)),
        }
    }
}

pub fn signal_name(sig: i32) -> String {
    let name = match sig {
        1 => "SIGHUP",
        2 => "SIGINT",
        3 => "SIGQUIT",
        4 => "SIGILL",
        5 => "SIGTRAP",
        6 => "SIGABRT",
        7 => "SIGBUS",
        8 => "SIGFPE",
        9 => "SIGKILL",
        11 => "SIGSEGV",
        13 => "SIGPIPE",
        14 => "SIGALRM",
        15 => "SIGTERM",
        _ => return format!("signal {sig}"),
    };
    name.to_string()
}

/// Durations in whole microseconds on the wire.
mod micros {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(d.as_micros() as u64)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        u64::deserialize(d).map(Duration::from_micros)
    }

    pub mod option {
        use super::*;

        pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
            match d {
                Some(d) => s.serialize_some(&(d.as_micros() as u64)),
                None => s.serialize_none(),
            }
        }

        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
            Ok(Option::<u64>::deserialize(d)?.map(Duration::from_micros))
        }
    }
}

/// One entry of the event log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    /// A component's first incarnation is serving.
    Started {
        component: String,
        pid: u32,
        #[serde(rename = "boot_us", with = "micros")]
        boot: Duration,
    },
    /// The injector sent a signal to a live incarnation.
    Injected {
        component: String,
        pid: u32,
        signal: i32,
        in_flight: Vec<String>,
        rss_kib: u64,
    },
    /// An incarnation died; `after_injection` is the time from the
    /// injector's signal to the supervisor's detection, when it caused it.
    Crashed {
        component: String,
        pid: u32,
        epoch: u64,
        exit: Exit,
        in_flight: Vec<String>,
        #[serde(rename = "after_injection_us", with = "micros::option")]
        after_injection: Option<Duration>,
    },
    /// A new incarnation serves; `took` runs from the death's detection to
    /// the new incarnation's readiness, of which `init` was its execution
    /// re-initialization (the component's `init`); the rest restored its
    /// memory (woke the pristine standby, or forked or exec'd one).
    Rebooted {
        component: String,
        epoch: u64,
        pid: u32,
        #[serde(rename = "took_us", with = "micros")]
        took: Duration,
        #[serde(rename = "init_us", with = "micros")]
        init: Duration,
    },
    /// At the start of `epoch`, the eager component's clients rebuilt
    /// `descriptors` descriptors by upcall, while it held other calls.
    EagerRecovery {
        component: String,
        epoch: u64,
        descriptors: u64,
        #[serde(rename = "took_us", with = "micros")]
        took: Duration,
    },
    /// Clients rebuilt descriptors of `server` during its previous epoch.
    Recovered {
        server: String,
        client: String,
        epoch: u64,
        descriptors: u64,
    },
    /// An active component ended by itself.
    Finished { component: String, exit: Exit },
    /// The supervisor gave up on a component, and `action` follows.
    GaveUp {
        component: String,
        reason: GiveUpReason,
        action: GiveUpAction,
    },
    /// `component` is restarted because `because`, in its restart group,
    /// failed (`one_for_all`, `rest_for_one`).
    GroupRestarted {
        component: String,
        group: String,
        because: String,
    },
    /// A component failed the same way `failures` times in a row: its
    /// restart waits `delay` (the restart policy's backoff).
    BackingOff {
        component: String,
        failures: u32,
        #[serde(rename = "delay_us", with = "micros")]
        delay: Duration,
    },
    /// A fault found beside the supervisor (the watchdog, a checker) was
    /// reported through the roster; the incarnation is killed and rebooted.
    FaultReported {
        component: String,
        pid: u32,
        detail: String,
        /// A hang the watchdog found (else a checker's finding, or an
        /// operator's `kintsugi restart`).
        #[serde(default)]
        hang: bool,
    },

    /// The pristine image died and was rebuilt from the binary.
    ZygoteRespawned { component: String, pid: u32 },
    /// A hang was answered by rolling the incarnation back in place to its
    /// latest checkpoint (`checkpoint.on_hang = "rollback"`).
    RolledBack {
        component: String,
        pid: u32,
        detail: String,
        pages: u64,
        #[serde(rename = "pause_us", with = "micros")]
        pause: Duration,
        /// Worker threads started over at the top of their loops (see
        /// `kintsugi_runtime`'s `restart.rs`) rather than resumed.
        #[serde(default)]
        started_over: usize,
    },
    /// A checkpoint-recovered component's new incarnation got the last
    /// checkpoint (`kind`: "restore and replay", or "replay" if there was
    /// none yet) and replays the `entries` requests logged since; or
    /// drops both ("fresh start (checkpoint and log dropped)") when the
    /// last recovery hung again at once (`ladder.rs`).
    Replayed {
        component: String,
        pid: u32,
        kind: String,
        /// Pages written into the new incarnation, and pages of it
        /// compared with the image to find them.
        pages: u64,
        #[serde(default)]
        compared: u64,
        /// System calls it made to put the mappings back as the image has
        /// them (`brk`, `mmap`, `mprotect`, `munmap`).
        #[serde(default)]
        layout_calls: u64,
        #[serde(rename = "pause_us", with = "micros")]
        pause: Duration,
        entries: u64,
        /// The replay, if it was over within 2 s.
        #[serde(rename = "replay_us", with = "micros")]
        replay: Duration,
        /// Calls of the replayed requests to other servers answered from
        /// the log, and divergences (see `kintsugi_runtime`'s journal).
        #[serde(default)]
        calls: u64,
        #[serde(default)]
        diverged: u64,
        /// Worker threads started over rather than resumed.
        #[serde(default)]
        started_over: usize,
    },
    /// A component's first incarnation took an image exported elsewhere
    /// (`kintsugi run --restore`).
    Restored {
        component: String,
        pid: u32,
        file: String,
        pages: u64,
        #[serde(rename = "pause_us", with = "micros")]
        pause: Duration,
    },
    /// The system stopped.
    Stopped { reason: String },
}

impl fmt::Display for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Event::Started { component, pid, boot } => {
                write!(f, "{component}: started (pid {pid}) in {} µs", boot.as_micros())
            }
            Event::Injected { component, pid, signal, in_flight, rss_kib } => {
                write!(f, "{component}: injected {} into pid {pid} (rss {rss_kib} KiB", signal_name(*signal))?;
                if in_flight.is_empty() {
                    write!(f, ", idle)")
                } else {
                    write!(f, ", during {})", in_flight.join(", "))
                }
            }
            Event::Crashed { component, pid, epoch, exit, in_flight, after_injection } => {
                match exit {
                    // Only a permanent component is restarted after a
                    // clean exit (any other has finished).
                    Exit::Code(0) => write!(
                        f,
                        "{component}: exited cleanly, restarted as a permanent component (pid {pid}, epoch {epoch}"
                    )?,
                    _ => write!(f, "{component}: crashed with {exit} (pid {pid}, epoch {epoch}")?,
                }
                match after_injection {
                    Some(d) => write!(f, ", detected {} µs after the signal)", d.as_micros())?,
                    None => write!(f, ")")?,
                }
                if !in_flight.is_empty() {
                    write!(f, "; calls in flight: {}", in_flight.join(", "))?;
                }
                Ok(())
            }
            Event::Rebooted { component, epoch, pid, took, init } => write!(
                f,
                "{component}: rebooted in {} µs, init {} µs (epoch {epoch}, pid {pid})",
                took.as_micros(),
                init.as_micros()
            ),
            Event::EagerRecovery { component, epoch, descriptors, took } => write!(
                f,
                "{component}: eager recovery rebuilt {descriptors} descriptors in {} µs (epoch {epoch})",
                took.as_micros()
            ),
            Event::Recovered { server, client, epoch, descriptors } => {
                write!(f, "{server}: {client} recovered {descriptors} descriptors during epoch {epoch}")
            }
            Event::Finished { component, exit } => write!(f, "{component}: finished with {exit}"),
            Event::GaveUp { component, reason, action } => write!(
                f,
                "{component}: {reason}; giving up: {}",
                match action {
                    GiveUpAction::Stop => "the system stops",
                    GiveUpAction::Isolate => "it stays failed, its clients' calls fail, the rest runs on",
                }
            ),
            Event::GroupRestarted { component, group, because } => {
                write!(f, "{component}: restarted with {because} (group {group})")
            }
            Event::BackingOff { component, failures, delay } => write!(
                f,
                "{component}: failed the same way {failures} times in a row; restarting in {} ms",
                delay.as_millis()
            ),
            Event::FaultReported { component, pid, detail, .. } => {
                write!(f, "{component}: fault reported in pid {pid}: {detail}; rebooting")
            }
            Event::ZygoteRespawned { component, pid } => {
                write!(f, "{component}: pristine image lost; rebuilt from the binary (pid {pid})")
            }
            Event::RolledBack {
                component,
                pid,
                detail,
                pages,
                pause,
                started_over,
            } => write!(
                f,
                "{component}: {detail}; rolled back in place (pid {pid}, {pages} pages, held {} µs, {started_over} workers started over)",
                pause.as_micros()
            ),
            Event::Replayed {
                component,
                pid,
                kind,
                pages,
                compared,
                layout_calls,
                pause,
                entries,
                replay,
                calls,
                diverged,
                started_over,
            } => write!(
                f,
                "{component}: checkpoint recovery into pid {pid}: {kind} ({pages} pages written of {compared} compared, {layout_calls} calls to remap, held {} µs, {started_over} workers started over), {entries} logged requests replayed in {} µs ({calls} calls to other servers answered from the log, {diverged} divergences)",
                pause.as_micros(),
                replay.as_micros()
            ),
            Event::Restored {
                component,
                pid,
                file,
                pages,
                pause,
            } => write!(
                f,
                "{component}: restored from {file} into pid {pid} ({pages} pages, held {} µs)",
                pause.as_micros()
            ),
            Event::Stopped { reason } => write!(f, "system stopped: {reason}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_clean_exit_is_not_called_a_crash() {
        let crashed = |exit| Event::Crashed {
            component: "a".into(),
            pid: 7,
            epoch: 2,
            exit,
            in_flight: vec!["fs.read".into()],
            after_injection: None,
        };
        assert_eq!(
            crashed(Exit::Signal(9)).to_string(),
            "a: crashed with SIGKILL (pid 7, epoch 2); calls in flight: fs.read"
        );
        assert_eq!(
            crashed(Exit::Code(0)).to_string(),
            "a: exited cleanly, restarted as a permanent component (pid 7, epoch 2); calls in flight: fs.read"
        );
    }
}

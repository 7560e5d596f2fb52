//! How a run is steered ([`Options`]), how it ended ([`Report`]) and what
//! can stop it from starting ([`SupervisorError`]).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kintsugi_inject::ChaosPlan;
use kintsugi_runtime::stub::InterfaceInfo;
use thiserror::Error;

use crate::events::Exit;
use crate::journald::Journal;
use crate::output::ComponentStdout;
use crate::roster::Roster;
use crate::sockets::{Activated, Inherited};

#[derive(Debug, Error)]
pub enum SupervisorError {
    #[error("component `{component}`: cannot start `{binary}`: {source}")]
    Spawn {
        component: String,
        binary: String,
        source: std::io::Error,
    },
    #[error("component `{component}` failed to boot: {detail}")]
    Boot { component: String, detail: String },
    #[error("component `{component}`: restoring {file}: {detail}")]
    Restore {
        component: String,
        file: String,
        detail: String,
    },
    #[error("vault: {0}")]
    Vault(String),
    #[error("chaos target `{0}` is not a component of this system")]
    UnknownTarget(String),
    #[error("supervisor: {0}")]
    Io(#[from] std::io::Error),
}

impl From<rustix::io::Errno> for SupervisorError {
    fn from(e: rustix::io::Errno) -> Self {
        SupervisorError::Io(e.into())
    }
}

/// How a run is steered.
pub struct Options {
    pub chaos: Option<ChaosPlan>,
    /// Stop the system once the chaos plan's count is reached.
    pub stop_after_chaos: bool,
    /// Stop the system when this component ends by itself.
    pub stop_when_finished: Option<String>,
    /// Stop after this long.
    pub duration: Option<Duration>,
    /// How long an incarnation may take to initialize.
    pub ready_timeout: Duration,
    /// How long a component may take to stop after SIGTERM.
    pub stop_grace: Duration,
    /// Interfaces known by name, to name the functions in flight at a fault.
    pub interfaces: Vec<&'static InterfaceInfo>,
    /// Detect deaths through lifelines as well as pidfds (see
    /// `kintsugi_runtime::abi::lifeline`); off, only the pidfd reports them.
    pub lifelines: bool,
    /// A live view of the system for observers; one is made if not given.
    pub roster: Option<Arc<Roster>>,
    /// Where periodic checkpoints kept as files go (`checkpoint.keep`);
    /// a folder under the temporary directory if not given.
    pub checkpoint_dir: Option<PathBuf>,
    /// Components whose first incarnation takes an exported image (its
    /// vault records and durable memory put in place before it starts, its
    /// memory and threads restored once it serves): another supervisor's
    /// checkpoint, moved here (`kintsugi run --restore C=FILE`).
    pub restores: Vec<(String, PathBuf)>,
    /// The event loop turns at least this often, each turn counted by
    /// [`Roster::loop_turns`], so that an observer can tell a live loop
    /// from a hung one (a service manager's watchdog).
    pub heartbeat: Option<Duration>,
    /// Sockets a service manager passed (socket activation), for the
    /// components whose `sockets` name them.
    pub sockets: Activated,
    /// Under a keeper (`[system] keeper`): what this supervisor inherited
    /// from the one before it (nothing for the first). The vault then logs
    /// the descriptors its records hold, and takes back those inherited.
    pub keeper: Option<Inherited>,
    /// Where components' log lines go as entries, if the logs go to
    /// systemd's journal (`--log-format journal`); else to stderr.
    pub journal: Option<Arc<Journal>>,
    /// Where the lines components print on their stdout (their reports)
    /// go: the supervisor's stdout, or its stderr when its stdout carries
    /// something else (a benchmark's tables).
    pub component_stdout: ComponentStdout,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            chaos: None,
            stop_after_chaos: false,
            stop_when_finished: None,
            duration: None,
            ready_timeout: Duration::from_secs(10),
            stop_grace: Duration::from_secs(20),
            interfaces: Vec::new(),
            lifelines: true,
            roster: None,
            checkpoint_dir: None,
            restores: Vec::new(),
            heartbeat: None,
            sockets: Activated::default(),
            keeper: None,
            journal: None,
            component_stdout: ComponentStdout::Stdout,
        }
    }
}

/// Why a run ended, and how each component's last incarnation ended.
#[derive(Debug)]
pub struct Report {
    pub reason: StopReason,
    pub exits: Vec<LastExit>,
}

/// How a component's last incarnation ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LastExit {
    pub component: String,
    pub exit: Exit,
    /// It died of the chaos injector's last signal before the stop reached
    /// it: the fault was injected, the component did not fail to stop.
    pub injected: bool,
}

impl LastExit {
    /// Stopped cleanly (exit code 0 or the stop's SIGTERM), or killed by
    /// an injection.
    pub fn clean(&self) -> bool {
        self.injected || matches!(self.exit, Exit::Code(0) | Exit::Signal(15))
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopReason {
    Signal,
    ChaosDone,
    Finished(String),
    Duration,
    GaveUp(String),
    /// An observer asked through the roster ([`Roster::request_stop`]).
    Requested,
}

impl Report {
    /// True if the run ended as planned and no active component failed.
    pub fn success(&self) -> bool {
        !matches!(self.reason, StopReason::GaveUp(_)) && self.exits.iter().all(LastExit::clean)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_succeeds_only_if_it_was_not_given_up_and_every_exit_is_clean() {
        let report = |reason, exits: &[Exit]| Report {
            reason,
            exits: exits
                .iter()
                .map(|e| LastExit {
                    component: "c".to_string(),
                    exit: *e,
                    injected: false,
                })
                .collect(),
        };
        assert!(report(StopReason::Duration, &[Exit::Code(0), Exit::Signal(15)]).success());
        assert!(!report(StopReason::Duration, &[Exit::Code(1)]).success());
        assert!(!report(StopReason::Duration, &[Exit::Signal(9)]).success());
        assert!(!report(StopReason::GaveUp("c".into()), &[]).success());
        let mut killed = report(StopReason::Finished("client".into()), &[Exit::Signal(11)]);
        assert!(!killed.success());
        killed.exits[0].injected = true;
        assert!(
            killed.success(),
            "the injector's last fault is not a failed stop"
        );
    }
}

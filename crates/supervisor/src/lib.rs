//! The kintsugi supervisor: starts a system from its description, wires the
//! only channels that exist between its components, detects component deaths
//! through pidfds, micro-reboots components from their pristine images,
//! applies restart policies, keeps the state vault, watches for hangs, and
//! stops everything cleanly.

#![deny(unsafe_code)]

mod activation;
mod chaos;
mod checkpoints;
pub mod events;
pub mod health;
pub mod journald;
mod ladder;
mod mailbox;
mod managed;
mod options;
mod output;
mod policy;
pub mod private;
#[allow(unsafe_code)] // each block has a SAFETY comment (README: unsafe)
mod process;
pub mod quota;
mod reboot;
pub mod roster;
mod shutdown;
#[allow(unsafe_code)] // each block with its SAFETY comment (README: unsafe)
mod sockets;
mod source;
pub mod stats;
mod supervisor;
mod turns;
mod vault;
mod watch;
pub mod watchdog;
mod zygote;

pub use checkpoints::Summary as CheckpointSummary;
pub use events::{Event, Exit};
pub use health::{Health, State};
pub use kintsugi_inject::{parse_signal, ChaosPlan};
pub use options::{LastExit, Options, Report, StopReason, SupervisorError};
pub use output::ComponentStdout;
pub use policy::GiveUpReason;
pub use quota::VaultUse;
pub use roster::{FaultReport, Member, Roster};
pub use sockets::{Activated, Inherited};
pub use supervisor::run;
pub use turns::{Stalls, Turns};
pub use watchdog::{Detection, HangKind};

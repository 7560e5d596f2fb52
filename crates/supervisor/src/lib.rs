//! The kintsugi supervisor: starts a system from its description, wires the
//! only channels that exist between its components, detects component deaths
//! through pidfds, micro-reboots components from their pristine images,
//! applies restart policies, keeps the state vault, watches for hangs, and
//! stops everything cleanly.

#![deny(unsafe_code)]

pub mod chaos;
pub mod events;
mod policy;
#[allow(unsafe_code)] // each block has a SAFETY comment (README: unsafe)
mod process;
pub mod roster;
mod supervisor;
mod vault;
mod watch;
pub mod watchdog;

pub use chaos::{parse_signal, ChaosPlan};
pub use events::{Event, Exit};
pub use roster::{FaultReport, Member, Roster};
pub use supervisor::{run, Options, Report, StopReason, SupervisorError};
pub use watchdog::{Detection, HangKind};

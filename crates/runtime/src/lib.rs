//! The kintsugi runtime, linked into every component and into the
//! supervisor: shared-memory channels and the invocation protocol, upcalls
//! from servers to clients, thread priorities, the types that generated
//! stubs use, the component lifecycle (pristine image, warm standby,
//! incarnation), and the state vault's protocol.

#![deny(unsafe_code)]

#[allow(unsafe_code)] // each block has a SAFETY comment (README: unsafe)
pub mod boot;
#[allow(unsafe_code)] // each block has a SAFETY comment (README: unsafe)
pub mod channel;
#[allow(unsafe_code)] // each block has a SAFETY comment (README: unsafe)
pub mod client;
pub mod clock;
#[allow(unsafe_code)] // each block has a SAFETY comment (README: unsafe)
pub mod component;
#[allow(unsafe_code)] // each block has a SAFETY comment (README: unsafe)
pub mod counters;
mod durable;
pub mod fdpass;
pub mod futex;
#[allow(unsafe_code)] // each block has a SAFETY comment (README: unsafe)
pub mod lifeline;
mod logging;
#[allow(unsafe_code)] // each block has a SAFETY comment (README: unsafe)
pub mod priority;
#[allow(unsafe_code)] // each block has a SAFETY comment (README: unsafe)
pub mod process;
pub mod records;
#[allow(unsafe_code)] // each block has a SAFETY comment (README: unsafe)
pub mod server;
#[allow(unsafe_code)] // each block has a SAFETY comment (README: unsafe)
pub mod shm;
pub mod stub;
pub mod testing;
pub mod upcall;
pub mod vault;
#[allow(unsafe_code)] // each block has a SAFETY comment (README: unsafe)
pub mod watchdog;
pub mod wire;

/// Includes the module that `kintsugi_idl` generated for interface `name`
/// in the build script (`$OUT_DIR/<name>.rs`):
///
/// ```ignore
/// pub mod tally {
///     kintsugi_runtime::include_interface!("tally");
/// }
/// ```
#[macro_export]
macro_rules! include_interface {
    ($name:literal) => {
        include!(concat!(env!("OUT_DIR"), "/", $name, ".rs"));
    };
}

pub use client::{Connection, RecoveryScope};
pub use component::{run, ConnectError, Incarnation, Runtime};
pub use stub::{CallError, Caller, Callers, Fault};

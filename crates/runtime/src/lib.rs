//! The kintsugi runtime, linked into every component and into the
//! supervisor: shared-memory channels and the invocation protocol, upcalls
//! from servers to clients, thread priorities, the types that generated
//! stubs use, the component lifecycle (pristine image, warm standby,
//! incarnation), and the state vault's protocol.

pub mod boot;
pub mod channel;
pub mod client;
pub mod clock;
pub mod component;
pub mod counters;
mod durable;
pub mod fdpass;
pub mod futex;
pub mod lifeline;
mod logging;
pub mod priority;
pub mod process;
pub mod records;
pub mod server;
pub mod shm;
pub mod stub;
pub mod testing;
pub mod upcall;
pub mod vault;
pub mod watchdog;
pub mod wire;

pub use client::{Connection, RecoveryScope};
pub use component::{run, ConnectError, Incarnation, Runtime};
pub use stub::{CallError, Caller, Callers, Fault};

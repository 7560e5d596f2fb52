//! The ABI between the supervisor and components: what lies in shared
//! memory and what crosses their sockets. `shm` maps the regions;
//! `channel` is an edge's slots and header (the invocation protocol of
//! C3's server-side invocation, futex-woken); `boot` the boot record and a
//! component's control block; `lifeline` the per-thread robust futexes
//! that report deaths; `zygote` and `fdpass` the pristine image's socket
//! protocol. Component authors never touch these; the supervisor and the
//! runtime both do, so they are one module and one layout.

#[allow(unsafe_code)] // each block has a SAFETY comment (README: unsafe)
pub mod boot;
#[allow(unsafe_code)] // each block has a SAFETY comment (README: unsafe)
pub mod channel;
pub mod fdpass;
#[allow(unsafe_code)] // each block has a SAFETY comment (README: unsafe)
pub mod journal;
#[allow(unsafe_code)] // each block has a SAFETY comment (README: unsafe)
pub mod lifeline;
#[allow(unsafe_code)] // each block has a SAFETY comment (README: unsafe)
pub mod shm;
pub mod zygote;

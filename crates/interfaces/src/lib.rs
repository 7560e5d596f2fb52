//! Client and server stubs for every interface in `idl/`, generated at
//! build time by `kintsugi-idl` (see `build.rs`). Each module holds the
//! interface's `INFO`, `Error`, records, descriptor handles, the `Server`
//! trait with `service()` (the server stub), and the recovering `Client`.

#![forbid(unsafe_code)]

/// `idl/fs.kidl`: the file system served by ramfs.
pub mod fs {
    kintsugi_runtime::include_interface!("fs");
}

/// `idl/bench.kidl`: the benchmark interface served by bench-echo.
pub mod bench {
    kintsugi_runtime::include_interface!("bench");
}

/// `idl/lock.kidl`: locks shared between components.
pub mod lock {
    kintsugi_runtime::include_interface!("lock");
}

/// `idl/evt.kidl`: events shared between components.
pub mod evt {
    kintsugi_runtime::include_interface!("evt");
}

/// `idl/timer.kidl`: periodic and one-shot timers.
pub mod timer {
    kintsugi_runtime::include_interface!("timer");
}

/// `idl/mm.kidl`: pages granted, aliased and revoked by the memory manager.
pub mod mm {
    kintsugi_runtime::include_interface!("mm");
}

/// `idl/spin.kidl`: work, hangs and waits for the watchdog's tests.
pub mod spin {
    kintsugi_runtime::include_interface!("spin");
}

/// `idl/net.kidl`: TCP connections served by netd.
pub mod net {
    kintsugi_runtime::include_interface!("net");
}

/// `idl/kv.kidl`: an in-memory key-value store, recovered by checkpoints
/// and request-log replay.
pub mod kv {
    kintsugi_runtime::include_interface!("kv");
}

pub mod fs_dir;
pub mod lock_lease;
pub mod mm_map;
pub mod spin_work;

/// Flags of `fs.open`.
pub mod fs_flags {
    /// Create the file if it does not exist.
    pub const CREATE: u32 = 1;
    /// Truncate the file to zero length.
    pub const TRUNCATE: u32 = 2;
}

/// Change counters ramfs publishes on its `fs` edges (see
/// `kintsugi_runtime::client::Changes`).
pub mod fs_changes {
    /// Counts changes of names: files and directories created, removed, renamed.
    pub const NAMES: usize = 0;
    /// Counters of files' contents, `Stat::counter`, lie in `FIRST_FILE..64`.
    pub const FIRST_FILE: usize = 1;
}

/// Every interface this crate knows, for naming functions in event logs.
pub static ALL: &[&kintsugi_runtime::InterfaceInfo] = &[
    &fs::INFO,
    &bench::INFO,
    &lock::INFO,
    &evt::INFO,
    &timer::INFO,
    &mm::INFO,
    &spin::INFO,
    &net::INFO,
    &kv::INFO,
];

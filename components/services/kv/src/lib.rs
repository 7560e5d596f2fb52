//! kv's store as a library: the component (`main.rs`) serves it, and
//! `kintsugi bench kv` runs it in process to measure what the request log
//! costs a request (`kintsugi_runtime::testing::Loopback`).

#![forbid(unsafe_code)]

mod changelog;
mod store;

pub use changelog::Changelog;
pub use store::Store;

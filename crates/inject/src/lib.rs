//! Fault injection into running processes, the primitives under
//! `kintsugi inject` and `kintsugi campaign`: one random bit of a
//! general-purpose register (or one in each) of a thread caught executing
//! user code, one bit of a resident byte of the heap, a live stack or the
//! binary's data, a crash signal delivered to one thread, a hang (a thread
//! held stopped) and a delay. Everything goes through ptrace and `/proc`
//! (`PTRACE_SEIZE`/`PTRACE_INTERRUPT`, `/proc/<pid>/mem`, `pagemap`): no
//! cooperation from the target and no `unsafe`. Every random choice comes
//! from the [`Injector`]'s seeded generator. The [`Schedule`] of crash
//! signals that the supervisor delivers (`kintsugi run --kill`) lives here
//! too: this crate is the one place faults are chosen.

#![forbid(unsafe_code)]

mod fault;
mod procfs;
mod schedule;
mod stop;

pub use fault::{Fault, Flip, Injection, Injector, GPRS};
pub use procfs::{describe_threads, threads, Area, ThreadInfo};
pub use schedule::{parse_signal, ChaosPlan, Schedule};
pub use stop::{hold_until_death, Held, Stopped};

use thiserror::Error;

#[derive(Debug, Error)]
pub enum InjectError {
    #[error("process {0} is gone")]
    Gone(u32),
    #[error("not permitted to trace thread {tid} of process {pid} (needs CAP_SYS_PTRACE, or to be its ancestor under Yama): {source}")]
    Permission {
        pid: u32,
        tid: u32,
        source: nix::Error,
    },
    #[error("no thread of process {pid} was executing user code within {waited_ms} ms")]
    NoRunningThread { pid: u32, waited_ms: u64 },
    #[error("process {pid} has no resident {area} memory")]
    NoMemory { pid: u32, area: Area },
    #[error("thread {tid}: did not stop within {waited_ms} ms")]
    Unstoppable { tid: u32, waited_ms: u64 },
    #[error("ptrace on thread {tid}: {source}")]
    Ptrace { tid: u32, source: nix::Error },
    #[error("{path}: {source}")]
    Proc {
        path: String,
        source: std::io::Error,
    },
}

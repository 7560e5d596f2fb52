//! Checkpoint and restore of running processes, the mechanism of RMK's
//! transparent application checkpointing (TAC,
//! `seeds/001_68a97066b3f6a3ed.txt` §6) and of RTCR
//! (`seeds/003_88af2f40302460e3.txt`: hot storage in memory, cold storage in
//! a file, incremental copying, marshalling for migration), on a stock
//! Linux kernel and from outside the process:
//!
//! - [`Frozen`]: every thread held in a ptrace-stop;
//! - [`Checkpointer`]: incremental checkpoints, finding written pages with
//!   userfaultfd asynchronous write-protection and `PAGEMAP_SCAN` (no fault
//!   per page reaches anyone), the pages written read ahead while the
//!   process runs so that the pause copies only what is written after
//!   (`ahead.rs`), and restore in place, keeping the pid;
//! - [`Image`]: the latest checkpoint, in memory; [`file`]: its versioned,
//!   checksummed, compressed file format.
//!
//! Shared mappings (channels, vault memfds, durable memory) are outside
//! every checkpoint and never rolled back; so is kernel state (descriptors,
//! sockets): a checkpoint taken at a safe point, with no invocation in
//! flight, needs none.

#![deny(unsafe_code)]

mod ahead;
mod checkpoint;
pub mod file;
mod freeze;
mod image;
pub mod maps;
mod memio;
mod remote;
mod respawn;
mod restore;
mod startover;
mod sys;

pub use checkpoint::{Checkpointer, Stats};
pub use file::ImageError;
pub use freeze::{thread_ids, Frozen};
pub use image::{Area, Image, Rseq, ThreadState};
pub use respawn::thread_pairs;
pub use startover::StartOver;

use thiserror::Error;

#[derive(Debug, Error)]
pub enum Error {
    #[error("process {0} is gone")]
    Gone(u32),
    #[error("ptrace on thread {tid}: {source}")]
    Ptrace { tid: u32, source: nix::Error },
    #[error("thread {tid} did not stop within {waited_ms} ms")]
    Unstoppable { tid: u32, waited_ms: u64 },
    #[error("{path}: {source}")]
    Proc {
        path: String,
        source: std::io::Error,
    },
    #[error("{what}: {source}")]
    Kernel {
        what: &'static str,
        source: std::io::Error,
    },
    #[error("{call} in process {pid}: {source}")]
    Remote {
        call: String,
        pid: u32,
        source: std::io::Error,
    },
    #[error("{what}: {detail}")]
    Malformed { what: String, detail: String },
    #[error("process {0} has no checkpoint yet")]
    NoCheckpoint(u32),
    #[error("process {pid} has threads {now:?}, its checkpoint {at_checkpoint:?}: an in-place restore keeps the threads")]
    ThreadsChanged {
        pid: u32,
        at_checkpoint: Vec<u32>,
        now: Vec<u32>,
    },
    #[error("process {pid} cannot be restored in place: {detail}")]
    Unrestorable { pid: u32, detail: String },
    #[error(transparent)]
    Image(#[from] ImageError),
}

impl Error {
    pub(crate) fn proc(path: &str, source: std::io::Error) -> Self {
        Error::Proc {
            path: path.to_string(),
            source,
        }
    }

    pub(crate) fn ptrace(tid: u32, source: nix::Error) -> Self {
        Error::Ptrace { tid, source }
    }
}

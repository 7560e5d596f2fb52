//! kv's optional changelog: every update, as one line (`version op key`),
//! in a file of another server (ramfs, over `fs`). It makes kv a client of
//! another server while it is checkpoint-recovered (issue 16's interplay):
//! the file is opened lazily by the first update, inside a request, and
//! each record is written at an explicit offset, so the calls are logged
//! with the request and answered from the log on replay, and the one
//! request that runs again in full after a crash writes the same bytes at
//! the same place. The descriptor and the offset live in kv's memory: a
//! restore rolls them back with the map, and the replay brings them
//! forward again; ramfs, which no restore rolls back, keeps the file.

use kintsugi_interfaces::fs::{self, File};
use kintsugi_interfaces::fs_flags;
use kintsugi_interfaces::kv::Error;
use kintsugi_runtime::CallError;

/// Where the next record goes: the open file (none before the first
/// update) and its length.
#[derive(Debug, Clone, Copy, Default)]
pub struct Position {
    file: Option<File>,
    end: u64,
}

pub struct Changelog {
    fs: fs::Client,
    path: String,
}

impl Changelog {
    pub fn new(fs: fs::Client, path: String) -> Self {
        Self { fs, path }
    }

    /// Writes `line` at `at`; returns where the next record goes.
    pub fn append(&self, at: Position, line: &[u8]) -> Result<Position, Error> {
        let file = match at.file {
            Some(f) => f,
            // A new store (first update ever, or after a fresh start)
            // begins a new changelog.
            None => self
                .fs
                .open(&self.path, fs_flags::CREATE | fs_flags::TRUNCATE)
                .map_err(|e| self.unavailable("open", e))?,
        };
        self.fs
            .seek(file, at.end)
            .map_err(|e| self.unavailable("seek", e))?;
        let n = self
            .fs
            .write(file, line)
            .map_err(|e| self.unavailable("write", e))?;
        if n as usize != line.len() {
            tracing::warn!(path = %self.path, wrote = n, "changelog: short write");
            return Err(Error::Unavailable);
        }
        Ok(Position {
            file: Some(file),
            end: at.end + u64::from(n),
        })
    }

    fn unavailable(&self, call: &str, e: CallError<fs::Error>) -> Error {
        tracing::warn!(path = %self.path, "changelog: {call}: {e}");
        Error::Unavailable
    }
}

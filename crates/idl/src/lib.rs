//! The kintsugi IDL compiler: parses `.kidl` interface definitions, checks
//! them, and generates the Rust client and server stubs that carry
//! invocations and recover descriptors after a server's micro-reboot.
//!
//! ```text
//! interface fs;
//! errors { NotFound, BadFd }
//! descriptor File { namespace: local; close: self; parent: none; field offset: u64; }
//! fn open(path: str remember, flags: u32 replay(0)) -> File create;
//! fn read(fd: File, len: u32 range(0, 65536)) -> bytes advance(fd.offset);
//! fn seek(fd: File, pos: u64 set(fd.offset)) -> u64 restore(fd.offset);
//! fn close(fd: File) terminal;
//! ```
//!
//! From a crate's `build.rs`, a [`Builder`] turns such files into one Rust
//! module each in `$OUT_DIR`, which the crate includes with
//! `kintsugi_runtime::include_interface!`:
//!
//! ```no_run
//! // build.rs
//! fn main() -> Result<(), kintsugi_idl::IdlError> {
//!     kintsugi_idl::compile(&["idl/tally.kidl"])?;
//!     // or: kintsugi_idl::configure().compile_dir("idl")?;
//!     Ok(())
//! }
//! ```
//!
//! [`parse`] and [`generate`] are the two steps it runs on each file.

#![forbid(unsafe_code)]

mod build;
mod check;
mod gen;
mod lexer;
mod model;
mod parser;

use std::fmt;
use std::path::{Path, PathBuf};

pub use build::{compile, configure, Builder};
pub use model::*;

/// A lexical, syntax or semantic error in an IDL file, or a failure to read
/// or write one. Displays as `path:line:col: message` (1-based).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdlError {
    pub path: PathBuf,
    /// 1-based; 0 for an I/O error that has no position.
    pub line: usize,
    pub col: usize,
    pub message: String,
}

impl fmt::Display for IdlError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.line == 0 {
            write!(f, "{}: {}", self.path.display(), self.message)
        } else {
            write!(
                f,
                "{}:{}:{}: {}",
                self.path.display(),
                self.line,
                self.col,
                self.message
            )
        }
    }
}

impl std::error::Error for IdlError {}

/// An error before it is tied to its file.
#[derive(Debug)]
pub(crate) struct Fail {
    span: Span,
    message: String,
}

impl Fail {
    pub(crate) fn new(span: Span, message: impl Into<String>) -> Self {
        Fail {
            span,
            message: message.into(),
        }
    }

    fn at(self, path: &Path) -> IdlError {
        IdlError {
            path: path.to_path_buf(),
            line: self.span.line,
            col: self.span.col,
            message: self.message,
        }
    }
}

/// Parses and checks one interface definition. `path` is only used in error
/// messages and in the generated code's header.
pub fn parse(path: &Path, text: &str) -> Result<Interface, IdlError> {
    let toks = lexer::lex(text).map_err(|e| e.at(path))?;
    let mut iface = parser::parse(path, toks).map_err(|e| e.at(path))?;
    check::check(&mut iface).map_err(|e| e.at(path))?;
    Ok(iface)
}

/// Generates the Rust module (client stub, server stub and types) for a
/// checked interface, formatted as rustfmt would (by `prettyplease`).
/// Text that does not parse as Rust (a generator bug) is returned as
/// generated, so that the compiler points at it.
pub fn generate(iface: &Interface) -> String {
    let text = gen::generate(iface);
    // The formatter keeps doc comments only: carry the header over.
    let header: String = text
        .lines()
        .take_while(|l| l.starts_with("//") && !l.starts_with("///"))
        .map(|l| format!("{l}\n"))
        .collect();
    match syn::parse_file(&text) {
        Ok(file) => header + &prettyplease::unparse(&file),
        Err(_) => text,
    }
}

/// The number of lines of a definition that are neither blank nor comments:
/// the size of the spec.
pub fn spec_lines(text: &str) -> usize {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with("//"))
        .count()
}

/// Compiles every `*.kidl` file in `idl_dir` into `out_dir/<interface>.rs`,
/// returning the paths written: `configure().out_dir(out_dir).compile_dir(idl_dir)`.
pub fn compile_dir(idl_dir: &Path, out_dir: &Path) -> Result<Vec<PathBuf>, IdlError> {
    configure().out_dir(out_dir).compile_dir(idl_dir)
}

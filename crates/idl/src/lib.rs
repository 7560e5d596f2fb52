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
//! From `build.rs`, [`compile_dir`] turns a folder of such files into one Rust
//! module each; [`parse`] and [`generate`] are the two steps it runs.

#![forbid(unsafe_code)]

mod check;
mod gen;
mod lexer;
mod model;
mod parser;

use std::fmt;
use std::path::{Path, PathBuf};

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
/// returning the paths written. Meant for `build.rs`: prints
/// `cargo:rerun-if-changed` for the folder and each file.
pub fn compile_dir(idl_dir: &Path, out_dir: &Path) -> Result<Vec<PathBuf>, IdlError> {
    let io = |path: &Path, e: std::io::Error| IdlError {
        path: path.to_path_buf(),
        line: 0,
        col: 0,
        message: e.to_string(),
    };
    println!("cargo:rerun-if-changed={}", idl_dir.display());
    let mut inputs: Vec<PathBuf> = std::fs::read_dir(idl_dir)
        .map_err(|e| io(idl_dir, e))?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "kidl"))
        .collect();
    inputs.sort();
    std::fs::create_dir_all(out_dir).map_err(|e| io(out_dir, e))?;
    let mut written = Vec::new();
    for input in inputs {
        println!("cargo:rerun-if-changed={}", input.display());
        let text = std::fs::read_to_string(&input).map_err(|e| io(&input, e))?;
        // Shown as `idl/fs.kidl`: the folder's name and the file's.
        let shown = match (
            idl_dir
                .canonicalize()
                .ok()
                .as_deref()
                .and_then(Path::file_name),
            input.file_name(),
        ) {
            (Some(dir), Some(file)) => Path::new(dir).join(file),
            _ => input.clone(),
        };
        let iface = parse(&shown, &text)?;
        let stem = input
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or_default();
        if iface.name != stem {
            return Err(Fail::new(
                iface.name_span,
                format!(
                    "interface `{}` must be in a file named `{}.kidl`",
                    iface.name, iface.name
                ),
            )
            .at(&shown));
        }
        let out = out_dir.join(format!("{}.rs", iface.name));
        std::fs::write(&out, generate(&iface)).map_err(|e| io(&out, e))?;
        written.push(out);
    }
    Ok(written)
}

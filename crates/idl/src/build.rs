//! The build helper for a crate's `build.rs`, in the manner of tonic-build:
//! [`configure`] returns a [`Builder`]; [`Builder::compile`] (a list of
//! files) or [`Builder::compile_dir`] (every `*.kidl` of a folder) write one
//! module per interface, `<interface>.rs`, into `$OUT_DIR` or the folder
//! given, and tell cargo to rerun when an input changes.

use std::path::{Path, PathBuf};

use crate::{generate, parse, Fail, IdlError};

/// How interfaces are compiled; made by [`configure`].
#[derive(Debug, Clone)]
pub struct Builder {
    out_dir: Option<PathBuf>,
    rerun_if_changed: bool,
}

/// A [`Builder`] with the defaults: output to `$OUT_DIR`, and
/// `cargo:rerun-if-changed` printed for every input.
pub fn configure() -> Builder {
    Builder {
        out_dir: None,
        rerun_if_changed: true,
    }
}

/// Compiles `files` with the defaults of [`configure`].
pub fn compile(files: &[impl AsRef<Path>]) -> Result<Vec<PathBuf>, IdlError> {
    configure().compile(files)
}

fn io(path: &Path, e: std::io::Error) -> IdlError {
    IdlError {
        path: path.to_path_buf(),
        line: 0,
        col: 0,
        message: e.to_string(),
    }
}

impl Builder {
    /// Writes the modules into `dir` instead of `$OUT_DIR`.
    pub fn out_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.out_dir = Some(dir.into());
        self
    }

    /// Whether to print `cargo:rerun-if-changed` lines (on by default; off
    /// outside a build script).
    pub fn emit_rerun_if_changed(mut self, on: bool) -> Self {
        self.rerun_if_changed = on;
        self
    }

    /// Compiles every `*.kidl` file of `dir`, in name order.
    pub fn compile_dir(&self, dir: impl AsRef<Path>) -> Result<Vec<PathBuf>, IdlError> {
        let dir = dir.as_ref();
        self.rerun(dir);
        let mut inputs: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| io(dir, e))?
            .filter_map(|entry| entry.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "kidl"))
            .collect();
        inputs.sort();
        self.compile(&inputs)
    }

    /// Compiles each of `files` into `<interface>.rs`; the interface must
    /// be named as its file. Returns the paths written.
    pub fn compile(&self, files: &[impl AsRef<Path>]) -> Result<Vec<PathBuf>, IdlError> {
        let out_dir = match &self.out_dir {
            Some(d) => d.clone(),
            None => std::env::var_os("OUT_DIR")
                .map(PathBuf::from)
                .ok_or_else(|| IdlError {
                    path: PathBuf::from("$OUT_DIR"),
                    line: 0,
                    col: 0,
                    message: "not set: call out_dir() outside a build script".into(),
                })?,
        };
        std::fs::create_dir_all(&out_dir).map_err(|e| io(&out_dir, e))?;
        files
            .iter()
            .map(|f| self.compile_one(f.as_ref(), &out_dir))
            .collect()
    }

    fn rerun(&self, path: &Path) {
        if self.rerun_if_changed {
            println!("cargo:rerun-if-changed={}", path.display());
        }
    }

    fn compile_one(&self, input: &Path, out_dir: &Path) -> Result<PathBuf, IdlError> {
        self.rerun(input);
        let text = std::fs::read_to_string(input).map_err(|e| io(input, e))?;
        let shown = shown_path(input);
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
        Ok(out)
    }
}

/// How a file is named in errors and generated headers: its folder's name
/// and its own (`idl/fs.kidl`), whatever the build's working directory.
fn shown_path(input: &Path) -> PathBuf {
    let dir = input
        .parent()
        .and_then(|d| d.canonicalize().ok())
        .and_then(|d| d.file_name().map(PathBuf::from));
    match (dir, input.file_name()) {
        (Some(dir), Some(file)) => dir.join(file),
        _ => input.to_path_buf(),
    }
}

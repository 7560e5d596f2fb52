//! Directories private to this user, as the roster's and the vault's must
//! be (issue 17): another user's directory, or one others may enter, would
//! let them plant, swap or read what is kept there.

use std::fs::DirBuilder;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::Path;

/// Creates `dir` with mode 0700 if it is absent, then says why it may not
/// be used, if it may not: a symlink, not a directory, another user's, or
/// open to group or others.
pub fn refusal(dir: &Path) -> std::io::Result<Option<String>> {
    match DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    let meta = std::fs::symlink_metadata(dir)?;
    let me = rustix::process::geteuid().as_raw();
    Ok(if meta.file_type().is_symlink() {
        Some("it is a symbolic link".to_string())
    } else if !meta.is_dir() {
        Some("it is not a directory".to_string())
    } else if meta.uid() != me {
        Some(format!("it is owned by uid {}, not {me}", meta.uid()))
    } else if meta.mode() & 0o077 != 0 {
        Some(format!(
            "its mode {:o} lets others in (0700 expected)",
            meta.mode() & 0o7777
        ))
    } else {
        None
    })
}

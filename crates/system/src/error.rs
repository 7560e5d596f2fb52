//! Errors of loading a system description, each pointing at `path:line:col`.

use std::fmt;
use std::io;
use std::path::PathBuf;

/// A 1-based position in the system description's text (columns count characters).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
pub struct Location {
    pub line: usize,
    pub col: usize,
}

impl Location {
    /// The 1-based line and column of byte `offset` in `text` (clamped to the text).
    pub fn of_offset(text: &str, offset: usize) -> Location {
        let mut off = offset.min(text.len());
        while !text.is_char_boundary(off) {
            off -= 1;
        }
        let before = &text[..off];
        let line = before.matches('\n').count() + 1;
        let line_start = before.rfind('\n').map_or(0, |i| i + 1);
        let col = text[line_start..off].chars().count() + 1;
        Location { line, col }
    }
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.line, self.col)
    }
}

/// What went wrong, for code that wants to match on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// TOML syntax error, unknown key, wrong type or missing field.
    Syntax,
    /// Two components share a name.
    DuplicateName,
    /// A component provides (or uses) the same interface twice.
    DuplicateInterface,
    /// A `uses` entry names an interface no component provides.
    UnknownInterface,
    /// A `uses` entry `iface@comp` names a component that does not exist.
    UnknownComponent,
    /// Several components provide the interface and no `@component` picks one.
    AmbiguousProvider,
    /// `iface@comp` where `comp` does not provide `iface`.
    NotProvided,
    /// A component uses an interface it provides itself.
    SelfUse,
    /// The `uses` graph has a cycle.
    Cycle,
    /// The binary could not be found.
    BinaryNotFound,
    /// The binary exists but is not executable.
    BinaryNotExecutable,
    /// A number outside its allowed range.
    OutOfRange,
    /// An empty name or one with characters outside `[a-z0-9_-]`; an empty binary.
    InvalidName,
    /// The system has no components.
    NoComponents,
    /// A `config` value that cannot be expressed in JSON.
    InvalidConfig,
    /// A `user` that this machine does not know.
    UnknownUser,
    /// A `syscalls` entry that names no system call of this architecture.
    UnknownSyscall,
    /// A `syscalls` entry among [`crate::NEVER_ALLOWED`].
    ForbiddenSyscall,
}

/// An error of loading a system description.
///
/// `Display` is `path:line:col: message` for everything found in the text and
/// `path: message` for errors without a position (the file cannot be read, or
/// a [`crate::System`] built by hand has no recorded positions).
#[derive(Debug, thiserror::Error)]
pub enum SystemError {
    #[error("{}: cannot read the system description: {source}", .path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{}{}: {message}", .path.display(), LocPrefix(.location))]
    Invalid {
        path: PathBuf,
        location: Option<Location>,
        kind: ErrorKind,
        message: String,
    },
}

struct LocPrefix<'a>(&'a Option<Location>);

impl fmt::Display for LocPrefix<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(loc) => write!(f, ":{}:{}", loc.line, loc.col),
            None => Ok(()),
        }
    }
}

impl SystemError {
    /// The position in the text, if the error has one.
    pub fn location(&self) -> Option<Location> {
        match self {
            SystemError::Read { .. } => None,
            SystemError::Invalid { location, .. } => *location,
        }
    }

    /// The kind of error; `None` for a read error.
    pub fn kind(&self) -> Option<ErrorKind> {
        match self {
            SystemError::Read { .. } => None,
            SystemError::Invalid { kind, .. } => Some(*kind),
        }
    }

    /// The message without the `path:line:col: ` prefix.
    pub fn message(&self) -> String {
        match self {
            SystemError::Read { source, .. } => {
                format!("cannot read the system description: {source}")
            }
            SystemError::Invalid { message, .. } => message.clone(),
        }
    }
}

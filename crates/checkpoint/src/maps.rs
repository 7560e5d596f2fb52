//! A process's address space as `/proc/<pid>/maps` shows it, and which of
//! its mappings a checkpoint copies: the private writable ones (heap,
//! stacks, anonymous mappings, the binary's and libraries' data). Shared
//! mappings (channels, the vault's memfds, durable memory) stay outside a
//! checkpoint and are never rolled back; the kernel's special mappings
//! (`[vdso]`, `[vvar]`, `[vsyscall]`) are the kernel's.

use serde::{Deserialize, Serialize};

use crate::Error;

pub const PAGE: u64 = 4096;

/// Protection and sharing of a mapping.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Prot {
    pub read: bool,
    pub write: bool,
    pub exec: bool,
    pub shared: bool,
}

impl Prot {
    /// The `PROT_*` bits.
    pub fn bits(self) -> u64 {
        let mut p = 0;
        if self.read {
            p |= libc::PROT_READ as u64;
        }
        if self.write {
            p |= libc::PROT_WRITE as u64;
        }
        if self.exec {
            p |= libc::PROT_EXEC as u64;
        }
        p
    }
}

/// One line of `/proc/<pid>/maps`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mapping {
    pub start: u64,
    pub end: u64,
    pub prot: Prot,
    pub offset: u64,
    /// The file or pseudo-name (`[heap]`, `[stack]`), empty if anonymous.
    pub name: String,
}

impl Mapping {
    /// A private mapping, readable, writable if `write`, named `name`
    /// (empty: anonymous), for the unit tests.
    #[cfg(test)]
    pub(crate) fn private(start: u64, end: u64, write: bool, name: &str) -> Self {
        Mapping {
            start,
            end,
            prot: Prot {
                read: true,
                write,
                exec: false,
                shared: false,
            },
            offset: 0,
            name: name.into(),
        }
    }

    pub fn len(&self) -> u64 {
        self.end - self.start
    }

    pub fn is_empty(&self) -> bool {
        self.end == self.start
    }

    /// Whether a checkpoint copies its contents.
    pub fn is_checkpointed(&self) -> bool {
        self.prot.write && !self.prot.shared && !self.is_special()
    }

    /// Backed by a file (its unwritten pages read from the file, not zero).
    pub fn is_file(&self) -> bool {
        self.name.starts_with('/')
    }

    pub fn is_heap(&self) -> bool {
        self.name == "[heap]"
    }

    pub fn is_special(&self) -> bool {
        matches!(
            self.name.as_str(),
            "[vdso]" | "[vvar]" | "[vvar_vclock]" | "[vsyscall]" | "[uprobes]"
        )
    }
}

/// Parses one line: `start-end perms offset dev inode [name]`.
fn parse_line(line: &str) -> Option<Mapping> {
    let mut fields = line.splitn(6, ' ');
    let (start, end) = fields.next()?.split_once('-')?;
    let perms = fields.next()?.as_bytes();
    let offset = fields.next()?;
    let _dev = fields.next()?;
    let _inode = fields.next()?;
    let name = fields.next().unwrap_or("").trim_start().to_string();
    if perms.len() != 4 {
        return None;
    }
    Some(Mapping {
        start: u64::from_str_radix(start, 16).ok()?,
        end: u64::from_str_radix(end, 16).ok()?,
        prot: Prot {
            read: perms[0] == b'r',
            write: perms[1] == b'w',
            exec: perms[2] == b'x',
            shared: perms[3] == b's',
        },
        offset: u64::from_str_radix(offset, 16).ok()?,
        name,
    })
}

/// Every mapping of process `pid`, in address order.
pub fn read(pid: u32) -> Result<Vec<Mapping>, Error> {
    let path = format!("/proc/{pid}/maps");
    let text = std::fs::read_to_string(&path).map_err(|e| Error::proc(&path, e))?;
    text.lines()
        .filter(|l| !l.is_empty())
        .map(|l| {
            parse_line(l).ok_or_else(|| Error::Malformed {
                what: path.clone(),
                detail: format!("unreadable line {l:?}"),
            })
        })
        .collect()
}

/// The start and the end of process `pid`'s program break: `start_brk`
/// (field 47 of `/proc/<pid>/stat`) and the end of its `[heap]` mapping in
/// `maps` (the break rounded up to a page, which is what the kernel maps;
/// `start_brk` when the heap is empty).
pub fn program_break(pid: u32, maps: &[Mapping]) -> Result<(u64, u64), Error> {
    let path = format!("/proc/{pid}/stat");
    let stat = procfs::process::Process::new(pid as i32)
        .and_then(|p| p.stat())
        .map_err(|e| Error::proc(&path, std::io::Error::other(e)))?;
    let start = stat.start_brk.ok_or_else(|| Error::Malformed {
        what: path.clone(),
        detail: "no start_brk field".into(),
    })?;
    // The heap may show as several lines (a part grown after the rest was
    // registered with userfaultfd is a mapping of its own): the break is
    // the end of the last.
    let end = maps
        .iter()
        .filter(|m| m.is_heap() && m.end >= start)
        .map(|m| m.end)
        .max()
        .unwrap_or(start);
    Ok((start, end))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_parse_with_and_without_names() {
        let m = parse_line("7f00a000-7f00b000 rw-p 00001000 08:01 1234       /usr/lib/libc.so.6")
            .unwrap();
        assert_eq!((m.start, m.end, m.offset), (0x7f00a000, 0x7f00b000, 0x1000));
        assert!(m.prot.read && m.prot.write && !m.prot.exec && !m.prot.shared);
        assert_eq!(m.name, "/usr/lib/libc.so.6");
        assert!(m.is_checkpointed() && m.is_file());
        let anon = parse_line("10000-20000 rw-p 00000000 00:00 0").unwrap();
        assert_eq!(anon.name, "");
        assert!(anon.is_checkpointed() && !anon.is_file());
        let shared = parse_line("10000-20000 rw-s 00000000 00:01 7 /memfd:chan (deleted)").unwrap();
        assert!(!shared.is_checkpointed());
        let vdso =
            parse_line("7ffd000-7ffe000 r-xp 00000000 00:00 0                  [vdso]").unwrap();
        assert_eq!(vdso.name, "[vdso]");
        assert!(parse_line("garbage").is_none());
    }

    #[test]
    fn own_maps_and_break_are_read() {
        let maps = read(std::process::id()).unwrap();
        assert!(maps.iter().any(|m| m.name == "[stack]"));
        assert!(maps.windows(2).all(|w| w[0].end <= w[1].start));
        let (start, end) = program_break(std::process::id(), &maps).unwrap();
        assert!(start <= end && start > 0);
        // A heap that grows shows in the break.
        let blocks: Vec<Vec<u8>> = (0..64).map(|_| vec![1u8; 1000]).collect();
        let (_, later) =
            program_break(std::process::id(), &read(std::process::id()).unwrap()).unwrap();
        assert!(later >= end, "{later:#x} < {end:#x} ({})", blocks.len());
    }
}

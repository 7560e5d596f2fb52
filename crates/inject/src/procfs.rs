//! What `/proc` says about a target: its threads and their scheduler
//! states, its writable private memory by area, which of its pages are
//! resident, and reading and writing its memory through `/proc/<pid>/mem`.

use std::fmt;
use std::fs::File;
use std::os::unix::fs::FileExt;

use crate::InjectError;

pub(crate) const PAGE: u64 = 4096;

fn proc_err(path: &str, source: std::io::Error) -> InjectError {
    InjectError::Proc {
        path: path.to_string(),
        source,
    }
}

/// One thread of a process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ThreadInfo {
    pub tid: u32,
    /// The scheduler state of `/proc/<pid>/task/<tid>/stat`: `R` running
    /// or runnable, `S` sleeping, `t` stopped by a tracer, `Z` zombie, ...
    pub state: char,
}

/// The state letter of one thread (None if it is gone).
pub(crate) fn thread_state(pid: u32, tid: u32) -> Option<char> {
    procfs::process::Process::new(pid as i32)
        .and_then(|p| p.task_from_tid(tid as i32))
        .and_then(|t| t.stat())
        .ok()
        .map(|s| s.state)
}

/// Every thread of process `pid` but its thread-group leader, whose exit
/// status belongs to its parent (the supervisor) and is never traced here.
pub fn threads(pid: u32) -> Result<Vec<ThreadInfo>, InjectError> {
    let dir = format!("/proc/{pid}/task");
    let entries = std::fs::read_dir(&dir).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => InjectError::Gone(pid),
        _ => proc_err(&dir, e),
    })?;
    let mut out: Vec<ThreadInfo> = entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&tid| tid != pid)
        .filter_map(|tid| {
            Some(ThreadInfo {
                tid,
                state: thread_state(pid, tid)?,
            })
        })
        .collect();
    out.sort_by_key(|t| t.tid);
    Ok(out)
}

/// Where each thread of process `pid` is, leader included, one line per
/// thread: `tid name state wchan syscall` (what `/proc` shows; for telling
/// why a system stopped serving).
pub fn describe_threads(pid: u32) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return vec![format!("{pid}: gone")];
    };
    let mut tids: Vec<u32> = entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    tids.sort_unstable();
    let read = |tid: u32, what: &str| {
        std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/{what}"))
            .map_or_else(|_| "?".to_string(), |s| s.trim().to_string())
    };
    tids.into_iter()
        .map(|tid| {
            let state = thread_state(pid, tid).unwrap_or('?');
            // The system call number and its first argument.
            let syscall: Vec<String> = read(tid, "syscall")
                .split(' ')
                .take(2)
                .map(String::from)
                .collect();
            format!(
                "{tid} {} {state} wchan={} syscall={}",
                read(tid, "comm"),
                read(tid, "wchan"),
                syscall.join(",")
            )
        })
        .collect()
}

/// Where a memory bit flip lands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Area {
    /// `[heap]` and the anonymous private writable mappings (allocator
    /// arenas, large allocations).
    Heap,
    /// A live stack: the 4 KiB above a stopped thread's stack pointer.
    Stack,
    /// The binary's writable data (its `rw-p` file mappings).
    Data,
}

impl fmt::Display for Area {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Area::Heap => "heap",
            Area::Stack => "stack",
            Area::Data => "data",
        })
    }
}

/// One line of `/proc/<pid>/maps`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Mapping {
    pub start: u64,
    pub end: u64,
    pub perms: String,
    pub path: String,
}

pub(crate) fn mappings(pid: u32) -> Result<Vec<Mapping>, InjectError> {
    let path = format!("/proc/{pid}/maps");
    let text = std::fs::read_to_string(&path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => InjectError::Gone(pid),
        _ => proc_err(&path, e),
    })?;
    Ok(text.lines().filter_map(parse_mapping).collect())
}

fn parse_mapping(line: &str) -> Option<Mapping> {
    // address perms offset dev inode path (the path may hold spaces)
    let mut fields = Vec::with_capacity(5);
    let mut rest = line;
    for _ in 0..5 {
        rest = rest.trim_start();
        let end = rest.find(' ').unwrap_or(rest.len());
        fields.push(&rest[..end]);
        rest = &rest[end..];
    }
    let (start, end) = fields[0].split_once('-')?;
    Some(Mapping {
        start: u64::from_str_radix(start, 16).ok()?,
        end: u64::from_str_radix(end, 16).ok()?,
        perms: fields[1].to_string(),
        path: rest.trim().to_string(),
    })
}

/// The mappings of `area` (Heap or Data) in process `pid`: private and
/// writable, never the shared memory of channels, arenas and pools.
pub(crate) fn area_mappings(pid: u32, area: Area) -> Result<Vec<Mapping>, InjectError> {
    let exe = std::fs::read_link(format!("/proc/{pid}/exe"))
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default();
    Ok(mappings(pid)?
        .into_iter()
        .filter(|m| m.perms.starts_with("rw") && m.perms.ends_with('p'))
        .filter(|m| match area {
            Area::Heap => m.path == "[heap]" || m.path.is_empty(),
            Area::Data => !exe.is_empty() && m.path == exe,
            Area::Stack => m.path.starts_with("[stack"),
        })
        .collect())
}

/// The resident pages of `start..end` in process `pid`
/// (`/proc/<pid>/pagemap` bit 63), by address.
pub(crate) fn resident_pages(pid: u32, start: u64, end: u64) -> Vec<u64> {
    let Ok(f) = File::open(format!("/proc/{pid}/pagemap")) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    let mut at = start / PAGE;
    // 512 entries (2 MiB of the target) per read.
    let mut entries = [0u8; 8 * 512];
    while at < end / PAGE {
        let n = ((end / PAGE - at) as usize).min(512);
        if f.read_exact_at(&mut entries[..n * 8], at * 8).is_err() {
            break;
        }
        for (i, e) in entries[..n * 8].chunks_exact(8).enumerate() {
            if u64::from_le_bytes(e.try_into().expect("8 bytes")) >> 63 == 1 {
                out.push((at + i as u64) * PAGE);
            }
        }
        at += n as u64;
    }
    out
}

/// The target's memory, through `/proc/<pid>/mem`.
pub(crate) struct Memory {
    file: File,
    path: String,
}

impl Memory {
    pub fn open(pid: u32) -> Result<Self, InjectError> {
        let path = format!("/proc/{pid}/mem");
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::NotFound => InjectError::Gone(pid),
                _ => proc_err(&path, e),
            })?;
        Ok(Self { file, path })
    }

    pub fn read_u8(&self, addr: u64) -> Result<u8, InjectError> {
        let mut b = [0u8; 1];
        self.file
            .read_exact_at(&mut b, addr)
            .map_err(|e| proc_err(&self.path, e))?;
        Ok(b[0])
    }

    pub fn write_u8(&self, addr: u64, v: u8) -> Result<(), InjectError> {
        self.file
            .write_all_at(&[v], addr)
            .map_err(|e| proc_err(&self.path, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_lines_parse() {
        let m = parse_mapping("7f00a000-7f00b000 rw-p 00000000 00:00 0 ").unwrap();
        assert_eq!(
            (m.start, m.end, m.perms.as_str(), m.path.as_str()),
            (0x7f00a000, 0x7f00b000, "rw-p", "")
        );
        let m = parse_mapping("55d0-55e0 rw-p 00002000 08:01 1234   /usr/bin/a b").unwrap();
        assert_eq!(m.path, "/usr/bin/a b");
        assert!(parse_mapping("garbage").is_none());
    }

    #[test]
    fn this_process_has_heap_and_data() {
        let me = std::process::id();
        assert!(!area_mappings(me, Area::Heap).unwrap().is_empty());
        assert!(!area_mappings(me, Area::Data).unwrap().is_empty());
        let boxed = Box::new([7u8; 64]);
        let page = boxed.as_ptr() as u64 / PAGE * PAGE;
        assert_eq!(resident_pages(me, page, page + PAGE), [page]);
        let tid = nix::unistd::gettid().as_raw() as u32;
        assert_eq!(
            thread_state(me, tid),
            Some('R'),
            "a thread reading its own state runs"
        );
    }
}

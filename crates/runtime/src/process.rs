//! Process plumbing for the pristine image: forking incarnations as children
//! of the supervisor, and tying every component process's life to it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use rustix::process::{Resource, Rlimit, Signal};

/// Forks the calling (single-threaded) process with `CLONE_PARENT`: the child
/// becomes a child of our parent, the supervisor, which can then wait for
/// it and read its exit status through a pidfd. Returns the child's pid in
/// the parent and `None` in the child.
pub fn fork_sibling() -> std::io::Result<Option<u32>> {
    fork_with((libc::CLONE_PARENT | libc::SIGCHLD) as libc::c_ulong)
}

/// Forks the calling (single-threaded) process with `CLONE_FILES`: parent
/// and child share one descriptor table, so every descriptor the child
/// opens is held by the parent too and outlives the child (the keeper's
/// hold on a supervisor's descriptors). Returns the child's pid in the
/// parent and `None` in the child.
pub fn fork_sharing_descriptors() -> std::io::Result<Option<u32>> {
    fork_with((libc::CLONE_FILES | libc::SIGCHLD) as libc::c_ulong)
}

/// Runs `body` in a forked child process of this (single-threaded) process
/// and returns the child's pid; the child exits when `body` returns.
/// Benchmarks use it to put a peer in a real second address space.
pub fn fork_child(body: impl FnOnce()) -> std::io::Result<u32> {
    match fork_with(libc::SIGCHLD as libc::c_ulong)? {
        Some(pid) => Ok(pid),
        None => {
            body();
            // SAFETY: _exit ends the child without running the parent's atexit
            // handlers or flushing buffers that belong to the parent.
            unsafe { libc::_exit(0) }
        }
    }
}

/// How long a fork waits for threads that are leaving (an upcall thread
/// whose connection was just dropped is told to leave, not joined).
const LEAVING: Duration = Duration::from_secs(1);

fn fork_with(flags: libc::c_ulong) -> std::io::Result<Option<u32>> {
    let deadline = Instant::now() + LEAVING;
    let mut threads = thread_count()?;
    while threads != 1 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
        threads = thread_count()?;
    }
    if threads != 1 {
        return Err(std::io::Error::other(format!(
            "a process must be single-threaded to fork, but this one has {threads} threads"
        )));
    }
    // SAFETY: a raw clone without CLONE_VM behaves like fork(2): the child gets
    // a copy of the address space and continues on a copy of this stack. The
    // process has exactly one thread (checked above), so no lock can be held by
    // a thread that does not exist in the child.
    let ret = unsafe { libc::syscall(libc::SYS_clone, flags, 0usize, 0usize, 0usize, 0usize) };
    match ret {
        -1 => Err(std::io::Error::last_os_error()),
        0 => Ok(None),
        pid => Ok(Some(pid as u32)),
    }
}

/// Takes ahead the page faults a standby's incarnation would take first:
/// in a standby just forked from the pristine image, every page of its
/// private writable mappings is either shared with the image
/// copy-on-write or not there at all, and each one the incarnation first
/// writes (its statics, heap, the stacks of its workers) costs a fault, a
/// copy or a zeroed page in the middle of a reboot (about 2 µs each on
/// these VMs). `MADV_POPULATE_WRITE` takes those faults now, while the standby
/// waits: for every mapping of at most [`WHOLE_MAPPING`] (thread stacks,
/// statics, small buffers) all of it, for larger ones (the heap) the pages
/// present. Stops after `limit` pages, or as soon as `stop()` is true
/// (checked between runs of pages: the standby is needed); returns the
/// pages populated.
pub fn populate_private_memory(limit: usize, stop: impl Fn() -> bool) -> std::io::Result<usize> {
    use std::os::unix::fs::FileExt;
    let page = crate::abi::shm::page_size();
    let maps = std::fs::read_to_string("/proc/self/maps")?;
    let pagemap = std::fs::File::open("/proc/self/pagemap")?;
    let (mut done, mut entries) = (0, Vec::new());
    for (start, end) in maps.lines().filter_map(private_writable) {
        let whole = end - start <= WHOLE_MAPPING;
        // A large mapping's pagemap is read a window at a time.
        for window in (start..end).step_by(WINDOW_PAGES * page) {
            let pages_here = ((end - window) / page).min(WINDOW_PAGES);
            let present: Vec<bool> = if whole {
                vec![true; pages_here]
            } else {
                entries.resize(pages_here * 8, 0u8);
                pagemap.read_exact_at(&mut entries, (window / page * 8) as u64)?;
                entries
                    .chunks_exact(8)
                    .map(|e| u64::from_le_bytes(e.try_into().expect("8 bytes")) & PAGE_PRESENT != 0)
                    .collect()
            };
            for (first, pages) in runs(&present) {
                if stop() || done >= limit {
                    return Ok(done);
                }
                let pages = pages.min(limit - done);
                let at = (window + first * page) as *mut std::ffi::c_void;
                // SAFETY: the range lies in a private writable mapping of
                // this process (from `/proc/self/maps`); populating it
                // writable changes no byte of it (the kernel takes the
                // write faults a write would: shared pages are copied,
                // missing ones zeroed), so no Rust value that lives there
                // is affected. A mapping unmapped or protected meanwhile
                // by another thread gives an error, not undefined
                // behaviour.
                let populated = unsafe {
                    rustix::mm::madvise(at, pages * page, rustix::mm::Advice::LinuxPopulateWrite)
                };
                match populated {
                    Ok(()) => done += pages,
                    // Unmapped (`ENOMEM`) or made inaccessible (`EFAULT`)
                    // since the maps were read: nothing left to take there.
                    Err(rustix::io::Errno::NOMEM | rustix::io::Errno::FAULT) => {}
                    Err(e) => return Err(e.into()),
                }
            }
        }
    }
    Ok(done)
}

/// Pages of a large mapping whose pagemap entries are read at once (32 KiB
/// of entries for 16 MiB of memory).
const WINDOW_PAGES: usize = 4096;

/// Private writable mappings up to this size are populated whole by
/// [`populate_private_memory`]: a worker's stack (256 KiB), a binary's statics.
const WHOLE_MAPPING: usize = 1 << 20;

/// `/proc/self/pagemap`'s bit for a page in memory.
const PAGE_PRESENT: u64 = 1 << 63;

/// The range of a `/proc/self/maps` line, if its mapping is private and
/// writable.
fn private_writable(line: &str) -> Option<(usize, usize)> {
    let mut fields = line.split_whitespace();
    let (range, perms) = (fields.next()?, fields.next()?);
    if perms != "rw-p" {
        return None;
    }
    let (a, b) = range.split_once('-')?;
    Some((
        usize::from_str_radix(a, 16).ok()?,
        usize::from_str_radix(b, 16).ok()?,
    ))
}

/// The runs of `true` in `present`: (first index, length).
fn runs(present: &[bool]) -> impl Iterator<Item = (usize, usize)> + '_ {
    let mut i = 0;
    std::iter::from_fn(move || {
        let first = i + present[i..].iter().position(|&p| p)?;
        let len = present[first..]
            .iter()
            .position(|&p| !p)
            .unwrap_or(present.len() - first);
        i = first + len;
        Some((first, len))
    })
}

/// Number of threads in this process.
pub fn thread_count() -> std::io::Result<usize> {
    Ok(std::fs::read_dir("/proc/self/task")?.count())
}

/// Descriptors reserved beside those the vault may hand a component.
const SPARE_DESCRIPTORS: u64 = 256;

/// Grows this process's descriptor table to hold `vault_fds` more (within
/// the open-file limit) while the process is still single-threaded. The
/// kernel grows a table by doubling, and a process whose table is shared
/// by several threads waits for an RCU grace period at each doubling
/// (`expand_fdtable`): ramfs receiving its 1,000 files' descriptors at
/// initialization spent 50–95 ms in those waits, and about 0.3 ms in all
/// once the table was grown here, before its workers started.
/// `open` is any open descriptor (duplicated, then closed).
pub fn reserve_descriptors(
    open: std::os::fd::BorrowedFd<'_>,
    vault_fds: u64,
) -> std::io::Result<()> {
    let limit = rustix::process::getrlimit(Resource::Nofile)
        .current
        .unwrap_or(u64::MAX);
    let want = vault_fds.saturating_add(SPARE_DESCRIPTORS).min(limit);
    let Ok(highest) = u32::try_from(want.saturating_sub(1)) else {
        return Ok(());
    };
    // The lowest free descriptor at or above `highest`: the table grows
    // to hold it, and stays grown once it is closed.
    drop(rustix::io::fcntl_dupfd_cloexec(open, highest as i32)?);
    Ok(())
}

/// Dies with SIGKILL when the parent (the supervisor) dies, so no component
/// outlives its system; exits at once if the parent is already gone.
pub fn die_with_parent(expected_parent: u32) -> std::io::Result<()> {
    rustix::process::set_parent_process_death_signal(Some(Signal::KILL))?;
    let parent = rustix::process::getppid()
        .map(|p| p.as_raw_nonzero().get() as u32)
        .unwrap_or(0);
    if parent != expected_parent {
        std::process::exit(70);
    }
    Ok(())
}

/// Makes this process non-dumpable: another process of the same user can
/// no longer open its `/proc/PID/fd/N` (its channels, its arena, the
/// memfds it was handed), read its memory or ptrace it, unless it holds
/// `CAP_SYS_PTRACE`, which components do not (the supervisor does, for
/// checkpoints and the injector). Inherited by every fork.
pub fn private_memory() -> std::io::Result<()> {
    rustix::process::set_dumpable_behavior(rustix::process::DumpableBehavior::NotDumpable)?;
    Ok(())
}

/// Names the process after its binary when it was exec'd through a
/// descriptor (`/proc/self/fd/N`, as the supervisor starts a component
/// that runs as another user), which gives it the name `N`: `ps`, `top`
/// and `perf` then show `kintsugi-ramfs`, not a number. `argv[0]` holds the
/// binary's path.
pub fn name_after_binary() {
    let named_by_number = rustix::thread::name()
        .is_ok_and(|n| !n.as_bytes().is_empty() && n.as_bytes().iter().all(u8::is_ascii_digit));
    if !named_by_number {
        return;
    }
    let Some(arg0) = std::env::args_os().next() else {
        return;
    };
    let path = std::path::PathBuf::from(arg0);
    let Some(file) = path.file_name() else { return };
    let mut name = std::os::unix::ffi::OsStrExt::as_bytes(file).to_vec();
    name.truncate(15); // the kernel keeps 15 bytes and a NUL
    if let Ok(name) = std::ffi::CString::new(name) {
        let _ = rustix::thread::set_name(&name);
    }
}

/// No core files: a crashing component is rebooted in microseconds, and a
/// core dump of it would take milliseconds and disk.
pub fn disable_core_dumps() -> std::io::Result<()> {
    rustix::process::setrlimit(
        Resource::Core,
        Rlimit {
            current: Some(0),
            maximum: Some(0),
        },
    )?;
    Ok(())
}

/// Restores the default action of the fault signals. Rust's standard library
/// catches SIGSEGV and SIGBUS to report stack overflows, and its handler
/// swallows one such signal when it was sent rather than caused by a fault;
/// a component must die of it, so that the supervisor reboots it.
pub fn default_fault_signals() -> std::io::Result<()> {
    for sig in [libc::SIGSEGV, libc::SIGBUS] {
        // SAFETY: installing SIG_DFL runs no code of ours in signal context.
        if unsafe { libc::signal(sig, libc::SIG_DFL) } == libc::SIG_ERR {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Makes a panic in any thread a fault of the whole component, whatever
/// profile it was built with: the message and its place are printed, then
/// the process aborts (SIGABRT), which the supervisor sees as a crash and
/// reboots. With unwinding and no such hook, a panicking worker would die
/// alone and leave the component half alive (a poisoned lock, clients
/// waiting for a thread that is gone) and nothing would reboot it. No
/// backtrace is taken: an incarnation is forked from a multithreaded
/// image, and symbolizing could wait for a lock no thread will release.
pub fn abort_on_panic() {
    std::panic::set_hook(Box::new(|info| {
        let thread = std::thread::current();
        eprintln!(
            "thread '{}' panicked: {info}; aborting the component",
            thread.name().unwrap_or("?")
        );
        if let (Some(site), Some(at)) = (PANIC_SITE.get(), info.location()) {
            site.store(
                panic_site(at.file(), at.line(), at.column()),
                Ordering::SeqCst,
            );
        }
        std::process::abort();
    }));
}

/// Where the panic hook records the place of a panic for the supervisor.
static PANIC_SITE: OnceLock<&'static AtomicU64> = OnceLock::new();

/// Has the panic hook record where a panic happened in `site` (the
/// control block's word, which outlives this incarnation).
pub fn report_panics_to(site: &'static AtomicU64) {
    let _ = PANIC_SITE.set(site);
}

/// A panic's place as one non-zero word (FNV-1a of file, line and column).
fn panic_site(file: &str, line: u32, column: u32) -> u64 {
    let bytes = file
        .bytes()
        .chain(line.to_le_bytes())
        .chain(column.to_le_bytes());
    bytes
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
        })
        .max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The descriptor table's size (`FDSize` in `/proc/self/status`).
    fn table_size() -> u64 {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let line = status.lines().find(|l| l.starts_with("FDSize:")).unwrap();
        line["FDSize:".len()..].trim().parse().unwrap()
    }

    #[test]
    fn runs_of_present_pages_are_found_whole() {
        let p = [false, true, true, false, true, false, false, true];
        assert_eq!(runs(&p).collect::<Vec<_>>(), [(1, 2), (4, 1), (7, 1)]);
        assert_eq!(runs(&[]).count(), 0);
        assert_eq!(runs(&[true; 3]).collect::<Vec<_>>(), [(0, 3)]);
        assert_eq!(
            private_writable("7f00-7f10 rw-p 00000000 00:00 0"),
            Some((0x7f00, 0x7f10))
        );
        assert_eq!(private_writable("7f00-7f10 r--p 00000000 00:00 0"), None);
        assert_eq!(private_writable("7f00-7f10 rw-s 00000000 00:00 0"), None);
    }

    /// Pages of a private mapping, some touched: populated with no byte
    /// changed; and the limit and the stop are kept.
    #[test]
    fn private_pages_are_populated_and_keep_their_bytes() {
        let page = crate::abi::shm::page_size();
        let mut buf = vec![0u8; 64 * page];
        for i in (0..64).step_by(4) {
            buf[i * page] = i as u8 + 1;
        }
        let done = populate_private_memory(usize::MAX, || false).unwrap();
        assert!(done >= 16, "{done} pages");
        for i in 0..64 {
            let want = if i % 4 == 0 { i as u8 + 1 } else { 0 };
            assert_eq!(buf[i * page], want, "page {i}");
        }
        assert_eq!(populate_private_memory(3, || false).unwrap(), 3);
        assert_eq!(populate_private_memory(usize::MAX, || true).unwrap(), 0);
    }

    #[test]
    fn the_descriptor_table_is_grown_for_the_vault_and_no_descriptor_is_left_open() {
        let limit = rustix::process::getrlimit(Resource::Nofile)
            .current
            .unwrap_or(u64::MAX);
        let want = (3000 + SPARE_DESCRIPTORS).min(limit);
        let file = std::fs::File::open("/dev/null").unwrap();
        let open_before = std::fs::read_dir("/proc/self/fd").unwrap().count();
        reserve_descriptors(std::os::fd::AsFd::as_fd(&file), 3000).unwrap();
        assert!(table_size() >= want, "{} < {want}", table_size());
        let open_after = std::fs::read_dir("/proc/self/fd").unwrap().count();
        assert_eq!(open_before, open_after);
    }
}

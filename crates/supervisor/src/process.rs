//! Processes the supervisor watches: a pidfd per process, and the exec of a
//! component binary with exactly the descriptors the system grants it.

use std::cell::OnceCell;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use kintsugi_runtime::futex::timespec;
use kintsugi_runtime::priority::Priority;
use rustix::event::{poll, PollFd, PollFlags};
use rustix::fs::{Mode, OFlags};
use rustix::process::{
    pidfd_open, pidfd_send_signal, Pid, PidfdFlags, Signal, WaitId, WaitIdOptions,
};
use rustix::thread::CpuSet;

use crate::events::Exit;

/// A child process of the supervisor, watched through its pidfd.
#[derive(Debug)]
pub struct Proc {
    pub pid: u32,
    pub pidfd: OwnedFd,
    /// How it ended, once reaped.
    exit: OnceCell<Exit>,
}

impl Proc {
    /// Watches `pid`, which must be a child of this process not yet reaped
    /// (so its pid cannot have been reused).
    pub fn adopt(pid: u32) -> std::io::Result<Self> {
        let p = Pid::from_raw(pid as i32).ok_or_else(|| std::io::Error::other("pid 0"))?;
        Ok(Self {
            pid,
            pidfd: pidfd_open(p, PidfdFlags::empty())?,
            exit: OnceCell::new(),
        })
    }

    /// Watches `pid` as a zygote reported it: refused unless it is a child
    /// of this process (the kernel says so: `waitid` on its pidfd fails
    /// with `ECHILD` otherwise), so that a faulty or hostile zygote cannot
    /// make the supervisor watch, and later signal, another process.
    pub fn adopt_child(pid: u32) -> std::io::Result<Self> {
        let proc = Self::adopt(pid)?;
        let probe = rustix::process::waitid(
            WaitId::PidFd(proc.pidfd.as_fd()),
            WaitIdOptions::EXITED | WaitIdOptions::NOHANG | WaitIdOptions::NOWAIT,
        );
        match probe {
            Err(rustix::io::Errno::CHILD) => Err(std::io::Error::other(format!(
                "pid {pid} is not a child of the supervisor"
            ))),
            _ => Ok(proc),
        }
    }

    pub fn signal(&self, sig: Signal) {
        if self.exit.get().is_none() {
            // Fails only if the process is already gone, which its pidfd reports.
            let _ = pidfd_send_signal(&self.pidfd, sig);
        }
    }

    /// Reaps the process if it has exited (once; later calls return the same exit).
    pub fn try_reap(&self) -> Option<Exit> {
        if let Some(e) = self.exit.get() {
            return Some(*e);
        }
        let status = rustix::process::waitid(
            WaitId::PidFd(self.pidfd.as_fd()),
            WaitIdOptions::EXITED | WaitIdOptions::NOHANG,
        )
        .ok()??;
        let exit = match status.terminating_signal() {
            Some(sig) => Exit::Signal(sig),
            None => Exit::Code(status.exit_status()?),
        };
        Some(*self.exit.get_or_init(|| exit))
    }

    /// Waits up to `timeout` for the process to exit and reaps it.
    pub fn wait_exit(&self, timeout: Duration) -> Option<Exit> {
        let mut fds = [PollFd::new(&self.pidfd, PollFlags::IN)];
        let ts = timespec(timeout);
        while let Err(rustix::io::Errno::INTR) = poll(&mut fds, Some(&ts)) {}
        self.try_reap()
    }

    /// SIGKILL and reap.
    pub fn kill(&self) -> Exit {
        self.signal(Signal::KILL);
        loop {
            if let Some(e) = self.wait_exit(Duration::from_secs(5)) {
                return e;
            }
        }
    }

    /// Resident set size in KiB (0 if unknown).
    pub fn rss_kib(&self) -> u64 {
        std::fs::read_to_string(format!("/proc/{}/status", self.pid))
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("VmRSS:"))
                    .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
            })
            .unwrap_or(0)
    }
}

/// How a process whose threads have all died is ending, read from its
/// `/proc/PID/stat` (`exit_code`, the line's last field) while the kernel
/// still tears it down (the exit code is set before the address space is
/// freed). The file is opened while the process lives, off the reboot's
/// path: opening and parsing it at the death (the `procfs` crate) took
/// 35–85 µs of a small incarnation's 180 µs reboot, most of the event
/// loop's bookkeeping (docs/benchmarks.md); a read of the open file is a
/// `pread`.
#[derive(Debug)]
pub struct ExitProbe(OwnedFd);

impl ExitProbe {
    /// Opens the stat file of `pid`, a child not yet reaped.
    pub fn open(pid: u32) -> std::io::Result<Self> {
        let path = format!("/proc/{pid}/stat");
        let fd = rustix::fs::open(
            path.as_str(),
            OFlags::RDONLY | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        Ok(Self(fd))
    }

    /// The exit the process is taking (`Exit::Signal(0)`: unknown, e.g.
    /// already reaped).
    pub fn read(&self) -> Exit {
        let mut buf = [0u8; 1024];
        let n = rustix::io::pread(&self.0, &mut buf, 0).unwrap_or(0);
        let line = &buf[..n];
        // The command name, in parentheses, may hold anything: the fields
        // after its last `)` are numbers, and `exit_code` ends the line.
        let after = line
            .iter()
            .rposition(|&b| b == b')')
            .map_or(&[][..], |i| &line[i + 1..]);
        std::str::from_utf8(after)
            .ok()
            .and_then(|t| t.split_ascii_whitespace().last())
            .and_then(|f| f.parse().ok())
            .map_or(Exit::Signal(0), exit_of_status)
    }
}

/// A wait status as an exit code or the signal that ended the process.
fn exit_of_status(status: i32) -> Exit {
    match status & 0x7f {
        0 => Exit::Code((status >> 8) & 0xff),
        sig => Exit::Signal(sig),
    }
}

const CAP_SYS_NICE: u32 = 23;
const CAP_SYS_RESOURCE: u32 = 24;

/// Whether this process holds `CAP_SYS_RESOURCE` (read once from
/// `/proc/self/status`), which raising a child's priority limits needs.
fn may_raise_limits() -> bool {
    static MAY: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *MAY.get_or_init(|| {
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let effective = status
            .lines()
            .find_map(|l| l.strip_prefix("CapEff:"))
            .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
            .unwrap_or(0);
        let may = effective & (1 << CAP_SYS_RESOURCE) != 0;
        if !may {
            tracing::info!(
                "no CAP_SYS_RESOURCE: components keep CAP_SYS_NICE instead of priority limits"
            );
        }
        may
    })
}

/// How a component's processes are confined and scheduled (issue 17,
/// least privilege).
#[derive(Clone, Copy)]
pub struct Confinement {
    /// Its nice value (applied also when 0: the supervisor's own threads
    /// run at a higher priority, and a child inherits its nice value).
    pub nice: i32,
    /// Address-space randomization off (`ADDR_NO_RANDOMIZE`), so that every
    /// exec of the binary lays out its memory alike and a checkpoint taken
    /// under one supervisor restores under another.
    pub fixed_layout: bool,
    /// One malloc arena for all its threads (glibc's `arena_max` tunable),
    /// for a component whose requests run one at a time (checkpoint
    /// recovery): no contention to spread, and a dozen fewer mappings and
    /// their pages for every checkpoint to scan and every restore to make.
    pub one_malloc_arena: bool,
    /// The capabilities it keeps, as a mask of their numbers.
    pub capabilities: u64,
    /// The highest priority it may take by itself (`RLIMIT_NICE`,
    /// `RLIMIT_RTPRIO`): that of its most urgent caller, so that priority
    /// inheritance works without `CAP_SYS_NICE`, and no higher.
    pub ceiling: Priority,
    /// The uid and gid it runs as (`user = …`), if not the supervisor's.
    pub user: Option<(u32, u32)>,
    /// The CPUs it may run on (`cpus = […]`), if not the supervisor's.
    pub cpus: Option<CpuSet>,
}

/// The CPU set of a component's `cpus`, refused unless the supervisor
/// may use every CPU listed (the kernel would quietly drop the others,
/// or refuse a set with none it allows, at exec).
pub fn cpu_set(cpus: &[u16]) -> std::io::Result<Option<CpuSet>> {
    if cpus.is_empty() {
        return Ok(None);
    }
    let allowed = rustix::thread::sched_getaffinity(None)?;
    let mut set = CpuSet::new();
    for &cpu in cpus {
        if !allowed.is_set(cpu as usize) {
            let list: Vec<String> = (0..CpuSet::MAX_CPU)
                .filter(|&c| allowed.is_set(c))
                .map(|c| c.to_string())
                .collect();
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "cpus lists CPU {cpu}, which the supervisor may not use (it may use {})",
                    list.join(", ")
                ),
            ));
        }
        set.set(cpu as usize);
    }
    Ok(Some(set))
}

/// Becomes user `uid` (group `gid`, no supplementary group) keeping the
/// capabilities in `keep` across the exec that follows: a non-root exec
/// drops every capability but the ambient ones, so those are raised
/// (permitted and inheritable first, which `PR_SET_KEEPCAPS` keeps
/// through the change of uid). Runs in the forked child before exec:
/// raw system calls only.
fn become_user(uid: u32, gid: u32, keep: u64) -> std::io::Result<()> {
    use rustix::thread::{self as t, CapabilitySet, CapabilitySets};
    t::set_thread_groups(&[])?;
    let gid = rustix::process::Gid::from_raw(gid);
    t::set_thread_res_gid(gid, gid, gid)?;
    t::set_keep_capabilities(true)?;
    let uid = rustix::process::Uid::from_raw(uid);
    t::set_thread_res_uid(uid, uid, uid)?;
    let kept = CapabilitySet::from_bits_retain(keep);
    t::set_capabilities(
        None,
        CapabilitySets {
            effective: kept,
            permitted: kept,
            inheritable: kept,
        },
    )?;
    for cap in (0..64).filter(|c| keep & (1 << c) != 0) {
        t::configure_capability_in_ambient_set(CapabilitySet::from_bits_retain(1 << cap), true)?;
    }
    t::set_keep_capabilities(false)?;
    Ok(())
}

/// Execs `binary` as a component: `boot_json` in its environment, `pass` the
/// only inherited descriptors besides stdio (stdout and stderr: `output`'s
/// pipes), its own process group (so a terminal's Ctrl-C reaches the
/// supervisor alone), confined as `how` says.
///
/// Least privilege: every other descriptor is closed at exec
/// (`close_range(CLOEXEC)`: the supervisor's own and any its parent left
/// open), `no_new_privs` is set, every capability but those kept leaves the
/// bounding set (so that even a component run by root keeps only what its
/// description grants), and its priority limits are its ceiling.
pub fn spawn_component(
    binary: &Path,
    boot_json: &str,
    pass: &[RawFd],
    output: &crate::output::Pipes,
    how: Confinement,
) -> std::io::Result<Proc> {
    let Confinement {
        nice,
        fixed_layout,
        one_malloc_arena,
        capabilities: mut keep,
        ceiling,
        user,
        cpus,
    } = how;
    // Raising a hard limit needs CAP_SYS_RESOURCE; where the supervisor
    // runs without it (some containers), components keep CAP_SYS_NICE
    // instead, and only the vault's clamp holds them to their ceiling.
    let limits = may_raise_limits();
    if !limits {
        keep |= 1 << CAP_SYS_NICE;
    }
    // RLIMIT_NICE counts from 1 (nice 19) to 40 (nice -20).
    let nice_limit = libc::rlimit {
        rlim_cur: (20 - ceiling.nice) as libc::rlim_t,
        rlim_max: (20 - ceiling.nice) as libc::rlim_t,
    };
    let rt_limit = libc::rlimit {
        rlim_cur: libc::rlim_t::from(ceiling.fifo.unwrap_or(0)),
        rlim_max: libc::rlim_t::from(ceiling.fifo.unwrap_or(0)),
    };
    let pass = pass.to_vec();
    let last_cap: u32 = std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(40);
    // Run as another user, it is exec'd through a descriptor the
    // supervisor opened: that user may lack the right to search the
    // binary's folders (a checkout in a 0700 folder), not to run it.
    let by_fd = match user {
        Some(_) => Some(rustix::fs::open(
            binary,
            rustix::fs::OFlags::PATH | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        )?),
        None => None,
    };
    let mut cmd = match &by_fd {
        Some(fd) => {
            let mut cmd = Command::new(format!("/proc/self/fd/{}", fd.as_raw_fd()));
            cmd.arg0(binary);
            cmd
        }
        None => Command::new(binary),
    };
    // The service manager's variables are the supervisor's, not theirs.
    for var in [
        "NOTIFY_SOCKET",
        "WATCHDOG_USEC",
        "WATCHDOG_PID",
        "LISTEN_FDS",
        "LISTEN_PID",
        "LISTEN_FDNAMES",
        // Its stderr is a pipe to the supervisor, not the journal's stream.
        "JOURNAL_STREAM",
    ] {
        cmd.env_remove(var);
    }
    // Its stderr is a pipe to the supervisor: it colours its lines as the
    // supervisor's own stderr would be.
    let colour = match kintsugi_runtime::logging::ansi_wanted() {
        true => "always",
        false => "never",
    };
    cmd.env("KINTSUGI_COLOR", colour);
    if one_malloc_arena {
        let tunables = std::env::var("GLIBC_TUNABLES").ok();
        let ours = "glibc.malloc.arena_max=1";
        cmd.env(
            "GLIBC_TUNABLES",
            tunables.map_or(ours.to_string(), |t| format!("{t}:{ours}")),
        );
    }
    cmd.env(kintsugi_runtime::abi::boot::BOOT_ENV, boot_json)
        .stdin(Stdio::null())
        .stdout(output.stdout.try_clone()?)
        .stderr(output.stderr.try_clone()?)
        .process_group(0);
    // SAFETY: the closure runs in the forked child before exec and calls only
    // async-signal-safe functions (close_range, fcntl, prctl, setrlimit,
    // setpriority, personality, sched_setaffinity; for another user
    // setgroups, setresgid,
    // setresuid and capset, as rustix's raw system calls); it allocates
    // nothing.
    unsafe {
        cmd.pre_exec(move || {
            // Everything from 3 up closes at exec, then the granted ones
            // are let through.
            if libc::syscall(
                libc::SYS_close_range,
                3u32,
                u32::MAX,
                libc::CLOSE_RANGE_CLOEXEC,
            ) == -1
            {
                return Err(std::io::Error::last_os_error());
            }
            for &fd in &pass {
                if libc::fcntl(fd, libc::F_SETFD, 0) == -1 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == -1 {
                return Err(std::io::Error::last_os_error());
            }
            for cap in (0..=last_cap.min(63)).filter(|c| keep & (1 << c) == 0) {
                // EPERM: this user holds no capability to drop (not root);
                // EINVAL: one this kernel does not know.
                if libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) == -1 {
                    let e = std::io::Error::last_os_error();
                    if !matches!(e.raw_os_error(), Some(libc::EPERM | libc::EINVAL)) {
                        return Err(e);
                    }
                }
            }
            if limits
                && (libc::setrlimit(libc::RLIMIT_NICE, &nice_limit) == -1
                    || libc::setrlimit(libc::RLIMIT_RTPRIO, &rt_limit) == -1)
            {
                return Err(std::io::Error::last_os_error());
            }
            // Always: the supervisor's thread runs above the components'
            // default, and a child inherits its nice value.
            if libc::setpriority(libc::PRIO_PROCESS, 0, nice) == -1 {
                return Err(std::io::Error::last_os_error());
            }
            if let Some(set) = &cpus {
                rustix::thread::sched_setaffinity(None, set)?;
            }
            if fixed_layout {
                // 0xffffffff queries the persona without changing it.
                let persona = libc::personality(0xffff_ffff);
                if persona == -1
                    || libc::personality((persona | libc::ADDR_NO_RANDOMIZE) as libc::c_ulong) == -1
                {
                    return Err(std::io::Error::last_os_error());
                }
            }
            // Last: the steps above need the supervisor's privileges.
            if let Some((uid, gid)) = user {
                become_user(uid, gid, keep)?;
            }
            Ok(())
        });
    }
    let child = cmd.spawn()?;
    Proc::adopt(child.id())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What no description may allow, the runtime does not allow either.
    #[test]
    fn the_runtimes_allow_list_holds_no_call_never_allowed() {
        for call in kintsugi_runtime::seccomp::RUNTIME {
            assert!(
                !kintsugi_system::NEVER_ALLOWED.contains(call),
                "{call} is in the runtime's list"
            );
        }
    }

    /// A stat line of a process named `name` with exit status `status`.
    #[test]
    fn only_a_child_is_adopted_as_a_zygotes_fork() {
        let e = Proc::adopt_child(1).unwrap_err();
        assert!(e.to_string().contains("not a child"), "{e}");
        let mut child = Command::new("sleep").arg("5").spawn().unwrap();
        let proc = Proc::adopt_child(child.id()).unwrap();
        proc.signal(Signal::KILL);
        let _ = child.wait();
    }

    #[test]
    fn a_dead_processs_exit_is_read_before_it_is_reaped() {
        assert_eq!(exit_of_status(9), Exit::Signal(9));
        assert_eq!(exit_of_status(3 << 8), Exit::Code(3));
        assert_eq!(exit_of_status(0), Exit::Code(0));
        // A zombie child whose command name holds a parenthesis and spaces.
        let child = Command::new("bash")
            .args(["-c", "printf 'a) (b' > /proc/self/comm; exit 3"])
            .spawn()
            .unwrap();
        let pid = child.id();
        let probe = ExitProbe::open(pid).unwrap();
        let until = std::time::Instant::now() + Duration::from_secs(10);
        while procfs::process::Process::new(pid as i32)
            .and_then(|p| p.stat())
            .map_or(true, |s| s.state != 'Z')
        {
            assert!(std::time::Instant::now() < until, "never a zombie");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(probe.read(), Exit::Code(3));
        let proc = Proc::adopt(pid).unwrap();
        assert_eq!(proc.wait_exit(Duration::from_secs(5)), Some(Exit::Code(3)));
        drop(child);
        assert_eq!(probe.read(), Exit::Signal(0), "gone: unknown");
    }
}

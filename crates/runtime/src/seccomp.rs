//! A seccomp filter for every component (issue 17, least privilege): the
//! system calls no component of kintsugi makes, and that would let a
//! compromised one reach beyond itself, fail with `EPERM`. It is a deny
//! list, not an allow list: what the runtime, the checkpointer's remote
//! calls (`mmap`, `clone`, `userfaultfd`, …) and every component need stays
//! open. Installed at boot on every thread (`TSYNC`), before any worker
//! starts, and inherited by every incarnation the zygote forks; it cannot
//! be lifted (`no_new_privs` is set by the supervisor at exec).

use std::collections::BTreeMap;

use seccompiler::{BpfProgram, SeccompAction, SeccompFilter, TargetArch};

/// The denied calls: other processes' memory and tracing, the kernel's
/// modules, mounts, namespaces, keys, clocks, BPF and performance
/// counters, and the machine itself.
pub const DENIED: &[(&str, i64)] = &[
    ("ptrace", libc::SYS_ptrace),
    ("process_vm_readv", libc::SYS_process_vm_readv),
    ("process_vm_writev", libc::SYS_process_vm_writev),
    ("kcmp", libc::SYS_kcmp),
    ("mount", libc::SYS_mount),
    ("umount2", libc::SYS_umount2),
    ("pivot_root", libc::SYS_pivot_root),
    ("chroot", libc::SYS_chroot),
    ("setns", libc::SYS_setns),
    ("unshare", libc::SYS_unshare),
    ("open_by_handle_at", libc::SYS_open_by_handle_at),
    ("name_to_handle_at", libc::SYS_name_to_handle_at),
    ("init_module", libc::SYS_init_module),
    ("finit_module", libc::SYS_finit_module),
    ("delete_module", libc::SYS_delete_module),
    ("kexec_load", libc::SYS_kexec_load),
    ("kexec_file_load", libc::SYS_kexec_file_load),
    ("reboot", libc::SYS_reboot),
    ("swapon", libc::SYS_swapon),
    ("swapoff", libc::SYS_swapoff),
    ("bpf", libc::SYS_bpf),
    ("perf_event_open", libc::SYS_perf_event_open),
    ("keyctl", libc::SYS_keyctl),
    ("add_key", libc::SYS_add_key),
    ("request_key", libc::SYS_request_key),
    ("settimeofday", libc::SYS_settimeofday),
    ("clock_settime", libc::SYS_clock_settime),
    ("clock_adjtime", libc::SYS_clock_adjtime),
    ("adjtimex", libc::SYS_adjtimex),
    ("acct", libc::SYS_acct),
    ("quotactl", libc::SYS_quotactl),
    ("syslog", libc::SYS_syslog),
    ("iopl", libc::SYS_iopl),
    ("ioperm", libc::SYS_ioperm),
];

/// The filter as a BPF program for this machine's architecture.
pub fn program() -> Result<BpfProgram, seccompiler::Error> {
    let rules = DENIED
        .iter()
        .map(|&(_, nr)| (nr, Vec::new()))
        .collect::<BTreeMap<_, _>>();
    let arch = TargetArch::try_from(std::env::consts::ARCH)?;
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EPERM as u32),
        arch,
    )?;
    filter.try_into().map_err(seccompiler::Error::Backend)
}

/// Installs the filter on the calling thread alone (and the threads it
/// will create): for measuring what the filter costs beside threads
/// without it (`kintsugi bench ipc`).
pub fn install_on_this_thread() -> Result<(), seccompiler::Error> {
    // Unprivileged, a filter needs no_new_privs (components have it from exec).
    rustix::thread::set_no_new_privs(true).map_err(|e| seccompiler::Error::Seccomp(e.into()))?;
    seccompiler::apply_filter(&program()?)
}

/// Installs the filter on every thread of this process.
pub fn install() -> Result<(), seccompiler::Error> {
    seccompiler::apply_filter_all_threads(&program()?)
}

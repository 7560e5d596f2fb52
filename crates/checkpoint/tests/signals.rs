//! A signal that reaches a process while it is frozen (for a checkpoint,
//! a restore, an injected system call) is delivered once it is let go:
//! the freeze holds signals back, it never swallows them.

mod common;

use std::time::Duration;

use common::Target;
use kintsugi_checkpoint::{Checkpointer, Frozen};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

const DEATH: Duration = Duration::from_secs(5);

fn target() -> Target {
    // Four threads asleep in the kernel, as a component's idle workers are.
    Target::start(3, 1 << 20, 4, 4, false)
}

#[test]
fn a_signal_sent_to_a_frozen_process_acts_once_it_is_let_go() {
    let mut t = target();
    let frozen = Frozen::freeze(t.pid()).unwrap();
    kill(Pid::from_raw(t.pid() as i32), Signal::SIGTERM).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(t.killed_by(Duration::ZERO), None, "died while frozen");
    drop(frozen);
    assert_eq!(t.killed_by(DEATH), Some(Signal::SIGTERM as i32));
}

/// Stepping a thread for an injected system call lets it take the
/// pending signal first: it stops to report it, and that stop (reported
/// by `waitid` as a ptrace event with number 0) must keep the signal.
/// Before this was read right, the checkpoint failed ("a single step
/// stopped with PtraceEvent(…, SIGTERM, 0)") and the signal was lost:
/// the process lived on.
#[test]
fn a_signal_taken_during_a_checkpoints_injected_calls_is_kept_and_the_checkpoint_taken() {
    let mut t = target();
    let mut c = Checkpointer::attach(t.pid()).unwrap();
    let frozen = Frozen::freeze(t.pid()).unwrap();
    kill(Pid::from_raw(t.pid() as i32), Signal::SIGTERM).unwrap();
    // The first checkpoint learns each thread's tid address with an
    // injected system call, a single step of each thread.
    let stats = c.checkpoint_frozen(&frozen);
    drop(frozen);
    assert_eq!(
        t.killed_by(DEATH),
        Some(Signal::SIGTERM as i32),
        "{stats:?}"
    );
    let stats = stats.unwrap();
    assert_eq!(stats.threads, 4, "{stats:?}");
}

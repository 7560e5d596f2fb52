//! Stops one thread of another process, as a hang the watchdog must catch
//! (a thread that is never scheduled again): `PTRACE_SEIZE` and
//! `PTRACE_INTERRUPT` from a thread of this process, which then stays the
//! tracer and reaps the thread when it is killed, so that its process can
//! be reaped by its parent.

use std::sync::mpsc;
use std::thread::JoinHandle;

use nix::sys::ptrace;
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

/// Stops thread `tid`; returns once it is stopped. The returned thread ends
/// when the frozen thread has died.
pub fn freeze_thread(tid: u32) -> anyhow::Result<JoinHandle<()>> {
    let (tx, rx) = mpsc::channel();
    let tracer = std::thread::Builder::new()
        .name(format!("freeze:{tid}"))
        .spawn(move || {
            let pid = Pid::from_raw(tid as i32);
            let stopped = (|| -> nix::Result<()> {
                ptrace::seize(pid, ptrace::Options::empty())?;
                ptrace::interrupt(pid)?;
                waitpid(pid, Some(WaitPidFlag::__WALL))?;
                Ok(())
            })();
            let ok = stopped.is_ok();
            let _ = tx.send(stopped);
            // Keep it stopped (group-stop or not) until it dies, then reap it.
            while ok {
                match waitpid(pid, Some(WaitPidFlag::__WALL)) {
                    Ok(WaitStatus::Exited(..) | WaitStatus::Signaled(..)) | Err(_) => break,
                    Ok(_) => {}
                }
            }
        })?;
    match rx.recv()? {
        Ok(()) => Ok(tracer),
        Err(e) => {
            let _ = tracer.join();
            anyhow::bail!("cannot stop thread {tid}: {e}")
        }
    }
}

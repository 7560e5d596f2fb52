//! Watching a live incarnation's lifelines, to learn of its death before the
//! kernel has torn it down (see `kintsugi_runtime::abi::lifeline`).
//!
//! One thread per component ([`Watcher`]) watches its live incarnations in
//! turn: it sleeps on the main thread's lifeline and, when the kernel marks
//! it, waits until every lifeline of the incarnation is marked (no thread of
//! it can run any more code), then tells the event loop through a pipe:
//! `[component index: u32][generation: u32]`. A thread made for each
//! incarnation and ended once it had told (as before) exited right after it
//! woke the event loop, on the same CPU: its exit stood on the reboot's path.

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kintsugi_runtime::abi::boot::ControlBlock;
use kintsugi_runtime::abi::lifeline::{Lifeline, OWNER_DIED, WAITERS};
use kintsugi_runtime::abi::shm::Region;
use kintsugi_runtime::futex;

use crate::events::Exit;
use crate::process::ExitProbe;

/// How long the rest of an incarnation's threads may take to die once its
/// main thread has.
const ALL_DEAD_WITHIN: Duration = Duration::from_millis(200);

/// One incarnation to watch.
struct Job {
    bank: usize,
    generation: u32,
    stop: Arc<AtomicBool>,
}

/// A component's watcher thread; it ends once this is dropped and the
/// incarnation it watches, if any, is let go.
pub struct Watcher {
    control: Arc<Region>,
    jobs: Sender<Job>,
}

impl Watcher {
    /// Starts the watcher of component `index`, whose control block is
    /// `control`; it reports deaths to `notify`.
    pub fn start(control: Arc<Region>, index: u32, notify: Arc<OwnedFd>) -> Self {
        let (jobs, queue) = channel::<Job>();
        let c = control.clone();
        std::thread::Builder::new()
            .name(format!("lifelines:{index}"))
            .spawn(move || {
                for job in queue {
                    if watch(&c, job.bank, &job.stop) && !job.stop.load(Ordering::SeqCst) {
                        let ctl: &ControlBlock = c.at(0);
                        if ctl.exiting.load(Ordering::SeqCst) != job.generation {
                            let mut msg = [0u8; 8];
                            msg[..4].copy_from_slice(&index.to_le_bytes());
                            msg[4..].copy_from_slice(&job.generation.to_le_bytes());
                            let _ = rustix::io::write(&*notify, &msg);
                        }
                    }
                }
            })
            .expect("spawn lifeline watcher");
        Self { control, jobs }
    }

    /// Watches incarnation `generation`, whose threads hold the lifelines
    /// of `bank`, until it dies or the returned [`Watch`] is dropped.
    pub fn watch(&self, bank: usize, generation: u32, exit: Option<ExitProbe>) -> Watch {
        let stop = Arc::new(AtomicBool::new(false));
        let job = Job {
            bank,
            generation,
            stop: stop.clone(),
        };
        let _ = self.jobs.send(job);
        Watch {
            stop,
            control: self.control.clone(),
            bank,
            exit,
        }
    }
}

/// The watch of one live incarnation; dropping it lets the incarnation go.
pub struct Watch {
    stop: Arc<AtomicBool>,
    control: Arc<Region>,
    bank: usize,
    /// Where its exit is read once its lifelines report it dying.
    exit: Option<ExitProbe>,
}

impl Watch {
    /// How the incarnation whose lifelines all died is ending
    /// (`Exit::Signal(0)`: unknown).
    pub fn dying_exit(&self) -> Exit {
        self.exit.as_ref().map_or(Exit::Signal(0), ExitProbe::read)
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // The watcher sleeps on the main thread's lifeline while the
        // incarnation lives; once that thread has died, the others' die
        // with the process and wake it themselves, and the watcher sleeps
        // on the main thread's no more (no wake: a reboot after the
        // lifelines reported spares its event loop the system call).
        let ctl: &ControlBlock = self.control.at(0);
        let main = &ctl.lifelines[self.bank][0].word;
        if main.load(Ordering::SeqCst) & OWNER_DIED == 0 {
            futex::wake_all(main);
        }
    }
}

/// Sleeps until every lifeline of `bank` is marked dead (true), or until
/// stopped (false). Each wait is a futex sleep that the kernel ends when it
/// marks the word, so the watcher takes no CPU from the dying threads.
fn watch(control: &Region, bank: usize, stop: &AtomicBool) -> bool {
    let ctl: &ControlBlock = control.at(0);
    if !wait_dead(&ctl.lifelines[bank][0], stop, None) {
        return false;
    }
    let deadline = Instant::now() + ALL_DEAD_WITHIN;
    ctl.bank(bank)
        .iter()
        .all(|line| wait_dead(line, stop, Some(deadline)))
}

/// Sleeps until `line`'s owner has died (true), or until stopped or past
/// `deadline` (false; the pidfd will report the death then).
fn wait_dead(line: &Lifeline, stop: &AtomicBool, deadline: Option<Instant>) -> bool {
    loop {
        if stop.load(Ordering::SeqCst) {
            return false;
        }
        let v = line.word.load(Ordering::SeqCst);
        if v == 0 || v & OWNER_DIED != 0 {
            return true;
        }
        let v = line.word.fetch_or(WAITERS, Ordering::SeqCst) | WAITERS;
        if v & OWNER_DIED != 0 {
            return true;
        }
        let timeout = match deadline {
            Some(d) => match d.checked_duration_since(Instant::now()) {
                Some(left) => left,
                None => return false,
            },
            None => Duration::from_secs(1),
        };
        futex::wait(&line.word, v, Some(timeout));
    }
}

//! Watching a live incarnation's lifelines, to learn of its death before the
//! kernel has torn it down (see `kintsugi_runtime::abi::lifeline`).
//!
//! One thread per live incarnation sleeps on its main thread's lifeline. When
//! the kernel marks it, the thread waits until every lifeline of the
//! incarnation is marked (no thread of it can run any more code), then tells
//! the event loop through a pipe: `[component index: u32][generation: u32]`.

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kintsugi_runtime::abi::boot::ControlBlock;
use kintsugi_runtime::abi::lifeline::{Lifeline, OWNER_DIED, WAITERS};
use kintsugi_runtime::abi::shm::Region;
use kintsugi_runtime::futex;

/// How long the rest of an incarnation's threads may take to die once its
/// main thread has.
const ALL_DEAD_WITHIN: Duration = Duration::from_millis(200);

/// A running watcher; dropping it stops the thread.
pub struct Watch {
    stop: Arc<AtomicBool>,
    control: Arc<Region>,
    bank: usize,
}

impl Watch {
    pub fn start(
        control: Arc<Region>,
        bank: usize,
        index: u32,
        generation: u32,
        notify: Arc<OwnedFd>,
    ) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let (s, c) = (stop.clone(), control.clone());
        std::thread::Builder::new()
            .name(format!("lifelines:{index}"))
            .spawn(move || {
                if watch(&c, bank, &s) && !s.load(Ordering::SeqCst) {
                    let ctl: &ControlBlock = c.at(0);
                    if ctl.exiting.load(Ordering::SeqCst) != generation {
                        let mut msg = [0u8; 8];
                        msg[..4].copy_from_slice(&index.to_le_bytes());
                        msg[4..].copy_from_slice(&generation.to_le_bytes());
                        let _ = rustix::io::write(&*notify, &msg);
                    }
                }
            })
            .expect("spawn lifeline watcher");
        Self {
            stop,
            control,
            bank,
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let ctl: &ControlBlock = self.control.at(0);
        futex::wake_all(&ctl.lifelines[self.bank][0].word);
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

//! The checkpoint thread's commands: one queue, kept in the order the
//! commands were given, where each is either *sent* (the thread is woken
//! for it) or *posted* (handled at the thread's next wake, before anything
//! else it does then, or at a [`Mailbox::flush`]). Posting keeps a wake of
//! another thread off the reboot's path: the event loop tells the
//! checkpoint thread that a component is down right where it learns of the
//! death, and that it is live again right where its new incarnation is
//! ready; waking the thread at each cost the event loop about 20 µs of a
//! small incarnation's reboot (docs/benchmarks.md, "The event loop's part
//! of a reboot"). The event loop flushes before it sleeps.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// A queue of commands with one receiver.
pub(crate) struct Mailbox<T> {
    state: Mutex<State<T>>,
    woken: Condvar,
}

struct State<T> {
    queued: VecDeque<T>,
    /// A command was sent since the receiver last took.
    sent: bool,
    closed: bool,
}

impl<T> Mailbox<T> {
    pub(crate) fn new() -> Self {
        Self {
            state: Mutex::new(State {
                queued: VecDeque::new(),
                sent: false,
                closed: false,
            }),
            woken: Condvar::new(),
        }
    }

    /// Queues `item` and wakes the receiver; false once closed.
    pub(crate) fn send(&self, item: T) -> bool {
        self.push(item, true)
    }

    /// Queues `item` for the receiver's next wake; false once closed.
    pub(crate) fn post(&self, item: T) -> bool {
        self.push(item, false)
    }

    fn push(&self, item: T, wake: bool) -> bool {
        let mut s = self.lock();
        if s.closed {
            return false;
        }
        s.queued.push_back(item);
        if wake {
            s.sent = true;
            drop(s);
            self.woken.notify_one();
        }
        true
    }

    /// Wakes the receiver if commands were posted since it last took.
    pub(crate) fn flush(&self) {
        let mut s = self.lock();
        if !s.queued.is_empty() && !s.sent {
            s.sent = true;
            drop(s);
            self.woken.notify_one();
        }
    }

    /// Accepts nothing more; the receiver takes what is queued, then `None`.
    pub(crate) fn close(&self) {
        self.lock().closed = true;
        self.woken.notify_one();
    }

    /// Waits until a command is sent, the mailbox is closed or `timeout`
    /// passes, and takes every command queued, in order (posted ones
    /// included; none after a timeout with nothing posted); `None` once
    /// closed and empty.
    pub(crate) fn take(&self, timeout: Duration) -> Option<Vec<T>> {
        let deadline = Instant::now().checked_add(timeout);
        let mut s = self.lock();
        while !s.sent && !s.closed {
            let left = match deadline {
                Some(d) => match d.checked_duration_since(Instant::now()) {
                    Some(left) if !left.is_zero() => left,
                    _ => break,
                },
                None => timeout,
            };
            s = match self.woken.wait_timeout(s, left) {
                Ok((s, _)) => s,
                Err(p) => p.into_inner().0,
            };
        }
        s.sent = false;
        if s.closed && s.queued.is_empty() {
            return None;
        }
        Some(s.queued.drain(..).collect())
    }

    fn lock(&self) -> MutexGuard<'_, State<T>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[test]
    fn posted_commands_wait_for_a_sent_one_and_keep_their_order() {
        let m = Mailbox::new();
        assert!(m.post(1));
        let t = Instant::now();
        assert_eq!(
            m.take(Duration::from_millis(30)),
            Some(vec![1]),
            "taken at the timeout"
        );
        assert!(
            t.elapsed() >= Duration::from_millis(30),
            "a post woke no one"
        );
        let m = Arc::new(m);
        let (tx, rx) = (m.clone(), m.clone());
        let receiver = std::thread::spawn(move || rx.take(Duration::from_secs(60)));
        assert!(tx.post(2) && tx.post(3));
        std::thread::sleep(Duration::from_millis(20));
        assert!(!receiver.is_finished(), "woken by a post");
        assert!(tx.send(4));
        assert_eq!(receiver.join().unwrap(), Some(vec![2, 3, 4]));
        let rx = m.clone();
        let receiver = std::thread::spawn(move || rx.take(Duration::from_secs(60)));
        m.flush();
        assert!(m.post(5));
        std::thread::sleep(Duration::from_millis(20));
        assert!(!receiver.is_finished(), "woken by a flush of nothing");
        m.flush();
        assert_eq!(receiver.join().unwrap(), Some(vec![5]), "a flush wakes");
    }

    #[test]
    fn a_closed_mailbox_hands_over_what_it_holds_then_ends() {
        let m = Arc::new(Mailbox::new());
        assert!(m.post("down"));
        let rx = m.clone();
        let receiver = std::thread::spawn(move || {
            let first = rx.take(Duration::from_secs(60));
            (first, rx.take(Duration::from_secs(60)))
        });
        std::thread::sleep(Duration::from_millis(20));
        m.close();
        assert!(!m.send("live"), "refused once closed");
        assert_eq!(receiver.join().unwrap(), (Some(vec!["down"]), None));
    }
}

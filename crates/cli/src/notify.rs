//! The service manager's notification protocol (`sd_notify(3)`, issue
//! 18), when `kintsugi run` runs under systemd (`Type=notify`, see
//! `packaging/kintsugi@.service`): `READY=1` once every component serves,
//! `STATUS=` lines as components crash and come back, `WATCHDOG=1` while
//! the supervisor's event loop and its other serving threads turn (when
//! the unit sets `WatchdogSec=`), and `STOPPING=1`. Without
//! `NOTIFY_SOCKET` it does nothing.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kintsugi_supervisor::{Event, Roster, Stalls};
use sd_notify::NotifyState;

pub struct Notifier {
    components: usize,
    started: usize,
    reboots: u64,
    stop: Arc<AtomicBool>,
    pinger: Option<std::thread::JoinHandle<()>>,
}

/// Sends `states`; a service manager that went away is no reason to stop.
fn send(states: &[NotifyState]) {
    if let Err(e) = sd_notify::notify(states) {
        tracing::debug!("sd_notify: {e}");
    }
}

impl Notifier {
    /// For a system of `components`; with the service manager's watchdog
    /// on, pings it every half period while `roster` shows the event loop
    /// turning (which `heartbeat` makes it do at least that often).
    pub fn start(components: usize, roster: Arc<Roster>) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let pinger = sd_notify::watchdog_enabled().map(|period| {
            let half = period / 2;
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut seen = roster.loop_turns();
                let mut stalls = Stalls::default();
                while !stop.load(Ordering::SeqCst) {
                    std::thread::sleep(half);
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    let now = roster.loop_turns();
                    // A loop that has not turned is hung, and so is a
                    // serving thread (a vault's, the output relay, the
                    // control socket's) that has not turned for a whole
                    // period (four of its heartbeats): no ping, and the
                    // service manager restarts the supervisor.
                    let stalled =
                        stalls.stalled(roster.thread_turn_counts(), period, "no watchdog ping");
                    if now != seen && !stalled {
                        send(&[NotifyState::Watchdog]);
                    }
                    seen = now;
                }
            })
        });
        Self {
            components,
            started: 0,
            reboots: 0,
            stop,
            pinger,
        }
    }

    /// How often the event loop must turn, if the service manager set a
    /// watchdog period: a quarter of it, so that it turns at least twice
    /// between two looks of the pinger.
    pub fn heartbeat() -> Option<Duration> {
        sd_notify::watchdog_enabled().map(|d| d / 4)
    }

    pub fn on(&mut self, e: &Event) {
        match e {
            Event::Started { .. } => {
                self.started += 1;
                if self.started == self.components {
                    let status = format!("{} components serving", self.components);
                    send(&[NotifyState::Ready, NotifyState::Status(&status)]);
                }
            }
            Event::Rebooted {
                component,
                epoch,
                took,
                ..
            } => {
                self.reboots += 1;
                let status = format!(
                    "{component} rebooted in {} µs (epoch {epoch}); {} reboots so far",
                    took.as_micros(),
                    self.reboots
                );
                send(&[NotifyState::Status(&status)]);
            }
            Event::GaveUp {
                component, reason, ..
            } => {
                let status = format!("{component} given up: {reason}");
                send(&[NotifyState::Status(&status)]);
            }
            _ => {}
        }
    }
}

impl Drop for Notifier {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.pinger.take() {
            let _ = t.join();
        }
        send(&[NotifyState::Stopping]);
    }
}

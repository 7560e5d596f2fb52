//! netd's connections and who holds each: the hand-overs between workers,
//! the watch and the ready queue, under one lock.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::conn::{Entry, Holder, Kept, Slot, State};
use crate::watch::Watch;

/// How long a connection of a dead client waits for a byte before netd
/// closes it (its client's own idle timeout died with it).
pub const ORPHAN_IDLE_MS: u32 = 5000;

#[derive(Default)]
pub struct Table {
    pub conns: HashMap<u64, Slot>,
    /// Deaths seen per client, so an `accept` outlived by its caller hands nothing to it.
    pub deaths: HashMap<u32, u64>,
    /// The `last` each worker passed to `accept`, per (client, worker).
    pub last: HashMap<(u32, u32), u64>,
    /// Closed connections, drained until the peer closes (or a timeout
    /// passes), so that late bytes do not make the kernel reset them and
    /// drop the last response.
    pub lingering: Vec<(Arc<Entry>, Instant)>,
    /// Connections in state `Ready`, oldest first (ids of connections
    /// that left that state meanwhile are skipped).
    ready: VecDeque<u64>,
    /// A thread serving `accept` waits on the watch.
    pub leading: bool,
}

impl Table {
    pub fn deaths_of(&self, client: u32) -> u64 {
        self.deaths.get(&client).copied().unwrap_or(0)
    }

    /// A connection restored from the vault that a dead incarnation had
    /// accepted for this worker but never reported (an id above its `last`).
    pub fn unreported(&mut self, client: u32, worker: u32, last: u64) -> Option<u64> {
        let me = Holder::Worker { client, worker };
        let id = self
            .conns
            .iter()
            .filter(|(id, s)| {
                matches!(s.state, State::Restored(_)) && s.kept.holder == me && **id > last
            })
            .map(|(id, _)| *id)
            .min()?;
        let deaths = self.deaths_of(client);
        let slot = self.conns.get_mut(&id).expect("present");
        slot.state = State::Delivered;
        slot.entry.deaths.store(deaths, Ordering::SeqCst);
        Some(id)
    }

    /// The oldest ready connection of `client`, taken off the queue.
    pub fn take_ready(&mut self, client: u32) -> Option<u64> {
        let conns = &self.conns;
        self.ready
            .retain(|id| conns.get(id).is_some_and(|s| s.state == State::Ready));
        let at = self
            .ready
            .iter()
            .position(|id| self.conns[id].kept.holder.client() == client)?;
        self.ready.remove(at)
    }

    /// Hands `id` to a worker; what the vault must now record with it.
    pub fn deliver(&mut self, id: u64, client: u32, worker: u32) -> Kept {
        let deaths = self.deaths_of(client);
        let slot = self.conns.get_mut(&id).expect("present");
        slot.state = State::Delivered;
        slot.kept.holder = Holder::Worker { client, worker };
        slot.entry.deaths.store(deaths, Ordering::SeqCst);
        slot.kept
    }

    /// Puts a connection into the ready queue if more than `skip` bytes
    /// are queued or its peer has closed (`closed`), else into the watch.
    pub fn watch_or_ready(&mut self, id: u64, skip: u64, closed: bool, watch: &Watch) -> bool {
        let Some(slot) = self.conns.get_mut(&id) else {
            return false;
        };
        let ready = closed
            || rustix::io::ioctl_fionread(&slot.entry.fd).map_or(true, |queued| queued > skip);
        if ready {
            if matches!(slot.state, State::Watched { .. }) {
                watch.remove(&slot.entry.fd);
            }
            slot.state = State::Ready;
            self.ready.push_back(id);
        } else if !matches!(slot.state, State::Watched { .. }) {
            slot.state = State::Watched {
                since: Instant::now(),
                skip,
            };
            watch.add(id, &slot.entry.fd);
        }
        ready
    }

    /// A watched connection has new bytes, or its peer closed: ready if
    /// they are more than its client saw.
    pub fn woken(&mut self, id: u64, closed: bool, watch: &Watch) -> bool {
        match self.conns.get(&id).map(|s| s.state) {
            Some(State::Watched { skip, .. }) => self.watch_or_ready(id, skip, closed, watch),
            _ => false,
        }
    }

    /// Takes a connection off the watch and the ready queue: a client
    /// claims it again (re-adopting it after netd's reboot).
    pub fn claim(&mut self, id: u64, watch: &Watch) -> bool {
        let Some(slot) = self.conns.get_mut(&id) else {
            return false;
        };
        if let State::Watched { .. } = slot.state {
            watch.remove(&slot.entry.fd);
        }
        slot.state = State::Delivered;
        true
    }

    /// Removes watched connections without a byte for their idle time.
    pub fn expired(&mut self, watch: &Watch) -> Vec<(u64, Slot)> {
        let now = Instant::now();
        let ids: Vec<u64> = self
            .conns
            .iter()
            .filter(|(_, s)| match (s.state, s.kept.holder) {
                (State::Watched { since, .. }, Holder::Parked { idle_ms, .. }) => {
                    now.duration_since(since) > Duration::from_millis(u64::from(idle_ms))
                }
                _ => false,
            })
            .map(|(id, _)| *id)
            .collect();
        ids.into_iter()
            .filter_map(|id| {
                let slot = self.conns.remove(&id)?;
                watch.remove(&slot.entry.fd);
                Some((id, slot))
            })
            .collect()
    }

    /// Client `client` died: its workers' connections go to the watch, to
    /// be handed to its successor once they have bytes (those with a
    /// request not answered have them already) with offsets rebased to
    /// where that request began.
    pub fn client_died(&mut self, client: u32, watch: &Watch) {
        let deaths = {
            let d = self.deaths.entry(client).or_default();
            *d += 1;
            *d
        };
        self.last.retain(|(c, _), _| *c != client);
        let orphans: Vec<u64> = self
            .conns
            .iter()
            .filter(|(_, s)| {
                matches!(s.state, State::Delivered | State::Restored(_))
                    && matches!(s.kept.holder, Holder::Worker { client: c, .. } if c == client)
                    && s.entry.deaths.load(Ordering::SeqCst) < deaths
            })
            .map(|(id, _)| *id)
            .collect();
        for id in orphans {
            let slot = self.conns.get_mut(&id).expect("present");
            slot.kept.holder = Holder::Parked {
                client,
                idle_ms: ORPHAN_IDLE_MS,
            };
            slot.entry.rebase.store(true, Ordering::SeqCst);
            // What the dead client saw is not the successor's to skip.
            self.watch_or_ready(id, 0, false, watch);
        }
    }

    /// Connections restored from the vault that nobody claimed within
    /// `unclaimed`, though their worker has since accepted past them:
    /// their `close` died with the previous incarnation.
    pub fn unclaimed(&mut self, unclaimed: Duration) -> Vec<(u64, Slot)> {
        let ids: Vec<u64> = self
            .conns
            .iter()
            .filter(|(id, s)| match (s.state, s.kept.holder) {
                (State::Restored(since), Holder::Worker { client, worker }) => {
                    since.elapsed() > unclaimed
                        && self.last.get(&(client, worker)).is_some_and(|l| l >= id)
                }
                _ => false,
            })
            .map(|(id, _)| *id)
            .collect();
        ids.into_iter()
            .filter_map(|id| Some((id, self.conns.remove(&id)?)))
            .collect()
    }
}

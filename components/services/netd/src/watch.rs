//! The readiness netd waits for: the listener (a connection to accept) and
//! parked connections (bytes their client has not seen, or the peer's
//! close), in one epoll set that one thread at a time waits on (the
//! leader of the threads serving `accept`), so a new connection wakes one
//! thread, not one per worker.
//!
//! Parked connections are registered edge-triggered: bytes a client has
//! seen but not answered stay in the receive queue (netd reads with
//! `MSG_PEEK`), so the socket is readable all along; each arrival of new
//! bytes is an edge, after which the caller compares the queue's length
//! with what the client has seen.

use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::time::Duration;

use rustix::event::epoll;

/// The listener's token; connection ids start at 1.
const LISTENER: u64 = 0;

/// What woke the waiting thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// A connection waits to be accepted.
    Listener,
    /// Connection `id` has new bytes, or `closed` (the peer's end, or an error).
    Conn { id: u64, closed: bool },
}

pub struct Watch {
    epoll: OwnedFd,
}

impl Watch {
    pub fn new(listener: impl AsFd) -> rustix::io::Result<Self> {
        let epoll = epoll::create(epoll::CreateFlags::CLOEXEC)?;
        epoll::add(
            &epoll,
            listener,
            epoll::EventData::new_u64(LISTENER),
            epoll::EventFlags::IN,
        )?;
        Ok(Self { epoll })
    }

    /// Watches connection `id` for new bytes and its peer's close.
    pub fn add(&self, id: u64, fd: impl AsFd) {
        let flags = epoll::EventFlags::IN | epoll::EventFlags::RDHUP | epoll::EventFlags::ET;
        if let Err(e) = epoll::add(&self.epoll, fd, epoll::EventData::new_u64(id), flags) {
            tracing::warn!(id, "watching a connection: {e}");
        }
    }

    /// Stops watching `fd`. Required before closing it: the vault holds a
    /// duplicate, so closing netd's descriptor alone leaves it registered.
    pub fn remove(&self, fd: impl AsFd) {
        let _ = epoll::delete(&self.epoll, fd);
    }

    /// Waits up to `timeout` for readiness.
    pub fn wait(&self, timeout: Duration) -> Vec<Event> {
        let mut buf = [MaybeUninit::<epoll::Event>::uninit(); 64];
        let timeout = rustix::time::Timespec {
            tv_sec: timeout.as_secs() as i64,
            tv_nsec: i64::from(timeout.subsec_nanos()),
        };
        let events = match epoll::wait(&self.epoll, &mut buf, Some(&timeout)) {
            Ok((events, _)) => events,
            Err(e) => {
                if e != rustix::io::Errno::INTR {
                    tracing::warn!("epoll: {e}");
                }
                return Vec::new();
            }
        };
        let closed = epoll::EventFlags::RDHUP | epoll::EventFlags::HUP | epoll::EventFlags::ERR;
        events
            .iter()
            .map(|e| {
                let flags = e.flags;
                match e.data.u64() {
                    LISTENER => Event::Listener,
                    id => Event::Conn {
                        id,
                        closed: flags.intersects(closed),
                    },
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn pair() -> (
        std::net::TcpListener,
        std::net::TcpStream,
        std::net::TcpStream,
    ) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        (l, c, s)
    }

    #[test]
    fn each_arrival_is_an_edge_though_older_bytes_stay_queued() {
        let (l, mut client, server) = pair();
        let w = Watch::new(&l).unwrap();
        client.write_all(b"GET").unwrap();
        w.add(7, &server);
        // Registration reports the bytes already there, once.
        let first = w.wait(Duration::from_secs(5));
        assert_eq!(
            first,
            vec![Event::Conn {
                id: 7,
                closed: false
            }]
        );
        assert!(w.wait(Duration::from_millis(50)).is_empty());
        client.write_all(b" /").unwrap();
        assert_eq!(
            w.wait(Duration::from_secs(5)),
            vec![Event::Conn {
                id: 7,
                closed: false
            }]
        );
        drop(client);
        assert_eq!(
            w.wait(Duration::from_secs(5)),
            vec![Event::Conn {
                id: 7,
                closed: true
            }]
        );
        w.remove(&server);
        let _c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        assert_eq!(w.wait(Duration::from_secs(5)), vec![Event::Listener]);
    }
}

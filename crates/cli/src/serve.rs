//! Serving a listening socket of `kintsugi run` (the control socket, the
//! metrics endpoint): one thread accepts, and each connection is served on
//! a thread of its own, at most [`MAX_SERVED`] at once (a connection
//! beyond them is turned away at once), so that a client slow to send, or
//! one that sends nothing until its read timeout, holds no one else's
//! request. The accepting thread ends when the [`Server`] is dropped; it
//! counts its turns for the keeper's heartbeat (`kintsugi_supervisor::Turns`).

use std::io;
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kintsugi_supervisor::Turns;

/// Connections served at once.
pub const MAX_SERVED: usize = 16;

/// How often the accepting thread looks at its stop flag.
const POLL: Duration = Duration::from_millis(100);

const POLL_TS: rustix::time::Timespec = rustix::time::Timespec {
    tv_sec: 0,
    tv_nsec: POLL.as_nanos() as i64,
};

/// A listening socket whose accepted connections are served in blocking mode.
pub trait Listen: AsFd + Send + 'static {
    type Conn: Send + 'static;
    /// The next connection, if one is waiting (the listener is non-blocking).
    fn next(&self) -> io::Result<Self::Conn>;
}

impl Listen for UnixListener {
    type Conn = UnixStream;
    fn next(&self) -> io::Result<UnixStream> {
        let (conn, _) = self.accept()?;
        conn.set_nonblocking(false)?;
        Ok(conn)
    }
}

impl Listen for std::net::TcpListener {
    type Conn = std::net::TcpStream;
    fn next(&self) -> io::Result<std::net::TcpStream> {
        let (conn, _) = self.accept()?;
        conn.set_nonblocking(false)?;
        Ok(conn)
    }
}

/// The accepting thread; stopped and joined when dropped.
pub struct Server {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Server {
    /// Serves `listener`'s connections with `serve`, each on a thread
    /// named `{name}-request`; `busy` answers one beyond [`MAX_SERVED`].
    /// The accepting thread counts a turn at least every `turns.timeout()`.
    pub fn start<L: Listen>(
        name: &str,
        listener: L,
        turns: Turns,
        serve: impl Fn(L::Conn) + Send + Sync + 'static,
        busy: impl Fn(L::Conn) + Send + 'static,
    ) -> io::Result<Self> {
        listener_nonblocking(&listener)?;
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        let serve = Arc::new(serve);
        let request = format!("{name}-request");
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                let serving = Arc::new(AtomicUsize::new(0));
                // Its stop flag at least every POLL; a turn at least as often as asked.
                let ts = turns
                    .timeout()
                    .filter(|t| t.tv_sec == 0 && t.tv_nsec < POLL_TS.tv_nsec)
                    .unwrap_or(POLL_TS);
                while !stopping.load(Ordering::SeqCst) {
                    turns.turned();
                    match listener.next() {
                        Ok(conn) => {
                            if serving.fetch_add(1, Ordering::SeqCst) >= MAX_SERVED {
                                serving.fetch_sub(1, Ordering::SeqCst);
                                busy(conn);
                                continue;
                            }
                            let (serve, count) = (serve.clone(), serving.clone());
                            let spawned = std::thread::Builder::new().name(request.clone()).spawn(
                                move || {
                                    serve(conn);
                                    count.fetch_sub(1, Ordering::SeqCst);
                                },
                            );
                            if spawned.is_err() {
                                serving.fetch_sub(1, Ordering::SeqCst);
                            }
                        }
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                            let mut fds = [rustix::event::PollFd::new(
                                &listener,
                                rustix::event::PollFlags::IN,
                            )];
                            let _ = rustix::event::poll(&mut fds, Some(&ts));
                        }
                        Err(_) => std::thread::sleep(POLL),
                    }
                }
            })?;
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Makes the listener non-blocking, so that its thread sees its stop flag.
fn listener_nonblocking(listener: &impl AsFd) -> io::Result<()> {
    let flags = rustix::fs::fcntl_getfl(listener)?;
    rustix::fs::fcntl_setfl(listener, flags | rustix::fs::OFlags::NONBLOCK)?;
    Ok(())
}

//! Lock leases: the threads of one component pass a lock of the lock server
//! among themselves without calling it, for as long as no other component
//! wants the lock.
//!
//! This is the issue-13 fast path "where the server need not run (an
//! uncontended lock)", after the lock caching of distributed lock managers
//! (a lock stays with the node that last used it until another node asks).
//! The seeds' web server takes a lock of the lock component around every
//! cache lookup; with a lease, httpd still owns that lock through the lock
//! server, which still arbitrates between components, but a request costs no
//! call and no wake-up of the server while httpd alone uses the lock.
//!
//! ```text
//!  Leased::take: local mutex ─▶ leased? ──no──▶ lock.lease (waits like take)
//!                                  │yes
//!                                  ▼
//!                           critical section
//!                                  ▼
//!  Held::drop: wanted? ──yes──▶ lock.unlease ─▶ unlock the local mutex
//!
//!  lock server: someone else's take/lease finds the lease
//!    └─ upcall LEASE_WANTED(lock) ─▶ handler: mark wanted, tell the returner
//!                                     returner thread: if no thread is inside,
//!                                     lock.unlease
//! ```
//!
//! The handler never calls the server itself: the edge's upcall mailbox
//! stays busy until a handler returns, and a rebooted server's eager
//! recovery needs it. Nothing waits for the local mutex but the component's
//! own threads: a wanted lease that a thread holds is given back when that
//! thread lets go, or by the thread that takes the local mutex next, which
//! then leases the lock again behind the component that wanted it.
//!
//! Recovery needs nothing of its own. The lease lives in the lock server's
//! durable arena and outlives its reboots; `lease` and `unlease` re-issued
//! by the client stub find the lease taken or given back and succeed; a
//! request to give it back that a reboot cut short is made again by the
//! waiter's re-issued `take`; the death of the leaseholding component
//! releases its lease like any lock it held. A dropped [`Leased`] gives its
//! lease back.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use kintsugi_runtime::{upcall, CallError};

use crate::lock;

/// The leases of one connection to the lock server.
pub struct Leases {
    client: Arc<lock::Client>,
    by_lock: Arc<Mutex<HashMap<u64, Weak<Lease>>>>,
}

/// One lock that this component's threads take by lease.
pub struct Leased {
    lease: Arc<Lease>,
}

/// Proof that the calling thread is inside the lock's critical section.
pub struct Held<'a> {
    lease: &'a Lease,
    leased: Option<MutexGuard<'a, bool>>,
}

struct Lease {
    client: Arc<lock::Client>,
    lock: lock::Lock,
    /// The local mutex; true while the component holds the lease.
    leased: Mutex<bool>,
    /// Set when the server asked for the lease.
    wanted: AtomicBool,
    given_back: AtomicU64,
}

fn guard<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Leases {
    /// Takes over `client`'s `LEASE_WANTED` upcalls (one `Leases` per
    /// connection) and starts the thread that gives wanted leases back.
    pub fn new(client: lock::Client) -> std::io::Result<Self> {
        let by_lock: Arc<Mutex<HashMap<u64, Weak<Lease>>>> = Arc::default();
        let (tx, rx) = mpsc::channel();
        let returner = Arc::downgrade(&by_lock);
        std::thread::Builder::new()
            .name("lock-leases".into())
            .spawn(move || give_back_wanted(&rx, &returner))?;
        let wanted = by_lock.clone();
        client.connection().on_upcall(
            upcall::LEASE_WANTED,
            Arc::new(move |[l, _, _]: [u64; 3]| {
                if let Some(lease) = guard(&wanted).get(&l).and_then(Weak::upgrade) {
                    lease.wanted.store(true, SeqCst);
                    let _ = tx.send(l);
                }
                0
            }),
        );
        Ok(Self {
            client: Arc::new(client),
            by_lock,
        })
    }

    /// The connection's client stub, for calls other than leases.
    pub fn client(&self) -> &lock::Client {
        &self.client
    }

    /// Lock `l` (allocated by this client), to be taken by lease. The
    /// component holds no lease until a thread first takes it.
    pub fn lease(&self, l: lock::Lock) -> Leased {
        let lease = Arc::new(Lease {
            client: self.client.clone(),
            lock: l,
            leased: Mutex::new(false),
            wanted: AtomicBool::new(false),
            given_back: AtomicU64::new(0),
        });
        guard(&self.by_lock).insert(l.0, Arc::downgrade(&lease));
        Leased { lease }
    }
}

/// The returner thread: gives back each lease the server asks for, unless
/// a thread is inside (that thread then does).
fn give_back_wanted(rx: &Receiver<u64>, by_lock: &Weak<Mutex<HashMap<u64, Weak<Lease>>>>) {
    for l in rx {
        let Some(by_lock) = by_lock.upgrade() else {
            return;
        };
        let lease = guard(&by_lock).get(&l).and_then(Weak::upgrade);
        if let Some(lease) = lease {
            lease.try_give_back();
        }
    }
}

impl Lease {
    /// Gives the lease back if the server asked for it; under the local mutex.
    fn give_back_if_wanted(&self, leased: &mut bool) {
        if self.wanted.swap(false, SeqCst) && self.give_back(leased) {
            self.given_back.fetch_add(1, SeqCst);
        }
    }

    /// Gives the lease back if the component holds it; under the local
    /// mutex. Whether it was held.
    fn give_back(&self, leased: &mut bool) -> bool {
        if !*leased {
            return false;
        }
        if let Err(e) = self.client.unlease(self.lock) {
            // Leased again at the next take (a lease still held is no error).
            tracing::warn!(lock = self.lock.0, "unlease: {e}");
        }
        *leased = false;
        true
    }

    /// Gives the lease back if it is wanted and no thread is inside.
    fn try_give_back(&self) {
        if self.wanted.load(SeqCst) {
            if let Ok(mut leased) = self.leased.try_lock() {
                self.give_back_if_wanted(&mut leased);
            }
        }
    }
}

impl Leased {
    /// Enters the critical section: waits for the other threads of this
    /// component, then, unless the component holds the lease, for the lock
    /// server to grant it.
    pub fn take(&self) -> Result<Held<'_>, CallError<lock::Error>> {
        let lease = &*self.lease;
        let mut leased = guard(&lease.leased);
        // Asked for meanwhile: the component that asked goes first.
        lease.give_back_if_wanted(&mut leased);
        if !*leased {
            lease.client.lease(lease.lock)?;
            *leased = true;
        }
        Ok(Held {
            lease,
            leased: Some(leased),
        })
    }

    /// How often the lease was given back because the server asked.
    pub fn given_back(&self) -> u64 {
        self.lease.given_back.load(SeqCst)
    }
}

/// A component done with a lock gives its lease back: a waiter must not
/// depend on the supervisor seeing the component exit (while the system
/// stops, it reaps one component at a time, and a client blocked on a lease
/// of an exited component waited out its whole grace; CI, seed 943176).
impl Drop for Leased {
    fn drop(&mut self) {
        self.lease.give_back(&mut guard(&self.lease.leased));
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        if let Some(mut leased) = self.leased.take() {
            self.lease.give_back_if_wanted(&mut leased);
        }
        // Asked for after the look above, while the returner found the
        // mutex held: nobody else would give it back.
        self.lease.try_give_back();
    }
}

//! One component under supervision: what is fixed for its whole life (its
//! channels and durable memory, handed to every zygote it will ever have),
//! its pristine image, its [`Phase`] and its [`Standby`] pipeline.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::time::Instant;

use kintsugi_runtime::abi::boot::{BootInfo, ProvidedEdge, UsedEdge, ABI};
use kintsugi_runtime::abi::channel::Edge;
use kintsugi_runtime::abi::journal::JournalRegion;
use kintsugi_runtime::abi::shm::Region;
use kintsugi_runtime::abi::zygote;
use kintsugi_system::ComponentSpec;

use crate::activation::Attempt;
use crate::policy::RestartWindow;
use crate::process::Proc;
use crate::watch::Watch;

/// A standby or live incarnation.
#[derive(Debug)]
pub(crate) struct Incarnation {
    pub proc: Proc,
    pub generation: u32,
    /// The control block's lifeline bank its threads registered in.
    pub bank: usize,
}

/// Where a component's active incarnation stands.
pub(crate) enum Phase {
    /// Between incarnations: booting, or rebooting after a death.
    Down,
    /// Running; its lifelines are watched unless lifelines are off.
    Live {
        inc: Incarnation,
        watch: Option<Watch>,
    },
    /// A new incarnation initializing after a restart, slower than a
    /// restart waits for: the event loop checks it until `deadline`.
    Starting {
        inc: Incarnation,
        deadline: Instant,
        attempt: Attempt,
    },
    /// It will not run again (finished, or given up): its clients' calls fail.
    Retired,
}

/// Where the next incarnation stands.
#[derive(Debug)]
enum Spare {
    None,
    /// Asked of the zygote; its reply is not read yet.
    Requested {
        generation: u32,
        bank: usize,
    },
    /// Forked and parked, ready to activate.
    Ready(Incarnation),
}

/// The warm-standby pipeline: which generation and lifeline bank the next
/// fork gets, and where that fork stands. A standby always takes the bank
/// the live incarnation does not use, so that the live one's lifelines stay
/// readable while the standby registers its own.
#[derive(Debug)]
pub(crate) struct Standby {
    spare: Spare,
    next_generation: u32,
    live_bank: usize,
}

impl Standby {
    pub(crate) fn new() -> Self {
        Self {
            spare: Spare::None,
            next_generation: 1,
            live_bank: 1,
        }
    }

    /// The fork to ask the zygote for, unless one is asked already or parked.
    pub(crate) fn request(&mut self) -> Option<zygote::Command> {
        if !matches!(self.spare, Spare::None) {
            return None;
        }
        let generation = self.next_generation;
        self.next_generation += 1;
        let bank = 1 - self.live_bank;
        self.spare = Spare::Requested { generation, bank };
        Some(zygote::Command::Fork {
            generation,
            bank: bank as u8,
        })
    }

    /// Whether a fork was asked for and its reply is not read yet.
    pub(crate) fn pending(&self) -> bool {
        matches!(self.spare, Spare::Requested { .. })
    }

    /// Matches the zygote's reply with the pending request: the generation
    /// and bank of the incarnation it forked.
    pub(crate) fn answer(&mut self, forked: zygote::Forked) -> Result<(u32, usize), String> {
        let Spare::Requested { generation, bank } = self.spare else {
            return Err("zygote answered no request".into());
        };
        self.spare = Spare::None;
        if forked.generation != generation {
            return Err(format!(
                "zygote answered generation {}, expected {generation}",
                forked.generation
            ));
        }
        Ok((generation, bank))
    }

    /// Parks a forked incarnation until it is needed.
    pub(crate) fn park(&mut self, inc: Incarnation) {
        debug_assert!(matches!(self.spare, Spare::None), "{:?}", self.spare);
        self.spare = Spare::Ready(inc);
    }

    /// The parked incarnation, if there is one.
    pub(crate) fn take(&mut self) -> Option<Incarnation> {
        match std::mem::replace(&mut self.spare, Spare::None) {
            Spare::Ready(inc) => Some(inc),
            other => {
                self.spare = other;
                None
            }
        }
    }

    /// Whether `pid` is the parked incarnation.
    pub(crate) fn holds(&self, pid: u32) -> bool {
        matches!(&self.spare, Spare::Ready(inc) if inc.proc.pid == pid)
    }

    /// An incarnation of `bank` went live.
    pub(crate) fn went_live(&mut self, bank: usize) {
        self.live_bank = bank;
    }

    /// Forgets the pipeline (the zygote is replaced, or the system stops):
    /// the parked incarnation to kill, and whether a reply was still pending.
    pub(crate) fn abandon(&mut self) -> (Option<Incarnation>, bool) {
        match std::mem::replace(&mut self.spare, Spare::None) {
            Spare::None => (None, false),
            Spare::Requested { .. } => (None, true),
            Spare::Ready(inc) => (Some(inc), false),
        }
    }
}

/// An edge a component serves.
pub(crate) struct Served {
    pub client: String,
    pub client_id: u32,
    pub interface: String,
    pub edge: Arc<Edge>,
    /// Descriptors the client had rebuilt at the last report.
    pub recovered_seen: u64,
}

/// An edge a component calls on.
pub(crate) struct Used {
    pub interface: String,
    pub server: String,
    pub server_id: u32,
    pub edge: Arc<Edge>,
    /// The server's pool, if it has one.
    pub pool: Option<Arc<Region>>,
    /// Whether the server is checkpoint-recovered.
    pub replayed: bool,
}

/// A component's durable memory (`arena_kib`, `pool_kib`): created once, when
/// the system starts, and handed to each of its zygotes, so that every
/// incarnation maps the same pages.
pub(crate) struct Durable {
    pub arena: Option<Region>,
    pub pool: Option<Arc<Region>>,
    /// The request log of a checkpoint-recovered component (`journal_kib`).
    pub journal: Option<Arc<JournalRegion>>,
}

impl Durable {
    pub(crate) fn create(spec: &ComponentSpec) -> std::io::Result<Self> {
        let region = |what: &str, kib: u64| -> std::io::Result<Option<Region>> {
            if kib == 0 {
                return Ok(None);
            }
            let name = format!("kintsugi:{}:{what}", spec.name);
            Region::create(&name, kib as usize * 1024).map(Some)
        };
        Ok(Self {
            arena: region("arena", spec.arena_kib)?,
            pool: region("pool", spec.pool_kib)?.map(Arc::new),
            journal: match spec.journal_kib {
                0 => None,
                kib => Some(Arc::new(JournalRegion::create(
                    &format!("kintsugi:{}:journal", spec.name),
                    kib as usize * 1024,
                )?)),
            },
        })
    }
}

/// What a component keeps for its whole life and hands to every zygote:
/// its control block, its ends of the zygote and vault sockets, its edges
/// and its durable memory.
pub(crate) struct Wiring {
    pub control: Arc<Region>,
    pub zygote_peer: OwnedFd,
    pub vault_peer: OwnedFd,
    pub served: Vec<Served>,
    pub used: Vec<Used>,
    pub durable: Durable,
    /// Its zygotes' (and so its incarnations') stdout and stderr.
    pub output: crate::output::Pipes,
    /// The highest priority its processes may take (see
    /// [`crate::process::Confinement::ceiling`]).
    pub ceiling: kintsugi_runtime::priority::Priority,
}

/// The descriptor number of a region the supervisor holds, as passed at exec.
fn raw_fd(region: Option<&Region>) -> Option<RawFd> {
    region.map(|r| r.fd().as_raw_fd())
}

impl Wiring {
    /// What a new zygote of `spec` is told at exec, and the descriptors it inherits.
    pub(crate) fn boot_info(
        &self,
        spec: &ComponentSpec,
        wide: SystemWide,
    ) -> (BootInfo, Vec<RawFd>) {
        let provides = self
            .served
            .iter()
            .map(|s| ProvidedEdge {
                interface: s.interface.clone(),
                client: s.client.clone(),
                client_id: s.client_id,
                fd: s.edge.region().fd().as_raw_fd(),
            })
            .collect::<Vec<_>>();
        let uses = self
            .used
            .iter()
            .map(|u| UsedEdge {
                interface: u.interface.clone(),
                server: u.server.clone(),
                server_id: u.server_id,
                fd: u.edge.region().fd().as_raw_fd(),
                pool_fd: raw_fd(u.pool.as_deref()),
                replayed: u.replayed,
            })
            .collect::<Vec<_>>();
        let boot = BootInfo {
            abi: ABI,
            component: spec.name.clone(),
            id: spec.id,
            supervisor: std::process::id(),
            control_fd: self.control.fd().as_raw_fd(),
            zygote_fd: self.zygote_peer.as_raw_fd(),
            vault_fd: self.vault_peer.as_raw_fd(),
            provides,
            uses,
            config: spec.config.clone(),
            recovery: spec.recovery.as_str().to_string(),
            priority: spec.priority,
            realtime: spec.realtime,
            arena_fd: raw_fd(self.durable.arena.as_ref()),
            pool_fd: raw_fd(self.durable.pool.as_deref()),
            journal_fd: raw_fd(self.durable.journal.as_deref().map(JournalRegion::region)),
            watchdog: spec.watchdog.as_ref().map_or(wide.watchdog, |w| w.enabled),
            spin: wide.spin,
            vault_fds: spec.vault_quota.fds,
            syscalls: spec.syscalls.iter().map(|c| c.id()).collect(),
            read_vault_ahead: spec.checkpoint.is_none() && self.durable.journal.is_none(),
        };
        let mut pass = vec![boot.control_fd, boot.zygote_fd, boot.vault_fd];
        pass.extend(boot.provides.iter().map(|p| p.fd));
        pass.extend(boot.uses.iter().map(|u| u.fd));
        pass.extend(
            boot.arena_fd
                .iter()
                .chain(&boot.pool_fd)
                .chain(&boot.journal_fd),
        );
        pass.extend(boot.uses.iter().filter_map(|u| u.pool_fd));
        (boot, pass)
    }
}

/// What every component of a system is told at boot.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct SystemWide {
    /// Whether components publish stretches for the watchdog (the
    /// system's `[watchdog]`; a component's own `watchdog` decides for it).
    pub watchdog: bool,
    /// When their waiters spin before they sleep.
    pub spin: kintsugi_runtime::futex::Spin,
}

/// A component's pristine image: the exec'd process that forks its
/// incarnations, and the supervisor's end of its socket.
pub(crate) struct Zygote {
    pub proc: Proc,
    pub sock: OwnedFd,
}

/// Which of a component's processes a pid is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    Zygote,
    Live,
    Standby,
    /// Found dead by its lifelines and rebooted already; index in `dying`.
    Dying(usize),
}

/// One component under supervision.
pub(crate) struct Managed {
    pub spec: ComponentSpec,
    pub wiring: Wiring,
    pub zygote: Zygote,
    pub phase: Phase,
    pub standby: Standby,
    /// Incarnations found dead by their lifelines, not yet reaped.
    pub dying: Vec<Proc>,
    pub epoch: u64,
    pub restarts: RestartWindow,
    /// Its live incarnation was killed because this other member of its
    /// restart group failed: its death, when the event loop sees it, is
    /// rebooted like any other but takes no one else with it, and not
    /// before that member's own restart.
    pub killed_for_group: Option<usize>,
}

impl Managed {
    pub(crate) fn live(&self) -> Option<&Incarnation> {
        match &self.phase {
            Phase::Live { inc, .. } => Some(inc),
            _ => None,
        }
    }

    /// The incarnation parked while it initializes, and its restart.
    pub(crate) fn take_starting(&mut self) -> Option<(Incarnation, Instant, Attempt)> {
        match std::mem::replace(&mut self.phase, Phase::Down) {
            Phase::Starting {
                inc,
                deadline,
                attempt,
            } => Some((inc, deadline, attempt)),
            other => {
                self.phase = other;
                None
            }
        }
    }

    /// The live incarnation, which is no longer live (it died).
    pub(crate) fn take_live(&mut self) -> Option<Incarnation> {
        match std::mem::replace(&mut self.phase, Phase::Down) {
            Phase::Live { inc, .. } => Some(inc),
            other => {
                self.phase = other;
                None
            }
        }
    }

    pub(crate) fn retired(&self) -> bool {
        matches!(self.phase, Phase::Retired)
    }

    /// The component will not run again: its clients' calls fail from now on.
    pub(crate) fn retire(&mut self) {
        self.phase = Phase::Retired;
        for s in &self.wiring.served {
            s.edge.server_gone();
        }
    }

    pub(crate) fn role_of(&self, pid: u32) -> Option<Role> {
        if self.zygote.proc.pid == pid {
            Some(Role::Zygote)
        } else if self.live().is_some_and(|l| l.proc.pid == pid) {
            Some(Role::Live)
        } else if self.standby.holds(pid) {
            Some(Role::Standby)
        } else {
            self.dying
                .iter()
                .position(|p| p.pid == pid)
                .map(Role::Dying)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kintsugi_runtime::abi::zygote::{Command, Forked};

    #[test]
    fn one_fork_at_a_time_on_the_bank_the_live_incarnation_does_not_use() {
        let mut s = Standby::new();
        assert_eq!(
            s.request(),
            Some(Command::Fork {
                generation: 1,
                bank: 0
            })
        );
        assert!(s.pending());
        assert_eq!(s.request(), None, "one request at a time");
        assert_eq!(
            s.answer(Forked {
                generation: 1,
                pid: 7
            }),
            Ok((1, 0))
        );
        assert!(!s.pending());
        s.went_live(0);
        assert_eq!(
            s.request(),
            Some(Command::Fork {
                generation: 2,
                bank: 1
            })
        );
    }

    #[test]
    fn a_reply_must_answer_the_pending_request() {
        let mut s = Standby::new();
        assert!(
            s.answer(Forked {
                generation: 1,
                pid: 7
            })
            .is_err(),
            "nothing asked"
        );
        s.request().expect("asked");
        let err = s
            .answer(Forked {
                generation: 9,
                pid: 7,
            })
            .unwrap_err();
        assert!(err.contains("generation 9, expected 1"), "{err}");
        assert!(!s.pending(), "a wrong answer ends the request");
        assert_eq!(
            s.request(),
            Some(Command::Fork {
                generation: 2,
                bank: 0
            })
        );
    }

    #[test]
    fn abandoning_reports_a_pending_reply() {
        let mut s = Standby::new();
        assert!(matches!(s.abandon(), (None, false)));
        s.request().expect("asked");
        assert!(matches!(s.abandon(), (None, true)));
        assert!(s.take().is_none());
        assert!(s.request().is_some(), "a new request may follow");
    }
}

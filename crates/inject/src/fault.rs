//! The faults, and the seeded injector that puts them into a process.
//!
//! Register flips, thread-directed signals and (preferably) hangs go into a
//! thread caught executing user code: the injector samples the target's
//! threads every `tick`, seizes one the scheduler shows running, and keeps
//! it only if it stopped outside a system call (C3 flips registers at timer
//! ticks in whatever thread is running inside the component); otherwise it
//! lets it go and tries at the next tick, until `patience` runs out.

use std::fmt;
use std::time::{Duration, Instant};

use nix::libc::user_regs_struct;
use nix::sys::signal::Signal;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use crate::procfs::{area_mappings, mappings, resident_pages, threads, Area, Memory, PAGE};
use crate::stop::{Held, Stopped};
use crate::InjectError;

/// The x86-64 general-purpose registers a flip may hit: all sixteen but
/// the instruction pointer (not `eflags`, nor the segment registers).
pub const GPRS: [&str; 16] = [
    "rax", "rbx", "rcx", "rdx", "rsi", "rdi", "rbp", "rsp", "r8", "r9", "r10", "r11", "r12", "r13",
    "r14", "r15",
];

fn gpr(regs: &mut user_regs_struct, i: usize) -> &mut u64 {
    match i {
        0 => &mut regs.rax,
        1 => &mut regs.rbx,
        2 => &mut regs.rcx,
        3 => &mut regs.rdx,
        4 => &mut regs.rsi,
        5 => &mut regs.rdi,
        6 => &mut regs.rbp,
        7 => &mut regs.rsp,
        8 => &mut regs.r8,
        9 => &mut regs.r9,
        10 => &mut regs.r10,
        11 => &mut regs.r11,
        12 => &mut regs.r12,
        13 => &mut regs.r13,
        14 => &mut regs.r14,
        _ => &mut regs.r15,
    }
}

/// One fault.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    /// One random bit of one random register of [`GPRS`]; with
    /// `every_register`, one random bit in each of them (SuperGlue).
    Register { every_register: bool },
    /// One random bit of one random resident byte of the area.
    Memory(Area),
    /// A signal; all but SIGKILL are delivered to a thread caught in user
    /// code, as if its instruction had raised it. SIGKILL goes to the process.
    Signal(Signal),
    /// A thread held stopped (see [`Held`]).
    Hang,
    /// A thread stopped for this long, then let go.
    Delay(Duration),
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Fault::Register {
                every_register: false,
            } => write!(f, "register bit flip"),
            Fault::Register {
                every_register: true,
            } => write!(f, "bit flip in every register"),
            Fault::Memory(a) => write!(f, "{a} bit flip"),
            Fault::Signal(s) => write!(f, "{s}"),
            Fault::Hang => write!(f, "hang"),
            Fault::Delay(d) => write!(f, "delay of {} ms", d.as_millis()),
        }
    }
}

/// One flipped register bit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Flip {
    pub register: &'static str,
    pub bit: u8,
    pub before: u64,
}

/// What an injection did.
#[derive(Debug)]
pub enum Injection {
    Register {
        tid: u32,
        /// The instruction pointer it was stopped at.
        pc: u64,
        flips: Vec<Flip>,
    },
    Memory {
        area: Area,
        addr: u64,
        bit: u8,
        before: u8,
    },
    Signal {
        tid: Option<u32>,
        signal: Signal,
    },
    /// The held thread: keep it to keep the hang.
    Hang(Held),
    Delay {
        tid: u32,
        held: Duration,
    },
}

impl fmt::Display for Injection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Injection::Register { tid, pc, flips } => {
                write!(f, "thread {tid} at pc {pc:#x}: flipped")?;
                for x in flips {
                    write!(f, " {} bit {} ({:#x})", x.register, x.bit, x.before)?;
                }
                Ok(())
            }
            Injection::Memory {
                area,
                addr,
                bit,
                before,
            } => write!(
                f,
                "{area} byte {addr:#x}: flipped bit {bit} ({before:#04x} -> {:#04x})",
                before ^ (1 << bit)
            ),
            Injection::Signal {
                tid: Some(t),
                signal,
            } => write!(f, "{signal} delivered to thread {t}"),
            Injection::Signal { tid: None, signal } => write!(f, "{signal} sent to the process"),
            Injection::Hang(h) => write!(f, "thread {} held stopped", h.tid()),
            Injection::Delay { tid, held } => {
                write!(f, "thread {tid} stopped for {} ms", held.as_millis())
            }
        }
    }
}

/// Puts faults into processes; every choice it makes comes from its seed.
pub struct Injector {
    rng: StdRng,
    /// How often the target's threads are sampled for one executing user code.
    pub tick: Duration,
    /// How long to look for one before giving up.
    pub patience: Duration,
}

impl Injector {
    pub fn new(seed: u64) -> Self {
        Self {
            rng: StdRng::seed_from_u64(seed),
            tick: Duration::from_millis(1),
            patience: Duration::from_secs(2),
        }
    }

    /// The injector's generator, for choices made around its injections.
    pub fn rng(&mut self) -> &mut StdRng {
        &mut self.rng
    }

    pub fn inject(&mut self, pid: u32, fault: &Fault) -> Result<Injection, InjectError> {
        match fault {
            Fault::Register { every_register } => {
                let mut t = self.catch_running(pid)?;
                let (tid, pc) = (t.tid(), t.regs().rip);
                let chosen: Vec<usize> = match every_register {
                    true => (0..GPRS.len()).collect(),
                    false => vec![self.rng.gen_range(0..GPRS.len())],
                };
                let mut flips = Vec::new();
                for i in chosen {
                    let bit = self.rng.gen_range(0..64u8);
                    let r = gpr(t.regs_mut(), i);
                    flips.push(Flip {
                        register: GPRS[i],
                        bit,
                        before: *r,
                    });
                    *r ^= 1 << bit;
                }
                t.resume()?;
                Ok(Injection::Register { tid, pc, flips })
            }
            Fault::Memory(area) => self.flip_memory(pid, *area),
            Fault::Signal(Signal::SIGKILL) => {
                nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), Signal::SIGKILL)
                    .map_err(|_| InjectError::Gone(pid))?;
                Ok(Injection::Signal {
                    tid: None,
                    signal: Signal::SIGKILL,
                })
            }
            Fault::Signal(signal) => {
                let t = self.catch_running(pid)?;
                let tid = t.tid();
                t.resume_with(*signal)?;
                Ok(Injection::Signal {
                    tid: Some(tid),
                    signal: *signal,
                })
            }
            Fault::Hang => Ok(Injection::Hang(Held::new(self.catch_any(pid)?))),
            Fault::Delay(d) => {
                let t = self.catch_any(pid)?;
                let tid = t.tid();
                std::thread::sleep(*d);
                t.resume()?;
                Ok(Injection::Delay { tid, held: *d })
            }
        }
    }

    /// Stops a thread of `pid` that is executing user code.
    pub fn catch_running(&mut self, pid: u32) -> Result<Stopped, InjectError> {
        let deadline = Instant::now() + self.patience;
        loop {
            let running: Vec<u32> = threads(pid)?
                .into_iter()
                .filter(|t| t.state == 'R')
                .map(|t| t.tid)
                .collect();
            if let Some(&tid) = running.choose(&mut self.rng) {
                match Stopped::seize(pid, tid, self.patience) {
                    Ok(t) if t.in_user_code() => return Ok(t),
                    // In a system call: let it go, try at the next tick.
                    Ok(t) => drop(t),
                    // That thread ended meanwhile; the process may live on.
                    Err(InjectError::Gone(_)) => {}
                    Err(e) => return Err(e),
                }
            }
            if Instant::now() >= deadline {
                return Err(InjectError::NoRunningThread {
                    pid,
                    waited_ms: self.patience.as_millis() as u64,
                });
            }
            std::thread::sleep(self.tick);
        }
    }

    /// Stops a thread executing user code if one is found within a tenth
    /// of the patience, else any thread.
    fn catch_any(&mut self, pid: u32) -> Result<Stopped, InjectError> {
        let patience = self.patience;
        self.patience = patience / 10;
        let caught = self.catch_running(pid);
        self.patience = patience;
        match caught {
            Err(InjectError::NoRunningThread { .. }) => {
                let all = threads(pid)?;
                let t = all.choose(&mut self.rng).ok_or(InjectError::Gone(pid))?;
                Stopped::seize(pid, t.tid, patience)
            }
            other => other,
        }
    }

    fn flip_memory(&mut self, pid: u32, area: Area) -> Result<Injection, InjectError> {
        let mem = Memory::open(pid)?;
        let bit = self.rng.gen_range(0..8u8);
        let addr = match area {
            Area::Stack => {
                // Above a stopped thread's stack pointer: its live frames.
                let t = self.catch_any(pid)?;
                let sp = t.regs().rsp;
                let top = mappings(pid)?
                    .iter()
                    .find(|m| m.start <= sp && sp < m.end)
                    .map(|m| m.end.min(sp + 4096))
                    .ok_or(InjectError::NoMemory { pid, area })?;
                let addr = self.rng.gen_range(sp..top);
                // Flip while the thread is stopped, so it cannot race the write.
                let before = mem.read_u8(addr)?;
                mem.write_u8(addr, before ^ (1 << bit))?;
                t.resume()?;
                return Ok(Injection::Memory {
                    area,
                    addr,
                    bit,
                    before,
                });
            }
            _ => self.resident_byte(pid, area)?,
        };
        let before = mem.read_u8(addr)?;
        mem.write_u8(addr, before ^ (1 << bit))?;
        Ok(Injection::Memory {
            area,
            addr,
            bit,
            before,
        })
    }

    /// A random byte of a resident page of `area`, uniform over the resident
    /// pages of its mappings (drawing addresses at random and keeping the
    /// first resident one missed pages of sparse areas: thread stacks and
    /// allocator arenas reserve far more than they touch).
    fn resident_byte(&mut self, pid: u32, area: Area) -> Result<u64, InjectError> {
        let pages: Vec<u64> = area_mappings(pid, area)?
            .iter()
            .flat_map(|m| resident_pages(pid, m.start, m.end))
            .collect();
        if pages.is_empty() {
            return Err(InjectError::NoMemory { pid, area });
        }
        let page = pages[self.rng.gen_range(0..pages.len())];
        Ok(page + self.rng.gen_range(0..PAGE))
    }
}

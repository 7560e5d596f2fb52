//! What to inject, as command-line arguments: shared by `kintsugi inject`
//! and campaigns.

use std::time::Duration;

use clap::{Args, ValueEnum};
use kintsugi_inject::{Area, Fault, Injector};
use nix::sys::signal::Signal;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
    /// One random bit of one general-purpose register (not rip) of a thread in user code.
    Register,
    /// One random bit in each of the sixteen general-purpose registers (SuperGlue).
    EveryRegister,
    /// One random bit of a resident byte of the heap, a live stack or the binary's data.
    Memory,
    /// A crash signal to a thread in user code (SIGKILL: to the process).
    Signal,
    /// A thread held stopped until the component is rebooted.
    Hang,
    /// A thread stopped for --delay-ms, then let go.
    Delay,
}

/// What to inject; shared by `inject` and `campaign`.
#[derive(Args, Debug, Clone)]
pub struct FaultArgs {
    #[arg(long, value_enum, default_value = "register")]
    pub kind: Kind,
    /// For --kind memory: heap, stack or data.
    #[arg(long, default_value = "heap", value_parser = parse_area)]
    pub area: Area,
    /// For --kind signal: segv, bus, abrt, ill, fpe, term or kill.
    #[arg(long, default_value = "segv", value_parser = parse_signal)]
    pub signal: Signal,
    /// For --kind delay.
    #[arg(long, default_value_t = 100)]
    pub delay_ms: u64,
    /// How often the target's threads are sampled for one executing user
    /// code (the injector's tick), in µs.
    #[arg(long, default_value_t = 200)]
    pub tick_us: u64,
    /// How long to look for a thread executing user code before giving up, in ms.
    #[arg(long, default_value_t = 5000)]
    pub patience_ms: u64,
}

fn parse_area(s: &str) -> Result<Area, String> {
    match s {
        "heap" => Ok(Area::Heap),
        "stack" => Ok(Area::Stack),
        "data" => Ok(Area::Data),
        _ => Err(format!("`{s}`: expected heap, stack or data")),
    }
}

fn parse_signal(s: &str) -> Result<Signal, String> {
    kintsugi_inject::parse_signal(s)
        .ok_or_else(|| format!("`{s}`: expected segv, bus, abrt, ill, fpe, term or kill"))
}

impl FaultArgs {
    pub fn fault(&self) -> Fault {
        match self.kind {
            Kind::Register => Fault::Register {
                every_register: false,
            },
            Kind::EveryRegister => Fault::Register {
                every_register: true,
            },
            Kind::Memory => Fault::Memory(self.area),
            Kind::Signal => Fault::Signal(self.signal),
            Kind::Hang => Fault::Hang,
            Kind::Delay => Fault::Delay(Duration::from_millis(self.delay_ms)),
        }
    }

    pub fn injector(&self, seed: u64) -> Injector {
        let mut i = Injector::new(seed);
        i.tick = Duration::from_micros(self.tick_us.max(1));
        i.patience = Duration::from_millis(self.patience_ms);
        i
    }
}

/// The seed given, else one from the clock.
pub fn seed_or_clock(seed: Option<u64>) -> u64 {
    seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
    })
}

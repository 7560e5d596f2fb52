//! The five services of Table I behind one trait: how a client creates a
//! descriptor, the service's representative call through the generated
//! (tracking) client stub, and the same invocation through a raw
//! [`Connection::call`] with hand-encoded arguments, which tracks nothing.
//!
//! | service | descriptor | call | rebuilt after a reboot by |
//! | --- | --- | --- | --- |
//! | fs | `File` (local), offset 1 | `seek` | the client stub: `open` replayed, then `seek` |
//! | lock | `Lock` (global) | `take` + `release` | the server stub, from its creation record |
//! | evt | `Evt` (global) | `wait` that returns at once (after an untimed `trigger`) | the server stub |
//! | timer | `Timer` (local), idle | `arm` + `disarm` | the client stub: `create` replayed |
//! | mm | `Page` (global), 1 page | `locate` | the server stub |

use kintsugi_interfaces::{evt, fs, fs_flags, lock, mm, timer};
use kintsugi_runtime::stub::ReplyStatus;
use kintsugi_runtime::wire::{WireError, Writer};
use kintsugi_runtime::{Connection, Runtime};

/// What a raw call names: a server id, and the epoch it belongs to for
/// local descriptors (as the generated stubs send it).
#[derive(Debug, Clone, Copy)]
pub struct RawTarget {
    pub id: u64,
    pub epoch: Option<u64>,
}

/// One service under measurement, through one client stub of its own.
pub trait Subject: Send + Sync + Sized {
    type Desc: Copy + Send + Sync;
    /// The representative call, as the table names it.
    const CALL: &'static str;

    /// A client stub of its own on `rt`'s connection to the service; `who`
    /// keeps the names of its descriptors apart from other stubs'.
    fn connect(rt: &Runtime, who: u64) -> anyhow::Result<Self>;
    fn connection(&self) -> &Connection;
    /// Creates descriptor number `i` of this stub.
    fn create(&self, i: u64) -> anyhow::Result<Self::Desc>;
    /// Untimed work before each timed call; what it returns goes to [`Subject::raw`].
    fn prepare(&self, _d: Self::Desc) -> anyhow::Result<u64> {
        Ok(0)
    }
    /// The representative call on `d`, through the tracking stub.
    fn tracked(&self, d: Self::Desc) -> anyhow::Result<()>;
    /// A server id for [`Subject::raw`] naming the same kind of object as
    /// `d` (descriptor number `i`) in the server's current incarnation.
    fn raw_target(&self, d: Self::Desc, i: u64) -> anyhow::Result<RawTarget>;
    /// The representative call through the raw connection.
    fn raw(&self, t: RawTarget, prepared: u64) -> anyhow::Result<()>;

    /// The representative call as a client makes it: prepared, then tracked.
    fn probe(&self, d: Self::Desc) -> anyhow::Result<()> {
        self.prepare(d)?;
        self.tracked(d)
    }
}

/// Invokes `func` through the raw connection; returns the reply's first
/// `u64`, if it has one.
fn invoke(
    conn: &Connection,
    func: u32,
    epoch: Option<u64>,
    encode: impl FnOnce(&mut Writer<'_>) -> Result<(), WireError>,
) -> anyhow::Result<Option<u64>> {
    let info = conn.interface();
    let reply = conn
        .call(func, epoch, encode, |status| {
            Ok(match status {
                ReplyStatus::Ok(mut r) => Ok(r.u64().ok()),
                ReplyStatus::AppError(code) => Err(code),
            })
        })
        .map_err(|f| anyhow::anyhow!("raw {}.{}: {f}", info.name, info.functions[func as usize]))?;
    reply.map_err(|code| {
        anyhow::anyhow!(
            "raw {}.{}: error code {code}",
            info.name,
            info.functions[func as usize]
        )
    })
}

/// A raw creation's id.
fn created(id: Option<u64>) -> anyhow::Result<u64> {
    id.ok_or_else(|| anyhow::anyhow!("a creation replied without an id"))
}

/// A name no other stub of this driver uses.
fn name(who: u64, i: u64) -> u64 {
    who << 32 | i
}

pub struct Fs {
    client: fs::Client,
    who: u64,
}

impl Fs {
    fn path(&self, i: u64) -> String {
        format!("/recovery-driver-{}-{i}", self.who)
    }
}

impl Subject for Fs {
    type Desc = fs::File;
    const CALL: &'static str = "seek";

    fn connect(rt: &Runtime, who: u64) -> anyhow::Result<Self> {
        Ok(Self {
            client: fs::Client::from_connection(rt.connect(&fs::INFO)?),
            who,
        })
    }
    fn connection(&self) -> &Connection {
        self.client.connection()
    }
    fn create(&self, i: u64) -> anyhow::Result<fs::File> {
        let f = self.client.open(&self.path(i), fs_flags::CREATE)?;
        // A nonzero offset: rebuilding the file replays `seek` after `open`.
        self.client.seek(f, 1)?;
        Ok(f)
    }
    fn tracked(&self, f: fs::File) -> anyhow::Result<()> {
        self.client.seek(f, 1)?;
        Ok(())
    }
    fn raw_target(&self, _: fs::File, i: u64) -> anyhow::Result<RawTarget> {
        let conn = self.connection();
        let epoch = Some(conn.epoch());
        let path = self.path(i);
        let id = invoke(conn, fs::FN_OPEN, epoch, |w| {
            w.str(&path)?;
            w.u32(0)
        })?;
        Ok(RawTarget {
            id: created(id)?,
            epoch,
        })
    }
    fn raw(&self, t: RawTarget, _: u64) -> anyhow::Result<()> {
        invoke(self.connection(), fs::FN_SEEK, t.epoch, |w| {
            w.u64(t.id)?;
            w.u64(1)
        })?;
        Ok(())
    }
}

pub struct Lock {
    client: lock::Client,
    who: u64,
}

impl Subject for Lock {
    type Desc = lock::Lock;
    const CALL: &'static str = "take + release";

    fn connect(rt: &Runtime, who: u64) -> anyhow::Result<Self> {
        Ok(Self {
            client: lock::Client::from_connection(rt.connect(&lock::INFO)?),
            who,
        })
    }
    fn connection(&self) -> &Connection {
        self.client.connection()
    }
    fn create(&self, i: u64) -> anyhow::Result<lock::Lock> {
        Ok(self.client.alloc(name(self.who, i))?)
    }
    fn tracked(&self, l: lock::Lock) -> anyhow::Result<()> {
        self.client.take(l)?;
        self.client.release(l)?;
        Ok(())
    }
    fn raw_target(&self, l: lock::Lock, _: u64) -> anyhow::Result<RawTarget> {
        Ok(RawTarget {
            id: l.0,
            epoch: None,
        })
    }
    fn raw(&self, t: RawTarget, _: u64) -> anyhow::Result<()> {
        invoke(self.connection(), lock::FN_TAKE, t.epoch, |w| w.u64(t.id))?;
        invoke(self.connection(), lock::FN_RELEASE, t.epoch, |w| {
            w.u64(t.id)
        })?;
        Ok(())
    }
}

pub struct Evt {
    client: evt::Client,
    who: u64,
}

impl Subject for Evt {
    type Desc = evt::Evt;
    const CALL: &'static str = "wait (returns at once)";

    fn connect(rt: &Runtime, who: u64) -> anyhow::Result<Self> {
        Ok(Self {
            client: evt::Client::from_connection(rt.connect(&evt::INFO)?),
            who,
        })
    }
    fn connection(&self) -> &Connection {
        self.client.connection()
    }
    fn create(&self, i: u64) -> anyhow::Result<evt::Evt> {
        Ok(self.client.create(name(self.who, i))?)
    }
    /// A trigger, so that the timed wait returns at once; returns the count.
    fn prepare(&self, ev: evt::Evt) -> anyhow::Result<u64> {
        Ok(self.client.trigger(ev)?)
    }
    fn tracked(&self, ev: evt::Evt) -> anyhow::Result<()> {
        self.client.wait(ev)?;
        Ok(())
    }
    fn raw_target(&self, ev: evt::Evt, _: u64) -> anyhow::Result<RawTarget> {
        Ok(RawTarget {
            id: ev.0,
            epoch: None,
        })
    }
    /// Waits past the count before the trigger that `count` came from, as
    /// the stub does with the count its last wait returned.
    fn raw(&self, t: RawTarget, count: u64) -> anyhow::Result<()> {
        invoke(self.connection(), evt::FN_WAIT, t.epoch, |w| {
            w.u64(t.id)?;
            w.u64(count.saturating_sub(1))
        })?;
        Ok(())
    }
}

/// Timers are armed to start far in the future: none ever ticks.
const TIMER_START_NS: u64 = 1 << 62;
const TIMER_PERIOD_US: u64 = 1_000_000;

pub struct Timer {
    client: timer::Client,
}

impl Subject for Timer {
    type Desc = timer::Timer;
    const CALL: &'static str = "arm + disarm";

    fn connect(rt: &Runtime, _: u64) -> anyhow::Result<Self> {
        Ok(Self {
            client: timer::Client::from_connection(rt.connect(&timer::INFO)?),
        })
    }
    fn connection(&self) -> &Connection {
        self.client.connection()
    }
    fn create(&self, _: u64) -> anyhow::Result<timer::Timer> {
        Ok(self.client.create(TIMER_PERIOD_US)?)
    }
    fn tracked(&self, tm: timer::Timer) -> anyhow::Result<()> {
        self.client.arm(tm, TIMER_START_NS, true)?;
        self.client.disarm(tm)?;
        Ok(())
    }
    fn raw_target(&self, _: timer::Timer, _: u64) -> anyhow::Result<RawTarget> {
        let conn = self.connection();
        let epoch = Some(conn.epoch());
        let id = invoke(conn, timer::FN_CREATE, epoch, |w| w.u64(TIMER_PERIOD_US))?;
        Ok(RawTarget {
            id: created(id)?,
            epoch,
        })
    }
    fn raw(&self, t: RawTarget, _: u64) -> anyhow::Result<()> {
        invoke(self.connection(), timer::FN_ARM, t.epoch, |w| {
            w.u64(t.id)?;
            w.u64(TIMER_START_NS)?;
            w.bool(true)
        })?;
        invoke(self.connection(), timer::FN_DISARM, t.epoch, |w| {
            w.u64(t.id)
        })?;
        Ok(())
    }
}

pub struct Mm {
    client: mm::Client,
}

impl Subject for Mm {
    type Desc = mm::Page;
    const CALL: &'static str = "locate";

    fn connect(rt: &Runtime, _: u64) -> anyhow::Result<Self> {
        Ok(Self {
            client: mm::Client::from_connection(rt.connect(&mm::INFO)?),
        })
    }
    fn connection(&self) -> &Connection {
        self.client.connection()
    }
    fn create(&self, _: u64) -> anyhow::Result<mm::Page> {
        Ok(self.client.grant(1)?)
    }
    fn tracked(&self, p: mm::Page) -> anyhow::Result<()> {
        self.client.locate(p)?;
        Ok(())
    }
    fn raw_target(&self, p: mm::Page, _: u64) -> anyhow::Result<RawTarget> {
        Ok(RawTarget {
            id: p.0,
            epoch: None,
        })
    }
    fn raw(&self, t: RawTarget, _: u64) -> anyhow::Result<()> {
        invoke(self.connection(), mm::FN_LOCATE, t.epoch, |w| w.u64(t.id))?;
        Ok(())
    }
}

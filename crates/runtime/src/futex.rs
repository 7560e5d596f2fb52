//! Futex wait and wake on words in shared memory, and the spin-then-sleep
//! wait that invocations use.
//!
//! The futexes are shared (not `FUTEX_PRIVATE`) because the words live in
//! memfd mappings seen by several processes.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use rustix::thread::futex;

/// Sleeps while `word == expected`, at most `timeout` (forever if `None`).
/// Returns on wake-up, value change, timeout or signal; callers re-check.
pub fn wait(word: &AtomicU32, expected: u32, timeout: Option<Duration>) {
    let ts = timeout.map(timespec);
    let _ = futex::wait(word, futex::Flags::empty(), expected, ts.as_ref());
}

/// A duration as the kernel's timespec.
pub fn timespec(d: Duration) -> rustix::time::Timespec {
    rustix::time::Timespec {
        tv_sec: d.as_secs() as i64,
        tv_nsec: d.subsec_nanos() as i64,
    }
}

/// Wakes up to `n` sleepers on `word`.
pub fn wake(word: &AtomicU32, n: u32) {
    let _ = futex::wake(word, futex::Flags::empty(), n);
}

/// Wakes every sleeper on `word`.
pub fn wake_all(word: &AtomicU32) {
    wake(word, i32::MAX as u32);
}

/// How long a waiter spins before it sleeps: `KINTSUGI_SPIN_US` (default 50 µs),
/// or what [`set_spin_budget`] set. Measured on the project's 2-core VMs
/// (`kintsugi bench ipc`, docs/benchmarks.md): a null round trip costs about
/// 4 µs with futex sleeps alone and 0.25 µs when both sides spin 50 µs, while
/// budgets of 2–10 µs are worse than none (each side gives up just before
/// the other answers and both pay a wake-up). The price is up to 50 µs of
/// spinning per call on an idle peer.
pub fn spin_budget() -> Duration {
    let ns = SPIN_NS.load(Ordering::Relaxed);
    if ns != UNSET {
        return Duration::from_nanos(ns);
    }
    let us = std::env::var("KINTSUGI_SPIN_US")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50u64);
    SPIN_NS.store(us * 1000, Ordering::Relaxed);
    Duration::from_micros(us)
}

/// Overrides the spin budget for this process (and children forked later).
pub fn set_spin_budget(budget: Duration) {
    SPIN_NS.store(budget.as_nanos() as u64, Ordering::Relaxed);
}

const UNSET: u64 = u64::MAX;
static SPIN_NS: AtomicU64 = AtomicU64::new(UNSET);

/// When a waiter spins before it sleeps: set per system (`[system] spin`
/// in its description, carried in the boot info).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Spin {
    /// Always, up to the budget; but a thread whose yields are being lost
    /// to CPU-bound work beside the system sleeps at once for a while
    /// (see `Yields`).
    #[default]
    Always,
    /// Not while the machine is [`oversubscribed`].
    UnlessOversubscribed,
    /// Where spinning has been paying: each thread remembers, per waiting
    /// site (a client's function of an interface, a server slot's next
    /// request), whether its last spin caught the event within 25 µs;
    /// after a spin that did not, the site sleeps at once for its next 1,
    /// 3, 7, … 31 waits
    /// before it tries again (adaptive spinning, as glibc's adaptive
    /// mutexes and Solaris's spin-then-block locks do). A call that waits
    /// on the network (`recv` on a keep-alive connection) stops spinning,
    /// one answered in microseconds keeps it.
    Adaptive,
}

/// This process's [`Spin`] policy, as `Spin as u8`.
static SPIN_POLICY: AtomicU8 = AtomicU8::new(Spin::Always as u8);

/// Sets this process's [`Spin`] policy (at boot).
pub fn set_spin_policy(policy: Spin) {
    SPIN_POLICY.store(policy as u8, Ordering::Relaxed);
}

fn policy() -> Spin {
    match SPIN_POLICY.load(Ordering::Relaxed) {
        p if p == Spin::UnlessOversubscribed as u8 => Spin::UnlessOversubscribed,
        p if p == Spin::Adaptive as u8 => Spin::Adaptive,
        _ => Spin::Always,
    }
}

/// Waiting sites a thread tells apart under [`Spin::Adaptive`] (sites are
/// hashed into them; two that share one only share its history).
const SITES: usize = 64;
/// The most waits a site skips its spin for after a spin that failed:
/// `2^MAX_LEVEL - 1`.
const MAX_LEVEL: u8 = 5;

/// A spin that catches its event later than this is counted as one that
/// did not pay, under [`Spin::Adaptive`]: it held a CPU that long.
const QUICK: Duration = Duration::from_micros(25);

/// One site's history: how many failed spins in a row, and how many
/// waits it still sleeps at once for.
#[derive(Clone, Copy, Default, Debug, PartialEq)]
struct Backoff {
    level: u8,
    skip: u8,
}

impl Backoff {
    /// Whether this wait skips its spin (counting it if so).
    fn skips(&mut self) -> bool {
        let skip = self.skip > 0;
        self.skip = self.skip.saturating_sub(1);
        skip
    }

    /// Notes whether a spin paid (caught its event quickly).
    fn note(&mut self, paid: bool) {
        match paid {
            true => *self = Backoff::default(),
            false => {
                self.level = (self.level + 1).min(MAX_LEVEL);
                self.skip = (1u8 << self.level) - 1;
            }
        }
    }
}

thread_local! {
    static BACKOFF: std::cell::RefCell<[Backoff; SITES]> =
        const { std::cell::RefCell::new([Backoff { level: 0, skip: 0 }; SITES]) };
}

/// Whether a waiter at `site` should skip its spin now (and, under
/// [`Spin::Adaptive`], counts one of the waits it skips).
fn spin_pointless(site: u32) -> bool {
    match policy() {
        Spin::Always => spins_off(),
        Spin::UnlessOversubscribed => oversubscribed(),
        Spin::Adaptive => BACKOFF.with_borrow_mut(|b| b[site as usize % SITES].skips()),
    }
}

/// Notes, under [`Spin::Adaptive`], whether a spin at `site` paid:
/// caught what it waited for within [`QUICK`].
fn spun(site: u32, paid: bool) {
    BACKOFF.with_borrow_mut(|b| b[site as usize % SITES].note(paid));
}

/// How often [`oversubscribed`] looks at the run queues again.
const LOAD_SAMPLE_NS: u64 = 2_000_000;

/// Whether more threads are runnable than there are CPUs, as
/// `/proc/loadavg` said when last read (at most every 2 ms, by whichever
/// thread asks first). A spinning waiter then only takes CPU time from the
/// threads it waits for: on the web system under `ab` (about 60 threads on
/// 2 CPUs), spinning 50 µs per call halved throughput against not spinning
/// at all, while a lone client and server on an idle machine gain 16x from
/// it (docs/benchmarks.md). Used under [`Spin::UnlessOversubscribed`].
pub fn oversubscribed() -> bool {
    static SAMPLED_NS: AtomicU64 = AtomicU64::new(0);
    static OVER: AtomicBool = AtomicBool::new(false);
    let now = crate::clock::monotonic_ns();
    let last = SAMPLED_NS.load(Ordering::Relaxed);
    if now.saturating_sub(last) >= LOAD_SAMPLE_NS
        && SAMPLED_NS
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    {
        let cpus = *CPUS.get_or_init(|| {
            std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
        });
        OVER.store(runnable().is_some_and(|r| r > cpus), Ordering::Relaxed);
    }
    OVER.load(Ordering::Relaxed)
}

static CPUS: OnceLock<usize> = OnceLock::new();

/// Threads runnable now, system-wide: the 4th field of `/proc/loadavg`
/// (`runnable/total`), this thread included.
fn runnable() -> Option<usize> {
    let fd = rustix::fs::open(
        "/proc/loadavg",
        rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .ok()?;
    let mut buf = [0u8; 128];
    let n = rustix::io::read(&fd, &mut buf).ok()?;
    parse_runnable(&buf[..n])
}

fn parse_runnable(loadavg: &[u8]) -> Option<usize> {
    let field = loadavg.split(|b| *b == b' ').nth(3)?;
    let running = field.split(|b| *b == b'/').next()?;
    std::str::from_utf8(running).ok()?.parse().ok()
}

/// Spins until `done(word value)` or the budget runs out; returns the last value
/// seen and whether it satisfied `done`. After the first microsecond the spin
/// yields the CPU between checks: on a machine with as few cores as these, the
/// peer that must answer may be waiting for this very core; and under
/// [`Spin::Always`] a thread whose yields are lost to other work stops
/// spinning for a while (see `Yields`). Under
/// [`Spin::UnlessOversubscribed`], no spin at all while the machine is
/// [`oversubscribed`]; under [`Spin::Adaptive`], none at a `site` where
/// spinning has not been paying.
pub fn spin_until(
    word: &AtomicU32,
    budget: Duration,
    site: u32,
    done: impl Fn(u32) -> bool,
) -> (u32, bool) {
    let v = word.load(Ordering::Acquire);
    if done(v) || budget.is_zero() || spin_pointless(site) {
        return (v, done(v));
    }
    let start = Instant::now();
    let (v, caught) = spin(word, budget, start, done);
    if policy() == Spin::Adaptive {
        spun(site, caught && start.elapsed() <= QUICK);
    }
    (v, caught)
}

/// [`spin_until`]'s loop, from `start`.
fn spin(
    word: &AtomicU32,
    budget: Duration,
    start: Instant,
    done: impl Fn(u32) -> bool,
) -> (u32, bool) {
    let mut rounds = 0u32;
    loop {
        for _ in 0..64 {
            std::hint::spin_loop();
            let v = word.load(Ordering::Acquire);
            if done(v) {
                return (v, true);
            }
        }
        rounds += 1;
        let elapsed = start.elapsed();
        if elapsed >= budget {
            let v = word.load(Ordering::Acquire);
            return (v, done(v));
        }
        if rounds > 4 && elapsed >= Duration::from_micros(1) {
            if policy() != Spin::Always {
                rustix::thread::sched_yield();
                continue;
            }
            // Copied out and back, never borrowed across the yield: a
            // checkpoint restore starts a spinning worker's loop over,
            // which would leave a borrow taken for good.
            let mut yields = YIELDS.get();
            let yielded = yields.maybe_yield(crate::clock::monotonic_ns);
            YIELDS.set(yields);
            if !yielded {
                // Spinning only keeps the CPU from the others: sleep.
                let v = word.load(Ordering::Acquire);
                return (v, done(v));
            }
        }
    }
}

/// A yield that kept its thread off the CPU this long gave the CPU to a
/// thread that ran most of a time slice (about 1.5 ms on 2 CPUs), not to
/// a peer answering in microseconds. 500 µs caught more beside the hogs
/// but fired on the idle machine often enough to cost kv 13–15 %; 1 ms
/// costs it nothing measurable (docs/benchmarks.md).
const LOST_YIELD_NS: u64 = 1_000_000;

/// Of a thread's last 8 yields, how many lost before its spins stop.
const LOST_OF_8: u32 = 6;

/// How long a thread's waits sleep at once after [`LOST_OF_8`].
const NO_SPIN_NS: u64 = 30_000_000;

/// Whether this thread's spins are off (see [`Yields`]): under
/// [`Spin::Always`] only. The other policies answer CPU-bound work beside
/// the system their own way (no spin on an oversubscribed machine, or a
/// site's spins skipped after one that took longer than 25 µs, as a lost
/// yield does), and `adaptive` lost 15 % of the web system's requests
/// under `wrk` with this on top (a CPU-bound load generator is the
/// server's peer, not a hog).
fn spins_off() -> bool {
    let until = YIELDS.get().off_until_ns;
    until != 0 && crate::clock::monotonic_ns() < until
}

/// A thread's spin yields and how they fared. Beside CPU-bound threads
/// that are not the system's (two CPU hogs), most yields give the CPU to
/// one for its whole slice, and each call then costs its spinner a slice:
/// kv's four client threads at full speed made 8,000–85,000 calls in 3 s
/// beside two hogs, against 1.7–1.8 million on an idle machine
/// (2026-12-07). On an idle machine the same yields are what makes
/// spinning pay, for the peer that answers often runs on the spinner's
/// CPU, and few of them are lost (about 1.5 % of kv's and its clients' last
/// 1 ms or more, in bursts). So a thread that lost 6 of its last 8
/// yields stops spinning for 30 ms (its waits sleep at once, to be woken
/// as the peer answers); then it spins again, and a lost yield stops it
/// again at once while its history holds 6 lost: beside two hogs 3.3 ×
/// the calls, idle 3.8 % fewer, inside the spread. Spinning on without
/// yields instead, or stopping every thread of the process at once, was
/// worse both beside the hogs and on the idle machine, where the
/// detection also fires now and then (docs/benchmarks.md).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Yields {
    /// The last 8 yields, the latest in the lowest bit: 1 if lost.
    lost: u8,
    /// No spinning before this instant (CLOCK_MONOTONIC ns).
    off_until_ns: u64,
}

impl Yields {
    /// Yields the CPU unless spinning is off (returns whether it
    /// yielded), and puts spinning off if the yield was the sixth of eight
    /// lost; `now` reads the clock.
    fn maybe_yield(&mut self, now: impl Fn() -> u64) -> bool {
        let before = now();
        if before < self.off_until_ns {
            return false;
        }
        rustix::thread::sched_yield();
        self.yielded(before, now());
        true
    }

    /// Notes a yield from `before` to `after`.
    fn yielded(&mut self, before: u64, after: u64) {
        let lost = after.saturating_sub(before) >= LOST_YIELD_NS;
        self.lost = (self.lost << 1) | u8::from(lost);
        if self.lost.count_ones() >= LOST_OF_8 {
            self.off_until_ns = after + NO_SPIN_NS;
        }
    }
}

thread_local! {
    static YIELDS: std::cell::Cell<Yields> = const {
        std::cell::Cell::new(Yields { lost: 0, off_until_ns: 0 })
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_site_whose_spins_do_not_pay_sleeps_at_once_for_longer_each_time() {
        let mut b = Backoff::default();
        assert!(!b.skips(), "a new site spins");
        // Each failed spin doubles the waits skipped after it, up to 31.
        for skipped in [1, 3, 7, 15, 31, 31] {
            b.note(false);
            for _ in 0..skipped {
                assert!(b.skips());
            }
            assert!(!b.skips(), "then it tries again");
        }
        // One that pays starts it over.
        b.note(true);
        assert_eq!(b, Backoff::default());
        assert!(!b.skips());
    }

    #[test]
    fn six_of_eight_yields_lost_stop_the_spins_for_a_while() {
        let lost = LOST_YIELD_NS;
        let mut y = Yields::default();
        // Five of every eight lost: spins go on.
        for i in 0..40u64 {
            let took = if i % 8 >= 3 { lost } else { lost - 1 };
            y.yielded(i * 2 * lost, i * 2 * lost + took);
        }
        assert_eq!(y.off_until_ns, 0, "{y:?}");
        // Six of eight: off for NO_SPIN_NS from the sixth.
        let t = 100 * lost;
        y.yielded(t, t + lost);
        assert_eq!(y.off_until_ns, t + lost + NO_SPIN_NS);
        // Meanwhile no yield: the clock is read, nothing noted.
        let before = y;
        assert!(!y.maybe_yield(|| t + 2 * lost));
        assert_eq!(y, before);
        // Then a lost one stops them again at once; kept ones do not.
        let later = y.off_until_ns;
        y.yielded(later, later + lost);
        assert_eq!(y.off_until_ns, later + lost + NO_SPIN_NS);
        for i in 0..8 {
            y.yielded(later + i, later + i);
        }
        assert_eq!(y.lost, 0);
    }

    #[test]
    fn loadavg_runnable_field() {
        assert_eq!(parse_runnable(b"0.52 0.58 0.59 3/467 12345\n"), Some(3));
        assert_eq!(parse_runnable(b"0.52 0.58"), None);
        assert_eq!(parse_runnable(b"a b c x/1 2"), None);
        assert!(runnable().is_some_and(|r| r >= 1), "this thread runs");
    }
    use std::sync::Arc;

    #[test]
    fn wake_releases_a_sleeper() {
        let w = Arc::new(AtomicU32::new(0));
        let w2 = w.clone();
        let t = std::thread::spawn(move || {
            while w2.load(Ordering::Acquire) == 0 {
                wait(&w2, 0, Some(Duration::from_secs(5)));
            }
        });
        std::thread::sleep(Duration::from_millis(10));
        w.store(1, Ordering::Release);
        wake_all(&w);
        t.join().unwrap();
    }

    #[test]
    fn wait_times_out() {
        let w = AtomicU32::new(0);
        let t = Instant::now();
        wait(&w, 0, Some(Duration::from_millis(5)));
        assert!(t.elapsed() >= Duration::from_millis(4));
    }
}

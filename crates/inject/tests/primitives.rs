//! Each primitive against a real process (`inject-target`): threads that
//! spin on a checked sum, and threads that sleep.

use std::io::{BufRead, BufReader};
use std::os::unix::fs::FileExt;
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kintsugi_inject::{threads, Area, Fault, Injection, Injector, Stopped, GPRS};
use nix::sys::signal::Signal;

const SEED: u64 = 0x5eed_1a7e;

struct Target(Child);

impl Target {
    fn start(spinners: u32, sleepers: u32) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_inject-target"))
            .args([spinners.to_string(), sleepers.to_string()])
            .stdout(Stdio::piped())
            .spawn()
            .expect("inject-target");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line.trim(), "ready");
        let t = Self(child);
        t.wait_for_sleepers(spinners as usize, sleepers as usize);
        t
    }

    /// Waits until each sleeper (the threads after the `spinners`, which
    /// the target spawns first) sleeps in `clock_nanosleep`: the target
    /// prints `ready` once it has spawned them, and a sleeper that has not
    /// yet reached its first sleep runs user code and could be caught as
    /// the "running" thread (seen beside CPU hogs, and in CI when the
    /// count of threads not running included a spinner blocked for an
    /// instant in its start-up).
    fn wait_for_sleepers(&self, spinners: usize, sleepers: usize) {
        let until = Instant::now() + Duration::from_secs(10);
        let in_sleep = |tid: u32| {
            std::fs::read_to_string(format!("/proc/{}/task/{tid}/syscall", self.pid()))
                .is_ok_and(|s| s.starts_with("230 "))
        };
        loop {
            let all = threads(self.pid()).unwrap();
            let asleep = all
                .iter()
                .skip(spinners)
                .filter(|t| in_sleep(t.tid))
                .count();
            if all.len() == spinners + sleepers && asleep == sleepers {
                return;
            }
            assert!(
                Instant::now() < until,
                "{asleep} of {sleepers} sleepers asleep after 10 s"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn pid(&self) -> u32 {
        self.0.id()
    }

    /// How it ended, if it did within `within`.
    fn ended(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        let until = Instant::now() + within;
        while Instant::now() < until {
            if let Some(s) = self.0.try_wait().unwrap() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        None
    }

    /// CPU time of thread `tid` in clock ticks (utime + stime).
    fn cpu(&self, tid: u32) -> u64 {
        let stat =
            std::fs::read_to_string(format!("/proc/{}/task/{tid}/stat", self.pid())).unwrap();
        let f: Vec<&str> = stat
            .rsplit_once(')')
            .unwrap()
            .1
            .split_whitespace()
            .collect();
        f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
    }

    fn read(&self, addr: u64) -> u8 {
        let mem = std::fs::File::open(format!("/proc/{}/mem", self.pid())).unwrap();
        let mut b = [0u8];
        mem.read_exact_at(&mut b, addr).unwrap();
        b[0]
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn injector() -> Injector {
    eprintln!("seed {SEED:#x}");
    Injector::new(SEED)
}

#[test]
fn a_changed_register_is_written_back_when_the_thread_resumes() {
    let t = Target::start(0, 1);
    let sleeper = threads(t.pid()).unwrap()[0].tid;
    // Wait until it sleeps in clock_nanosleep (230), past its start-up calls.
    let syscall = format!("/proc/{}/task/{sleeper}/syscall", t.pid());
    while !std::fs::read_to_string(&syscall)
        .unwrap()
        .starts_with("230 ")
    {
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut s = Stopped::seize(t.pid(), sleeper, Duration::from_secs(5)).unwrap();
    // Blocked in nanosleep: in a system call, not in user code.
    assert!(!s.in_user_code());
    let r12 = s.regs().r12;
    s.regs_mut().r12 ^= 1 << 37;
    s.resume().unwrap();
    // r12 is callee-saved: the sleeping thread's value is unchanged since.
    let s = Stopped::seize(t.pid(), sleeper, Duration::from_secs(5)).unwrap();
    assert_eq!(s.regs().r12, r12 ^ (1 << 37));
    drop(s);
    // Let go, it restarts its sleep (running for an instant) and sleeps on.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while threads(t.pid()).unwrap()[0].state != 'S' && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(
        threads(t.pid()).unwrap()[0].state,
        'S',
        "let go, it sleeps on"
    );
}

#[test]
fn register_flips_hit_threads_in_user_code_and_are_caught() {
    let mut t = Target::start(2, 2);
    let sleepers: Vec<u32> = threads(t.pid()).unwrap()[2..]
        .iter()
        .map(|x| x.tid)
        .collect();
    let mut inj = injector();
    let mut done = 0;
    while done < 300 && t.ended(Duration::from_millis(2)).is_none() {
        match inj.inject(
            t.pid(),
            &Fault::Register {
                every_register: false,
            },
        ) {
            Ok(Injection::Register { tid, flips, .. }) => {
                assert!(!sleepers.contains(&tid), "a sleeping thread was hit");
                assert_eq!(flips.len(), 1);
                assert!(GPRS.contains(&flips[0].register) && flips[0].bit < 64);
                done += 1;
            }
            Ok(other) => panic!("{other}"),
            Err(e) => {
                // It died of an earlier flip between two injections.
                assert!(t.ended(Duration::from_secs(1)).is_some(), "{e}");
                break;
            }
        }
    }
    // Some flip must have had an effect: a crash, or the checker's exit 3.
    let status = t
        .ended(Duration::from_secs(10))
        .expect("no flip had any effect");
    eprintln!("{done} flips; target ended with {status:?}");
    assert!(
        status.signal().is_some() || status.code() == Some(3),
        "{status:?}"
    );
}

#[test]
fn a_flip_in_every_register_is_sixteen_flips() {
    let t = Target::start(1, 0);
    match injector()
        .inject(
            t.pid(),
            &Fault::Register {
                every_register: true,
            },
        )
        .unwrap()
    {
        Injection::Register { flips, .. } => {
            let regs: Vec<_> = flips.iter().map(|f| f.register).collect();
            assert_eq!(regs, GPRS);
        }
        other => panic!("{other}"),
    }
}

#[test]
fn memory_flips_change_one_bit_of_resident_heap_data_and_stack() {
    // Only sleepers: nothing writes the flipped bytes after the flip.
    let t = Target::start(0, 2);
    let mut inj = injector();
    for area in [Area::Heap, Area::Data, Area::Stack] {
        for _ in 0..20 {
            match inj.inject(t.pid(), &Fault::Memory(area)).unwrap() {
                Injection::Memory {
                    area: a,
                    addr,
                    bit,
                    before,
                } => {
                    assert_eq!(a, area);
                    assert_eq!(t.read(addr), before ^ (1 << bit), "{area} {addr:#x}");
                    // Flip it back, so that the next round starts clean.
                    let mem = std::fs::OpenOptions::new()
                        .write(true)
                        .open(format!("/proc/{}/mem", t.pid()))
                        .unwrap();
                    mem.write_all_at(&[before], addr).unwrap();
                }
                other => panic!("{other}"),
            }
        }
    }
}

#[test]
fn a_signal_goes_to_a_running_thread_and_kills_the_process() {
    for signal in [
        Signal::SIGSEGV,
        Signal::SIGBUS,
        Signal::SIGABRT,
        Signal::SIGKILL,
    ] {
        let mut t = Target::start(1, 1);
        let spinner = threads(t.pid())
            .unwrap()
            .into_iter()
            .find(|t| t.state == 'R')
            .expect("the spinner runs")
            .tid;
        // Rust's runtime catches SIGSEGV and SIGBUS to report stack
        // overflows; its handler swallows one that was sent rather than
        // caused, and restores the default action (kintsugi components
        // restore it at start: `kintsugi_runtime::process::default_fault_signals`).
        let sends = match signal {
            Signal::SIGSEGV | Signal::SIGBUS => 2,
            _ => 1,
        };
        let mut inj = injector();
        for _ in 0..sends {
            match inj.inject(t.pid(), &Fault::Signal(signal)).unwrap() {
                Injection::Signal { tid, signal: s } => {
                    assert_eq!(s, signal);
                    assert_eq!(tid, (signal != Signal::SIGKILL).then_some(spinner));
                }
                other => panic!("{other}"),
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let status = t
            .ended(Duration::from_secs(5))
            .unwrap_or_else(|| panic!("{signal}: it lives on"));
        assert_eq!(status.signal(), Some(signal as i32));
    }
}

#[test]
fn a_hang_holds_one_thread_until_released_and_a_delay_lets_it_go() {
    let mut t = Target::start(2, 0);
    let mut inj = injector();
    let held = match inj.inject(t.pid(), &Fault::Hang).unwrap() {
        Injection::Hang(h) => h,
        other => panic!("{other}"),
    };
    let other = threads(t.pid())
        .unwrap()
        .into_iter()
        .find(|x| x.tid != held.tid())
        .unwrap()
        .tid;
    let (h0, o0) = (t.cpu(held.tid()), t.cpu(other));
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(t.cpu(held.tid()), h0, "the held thread ran");
    assert!(t.cpu(other) > o0, "the other thread stopped too");
    assert_eq!(
        threads(t.pid())
            .unwrap()
            .iter()
            .find(|x| x.tid == held.tid())
            .unwrap()
            .state,
        't'
    );
    let tid = held.tid();
    held.release().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert!(t.cpu(tid) > h0, "released, it runs again");

    let start = Instant::now();
    match inj
        .inject(t.pid(), &Fault::Delay(Duration::from_millis(200)))
        .unwrap()
    {
        Injection::Delay { held, .. } => assert_eq!(held, Duration::from_millis(200)),
        other => panic!("{other}"),
    }
    assert!(start.elapsed() >= Duration::from_millis(200));
    assert!(threads(t.pid()).unwrap().iter().all(|x| x.state != 't'));

    // A held thread whose process is killed is collected, and the process's
    // exit reaches its parent.
    let mut held = match inj.inject(t.pid(), &Fault::Hang).unwrap() {
        Injection::Hang(h) => h,
        other => panic!("{other}"),
    };
    assert!(!held.reap_if_dead());
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(t.pid() as i32), Signal::SIGKILL).unwrap();
    let until = Instant::now() + Duration::from_secs(5);
    while !held.reap_if_dead() {
        assert!(Instant::now() < until, "never seen dead");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(
        t.ended(Duration::from_secs(5))
            .expect("exit held back")
            .signal(),
        Some(9)
    );
}

#[test]
fn a_process_with_no_running_thread_is_reported_not_waited_on_forever() {
    let t = Target::start(0, 1);
    let mut inj = injector();
    inj.patience = Duration::from_millis(100);
    let e = inj
        .inject(
            t.pid(),
            &Fault::Register {
                every_register: false,
            },
        )
        .unwrap_err();
    assert!(e.to_string().contains("executing user code"), "{e}");
}

#[test]
fn every_thread_is_described_with_its_state_and_system_call() {
    let target = Target::start(1, 2);
    // The sleepers may not have reached their sleep when the target says ready.
    let sleeping = |lines: &[String]| lines.iter().filter(|l| l.contains(" S ")).count();
    let until = Instant::now() + Duration::from_secs(5);
    let mut lines = kintsugi_inject::describe_threads(target.pid());
    while sleeping(&lines) < 3 && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(10));
        lines = kintsugi_inject::describe_threads(target.pid());
    }
    assert_eq!(
        lines.len(),
        4,
        "the leader, a spinner and two sleepers: {lines:?}"
    );
    assert!(
        lines[0].starts_with(&format!("{} ", target.pid())),
        "{lines:?}"
    );
    assert!(
        lines
            .iter()
            .all(|l| l.contains(" wchan=") && l.contains(" syscall=")),
        "{lines:?}"
    );
    // The spinner runs (R) in user code; the sleepers wait in a system call.
    assert!(lines.iter().any(|l| l.contains(" R ")), "{lines:?}");
    assert_eq!(
        sleeping(&lines),
        3,
        "the leader and the two sleepers: {lines:?}"
    );
    drop(target);
    assert_eq!(
        kintsugi_inject::describe_threads(u32::MAX),
        [format!("{}: gone", u32::MAX)]
    );
}

//! A target for the injector's own tests: `inject-target SPINNERS SLEEPERS`
//! runs SPINNERS threads that compute a running sum and check it against a
//! closed form every million steps (exit code 3 and a line on stderr on a
//! mismatch: a register flip caught), and SLEEPERS threads that sleep. It
//! prints `ready` once every thread runs, and runs until killed.

#![forbid(unsafe_code)]

use std::hint::black_box;
use std::time::Duration;

fn spin(seed: u64) -> ! {
    loop {
        let mut sum = 0u64;
        let n = 1_000_000u64 + seed;
        for i in 0..n {
            sum = black_box(sum.wrapping_add(black_box(i)));
        }
        if sum != n * (n - 1) / 2 {
            eprintln!("checker: sum {sum} != {}", n * (n - 1) / 2);
            std::process::exit(3);
        }
    }
}

fn main() {
    let mut args = std::env::args()
        .skip(1)
        .map(|a| a.parse::<u64>().expect("a count"));
    let (spinners, sleepers) = (args.next().unwrap_or(1), args.next().unwrap_or(0));
    for s in 0..spinners {
        std::thread::spawn(move || spin(s));
    }
    for _ in 0..sleepers {
        std::thread::spawn(|| loop {
            std::thread::sleep(Duration::from_secs(3600));
        });
    }
    println!("ready");
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

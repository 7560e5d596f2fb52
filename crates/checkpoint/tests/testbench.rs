//! RTCR's testbench: generated cases over heap sizes, numbers of mappings
//! (made and dropped between checkpoints), threads, written shares,
//! checkpoint intervals and restore kinds. Each case checks, against what
//! the target held at its last checkpoint, every byte of every checkpointed
//! mapping (hashed from `/proc/<pid>/mem` before and after, outside the
//! checkpointer), every thread's registers and extended state, the
//! target's own digest of its pages and generations, and that it serves
//! on (a write of 10 % of its pages and a clean digest after).
//!
//! `KINTSUGI_CKPT_CASES` (default 40) and `KINTSUGI_TEST_SEED` set the
//! sample; `KINTSUGI_CKPT_MAX_HEAP` caps the heap (default 64 MiB; the full
//! run in `docs/reliability.md` goes to 1 GiB).

mod common;

use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use common::Target;
use kintsugi_checkpoint::{file, Checkpointer, Frozen, Image, ThreadState};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    InPlace,
    ImageFile,
    NewProcess,
}

#[derive(Debug)]
struct Case {
    seed: u64,
    heap: u64,
    maps: u64,
    threads: u64,
    spin: bool,
    rounds: usize,
    permille: Vec<u64>,
    kind: Kind,
    /// Pages read ahead while the target writes, before each checkpoint
    /// and before the restore (see `ahead.rs`).
    read_ahead: bool,
}

fn log_uniform(rng: &mut StdRng, lo: u64, hi: u64) -> u64 {
    let (a, b) = ((lo as f64).ln(), (hi as f64).ln());
    rng.gen_range(a..=b).exp() as u64
}

fn case(rng: &mut StdRng, max_heap: u64) -> Case {
    let heap = match rng.gen_range(0..1000) {
        0..=699 => log_uniform(rng, 4 << 10, 4 << 20),
        700..=949 => log_uniform(rng, 4 << 20, 64 << 20),
        950..=994 => log_uniform(rng, 64 << 20, 256 << 20),
        _ => 1 << 30,
    }
    .min(max_heap);
    let maps = match rng.gen_range(0..10) {
        0..=3 => rng.gen_range(1..=10),
        4..=7 => rng.gen_range(10..=100),
        _ => rng.gen_range(100..=1000),
    };
    let rounds = rng.gen_range(1..=3);
    let shares = [0, 1, 10, 100, 500, 1000];
    let seed: u64 = rng.gen();
    Case {
        seed,
        // From the seed, so that the cases a seed made before read-ahead
        // existed are the same cases, half of them now reading ahead.
        read_ahead: seed.is_multiple_of(2),
        heap,
        maps,
        threads: rng.gen_range(1..=16),
        spin: rng.gen_bool(0.5),
        rounds,
        permille: (0..=rounds)
            .map(|_| shares[rng.gen_range(0..shares.len())])
            .collect(),
        kind: [Kind::InPlace, Kind::ImageFile, Kind::NewProcess][rng.gen_range(0..3)],
    }
}

/// What the target held at its checkpoint, seen from outside.
struct Truth {
    /// A CRC per page of each checkpointed mapping, by its start.
    bytes: BTreeMap<u64, Vec<u32>>,
    threads: Vec<ThreadState>,
}

fn hash(bytes: &[u8]) -> Vec<u32> {
    bytes.chunks(4096).map(crc32fast::hash).collect()
}

/// What the frozen target holds in `image`'s mappings and threads. Words
/// the kernel writes at will (each thread's rseq CPU fields) are seen as
/// zero; `renamed` gives thread-id words the value they are compared with
/// (a new process holds its own ids there).
fn observe(frozen: &Frozen, image: &Image, renamed: &[(u64, u32)]) -> Truth {
    let mem = File::open(format!("/proc/{}/mem", frozen.pid())).unwrap();
    let mut patches: Vec<(u64, Vec<u8>)> = renamed
        .iter()
        .map(|&(addr, tid)| (addr, tid.to_le_bytes().to_vec()))
        .collect();
    for t in image.threads.iter().filter(|t| t.rseq.address != 0) {
        // cpu_id_start and cpu_id; node_id and mm_cid.
        patches.push((t.rseq.address, vec![0; 8]));
        patches.push((t.rseq.address + 20, vec![0; 8]));
    }
    let mut bytes = BTreeMap::new();
    let mut buf = Vec::new();
    for a in image.areas.values() {
        buf.resize(a.map.len() as usize, 0);
        mem.read_exact_at(&mut buf, a.map.start).unwrap();
        for (addr, b) in &patches {
            if *addr >= a.map.start && addr + b.len() as u64 <= a.map.end {
                let at = (addr - a.map.start) as usize;
                buf[at..at + b.len()].copy_from_slice(b);
            }
        }
        bytes.insert(a.map.start, hash(&buf));
    }
    let threads = frozen
        .tids()
        .iter()
        .map(|&tid| ThreadState::new(tid, &frozen.regs(tid).unwrap(), frozen.xstate(tid).unwrap()))
        .collect();
    Truth { bytes, threads }
}

fn run(case: &Case, dir: &std::path::Path) -> Result<Duration, String> {
    let started = Instant::now();
    let mut t = Target::start(case.seed, case.heap, case.maps, case.threads, case.spin);
    let mut c = Checkpointer::attach(t.pid()).map_err(|e| format!("attach: {e}"))?;
    let mut truth = None;
    let mut digest = String::new();
    for round in 0..case.rounds {
        t.cmd(&format!(
            "mutate {} {}",
            case.permille[round],
            case.seed ^ round as u64
        ))?;
        // Read ahead while the target writes more: pages written during
        // or after the read are copied again in the pause.
        let ahead = case.read_ahead && round > 0;
        if ahead {
            t.send(&format!(
                "mutate 10 {}",
                case.seed.rotate_left(round as u32)
            ))?;
        }
        let t = &mut t;
        let mut take = |c: &mut Checkpointer| -> Result<(String, Truth), String> {
            if ahead {
                t.reply()?;
            }
            if round % 2 == 1 {
                t.cmd(&format!(
                    "map {} {}",
                    1 + case.maps / 4,
                    case.seed + round as u64
                ))?;
                t.cmd(&format!(
                    "unmap {} {}",
                    1 + case.maps / 8,
                    case.seed + round as u64
                ))?;
            }
            let digest = t.digest()?;
            std::thread::sleep(Duration::from_micros(case.seed % 3000));
            let frozen = Frozen::freeze(t.pid()).map_err(|e| format!("freeze: {e}"))?;
            c.checkpoint_frozen(&frozen)
                .map_err(|e| format!("checkpoint {round}: {e}"))?;
            Ok((digest, observe(&frozen, c.image(), &[])))
        };
        let (d, held) = match ahead {
            true => c.with_read_ahead(take)?,
            false => take(&mut c)?,
        };
        digest = d;
        truth = Some(held);
    }
    let truth = truth.unwrap();
    // After the checkpoint: writes, new mappings, dropped ones.
    t.cmd(&format!(
        "mutate {} {}",
        case.permille[case.rounds].max(1),
        !case.seed
    ))?;
    if case.read_ahead {
        // Pages read ahead, and no checkpoint taken: the image must be the
        // checkpoint's again, and the pages found written by the restore.
        c.with_read_ahead(|_| ());
        t.cmd(&format!("mutate 10 {}", case.seed.rotate_right(3)))?;
    }
    t.cmd(&format!("map {} {}", 1 + case.maps / 3, !case.seed))?;
    t.cmd(&format!("unmap {} {}", 1 + case.maps / 5, !case.seed))?;
    let (mut t, mut c) = match case.kind {
        Kind::NewProcess => {
            // A new incarnation of the same program takes the image.
            let path = dir.join(format!("case-{}.ksgckpt", case.seed));
            file::write(c.image(), &path).map_err(|e| format!("write: {e}"))?;
            let fresh = Target::start(case.seed, case.heap, case.maps, case.threads, case.spin);
            let fc = Checkpointer::attach(fresh.pid()).map_err(|e| format!("attach new: {e}"))?;
            drop(t);
            (fresh, fc)
        }
        _ => (t, c),
    };
    let frozen = Frozen::freeze(t.pid()).map_err(|e| format!("freeze: {e}"))?;
    let path = dir.join(format!("case-{}.ksgckpt", case.seed));
    match case.kind {
        // Restored with pages read ahead: they go back too.
        Kind::InPlace if case.read_ahead && case.seed & 2 == 0 => {
            c.with_read_ahead(|c| c.restore_frozen(&frozen))
                .map_err(|e| format!("restore: {e}"))?;
        }
        Kind::InPlace => {
            c.restore_frozen(&frozen)
                .map_err(|e| format!("restore: {e}"))?;
        }
        Kind::ImageFile => {
            file::write(c.image(), &path).map_err(|e| format!("write: {e}"))?;
            let image = file::read(&path).map_err(|e| format!("read: {e}"))?;
            c.restore_image_frozen(&frozen, image)
                .map_err(|e| format!("restore image: {e}"))?;
        }
        Kind::NewProcess => {
            let image = file::read(&path).map_err(|e| format!("read: {e}"))?;
            c.restore_new_frozen(&frozen, image)
                .map_err(|e| format!("restore into a new process: {e}"))?;
        }
    }
    std::fs::remove_file(&path).ok();
    // Checked before any thread runs again.
    // In a new process, thread i of the image is thread i of the process,
    // and the C library's id words hold the new ids.
    let renamed: Vec<(u64, u32)> = match case.kind {
        Kind::NewProcess => c
            .image()
            .threads
            .iter()
            .zip(&truth.threads)
            .filter(|(t, _)| t.tid_address != 0)
            .map(|(t, old)| (t.tid_address, old.tid))
            .collect(),
        _ => Vec::new(),
    };
    let after = observe(&frozen, c.image(), &renamed);
    for (start, h) in &truth.bytes {
        let got = after
            .bytes
            .get(start)
            .ok_or(format!("mapping at {start:#x} gone"))?;
        if let Some(p) = (0..h.len()).find(|&p| got.get(p) != h.get(p)) {
            let a = &c.image().areas[start];
            return Err(format!(
                "mapping at {start:#x} ({} pages, {:?}, tracked {}): page {p} differs from the checkpoint",
                h.len(),
                a.map.name,
                a.tracked
            ));
        }
    }
    // Thread i of the image is thread i of the process restored into.
    for (i, (want, got)) in truth.threads.iter().zip(&after.threads).enumerate() {
        if want.regs != got.regs {
            return Err(format!("thread {i} ({}): registers differ", got.tid));
        }
        if want.xstate != got.xstate {
            return Err(format!("thread {i} ({}): extended state differs", got.tid));
        }
    }
    drop(frozen);
    let now = t.cmd("digest")?;
    if now != digest {
        return Err(format!(
            "digest after restore {now}, at the checkpoint {digest}"
        ));
    }
    t.cmd(&format!("mutate 100 {}", case.seed.rotate_left(7)))?;
    let served = t.cmd("digest")?;
    if !served.starts_with("ok ") {
        return Err(format!("after serving on: {served}"));
    }
    Ok(started.elapsed())
}

fn size_class(b: u64) -> &'static str {
    match b {
        0..=0x3f_ffff => "≤ 4 MiB",
        0x40_0000..=0x3ff_ffff => "4-64 MiB",
        0x400_0000..=0xfff_ffff => "64-256 MiB",
        _ => "≥ 256 MiB",
    }
}

#[test]
fn generated_cases_restore_every_byte_and_register() {
    let cases: usize = std::env::var("KINTSUGI_CKPT_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(40);
    let max_heap: u64 = std::env::var("KINTSUGI_CKPT_MAX_HEAP")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64 << 20);
    let seed = std::env::var("KINTSUGI_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                % 1_000_000
        });
    eprintln!("testbench: {cases} cases, seed {seed} (replay with KINTSUGI_TEST_SEED={seed})");
    let dir = std::env::temp_dir().join(format!("kintsugi-testbench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut table: BTreeMap<(&str, Kind), (u64, u64, Duration)> = BTreeMap::new();
    let mut failures = Vec::new();
    for i in 0..cases {
        let c = case(&mut rng, max_heap);
        if std::env::var("KINTSUGI_CKPT_ONLY").is_ok_and(|only| only != i.to_string()) {
            continue;
        }
        let row = table.entry((size_class(c.heap), c.kind)).or_default();
        row.0 += 1;
        match run(&c, &dir) {
            Ok(took) => row.2 += took,
            Err(e) => {
                row.1 += 1;
                eprintln!("case {i} FAILED: {e}\n  {c:?}");
                failures.push(i);
            }
        }
    }
    std::fs::remove_dir_all(&dir).ok();
    eprintln!("| heap | restore | cases | failed | mean time per case |");
    eprintln!("| --- | --- | ---: | ---: | ---: |");
    for ((class, kind), (n, failed, took)) in &table {
        let ok = (n - failed).max(1);
        eprintln!(
            "| {class} | {kind:?} | {n} | {failed} | {:.1} ms |",
            took.as_secs_f64() * 1e3 / ok as f64
        );
    }
    eprintln!(
        "{} passed, {} failed",
        cases - failures.len(),
        failures.len()
    );
    assert!(
        failures.is_empty(),
        "failed cases {failures:?} of seed {seed}"
    );
}

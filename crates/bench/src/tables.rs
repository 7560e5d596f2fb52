//! The client stubs' descriptor tables alone, in process: what tracking
//! costs per call before and after the invocation, without the noise of
//! the invocation itself (C3's per-call tracking, issue 14's ≤ 10 % of a
//! null invocation). The baseline, measured in the same run, is the
//! table the stubs used before issue 14: a `Mutex<std HashMap>` looked
//! up twice (and, for global descriptors' fields, the table they used
//! before the seqlock); a null invocation over a real shared-memory edge
//! in this process gives the scale.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::hint::black_box;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use kintsugi_interfaces::bench;
use kintsugi_interfaces::evt::EvtRecord;
use kintsugi_runtime::generated::{DescTable, FieldTable};
use kintsugi_runtime::testing::Loopback;
use kintsugi_supervisor::stats::Summary;

use crate::Pinning;

/// A local descriptor's record, like fs's: a remembered path and a
/// tracked offset.
#[derive(Clone, Default)]
struct FileRecord {
    _path: String,
    offset: u64,
}

/// ns per null invocation of the bench interface over a loopback edge
/// (the runtime's real channel and worker, in this process), and where
/// its two threads ran.
fn null_invocation(blocks: usize, per_block: u64) -> (Summary, &'static str) {
    let pins = Pinning::new();
    let lb = pins.apart(|| Loopback::new(bench::service(Arc::new(crate::NullServer))));
    let client = bench::Client::from_connection(lb.connection());
    let null = time(blocks, per_block, |_| client.null().expect("a null call"));
    let placed = match pins.pinned() {
        true => "pinned to CPUs 1 and 0",
        false => "not pinned",
    };
    (null, placed)
}

// Each table's work around one call is a function of its own, never
// inlined into the timing loop: inlined, how the compiler laid out the
// loop moved one table's figure by a factor of two between builds that
// changed only the code around it.

/// A local descriptor around a call: where it lives before it, its
/// record updated after it.
#[inline(never)]
fn desc_table_fields(table: &DescTable<FileRecord>, id: u32) {
    let epoch = black_box(table.locate(id).expect("tracked").epoch);
    table.update(id, |t| {
        t.record.offset += 1;
        if t.epoch != epoch {
            t.epoch = 0;
        }
    });
}

/// The same in one locked map (server id, epoch, record), looked up twice.
#[inline(never)]
fn locked_local(map: &Mutex<HashMap<u32, (u64, u64, FileRecord)>>, id: u32) {
    let epoch = black_box(map.lock().unwrap().get(&id).expect("tracked").1);
    if let Some(t) = map.lock().unwrap().get_mut(&id) {
        t.2.offset += 1;
        if t.1 != epoch {
            t.1 = 0;
        }
    }
}

/// What the generated stub does around a call: one probe before it, the
/// update after it where the probe found the fields.
#[inline(never)]
fn seqlock_fields(fields: &FieldTable<EvtRecord, 1>, g: u64) {
    let looked = fields.look(g);
    let seen = black_box(looked.fields.seen);
    fields.update_looked(&looked, g, |f| f.seen = seen + 1);
}

/// What a stub did around a call with its fields in one locked map: a
/// lookup before the call, another for the update after it.
#[inline(never)]
fn locked_fields<S: BuildHasher>(map: &Mutex<HashMap<u64, EvtRecord, S>>, g: u64) {
    let seen = black_box(
        map.lock()
            .unwrap()
            .get(&g)
            .cloned()
            .unwrap_or_default()
            .seen,
    );
    map.lock().unwrap().entry(g).or_default().seen = seen + 1;
}

/// Times `op` over `blocks` blocks of `per_block` calls: ns per call per block.
fn time(blocks: usize, per_block: u64, mut op: impl FnMut(u64)) -> Summary {
    let mut samples = Vec::with_capacity(blocks);
    let mut k = 0u64;
    for _ in 0..blocks {
        let t = Instant::now();
        for _ in 0..per_block {
            op(k);
            k += 1;
        }
        samples.push(t.elapsed().as_nanos() as f64 / per_block as f64);
    }
    Summary::of(&samples).expect("blocks > 0")
}

pub fn tables(descriptors: u64, blocks: usize, per_block: u64) -> anyhow::Result<bool> {
    anyhow::ensure!(
        descriptors > 0 && blocks > 0 && per_block > 0,
        "sizes must be positive"
    );
    println!("kintsugi bench tables: one thread, {descriptors} descriptors used in turn; per call, what a");
    println!(
        "generated stub does around the invocation: look the descriptor up before it, record its"
    );
    println!("effect after it. {blocks} blocks of {per_block} calls; ns per call over blocks.\n");

    // Local descriptors (fs, timer, net): where it lives, then the update.
    let table = DescTable::<FileRecord>::default();
    let ids: Vec<u32> = (0..descriptors)
        .map(|i| {
            table.insert(
                i,
                1,
                FileRecord {
                    _path: format!("/f{i}"),
                    offset: 0,
                },
            )
        })
        .collect();
    let local = time(blocks, per_block, |k| {
        desc_table_fields(&table, ids[(k % descriptors) as usize])
    });
    let baseline: Mutex<HashMap<u32, (u64, u64, FileRecord)>> = Mutex::new(
        ids.iter()
            .map(|&id| (id, (u64::from(id), 1, FileRecord::default())))
            .collect(),
    );
    let local_base = time(blocks, per_block, |k| {
        locked_local(&baseline, ids[(k % descriptors) as usize])
    });

    // Global descriptors' fields (evt's `seen`): read, then store.
    let fields = FieldTable::<EvtRecord, 1>::default();
    let gids: Vec<u64> = (0..descriptors).map(|i| 0x5eed_0000 + i * 7919).collect();
    let global = time(blocks, per_block, |k| {
        seqlock_fields(&fields, gids[(k % descriptors) as usize])
    });
    // The table before the seqlock (2026-11-28): one mutex, hashbrown's
    // seeded foldhash, two lookups per call.
    let locked = Mutex::new(HashMap::with_hasher(
        hashbrown::DefaultHashBuilder::default(),
    ));
    let global_locked = time(blocks, per_block, |k| {
        locked_fields(&locked, gids[(k % descriptors) as usize])
    });
    let std_fields = Mutex::new(HashMap::new());
    let global_base = time(blocks, per_block, |k| {
        locked_fields(&std_fields, gids[(k % descriptors) as usize])
    });

    let (null, pinned) = null_invocation(blocks.div_ceil(4), per_block);
    println!(
        "A null invocation in the same run (a real shared-memory edge in this process, client and\nworker spinning, {pinned}): p50 {:.1} ns over {} blocks of {per_block} calls.\n",
        null.p50, null.n
    );
    println!("| descriptor kind | table | blocks | ns per call p50 | p99 | max | ratio to baseline (p50) | % of a null invocation (p50) |");
    println!("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |");
    let row = |kind: &str, what: &str, s: &Summary, base: &Summary| {
        println!(
            "| {kind} | {what} | {} | {:.1} | {:.1} | {:.1} | {:.2}× | {:.1} % |",
            s.n,
            s.p50,
            s.p99,
            s.max,
            s.p50 / base.p50,
            100.0 * s.p50 / null.p50
        );
    };
    row(
        "local (fs, timer, net)",
        "`Mutex<std HashMap>`, two lookups (baseline)",
        &local_base,
        &local_base,
    );
    row(
        "local (fs, timer, net)",
        "`DescTable`: seqlock read, slot lock",
        &local,
        &local_base,
    );
    row(
        "global fields (evt)",
        "`Mutex<std HashMap>` (baseline)",
        &global_base,
        &global_base,
    );
    row(
        "global fields (evt)",
        "`Mutex<hashbrown>`, two lookups (the table before)",
        &global_locked,
        &global_base,
    );
    row(
        "global fields (evt)",
        "`FieldTable`: seqlock read, one compare-and-swap per update, one probe",
        &global,
        &global_base,
    );
    Ok(true)
}

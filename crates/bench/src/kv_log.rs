//! The first table of `kintsugi bench kv`: what the request log of
//! `recovery = "checkpoint"` costs a request, in one process, where the
//! whole-system runs' spread (a factor of two between runs) hides it. A
//! client thread calls a server worker over a real shared-memory edge
//! (`testing::Loopback`, both spinning), the server with and without its
//! log, taking turns; the log is cut every [`CUT_EVERY`] calls, as the
//! supervisor's checkpoints cut it.

use std::sync::Arc;
use std::time::Instant;

use kintsugi_interfaces::{bench, kv};
use kintsugi_runtime::stub::Service;
use kintsugi_runtime::testing::Loopback;

use crate::kv::row;
use crate::{median_of, Pinning};

/// Calls between two cuts of the log (a 1 MiB log holds several
/// thousand kv requests).
const CUT_EVERY: usize = 1_000;

/// Distinct keys the kv calls use.
const KEYS: usize = 1_024;

/// Makes one call; its number picks the key.
type Call = Box<dyn FnMut(usize)>;

/// One kind of request: its name, a fresh server with what puts it back
/// to the state its log starts from (a checkpoint's restore, for the
/// replay table), and a caller over a loopback's connection (the call's
/// number picks the key).
struct Request {
    name: &'static str,
    server: fn() -> (Arc<dyn Service>, Restore),
    caller: fn(&Loopback) -> Call,
}

type Restore = Box<dyn Fn()>;

fn null_caller(lb: &Loopback) -> Call {
    let client = bench::Client::from_connection(lb.connection());
    Box::new(move |_| client.null().expect("a null call"))
}

fn keys() -> Vec<String> {
    (0..KEYS).map(|k| format!("key-{k}")).collect()
}

/// Puts, the call's number picking the key.
fn kv_putter(lb: &Loopback) -> Call {
    let client = kv::Client::from_connection(lb.connection());
    let keys = keys();
    Box::new(move |i| {
        client.put(&keys[i % KEYS], &[i as u8; 32]).expect("a put");
    })
}

/// Gets (`readonly`: not logged) of keys put first.
fn kv_getter(lb: &Loopback) -> Call {
    let client = kv::Client::from_connection(lb.connection());
    let keys = keys();
    for key in &keys {
        client.put(key, &[7; 32]).expect("a put");
    }
    Box::new(move |i| {
        let got = client.get(&keys[i % KEYS]).expect("a get");
        assert_eq!(got.len(), 32, "the value put");
    })
}

/// A null call: the log's own part, the request's work aside.
const NULL: Request = Request {
    name: "null",
    server: || (bench::service(Arc::new(crate::NullServer)), Box::new(|| {})),
    caller: null_caller,
};

/// A kv store, emptied to restore it (as it was when the log began).
fn kv_store() -> (Arc<dyn Service>, Restore) {
    let store = Arc::new(kintsugi_kv::Store::new(None));
    let service = kv::service(store.clone());
    (service, Box::new(move || store.clear()))
}

const KV_PUT: Request = Request {
    name: "kv put (32-byte values)",
    server: kv_store,
    caller: kv_putter,
};

const REQUESTS: [&Request; 3] = [
    &NULL,
    &KV_PUT,
    &Request {
        name: "kv get (readonly: not logged)",
        server: kv_store,
        caller: kv_getter,
    },
];

/// A loopback serving `r`, its server logged or not, its workers and the
/// calling thread (the client) placed by `pins`.
fn loopback(r: &Request, logged: bool, pins: &Pinning) -> Loopback {
    let (service, _) = (r.server)();
    pins.apart(|| match logged {
        true => Loopback::journaled(service),
        false => Loopback::new(service),
    })
}

/// Mean ns per call of `calls` calls of `r`, logged or not.
fn run(r: &Request, logged: bool, calls: usize, pins: &Pinning) -> f64 {
    let lb = loopback(r, logged, pins);
    let mut call = (r.caller)(&lb);
    let mut round = |n: usize| {
        let started = Instant::now();
        for i in 0..n {
            call(i);
            if logged && i % CUT_EVERY == CUT_EVERY - 1 {
                lb.cut_log();
            }
        }
        started.elapsed()
    };
    round(calls / 10 + 2 * KEYS); // warm-up: every key put
    round(calls).as_nanos() as f64 / calls as f64
}

/// Logged requests a replay round runs again (a 1 MiB log holds them
/// without asking for a checkpoint).
const REPLAYED: usize = 2_000;

/// Requests replayed: a null call (nothing to put back) and kv's put (a
/// get is not logged: nothing to replay).
const REPLAYS: [&Request; 2] = [&NULL, &KV_PUT];

/// Mean ns per logged request of a replay of [`REPLAYED`] calls of `r`.
fn replay(r: &Request, pins: &Pinning) -> f64 {
    let (service, restore) = (r.server)();
    let lb = pins.apart(|| Loopback::journaled(service));
    let mut call = (r.caller)(&lb);
    for i in 0..REPLAYED {
        call(i);
    }
    // Any worker may replay (every one is woken), the call's waits for
    // its turn until it is done: timed from the rollback to the next
    // call's reply.
    let started = Instant::now();
    lb.roll_back(restore);
    call(REPLAYED);
    started.elapsed().as_nanos() as f64 / REPLAYED as f64
}

/// Prints the table: `repeats` rounds of `calls` calls per request and
/// configuration.
pub fn table(calls: usize, repeats: usize) {
    println!(
        "### The log's cost per request, in process (a client thread and the server's worker over a shared-memory edge, both spinning; {calls} calls a round, median of {repeats} rounds, with and without the log taking turns)\n"
    );
    row(&[
        "request",
        "no log (ns)",
        "log (ns)",
        "log − no log (ns)",
        "× no log",
        "rounds, log (ns)",
    ]
    .map(String::from));
    row(&["---", "---:", "---:", "---:", "---:", "---"].map(String::from));
    let pins = Pinning::new();
    for r in REQUESTS {
        let (mut bare, mut logged) = (Vec::new(), Vec::new());
        for _ in 0..repeats {
            bare.push(run(r, false, calls, &pins));
            logged.push(run(r, true, calls, &pins));
        }
        let (b, l) = (median_of(&mut bare), median_of(&mut logged));
        row(&[
            r.name.to_string(),
            format!("{b:.0}"),
            format!("{l:.0}"),
            format!("{:.0}", l - b),
            format!("{:.3}", l / b),
            logged
                .iter()
                .map(|v| format!("{v:.0}"))
                .collect::<Vec<_>>()
                .join(", "),
        ]);
    }
    println!("\nReplay of {REPLAYED} logged requests after a rollback, in process, median of {repeats}:\n");
    row(&["request", "ns per request replayed", "min", "max"].map(String::from));
    row(&["---", "---:", "---:", "---:"].map(String::from));
    for r in REPLAYS {
        let mut v: Vec<f64> = (0..repeats).map(|_| replay(r, &pins)).collect();
        let m = median_of(&mut v);
        row(&[
            r.name.to_string(),
            format!("{m:.0}"),
            format!("{:.0}", v[0]),
            format!("{:.0}", v[v.len() - 1]),
        ]);
    }
    println!();
}

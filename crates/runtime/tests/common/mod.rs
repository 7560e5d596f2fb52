//! An echo service and its client call, shared by the runtime's integration tests.

use std::sync::atomic::{AtomicU64, Ordering};

use kintsugi_runtime::priority;
use kintsugi_runtime::stub::{Caller, Dispatched, Fault, InterfaceInfo, ReplyStatus, Service};
use kintsugi_runtime::wire::{Reader, Writer};
use kintsugi_runtime::Connection;

pub static ECHO: InterfaceInfo = InterfaceInfo {
    name: "echo",
    hash: 0xec40,
    functions: &["echo", "count", "whoami"],
    readonly: &[],
};

/// Echoes its argument; counts calls per instance; tells which thread
/// served a call, at what priority.
#[derive(Default)]
pub struct EchoService {
    pub calls: AtomicU64,
}

impl Service for EchoService {
    fn interface(&self) -> &'static InterfaceInfo {
        &ECHO
    }
    fn client_died(&self, _client: u32) {}
    fn dispatch(&self, _c: &Caller, func: u32, req: &[u8], resp: &mut [u8]) -> Dispatched {
        let n = self.calls.fetch_add(1, Ordering::Relaxed) + 1;
        let mut r = Reader::new(req);
        let mut w = Writer::new(resp);
        match func {
            0 => {
                let b = match r.bytes() {
                    Ok(b) => b,
                    Err(e) => return Dispatched::Refused(e.into()),
                };
                w.bytes(b).unwrap();
            }
            1 => w.u64(n).unwrap(),
            2 => {
                let tid = rustix::thread::gettid().as_raw_nonzero().get();
                let p = priority::of_thread(tid).unwrap();
                w.u32(tid as u32).unwrap();
                w.u32(p.word()).unwrap();
            }
            f => return Dispatched::Refused(kintsugi_runtime::stub::Refusal::UnknownFunction(f)),
        }
        Dispatched::Ok(w.len())
    }
}

pub fn echo(conn: &Connection, data: &[u8], epoch: Option<u64>) -> Result<Vec<u8>, Fault> {
    conn.call(
        0,
        epoch,
        |w| w.bytes(data),
        |r| match r {
            ReplyStatus::Ok(mut r) => Ok(r.bytes()?.to_vec()),
            ReplyStatus::AppError(_) => unreachable!(),
        },
    )
}

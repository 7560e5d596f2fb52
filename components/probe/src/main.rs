//! probe: a component for isolation tests. It tries to connect to every
//! interface kintsugi knows, lists the shared-memory channels among its open
//! descriptors, reads the note its servers leave in their pools (bench-echo
//! writes one at the start of its pool's second page), prints all of it as
//! JSON on stdout and exits.

#![forbid(unsafe_code)]

use std::sync::atomic::Ordering;

use kintsugi_runtime::shm::page_size;
use kintsugi_runtime::{Incarnation, Runtime};

/// The text at the start of the second page of the pool of the server that
/// provides `interface`, mapped on its own as an mm client maps a granted page.
fn pool_note(rt: &Runtime, interface: &str) -> anyhow::Result<Option<String>> {
    let Some(pool) = rt.server_pool(interface) else {
        return Ok(None);
    };
    let page = pool.map_range(page_size(), page_size())?;
    let text: Vec<u8> = page
        .bytes(0, page.len())
        .iter()
        .map(|b| b.load(Ordering::Relaxed))
        .take_while(|b| *b != 0)
        .collect();
    Ok(Some(String::from_utf8_lossy(&text).into_owned()))
}

fn main() {
    kintsugi_runtime::run(|rt| {
        let rt = rt.clone();
        Ok(Incarnation::main(move || {
            let connect: serde_json::Map<String, serde_json::Value> = kintsugi_interfaces::ALL
                .iter()
                .map(|info| {
                    let outcome = match rt.connect(info) {
                        Ok(_) => "granted".to_string(),
                        Err(e) => e.to_string(),
                    };
                    (info.name.to_string(), outcome.into())
                })
                .collect();
            let channels: Vec<String> = std::fs::read_dir("/proc/self/fd")?
                .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
                .map(|target| target.display().to_string())
                .filter(|t| t.contains("kintsugi:"))
                .collect();
            let mut pools = serde_json::Map::new();
            for info in kintsugi_interfaces::ALL {
                if let Some(note) = pool_note(&rt, info.name)? {
                    pools.insert(info.name.to_string(), note.into());
                }
            }
            println!(
                "{}",
                serde_json::json!({
                    "component": rt.name(),
                    "connect": connect,
                    "channels": channels,
                    "pools": pools,
                })
            );
            Ok(())
        }))
    })
}

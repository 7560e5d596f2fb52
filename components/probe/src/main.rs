//! probe: a component for isolation tests. It tries to connect to every
//! interface kintsugi knows, lists the shared-memory channels among its open
//! descriptors, prints both as JSON on stdout and exits.

use kintsugi_runtime::Incarnation;

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
            println!(
                "{}",
                serde_json::json!({ "component": rt.name(), "connect": connect, "channels": channels })
            );
            Ok(())
        }))
    })
}

//! Logging for component processes: `tracing` to stderr, filtered by
//! `KINTSUGI_LOG` (default `info`), each line naming the component.

use tracing_subscriber::EnvFilter;

pub fn init(component: &str) {
    let filter = EnvFilter::try_from_env("KINTSUGI_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .without_time()
        .with_thread_names(false)
        .fmt_fields(tracing_subscriber::fmt::format::DefaultFields::new())
        .try_init();
    tracing::debug!(component, "booted");
}

//! Logging for component processes: `tracing` to stderr, filtered by
//! `KINTSUGI_LOG` (default `info`), in colour only on a terminal, each
//! line starting with the component's name (its processes share the
//! supervisor's stderr with every other component).

use std::fmt;

use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::{DefaultFields, Format, Writer};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::EnvFilter;

/// The default format, after `<component>: `.
struct Named {
    component: String,
    inner: Format<tracing_subscriber::fmt::format::Full, ()>,
}

impl<S, N> FormatEvent<S, N> for Named
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        write!(writer, "{}:", self.component)?;
        self.inner.format_event(ctx, writer, event)
    }
}

pub fn init(component: &str) {
    let filter = EnvFilter::try_from_env("KINTSUGI_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
        .fmt_fields(DefaultFields::new())
        .event_format(Named {
            component: component.to_string(),
            inner: tracing_subscriber::fmt::format()
                .with_target(false)
                .with_thread_names(false)
                .with_ansi(ansi)
                .without_time(),
        })
        .try_init();
    tracing::debug!("booted");
}

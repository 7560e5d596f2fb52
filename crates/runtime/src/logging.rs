//! Logging for component processes: `tracing` to stderr, filtered by
//! `KINTSUGI_LOG` (default `info`), in colour as [`ansi_wanted`] says, each
//! line naming the component (its processes share the supervisor's stderr
//! with every other component): `ramfs: INFO …` as text, or with
//! `KINTSUGI_LOG_FORMAT=json` one JSON object per line whose first fields
//! are `"component"`, `"pid"` and `"epoch"` (0 in the zygote, which forks
//! the incarnations and never serves).

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::{DefaultFields, Format, Full, Json, JsonFields, Writer};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::EnvFilter;

/// Whether a component's logs are to be JSON lines: with
/// `KINTSUGI_LOG_FORMAT=json`, and with `journal`, where the supervisor
/// turns each line into a journal entry with its fields.
pub fn json_requested() -> bool {
    std::env::var("KINTSUGI_LOG_FORMAT").is_ok_and(|v| v == "json" || v == "journal")
}

/// Whether log lines get ANSI colours: `KINTSUGI_COLOR=always` or
/// `never` (what `kintsugi --color` sets, for the supervisor and every
/// component it starts), else (`auto`) only on a terminal and without
/// `NO_COLOR` (no-color.org).
pub fn ansi_wanted() -> bool {
    match std::env::var("KINTSUGI_COLOR").as_deref() {
        Ok("always") => true,
        Ok("never") => false,
        _ => {
            std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
                && std::io::IsTerminal::is_terminal(&std::io::stderr())
        }
    }
}

/// This incarnation's epoch, for its JSON log lines (0 until it is woken).
static EPOCH: AtomicU64 = AtomicU64::new(0);

/// Records the epoch this process serves in (its log lines carry it).
pub fn set_epoch(epoch: u64) {
    EPOCH.store(epoch, Ordering::Relaxed);
}

/// A format that names the component first.
struct Named<F> {
    component: String,
    inner: F,
}

impl<S, N> FormatEvent<S, N> for Named<Format<Full, ()>>
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

impl<S, N> FormatEvent<S, N> for Named<Format<Json>>
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
        let mut line = String::new();
        self.inner
            .format_event(ctx, Writer::new(&mut line), event)?;
        // Names are [a-z0-9_-]: they need no escaping.
        match line.strip_prefix('{') {
            Some(rest) => write!(
                writer,
                "{{\"component\":\"{}\",\"pid\":{},\"epoch\":{},{rest}",
                self.component,
                std::process::id(),
                EPOCH.load(Ordering::Relaxed)
            ),
            None => writer.write_str(&line),
        }
    }
}

pub fn init(component: &str) {
    let filter = EnvFilter::try_from_env("KINTSUGI_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let ansi = ansi_wanted();
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let component = component.to_string();
    let _ = if json_requested() {
        builder
            .fmt_fields(JsonFields::new())
            .event_format(Named {
                component,
                inner: tracing_subscriber::fmt::format().json().with_target(false),
            })
            .try_init()
    } else {
        builder
            .with_ansi(ansi)
            .fmt_fields(DefaultFields::new())
            .event_format(Named {
                component,
                inner: tracing_subscriber::fmt::format()
                    .with_target(false)
                    .with_thread_names(false)
                    .with_ansi(ansi)
                    .without_time(),
            })
            .try_init()
    };
    tracing::debug!("booted");
}

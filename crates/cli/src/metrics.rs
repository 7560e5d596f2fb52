//! `kintsugi run --metrics ADDR`: a Prometheus exposition endpoint
//! (`GET /metrics`, text format 0.0.4, built with `prometheus-client`)
//! with what the supervisor knows of each component (issue 18): restarts,
//! a reboot-latency histogram, hangs found, descriptors its clients
//! rebuilt, give-ups, whether it is up, its epoch, and its own named
//! counters. Event-driven series are updated as the events happen;
//! gauges are read from the roster at each scrape.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use kintsugi_supervisor::{Event, Roster, State};
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::serve::Server;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ComponentLabel {
    component: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CounterLabel {
    component: String,
    counter: String,
}

/// Reboot times from 10 µs to about 0.3 s.
fn reboot_histogram() -> Histogram {
    Histogram::new(exponential_buckets(1e-5, 2.0, 16))
}

/// The series, shared by the event callback and the server thread.
struct Series {
    registry: Registry,
    restarts: Family<ComponentLabel, Counter>,
    hangs: Family<ComponentLabel, Counter>,
    recovered: Family<ComponentLabel, Counter>,
    give_ups: Family<ComponentLabel, Counter>,
    reboot_seconds: Family<ComponentLabel, Histogram, fn() -> Histogram>,
    up: Family<ComponentLabel, Gauge>,
    epoch: Family<ComponentLabel, Gauge>,
    counters: Family<CounterLabel, Gauge>,
    vault: Family<VaultLabel, Gauge>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct VaultLabel {
    component: String,
    /// records, bytes or descriptors.
    held: &'static str,
}

impl Series {
    fn new() -> Self {
        let (restarts, hangs, recovered, give_ups) = Default::default();
        let reboot_seconds: Family<_, _, fn() -> Histogram> =
            Family::new_with_constructor(reboot_histogram);
        let (up, epoch, counters, vault) = Default::default();
        let mut registry = Registry::with_prefix("kintsugi");
        let r = &mut registry;
        r.register(
            "restarts",
            "Micro-reboots of a component",
            Family::clone(&restarts),
        );
        r.register(
            "hangs",
            "Hangs the watchdog found in a component",
            Family::clone(&hangs),
        );
        r.register(
            "recovered_descriptors",
            "Descriptors a component's clients rebuilt after its reboots",
            Family::clone(&recovered),
        );
        r.register(
            "give_ups",
            "Times the supervisor gave up on a component",
            Family::clone(&give_ups),
        );
        r.register(
            "reboot_seconds",
            "Time from a crash's detection to the new incarnation's readiness",
            reboot_seconds.clone(),
        );
        r.register(
            "up",
            "1 if the component has a live incarnation",
            Family::clone(&up),
        );
        r.register("epoch", "The component's epoch", Family::clone(&epoch));
        r.register(
            "component_counter",
            "A counter the component publishes (ops, errors, ...)",
            Family::clone(&counters),
        );
        r.register(
            "vault",
            "What a component's vault holds (held: records, bytes, descriptors)",
            Family::clone(&vault),
        );
        Self {
            vault,
            registry,
            restarts,
            hangs,
            recovered,
            give_ups,
            reboot_seconds,
            up,
            epoch,
            counters,
        }
    }

    fn on(&self, e: &Event) {
        let label = |c: &str| ComponentLabel {
            component: c.to_string(),
        };
        match e {
            Event::Rebooted {
                component, took, ..
            } => {
                self.restarts.get_or_create(&label(component)).inc();
                self.reboot_seconds
                    .get_or_create(&label(component))
                    .observe(took.as_secs_f64());
            }
            Event::FaultReported {
                component,
                hang: true,
                ..
            }
            | Event::RolledBack { component, .. } => {
                self.hangs.get_or_create(&label(component)).inc();
            }
            Event::Recovered {
                server,
                descriptors,
                ..
            } => {
                self.recovered
                    .get_or_create(&label(server))
                    .inc_by(*descriptors);
            }
            Event::GaveUp { component, .. } => {
                self.give_ups.get_or_create(&label(component)).inc();
            }
            _ => {}
        }
    }

    /// The exposition text, with the gauges read from `roster` now.
    fn render(&self, roster: &Roster) -> String {
        for m in roster.members() {
            let l = ComponentLabel {
                component: m.name.clone(),
            };
            // Every component has every series, at 0 until something happens.
            for family in [&self.restarts, &self.hangs, &self.give_ups] {
                let _ = family.get_or_create(&l);
            }
            self.up
                .get_or_create(&l)
                .set(i64::from(m.health.state == State::Live));
            self.epoch.get_or_create(&l).set(m.epoch as i64);
            let held = roster.vault_use(&m.name);
            for (what, n) in [
                ("records", held.records),
                ("bytes", held.bytes),
                ("descriptors", held.fds),
            ] {
                self.vault
                    .get_or_create(&VaultLabel {
                        component: m.name.clone(),
                        held: what,
                    })
                    .set(n as i64);
            }
            for (counter, value) in roster.counters(&m.name) {
                self.counters
                    .get_or_create(&CounterLabel {
                        component: m.name.clone(),
                        counter,
                    })
                    .set(value as i64);
            }
        }
        let mut out = String::new();
        let _ = encode(&mut out, &self.registry);
        out
    }
}

/// The endpoint; stops serving when dropped.
pub struct Metrics {
    series: Arc<Series>,
    /// Serves each connection on a thread of its own (`serve.rs`): any
    /// local user can reach a loopback port, and one who connects and
    /// sends nothing must not hold the scrapes.
    _server: Server,
}

impl Metrics {
    /// Serves `GET /metrics` on `addr` (a loopback address: it is refused
    /// otherwise, for the endpoint has no authentication).
    pub fn start(
        addr: SocketAddr,
        roster: Arc<Roster>,
        heartbeat: Option<std::time::Duration>,
    ) -> anyhow::Result<Self> {
        anyhow::ensure!(
            addr.ip().is_loopback(),
            "--metrics {addr}: only a loopback address is served (the endpoint has no authentication)"
        );
        let listener = TcpListener::bind(addr).with_context(|| format!("--metrics {addr}"))?;
        let addr = listener.local_addr()?;
        let series = Arc::new(Series::new());
        let s = series.clone();
        let server = Server::start(
            "metrics",
            listener,
            roster.thread_turns("metrics", heartbeat),
            move |conn| {
                let _ = answer(conn, &s, &roster);
            },
            |mut conn| {
                let _ = conn.write_all(
                    b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                );
            },
        )?;
        tracing::info!("metrics at http://{addr}/metrics");
        Ok(Self {
            series,
            _server: server,
        })
    }

    /// Takes in an event the supervisor emitted.
    pub fn on(&self, e: &Event) {
        self.series.on(e);
    }
}

/// Answers one HTTP request: the metrics for `GET /metrics`, 404 for any
/// other path. A client that sends nothing is dropped after a second.
fn answer(conn: TcpStream, series: &Series, roster: &Roster) -> std::io::Result<()> {
    conn.set_read_timeout(Some(Duration::from_secs(1)))?;
    let mut request_line = String::new();
    let mut reader = BufReader::new(&conn);
    reader.read_line(&mut request_line)?;
    // The headers, up to the blank line.
    let mut header = String::new();
    while reader.read_line(&mut header)? > 2 {
        header.clear();
    }
    let (status, body) = match request_line.split_whitespace().collect::<Vec<_>>()[..] {
        ["GET", "/metrics", _] => ("200 OK", series.render(roster)),
        _ => ("404 Not Found", "only GET /metrics is served\n".to_string()),
    };
    let mut conn = conn;
    write!(
        conn,
        "HTTP/1.1 {status}\r\nContent-Type: application/openmetrics-text; version=1.0.0; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
}

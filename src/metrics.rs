//! Prometheus metrics, exposed as OpenMetrics text at `/metrics`.

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use std::time::Duration;

type Labels = Vec<(&'static str, String)>;

fn latency_histogram() -> Histogram {
    // 100 µs .. ~52 s
    Histogram::new(exponential_buckets(0.0001, 2.0, 20))
}

pub struct Metrics {
    registry: Registry,
    pub sessions_active: Gauge,
    pub sessions_created: Counter,
    pub session_duration: Histogram,
    pub sandbox_create: Family<Labels, Histogram>,
    pub exec_total: Family<Labels, Counter>,
    pub exec_latency: Family<Labels, Histogram>,
    pub agent_bytes: Family<Labels, Counter>,
    pub errors: Family<Labels, Counter>,
    pub pool_size: Family<Labels, Gauge>,
    pub net_setup: Family<Labels, Histogram>,
    pub standby_used: Family<Labels, Counter>,
    pub http_requests: Family<Labels, Counter>,
    /// Audit records not written or not forwarded, by `where`: `queue`
    /// (writer queue full), `rate` (rate limit; summarised), `cap`
    /// (session cap), `io`, `http_queue`, `http` (sink gave up), `syslog`.
    pub audit_dropped: Family<Labels, Counter>,
    /// The HTTP server's connection counters.
    pub http_conn: HttpConnStats,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("agent_sandbox");
        let sessions_active = Gauge::default();
        let sessions_created = Counter::default();
        let session_duration = Histogram::new(exponential_buckets(0.1, 2.0, 20));
        let sandbox_create = Family::<Labels, Histogram>::new_with_constructor(
            latency_histogram as fn() -> Histogram,
        );
        let exec_total = Family::<Labels, Counter>::default();
        let exec_latency = Family::<Labels, Histogram>::new_with_constructor(
            latency_histogram as fn() -> Histogram,
        );
        let agent_bytes = Family::<Labels, Counter>::default();
        let errors = Family::<Labels, Counter>::default();
        let pool_size = Family::<Labels, Gauge>::default();
        let net_setup = Family::<Labels, Histogram>::new_with_constructor(
            latency_histogram as fn() -> Histogram,
        );
        let standby_used = Family::<Labels, Counter>::default();
        let http_requests = Family::<Labels, Counter>::default();
        let audit_dropped = Family::<Labels, Counter>::default();
        registry.register(
            "audit_dropped",
            "Audit records dropped or not forwarded, by where",
            audit_dropped.clone(),
        );
        let http_conn = HttpConnStats::default();
        registry.register(
            "http_connections_refused",
            "Connections refused over max_connections / max_connections_per_ip",
            http_conn.refused_connections.clone(),
        );
        registry.register(
            "http_bad_requests",
            "Requests refused at the head (framing, size, time)",
            http_conn.bad_requests.clone(),
        );
        registry.register(
            "http_handler_panics",
            "Request handlers that panicked (their connection was closed)",
            http_conn.handler_panics.clone(),
        );
        registry.register(
            "http_connections_open",
            "Client connections open now",
            http_conn.open_connections.clone(),
        );
        registry.register(
            "sessions_active",
            "Sessions currently alive",
            sessions_active.clone(),
        );
        registry.register(
            "sessions_created",
            "Sessions created since start",
            sessions_created.clone(),
        );
        registry.register(
            "session_duration_seconds",
            "Lifetime of ended sessions",
            session_duration.clone(),
        );
        registry.register(
            "sandbox_create_seconds",
            "Time to create a sandbox (VM boot/restore + network + agent hello) by backend and template",
            sandbox_create.clone(),
        );
        registry.register(
            "exec",
            "Commands executed, by outcome (ok, nonzero, signal, timeout, error)",
            exec_total.clone(),
        );
        registry.register(
            "exec_seconds",
            "Command latency as seen by the API, by outcome",
            exec_latency.clone(),
        );
        registry.register(
            "agent_bytes",
            "Bytes exchanged with guest agents, by direction",
            agent_bytes.clone(),
        );
        registry.register("errors", "Errors by kind", errors.clone());
        registry.register(
            "pool_size",
            "Warm sandboxes ready, by template",
            pool_size.clone(),
        );
        registry.register(
            "network_setup_seconds",
            "Per-session network setup latency",
            net_setup.clone(),
        );
        registry.register(
            "standby_vmm_used",
            "Sandboxes restored into a VMM started ahead of demand, by template",
            standby_used.clone(),
        );
        registry.register(
            "http_requests",
            "HTTP requests by status class",
            http_requests.clone(),
        );
        Metrics {
            registry,
            sessions_active,
            sessions_created,
            session_duration,
            sandbox_create,
            exec_total,
            exec_latency,
            agent_bytes,
            errors,
            pool_size,
            net_setup,
            standby_used,
            http_requests,
            audit_dropped,
            http_conn,
        }
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }

    pub fn error(&self, kind: &str) {
        self.errors
            .get_or_create(&vec![("kind", kind.to_string())])
            .inc();
    }

    pub fn exec_done(&self, outcome: &str, took: Duration) {
        let l = vec![("outcome", outcome.to_string())];
        self.exec_total.get_or_create(&l).inc();
        self.exec_latency
            .get_or_create(&l)
            .observe(took.as_secs_f64());
    }

    pub fn sandbox_created(&self, backend: &str, template: &str, took: Duration) {
        self.sandbox_create
            .get_or_create(&vec![
                ("backend", backend.to_string()),
                ("template", template.to_string()),
            ])
            .observe(took.as_secs_f64());
    }

    pub fn agent_traffic(&self, bytes_in: u64, bytes_out: u64) {
        self.agent_bytes
            .get_or_create(&vec![("direction", "in".to_string())])
            .inc_by(bytes_in);
        self.agent_bytes
            .get_or_create(&vec![("direction", "out".to_string())])
            .inc_by(bytes_out);
    }

    pub fn set_pool(&self, template: &str, n: usize) {
        self.pool_size
            .get_or_create(&vec![("template", template.to_string())])
            .set(n as i64);
    }
}

/// The HTTP server's connection counters (`server::httpd` counts, this
/// module exports).
#[derive(Default, Clone)]
pub struct HttpConnStats {
    pub refused_connections: Counter,
    pub bad_requests: Counter,
    pub handler_panics: Counter,
    pub open_connections: Gauge,
}

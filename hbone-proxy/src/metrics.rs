//! The proxy's Prometheus metrics, named as Istio's so existing dashboards read them.

use istio_contract::telemetry;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::traffic::TrafficLabels;

/// Which way a captured connection went, seen from the pod the proxy serves (the refusal counter's label; the
/// traffic counters say it as ztunnel does, with `reporter`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// The pod is the client.
    Outbound,
    /// The pod is the server.
    Inbound,
}

impl Direction {
    /// The `direction` label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Direction::Outbound => "outbound",
            Direction::Inbound => "inbound",
        }
    }
}

/// Why a captured connection was refused before anything was connected for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RefusalReason {
    /// The destination is one of the proxy's own ports on an address of the pod: serving it would loop.
    SelfCall,
    /// The original destination is the listener itself: nothing redirected the connection to it.
    NotRedirected,
    /// A plaintext inbound connection headed for an address that is not the pod's.
    NotPodIp,
    /// The connection's original destination could not be read.
    NoOriginalDst,
    /// istiod's authorization policies deny the connection (inbound HBONE, plaintext or same-node).
    AuthorizationPolicy,
}

impl RefusalReason {
    /// The `reason` label value.
    pub fn as_str(self) -> &'static str {
        match self {
            RefusalReason::SelfCall => "self_call",
            RefusalReason::NotRedirected => "not_redirected",
            RefusalReason::NotPodIp => "not_pod_ip",
            RefusalReason::NoOriginalDst => "no_original_dst",
            RefusalReason::AuthorizationPolicy => "authorization_policy",
        }
    }
}

/// Labels of the refused-connection counter.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RefusalLabels {
    /// `outbound` or `inbound`.
    pub direction: String,
    /// A [`RefusalReason`] label value.
    pub reason: String,
}

/// Labels of the DNS forwarder's request counters, as ztunnel's `istio_dns_*`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DnsLabels {
    /// `udp` or `tcp`: how the pod sent the query.
    pub request_protocol: &'static str,
}

/// Labels of the dropped DNS query counter.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DnsDropLabels {
    /// `udp` or `tcp`: how the pod sent the query.
    pub request_protocol: &'static str,
    /// Why it was dropped: `in_flight_limit`, `tcp_connection_limit`, `oversized` or `malformed`.
    pub reason: &'static str,
}

/// The DNS forwarder's metrics (all pods together).
#[derive(Debug, Clone, Default)]
pub struct DnsMetrics {
    /// Queries received from pods, dropped ones included (ztunnel's `istio_dns_requests_total`).
    pub requests: Family<DnsLabels, Counter>,
    /// Queries sent upstream, one per upstream tried (ztunnel's `istio_dns_upstream_requests_total`).
    pub upstream_requests: Family<DnsLabels, Counter>,
    /// Upstream tries that failed or timed out (ztunnel's `istio_dns_upstream_failures_total`).
    pub upstream_failures: Family<DnsLabels, Counter>,
    /// Queries dropped unanswered, by reason.
    pub dropped: Family<DnsDropLabels, Counter>,
    /// Queries being resolved or answered now.
    pub in_flight: Gauge,
}

impl DnsMetrics {
    fn register(&self, registry: &mut Registry) {
        registry.register("istio_dns_requests", "DNS queries received from pods", self.requests.clone());
        registry.register(
            "istio_dns_upstream_requests",
            "DNS queries forwarded upstream, one per upstream tried",
            self.upstream_requests.clone(),
        );
        registry.register(
            "istio_dns_upstream_failures",
            "DNS queries an upstream failed or did not answer in time",
            self.upstream_failures.clone(),
        );
        registry.register(
            "istio_dns_requests_dropped",
            "DNS queries dropped unanswered (labels request_protocol, reason)",
            self.dropped.clone(),
        );
        registry.register("istio_dns_requests_in_flight", "DNS queries being resolved now", self.in_flight.clone());
    }
}

/// Labels of the HBONE limit counters.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HboneLimitLabels {
    /// Which limit: see [`HboneLimitMetrics`].
    pub reason: &'static str,
}

/// What the HBONE server's limits on 15008 turned away or cut (all pods together).
#[derive(Debug, Clone, Default)]
pub struct HboneLimitMetrics {
    /// Connections refused after the TLS handshake, by reason: `max_connections` (`HBONE_MAX_CONNECTIONS`),
    /// `max_connections_per_identity` (`HBONE_MAX_CONNECTIONS_PER_IDENTITY`), `no_alpn` (the client did not
    /// offer `h2`).
    pub refused: Family<HboneLimitLabels, Counter>,
    /// Connections the server closed because of a limit, by reason: `idle_timeout`
    /// (`HBONE_SERVER_IDLE_TIMEOUT`), `handshake_timeout` (no HTTP/2 preface in time), or the code of the GOAWAY
    /// sent for breaking an HTTP/2 limit (`enhance_your_calm`: too many resets or header bytes,
    /// `compression_error`, `frame_size_error`).
    pub terminated: Family<HboneLimitLabels, Counter>,
}

impl HboneLimitMetrics {
    fn register(&self, registry: &mut Registry) {
        registry.register(
            "hbone_connections_refused",
            "Inbound HBONE connections refused by a limit (label reason)",
            self.refused.clone(),
        );
        registry.register(
            "hbone_connections_terminated",
            "Inbound HBONE connections closed by the server because of a limit (label reason)",
            self.terminated.clone(),
        );
    }
}

/// Every metric the proxy exports.
#[derive(Debug)]
pub struct Metrics {
    /// Bytes sent to the client side of a connection (ztunnel's `istio_tcp_sent_bytes`), with ztunnel's labels.
    pub sent_bytes: Family<TrafficLabels, Counter>,
    /// Bytes received from the client side of a connection (ztunnel's `istio_tcp_received_bytes`).
    pub received_bytes: Family<TrafficLabels, Counter>,
    /// Connections opened (ztunnel's `istio_tcp_connections_opened`).
    pub connections_opened: Family<TrafficLabels, Counter>,
    /// Connections closed (ztunnel's `istio_tcp_connections_closed`), with the flag of how they ended.
    pub connections_closed: Family<TrafficLabels, Counter>,
    /// Captured connections refused at once (self-calls, connections nothing redirected, plaintext inbound to an
    /// address that is not the pod's).
    pub connections_refused: Family<RefusalLabels, Counter>,
    /// Pods with running in-pod listeners.
    pub active_proxies: Gauge,
    /// Pods whose listeners failed to start (retried every 5 s).
    pub pending_proxies: Gauge,
    /// How long each new outbound HBONE connection took to establish (TCP, TLS and HTTP/2 handshakes).
    pub hbone_connect_seconds: Histogram,
    /// The DNS forwarder's.
    pub dns: DnsMetrics,
    /// The HBONE server's limits'.
    pub hbone_limits: HboneLimitMetrics,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            sent_bytes: Family::default(),
            received_bytes: Family::default(),
            connections_opened: Family::default(),
            connections_closed: Family::default(),
            connections_refused: Family::default(),
            active_proxies: Gauge::default(),
            pending_proxies: Gauge::default(),
            // 1 ms to about 16 s.
            hbone_connect_seconds: Histogram::new(exponential_buckets(0.001, 2.0, 15)),
            dns: DnsMetrics::default(),
            hbone_limits: HboneLimitMetrics::default(),
        }
    }
}

impl Metrics {
    /// Creates the metrics and registers them in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Metrics::default();
        registry.register(telemetry::TCP_SENT_BYTES, "Bytes sent to the client of a connection", m.sent_bytes.clone());
        registry.register(
            telemetry::TCP_RECEIVED_BYTES,
            "Bytes received from the client of a connection",
            m.received_bytes.clone(),
        );
        registry.register(telemetry::TCP_CONNECTIONS_OPENED, "Connections opened", m.connections_opened.clone());
        registry.register(telemetry::TCP_CONNECTIONS_CLOSED, "Connections closed", m.connections_closed.clone());
        registry.register(
            "istio_tcp_connections_refused",
            "Captured connections refused at once (labels direction, reason)",
            m.connections_refused.clone(),
        );
        registry.register("workload_manager_active_proxy_count", "Pods with running proxies", m.active_proxies.clone());
        registry.register(
            "workload_manager_pending_proxy_count",
            "Pods whose proxy failed to start",
            m.pending_proxies.clone(),
        );
        registry.register(
            "hbone_connect_duration_seconds",
            "Time to establish an outbound HBONE connection (TCP, TLS and HTTP/2 handshakes)",
            m.hbone_connect_seconds.clone(),
        );
        m.dns.register(registry);
        m.hbone_limits.register(registry);
        m
    }

    /// Counts a connection as opened.
    pub fn opened(&self, labels: &TrafficLabels) {
        self.connections_opened.get_or_create(labels).inc();
    }

    /// Counts the connection opened with `labels` as closed with its byte totals (`from_client`, `to_client`); as
    /// ztunnel, the bytes keep the labels it opened with and the closed count carries `flag` (how it ended:
    /// [`telemetry::RESPONSE_FLAGS_NONE`] or a flag).
    pub fn closed(&self, labels: &TrafficLabels, flag: &'static str, from_client: u64, to_client: u64) {
        self.received_bytes.get_or_create(labels).inc_by(from_client);
        self.sent_bytes.get_or_create(labels).inc_by(to_client);
        self.connections_closed.get_or_create(&labels.flagged(flag)).inc();
    }

    /// Counts a captured connection refused for `reason`.
    pub fn refused(&self, direction: Direction, reason: RefusalReason) {
        let labels = RefusalLabels { direction: direction.as_str().to_owned(), reason: reason.as_str().to_owned() };
        self.connections_refused.get_or_create(&labels).inc();
    }
}

//! The proxy's Prometheus metrics, named as Istio's so existing dashboards read them.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// Which way a connection went, seen from the pod the proxy serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// The pod is the client.
    Outbound,
    /// The pod is the server.
    Inbound,
}

impl Direction {
    fn as_str(self) -> &'static str {
        match self {
            Direction::Outbound => "outbound",
            Direction::Inbound => "inbound",
        }
    }
}

/// Labels of the per-connection counters.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ConnectionLabels {
    /// `outbound` or `inbound`.
    pub direction: String,
    /// `HBONE` or `TCP`: how the connection crossed the network.
    pub protocol: String,
}

/// Every metric the proxy exports.
#[derive(Debug)]
pub struct Metrics {
    /// Bytes sent to the client side of a connection (Istio's `istio_tcp_sent_bytes`).
    pub sent_bytes: Family<ConnectionLabels, Counter>,
    /// Bytes received from the client side of a connection (Istio's `istio_tcp_received_bytes`).
    pub received_bytes: Family<ConnectionLabels, Counter>,
    /// Connections opened.
    pub connections_opened: Family<ConnectionLabels, Counter>,
    /// Connections closed.
    pub connections_closed: Family<ConnectionLabels, Counter>,
    /// Pods with running in-pod listeners.
    pub active_proxies: Gauge,
    /// Pods whose listeners failed to start (retried every 5 s).
    pub pending_proxies: Gauge,
    /// How long each new outbound HBONE connection took to establish (TCP, TLS and HTTP/2 handshakes).
    pub hbone_connect_seconds: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            sent_bytes: Family::default(),
            received_bytes: Family::default(),
            connections_opened: Family::default(),
            connections_closed: Family::default(),
            active_proxies: Gauge::default(),
            pending_proxies: Gauge::default(),
            // 1 ms to about 16 s.
            hbone_connect_seconds: Histogram::new(exponential_buckets(0.001, 2.0, 15)),
        }
    }
}

impl Metrics {
    /// Creates the metrics and registers them in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Metrics::default();
        registry.register("istio_tcp_sent_bytes", "Bytes sent to the client of a connection", m.sent_bytes.clone());
        registry.register(
            "istio_tcp_received_bytes",
            "Bytes received from the client of a connection",
            m.received_bytes.clone(),
        );
        registry.register("istio_tcp_connections_opened", "Connections opened", m.connections_opened.clone());
        registry.register("istio_tcp_connections_closed", "Connections closed", m.connections_closed.clone());
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
        m
    }

    /// Counts a connection as opened.
    pub fn opened(&self, direction: Direction, protocol: &str) {
        self.connections_opened.get_or_create(&labels(direction, protocol)).inc();
    }

    /// Counts a connection as closed with its byte totals (`from_client`, `to_client`).
    pub fn closed(&self, direction: Direction, protocol: &str, from_client: u64, to_client: u64) {
        let labels = labels(direction, protocol);
        self.received_bytes.get_or_create(&labels).inc_by(from_client);
        self.sent_bytes.get_or_create(&labels).inc_by(to_client);
        self.connections_closed.get_or_create(&labels).inc();
    }
}

fn labels(direction: Direction, protocol: &str) -> ConnectionLabels {
    ConnectionLabels { direction: direction.as_str().to_owned(), protocol: protocol.to_owned() }
}

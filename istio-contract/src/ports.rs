//! The ports of Istio's data plane on a node. The proxy (ztunnel, our hbone-proxy, or a sidecar's Envoy)
//! listens on them and the redirect rules send traffic to them, so both sides must agree on every number.

/// The proxy's admin endpoint (`/config_dump`), bound to localhost.
pub const ADMIN: u16 = 15000;
/// Outbound capture: every redirected connection a pod opens lands here.
pub const OUTBOUND: u16 = 15001;
/// Plaintext inbound capture: redirected connections to a pod that did not come over HBONE.
pub const INBOUND_PLAINTEXT: u16 = 15006;
/// HBONE: mutual-TLS HTTP/2 CONNECT between proxies; never redirected.
pub const HBONE: u16 = 15008;
/// The proxy's merged Prometheus stats (and the sidecar's health check port); never captured inbound.
pub const STATS: u16 = 15020;
/// The proxy's readiness endpoint (`/healthz/ready`); never captured inbound.
pub const READINESS: u16 = 15021;
/// The proxy's DNS server.
pub const DNS: u16 = 15053;
/// Envoy's Prometheus endpoint in a sidecar; never captured inbound.
pub const ENVOY_PROMETHEUS: u16 = 15090;
/// Every port the proxy itself listens on in a pod: a connection redirected to one of these would loop.
pub const PROXY_OWN: [u16; 7] = [ADMIN, OUTBOUND, INBOUND_PLAINTEXT, HBONE, STATS, READINESS, DNS];
/// istio-cni's metrics port on the node (`MONITORING_PORT`).
pub const CNI_MONITORING: u16 = 15014;
/// The node agent's localhost-only admin port (`ADMIN_PORT`): `GET /debug/pods/...`, which
/// `node-agent explain` reads. Ours, not Istio's: no Istio component uses it, so it cannot clash with a proxy's
/// ports in the node's network namespace.
pub const CNI_ADMIN: u16 = 15016;
/// istio-cni's readiness port on the node (`READINESS_PORT`).
pub const CNI_READINESS: u16 = 8000;

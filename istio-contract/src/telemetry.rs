//! ztunnel's traffic metrics: the `istio_tcp_*` counters, their labels and the fixed values those labels take.
//! Istio's dashboards and the queries users already have (`sum(istio_tcp_sent_bytes_total{reporter="destination",
//! destination_workload="…"})`) select on exactly these names and values, so a node proxy that means to stand in
//! for ztunnel exports them unchanged. A label with nothing known for it reads [`UNKNOWN`], never an empty string.

/// Bytes the server side sent back to the client, per connection (exposed as `istio_tcp_sent_bytes_total`).
pub const TCP_SENT_BYTES: &str = "istio_tcp_sent_bytes";
/// Bytes received from the client side, per connection (exposed as `istio_tcp_received_bytes_total`).
pub const TCP_RECEIVED_BYTES: &str = "istio_tcp_received_bytes";
/// Connections opened (exposed as `istio_tcp_connections_opened_total`).
pub const TCP_CONNECTIONS_OPENED: &str = "istio_tcp_connections_opened";
/// Connections closed (exposed as `istio_tcp_connections_closed_total`).
pub const TCP_CONNECTIONS_CLOSED: &str = "istio_tcp_connections_closed";

/// The label names of the `istio_tcp_*` counters, one constant each.
pub mod label {
    /// Who reports the series: [`super::REPORTER_SOURCE`] (the client's proxy) or
    /// [`super::REPORTER_DESTINATION`] (the server's).
    pub const REPORTER: &str = "reporter";
    /// The client's workload (its Deployment, Job… name, as Istio derives it from the pod).
    pub const SOURCE_WORKLOAD: &str = "source_workload";
    /// The client's canonical service.
    pub const SOURCE_CANONICAL_SERVICE: &str = "source_canonical_service";
    /// The client's canonical revision.
    pub const SOURCE_CANONICAL_REVISION: &str = "source_canonical_revision";
    /// The client's namespace.
    pub const SOURCE_WORKLOAD_NAMESPACE: &str = "source_workload_namespace";
    /// The client's SPIFFE identity, when mutual TLS proved it.
    pub const SOURCE_PRINCIPAL: &str = "source_principal";
    /// The client's app (ztunnel gives its canonical service).
    pub const SOURCE_APP: &str = "source_app";
    /// The client's version (ztunnel gives its canonical revision).
    pub const SOURCE_VERSION: &str = "source_version";
    /// The client's cluster id.
    pub const SOURCE_CLUSTER: &str = "source_cluster";
    /// The host name of the service the client addressed.
    pub const DESTINATION_SERVICE: &str = "destination_service";
    /// The namespace of the service the client addressed.
    pub const DESTINATION_SERVICE_NAMESPACE: &str = "destination_service_namespace";
    /// The name of the service the client addressed.
    pub const DESTINATION_SERVICE_NAME: &str = "destination_service_name";
    /// The server's workload.
    pub const DESTINATION_WORKLOAD: &str = "destination_workload";
    /// The server's canonical service.
    pub const DESTINATION_CANONICAL_SERVICE: &str = "destination_canonical_service";
    /// The server's canonical revision.
    pub const DESTINATION_CANONICAL_REVISION: &str = "destination_canonical_revision";
    /// The server's namespace.
    pub const DESTINATION_WORKLOAD_NAMESPACE: &str = "destination_workload_namespace";
    /// The server's SPIFFE identity.
    pub const DESTINATION_PRINCIPAL: &str = "destination_principal";
    /// The server's app (its canonical service).
    pub const DESTINATION_APP: &str = "destination_app";
    /// The server's version (its canonical revision).
    pub const DESTINATION_VERSION: &str = "destination_version";
    /// The server's cluster id.
    pub const DESTINATION_CLUSTER: &str = "destination_cluster";
    /// The protocol the proxy saw: always [`super::REQUEST_PROTOCOL_TCP`] for a node proxy.
    pub const REQUEST_PROTOCOL: &str = "request_protocol";
    /// Why a connection failed: [`super::RESPONSE_FLAGS_NONE`] or a flag.
    pub const RESPONSE_FLAGS: &str = "response_flags";
    /// [`super::SECURITY_POLICY_MUTUAL_TLS`] over HBONE, [`super::SECURITY_POLICY_SAME_NODE`] over the same-node
    /// fast path, else [`super::SECURITY_POLICY_UNKNOWN`].
    pub const CONNECTION_SECURITY_POLICY: &str = "connection_security_policy";
}

/// Every label of the `istio_tcp_*` counters, in the order ztunnel writes them.
pub const TRAFFIC_LABELS: [&str; 23] = [
    label::REPORTER,
    label::SOURCE_WORKLOAD,
    label::SOURCE_CANONICAL_SERVICE,
    label::SOURCE_CANONICAL_REVISION,
    label::SOURCE_WORKLOAD_NAMESPACE,
    label::SOURCE_PRINCIPAL,
    label::SOURCE_APP,
    label::SOURCE_VERSION,
    label::SOURCE_CLUSTER,
    label::DESTINATION_SERVICE,
    label::DESTINATION_SERVICE_NAMESPACE,
    label::DESTINATION_SERVICE_NAME,
    label::DESTINATION_WORKLOAD,
    label::DESTINATION_CANONICAL_SERVICE,
    label::DESTINATION_CANONICAL_REVISION,
    label::DESTINATION_WORKLOAD_NAMESPACE,
    label::DESTINATION_PRINCIPAL,
    label::DESTINATION_APP,
    label::DESTINATION_VERSION,
    label::DESTINATION_CLUSTER,
    label::REQUEST_PROTOCOL,
    label::RESPONSE_FLAGS,
    label::CONNECTION_SECURITY_POLICY,
];

/// `reporter` of the series the client's proxy (outbound) writes.
pub const REPORTER_SOURCE: &str = "source";
/// `reporter` of the series the server's proxy (inbound) writes.
pub const REPORTER_DESTINATION: &str = "destination";
/// `request_protocol` of every connection a node proxy carries: it does not parse HTTP.
pub const REQUEST_PROTOCOL_TCP: &str = "tcp";
/// `response_flags` of a connection nothing went wrong with.
pub const RESPONSE_FLAGS_NONE: &str = "-";
/// `response_flags` of an inbound connection whose app could not be connected to.
pub const RESPONSE_FLAG_CONNECTION_FAILURE: &str = "CONNECT";
/// `response_flags` of a connection refused by policy.
pub const RESPONSE_FLAG_DENIED: &str = "DENY";
/// `connection_security_policy` of a connection carried over HBONE (mutual TLS).
pub const SECURITY_POLICY_MUTUAL_TLS: &str = "mutual_tls";
/// `connection_security_policy` of a plaintext connection.
pub const SECURITY_POLICY_UNKNOWN: &str = "unknown";
/// `connection_security_policy` of a connection between two pods enrolled in the same node proxy, carried by its
/// same-node fast path: no TLS (the bytes never leave the node's kernel), both identities known from the pods'
/// enrollment. Ours: ztunnel has no such path, so no value for it.
pub const SECURITY_POLICY_SAME_NODE: &str = "same_node";
/// The value of any label nothing is known for (an address outside the mesh, a service never resolved).
pub const UNKNOWN: &str = "unknown";
/// The cluster id ztunnel (and istiod) use when `CLUSTER_ID` is not set.
pub const DEFAULT_CLUSTER_ID: &str = "Kubernetes";

#[cfg(test)]
mod tests {
    use super::*;

    /// Every label once, each a valid Prometheus label name.
    #[test]
    fn labels_are_distinct_and_valid() {
        let unique: std::collections::BTreeSet<_> = TRAFFIC_LABELS.iter().collect();
        assert_eq!(unique.len(), TRAFFIC_LABELS.len(), "no label twice");
        assert!(TRAFFIC_LABELS.iter().all(|l| l.bytes().all(|b| b.is_ascii_lowercase() || b == b'_')));
    }
}

//! The labels of the `istio_tcp_*` counters, as ztunnel writes them, so Istio's dashboards and users' queries work
//! on this proxy's metrics unchanged: who reports (the client's side or the server's), both ends' workload,
//! canonical service, namespace, principal and cluster, and how the connection went.
//!
//! Every value comes from the workload directory, the pod's own certificate or a verified peer certificate, or is
//! one of a few fixed words; never from what a peer sends (baggage, headers), so a hostile pod cannot mint series:
//! there are at most as many as the directory has workloads, and anything not in it reads `unknown`.

use hbone::Identity;
use istio_contract::telemetry::{self, label, UNKNOWN};
use prometheus_client::encoding::{EncodeLabelSet, LabelSetEncoder};

use crate::context::PodContext;
use crate::directory::Destination;

/// One end of a connection as the labels show it; `None` reads `unknown`.
#[derive(Debug, Clone, Default, Hash, PartialEq, Eq)]
pub struct Peer {
    /// The workload (a Deployment's name, say).
    pub workload: Option<String>,
    /// Its canonical service, also shown as its app.
    pub canonical_service: Option<String>,
    /// Its canonical revision, also shown as its version.
    pub canonical_revision: Option<String>,
    /// Its namespace.
    pub namespace: Option<String>,
    /// Its SPIFFE identity, when the connection's mutual TLS proves (or will prove) it.
    pub principal: Option<String>,
    /// Its cluster.
    pub cluster: Option<String>,
}

impl Peer {
    /// The workload the directory lists at an address; `cluster` when it is listed without one (the node's own).
    pub fn listed(destination: &Destination, cluster: &str) -> Self {
        let w = &destination.workload;
        let known = |value: &str| (!value.is_empty()).then(|| value.to_owned());
        Peer {
            workload: known(&w.workload_name),
            canonical_service: known(&w.canonical_name),
            canonical_revision: known(&w.canonical_revision),
            namespace: known(&w.namespace),
            principal: Some(destination.identity.to_string()),
            cluster: known(&w.cluster_id).or_else(|| known(cluster)),
        }
    }

    /// The pod `pod` serves, with its own identity as principal: the directory's entry for one of its addresses
    /// (the one listed with that identity), else only what its ZDS enrollment said (its namespace).
    pub fn local(pod: &PodContext) -> Self {
        let cert = pod.cert();
        let own = cert.identity();
        let listed = pod.ips.iter().find_map(|ip| pod.mesh.directory.lookup(*ip).filter(|d| d.identity == *own));
        match listed {
            Some(destination) => Peer::listed(&destination, &pod.mesh.cluster_id),
            None => Peer {
                namespace: Some(pod.baggage.namespace.clone()).filter(|ns| !ns.is_empty()),
                principal: Some(own.to_string()),
                cluster: Some(pod.mesh.cluster_id.clone()).filter(|c| !c.is_empty()),
                ..Peer::default()
            },
        }
    }

    /// The client of an inbound HBONE connection from `address`, proven to be `identity` by its certificate: the
    /// directory's entry for that address only if it is listed with that same identity (else its workload is
    /// `unknown`), and the proven identity as principal.
    pub fn verified_client(pod: &PodContext, address: std::net::IpAddr, identity: &Identity) -> Self {
        let listed = pod.mesh.directory.lookup(address).filter(|d| d.identity == *identity);
        let mut peer = listed.map(|d| Peer::listed(&d, &pod.mesh.cluster_id)).unwrap_or_default();
        peer.principal = Some(identity.to_string());
        peer
    }

    /// The client of a plaintext inbound connection from `address`: whatever the directory lists there, without a
    /// principal (nothing proved it).
    pub fn plaintext_client(pod: &PodContext, address: std::net::IpAddr) -> Self {
        let listed = pod.mesh.directory.lookup(address);
        let peer = listed.map(|d| Peer::listed(&d, &pod.mesh.cluster_id)).unwrap_or_default();
        Peer { principal: None, ..peer }
    }
}

/// How a connection was carried, as its `connection_security_policy` label says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Security {
    /// Over HBONE: mutual TLS proved the client's identity.
    MutualTls,
    /// Over the same-node fast path ([`crate::fast_path`]): no TLS, both identities known from the pods' enrollment.
    SameNode,
    /// In plaintext: no identity proved.
    Plaintext,
}

impl Security {
    /// The label value.
    fn policy(self) -> &'static str {
        match self {
            Security::MutualTls => telemetry::SECURITY_POLICY_MUTUAL_TLS,
            Security::SameNode => telemetry::SECURITY_POLICY_SAME_NODE,
            Security::Plaintext => telemetry::SECURITY_POLICY_UNKNOWN,
        }
    }
}

/// The labels of one connection's `istio_tcp_*` series.
#[derive(Debug, Clone, Hash, PartialEq, Eq)]
pub struct TrafficLabels {
    /// [`telemetry::REPORTER_SOURCE`] (outbound) or [`telemetry::REPORTER_DESTINATION`] (inbound).
    pub reporter: &'static str,
    /// The client.
    pub source: Peer,
    /// The server.
    pub destination: Peer,
    /// [`telemetry::RESPONSE_FLAGS_NONE`] or the flag of what went wrong.
    pub response_flags: &'static str,
    /// [`telemetry::SECURITY_POLICY_MUTUAL_TLS`] over HBONE, [`telemetry::SECURITY_POLICY_SAME_NODE`] over the
    /// same-node fast path, else [`telemetry::SECURITY_POLICY_UNKNOWN`].
    pub security_policy: &'static str,
}

impl TrafficLabels {
    /// What the client's proxy reports; over HBONE the client's principal is the pod's own identity, as its
    /// certificate proves it to the server (over the fast path, as its enrollment does); in plaintext there is none.
    pub fn outbound(mut source: Peer, destination: Peer, security: Security) -> Self {
        if security == Security::Plaintext {
            source.principal = None;
        }
        Self::new(telemetry::REPORTER_SOURCE, source, destination, security)
    }

    /// What the server's proxy reports.
    pub fn inbound(source: Peer, destination: Peer, security: Security) -> Self {
        Self::new(telemetry::REPORTER_DESTINATION, source, destination, security)
    }

    fn new(reporter: &'static str, source: Peer, destination: Peer, security: Security) -> Self {
        let security_policy = security.policy();
        TrafficLabels { reporter, source, destination, response_flags: telemetry::RESPONSE_FLAGS_NONE, security_policy }
    }

    /// The same connection, ended with `flag`.
    pub fn flagged(&self, flag: &'static str) -> Self {
        TrafficLabels { response_flags: flag, ..self.clone() }
    }

    /// Every label and its value, in ztunnel's order ([`telemetry::TRAFFIC_LABELS`]).
    fn pairs(&self) -> [(&'static str, &str); 23] {
        fn value(v: &Option<String>) -> &str {
            v.as_deref().unwrap_or(UNKNOWN)
        }
        let (s, d) = (&self.source, &self.destination);
        [
            (label::REPORTER, self.reporter),
            (label::SOURCE_WORKLOAD, value(&s.workload)),
            (label::SOURCE_CANONICAL_SERVICE, value(&s.canonical_service)),
            (label::SOURCE_CANONICAL_REVISION, value(&s.canonical_revision)),
            (label::SOURCE_WORKLOAD_NAMESPACE, value(&s.namespace)),
            (label::SOURCE_PRINCIPAL, value(&s.principal)),
            (label::SOURCE_APP, value(&s.canonical_service)),
            (label::SOURCE_VERSION, value(&s.canonical_revision)),
            (label::SOURCE_CLUSTER, value(&s.cluster)),
            // Services are not resolved: the proxy connects to the pod address the app dialled.
            (label::DESTINATION_SERVICE, UNKNOWN),
            (label::DESTINATION_SERVICE_NAMESPACE, UNKNOWN),
            (label::DESTINATION_SERVICE_NAME, UNKNOWN),
            (label::DESTINATION_WORKLOAD, value(&d.workload)),
            (label::DESTINATION_CANONICAL_SERVICE, value(&d.canonical_service)),
            (label::DESTINATION_CANONICAL_REVISION, value(&d.canonical_revision)),
            (label::DESTINATION_WORKLOAD_NAMESPACE, value(&d.namespace)),
            (label::DESTINATION_PRINCIPAL, value(&d.principal)),
            (label::DESTINATION_APP, value(&d.canonical_service)),
            (label::DESTINATION_VERSION, value(&d.canonical_revision)),
            (label::DESTINATION_CLUSTER, value(&d.cluster)),
            (label::REQUEST_PROTOCOL, telemetry::REQUEST_PROTOCOL_TCP),
            (label::RESPONSE_FLAGS, self.response_flags),
            (label::CONNECTION_SECURITY_POLICY, self.security_policy),
        ]
    }
}

impl EncodeLabelSet for TrafficLabels {
    fn encode(&self, encoder: &mut LabelSetEncoder) -> Result<(), std::fmt::Error> {
        self.pairs().encode(encoder)
    }
}

#[cfg(test)]
mod tests {
    use prometheus_client::encoding::text::encode;
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::metrics::family::Family;
    use prometheus_client::registry::Registry;

    use super::*;

    #[test]
    fn every_label_is_written_in_ztunnels_order_with_unknown_for_the_missing() {
        let source = Peer {
            workload: Some("web".into()),
            canonical_service: Some("shop".into()),
            canonical_revision: Some("v1".into()),
            namespace: Some("ns".into()),
            principal: Some("spiffe://td/ns/ns/sa/web".into()),
            cluster: Some("Kubernetes".into()),
        };
        let labels = TrafficLabels::outbound(source, Peer::default(), Security::Plaintext);
        let names: Vec<&str> = labels.pairs().iter().map(|(name, _)| *name).collect();
        assert_eq!(names, telemetry::TRAFFIC_LABELS);

        let family = Family::<TrafficLabels, Counter>::default();
        family.get_or_create(&labels).inc_by(7);
        let mut registry = Registry::default();
        registry.register(telemetry::TCP_SENT_BYTES, "test", family);
        let mut text = String::new();
        encode(&mut text, &registry).unwrap();
        let want = "istio_tcp_sent_bytes_total{reporter=\"source\",source_workload=\"web\",\
            source_canonical_service=\"shop\",source_canonical_revision=\"v1\",source_workload_namespace=\"ns\",\
            source_principal=\"unknown\",source_app=\"shop\",source_version=\"v1\",source_cluster=\"Kubernetes\",\
            destination_service=\"unknown\",destination_service_namespace=\"unknown\",\
            destination_service_name=\"unknown\",destination_workload=\"unknown\",\
            destination_canonical_service=\"unknown\",destination_canonical_revision=\"unknown\",\
            destination_workload_namespace=\"unknown\",destination_principal=\"unknown\",destination_app=\"unknown\",\
            destination_version=\"unknown\",destination_cluster=\"unknown\",request_protocol=\"tcp\",\
            response_flags=\"-\",connection_security_policy=\"unknown\"} 7";
        assert!(text.contains(want), "plaintext: no principal proven, policy unknown:\n{text}");
    }

    #[test]
    fn a_flag_changes_only_the_response_flags() {
        let labels = TrafficLabels::inbound(Peer::default(), Peer::default(), Security::MutualTls);
        let flagged = labels.flagged(telemetry::RESPONSE_FLAG_CONNECTION_FAILURE);
        assert_eq!(flagged.response_flags, "CONNECT");
        assert_eq!(TrafficLabels { response_flags: labels.response_flags, ..flagged }, labels);
        assert_eq!((labels.reporter, labels.security_policy), ("destination", "mutual_tls"));
    }

    #[test]
    fn the_fast_path_keeps_the_clients_principal_under_its_own_policy() {
        let source = Peer { principal: Some("spiffe://td/ns/ns/sa/web".into()), ..Peer::default() };
        let labels = TrafficLabels::outbound(source.clone(), Peer::default(), Security::SameNode);
        assert_eq!(labels.security_policy, "same_node");
        assert_eq!(labels.source.principal, source.principal, "the enrollment proves who the client is");
        let plaintext = TrafficLabels::outbound(source, Peer::default(), Security::Plaintext);
        assert_eq!((plaintext.security_policy, plaintext.source.principal), ("unknown", None));
    }
}

//! The labels of the `istio_tcp_*` counters, as ztunnel writes them, so Istio's dashboards and users' queries work
//! on this proxy's metrics unchanged: who reports (the client's side or the server's), both ends' workload,
//! canonical service, namespace, principal and cluster, and how the connection went.
//!
//! Every value comes from the workload directory, the pod's own certificate or a verified peer certificate, or is
//! one of a few fixed words; never from what a peer sends (baggage, headers), so a hostile pod cannot mint series:
//! there are at most as many as the directory has workloads, and anything not in it reads `unknown`.
//!
//! An end whose identity is proven (a client's certificate, the pod's own) is labelled with the directory's
//! workload at its address only when the directory lists that address with that same identity; otherwise its
//! workload, canonical names and namespace read `unknown` (for the pod's own end: what its enrollment said), so a
//! workload cannot pass its traffic off as another's by sending from an address listed for someone else. The
//! constructors take the directory and plain values, not a pod, so this rule is tested here.

use std::net::IpAddr;

use hbone::Identity;
use istio_contract::telemetry::{self, label, UNKNOWN};
use prometheus_client::encoding::{EncodeLabelSet, LabelSetEncoder};

use crate::directory::{Destination, Directory};

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

    /// A pod this proxy serves, at addresses `ips`, whose certificate proves `own`, with its own identity as
    /// principal: the directory's entry for one of its addresses (the one listed with that identity), else only
    /// what its ZDS enrollment said (its `namespace`) and the node's `cluster`.
    pub fn local(directory: &Directory, cluster: &str, ips: &[IpAddr], own: &Identity, namespace: &str) -> Self {
        let listed = ips.iter().find_map(|ip| directory.lookup(*ip).filter(|d| d.identity == *own));
        match listed {
            Some(destination) => Peer::listed(&destination, cluster),
            None => Peer {
                namespace: Some(namespace.to_owned()).filter(|ns| !ns.is_empty()),
                principal: Some(own.to_string()),
                cluster: Some(cluster.to_owned()).filter(|c| !c.is_empty()),
                ..Peer::default()
            },
        }
    }

    /// The client of an inbound HBONE connection from `address`, proven to be `identity` by its certificate: the
    /// directory's entry for that address only if it is listed with that same identity (else its workload is
    /// `unknown`), and the proven identity as principal.
    pub fn verified_client(directory: &Directory, cluster: &str, address: IpAddr, identity: &Identity) -> Self {
        let listed = directory.lookup(address).filter(|d| d.identity == *identity);
        let mut peer = listed.map(|d| Peer::listed(&d, cluster)).unwrap_or_default();
        peer.principal = Some(identity.to_string());
        peer
    }

    /// The client of a plaintext inbound connection from `address`: whatever the directory lists there, without a
    /// principal (nothing proved it).
    pub fn plaintext_client(directory: &Directory, cluster: &str, address: IpAddr) -> Self {
        let listed = directory.lookup(address);
        let peer = listed.map(|d| Peer::listed(&d, cluster)).unwrap_or_default();
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
    use crate::directory::{Protocol, Workload};

    const CLUSTER: &str = "Kubernetes";
    const TRUST_DOMAIN: &str = "cluster.local";

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    fn identity(namespace: &str, service_account: &str) -> Identity {
        Identity::new(TRUST_DOMAIN, namespace, service_account).unwrap()
    }

    /// A directory listing, for each `(address, workload name, service account)`, that workload in namespace
    /// `shop`, without a cluster of its own.
    fn directory(entries: &[(&str, &str, &str)]) -> Directory {
        let directory = Directory::new(TRUST_DOMAIN);
        let workloads = entries
            .iter()
            .map(|(address, name, service_account)| Workload {
                uid: format!("uid-{name}"),
                name: format!("{name}-0"),
                namespace: "shop".into(),
                service_account: (*service_account).into(),
                trust_domain: String::new(),
                workload_ips: vec![ip(address)],
                protocol: Protocol::Hbone,
                node: "node-1".into(),
                workload_name: (*name).into(),
                canonical_name: format!("{name}-app"),
                canonical_revision: "v2".into(),
                cluster_id: String::new(),
                require_mtls: false,
            })
            .collect();
        assert!(directory.replace("test", workloads).is_empty());
        directory
    }

    /// The labels of the workload `name` the [`directory`] lists with service account `service_account`.
    fn listed_as(name: &str, service_account: &str) -> Peer {
        Peer {
            workload: Some(name.into()),
            canonical_service: Some(format!("{name}-app")),
            canonical_revision: Some("v2".into()),
            namespace: Some("shop".into()),
            principal: Some(identity("shop", service_account).to_string()),
            cluster: Some(CLUSTER.into()),
        }
    }

    /// Only the principal: what a proven client is labelled with when the directory does not vouch for it.
    fn principal_only(identity: &Identity) -> Peer {
        Peer { principal: Some(identity.to_string()), ..Peer::default() }
    }

    #[test]
    fn a_proven_client_gets_the_listed_workload_only_where_the_directory_lists_its_identity() {
        let directory = directory(&[("10.0.0.5", "web", "web-sa")]);
        let web = identity("shop", "web-sa");
        assert_eq!(
            Peer::verified_client(&directory, CLUSTER, ip("10.0.0.5"), &web),
            listed_as("web", "web-sa"),
            "listed with the identity it proved: the directory's workload"
        );
        assert_eq!(
            Peer::verified_client(&directory, CLUSTER, ip("::ffff:10.0.0.5"), &web),
            listed_as("web", "web-sa"),
            "the v4-mapped form is the same address"
        );
        // Another identity sending from web's address (or claiming it): the proven identity, nothing of web's.
        for other in [
            identity("shop", "db-sa"),
            identity("other", "web-sa"),
            Identity::new("evil.td", "shop", "web-sa").unwrap(),
        ] {
            assert_eq!(
                Peer::verified_client(&directory, CLUSTER, ip("10.0.0.5"), &other),
                principal_only(&other),
                "{other} is not listed at 10.0.0.5"
            );
        }
        assert_eq!(Peer::verified_client(&directory, CLUSTER, ip("10.0.0.9"), &web), principal_only(&web), "unlisted");
    }

    #[test]
    fn the_pods_own_end_gets_the_listing_of_its_own_identity_only() {
        // The pod holds 10.0.0.6 and 10.0.0.5; the directory lists 10.0.0.6 as another workload.
        let directory = directory(&[("10.0.0.6", "db", "db-sa"), ("10.0.0.5", "web", "web-sa")]);
        let web = identity("shop", "web-sa");
        let both = [ip("10.0.0.6"), ip("10.0.0.5")];
        assert_eq!(
            Peer::local(&directory, CLUSTER, &both, &web, "shop"),
            listed_as("web", "web-sa"),
            "the address listed with the pod's identity, not the first one listed"
        );
        let enrolled = Peer {
            namespace: Some("shop".into()),
            principal: Some(web.to_string()),
            cluster: Some(CLUSTER.into()),
            ..Peer::default()
        };
        assert_eq!(
            Peer::local(&directory, CLUSTER, &[ip("10.0.0.6")], &web, "shop"),
            enrolled,
            "listed only as another identity: what the enrollment said"
        );
        assert_eq!(Peer::local(&directory, CLUSTER, &[ip("10.0.0.9")], &web, "shop"), enrolled, "not listed");
        assert_eq!(Peer::local(&directory, "", &[ip("10.0.0.9")], &web, ""), principal_only(&web), "empty is unknown");
    }

    #[test]
    fn a_plaintext_client_gets_whatever_is_listed_at_its_address_but_no_principal() {
        let directory = directory(&[("10.0.0.5", "web", "web-sa")]);
        let listed = Peer { principal: None, ..listed_as("web", "web-sa") };
        assert_eq!(Peer::plaintext_client(&directory, CLUSTER, ip("10.0.0.5")), listed);
        assert_eq!(Peer::plaintext_client(&directory, CLUSTER, ip("10.0.0.9")), Peer::default());
    }

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

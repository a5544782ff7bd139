//! The node proxy's traffic metrics as Istio's dashboards read them: after a real HBONE connection between two
//! pods, the proxy exports `istio_tcp_*` series with ztunnel's full label set, once as the client's side
//! (`reporter="source"`) and once as the server's (`reporter="destination"`), with the workload names and canonical
//! services Istio derives from the Pod objects, the SPIFFE principals, and byte counts equal to what each app
//! sent. A connection to a pod outside the mesh is reported with `unknown` for everything the proxy cannot know.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::Path;

use istio_contract::telemetry::{
    label, DEFAULT_CLUSTER_ID, REPORTER_DESTINATION, REPORTER_SOURCE, REQUEST_PROTOCOL_TCP, RESPONSE_FLAGS_NONE,
    SECURITY_POLICY_MUTUAL_TLS, SECURITY_POLICY_UNKNOWN, TCP_CONNECTIONS_CLOSED, TCP_CONNECTIONS_OPENED,
    TCP_RECEIVED_BYTES, TCP_SENT_BYTES, TRAFFIC_LABELS, UNKNOWN,
};
use serde_json::{json, Value};
use testbed::mesh::RuleBackend;
use testbed::node_agent::{ambient_pod, namespace, NodeAgent};
use testbed::wait::eventually;
use testbed::{Cluster, Pod};

use support::metrics::{scrape, Series};
use support::traffic::{transfer, Payload};
use support::{
    await_kubernetes_listing, conflist_for, connect_from, listen_on, plain_member, record_pod_ips, Proxy, Stack,
    APP_PORT, HBONE_ON_ONE_NODE, NS,
};

/// Bytes the client app sends, and the server app answers: different, so a swapped counter shows.
const FROM_CLIENT: u64 = 300_000;
const FROM_SERVER: u64 = 70_000;

/// Ambient pod `name` with service account `sa`, `labels` besides the ambient one, created (generated name) by
/// the controller `kind`/`owner`, as the API server shows a Deployment's or StatefulSet's pod; returns once the
/// proxy took it.
fn controlled_member(cluster: &Cluster, name: &str, sa: &str, labels: Value, (kind, owner): (&str, &str)) -> Pod {
    let mut pod = ambient_pod(NS, name);
    pod["spec"]["serviceAccountName"] = json!(sa);
    for (key, value) in labels.as_object().expect("labels object") {
        pod["metadata"]["labels"][key] = value.clone();
    }
    pod["metadata"]["generateName"] = json!(format!("{owner}-"));
    pod["metadata"]["ownerReferences"] = json!([{
        "apiVersion": "apps/v1", "kind": kind, "name": owner, "uid": format!("{owner}-uid"), "controller": true,
    }]);
    cluster.create(&pod);
    let added = cluster.add_with(conflist_for(cluster, Stack::V4), name, NS).expect("CNI ADD");
    record_pod_ips(cluster, name, &added);
    added
}

/// How Prometheus exposes counter `name`.
fn total(name: &str) -> String {
    format!("{name}_total")
}

/// `pairs` as a label map.
fn expected(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

/// The one series named `name` with `reporter`, or `None` while there is none (more than one fails the test).
fn only_series(netns: &Path, name: &str, reporter: &str) -> Option<Series> {
    let mut found: Vec<Series> =
        scrape(netns).into_iter().filter(|s| s.name == name && s.matches(&[(label::REPORTER, reporter)])).collect();
    assert!(found.len() <= 1, "one {name} series per reporter, got {found:#?}");
    found.pop()
}

#[test]
fn hbone_traffic_is_reported_with_ztunnels_labels_by_both_sides() {
    let dir = tempfile::tempdir().expect("scratch dir");
    let cluster = Cluster::with_backend(RuleBackend::Nftables);
    cluster.api.upsert(namespace(NS, json!({}))).expect("store namespace");
    let agent = NodeAgent::start(&cluster, &[]);
    // Both pods are on this node: without the fast path, so their connection is HBONE (`proxy_fast_path.rs` checks
    // the fast path's series).
    let proxy = Proxy::start(&cluster, &agent, dir.path(), &dir.path().join("workloads.yaml"), &[HBONE_ON_ONE_NODE]);
    let netns = cluster.node.netns().path();

    // A Deployment's pod (its ReplicaSet's name ends with the pod-template hash) with app and version labels, and a
    // StatefulSet's pod naming its canonical service and revision outright.
    let client_labels = json!({ "pod-template-hash": "5f6d7c", "app": "frontend", "version": "v1" });
    let web = controlled_member(&cluster, "web-5f6d7c-x2x9z", "web-sa", client_labels, ("ReplicaSet", "web-5f6d7c"));
    let server_labels =
        json!({ "service.istio.io/canonical-name": "database", "service.istio.io/canonical-revision": "v7" });
    let db = controlled_member(&cluster, "db-0", "db-sa", server_labels, ("StatefulSet", "db"));
    await_kubernetes_listing(&proxy, 2);

    let db_app = SocketAddr::from((db.ip, APP_PORT));
    let (sent, answered) = (Payload::new(1, FROM_CLIENT), Payload::new(2, FROM_SERVER));
    transfer(listen_on(&db, APP_PORT), || connect_from(&web, db_app), sent, answered);

    let labels = |reporter| {
        expected(&[
            (label::REPORTER, reporter),
            (label::SOURCE_WORKLOAD, "web"),
            (label::SOURCE_CANONICAL_SERVICE, "frontend"),
            (label::SOURCE_CANONICAL_REVISION, "v1"),
            (label::SOURCE_WORKLOAD_NAMESPACE, NS),
            (label::SOURCE_PRINCIPAL, "spiffe://cluster.local/ns/shop/sa/web-sa"),
            (label::SOURCE_APP, "frontend"),
            (label::SOURCE_VERSION, "v1"),
            (label::SOURCE_CLUSTER, DEFAULT_CLUSTER_ID),
            (label::DESTINATION_SERVICE, UNKNOWN),
            (label::DESTINATION_SERVICE_NAMESPACE, UNKNOWN),
            (label::DESTINATION_SERVICE_NAME, UNKNOWN),
            (label::DESTINATION_WORKLOAD, "db"),
            (label::DESTINATION_CANONICAL_SERVICE, "database"),
            (label::DESTINATION_CANONICAL_REVISION, "v7"),
            (label::DESTINATION_WORKLOAD_NAMESPACE, NS),
            (label::DESTINATION_PRINCIPAL, "spiffe://cluster.local/ns/shop/sa/db-sa"),
            (label::DESTINATION_APP, "database"),
            (label::DESTINATION_VERSION, "v7"),
            (label::DESTINATION_CLUSTER, DEFAULT_CLUSTER_ID),
            (label::REQUEST_PROTOCOL, REQUEST_PROTOCOL_TCP),
            (label::RESPONSE_FLAGS, RESPONSE_FLAGS_NONE),
            (label::CONNECTION_SECURITY_POLICY, SECURITY_POLICY_MUTUAL_TLS),
        ])
    };
    let every_label: BTreeSet<String> = TRAFFIC_LABELS.iter().map(|l| l.to_string()).collect();
    assert_eq!(labels(REPORTER_SOURCE).into_keys().collect::<BTreeSet<_>>(), every_label, "the test checks them all");
    // Each counter, the value it must reach: bytes as the apps sent them (received = from the client), one
    // connection opened and closed, the same seen from either side.
    let counters = [
        (TCP_RECEIVED_BYTES, FROM_CLIENT as f64),
        (TCP_SENT_BYTES, FROM_SERVER as f64),
        (TCP_CONNECTIONS_OPENED, 1.0),
        (TCP_CONNECTIONS_CLOSED, 1.0),
    ];
    for reporter in [REPORTER_SOURCE, REPORTER_DESTINATION] {
        for (counter, value) in counters {
            let name = &total(counter);
            // The bytes are counted when the connection ends, on both sides: wait for the closed count.
            let series = eventually(&format!("{name}{{reporter=\"{reporter}\"}} reaches {value}"), || {
                only_series(&netns, name, reporter).filter(|s| s.value == value)
            });
            assert_eq!(series.labels, labels(reporter), "{name} as the {reporter} reports it");
        }
    }

    // A destination outside the mesh: passed through in plaintext, reported by the client's side only, with what
    // the proxy cannot know as `unknown` (no workload, no principal on either side, no mutual TLS).
    let legacy = plain_member(&cluster, "legacy");
    let legacy_app = SocketAddr::from((legacy.ip, APP_PORT));
    transfer(listen_on(&legacy, APP_PORT), || connect_from(&web, legacy_app), sent, answered);
    let plaintext = [(label::REPORTER, REPORTER_SOURCE), (label::CONNECTION_SECURITY_POLICY, SECURITY_POLICY_UNKNOWN)];
    let series = eventually("the passthrough connection is counted", || {
        let all = scrape(&netns);
        all.into_iter().find(|s| s.name == total(TCP_SENT_BYTES) && s.matches(&plaintext))
    });
    assert_eq!(series.value, FROM_SERVER as f64, "bytes the outside server answered");
    let unknown = [
        label::SOURCE_PRINCIPAL,
        label::DESTINATION_WORKLOAD,
        label::DESTINATION_CANONICAL_SERVICE,
        label::DESTINATION_WORKLOAD_NAMESPACE,
        label::DESTINATION_PRINCIPAL,
    ];
    for name in unknown {
        assert_eq!(series.labels[name], UNKNOWN, "{name} of a destination outside the mesh: {series:#?}");
    }
    assert_eq!(series.labels[label::SOURCE_WORKLOAD], "web", "the client is still known");
    assert_eq!(series.labels.keys().collect::<BTreeSet<_>>(), every_label.iter().collect(), "{series:#?}");
}

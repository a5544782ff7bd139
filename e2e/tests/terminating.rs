//! Terminating pods, as Istio's node agent handles them (issue #16): a pod deleted gracefully keeps running through
//! its grace period, and its traffic, shutdown included, stays in the mesh. It stays enrolled while the API server
//! shows it with `deletionTimestamp` (grace period running, or held by a finalizer) and leaves only when the API
//! server deletes it (DELETED): then the proxy gets `DelWorkload`, the agent closes its netns handle and drops its
//! host probe entry. A pod that reaches a terminal phase leaves at once; a pod already terminating when its
//! namespace joins the mesh is never enrolled. The real `node-agent` runs against the fake API server, whose
//! graceful deletion (MODIFIED with `deletionTimestamp`, DELETED when the grace period ends or the last finalizer
//! goes) is what a real API server does; a [`ZdsPeer`] or the real `hbone-proxy` is the node proxy.

mod support;

use std::io::{Read as _, Write as _};
use std::net::Ipv4Addr;

use istio_contract::names;
use serde_json::{json, Value};
use testbed::mesh::{plain_pod, RuleBackend};
use testbed::node_agent::{
    ambient_conflist, ambient_pod, namespace, redirection, uid, NodeAgent, RequestKind, ZdsPeer, CONNMARK_RULE,
};
use testbed::pod_process::PodProcess;
use testbed::wait::eventually;
use testbed::{Cluster, Pod};

use support::{Scene, NS};

const ENROLLED: &str = "nodeagent_enrolled_pods";
const DELETES: &str = "nodeagent_reconcile_events_total{type=\"delete\"}";
/// A grace period longer than any test: the pod's shutdown ends when the test says (the kubelet's final delete).
const LONG_GRACE: i64 = 3600;
/// A grace period the fake lets run out by itself during the test.
const SHORT_GRACE: i64 = 2;
/// A finalizer some controller of the pod holds.
const FINALIZER: &str = "example.com/drain";

/// A cluster (whose API server deletes as a real one does: `deletionTimestamp`, grace periods, finalizers), with
/// namespace `NS` stored unlabelled and the agent running on its node.
fn graceful_node() -> (Cluster, NodeAgent) {
    let c = Cluster::with_backend(RuleBackend::Nftables);
    c.api.upsert(namespace(NS, json!({}))).expect("store namespace");
    let agent = NodeAgent::start(&c, &[]);
    (c, agent)
}

/// Stores `pod` and runs its ADD through the runtime; returns it with its UID once the proxy has it.
fn enrolled(c: &Cluster, peer: &ZdsPeer, pod: &Value) -> (Pod, String) {
    let name = pod["metadata"]["name"].as_str().expect("pod name");
    c.create(pod);
    let created = c.add_with(ambient_conflist(c), name, NS).unwrap_or_else(|e| panic!("ADD {name}: {e}"));
    let id = uid(c, NS, name);
    assert!(!peer.received_for(RequestKind::Add, &id).is_empty(), "ADD returned before the proxy had {name}");
    (created, id)
}

/// Whether `pod`'s netns has the ambient in-pod rules (nftables tables and the connmark routing rule).
fn has_inpod_rules(pod: &Pod) -> bool {
    let rules = pod.netns.exec_ok(&["sh", "-c", "nft list ruleset; ip rule show"]);
    rules.contains("istio-ambient") && rules.contains(CONNMARK_RULE)
}

/// Whether the node's host probe set has an entry of pod `id` (its entries carry their pod's UID as comment).
fn in_probe_set(c: &Cluster, id: &str) -> bool {
    c.node.netns().exec_ok(&["nft", "list", "ruleset"]).contains(id)
}

/// Returns once the agent has handled every pod event the API server sent so far: stores a pod on this node and
/// deletes it at once (on purpose: no terminating phase, one DELETED event), then waits for the agent to count
/// that deletion. The agent handles its pod events in order, each to the end, so every earlier one is done by then.
fn settled(c: &Cluster, agent: &NodeAgent, marker: &str) {
    let before = agent.metric(DELETES).unwrap_or(0);
    c.create(&plain_pod(NS, marker));
    c.api.delete("Pod", Some(NS), marker).expect("marker stored");
    eventually("the agent handled the pod events before the marker's deletion", || {
        (agent.metric(DELETES).unwrap_or(0) > before).then_some(())
    });
}

/// Everything of an enrolled pod is still in place: no Del, rules, netns handle, probe entry, annotation.
#[track_caller]
fn assert_still_enrolled(c: &Cluster, agent: &NodeAgent, peer: &ZdsPeer, (pod, id): (&Pod, &str), name: &str) {
    let log = || agent.log();
    assert!(peer.received_for(RequestKind::Del, id).is_empty(), "{name}: the proxy got Del while it runs\n{}", log());
    assert!(has_inpod_rules(pod), "{name}: its in-pod rules were removed while it runs\n{}", log());
    assert!(agent.netns_handles(&pod.netns) > 0, "{name}: the agent let go of its netns\n{}", log());
    assert!(in_probe_set(c, id), "{name}: its host probe entry was removed\n{}", log());
    assert_eq!(redirection(c, NS, name).as_deref(), Some(names::AMBIENT_REDIRECTION_ENABLED), "{name}: annotation");
    assert_eq!(agent.metric(ENROLLED), Some(1), "{name}: the agent counts it enrolled");
}

/// The pod is gone from the node's mesh: Del sent, handle closed, probe entry removed, nothing counted.
#[track_caller]
fn assert_removed(c: &Cluster, agent: &NodeAgent, peer: &ZdsPeer, (pod, id): (&Pod, &str)) {
    eventually("the proxy receives DelWorkload", || {
        (!peer.received_for(RequestKind::Del, id).is_empty()).then_some(())
    });
    eventually("the agent closes the pod's netns handle", || (agent.netns_handles(&pod.netns) == 0).then_some(()));
    eventually("the host probe entry is removed", || (!in_probe_set(c, id)).then_some(()));
    eventually("the agent counts no enrolled pod", || (agent.metric(ENROLLED) == Some(0)).then_some(()));
}

#[test]
fn a_pod_deleted_gracefully_stays_enrolled_until_the_api_server_deletes_it() {
    let (c, agent) = graceful_node();
    let peer = ZdsPeer::connect(&agent);
    let (pod, id) = enrolled(&c, &peer, &ambient_pod(NS, "leaving"));

    // `kubectl delete`: MODIFIED with deletionTimestamp; the kubelet starts the shutdown and the pod keeps running.
    let deleting = c.api.delete_gracefully("Pod", Some(NS), "leaving", Some(LONG_GRACE)).expect("pod stored");
    assert!(deleting["metadata"]["deletionTimestamp"].is_string(), "the pod is terminating: {deleting}");
    settled(&c, &agent, "marker-1");
    assert_still_enrolled(&c, &agent, &peer, (&pod, &id), "leaving");

    // Its containers have stopped: the kubelet's final delete, and the API server sends DELETED.
    c.api.delete_gracefully("Pod", Some(NS), "leaving", Some(0)).expect("pod stored");
    assert!(c.api.get("Pod", Some(NS), "leaving").is_none(), "the final delete removed the pod");
    assert_removed(&c, &agent, &peer, (&pod, &id));
}

#[test]
fn a_terminating_pod_leaves_the_mesh_only_when_its_grace_period_has_run_out() {
    let (c, agent) = graceful_node();
    let peer = ZdsPeer::connect(&agent);
    let (pod, id) = enrolled(&c, &peer, &ambient_pod(NS, "leaving"));

    c.api.delete_gracefully("Pod", Some(NS), "leaving", Some(SHORT_GRACE)).expect("pod stored");
    // The Del comes from the API server's DELETED at the end of the grace period: when the proxy gets it, the
    // pod is already gone from the API.
    eventually("the proxy receives DelWorkload", || {
        let del = !peer.received_for(RequestKind::Del, &id).is_empty();
        let stored = c.api.get("Pod", Some(NS), "leaving");
        assert!(
            !del || stored.is_none(),
            "the proxy got Del while the pod was still terminating: {}\n{}",
            stored.unwrap_or_default(),
            agent.log()
        );
        del.then_some(())
    });
    assert_removed(&c, &agent, &peer, (&pod, &id));
}

#[test]
fn a_pod_held_by_a_finalizer_stays_enrolled_until_the_finalizer_is_removed() {
    let (c, agent) = graceful_node();
    let peer = ZdsPeer::connect(&agent);
    let mut held = ambient_pod(NS, "held");
    held["metadata"]["finalizers"] = json!([FINALIZER]);
    let (pod, id) = enrolled(&c, &peer, &held);

    // The grace period runs out, but the finalizer keeps the pod: the API server only sets its grace period to 0.
    c.api.delete_gracefully("Pod", Some(NS), "held", Some(1)).expect("pod stored");
    eventually("the grace period has run out and the finalizer holds the pod", || {
        let stored = c.api.get("Pod", Some(NS), "held").expect("held by its finalizer");
        (stored["metadata"]["deletionGracePeriodSeconds"] == json!(0)).then_some(())
    });
    settled(&c, &agent, "marker-1");
    assert_still_enrolled(&c, &agent, &peer, (&pod, &id), "held");

    // The controller removes its finalizer: the API server deletes the pod.
    remove_finalizers(&c, "held");
    eventually("the API server deleted the released pod", || {
        c.api.get("Pod", Some(NS), "held").is_none().then_some(())
    });
    assert_removed(&c, &agent, &peer, (&pod, &id));
}

#[test]
fn a_pod_already_terminating_when_its_namespace_joins_the_mesh_is_not_enrolled() {
    let (c, agent) = graceful_node();
    let peer = ZdsPeer::connect(&agent);
    // Two running pods outside the mesh, found through /proc once their namespace is labelled.
    let names = ["leaving", "staying"];
    let pods: Vec<Pod> = names.iter().map(|name| running(&c, name)).collect();
    let ids: Vec<String> = names.iter().map(|name| uid(&c, NS, name)).collect();
    let _processes: Vec<PodProcess> =
        pods.iter().zip(&ids).map(|(pod, id)| PodProcess::start(&pod.netns, id)).collect();
    for (name, pod) in names.iter().zip(&pods) {
        set_running(&c, name, pod.ip);
    }
    c.api.delete_gracefully("Pod", Some(NS), "leaving", Some(LONG_GRACE)).expect("pod stored");
    // The agent has seen the deletion (its pod and namespace watches are separate streams).
    settled(&c, &agent, "marker-1");

    c.api.upsert(namespace(NS, json!({ names::DATAPLANE_MODE_LABEL: "ambient" }))).expect("label namespace");
    eventually("the proxy receives AddWorkload for the running pod", || {
        (!peer.received_for(RequestKind::Add, &ids[1]).is_empty()).then_some(())
    });
    settled(&c, &agent, "marker-2");
    assert!(peer.received_for(RequestKind::Add, &ids[0]).is_empty(), "terminating pod enrolled\n{}", agent.log());
    assert!(!has_inpod_rules(&pods[0]), "the terminating pod got in-pod rules\n{}", agent.log());
    assert_eq!(agent.netns_handles(&pods[0].netns), 0, "the agent holds the terminating pod's netns");
    assert_eq!(redirection(&c, NS, "leaving"), None, "the terminating pod is annotated");
    eventually("the running pod is annotated enabled", || {
        (redirection(&c, NS, "staying").as_deref() == Some(names::AMBIENT_REDIRECTION_ENABLED)).then_some(())
    });
    assert_eq!(agent.metric(ENROLLED), Some(1), "only the running pod is enrolled");
}

#[test]
fn a_pod_that_reaches_a_terminal_phase_leaves_the_mesh() {
    let (c, agent) = graceful_node();
    let peer = ZdsPeer::connect(&agent);
    let (pod, id) = enrolled(&c, &peer, &ambient_pod(NS, "job"));

    // The job's containers exited: the kubelet reports Succeeded (without IPs, as it may: kubernetes#125370).
    let mut done = c.api.get("Pod", Some(NS), "job").expect("pod stored");
    done["status"] = json!({ "phase": "Succeeded" });
    c.api.upsert(done).expect("store the terminal status");
    assert_removed(&c, &agent, &peer, (&pod, &id));
}

/// What the pod's controller does when it is done with it: removes its finalizers with a JSON patch, through the
/// API (`curl` in the node netns, as an administrator), so the API server's update rules apply.
fn remove_finalizers(c: &Cluster, name: &str) {
    let ca = tempfile::NamedTempFile::new().expect("CA file");
    std::fs::write(ca.path(), c.ca_pem()).expect("write CA");
    let auth = format!("Authorization: Bearer {}", c.api.cluster().kubeconfig_token());
    let url = format!("{}/api/v1/namespaces/{NS}/pods/{name}", c.api.url());
    let patch = json!([{ "op": "remove", "path": "/metadata/finalizers" }]).to_string();
    let ca = ca.path().display().to_string();
    let argv = ["curl", "-sSf", "--cacert", &ca, "-H", &auth, "-H", "Content-Type: application/json-patch+json"];
    c.node.netns().exec_ok(&[&argv[..], &["-X", "PATCH", "--data", &patch, &url]].concat());
}

/// Pod `name`, outside the mesh (no ambient label, namespace not labelled), created through the runtime.
fn running(c: &Cluster, name: &str) -> Pod {
    c.create(&plain_pod(NS, name));
    c.add_with(ambient_conflist(c), name, NS).unwrap_or_else(|e| panic!("ADD {name}: {e}"))
}

/// Records `ip` as pod `name`'s address (phase Running), as the kubelet does once the sandbox is up.
fn set_running(c: &Cluster, name: &str, ip: Ipv4Addr) {
    let mut pod = c.api.get("Pod", Some(NS), name).unwrap_or_else(|| panic!("no pod {name}"));
    pod["status"] = json!({ "phase": "Running", "podIP": ip.to_string(), "podIPs": [{ "ip": ip.to_string() }] });
    c.api.upsert(pod).expect("store pod status");
}

/// With the real node proxy: pod B, deleted gracefully, still takes A's connections over HBONE while it shuts
/// down (the proxy still runs B's listeners, and A's bytes arrive through B's HBONE inbound).
#[test]
fn a_terminating_pod_still_takes_mesh_traffic() {
    // Over HBONE, as from another node: B's inbound HBONE must still take it.
    let scene = Scene::new(tempfile::tempdir().expect("scratch dir"), "b-sa", &[support::HBONE_ON_ONE_NODE]);
    let node = scene.cluster.node.netns().path();
    let inbound = || support::metrics::sum(&node, "istio_tcp_received_bytes_total", &support::metrics::hbone(false));
    let before = inbound();

    scene.cluster.api.delete_gracefully("Pod", Some(NS), "b", Some(LONG_GRACE)).expect("pod stored");
    settled(&scene.cluster, &scene.agent, "marker-1");

    let listener = scene.b_listener();
    let mut client = scene.a_connects_to_b();
    client.write_all(b"last words").expect("A writes");
    let (mut conn, peer) = listener.accept().expect("B's app accepts");
    assert_eq!(peer.ip(), scene.a.ip, "B's app sees A as its peer");
    let mut got = [0u8; 10];
    conn.read_exact(&mut got).expect("B's app reads");
    assert_eq!(&got, b"last words");
    conn.write_all(b"bye").expect("B answers");
    let mut answer = [0u8; 3];
    client.read_exact(&mut answer).unwrap_or_else(|e| panic!("A reads B's answer: {e}\n{}", scene.agent.log()));
    assert_eq!(&answer, b"bye");
    drop((client, conn)); // the proxy counts a connection's bytes when it ends
    eventually("B's HBONE inbound counted A's bytes", || (inbound() >= before + 10.0).then_some(()));
}

//! Two nodes on one API server (testbed's `Fleet`), each with its own node agent (`NODE_NAME`) and proxy, and the
//! pods of a third node stored as its agent would have left them: what the API server sends each component is
//! what the fleet model (docs/fleet.md) says. Each agent lists and watches only its own node's pods (field
//! selector `spec.nodeName` on both), so it is sent none of the other nodes' pods; each proxy is sent every pod of
//! the cluster and lists every enrolled one.

use fake_apiserver::{TrafficRecord, User};
use serde_json::json;
use testbed::chart;
use testbed::fleet::Fleet;
use testbed::hbone_proxy::Proxy;
use testbed::mesh::RuleBackend;
use testbed::node_agent::{ambient_conflist, ambient_pod, namespace, redirection, NodeAgent};
use testbed::wait::eventually;

const NS: &str = "fleet";
/// Pods of a node that runs no agent or proxy here.
const ELSEWHERE: usize = 40;

/// Pod objects (list items and watch events) the server sent `user` on front end `front_end`.
fn pods_sent(traffic: &[TrafficRecord], front_end: &str, user: &str) -> u64 {
    traffic
        .iter()
        .filter(|r| r.front_end == front_end && r.user == user && r.resource == "pods")
        .map(|r| r.objects)
        .sum()
}

#[test]
fn each_agent_is_sent_only_its_nodes_pods_and_each_proxy_every_pod() {
    let fleet = Fleet::start();
    fleet.api.upsert(namespace(NS, json!({}))).expect("store namespace");
    let names = ["node-1", "node-2"];
    let nodes: Vec<_> = names.iter().map(|name| fleet.join(name, RuleBackend::Nftables)).collect();
    let dirs: Vec<_> = names.iter().map(|_| tempfile::tempdir().expect("proxy dir")).collect();
    let agents: Vec<_> =
        nodes.iter().zip(names).map(|(n, name)| NodeAgent::start(&n.cluster, &[("NODE_NAME", name)])).collect();
    let proxies: Vec<_> = nodes
        .iter()
        .zip(&agents)
        .zip(&dirs)
        .map(|((n, agent), dir)| Proxy::start(&n.cluster, agent, dir.path(), &dir.path().join("workloads.yaml"), &[]))
        .collect();

    for i in 0..ELSEWHERE {
        let mut pod = ambient_pod(NS, &format!("elsewhere-{i}"));
        pod["spec"]["nodeName"] = json!("node-3");
        pod["metadata"]["annotations"] = json!({ "ambient.istio.io/redirection": "enabled" });
        let ip = format!("10.250.0.{}", i + 1);
        pod["status"] = json!({ "phase": "Running", "podIP": ip, "podIPs": [{ "ip": ip }] });
        fleet.api.upsert(pod).expect("store a pod of node-3");
    }
    // One pod on node-1, enrolled for real: CNI ADD, the agent's annotation, the kubelet's status.
    let cluster = &nodes[0].cluster;
    let mut pod = ambient_pod(NS, "mine");
    pod["spec"]["nodeName"] = json!("node-1");
    cluster.create(&pod);
    let added = cluster.add_with(ambient_conflist(cluster), "mine", NS).expect("CNI ADD on node-1");
    eventually("node-1's agent annotates its pod", || {
        (redirection(cluster, NS, "mine").as_deref() == Some("enabled")).then_some(())
    });
    let mut stored = cluster.api.get("Pod", Some(NS), "mine").expect("pod stored");
    stored["status"] =
        json!({ "phase": "Running", "podIP": added.ip.to_string(), "podIPs": [{ "ip": added.ip.to_string() }] });
    cluster.api.upsert(stored).expect("report the pod running");

    for proxy in &proxies {
        eventually("every proxy lists every enrolled pod of the cluster", || {
            (proxy.kubernetes_addresses() == Some(ELSEWHERE + 1)).then_some(())
        });
    }
    let agent_user = User::service_account(chart::NAMESPACE, chart::CNI_SERVICE_ACCOUNT).name;
    let proxy_user = User::service_account(chart::NAMESPACE, chart::PROXY_SERVICE_ACCOUNT).name;
    let traffic = fleet.api.traffic();
    assert_eq!(pods_sent(&traffic, "node-2", &agent_user), 0, "node-2's agent was sent another node's pods");
    let mine = pods_sent(&traffic, "node-1", &agent_user);
    assert!((1..=3).contains(&mine), "node-1's agent was sent {mine} pod objects: only its one pod's events");
    for name in names {
        let sent = pods_sent(&traffic, name, &proxy_user);
        assert!(sent > ELSEWHERE as u64, "{name}'s proxy was sent {sent} pod objects: every pod of the cluster");
    }
    let requests = fleet.api.requests();
    let agent_pods: Vec<_> = requests.iter().filter(|r| r.user == agent_user && r.path == "/api/v1/pods").collect();
    for verb in ["list", "watch"] {
        let n = agent_pods.iter().filter(|r| r.verb == verb).count();
        assert!(n >= names.len(), "each agent {verb}s its pods ({n} requests)");
    }
    for request in agent_pods {
        let selector = request.param("fieldSelector").unwrap_or_default();
        assert!(
            names.iter().any(|n| selector == format!("spec.nodeName={n}")),
            "an agent's pod {} without its node's field selector: {request:?}",
            request.verb
        );
    }
    drop(added);
}

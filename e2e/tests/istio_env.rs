//! The settings Istio's DaemonSet passes, under Istio's names, reach the real `node-agent`: the host probe SNAT
//! address (`HOST_PROBE_SNAT_IP`), the node name alone under `KUBERNETES_NODE_NAME`, the repair controller's pod
//! selectors (`REPAIR_LABEL_SELECTORS`, `REPAIR_FIELD_SELECTORS`), a YAML `AMBIENT_ENABLEMENT_SELECTOR` and a scoped
//! log level. install-cni's counterparts are in `installer/tests/install_cni.rs`.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use istio_contract::proxy;
use serde_json::{json, Value};
use testbed::kubelet::KUBELET_UID;
use testbed::mesh::{plain_pod, RuleBackend};
use testbed::node_agent::{
    ambient_conflist, ambient_node, ambient_pod, crash_looping_pod, uid, RequestKind, ZdsPeer, BROKEN_POD_LABEL,
    VALIDATION_CONTAINER,
};
use testbed::wait::eventually_or;
use testbed::{Cluster, Pod};

/// Namespace of the test pods.
const NS: &str = "shop";
/// Port the test app listens on.
const APP_PORT: u16 = 8080;
/// A probe address other than Istio's default.
const SNAT: Ipv4Addr = Ipv4Addr::new(169, 254, 7, 200);

fn run(cluster: &Cluster, pod: &Value) -> Pod {
    let name = pod["metadata"]["name"].as_str().unwrap();
    cluster.create(pod);
    cluster.add_with(ambient_conflist(cluster), name, NS).unwrap_or_else(|e| panic!("ADD of {name}: {e}"))
}

/// `HOST_PROBE_SNAT_IP` names the address the host probe rule SNATs the kubelet's connections to, and the pod's
/// rules let that address past the proxy: in every backend the kubelet reaches the app from it.
#[test]
fn host_probe_snat_ip_is_the_address_the_kubelets_probes_come_from() {
    for backend in RuleBackend::ALL {
        eprintln!("--- backend {backend:?}");
        let (cluster, agent) = ambient_node(backend, NS, &[("HOST_PROBE_SNAT_IP", &SNAT.to_string())]);
        let host_rules = backend.dump(cluster.node.netns());
        assert!(host_rules.contains(&SNAT.to_string()), "{backend:?}: no rule with {SNAT}:\n{host_rules}");
        assert!(
            !host_rules.contains(&proxy::PROBE_SNAT_V4.to_string()),
            "{backend:?}: the default address is still programmed:\n{host_rules}"
        );
        let _peer = ZdsPeer::connect(&agent);
        let web = run(&cluster, &ambient_pod(NS, "web"));
        let app = web.netns.listen_tcp(APP_PORT);
        let target = SocketAddr::from((web.ip, APP_PORT));
        cluster.node.netns().connect_tcp(target, Some(KUBELET_UID)).expect("the kubelet connects");
        assert_eq!(app.accepted().peer.ip(), IpAddr::V4(SNAT), "{backend:?}: the kubelet comes from {SNAT}");
    }
}

/// Istio's `KUBERNETES_NODE_NAME` alone names the node: the agent starts and enrolls this node's pods.
#[test]
fn kubernetes_node_name_alone_sets_the_node() {
    let (cluster, agent) =
        ambient_node(RuleBackend::Nftables, NS, &[("NODE_NAME", ""), ("KUBERNETES_NODE_NAME", "node-1")]);
    let peer = ZdsPeer::connect(&agent);
    run(&cluster, &ambient_pod(NS, "web"));
    let adds = peer.received_for(RequestKind::Add, &uid(&cluster, NS, "web"));
    assert_eq!(adds.len(), 1, "{:?}\n{}", peer.received(), agent.log());
}

/// A YAML `AMBIENT_ENABLEMENT_SELECTOR`, as Istio's chart renders it: the agent starts with it and logs at debug
/// with Istio's scoped level form.
#[test]
fn a_yaml_enablement_selector_and_a_scoped_log_level_are_accepted() {
    let yaml = "- podSelector:\n    matchLabels:\n      mesh: ambient\n";
    let (cluster, agent) = ambient_node(
        RuleBackend::Nftables,
        NS,
        &[("AMBIENT_ENABLEMENT_SELECTOR", yaml), ("LOG_LEVEL", "default:debug,xds:info")],
    );
    let peer = ZdsPeer::connect(&agent);
    let mut pod = plain_pod(NS, "web");
    pod["metadata"]["labels"] = json!({ "mesh": "ambient" });
    cluster.create(&pod);
    // The plugin's netconf carries the same selectors, as install-cni writes them (JSON).
    let mut list = ambient_conflist(&cluster);
    let plugins = list["plugins"].as_array_mut().unwrap();
    plugins.last_mut().unwrap()["enablement_selectors"] =
        json!([{ "podSelector": { "matchLabels": { "mesh": "ambient" } } }]);
    cluster.add_with(list, "web", NS).expect("ADD of web");
    let adds = peer.received_for(RequestKind::Add, &uid(&cluster, NS, "web"));
    assert_eq!(adds.len(), 1, "{:?}\n{}", peer.received(), agent.log());
    let log = agent.log();
    assert!(log.lines().any(|l| l.contains("DEBUG")), "no debug line:\n{log}");
    assert!(log.contains("Istio log scopes with no counterpart here are ignored") && log.contains("xds"), "{log}");
}

/// `REPAIR_LABEL_SELECTORS` and `REPAIR_FIELD_SELECTORS` restrict the pods the repair controller touches: of three
/// broken pods only the one both select is labelled.
#[test]
fn repair_selectors_restrict_which_pods_are_repaired() {
    let (c, agent) = ambient_node(
        RuleBackend::Nftables,
        NS,
        &[
            ("REPAIR_LABEL_PODS", "true"),
            ("REPAIR_LABEL_SELECTORS", "team in (a)"),
            ("REPAIR_FIELD_SELECTORS", &format!("metadata.namespace={NS}")),
        ],
    );
    let broken = |ns: &str, name: &str, team: &str| {
        let mut pod = crash_looping_pod(ns, name, "node-1", VALIDATION_CONTAINER, 126, true);
        pod["metadata"]["labels"] = json!({ "team": team });
        pod
    };
    let labelled = |ns: &str, name: &str| {
        c.api
            .get("Pod", Some(ns), name)
            .and_then(|p| p["metadata"]["labels"][BROKEN_POD_LABEL].as_str().map(String::from))
    };
    // Stored first: the controller handles pods in watch order, so these are judged before the selected one.
    c.api.upsert(broken(NS, "team-b", "b")).expect("store pod");
    c.api.upsert(broken("elsewhere", "team-a", "a")).expect("store pod");
    c.api.upsert(broken(NS, "team-a", "a")).expect("store pod");
    eventually_or("the selected broken pod is labelled", || labelled(NS, "team-a"), || agent.log());
    let log = agent.log();
    assert_eq!(labelled(NS, "team-b"), None, "a pod the label selector excludes was labelled:\n{log}");
    assert_eq!(labelled("elsewhere", "team-a"), None, "a pod the field selector excludes was labelled:\n{log}");
}

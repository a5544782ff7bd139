//! The host probe path, end to end: the real `node-agent` on a test node whose kubelet is a real process it
//! finds through `/proc` (testbed's stand-in, running as [`KUBELET_UID`]), the real plugin, and a test proxy.
//! Which host processes reach an ambient pod around its proxy, in plaintext from the probe address, in each
//! backend; and that nftables mode refuses to guess the kubelet's uid.

use std::net::{IpAddr, SocketAddr};

use istio_contract::{ports, proxy};
use serde_json::json;
use testbed::kubelet::KUBELET_UID;
use testbed::mesh::RuleBackend;
use testbed::node_agent::{ambient_conflist, ambient_node, ambient_pod, namespace, NodeAgent, ZdsPeer};
use testbed::{Cluster, Pod};

/// Namespace of the test pods.
const NS: &str = "shop";
/// Ports the test app listens on.
const APP_PORT: u16 = 8080;
const OTHER_PORT: u16 = 8081;

fn run(cluster: &Cluster, name: &str) -> Pod {
    cluster.create(&ambient_pod(NS, name));
    cluster.add_with(ambient_conflist(cluster), name, NS).unwrap_or_else(|e| panic!("ADD of {name}: {e}"))
}

/// The host netns's nftables tables of the host probe SNAT (`istio-ambient-nat`), in `nft list` form.
fn host_probe_tables(cluster: &Cluster) -> String {
    let tables = cluster.node.netns().exec_ok(&["nft", "list", "tables"]);
    assert!(tables.contains("istio-ambient-nat"), "no host probe table in the node netns: {tables}");
    cluster.node.netns().exec_ok(&["nft", "list", "table", "inet", "istio-ambient-nat"])
}

#[test]
fn in_nftables_mode_the_host_probe_rule_matches_the_uid_the_kubelet_runs_as() {
    let (cluster, _agent) = ambient_node(RuleBackend::Nftables, NS, &[]);
    let table = host_probe_tables(&cluster);
    let rules: Vec<&str> = table.lines().filter(|l| l.contains("snat")).collect();
    assert!(!rules.is_empty(), "no SNAT rule:\n{table}");
    for rule in rules {
        assert!(rule.contains(&format!("meta skuid {KUBELET_UID} ")), "the rule matches the kubelet's uid: {rule}");
    }
}

/// A node whose `/proc` shows no kubelet (`HOST_PROC` names one where none runs): the agent exits non-zero at
/// start with an error saying what it looked for and where, and programs no host probe rule.
#[test]
fn in_nftables_mode_without_a_kubelet_the_agent_refuses_to_start_and_programs_nothing() {
    let cluster = Cluster::with_backend(RuleBackend::Nftables);
    cluster.api.upsert(namespace(NS, json!({}))).expect("store namespace");
    let empty_proc = tempfile::tempdir().unwrap();
    let proc = empty_proc.path().display().to_string();
    let (status, log) = NodeAgent::start_expecting_exit(&cluster, &[("HOST_PROC", &proc)]);
    assert!(!status.success(), "the agent exits non-zero: {status}\n{log}");
    let error = log.lines().find(|l| l.contains("node-agent failed")).unwrap_or_else(|| panic!("no error:\n{log}"));
    for part in ["kubelet's uid", "no kubelet process in", proc.as_str(), "`kubelet`", "`kubelite`", "`k3s`"] {
        assert!(error.contains(part), "the error names {part:?}: {error}");
    }
    let ruleset = cluster.node.netns().exec_ok(&["nft", "list", "ruleset"]);
    assert!(!ruleset.contains("istio"), "no host probe rule or set left behind:\n{ruleset}");
}

/// What `docs/threat-model.md` says of host-network processes: in both modes the kubelet's probes reach the app
/// in plaintext from the probe address, bypassing the proxy (so `STRICT` never sees them); in iptables mode so does
/// every other host process with a socket, while in nftables mode another uid's connection is captured by the
/// proxy's plaintext inbound port like any other peer's, from the node's own address.
#[test]
fn the_kubelets_connections_bypass_the_proxy_in_both_modes_other_host_processes_only_in_iptables_mode() {
    for backend in RuleBackend::ALL {
        eprintln!("--- backend {backend:?}");
        let (cluster, agent) = ambient_node(backend, NS, &[]);
        let _peer = ZdsPeer::connect(&agent);
        let web = run(&cluster, "web");
        let host = cluster.node.netns();

        let app = web.netns.listen_tcp(APP_PORT);
        host.connect_tcp(SocketAddr::from((web.ip, APP_PORT)), Some(KUBELET_UID)).expect("the kubelet connects");
        assert_eq!(app.accepted().peer.ip(), IpAddr::V4(proxy::PROBE_SNAT_V4), "{backend:?}: kubelet SNATed");

        // Each listener takes one connection: the second goes to another port.
        let (app, proxy_inbound) = (web.netns.listen_tcp(OTHER_PORT), web.netns.listen_tcp(ports::INBOUND_PLAINTEXT));
        let target = SocketAddr::from((web.ip, OTHER_PORT));
        host.connect_tcp(target, None).expect("a root process on the host connects");
        if backend == RuleBackend::Nftables {
            let got = proxy_inbound.accepted();
            assert_eq!(got.peer.ip(), IpAddr::V4(cluster.node.gateway()), "nftables: not SNATed");
            assert_eq!(got.original_dst.map(SocketAddr::V4), Some(target), "nftables: captured by the proxy");
        } else {
            assert_eq!(app.accepted().peer.ip(), IpAddr::V4(proxy::PROBE_SNAT_V4), "{backend:?}: any socket SNATed");
        }
    }
}

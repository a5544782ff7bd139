//! Drift repair, end to end: the real `node-agent` (drift check every 2 s) with the real plugin and a test
//! proxy. An enrolled ambient pod's rules are deleted inside its netns with the tools themselves (iptables: the
//! jump and our chain's rules; nftables: the whole table); the agent programs them again, counts the repair in
//! `nodeagent_drift_repaired_total{kind="inpod_rules"}`, logs the diff, and the pod's traffic lands on the
//! proxy's port again. The host probe SNAT rule, flushed in the node netns, comes back the same way
//! (`kind="host_probe"`), and host connections come from the probe address again. The pod's connmark routing
//! (`ip rule` and table 100), deleted, is repaired and counted with the rules.
//!
//! A running sidecar pod's rules, deleted the same way, are only reported (`nodeagent_drift_detected_total
//! {kind="sidecar_rules"}`) unless `DRIFT_REPAIR_SIDECAR=true`, which programs them again; in a sidecar-only
//! install (`AMBIENT_ENABLED=false`) too.

use std::net::{IpAddr, SocketAddr, SocketAddrV4};

use istio_contract::{ports, proxy};
use serde_json::json;
use testbed::kubelet::KUBELET_UID;
use testbed::mesh::{sidecar_pod, RuleBackend};
use testbed::node_agent::{ambient_conflist, ambient_node, ambient_pod, uid, NodeAgent, ZdsPeer};
use testbed::pod_process::PodProcess;
use testbed::wait::eventually_or;
use testbed::{Cluster, NetnsGuard, Pod};

/// Namespace of the test pod.
const NS: &str = "shop";
/// A port of the node the pod connects to (never reached: the proxy's listener takes the connection).
const APP_PORT: u16 = 8080;
/// A drift check every 2 s, and the probe self-test (which would add nothing here) out of the way.
const SETTINGS: [(&str, &str); 2] = [("DRIFT_CHECK_INTERVAL", "2s"), ("PROBE_SELFTEST_INTERVAL", "0s")];
const INPOD: &str = r#"nodeagent_drift_repaired_total{kind="inpod_rules"}"#;
const HOST_PROBE: &str = r#"nodeagent_drift_repaired_total{kind="host_probe"}"#;
const SIDECAR_DETECTED: &str = r#"nodeagent_drift_detected_total{kind="sidecar_rules"}"#;
const SIDECAR_REPAIRED: &str = r#"nodeagent_drift_repaired_total{kind="sidecar_rules"}"#;
/// The app's uid in a sidecar pod (not the proxy's 1337, whose traffic is not redirected).
const APP_UID: u32 = 1000;

fn run(cluster: &Cluster, name: &str) -> Pod {
    cluster.create(&ambient_pod(NS, name));
    cluster.add_with(ambient_conflist(cluster), name, NS).unwrap_or_else(|e| panic!("ADD of {name}: {e}"))
}

/// Whether the pod's netns holds our outbound redirect (the rule that sends the pod's TCP to 15001).
fn has_outbound_redirect(backend: RuleBackend, ns: &NetnsGuard) -> bool {
    let dump = backend.dump(ns);
    let port = ports::OUTBOUND.to_string();
    match backend {
        RuleBackend::Nftables => dump.contains("istio-ambient-nat") && dump.contains(&format!("redirect to :{port}")),
        _ => {
            dump.contains("-A OUTPUT -j ISTIO_OUTPUT")
                && dump.lines().any(|l| l.starts_with("-A ISTIO_OUTPUT") && l.contains(&format!("--to-ports {port}")))
        }
    }
}

/// Deletes our in-pod rules the way another agent or a debug session would.
fn delete_inpod_rules(backend: RuleBackend, ns: &NetnsGuard) {
    match backend {
        RuleBackend::Nftables => {
            ns.exec_ok(&["nft", "delete", "table", "inet", "istio-ambient-nat"]);
        }
        _ => {
            let bin = if backend == RuleBackend::IptablesNft { "iptables-nft" } else { "iptables-legacy" };
            ns.exec_ok(&[bin, "-w", "-t", "nat", "-D", "OUTPUT", "-j", "ISTIO_OUTPUT"]);
            ns.exec_ok(&[bin, "-w", "-t", "nat", "-F", "ISTIO_OUTPUT"]);
        }
    }
}

/// Flushes the host probe SNAT rule from the node netns.
fn flush_host_probe_rule(backend: RuleBackend, host: &NetnsGuard) {
    match backend {
        RuleBackend::Nftables => {
            host.exec_ok(&["nft", "flush", "chain", "inet", "istio-ambient-nat", "postrouting"]);
        }
        _ => {
            let bin = if backend == RuleBackend::IptablesNft { "iptables-nft" } else { "iptables-legacy" };
            host.exec_ok(&[bin, "-w", "-t", "nat", "-F", "ISTIO_POSTRT"]);
        }
    }
}

/// Whether a connection from web lands on a 15001 listener in its netns with its original destination.
fn outbound_redirected(c: &Cluster, web: &Pod, peer: &ZdsPeer) -> bool {
    let proxy = testbed::tcp::listen_in(peer.netns(&uid(c, NS, "web")), ports::OUTBOUND, false);
    let dst = SocketAddrV4::new(c.node.gateway(), APP_PORT);
    web.netns.connect_tcp(SocketAddr::V4(dst), None).expect("app connects");
    let got = proxy.accepted();
    got.local.port() == ports::OUTBOUND && got.original_dst == Some(dst)
}

fn context<'a>(agent: &'a NodeAgent, backend: RuleBackend, web: &Pod) -> impl Fn() -> String + 'a {
    let rules = backend.dump(&web.netns);
    move || {
        format!(
            "{backend:?}\n--- pod rules when broken:\n{rules}\n--- metrics:\n{}\n--- log:\n{}",
            agent.metrics(),
            agent.log()
        )
    }
}

fn drifted_rules_are_repaired(backend: RuleBackend) {
    let (c, agent) = ambient_node(backend, NS, &SETTINGS);
    let peer = ZdsPeer::connect(&agent);
    let web = run(&c, "web");
    assert!(has_outbound_redirect(backend, &web.netns), "{backend:?}: enrolled with rules");
    assert!(outbound_redirected(&c, &web, &peer), "{backend:?}: redirected after enrollment");

    delete_inpod_rules(backend, &web.netns);
    let ctx = context(&agent, backend, &web);
    eventually_or(
        "the in-pod rules are back and the repair is counted",
        || (has_outbound_redirect(backend, &web.netns) && agent.metric(INPOD) >= Some(1)).then_some(()),
        &ctx,
    );
    assert!(outbound_redirected(&c, &web, &peer), "{backend:?}: redirected again after the repair\n{}", ctx());
    let log = agent.log();
    assert!(
        log.lines().any(|l| l.contains("rules drifted: repaired") && l.contains("missing")),
        "{backend:?}: the repair is logged with the diff\n{log}"
    );
    assert_eq!(agent.metric(INPOD), Some(1), "{backend:?}: one repair, not one per check\n{}", agent.metrics());

    // The host probe SNAT rule in the node netns: flushed, re-ensured, and host connections are SNATed again.
    flush_host_probe_rule(backend, c.node.netns());
    eventually_or(
        "the host probe rule repair is counted",
        || (agent.metric(HOST_PROBE) >= Some(1)).then_some(()),
        &ctx,
    );
    let app = web.netns.listen_tcp(APP_PORT);
    let dst = SocketAddr::V4(SocketAddrV4::new(web.ip, APP_PORT));
    c.node.netns().connect_tcp(dst, Some(KUBELET_UID)).expect("kubelet connects");
    assert_eq!(app.accepted().peer.ip(), IpAddr::V4(proxy::PROBE_SNAT_V4), "{backend:?}: SNAT to the probe address");
}

/// Whether the pod's netns holds the connmark routing the agent programs (Istio's mark, priority and table).
fn has_connmark_routing(ns: &NetnsGuard) -> bool {
    ns.exec_ok(&["ip", "rule", "show"]).contains("32764:\tfrom all fwmark 0x111/0xfff lookup 100")
        && ns.exec_ok(&["ip", "route", "show", "table", "100"]).contains("local default dev lo")
}

#[test]
fn deleted_connmark_routing_is_repaired() {
    let backend = RuleBackend::Nftables;
    let (c, agent) = ambient_node(backend, NS, &SETTINGS);
    let _peer = ZdsPeer::connect(&agent);
    let web = run(&c, "web");
    assert!(has_connmark_routing(&web.netns), "enrolled with its routing");

    // The rules stay; the policy routing that returns TPROXY'd inbound replies to the proxy goes.
    web.netns.exec_ok(&["ip", "rule", "del", "pref", "32764"]);
    web.netns.exec_ok(&["ip", "route", "flush", "table", "100"]);
    assert!(!has_connmark_routing(&web.netns));
    let ctx = context(&agent, backend, &web);
    eventually_or(
        "the connmark routing is back and the repair is counted",
        || (has_connmark_routing(&web.netns) && agent.metric(INPOD) >= Some(1)).then_some(()),
        &ctx,
    );
    let log = agent.log();
    assert!(
        log.lines().any(|l| l.contains("rules drifted: repaired") && l.contains("rule fwmark 0x111/0xfff pref 32764")),
        "the repair is logged with the missing routing\n{log}"
    );
}

#[test]
fn drifted_iptables_nft_rules_are_repaired() {
    drifted_rules_are_repaired(RuleBackend::IptablesNft);
}

#[test]
fn drifted_iptables_legacy_rules_are_repaired() {
    drifted_rules_are_repaired(RuleBackend::IptablesLegacy);
}

#[test]
fn drifted_nftables_rules_are_repaired() {
    drifted_rules_are_repaired(RuleBackend::Nftables);
}

/// A sidecar pod created through the plugin (which programs its rules), running: its Pod object says Running
/// with its IP, and a process of it runs in its netns (how the agent finds the netns through `/proc`).
fn running_sidecar_pod(c: &Cluster, name: &str) -> (Pod, PodProcess) {
    let pod = c.run(&sidecar_pod(NS, name));
    let mut stored = c.api.get("Pod", Some(NS), name).expect("stored pod");
    let ip = pod.ip.to_string();
    stored["status"] = json!({ "phase": "Running", "podIP": ip, "podIPs": [{ "ip": ip }] });
    c.api.upsert(stored).expect("store pod status");
    let process = PodProcess::start(&pod.netns, &uid(c, NS, name));
    (pod, process)
}

/// Whether the sidecar pod's netns holds the plugin's outbound redirect.
fn has_sidecar_redirect(backend: RuleBackend, ns: &NetnsGuard) -> bool {
    let dump = backend.dump(ns);
    match backend {
        RuleBackend::Nftables => dump.contains("istio-proxy-nat"),
        _ => dump.contains("-A OUTPUT -j ISTIO_OUTPUT"),
    }
}

fn delete_sidecar_rules(backend: RuleBackend, ns: &NetnsGuard) {
    match backend {
        RuleBackend::Nftables => {
            ns.exec_ok(&["nft", "delete", "table", "inet", "istio-proxy-nat"]);
        }
        _ => {
            let bin = if backend == RuleBackend::IptablesNft { "iptables-nft" } else { "iptables-legacy" };
            ns.exec_ok(&[bin, "-w", "-t", "nat", "-F"]);
        }
    }
}

/// Whether the agent runs with ambient on or, as in a sidecar-only install, off.
#[derive(Clone, Copy, PartialEq)]
enum Install {
    Ambient,
    SidecarOnly,
}

fn sidecar_drift(backend: RuleBackend, repair: bool, install: Install) {
    let ambient = if install == Install::Ambient { "true" } else { "false" };
    let repair_setting = ("DRIFT_REPAIR_SIDECAR", if repair { "true" } else { "false" });
    let settings = [SETTINGS[0], SETTINGS[1], repair_setting, ("AMBIENT_ENABLED", ambient)];
    let (c, agent) = ambient_node(backend, NS, &settings);
    let (side, _process) = running_sidecar_pod(&c, "side");
    assert!(has_sidecar_redirect(backend, &side.netns), "{backend:?}: the plugin programmed the sidecar rules");

    delete_sidecar_rules(backend, &side.netns);
    let ctx = context(&agent, backend, &side);
    eventually_or("the sidecar drift is counted", || (agent.metric(SIDECAR_DETECTED) >= Some(1)).then_some(()), &ctx);
    if !repair {
        assert!(!has_sidecar_redirect(backend, &side.netns), "{backend:?}: repaired without DRIFT_REPAIR_SIDECAR");
        assert_eq!(agent.metric(SIDECAR_REPAIRED), None, "{}", agent.metrics());
        let log = agent.log();
        assert!(log.contains("DRIFT_REPAIR_SIDECAR is off"), "{backend:?}: the drift is logged\n{log}");
        return;
    }
    eventually_or(
        "the sidecar rules are back and the repair is counted",
        || (has_sidecar_redirect(backend, &side.netns) && agent.metric(SIDECAR_REPAIRED) >= Some(1)).then_some(()),
        &ctx,
    );
    let proxy = side.netns.listen_tcp(ports::OUTBOUND);
    let dst = SocketAddrV4::new(c.node.gateway(), APP_PORT);
    side.netns.connect_tcp(SocketAddr::V4(dst), Some(APP_UID)).expect("app connects");
    assert_eq!(proxy.accepted().original_dst, Some(dst), "{backend:?}: the app's traffic is redirected again");
}

#[test]
fn sidecar_drift_is_reported_and_left_alone_by_default() {
    sidecar_drift(RuleBackend::IptablesNft, false, Install::Ambient);
}

#[test]
fn sidecar_drift_is_repaired_when_asked_for() {
    sidecar_drift(RuleBackend::Nftables, true, Install::Ambient);
}

#[test]
fn sidecar_drift_is_repaired_in_a_sidecar_only_install() {
    sidecar_drift(RuleBackend::IptablesLegacy, true, Install::SidecarOnly);
}

//! The host probe self-test, end to end: the real `node-agent` (self-test every few seconds) on a test node with
//! the stand-in kubelet, the real plugin and a test proxy. With an enrolled pod the self-test passes; with the host
//! probe SNAT rule taken out of the node netns the agent turns unready, says why in `/readyz`, and reports
//! `nodeagent_probe_selftest_ok 0`; with the rule back (put back by the test, or by the drift repair the failure
//! asks for) it is ready again and reports 1. In each backend (in nftables mode the rule only SNATs the kubelet's
//! uid, so the agent must connect as that uid). A pod whose own rules drop the test does not make the agent
//! unready: the failure is confirmed with another pod.

use std::time::{Duration, Instant};

use istio_contract::ports;
use istio_contract::proxy::PROBE_SNAT_V4;
use testbed::mesh::RuleBackend;
use testbed::node_agent::{ambient_conflist, ambient_node, ambient_pod, uid, NodeAgent, ZdsPeer};
use testbed::wait::{eventually_or, within};
use testbed::{Cluster, Pod};

/// Namespace of the test pod.
const NS: &str = "shop";
/// The gauge the self-test sets.
const GAUGE: &str = "nodeagent_probe_selftest_ok";
/// The drift repair counter of the host probe rule.
const REPAIRED: &str = "nodeagent_drift_repaired_total{kind=\"host_probe\"}";

/// Istio's host probe names: the nftables table and its nat postrouting chain, the iptables nat chain.
const NFT_TABLE: &str = "istio-ambient-nat";
const NFT_CHAIN: &str = "postrouting";
const IPT_CHAIN: &str = "ISTIO_POSTRT";

fn run(cluster: &Cluster, name: &str) -> Pod {
    cluster.create(&ambient_pod(NS, name));
    cluster.add_with(ambient_conflist(cluster), name, NS).unwrap_or_else(|e| panic!("ADD of {name}: {e}"))
}

/// `/readyz`: status and body.
fn readyz(cluster: &Cluster) -> Option<(u16, String)> {
    testbed::http::get(&cluster.node.netns().path(), ports::CNI_READINESS, "/readyz").ok()
}

/// Removes the host probe SNAT rule from the node netns, as another agent flushing it would; returns the
/// commands that add it back, as they were.
fn remove_host_probe_rule(cluster: &Cluster, backend: RuleBackend) -> Vec<Vec<String>> {
    let host = cluster.node.netns();
    let owned = |argv: &[&str]| argv.iter().map(|a| a.to_string()).collect::<Vec<_>>();
    match backend {
        RuleBackend::Nftables => {
            let chain = host.exec_ok(&["nft", "-a", "list", "chain", "inet", NFT_TABLE, NFT_CHAIN]);
            let rules: Vec<(&str, &str)> = chain
                .lines()
                .filter(|l| l.contains("snat"))
                .filter_map(|l| l.trim().rsplit_once(" # handle "))
                .collect();
            assert!(!rules.is_empty(), "no host probe SNAT rule in the node netns:\n{chain}");
            let mut restore = Vec::new();
            for (rule, handle) in rules {
                host.exec_ok(&["nft", "delete", "rule", "inet", NFT_TABLE, NFT_CHAIN, "handle", handle]);
                // `counter packets N bytes M` adds back as a fresh counter.
                let words: Vec<&str> = rule.split_whitespace().collect();
                let mut text = Vec::new();
                let mut i = 0;
                while i < words.len() {
                    text.push(words[i]);
                    i += if words[i] == "counter" && words.get(1 + i) == Some(&"packets") { 5 } else { 1 };
                }
                let mut argv = owned(&["nft", "add", "rule", "inet", NFT_TABLE, NFT_CHAIN]);
                argv.extend(text.iter().map(|w| w.to_string()));
                restore.push(argv);
            }
            restore
        }
        RuleBackend::IptablesNft | RuleBackend::IptablesLegacy => {
            let bin = if backend == RuleBackend::IptablesNft { "iptables-nft" } else { "iptables-legacy" };
            let saved = host.exec_ok(&[&format!("{bin}-save"), "-t", "nat"]);
            let prefix = format!("-A {IPT_CHAIN} ");
            let rules: Vec<&str> = saved.lines().filter(|l| l.starts_with(&prefix) && l.contains("SNAT")).collect();
            assert!(!rules.is_empty(), "no host probe SNAT rule in the node netns:\n{saved}");
            // `-w`: the agent's own iptables-restore may hold the xtables lock (a repair the failed self-test asked
            // for), and without it iptables gives up at once ("Resource temporarily unavailable").
            host.exec_ok(&[bin, "-w", "-t", "nat", "-F", IPT_CHAIN]);
            rules
                .iter()
                .map(|rule| {
                    let mut argv = owned(&[bin, "-w", "-t", "nat"]);
                    argv.extend(rule.split_whitespace().map(str::to_owned));
                    argv
                })
                .collect()
        }
    }
}

/// Whether the node netns has a host probe SNAT rule.
fn has_host_probe_rule(cluster: &Cluster, backend: RuleBackend) -> bool {
    let host = cluster.node.netns();
    match backend {
        RuleBackend::Nftables => {
            let tables = host.exec_ok(&["nft", "list", "tables"]);
            tables.contains(NFT_TABLE)
                && host.exec_ok(&["nft", "list", "chain", "inet", NFT_TABLE, NFT_CHAIN]).contains("snat")
        }
        RuleBackend::IptablesNft | RuleBackend::IptablesLegacy => {
            let bin = if backend == RuleBackend::IptablesNft { "iptables-nft-save" } else { "iptables-legacy-save" };
            let prefix = format!("-A {IPT_CHAIN} ");
            host.exec_ok(&[bin, "-t", "nat"]).lines().any(|l| l.starts_with(&prefix) && l.contains("SNAT"))
        }
    }
}

/// Adds the rule back with `commands`, unless the agent already has (its failed self-test asks for a drift check).
fn restore(cluster: &Cluster, backend: RuleBackend, commands: &[Vec<String>]) {
    if has_host_probe_rule(cluster, backend) {
        return;
    }
    for argv in commands {
        let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
        cluster.node.netns().exec_ok(&argv);
    }
}

/// Waits until the gauge reads `value` and `/readyz` answers `status` with a body `body` accepts.
#[track_caller]
fn wait_for(agent: &NodeAgent, cluster: &Cluster, what: &str, value: u64, status: u16, body: impl Fn(&str) -> bool) {
    eventually_or(
        what,
        || {
            let ready = readyz(cluster)?;
            (agent.metric(GAUGE) == Some(value) && ready.0 == status && body(&ready.1)).then_some(())
        },
        || format!("{GAUGE}: {:?}; /readyz: {:?}\nlog:\n{}", agent.metric(GAUGE), readyz(cluster), agent.log()),
    );
}

/// The agent on `backend` with `settings`, a test proxy, and pod `shop/web` enrolled; returns once the self-test
/// passed on it (not before: with no pod, nothing is tested, no gauge is exposed and readiness is not held up).
fn enrolled(backend: RuleBackend, settings: &[(&str, &str)]) -> (Cluster, NodeAgent, ZdsPeer, Pod) {
    let (cluster, agent) = ambient_node(backend, NS, settings);
    let peer = ZdsPeer::connect(&agent);
    assert_eq!(readyz(&cluster).map(|r| r.0), Some(200));
    assert_eq!(agent.metric(GAUGE), None, "{backend:?}: no pod tested yet");
    let web = run(&cluster, "web");
    wait_for(&agent, &cluster, "the self-test passes with an enrolled pod", 1, 200, |_| true);
    (cluster, agent, peer, web)
}

/// `/readyz` names the self-test and the pod it failed on.
fn names_the_failure(body: &str) -> bool {
    body.contains("probe-selftest") && body.contains(&format!("{NS}/web"))
}

#[test]
fn the_self_test_fails_without_the_host_probe_rule_and_passes_again_once_it_is_back() {
    for backend in RuleBackend::ALL {
        eprintln!("--- backend {backend:?}");
        // Periodic drift checks far away: the rule comes back when the test (or the check the failure asks for)
        // puts it back.
        let settings = [("PROBE_SELFTEST_INTERVAL", "2s"), ("DRIFT_CHECK_INTERVAL", "1h")];
        let (cluster, agent, _peer, _web) = enrolled(backend, &settings);

        let commands = remove_host_probe_rule(&cluster, backend);
        wait_for(&agent, &cluster, "the self-test fails without the host probe rule", 0, 503, names_the_failure);

        restore(&cluster, backend, &commands);
        wait_for(&agent, &cluster, "the self-test passes again with the rule back", 1, 200, |_| true);
        let runs = agent.metrics();
        assert!(runs.contains("nodeagent_probe_selftest_runs_total{result=\"fail\"}"), "{backend:?}:\n{runs}");
    }
}

/// With periodic drift checks off (`DRIFT_CHECK_INTERVAL=0s`: on demand only), the failed self-test is what asks
/// for the check: the agent puts the rule back by itself, counts the repair, and is ready again.
#[test]
fn a_failed_self_test_has_the_host_probe_rule_repaired_and_the_agent_ready_again() {
    for backend in RuleBackend::ALL {
        eprintln!("--- backend {backend:?}");
        let settings = [("PROBE_SELFTEST_INTERVAL", "4s"), ("DRIFT_CHECK_INTERVAL", "0s")];
        let (cluster, agent, _peer, _web) = enrolled(backend, &settings);
        assert_eq!(agent.metric(REPAIRED).unwrap_or(0), 0, "{backend:?}: nothing repaired yet");

        remove_host_probe_rule(&cluster, backend);
        wait_for(&agent, &cluster, "the self-test fails without the host probe rule", 0, 503, names_the_failure);

        wait_for(&agent, &cluster, "the rule is repaired and the self-test passes again", 1, 200, |_| true);
        assert!(has_host_probe_rule(&cluster, backend), "{backend:?}: the rule is back");
        assert!(agent.metric(REPAIRED).is_some_and(|n| n >= 1), "{backend:?}:\n{}", agent.metrics());
    }
}

/// A pod's own rules drop the self-test's connection (a pod with NET_ADMIN can add rules of its own): the failure
/// is confirmed with another enrolled pod, which passes, so one pod cannot make the node's agent unready.
#[test]
fn a_pod_that_drops_the_self_test_does_not_make_the_agent_unready() {
    let settings = [("PROBE_SELFTEST_INTERVAL", "1s"), ("DRIFT_CHECK_INTERVAL", "1h")];
    let (cluster, agent, _peer, web) = enrolled(RuleBackend::Nftables, &settings);
    let api = run(&cluster, "api");
    // The self-test tries the first enrolled pod in UID order first: that one turns hostile.
    let hostile = if uid(&cluster, NS, "web") < uid(&cluster, NS, "api") { &web } else { &api };
    let snat = PROBE_SNAT_V4.to_string();
    hostile.netns.exec_ok(&["nft", "add", "table", "inet", "hostile"]);
    hostile.netns.exec_ok(&[
        "nft",
        "add",
        "chain",
        "inet",
        "hostile",
        "input",
        "{ type filter hook input priority -400 ; }",
    ]);
    hostile.netns.exec_ok(&["nft", "add", "rule", "inet", "hostile", "input", "ip", "saddr", &snat, "drop"]);

    let ok = "nodeagent_probe_selftest_runs_total{result=\"ok\"}";
    let before = agent.metric(ok).unwrap_or(0);
    let passed_twice =
        within(Instant::now(), Duration::from_secs(60), || (agent.metric(ok).unwrap_or(0) >= before + 2).then_some(()));
    assert!(passed_twice.is_some(), "two more self-tests ran:\n{}\n{}", agent.metrics(), agent.log());
    let fails = agent.metric("nodeagent_probe_selftest_runs_total{result=\"fail\"}").unwrap_or(0);
    assert_eq!(fails, 0, "no self-test failed for the node:\n{}", agent.log());
    assert_eq!((agent.metric(GAUGE), readyz(&cluster).map(|r| r.0)), (Some(1), Some(200)));
}

//! `node-agent explain` (issue #20): why a pod is or is not in the mesh, in one answer. The real agent runs in
//! the node netns with the real plugin; each pod's report is read as a user reads it: from the admin port
//! (`GET /debug/pods/NAMESPACE/NAME`) and from the `explain` subcommand run beside the agent, in its netns with
//! its env, as `kubectl exec` into the istio-cni-node pod runs it. An ambient pod's report carries the node's
//! latest host probe self-test, and `explain --check-drift` has the agent check (and repair) every pod's rules at
//! once rather than at its next `DRIFT_CHECK_INTERVAL`.

use std::net::Ipv4Addr;
use std::process::Command;

use istio_contract::{names, ports};
use serde_json::{json, Value};
use testbed::mesh::{annotate, plain_pod, sidecar_pod, RuleBackend};
use testbed::node_agent::{ambient_conflist, ambient_node, ambient_pod, namespace, netns_id, uid, ZdsPeer};
use testbed::pod_process::PodProcess;
use testbed::wait::{eventually, eventually_or};
use testbed::{bins, Cluster};

/// Namespace of the test pods (not labelled: pods opt in by their own label).
const NS: &str = "shop";
/// A namespace the agent never enrolls (`EXCLUDE_NAMESPACES`).
const EXCLUDED: &str = "batch";

/// `GET path` on the agent's admin port, from the node netns: status and body.
fn admin_get(c: &Cluster, path: &str) -> (u16, String) {
    testbed::http::get(&c.node.netns().path(), ports::CNI_ADMIN, path).expect("the admin port answers")
}

/// Pod `pod`'s report from the admin port.
#[track_caller]
fn report(c: &Cluster, pod: &str) -> Value {
    let (status, body) = admin_get(c, &format!("/debug/pods/{pod}"));
    assert_eq!(status, 200, "{pod}: {body}");
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("{pod}: not JSON ({e}): {body}"))
}

/// What `node-agent explain ARGS` prints when run in the node netns with the agent's env (it is not set here,
/// so the defaults): whether it succeeded, its stdout and its stderr.
fn explain(c: &Cluster, args: &[&str]) -> (bool, String, String) {
    let mut cmd = Command::new(bins::path("node-agent"));
    cmd.arg("explain").args(args).env_clear().env("PATH", std::env::var("PATH").unwrap_or_default());
    let ns = c.node.netns().open().expect("open node netns");
    let out = ns.run(|| cmd.output()).expect("enter node netns").expect("run node-agent explain");
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.success(), text(&out.stdout), text(&out.stderr))
}

/// `explain ARGS`, which must succeed: its stdout.
#[track_caller]
fn explained(c: &Cluster, args: &[&str]) -> String {
    let (ok, stdout, stderr) = explain(c, args);
    assert!(ok, "node-agent explain {args:?} failed: {stderr}");
    stdout
}

/// Records `ip` as the pod's `status.podIPs` (phase Running), as the kubelet does once the sandbox is up.
fn set_pod_ip(c: &Cluster, ns: &str, name: &str, ip: Ipv4Addr) {
    let mut pod = c.api.get("Pod", Some(ns), name).unwrap_or_else(|| panic!("no pod {ns}/{name}"));
    pod["status"] = json!({ "phase": "Running", "podIP": ip.to_string(), "podIPs": [{ "ip": ip.to_string() }] });
    c.api.upsert(pod).expect("store pod status");
}

fn phases(report: &Value) -> Vec<String> {
    let phases = report["timeline"]["phases"].as_array().cloned().unwrap_or_default();
    phases.iter().map(|p| p["phase"].as_str().unwrap_or_default().to_owned()).collect()
}

#[test]
fn explain_tells_an_ambient_pod_a_sidecar_pod_and_pods_left_out_apart() {
    // The agent's own drift checks are off, so rules deleted behind its back stay deleted until explain looks.
    let settings =
        [("EXCLUDE_NAMESPACES", EXCLUDED), ("DRIFT_CHECK_INTERVAL", "0s"), ("PROBE_SELFTEST_INTERVAL", "0s")];
    let (c, agent) = ambient_node(RuleBackend::Nftables, NS, &settings);
    c.api.upsert(namespace(EXCLUDED, json!({ names::DATAPLANE_MODE_LABEL: "ambient" }))).expect("store namespace");
    let peer = ZdsPeer::connect(&agent);
    let list = ambient_conflist(&c);

    // An ambient pod through the plugin, with the proxy's outbound listener in it.
    c.create(&ambient_pod(NS, "web"));
    let web = c.add_with(list.clone(), "web", NS).expect("ADD of the ambient pod");
    let _outbound = testbed::tcp::listen_in(peer.netns(&uid(&c, NS, "web")), ports::OUTBOUND, false);
    // A sidecar pod, running (its process and IPs, so explain finds its netns through /proc as the agent does).
    c.create(&sidecar_pod(NS, "legacy"));
    let legacy = c.add_with(list.clone(), "legacy", NS).expect("ADD of the sidecar pod");
    let _legacy_process = PodProcess::start(&legacy.netns, &uid(&c, NS, "legacy"));
    set_pod_ip(&c, NS, "legacy", legacy.ip);
    // Pods left out: an excluded namespace, an opt-out label, no label at all.
    c.create(&ambient_pod(EXCLUDED, "job"));
    let _job = c.add_with(list.clone(), "job", EXCLUDED).expect("ADD of the excluded pod");
    let mut opted_out = ambient_pod(NS, "quiet");
    opted_out["metadata"]["labels"] = json!({ names::DATAPLANE_MODE_LABEL: "none" });
    c.create(&opted_out);
    let _quiet = c.add_with(list.clone(), "quiet", NS).expect("ADD of the opted-out pod");
    c.create(&plain_pod(NS, "db"));
    let _db = c.add_with(list, "db", NS).expect("ADD of the plain pod");

    // The ambient pod: in the mesh, by the pod-label selector; its netns, rules, proxy, sockets, probe entry.
    let r = report(&c, &format!("{NS}/web"));
    assert_eq!(r["verdict"], "in mesh (ambient)", "{r:#}");
    assert_eq!(r["mode"], "ambient");
    let reason = r["reason"].as_str().unwrap();
    assert!(
        reason.contains("AMBIENT_ENABLEMENT_SELECTOR entry #1") && reason.contains("istio.io/dataplane-mode=ambient"),
        "{reason}"
    );
    assert_eq!(r["netns"]["inode"], netns_id(&web.netns).1, "the netns the agent holds is the pod's: {r:#}");
    assert_eq!(r["ips"], json!([web.ip.to_string()]));
    assert_eq!(r["rules"]["backend"], "nftables", "{r:#}");
    assert!(!r["rules"]["expected"].as_array().unwrap().is_empty(), "{r:#}");
    assert_eq!(r["rules"]["expected"], r["rules"]["found"], "{r:#}");
    assert!(r["rules"].get("missing").is_none() && r["rules"].get("unexpected").is_none(), "no diff: {r:#}");
    assert_eq!(r["zds"]["state"], "acked");
    let listeners = r["listeners"]["found"].as_array().unwrap();
    assert!(listeners.iter().any(|l| l["port"] == ports::OUTBOUND), "the proxy's 15001 socket: {r:#}");
    assert!(r["listeners"]["missing"].as_array().unwrap().contains(&json!(ports::INBOUND_PLAINTEXT)), "{r:#}");
    assert_eq!(r["host_probe"]["in_set"], true, "{r:#}");
    assert!(r.get("last_error").is_none(), "{r:#}");
    assert_eq!(r["timeline"]["source"], "plugin");
    assert_eq!(phases(&r), ["netns", "rules", "proxy_ack", "probe", "annotate"], "{r:#}");
    assert!(r["timeline"]["started_at"].as_str().unwrap().ends_with('Z'), "RFC 3339: {r:#}");

    // The sidecar pod: the plugin's decision and our rules in its netns.
    // Found once the agent's watch has its IPs, as the kubelet reports them.
    let r = eventually("explain finds the sidecar pod's netns through /proc", || {
        let r = report(&c, &format!("{NS}/legacy"));
        r["netns"]["inode"].is_u64().then_some(r)
    });
    assert_eq!(r["verdict"], "in mesh (sidecar)", "{r:#}");
    assert_eq!(r["mode"], "sidecar");
    assert!(r["reason"].as_str().unwrap().contains(names::SIDECAR_STATUS_ANNOTATION), "{r:#}");
    assert_eq!(r["sidecar"]["redirected"], true, "{r:#}");
    assert!(r["sidecar"]["decision"].as_str().unwrap().contains("sidecar's redirect rules"), "{r:#}");
    assert!(r["sidecar"]["rule_count"].as_u64().unwrap() > 0, "the plugin's rules are found: {r:#}");
    assert_eq!(r["netns"]["inode"], netns_id(&legacy.netns).1, "{r:#}");

    // The pods left out, each with its reason.
    let verdict = |pod: &str| report(&c, pod)["verdict"].as_str().unwrap().to_owned();
    assert_eq!(
        verdict(&format!("{EXCLUDED}/job")),
        format!("not in mesh: namespace {EXCLUDED} is in EXCLUDE_NAMESPACES")
    );
    assert_eq!(verdict(&format!("{NS}/quiet")), "not in mesh: pod label istio.io/dataplane-mode=none opts it out");
    assert!(verdict(&format!("{NS}/db")).starts_with("not in mesh: no AMBIENT_ENABLEMENT_SELECTOR entry matches"));

    // The subcommand, as `kubectl exec` runs it: the same report as text, and as JSON.
    let text = explained(&c, &[&format!("{NS}/web")]);
    assert!(text.contains("Verdict:    in mesh (ambient)"), "{text}");
    assert!(text.contains("ZDS:        acked"), "{text}");
    assert!(text.contains("Probe set:  yes"), "{text}");
    assert!(text.contains("nftables: in sync"), "{text}");
    assert!(text.contains("proxy_ack"), "{text}");
    let json: Value =
        serde_json::from_str(&explained(&c, &[&format!("{NS}/legacy"), "-o", "json"])).expect("-o json is JSON");
    assert_eq!(json["verdict"], "in mesh (sidecar)");
    let text = explained(&c, &[&format!("{EXCLUDED}/job")]);
    assert!(
        text.contains(&format!("Verdict:    not in mesh: namespace {EXCLUDED} is in EXCLUDE_NAMESPACES")),
        "{text}"
    );

    // --all: one line per pod with its verdict, as text and as JSON.
    let all = explained(&c, &["--all"]);
    let line = |pod: &str| {
        all.lines().find(|l| l.starts_with(pod)).unwrap_or_else(|| panic!("no {pod} in:\n{all}")).to_owned()
    };
    assert!(line(&format!("{NS}/web ")).ends_with("ambient  in mesh (ambient)"), "{all}");
    assert!(line(&format!("{NS}/legacy ")).ends_with("sidecar  in mesh (sidecar)"), "{all}");
    assert!(line(&format!("{NS}/quiet ")).contains("none     not in mesh: pod label"), "{all}");
    assert!(line(&format!("{EXCLUDED}/job ")).contains("EXCLUDE_NAMESPACES"), "{all}");
    let all: Value = serde_json::from_str(&explained(&c, &["--all", "-o", "json"])).expect("--all -o json is JSON");
    assert_eq!(all.as_array().map(Vec::len), Some(5), "{all:#}");

    // An unknown pod, and an agent that is not there: a non-zero exit and a message that says so.
    let (ok, _, stderr) = explain(&c, &[&format!("{NS}/ghost")]);
    assert!(!ok && stderr.contains(&format!("pod {NS}/ghost is not on this node")), "{stderr}");
    let (status, body) = admin_get(&c, &format!("/debug/pods/{NS}/ghost"));
    assert_eq!(status, 404, "{body}");
    let (ok, _, stderr) = explain(&c, &["--all", "--admin-port", "1"]);
    assert!(!ok && stderr.contains("not reachable on 127.0.0.1:1"), "{stderr}");

    // Rules deleted in the ambient pod behind the agent's back: explain shows the diff.
    web.netns.exec_ok(&["nft", "delete", "table", "inet", "istio-ambient-nat"]);
    let r = report(&c, &format!("{NS}/web"));
    let verdict = r["verdict"].as_str().unwrap();
    assert!(verdict.starts_with("in mesh (ambient), but its rules drifted: "), "{r:#}");
    let missing = r["rules"]["missing"].as_array().expect("missing rules listed");
    assert!(!missing.is_empty() && missing.iter().all(|l| l.as_str().unwrap().contains("istio-ambient-nat")), "{r:#}");
    let text = explained(&c, &[&format!("{NS}/web")]);
    assert!(text.contains("nftables: DRIFTED") && text.contains("Rules missing:\n  inet istio-ambient-nat"), "{text}");
}

#[test]
fn explain_names_the_error_of_a_failed_enrollment_and_when_it_happened() {
    let (c, agent) = ambient_node(RuleBackend::Nftables, NS, &[]);
    let list = ambient_conflist(&c);

    // No node proxy connected: the ADD fails at the proxy step.
    c.create(&ambient_pod(NS, "early"));
    c.add_with(list.clone(), "early", NS).expect_err("ADD fails without a node proxy");
    let r = report(&c, &format!("{NS}/early"));
    let verdict = r["verdict"].as_str().unwrap();
    assert!(verdict.starts_with("enrollment failed: ") && verdict.contains("no node proxy is connected"), "{r:#}");
    assert_eq!(r["mode"], "ambient");
    assert_eq!(r["zds"]["state"], "error", "{r:#}");
    assert!(r["zds"]["message"].as_str().unwrap().contains("no node proxy"), "{r:#}");
    assert!(r["last_error"]["message"].as_str().unwrap().contains("no node proxy"), "{r:#}");
    assert!(r["last_error"]["at"].as_str().unwrap().ends_with('Z'), "RFC 3339: {r:#}");
    assert_eq!(phases(&r), ["netns", "rules", "proxy_ack"], "{r:#}");
    assert_eq!(r["ips"].as_array().map(Vec::len), Some(1), "the IPs the plugin enrolled it with: {r:#}");
    let failed = &r["timeline"]["phases"][2];
    assert!(failed["error"].as_str().unwrap().contains("no node proxy"), "{r:#}");

    // An annotation that makes no rules: the ADD fails at the rules step, and explain names the annotation.
    let _peer = ZdsPeer::connect(&agent);
    let bad = annotate(ambient_pod(NS, "odd"), names::REROUTE_VIRTUAL_INTERFACES, "eth0;reboot");
    c.create(&bad);
    c.add_with(list, "odd", NS).expect_err("ADD fails for an invalid annotation");
    let r = report(&c, &format!("{NS}/odd"));
    let verdict = r["verdict"].as_str().unwrap();
    assert!(verdict.starts_with("enrollment failed: ") && verdict.contains(names::REROUTE_VIRTUAL_INTERFACES), "{r:#}");
    assert_eq!(r["zds"]["state"], "not_sent", "{r:#}");
    assert_eq!(phases(&r), ["netns", "rules"], "{r:#}");

    let text = explained(&c, &[&format!("{NS}/early")]);
    assert!(text.contains("Verdict:    enrollment failed: "), "{text}");
    assert!(text.contains("ZDS:        error: no node proxy is connected"), "{text}");
    assert!(text.contains("Last error: "), "{text}");
    let all = explained(&c, &["--all"]);
    assert!(all.lines().any(|l| l.starts_with(&format!("{NS}/odd ")) && l.contains("enrollment failed")), "{all}");
}

#[test]
fn explain_shows_the_proc_search_of_a_running_pod_and_why_it_failed() {
    let (c, agent) = ambient_node(RuleBackend::Nftables, NS, &[]);
    c.api.upsert(namespace("lab", json!({}))).expect("store namespace");
    let _peer = ZdsPeer::connect(&agent);
    let list = ambient_conflist(&c);
    // Two pods started while their namespace is not in ambient, both with their IPs reported; only "found" has a
    // process in its cgroup, so only its netns can be found through /proc.
    c.create(&plain_pod("lab", "found"));
    let found = c.add_with(list.clone(), "found", "lab").expect("ADD of a plain pod");
    let _found_process = PodProcess::start(&found.netns, &uid(&c, "lab", "found"));
    set_pod_ip(&c, "lab", "found", found.ip);
    c.create(&plain_pod("lab", "lost"));
    let lost = c.add_with(list, "lost", "lab").expect("ADD of a plain pod");
    set_pod_ip(&c, "lab", "lost", lost.ip);

    c.api.upsert(namespace("lab", json!({ names::DATAPLANE_MODE_LABEL: "ambient" }))).expect("label namespace");
    // Enrolled by the watch: its record begins with the /proc search, as its `netns` step.
    let r = eventually("lab/found is enrolled through /proc", || {
        let r = report(&c, "lab/found");
        (r["timeline"]["outcome"] == "enrolled").then_some(r)
    });
    assert_eq!(r["verdict"], "in mesh (ambient)", "{r:#}");
    assert_eq!(r["timeline"]["source"], "watch", "{r:#}");
    assert_eq!(phases(&r), ["netns", "rules", "proxy_ack", "probe", "annotate"], "{r:#}");
    assert_eq!(r["timeline"]["started_at"], r["timeline"]["phases"][0]["started_at"], "{r:#}");
    assert!(r["timeline"]["phases"][0].get("error").is_none(), "{r:#}");

    // Not found: the failed search is the pod's failed enrollment, with the cause and its time.
    let r = eventually("lab/lost's failed search is recorded", || {
        let r = report(&c, "lab/lost");
        r["verdict"].as_str().unwrap().starts_with("enrollment failed: ").then_some(r)
    });
    let verdict = r["verdict"].as_str().unwrap();
    assert!(verdict.contains("netns not found through /proc: no process there has the pod's UID"), "{r:#}");
    assert_eq!(r["timeline"]["source"], "watch", "{r:#}");
    assert_eq!(phases(&r), ["netns"], "{r:#}");
    assert!(r["timeline"]["phases"][0]["error"].as_str().unwrap().contains("not found through /proc"), "{r:#}");
    assert!(r["last_error"]["at"].as_str().unwrap().ends_with('Z'), "RFC 3339: {r:#}");
    assert_eq!(r["zds"]["state"], "not_sent", "{r:#}");
    let text = explained(&c, &["lab/lost"]);
    assert!(text.contains("Verdict:    enrollment failed: netns not found through /proc"), "{text}");

    // Its process shows up; the next reconciliation (here: the pod changes) finds it and enrolls it.
    let _lost_process = PodProcess::start(&lost.netns, &uid(&c, "lab", "lost"));
    let mut pod = c.api.get("Pod", Some("lab"), "lost").expect("pod lab/lost");
    pod["metadata"]["labels"]["touched"] = json!("yes");
    c.api.upsert(pod).expect("store pod");
    let r = eventually("lab/lost is enrolled once its netns is found", || {
        let r = report(&c, "lab/lost");
        (r["timeline"]["outcome"] == "enrolled").then_some(r)
    });
    assert_eq!(r["verdict"], "in mesh (ambient)", "{r:#}");
    assert_eq!(phases(&r), ["netns", "rules", "proxy_ack", "probe", "annotate"], "{r:#}");
    assert_eq!(r["netns"]["inode"], netns_id(&lost.netns).1, "{r:#}");
}

#[test]
fn explain_answers_on_a_sidecar_only_node_too() {
    let (c, _agent) = ambient_node(RuleBackend::IptablesNft, NS, &[("AMBIENT_ENABLED", "false")]);
    let legacy = c.run(&sidecar_pod(NS, "legacy"));
    let _process = PodProcess::start(&legacy.netns, &uid(&c, NS, "legacy"));
    set_pod_ip(&c, NS, "legacy", legacy.ip);
    c.create(&ambient_pod(NS, "web"));

    let r = eventually("explain finds the sidecar pod's netns through /proc", || {
        let r = report(&c, &format!("{NS}/legacy"));
        r["netns"]["inode"].is_u64().then_some(r)
    });
    assert_eq!(r["verdict"], "in mesh (sidecar)", "{r:#}");
    assert_eq!(r["rules"]["backend"], "iptables-nft", "the plugin's rules, read with the agent's backend: {r:#}");
    assert!(r["sidecar"]["rule_count"].as_u64().unwrap() > 0, "{r:#}");
    let web = eventually("the agent's watch has the ambient pod", || {
        let (status, body) = admin_get(&c, &format!("/debug/pods/{NS}/web"));
        (status == 200).then(|| serde_json::from_str::<Value>(&body).expect("JSON"))
    });
    assert_eq!(web["verdict"], "not in mesh: ambient is disabled on this node agent (AMBIENT_ENABLED=false)");
    let all = explained(&c, &["--all"]);
    assert!(all.contains("sidecar  in mesh (sidecar)") && all.contains("AMBIENT_ENABLED=false"), "{all}");
}

#[test]
fn explain_shows_the_probe_self_test_and_check_drift_repairs_on_demand() {
    // The periodic drift check is an hour away, so only `--check-drift` can repair within the test; the probe
    // self-test runs every second.
    let settings = [("DRIFT_CHECK_INTERVAL", "1h"), ("PROBE_SELFTEST_INTERVAL", "1s")];
    let (c, agent) = ambient_node(RuleBackend::IptablesNft, NS, &settings);
    let _peer = ZdsPeer::connect(&agent);
    c.create(&ambient_pod(NS, "web"));
    let web = c.add_with(ambient_conflist(&c), "web", NS).expect("ADD of the ambient pod");
    let pod = format!("{NS}/web");

    // The node's self-test, in the ambient pod's report and its text.
    let r = eventually_or(
        "the probe self-test passed with the enrolled pod",
        || Some(report(&c, &pod)).filter(|r| r["probe_selftest"]["verdict"] == "ok"),
        || format!("{:#}\n--- log:\n{}", report(&c, &pod), agent.log()),
    );
    assert_eq!(r["verdict"], "in mesh (ambient)", "{r:#}");
    assert_eq!(r["probe_selftest"]["pod"], pod.as_str(), "{r:#}");
    assert!(r["probe_selftest"]["at"].as_str().unwrap().ends_with('Z'), "RFC 3339: {r:#}");
    let text = explained(&c, &[&pod]);
    assert!(text.lines().any(|l| l.starts_with(&format!("Self-test:  ok with pod {pod} at "))), "{text}");

    // Rules deleted behind the agent's back stay deleted until asked: explain shows the drift.
    let repaired = || agent.metric(r#"nodeagent_drift_repaired_total{kind="inpod_rules"}"#).unwrap_or(0);
    assert_eq!(repaired(), 0, "no drift check ran yet");
    web.netns.exec_ok(&["iptables-nft", "-t", "nat", "-D", "OUTPUT", "-j", "ISTIO_OUTPUT"]);
    web.netns.exec_ok(&["iptables-nft", "-t", "nat", "-F", "ISTIO_OUTPUT"]);
    let r = report(&c, &pod);
    assert!(r["verdict"].as_str().unwrap().starts_with("in mesh (ambient), but its rules drifted: "), "{r:#}");

    // `--check-drift`, run beside the agent: the check runs now, and repairs the pod.
    let said = explained(&c, &["--check-drift"]);
    assert!(said.starts_with("drift check requested: "), "{said}");
    let r = eventually_or(
        "the on-demand drift check repaired the pod's rules",
        || Some(report(&c, &pod)).filter(|r| r["drift"]["repairs"] == 1 && r["rules"]["missing"].is_null()),
        || format!("{:#}\n--- log:\n{}", report(&c, &pod), agent.log()),
    );
    assert_eq!(r["verdict"], "in mesh (ambient)", "{r:#}");
    assert_eq!(repaired(), 1, "{}", agent.metrics());
    let rules = RuleBackend::IptablesNft.dump(&web.netns);
    assert!(rules.contains("-A OUTPUT -j ISTIO_OUTPUT"), "the jump is back in the pod's netns:\n{rules}");
    let text = explained(&c, &[&pod]);
    assert!(text.contains("iptables-nft: in sync") && text.contains("repaired 1 times"), "{text}");
}

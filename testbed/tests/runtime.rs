//! The fake CNI runtime against the real reference plugins (bridge + host-local) and spy plugins:
//! what ADD/CHECK/DEL do to real namespaces, and exactly what each plugin is given.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use testbed::runtime::{NetworkConfigList, Runtime, RuntimeConf, RuntimeError};
use testbed::{bins, Node, Spy};

fn ipv4_addrs(ns: &testbed::NetnsGuard, dev: &str) -> Vec<String> {
    let addrs = ns.exec_json(&["ip", "-j", "-4", "addr", "show", "dev", dev]);
    addrs[0]["addr_info"]
        .as_array()
        .expect("addr_info")
        .iter()
        .map(|a| format!("{}/{}", a["local"].as_str().unwrap(), a["prefixlen"]))
        .collect()
}

/// Host-side veths enslaved to the node bridge.
fn bridge_ports(node: &Node) -> Vec<String> {
    let links = node.netns().exec_json(&["ip", "-j", "link", "show", "master", testbed::node::BRIDGE]);
    links.as_array().unwrap().iter().map(|l| l["ifname"].as_str().unwrap().to_owned()).collect()
}

#[test]
fn add_configures_the_pod_ip_on_eth0_and_caches_the_result() {
    let node = Node::new();
    let pod = node.add_pod("web", "default", vec![]);

    let expected = pod.result["ips"][0]["address"].as_str().unwrap().to_owned();
    assert!(expected.starts_with(&format!("{}/", pod.ip)), "{expected}");
    assert_eq!(ipv4_addrs(&pod.netns, "eth0"), vec![expected]);
    assert_eq!(bridge_ports(&node).len(), 1, "one host veth on the bridge");
    // The bridge was created in the node netns (where the runtime runs) and is the pod's gateway.
    assert_eq!(ipv4_addrs(node.netns(), testbed::node::BRIDGE), vec![format!("{}/24", node.gateway())]);
    assert_eq!(pod.result["ips"][0]["gateway"], node.gateway().to_string());

    let cached: Value = serde_json::from_slice(&std::fs::read(pod.cache_path()).expect("cache entry")).unwrap();
    assert_eq!(cached["result"], pod.result);
    assert_eq!(cached["containerId"], pod.conf.container_id.as_str());
    assert_eq!(cached["ifName"], "eth0");
}

#[test]
fn two_pods_reach_each_other_over_the_bridge() {
    let node = Node::new();
    let a = node.add_pod("a", "default", vec![]);
    let b = node.add_pod("b", "default", vec![]);
    assert_ne!(a.ip, b.ip);

    let probe = b.netns.listen_tcp(8080);
    a.netns.connect_tcp(SocketAddr::from((b.ip, 8080)), None).expect("a connects to b");
    let accepted = probe.accepted();
    assert_eq!(accepted.peer.ip(), a.ip, "b sees a's pod IP as source");
    assert_eq!(accepted.local, SocketAddr::from((b.ip, 8080)));

    // Nothing listens on 8081: the connection is refused, so the probe can fail.
    let refused = a.netns.connect_tcp(SocketAddr::from((b.ip, 8081)), None);
    assert!(refused.is_err(), "{refused:?}");
}

#[test]
fn connect_as_uid_runs_the_client_as_that_uid() {
    let node = Node::new();
    let a = node.add_pod("a", "default", vec![]);
    let b = node.add_pod("b", "default", vec![]);
    // Only uid 1337 may connect to b:9090 from a.
    a.netns.exec_ok(&[
        "iptables",
        "-A",
        "OUTPUT",
        "-p",
        "tcp",
        "--dport",
        "9090",
        "-m",
        "owner",
        "!",
        "--uid-owner",
        "1337",
        "-j",
        "REJECT",
        "--reject-with",
        "tcp-reset",
    ]);
    let probe = b.netns.listen_tcp(9090);
    assert!(a.netns.connect_tcp(SocketAddr::from((b.ip, 9090)), None).is_err(), "root is rejected");
    a.netns.connect_tcp(SocketAddr::from((b.ip, 9090)), Some(1337)).expect("uid 1337 passes");
    assert_eq!(probe.accepted().peer.ip(), a.ip);
}

#[test]
fn check_passes_and_del_removes_veth_and_cache_and_can_repeat() {
    let node = Node::new();
    let mut pod = node.add_pod("web", "default", vec![]);
    pod.check().expect("CHECK after ADD");
    assert_eq!(bridge_ports(&node).len(), 1);

    pod.del().expect("DEL");
    assert!(bridge_ports(&node).is_empty(), "host veth removed");
    let eth0 = pod.netns.exec(&["ip", "link", "show", "eth0"]);
    assert!(!eth0.status.success(), "eth0 removed from the pod");
    assert!(!pod.cache_path().exists(), "cache entry removed");

    pod.del().expect("repeated DEL succeeds");
    // Nothing cached: libcni still runs CHECK, without a prevResult, and bridge (its IPAM: the address is
    // released) refuses.
    let err = pod.check().expect_err("CHECK without cached result");
    let RuntimeError::Plugin(e) = &err else { panic!("not bridge's refusal: {err}") };
    assert_eq!(e.plugin, "bridge", "{err}");
}

/// A node whose conflist is bridge + two spies; spy1 declares the portMappings capability.
struct SpyChain {
    node: Node,
    spy1: Spy,
    spy2: Spy,
    spy1_out: Value,
    spy2_out: Value,
}

fn spy_chain() -> SpyChain {
    let node = Node::new();
    let spy1_out = json!({"cniVersion": "1.0.0", "ips": [{"address": "10.99.0.5/24"}], "dns": {"domain": "spy1"}});
    let spy2_out = json!({"cniVersion": "1.0.0", "ips": [{"address": "10.99.0.6/24"}], "dns": {"domain": "spy2"}});
    let spy1 = Spy::install(&node.bin_dir(), node.dir(), "spy1", &spy1_out, None);
    let spy2 = Spy::install(&node.bin_dir(), node.dir(), "spy2", &spy2_out, None);
    SpyChain { node, spy1, spy2, spy1_out, spy2_out }
}

#[test]
fn chained_plugins_get_injected_config_prev_result_and_runtime_config() {
    let SpyChain { node, spy1, spy2, spy1_out, spy2_out } = spy_chain();
    let list = NetworkConfigList::from_value(node.conflist(vec![
        json!({"type": "spy1", "capabilities": {"portMappings": true, "bandwidth": false}, "custom": 1}),
        json!({"type": "spy2", "cniVersion": "0.0.1", "name": "overridden"}),
    ]))
    .unwrap();
    let netns = node.pod_netns();
    let ports = json!([{"hostPort": 8080, "containerPort": 80, "protocol": "tcp"}]);
    let conf = RuntimeConf::new("cid1", netns.path())
        .arg("IgnoreUnknown", "1")
        .arg("K8S_POD_NAME", "web")
        .arg("K8S_POD_NAMESPACE", "prod")
        .capability("portMappings", ports.clone())
        .capability("bandwidth", json!({"ingressRate": 1}));
    let rt = node.runtime();

    let result = rt.add(&list, &conf).expect("ADD");
    assert_eq!(result, spy2_out, "ADD returns the last plugin's result");
    assert_eq!(rt.cached_result(&list, &conf).unwrap(), Some(spy2_out.clone()));

    let in1 = spy1.stdin("ADD", "cid1").expect("spy1 ran ADD");
    assert_eq!(in1["cniVersion"], "1.0.0");
    assert_eq!(in1["name"], testbed::node::NETWORK_NAME);
    assert_eq!(in1["custom"], 1);
    assert_eq!(in1["runtimeConfig"], json!({"portMappings": ports}), "only declared+enabled capabilities");
    let bridge_ip = in1["prevResult"]["ips"][0]["address"].as_str().expect("bridge result as prevResult");
    assert!(bridge_ip.starts_with(&node.subnet()[..node.subnet().len() - 4]), "{bridge_ip}");
    let env1 = spy1.env("ADD", "cid1").unwrap();
    for want in [
        "CNI_COMMAND=ADD".to_owned(),
        "CNI_CONTAINERID=cid1".to_owned(),
        format!("CNI_NETNS={}", netns.path().display()),
        "CNI_IFNAME=eth0".to_owned(),
        "CNI_ARGS=IgnoreUnknown=1;K8S_POD_NAME=web;K8S_POD_NAMESPACE=prod".to_owned(),
        format!("CNI_PATH={}", node.bin_dir().display()),
    ] {
        assert!(env1.contains(&want), "{want} missing in {env1:?}");
    }

    let in2 = spy2.stdin("ADD", "cid1").expect("spy2 ran ADD");
    assert_eq!(in2["prevResult"], spy1_out, "prevResult threads through the chain");
    assert_eq!((in2["cniVersion"].as_str(), in2["name"].as_str()), (Some("1.0.0"), Some(testbed::node::NETWORK_NAME)));
    assert!(in2.get("runtimeConfig").is_none(), "no capabilities declared: {in2}");

    rt.del(&list, &conf).expect("DEL");
    let del1 = spy1.stdin("DEL", "cid1").unwrap();
    assert_eq!(del1["prevResult"], spy2_out, "DEL gets the cached result");
    assert_eq!(del1["runtimeConfig"], json!({"portMappings": ports}));
    assert_eq!(rt.cached_result(&list, &conf).unwrap(), None);

    rt.del(&list, &conf).expect("second DEL");
    assert!(spy1.stdin("DEL", "cid1").unwrap().get("prevResult").is_none(), "nothing cached any more");
}

#[test]
fn check_gets_the_cached_result_in_order() {
    // Spies only: bridge's CHECK would (rightly) reject a cached result without its interfaces.
    let SpyChain { node, spy1, spy2, spy2_out, .. } = spy_chain();
    let list = NetworkConfigList::from_value(json!({
        "cniVersion": "1.0.0", "name": "spies", "plugins": [{"type": "spy1"}, {"type": "spy2"}]
    }))
    .unwrap();
    let netns = node.pod_netns();
    let conf = RuntimeConf::new("cid", netns.path());
    let rt = node.runtime();
    rt.add(&list, &conf).unwrap();
    rt.check(&list, &conf).expect("CHECK");
    assert_eq!(spy1.stdin("CHECK", "cid").unwrap()["prevResult"], spy2_out, "CHECK gets the cached result");
    assert_eq!(spy2.stdin("CHECK", "cid").unwrap()["prevResult"], spy2_out);
    let calls = testbed::spy::calls(node.dir());
    assert_eq!(calls[2..], ["spy1 CHECK cid", "spy2 CHECK cid"]);
}

#[test]
fn del_runs_plugins_in_reverse_order() {
    let SpyChain { node, .. } = spy_chain();
    let list =
        NetworkConfigList::from_value(node.conflist(vec![json!({"type": "spy1"}), json!({"type": "spy2"})])).unwrap();
    let netns = node.pod_netns();
    let conf = RuntimeConf::new("cid", netns.path());
    node.runtime().add(&list, &conf).unwrap();
    node.runtime().del(&list, &conf).unwrap();
    let calls = testbed::spy::calls(node.dir());
    assert_eq!(calls, ["spy1 ADD cid", "spy2 ADD cid", "spy2 DEL cid", "spy1 DEL cid"]);
}

#[test]
fn plugin_error_json_is_parsed_into_plugin_error() {
    let node = Node::new();
    let err_json = json!({"cniVersion": "1.0.0", "code": 7, "msg": "boom", "details": "more"});
    Spy::install(&node.bin_dir(), node.dir(), "failing", &json!({}), Some(&err_json));
    let err = node.try_add_pod("web", "default", vec![json!({"type": "failing"})]).expect_err("ADD fails");
    let RuntimeError::Plugin(e) = err else { panic!("not a plugin error: {err}") };
    assert_eq!((e.plugin.as_str(), e.code, e.msg.as_str(), e.details.as_str()), ("failing", Some(7), "boom", "more"));
    assert_eq!(e.exit, Some(1));
    assert!(e.stderr.contains("spy failing failing"), "{}", e.stderr);
}

#[test]
fn hung_plugin_is_killed_at_the_deadline() {
    let node = Node::new();
    let bin = node.bin_dir().join("hang");
    std::fs::write(&bin, "#!/bin/sh\nsleep 600\n").unwrap();
    std::fs::set_permissions(&bin, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let rt = Runtime::new(vec![node.bin_dir()], node.dir().join("cache")).with_timeout(Duration::from_secs(1));
    let list =
        NetworkConfigList::from_value(json!({"cniVersion": "1.0.0", "name": "n", "plugins": [{"type": "hang"}]}))
            .unwrap();
    let start = Instant::now();
    let err = rt.add(&list, &RuntimeConf::new("c", "/proc/self/ns/net")).expect_err("times out");
    assert!(matches!(err, RuntimeError::Timeout { .. }), "{err}");
    assert!(start.elapsed() < Duration::from_secs(10), "killed promptly: {:?}", start.elapsed());
}

#[test]
fn exec_raw_clears_the_environment() {
    let SpyChain { node, spy1, .. } = spy_chain();
    let out = node
        .runtime()
        .exec_raw(&spy1.bin, &[("CNI_COMMAND", "VERSION"), ("CNI_CONTAINERID", "raw")], b"{\"x\":1}")
        .unwrap();
    assert!(out.status.success(), "{}", out.stderr_str());
    assert_eq!(spy1.stdin("VERSION", "raw"), Some(json!({"x": 1})));
    let env = spy1.env("VERSION", "raw").unwrap();
    assert!(env.iter().all(|l| !l.starts_with("HOME=") && !l.starts_with("PATH=")), "env not cleared: {env:?}");
}

#[test]
fn version_reports_supported_versions_of_bridge() {
    let rt = Runtime::new(vec![bins::reference_plugin_dir().to_path_buf()], tempfile::tempdir().unwrap().path());
    let info = rt.version("bridge").expect("VERSION");
    let supported = info["supportedVersions"].as_array().expect("supportedVersions");
    assert!(supported.contains(&json!("1.0.0")), "{info}");
}

#[test]
fn status_and_gc_follow_spec_1_1() {
    let node = Node::new();
    let spy = Spy::install(&node.bin_dir(), node.dir(), "spy", &json!({"cniVersion": "1.1.0"}), None);
    let list =
        NetworkConfigList::from_value(json!({"cniVersion": "1.1.0", "name": "gcnet", "plugins": [{"type": "spy"}]}))
            .unwrap();
    let rt = node.runtime();

    rt.status(&list).expect("STATUS");
    let status = spy.stdin("STATUS", "").expect("STATUS ran");
    assert_eq!((status["name"].as_str(), status.get("prevResult")), (Some("gcnet"), None));

    let ns = node.pod_netns();
    let keep = RuntimeConf::new("keep", ns.path());
    let stale = RuntimeConf::new("stale", ns.path());
    rt.add(&list, &keep).unwrap();
    rt.add(&list, &stale).unwrap();

    rt.gc(&list, &[("keep", "eth0")]).expect("GC");
    assert!(spy.stdin("DEL", "stale").is_some(), "stale attachment DELeted");
    assert!(spy.stdin("DEL", "keep").is_none(), "valid attachment kept");
    assert!(rt.cached_result(&list, &keep).unwrap().is_some());
    assert!(rt.cached_result(&list, &stale).unwrap().is_none());
    let gc = spy.stdin("GC", "").expect("GC ran");
    assert_eq!(gc["cni.dev/valid-attachments"], json!([{"containerID": "keep", "ifname": "eth0"}]));
}

#[test]
fn podman_attaches_a_container_to_the_node_network_through_cni() {
    let node = Node::new();
    let spy = Spy::install(&node.bin_dir(), node.dir(), "spy", &json!({}), None);
    // The spy prints `{}` on ADD; podman only needs a result from the last plugin, so put it first.
    let podman = node.podman(vec![]);
    let mut conflist = node.conflist(vec![]);
    conflist["plugins"].as_array_mut().unwrap().insert(0, json!({"type": "spy"}));
    podman.add_network(&conflist);

    let start = Instant::now();
    let out = podman.run(
        testbed::node::NETWORK_NAME,
        "web-1",
        &[("K8S_POD_NAMESPACE", "prod"), ("K8S_POD_NAME", "web")],
        &["ip", "-4", "-o", "addr", "show", "eth0"],
    );
    let took = start.elapsed();
    assert!(out.status.success(), "podman run failed: {}{}", out.stdout_str(), out.stderr_str());
    let subnet_prefix = node.subnet().trim_end_matches("0/24").to_owned();
    assert!(out.stdout_str().contains(&format!("inet {subnet_prefix}")), "{}", out.stdout_str());
    eprintln!("podman run took {took:?}");

    // podman also asks every plugin for VERSION before ADD and DEL.
    let calls: Vec<String> = testbed::spy::calls(node.dir()).into_iter().filter(|c| c != "spy VERSION").collect();
    let id = calls[0].strip_prefix("spy ADD ").expect("first call is ADD");
    assert_eq!(calls, [format!("spy ADD {id}"), format!("spy DEL {id}")], "ADD, then DEL by --rm");
    let add_env = spy.env("ADD", id).unwrap();
    assert!(
        add_env.contains(
            &"CNI_ARGS=IgnoreUnknown=1;K8S_POD_NAME=web-1;K8S_POD_NAMESPACE=prod;K8S_POD_NAME=web".to_owned()
        ),
        "{add_env:?}"
    );
    assert!(bridge_ports(&node).is_empty(), "--rm ran DEL");
}

#[test]
fn listener_reports_the_original_destination_of_a_redirected_connection() {
    let node = Node::new();
    let a = node.add_pod("a", "default", vec![]);
    let b = node.add_pod("b", "default", vec![]);
    b.netns.exec_ok(&[
        "iptables",
        "-t",
        "nat",
        "-A",
        "PREROUTING",
        "-p",
        "tcp",
        "--dport",
        "80",
        "-j",
        "REDIRECT",
        "--to-ports",
        "15006",
    ]);
    let probe = b.netns.listen_tcp(15006);
    a.netns.connect_tcp(SocketAddr::from((b.ip, 80)), None).expect("connect to b:80");
    let accepted = probe.accepted();
    assert_eq!(accepted.local, SocketAddr::from((b.ip, 15006)));
    assert_eq!(accepted.original_dst, Some(std::net::SocketAddrV4::new(b.ip, 80)));
}

//! Acceptance for ambient mode, end to end: the real `node-agent` in the node netns, the real `istio-cni` plugin
//! run by the fake CNI runtime, the fake API server, and a test node proxy on the agent's ZDS socket.

use std::net::{SocketAddr, SocketAddrV4};

use istio_contract::{names, ports, proxy};
use serde_json::{json, Value};
use testbed::kubelet::KUBELET_UID;
use testbed::mesh::{plain_pod, RuleBackend};
use testbed::node_agent::{
    ambient_conflist, ambient_node, ambient_pod, namespace, netns_id, redirection, uid, NodeAgent, Reply, RequestKind,
    ZdsPeer,
};
use testbed::runtime::RuntimeError;
use testbed::wait::eventually;
use testbed::{Cluster, Pod};

/// Namespace of the test pods (not labelled: pods opt in by their own label).
const NS: &str = "shop";
/// Port the test apps listen on.
const APP_PORT: u16 = 8080;

/// A cluster on `backend` with the `shop` namespace stored, and the agent running on its node.
fn setup(backend: RuleBackend) -> (Cluster, NodeAgent) {
    ambient_node(backend, NS, &[])
}

/// Runs `scenario` once per rule backend, each time on a fresh cluster (from [`setup`]) with a test proxy
/// connected to the agent.
fn on_every_backend(scenario: impl Fn(RuleBackend, &Cluster, &ZdsPeer)) {
    for backend in RuleBackend::ALL {
        eprintln!("--- backend {backend:?}");
        let (c, agent) = setup(backend);
        let peer = ZdsPeer::connect(&agent);
        scenario(backend, &c, &peer);
    }
}

/// Stores `pod` in the API and creates it through the runtime with the ambient conflist.
fn create(cluster: &Cluster, pod: &Value) -> Result<Pod, RuntimeError> {
    cluster.create(pod);
    let name = pod["metadata"]["name"].as_str().unwrap();
    cluster.add_with(ambient_conflist(cluster), name, NS)
}

#[track_caller]
fn run(cluster: &Cluster, pod: &Value) -> Pod {
    create(cluster, pod).unwrap_or_else(|e| panic!("CNI ADD of {} failed: {e}", pod["metadata"]["name"]))
}

fn plugin_msg(result: Result<Pod, RuntimeError>) -> String {
    match result {
        Err(RuntimeError::Plugin(e)) => format!("{} {}", e.msg, e.details),
        Err(other) => panic!("expected the plugin to fail ADD, got {other}"),
        Ok(pod) => panic!("expected ADD to fail, but pod got {}", pod.ip),
    }
}

fn v4(ip: std::net::Ipv4Addr, port: u16) -> SocketAddrV4 {
    SocketAddrV4::new(ip, port)
}

#[test]
fn add_returns_after_the_proxy_got_the_pod_netns_and_the_pod_is_redirected() {
    on_every_backend(|backend, c, peer| {
        let pod = run(c, &ambient_pod(NS, "web"));
        let id = uid(c, NS, "web");

        // Checked without waiting: ADD returned, so the proxy must already have it.
        let adds = peer.received_for(RequestKind::Add, &id);
        assert_eq!(adds.len(), 1, "one AddWorkload for {id}, got {:?}", peer.received());
        assert_eq!(adds[0].fds, vec![netns_id(&pod.netns)], "the one fd is the pod's netns");
        let info = adds[0].info.as_ref().expect("AddWorkload carries workload_info");
        assert_eq!((info.name.as_str(), info.namespace.as_str()), ("web", NS));
        assert_eq!(redirection(c, NS, "web").as_deref(), Some("enabled"));

        let rules = backend.dump(&pod.netns);
        let chain = if backend == RuleBackend::Nftables { "istio-ambient" } else { "ISTIO_PRERT" };
        assert!(rules.contains(chain), "{backend:?}: no {chain} in the pod netns:\n{rules}");
    });
}

#[test]
fn pods_of_a_labelled_namespace_are_enrolled_unless_they_opt_out() {
    let (c, agent) = setup(RuleBackend::Nftables);
    c.api.upsert(namespace("mesh", json!({ names::DATAPLANE_MODE_LABEL: "ambient" }))).expect("store namespace");
    let peer = ZdsPeer::connect(&agent);
    let list = ambient_conflist(&c);

    c.create(&plain_pod("mesh", "web"));
    let web = c.add_with(list.clone(), "web", "mesh").expect("ADD of mesh/web");
    let adds = peer.received_for(RequestKind::Add, &uid(&c, "mesh", "web"));
    assert_eq!(adds.len(), 1, "{:?}", peer.received());
    assert_eq!(adds[0].fds, vec![netns_id(&web.netns)]);
    assert_eq!(redirection(&c, "mesh", "web").as_deref(), Some("enabled"));

    let mut opted_out = plain_pod("mesh", "batch");
    opted_out["metadata"]["labels"] = json!({ names::DATAPLANE_MODE_LABEL: "none" });
    c.create(&opted_out);
    let _batch = c.add_with(list, "batch", "mesh").expect("ADD of mesh/batch");
    assert!(peer.received_for(RequestKind::Add, &uid(&c, "mesh", "batch")).is_empty(), "{:?}", peer.received());
    assert_eq!(redirection(&c, "mesh", "batch"), None);
}

#[test]
fn a_plain_pod_is_not_enrolled() {
    let (c, agent) = setup(RuleBackend::Nftables);
    let peer = ZdsPeer::connect(&agent);
    let pod = run(&c, &plain_pod(NS, "db"));
    assert!(peer.received_for(RequestKind::Add, &uid(&c, NS, "db")).is_empty(), "{:?}", peer.received());
    assert_eq!(redirection(&c, NS, "db"), None);
    let rules = RuleBackend::dump_all(&pod.netns);
    assert!(!rules.contains("ISTIO") && !rules.contains("istio"), "a plain pod got rules:\n{rules}");
}

#[test]
fn outbound_lands_on_a_15001_listener_opened_from_the_received_fd_and_proxy_marked_traffic_is_not_redirected() {
    on_every_backend(|backend, c, peer| {
        let web = run(c, &ambient_pod(NS, "web"));
        let db = run(c, &plain_pod(NS, "db"));
        let web_ns = peer.netns(&uid(c, NS, "web"));

        let proxy = testbed::tcp::listen_in(web_ns, ports::OUTBOUND, false);
        web.netns.connect_tcp(SocketAddr::V4(v4(db.ip, APP_PORT)), None).expect("app connects");
        let got = proxy.accepted();
        assert_eq!(got.local.port(), ports::OUTBOUND);
        assert_eq!(got.original_dst, Some(v4(db.ip, APP_PORT)), "{backend:?}: original destination");

        let app = db.netns.listen_tcp(APP_PORT);
        web.netns.connect_tcp_marked(v4(db.ip, APP_PORT), proxy::PROXY_MARK).expect("proxy-marked connect");
        let got = app.accepted();
        assert_eq!(got.peer.ip(), std::net::IpAddr::V4(web.ip), "{backend:?}: reached the real app, from web");
    });
}

#[test]
fn inbound_to_an_ambient_pod_lands_on_15006() {
    on_every_backend(|_, c, peer| {
        let web = run(c, &ambient_pod(NS, "web"));
        let db = run(c, &plain_pod(NS, "db"));

        let proxy = testbed::tcp::listen_in(peer.netns(&uid(c, NS, "web")), ports::INBOUND_PLAINTEXT, false);
        db.netns.connect_tcp(SocketAddr::V4(v4(web.ip, APP_PORT)), None).expect("db connects to web");
        let got = proxy.accepted();
        assert_eq!(got.local.port(), ports::INBOUND_PLAINTEXT);
        assert_eq!(got.original_dst, Some(v4(web.ip, APP_PORT)), "original destination");
        assert_eq!(got.peer.ip(), std::net::IpAddr::V4(db.ip));
    });
}

#[test]
fn add_fails_closed_without_a_connected_proxy() {
    let (c, _agent) = setup(RuleBackend::Nftables);
    let msg = plugin_msg(create(&c, &ambient_pod(NS, "web")));
    assert!(msg.contains("no node proxy is connected"), "the error says why: {msg}");
    assert_ne!(redirection(&c, NS, "web").as_deref(), Some("enabled"));
}

#[test]
fn add_fails_closed_when_the_proxy_refuses_the_pod() {
    let (c, agent) = setup(RuleBackend::Nftables);
    let peer = ZdsPeer::connect(&agent);
    peer.set_reply(Reply::Nack("out of capacity".into()));
    let msg = plugin_msg(create(&c, &ambient_pod(NS, "web")));
    assert!(msg.contains("out of capacity"), "the proxy's reason reaches the runtime: {msg}");
    assert_eq!(redirection(&c, NS, "web").as_deref(), Some("pending"));
}

#[test]
fn add_fails_closed_when_the_agent_is_not_running() {
    let c = Cluster::with_backend(RuleBackend::Nftables);
    c.api.upsert(namespace(NS, json!({}))).expect("store namespace");
    let msg = plugin_msg(create(&c, &ambient_pod(NS, "web")));
    assert!(msg.contains("pluginevent.sock"), "the error names the agent socket: {msg}");
    assert_eq!(redirection(&c, NS, "web"), None);
}

#[test]
fn after_the_agent_stops_enrolled_pods_keep_their_rules_and_new_pods_fail_closed() {
    let (c, mut agent) = setup(RuleBackend::Nftables);
    let peer = ZdsPeer::connect(&agent);
    let web = run(&c, &ambient_pod(NS, "web"));
    let status = agent.terminate();
    assert!(status.success(), "node-agent exits cleanly on SIGTERM: {status}\n{}", agent.log());

    let proxy = testbed::tcp::listen_in(peer.netns(&uid(&c, NS, "web")), ports::OUTBOUND, false);
    web.netns.connect_tcp(SocketAddr::V4(v4(c.node.gateway(), APP_PORT)), None).expect("app connects");
    assert_eq!(proxy.accepted().original_dst, Some(v4(c.node.gateway(), APP_PORT)), "still redirected");

    let msg = plugin_msg(create(&c, &ambient_pod(NS, "late")));
    assert!(msg.contains("pluginevent.sock"), "the error names the agent socket: {msg}");
    assert_eq!(redirection(&c, NS, "late"), None);
}

#[test]
fn host_connections_to_an_enrolled_pod_come_from_the_probe_address() {
    on_every_backend(|backend, c, _| {
        let web = run(c, &ambient_pod(NS, "web"));
        let app = web.netns.listen_tcp(APP_PORT);
        c.node.netns().connect_tcp(SocketAddr::V4(v4(web.ip, APP_PORT)), Some(KUBELET_UID)).expect("kubelet connects");
        let got = app.accepted();
        assert_eq!(got.peer.ip(), std::net::IpAddr::V4(proxy::PROBE_SNAT_V4), "{backend:?}: SNAT to the probe address");
    });
}

#[test]
fn a_pod_deleted_through_the_api_is_removed_from_the_proxy_and_the_probe_set() {
    let (c, agent) = setup(RuleBackend::Nftables);
    let peer = ZdsPeer::connect(&agent);
    let web = run(&c, &ambient_pod(NS, "web"));
    let id = uid(&c, NS, "web");

    // Deleted through the API while its sandbox still runs (the kubelet has not torn it down yet).
    c.delete_pod(NS, "web", None);
    eventually("the proxy receives DelWorkload", || {
        (!peer.received_for(RequestKind::Del, &id).is_empty()).then_some(())
    });
    // Gone from the agent's cache: a proxy connecting now gets an empty snapshot.
    let fresh = ZdsPeer::connect(&agent);
    assert_eq!(fresh.received().len(), 1, "only SnapshotSent: {:?}", fresh.received());
    // The in-pod rules stay (the netns goes away with the pod), so the host's connection lands on 15006,
    // now from the node's own address.
    let proxy = testbed::tcp::listen_in(peer.netns(&id), ports::INBOUND_PLAINTEXT, false);
    c.node.netns().connect_tcp(SocketAddr::V4(v4(web.ip, APP_PORT)), Some(KUBELET_UID)).expect("kubelet connects");
    assert_eq!(proxy.accepted().peer.ip(), std::net::IpAddr::V4(c.node.gateway()), "no probe SNAT any more");
}

#[test]
fn a_reused_ip_keeps_the_new_pods_probe_entry() {
    on_every_backend(|backend, c, peer| {
        // A one-address range, so the second pod must get the first one's IP.
        let mut list = ambient_conflist(c);
        let only = format!("{}.200", c.node.gateway().to_string().rsplit_once('.').unwrap().0);
        list["plugins"][0]["ipam"]["ranges"][0][0]["rangeStart"] = json!(only);
        list["plugins"][0]["ipam"]["ranges"][0][0]["rangeEnd"] = json!(only);
        let add = |name: &str| {
            c.create(&ambient_pod(NS, name));
            c.add_with(list.clone(), name, NS).unwrap_or_else(|e| panic!("ADD of {name}: {e}"))
        };

        let mut old = add("old");
        old.del().expect("CNI DEL of the old pod releases its IP");
        let new = add("new");
        assert_eq!(new.ip, old.ip, "the IP was reused");
        // The old pod's deletion reaches the agent only now, as a lagging watch would deliver it.
        let old_id = uid(c, NS, "old");
        c.delete_pod(NS, "old", None);
        eventually("the proxy receives DelWorkload for the old pod", || {
            (!peer.received_for(RequestKind::Del, &old_id).is_empty()).then_some(())
        });

        let app = new.netns.listen_tcp(APP_PORT);
        c.node.netns().connect_tcp(SocketAddr::V4(v4(new.ip, APP_PORT)), Some(KUBELET_UID)).expect("kubelet connects");
        assert_eq!(app.accepted().peer.ip(), std::net::IpAddr::V4(proxy::PROBE_SNAT_V4), "{backend:?}: entry kept");
    });
}

#[test]
fn a_host_without_iptables_or_nft_enrolls_ambient_pods_with_native_nftables() {
    let cluster = Cluster::with_backend(RuleBackend::Nftables);
    cluster.api.upsert(namespace(NS, json!({}))).expect("store namespace");
    // Nothing at all can be found on the agent's PATH: no iptables, no nft, no ipset, no shell.
    let empty = tempfile::tempdir().unwrap();
    let agent = NodeAgent::start(&cluster, &[("PATH", empty.path().to_str().unwrap())]);
    let peer = ZdsPeer::connect(&agent);
    let pod = run(&cluster, &ambient_pod(NS, "bare"));
    let id = uid(&cluster, NS, "bare");
    assert_eq!(peer.received_for(RequestKind::Add, &id).len(), 1);
    assert_eq!(redirection(&cluster, NS, "bare").as_deref(), Some("enabled"));
    assert!(RuleBackend::Nftables.dump(&pod.netns).contains("istio-ambient-nat"));
}

#[test]
fn the_plugins_logs_show_up_in_the_agents_log() {
    let (c, agent) = setup(RuleBackend::Nftables);
    let _peer = ZdsPeer::connect(&agent);
    let _pod = run(&c, &ambient_pod(NS, "logged"));
    eventually("the plugin's log line in the agent's log", || {
        let log = agent.log();
        log.lines()
            .any(|l| l.contains("istio_cni_plugin") && l.contains("ambient pod enrolled by the node agent"))
            .then_some(())
    });
}

/// Without hostNetwork (as the chart runs it) the agent's own netns is not the node's: `HOST_NETNS` names the
/// node's, and the host probe rules go there, not into the agent's netns.
#[test]
fn host_probe_rules_go_into_the_host_netns_the_agent_is_given() {
    let cluster = Cluster::with_backend(RuleBackend::Nftables);
    let host = testbed::NetnsGuard::new("host");
    let host_path = host.path().display().to_string();
    let _agent = NodeAgent::start(&cluster, &[("HOST_NETNS", &host_path)]);
    let tables = |ns: &testbed::NetnsGuard| ns.exec_ok(&["nft", "list", "tables"]);
    assert!(tables(&host).contains("istio-ambient"), "host probe tables in HOST_NETNS: {}", tables(&host));
    let own = tables(cluster.node.netns());
    assert!(!own.contains("istio-ambient"), "nothing in the agent's own netns: {own}");
}

/// Interface names that must never reach an in-pod rule: the newline-and-rule, one that the unchecked
/// iptables payload would have taken whole (an ACCEPT at the top of nat OUTPUT: the pod's traffic escapes
/// capture), and a 16-byte name (one over the kernel's limit; nftables used to truncate it).
const UNSAFE_INTERFACES: [&str; 3] =
    ["eth9\n-I OUTPUT -j ACCEPT", "eth9 -j RETURN\n-I OUTPUT -j ACCEPT\n-A OUTPUT -o eth9", "abcdefghijklmnop"];

/// Rule lines the pod's netns holds in any backend: iptables' `-A`/`-I` lines and nftables' `rule`s.
fn rule_lines(ns: &testbed::NetnsGuard) -> Vec<String> {
    let dump = RuleBackend::dump_all(ns);
    let ipt = dump.lines().filter(|l| l.starts_with("-A ") || l.starts_with("-I ")).map(String::from);
    let nft = ns.exec_json(&["nft", "-j", "list", "ruleset"]);
    let nft = nft["nftables"].as_array().into_iter().flatten().filter_map(|i| i.get("rule")).map(Value::to_string);
    ipt.chain(nft).collect()
}

#[test]
fn a_reroute_virtual_interfaces_annotation_holding_a_rule_or_16_bytes_fails_add_in_every_backend_and_programs_nothing()
{
    on_every_backend(|backend, c, peer| {
        let list = testbed::NetworkConfigList::from_value(ambient_conflist(c)).expect("ambient conflist");
        for (i, value) in UNSAFE_INTERFACES.into_iter().enumerate() {
            let name = format!("bad-{i}");
            let mut pod = ambient_pod(NS, &name);
            pod["metadata"]["annotations"] = json!({ names::REROUTE_VIRTUAL_INTERFACES: format!("eth1,{value}") });
            c.create(&pod);
            // ADD by hand, so the pod's netns outlives the failed ADD and can be listed.
            let netns = c.node.pod_netns();
            let conf = testbed::node::pod_attachment(&netns, NS, &name, "");
            let result = c.node.runtime().add(&list, &conf);
            c.node.runtime().del(&list, &conf).expect("DEL after the failed ADD");
            let case = format!("{backend:?} {}={value:?}", names::REROUTE_VIRTUAL_INTERFACES);
            let (code, msg) = match result {
                Err(RuntimeError::Plugin(e)) => (e.code, format!("{} {}", e.msg, e.details)),
                other => panic!("{case}: expected the plugin to fail ADD, got {other:?}"),
            };
            // Invalid config, as on the sidecar path: no retry can fix the pod.
            assert_eq!(code, Some(7), "{case}: {msg}");
            assert!(msg.contains(&format!("annotation {}=", names::REROUTE_VIRTUAL_INTERFACES)), "{case}: {msg}");
            assert!(msg.contains("interface name"), "{case}: {msg}");
            let left = rule_lines(&netns);
            assert!(left.is_empty(), "{case}: rules were programmed:\n{}", left.join("\n"));
            let all = RuleBackend::dump_all(&netns);
            assert!(!all.to_lowercase().contains("istio"), "{case}:\n{all}");
            let id = uid(c, NS, &name);
            assert!(peer.received_for(RequestKind::Add, &id).is_empty(), "{case}: the proxy got the pod");
            assert_eq!(redirection(c, NS, &name), None, "{case}: the pod was annotated");
        }
        // One byte less is the kernel's limit, and is programmed whole.
        let mut pod = ambient_pod(NS, "longest");
        pod["metadata"]["annotations"] = json!({ names::REROUTE_VIRTUAL_INTERFACES: "abcdefghijklmno" });
        let ok = run(c, &pod);
        let dump = backend.dump(&ok.netns);
        assert!(dump.contains("abcdefghijklmno"), "{backend:?}: the 15-byte name is missing:\n{dump}");
    });
}

#[test]
fn a_pod_with_ipv6_off_is_enrolled_with_ipv4_routing_only_and_its_rules_read_back_whole() {
    // IPv4-only nodes often turn IPv6 off (`disable_ipv6`) in the node and in every pod. The agent's settings keep
    // their default (IPv6 on), so the pod's plan has IPv6 rules; the loopback cannot take an IPv6 route there, and
    // adding it used to refuse the pod (EACCES). As Istio's agent, ours leaves IPv6 routing out in such a pod.
    on_every_backend(|backend, c, peer| {
        // First, with IPv6 on in the pod: its IPv6 connmark route is there, and the agent expects it.
        let dual = run(c, &ambient_pod(NS, "dual"));
        let v6_routes = dual.netns.exec_ok(&["ip", "-6", "route", "show", "table", "100"]);
        assert!(v6_routes.contains("local default dev lo"), "{backend:?}: IPv6 on: {v6_routes}");
        let report = pod_report(c, "dual");
        assert_eq!(report["rules"]["expected"], report["rules"]["found"], "{backend:?}: {report:#}");
        let lines = report["rules"]["expected"].as_array().unwrap().iter().filter_map(Value::as_str);
        assert!(lines.clone().any(|l| l == "ipv6 route local default dev lo table 100"), "{report:#}");

        c.node.turn_off_ipv6();
        let pod = run(c, &ambient_pod(NS, "web"));
        assert_eq!(redirection(c, NS, "web").as_deref(), Some("enabled"), "{backend:?}: the pod is enrolled");
        assert_eq!(pod.netns.exec_ok(&["cat", "/proc/sys/net/ipv6/conf/lo/disable_ipv6"]).trim(), "1");

        // Redirected as any pod: its outbound lands on the proxy's 15001.
        let db = run(c, &plain_pod(NS, "db"));
        let proxy = testbed::tcp::listen_in(peer.netns(&uid(c, NS, "web")), ports::OUTBOUND, false);
        pod.netns.connect_tcp(SocketAddr::V4(v4(db.ip, APP_PORT)), None).expect("app connects");
        assert_eq!(proxy.accepted().original_dst, Some(v4(db.ip, APP_PORT)), "{backend:?}: redirected");

        // IPv4 connmark routing in place, no IPv6 routing.
        let v4_routes = pod.netns.exec_ok(&["ip", "-4", "route", "show", "table", "100"]);
        assert!(v4_routes.contains("local default dev lo"), "{backend:?}: {v4_routes}");
        let v6_routes = pod.netns.exec(&["ip", "-6", "route", "show", "table", "100"]);
        assert!(String::from_utf8_lossy(&v6_routes.stdout).trim().is_empty(), "{backend:?}: {v6_routes:?}");

        // The agent reads the pod's rules back as it programmed them: no drift reported (so none repaired).
        let report = pod_report(c, "web");
        assert_eq!(report["verdict"], "in mesh (ambient)", "{backend:?}: {report:#}");
        assert_eq!(report["rules"]["expected"], report["rules"]["found"], "{backend:?}: {report:#}");
        let routing: Vec<&str> =
            report["rules"]["expected"].as_array().unwrap().iter().filter_map(Value::as_str).collect();
        assert!(routing.contains(&"ipv4 route local default dev lo table 100"), "{routing:?}");
        assert!(!routing.iter().any(|l| l.starts_with("ipv6 route")), "{routing:?}");
    });
}

/// Pod `NS/name`'s report from the agent's admin port (what `node-agent explain` shows).
fn pod_report(c: &Cluster, name: &str) -> Value {
    let path = format!("/debug/pods/{NS}/{name}");
    let (status, body) =
        testbed::http::get(&c.node.netns().path(), ports::CNI_ADMIN, &path).expect("the admin port answers");
    assert_eq!(status, 200, "{body}");
    serde_json::from_str(&body).expect("a JSON report")
}

//! Acceptance for the sidecar plugin: pods created through the fake runtime (bridge + istio-cni), served by
//! the fake API server, with real traffic in real network namespaces.

use std::net::{SocketAddr, SocketAddrV4};

use istio_contract::{names, ports, proxy};
use serde_json::{json, Value};
use testbed::mesh::{annotate, plain_pod, proxy_env, sidecar_pod, RuleBackend};
use testbed::runtime::{NetworkConfigList, RuntimeConf, RuntimeError};
use testbed::{Cluster, NetnsGuard};

/// uid of the app container: anything but the proxy's.
const APP_UID: u32 = 1000;

fn addr(ip: std::net::Ipv4Addr, port: u16) -> SocketAddr {
    SocketAddr::new(ip.into(), port)
}

/// Every rule any backend holds in the netns.
fn rules(ns: &NetnsGuard) -> String {
    RuleBackend::dump_all(ns)
}

/// Runs `scenario` once per backend; the backend is printed first so a failure says which one broke.
fn on_every_backend(scenario: impl Fn(RuleBackend)) {
    for backend in RuleBackend::ALL {
        eprintln!("--- backend {backend:?}");
        scenario(backend);
    }
}

/// A rule dump without comments and packet/byte counters, which stray packets (IPv6 neighbour discovery, say)
/// change between two dumps.
fn without_counters(dump: &str) -> String {
    dump.lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| match (l.starts_with(':'), l.rfind(" [")) {
            (true, Some(i)) => l[..i].to_string(),
            _ => match l.find(" counter packets ") {
                Some(i) => format!(
                    "{} counter{}",
                    &l[..i],
                    l[i..].splitn(7, ' ').nth(6).map(|r| format!(" {r}")).unwrap_or_default()
                ),
                None => l.to_string(),
            },
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Runs ADD in a netns that outlives a failed ADD, so tests can look inside afterwards.
fn add_keeping_netns(c: &Cluster, pod: &Value) -> (NetnsGuard, Result<Value, RuntimeError>) {
    let netns = c.node.pod_netns();
    let list = NetworkConfigList::from_value(c.conflist()).unwrap();
    let conf = RuntimeConf::new(netns.name(), netns.path())
        .arg("IgnoreUnknown", "1")
        .arg("K8S_POD_NAMESPACE", pod["metadata"]["namespace"].as_str().unwrap())
        .arg("K8S_POD_NAME", pod["metadata"]["name"].as_str().unwrap());
    let result = c.node.runtime().add(&list, &conf);
    if result.is_err() {
        c.node.runtime().del(&list, &conf).expect("DEL after failed ADD");
    }
    (netns, result)
}

fn plugin_error(result: Result<Value, RuntimeError>) -> testbed::PluginError {
    match result {
        Err(RuntimeError::Plugin(e)) => *e,
        other => panic!("expected a plugin error, got {other:?}"),
    }
}

#[test]
fn outbound_from_a_sidecar_pod_lands_on_15001_with_the_original_destination() {
    on_every_backend(|backend| {
        let c = Cluster::with_backend(backend);
        let web = c.run(&sidecar_pod("shop", "web"));
        let db = c.run(&plain_pod("shop", "db"));
        let proxy = web.netns.listen_tcp(ports::OUTBOUND);
        web.netns.connect_tcp(addr(db.ip, 8080), Some(APP_UID)).expect("app connects");
        let got = proxy.accepted();
        assert_eq!(got.local.port(), ports::OUTBOUND);
        assert_eq!(got.original_dst, Some(SocketAddrV4::new(db.ip, 8080)));
    });
}

#[test]
fn inbound_to_a_sidecar_pod_lands_on_15006() {
    on_every_backend(|backend| {
        let c = Cluster::with_backend(backend);
        let web = c.run(&sidecar_pod("shop", "web"));
        let client = c.run(&plain_pod("shop", "client"));
        let proxy = web.netns.listen_tcp(ports::INBOUND_PLAINTEXT);
        client.netns.connect_tcp(addr(web.ip, 8080), None).expect("client connects");
        let got = proxy.accepted();
        assert_eq!(got.local.port(), ports::INBOUND_PLAINTEXT);
        assert_eq!(got.original_dst, Some(SocketAddrV4::new(web.ip, 8080)));
        assert_eq!(got.peer.ip(), std::net::IpAddr::from(client.ip), "the proxy sees the real client");
    });
}

#[test]
fn tproxy_inbound_lands_on_a_transparent_15006_listener_that_sees_the_original_destination() {
    on_every_backend(|backend| {
        let c = Cluster::with_backend(backend);
        let web = c.run(&annotate(sidecar_pod("shop", "web"), "sidecar.istio.io/interceptionMode", "TPROXY"));
        let client = c.run(&plain_pod("shop", "client"));
        // Nothing listens on 8080: only the TPROXY rule can deliver the connection to this socket.
        let proxy = web.netns.listen_tcp_transparent(ports::INBOUND_PLAINTEXT);
        client.netns.connect_tcp(addr(web.ip, 8080), None).expect("client connects");
        let got = proxy.accepted();
        assert_eq!(got.local, addr(web.ip, 8080), "TPROXY keeps the original destination as the local address");
        // Outbound still uses REDIRECT in TPROXY mode.
        let db = c.run(&plain_pod("shop", "db"));
        let out = web.netns.listen_tcp(ports::OUTBOUND);
        web.netns.connect_tcp(addr(db.ip, 5432), Some(APP_UID)).expect("app connects");
        assert_eq!(out.accepted().original_dst, Some(SocketAddrV4::new(db.ip, 5432)));
        let rule = web.netns.exec_ok(&["ip", "rule"]);
        assert!(rule.contains("fwmark 0x539 lookup 133"), "TPROXY policy routing missing: {rule}");
    });
}

#[test]
fn excluded_ports_and_the_proxy_uid_are_not_redirected() {
    on_every_backend(|backend| {
        let c = Cluster::with_backend(backend);
        let pod = annotate(sidecar_pod("shop", "web"), "traffic.sidecar.istio.io/excludeInboundPorts", "9090");
        let web = c.run(&annotate(pod, "traffic.sidecar.istio.io/excludeOutboundPorts", "5432"));
        let db = c.run(&plain_pod("shop", "db"));

        let app = web.netns.listen_tcp(9090);
        db.netns.connect_tcp(addr(web.ip, 9090), None).expect("connect to excluded inbound port");
        assert_eq!(app.accepted().local, addr(web.ip, 9090), "excluded inbound port reaches the app");

        let db_listener = db.netns.listen_tcp(8080);
        web.netns.connect_tcp(addr(db.ip, 8080), Some(proxy::PROXY_UID)).expect("proxy connects");
        assert_eq!(db_listener.accepted().peer.ip(), std::net::IpAddr::from(web.ip), "uid 1337 goes straight out");

        let db_pg = db.netns.listen_tcp(5432);
        web.netns.connect_tcp(addr(db.ip, 5432), Some(APP_UID)).expect("app connects to excluded port");
        assert_eq!(db_pg.accepted().local, addr(db.ip, 5432), "excluded outbound port goes straight out");
    });
}

#[test]
fn pods_without_a_sidecar_get_no_rules_and_keep_their_ip() {
    let c = Cluster::new();
    let skipped = [
        plain_pod("shop", "plain"),
        annotate(sidecar_pod("shop", "opted-out"), "sidecar.istio.io/inject", "false"),
        proxy_env(sidecar_pod("shop", "no-envoy"), "DISABLE_ENVOY", "true"),
    ];
    for pod in &skipped {
        let p = c.run(pod);
        assert!(!rules(&p.netns).to_lowercase().contains("istio"), "{}: rules were installed", pod["metadata"]["name"]);
        let eth0 = p.netns.exec_ok(&["ip", "-4", "-o", "addr", "show", "eth0"]);
        assert!(eth0.contains(&format!("{}/24", p.ip)), "pod IP missing on eth0: {eth0}");
        assert_eq!(p.result["interfaces"].as_array().map(Vec::len), Some(3), "bridge's interfaces passed through");
        assert_eq!(p.result["ips"][0]["gateway"], json!(c.node.gateway().to_string()));
    }
}

#[test]
fn an_invalid_annotation_fails_add_with_code_7_and_leaves_no_rules() {
    let c = Cluster::new();
    let pod = annotate(sidecar_pod("shop", "bad"), "traffic.sidecar.istio.io/includeInboundPorts", "80,http");
    c.create(&pod);
    let (netns, result) = add_keeping_netns(&c, &pod);
    let err = plugin_error(result);
    assert_eq!(err.code, Some(7), "{err:?}");
    assert!(err.msg.contains("traffic.sidecar.istio.io/includeInboundPorts"), "{}", err.msg);
    assert!(!rules(&netns).to_lowercase().contains("istio"));
}

/// Interface names that must never reach a rule: the newline-and-rule, one that the unchecked
/// iptables payload would have taken whole (an ACCEPT at the top of nat OUTPUT: the pod's traffic escapes capture),
/// and a 16-byte name (one over the kernel's limit; nftables used to truncate it).
const UNSAFE_INTERFACES: [&str; 3] =
    ["eth9\n-I OUTPUT -j ACCEPT", "eth9 -j RETURN\n-I OUTPUT -j ACCEPT\n-A OUTPUT -o eth9", "abcdefghijklmnop"];

/// Rule lines in a dump of every backend: iptables' `-A`/`-I` lines and nftables' `rule`s.
fn rule_lines(ns: &NetnsGuard) -> Vec<String> {
    let dump = rules(ns);
    let ipt = dump.lines().filter(|l| l.starts_with("-A ") || l.starts_with("-I ")).map(String::from);
    let nft = ns.exec_json(&["nft", "-j", "list", "ruleset"]);
    let nft = nft["nftables"].as_array().into_iter().flatten().filter_map(|i| i.get("rule")).map(Value::to_string);
    ipt.chain(nft).collect()
}

#[test]
fn an_interface_annotation_holding_a_rule_or_16_bytes_fails_add_with_code_7_in_every_backend_and_programs_nothing() {
    on_every_backend(|backend| {
        let c = Cluster::with_backend(backend);
        let annotations = [names::EXCLUDE_INTERFACES, names::REROUTE_VIRTUAL_INTERFACES, names::KUBEVIRT_INTERFACES];
        for (i, annotation) in annotations.into_iter().enumerate() {
            for (j, value) in UNSAFE_INTERFACES.into_iter().enumerate() {
                let pod = annotate(sidecar_pod("shop", &format!("bad-{i}-{j}")), annotation, &format!("eth1,{value}"));
                c.create(&pod);
                let (netns, result) = add_keeping_netns(&c, &pod);
                let err = plugin_error(result);
                let case = format!("{backend:?} {annotation}={value:?}");
                assert_eq!(err.code, Some(7), "{case}: {err:?}");
                assert!(err.msg.contains(&format!("annotation {annotation}=")), "{case}: {}", err.msg);
                assert!(err.msg.contains("interface name"), "{case}: {}", err.msg);
                let left = rule_lines(&netns);
                assert!(left.is_empty(), "{case}: rules were programmed:\n{}", left.join("\n"));
                assert!(!rules(&netns).to_lowercase().contains("istio"), "{case}:\n{}", rules(&netns));
            }
        }
        // One byte less is the kernel's limit, and is programmed whole.
        let ok = c.run(&annotate(sidecar_pod("shop", "longest"), names::EXCLUDE_INTERFACES, "abcdefghijklmno"));
        let dump = backend.dump(&ok.netns);
        assert!(dump.contains("abcdefghijklmno"), "{backend:?}: the 15-byte name is missing:\n{dump}");
    });
}

#[test]
fn an_unknown_force_iptables_binary_fails_add_with_code_7_naming_it_and_programs_nothing() {
    let mut c = Cluster::new();
    c.plugin_overrides = json!({ "force_iptables_binary": "iptables-nft\n-A OUTPUT -j ACCEPT" });
    let pod = sidecar_pod("shop", "web");
    c.create(&pod);
    let (netns, result) = add_keeping_netns(&c, &pod);
    let err = plugin_error(result);
    assert_eq!(err.code, Some(7), "{err:?}");
    assert!(err.msg.contains("force_iptables_binary"), "{}", err.msg);
    assert!(rule_lines(&netns).is_empty() && !rules(&netns).to_lowercase().contains("istio"));
}

#[test]
fn add_fails_closed_with_code_11_when_the_api_server_is_down() {
    let c = Cluster::new();
    let pod = sidecar_pod("shop", "web");
    c.create(&pod);
    c.api.set_fault(Some(fake_apiserver::Fault::Refuse));
    let (netns, result) = add_keeping_netns(&c, &pod);
    let err = plugin_error(result);
    assert_eq!(err.code, Some(11), "{err:?}");
    assert!(err.msg.contains("shop/web") && err.msg.contains("3 attempts"), "{}", err.msg);
    assert!(
        !rules(&netns).to_lowercase().contains("istio"),
        "a pod that should be meshed must not start half-redirected"
    );
}

#[test]
fn add_fails_closed_when_the_pod_is_unknown_to_the_api() {
    let c = Cluster::new();
    let (_netns, result) = add_keeping_netns(&c, &sidecar_pod("shop", "ghost"));
    assert_eq!(plugin_error(result).code, Some(11));
}

#[test]
fn own_pods_and_excluded_namespaces_pass_through_without_touching_the_api() {
    let c = Cluster::new();
    std::fs::remove_file(c.run_dir().join("istio-cni-kubeconfig")).unwrap();
    c.api.clear_requests();
    let own = c.run(&sidecar_pod("istio-system", "istio-cni-node-x7k2p"));
    let system = c.run(&sidecar_pod("kube-system", "coredns"));
    assert!(!rules(&own.netns).to_lowercase().contains("istio"));
    assert!(!rules(&system.netns).to_lowercase().contains("istio"));
    assert!(c.api.requests().is_empty(), "API was called: {:?}", c.api.requests());
}

#[test]
fn one_api_call_per_add_and_nothing_kept_outside_the_pod() {
    let c = Cluster::new();
    let before = dir_listing(&c);
    c.api.clear_requests();
    let web = c.run(&sidecar_pod("shop", "web"));
    let gets: Vec<_> = c.api.requests().into_iter().filter(|r| r.method == "GET").collect();
    assert_eq!(gets.len(), 1, "{gets:?}");
    assert!(gets[0].path.ends_with("/namespaces/shop/pods/web"), "{gets:?}");
    // GC has nothing to collect: ADD left no state behind but the log file.
    let mut after = dir_listing(&c);
    after.retain(|f| !f.ends_with("istio-cni.log"));
    assert_eq!(before, after);
    let list = NetworkConfigList::from_value(json!({"cniVersion": "1.1.0", "name": "gc", "plugins": [c.istio_cni()]}));
    c.node.runtime().gc(&list.unwrap(), &[]).expect("GC succeeds");
    assert!(rules(&web.netns).contains("ISTIO_OUTPUT"), "GC must not touch live pods");
}

fn dir_listing(c: &Cluster) -> Vec<String> {
    let mut files: Vec<String> =
        std::fs::read_dir(c.run_dir()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into()).collect();
    files.sort();
    files
}

#[test]
fn check_and_repeated_del_succeed_for_a_sidecar_pod() {
    let c = Cluster::new();
    let mut web = c.run(&sidecar_pod("shop", "web"));
    web.check().expect("CHECK");
    web.del().expect("DEL");
    web.del().expect("repeated DEL");
    // containerd's repeated StopPodSandbox once the netns is gone: DEL with CNI_NETNS="" must succeed.
    let out = std::process::Command::new("ip").args(["netns", "del", web.netns.name()]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    web.del_without_netns().expect("DEL without a netns");
}

#[test]
fn check_without_a_cached_result_is_refused_by_the_plugin() {
    // libcni runs CHECK even when nothing is cached, without a prevResult: the plugin itself must refuse.
    let c = Cluster::new();
    let list =
        NetworkConfigList::from_value(json!({"cniVersion": "1.0.0", "name": "solo", "plugins": [c.istio_cni()]}))
            .unwrap();
    let ns = c.node.pod_netns();
    let conf = RuntimeConf::new("never-added", ns.path());
    let err = c.node.runtime().check(&list, &conf).expect_err("CHECK of an attachment never added");
    let RuntimeError::Plugin(e) = &err else { panic!("not the plugin's refusal: {err}") };
    assert_eq!((e.plugin.as_str(), e.code), ("istio-cni", Some(7)), "{err}");
    assert!(e.msg.contains("prevResult"), "{err}");
}

#[test]
fn reapplying_is_idempotent() {
    on_every_backend(|backend| {
        let c = Cluster::with_backend(backend);
        let web = c.run(&sidecar_pod("shop", "web"));
        let first = backend.dump(&web.netns);
        // Run our plugin's ADD again on the same pod, exactly as the runtime invoked it the first time.
        let mut stdin = c.istio_cni();
        stdin["cniVersion"] = json!("1.0.0");
        stdin["name"] = json!("cni-test-net");
        stdin["prevResult"] = web.result.clone();
        let netns = web.netns.path();
        let env = [
            ("CNI_COMMAND", "ADD"),
            ("CNI_CONTAINERID", web.conf.container_id.as_str()),
            ("CNI_NETNS", netns.to_str().unwrap()),
            ("CNI_IFNAME", "eth0"),
            ("CNI_ARGS", "K8S_POD_NAMESPACE=shop;K8S_POD_NAME=web"),
        ];
        let bin = testbed::bins::path("istio-cni");
        let out = c.node.runtime().exec_raw(&bin, &env, stdin.to_string().as_bytes()).unwrap();
        assert!(out.status.success(), "second ADD: {}{}", out.stdout_str(), out.stderr_str());
        let result: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(result, web.result, "prevResult passes through unchanged");
        assert_eq!(without_counters(&first), without_counters(&backend.dump(&web.netns)));
    });
}

#[test]
fn dns_capture_and_invalid_drop_rules_are_accepted_by_the_kernel() {
    on_every_backend(|backend| {
        let c = Cluster::with_backend(backend);
        let pod = proxy_env(sidecar_pod("shop", "web"), "ISTIO_META_DNS_CAPTURE", "true");
        let web = c.run(&proxy_env(pod, "INVALID_DROP", "true"));
        let saved = backend.dump(&web.netns);
        let markers: &[&str] = match backend {
            RuleBackend::Nftables => &["redirect to :15053", "ct zone set 1", "ct state invalid"],
            _ => &["--to-ports 15053", "CT --zone 1", "--ctstate INVALID -j ISTIO_DROP"],
        };
        for marker in markers {
            assert!(saved.contains(marker), "{marker:?} missing:\n{saved}");
        }
    });
}

#[test]
fn each_backend_programs_only_its_own_tables() {
    let marker = |b: RuleBackend, ns: &NetnsGuard| match b {
        RuleBackend::Nftables => ns.exec_ok(&["nft", "list", "tables"]).contains("istio-proxy-nat"),
        RuleBackend::IptablesNft => ns.exec_ok(&["iptables-nft-save"]).contains("-A ISTIO_OUTPUT -j ISTIO_REDIRECT"),
        RuleBackend::IptablesLegacy => {
            ns.exec_ok(&["iptables-legacy-save"]).contains("-A ISTIO_OUTPUT -j ISTIO_REDIRECT")
        }
    };
    on_every_backend(|backend| {
        let c = Cluster::with_backend(backend);
        let web = c.run(&sidecar_pod("shop", "web"));
        for other in RuleBackend::ALL {
            assert_eq!(marker(other, &web.netns), other == backend, "{other:?} tables after ADD with {backend:?}");
        }
    });
}

#[test]
fn pods_with_ipv6_addresses_get_ipv6_rules() {
    on_every_backend(|backend| {
        let c = Cluster::with_backend(backend);
        let mut list = c.conflist();
        let v6 = format!("fd00:{:x}::/64", std::process::id() % 0xffff);
        list["plugins"][0]["ipam"]["ranges"].as_array_mut().unwrap().push(json!([{ "subnet": v6 }]));
        c.create(&sidecar_pod("shop", "dual"));
        let dual = c.node.try_add_pod_with(list, "dual", "shop").expect("dual-stack ADD");
        let ips = dual.result["ips"].as_array().unwrap();
        assert!(ips.iter().any(|ip| ip["address"].as_str().unwrap().contains(':')), "no IPv6 address: {ips:?}");
        let marker = match backend {
            RuleBackend::Nftables => "ip6 saddr ::6",
            _ => "-A ISTIO_OUTPUT -s ::6/128 -o lo -j RETURN",
        };
        let saved = backend.dump(&dual.netns);
        assert!(saved.contains(marker), "{marker:?} missing:\n{saved}");
        assert!(dual.netns.exec_ok(&["ip", "-6", "addr", "show", "dev", "lo"]).contains("::6/128"));
    });
}

#[test]
fn add_does_not_wait_for_the_hosts_xtables_lock() {
    let c = Cluster::with_backend(RuleBackend::IptablesLegacy);
    // kube-proxy holding the host's xtables lock must not stall pod creation: the pod netns has its own tables.
    let lock = std::fs::OpenOptions::new().create(true).truncate(false).write(true).open("/run/xtables.lock").unwrap();
    let held = nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusiveNonblock).expect("take xtables lock");
    let web = c.run(&sidecar_pod("shop", "web"));
    assert!(web.netns.exec_ok(&["iptables-legacy-save"]).contains("ISTIO_REDIRECT"));
    drop(held);
}

#[test]
fn a_host_without_iptables_or_nft_programs_sidecar_pods_with_native_nftables() {
    let c = Cluster::with_backend(RuleBackend::Nftables);
    c.create(&sidecar_pod("shop", "web"));
    let pod_ns = c.node.pod_netns();
    let mut stdin = c.istio_cni();
    stdin["cniVersion"] = json!("1.0.0");
    stdin["name"] = json!("k8s-pod-network");
    let empty = tempfile::tempdir().unwrap();
    let netns = pod_ns.path();
    let env = [
        ("CNI_COMMAND", "ADD"),
        ("CNI_CONTAINERID", "no-binaries"),
        ("CNI_NETNS", netns.to_str().unwrap()),
        ("CNI_IFNAME", "eth0"),
        ("CNI_ARGS", "K8S_POD_NAMESPACE=shop;K8S_POD_NAME=web"),
        // Nothing at all can be found on this PATH: no iptables, no nft, no shell.
        ("PATH", empty.path().to_str().unwrap()),
    ];
    let bin = testbed::bins::path("istio-cni");
    let out = c.node.runtime().exec_raw(&bin, &env, stdin.to_string().as_bytes()).unwrap();
    assert!(out.status.success(), "ADD without binaries: {}{}", out.stdout_str(), out.stderr_str());
    let tables = pod_ns.exec_ok(&["nft", "list", "tables"]);
    assert!(tables.contains("istio-proxy-nat"), "{tables}");
}

/// Two backends at once are a known source of silent bypass: a host (the node netns the plugin runs in) holding
/// iptables-legacy rules gets a warning naming it from a plugin that programs with native nftables, and the pod
/// still gets its rules.
#[test]
fn add_warns_when_the_host_also_has_rules_in_another_backend() {
    let c = Cluster::with_backend(RuleBackend::Nftables);
    c.node.netns().exec_ok(&["iptables-legacy", "-t", "nat", "-N", "KUBE-LIKE"]);
    let web = c.run(&sidecar_pod("shop", "web"));
    assert!(web.netns.exec_ok(&["nft", "list", "tables"]).contains("istio-proxy-nat"), "the pod is redirected");
    let log = std::fs::read_to_string(c.run_dir().join("istio-cni.log")).unwrap();
    let warning = log.lines().find(|l| l.contains("also has rules in another packet-filter backend"));
    let warning = warning.unwrap_or_else(|| panic!("no mixed-backend warning in the plugin log:\n{log}"));
    assert!(warning.contains("iptables-legacy") && warning.contains("pod=\"web\""), "{warning}");
}

//! Security checks of the node side, as an attacker on the node or in a pod would probe them: file and socket
//! modes, the plugin event socket's surface, and secrets in logs at the most verbose level.
//!
//! Covered elsewhere: the kubeconfig's 0600 mode (`installer.rs::installs_into_a_bridge_conflist_and_a_new_
//! sidecar_pod_gets_its_rules`), mTLS refusals, plaintext on 15008 and the proxy's own logs
//! (`e2e/tests/proxy_security.rs`, `e2e/tests/proxy_errors.rs`), CONNECT to the proxy's own ports
//! (`e2e/tests/proxy_errors.rs::b_answers_protocol_errors_with_400_and_503`).

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use istio_contract::{names, paths};
use serde_json::json;
use testbed::chart;
use testbed::chart::Rendered;
use testbed::hbone_proxy::Proxy;
use testbed::install_cni::Installer;
use testbed::mesh::{sidecar_pod, RuleBackend, CHART_SETS};
use testbed::node_agent::{ambient_conflist, ambient_node, ambient_pod, namespace, redirection, NodeAgent, ZdsPeer};
use testbed::Cluster;

const NS: &str = "shop";

/// The bearer token of a kubeconfig (a binary's credentials).
fn token_of(kubeconfig: &Path) -> String {
    let text = std::fs::read_to_string(kubeconfig).unwrap_or_else(|e| panic!("read {}: {e}", kubeconfig.display()));
    let config: serde_json::Value = serde_yaml::from_str(&text).expect("kubeconfig is YAML");
    let token = config["users"][0]["user"]["token"].as_str().expect("kubeconfig has a token user");
    assert!(token.len() > 16, "a real token: {token}");
    token.to_owned()
}

/// A line of the body of the cluster CA certificate, which the installer puts into the kubeconfig.
fn ca_body_line(cluster: &Cluster) -> String {
    cluster.ca_pem().lines().nth(1).expect("the CA PEM has a body").to_owned()
}

fn mode(path: &Path) -> u32 {
    std::fs::symlink_metadata(path).unwrap_or_else(|e| panic!("stat {}: {e}", path.display())).permissions().mode()
        & 0o7777
}

fn setup(overrides: &[(&str, &str)]) -> (Cluster, NodeAgent) {
    ambient_node(RuleBackend::Nftables, NS, overrides)
}

#[test]
fn the_zds_socket_is_not_world_writable_and_the_plugin_sockets_have_the_documented_modes() {
    let (c, agent) = setup(&[]);
    // Whoever can connect to ZDS receives every pod's netns: owner and group only (docs/node-agent.md: 0770).
    let zds = mode(&agent.zds_socket());
    assert_eq!(zds, 0o770, "ZDS socket mode {zds:o}");
    // The plugin runs as the runtime's user: the sockets are 0666 inside a 0750 run dir (docs/node-agent.md).
    assert_eq!(mode(&c.run_dir()), 0o750, "run dir mode {:o}", mode(&c.run_dir()));
    for name in ["pluginevent.sock", "log.sock"] {
        let path = c.run_dir().join(name);
        assert_eq!(mode(&path), 0o666, "{name} mode {:o}", mode(&path));
    }
}

/// Sends `request` on a fresh connection to the plugin event socket; returns the status code (0 when the agent
/// closed without answering) and the body.
fn send(socket: &Path, request: &[u8]) -> (u16, String) {
    let mut stream = UnixStream::connect(socket).expect("connect to pluginevent.sock");
    stream.set_read_timeout(Some(Duration::from_secs(10))).expect("read timeout");
    let _ = stream.write_all(request);
    let mut raw = Vec::new();
    let _ = stream.read_to_end(&mut raw);
    let raw = String::from_utf8_lossy(&raw).into_owned();
    let status = raw.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    (status, raw.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default())
}

fn http(method: &str, path: &str, body: &[u8]) -> Vec<u8> {
    let mut request = format!(
        "{method} {path} HTTP/1.1\r\nHost: cni\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    request.extend_from_slice(body);
    request
}

#[test]
fn the_plugin_event_socket_serves_only_post_cmdadd_and_shrugs_off_garbage() {
    let (c, agent) = setup(&[]);
    let _peer = ZdsPeer::connect(&agent);
    let socket = c.run_dir().join("pluginevent.sock");
    c.create(&ambient_pod(NS, "web"));
    let event = json!({ "Netns": "/proc/1/ns/net", "PodName": "web", "PodNamespace": NS, "IPs": [] }).to_string();

    // Other methods and paths, with a body that would enroll the pod on POST /cmdadd.
    for (method, path) in [("GET", "/cmdadd"), ("PUT", "/cmdadd"), ("DELETE", "/cmdadd"), ("POST", "/cmddel")] {
        let (status, body) = send(&socket, &http(method, path, event.as_bytes()));
        assert!(matches!(status, 404 | 405), "{method} {path}: {status} {body}");
    }
    let oversized = format!("{{\"PodName\":\"{}\"}}", "x".repeat(128 * 1024));
    let bad_bodies: [(&str, &[u8]); 4] = [
        ("not JSON", b"\x00\xffnot json"),
        ("JSON of the wrong shape", b"[1,2,3]"),
        ("an empty body", b""),
        ("a 128 KiB body", oversized.as_bytes()),
    ];
    for (what, body) in bad_bodies {
        let (status, answer) = send(&socket, &http("POST", "/cmdadd", body));
        assert_eq!(status, 400, "{what}: {answer}");
    }
    let (status, _) = send(&socket, b"\x16\x03\x01\x00\xa5garbage that is no HTTP at all\r\n\r\n");
    assert!(matches!(status, 0 | 400), "garbage: answered {status}");

    // None of it enrolled the pod or hurt the agent; the plugin's real ADD still works.
    assert_eq!(redirection(&c, NS, "web"), None, "a refused request touched the pod");
    assert_eq!(agent.probes(), (Some(200), Some(200)));
    let pod = c.add_with(ambient_conflist(&c), "web", NS).expect("ADD through the plugin");
    assert_eq!(redirection(&c, NS, "web").as_deref(), Some("enabled"));
    drop(pod);
}

/// Every secret's tell-tale in `log`, named.
fn leaks(log: &str, secrets: &[&str]) -> Vec<String> {
    let mut found: Vec<String> = secrets.iter().filter(|s| log.contains(*s)).map(|s| format!("{s:?}")).collect();
    for marker in ["BEGIN CERTIFICATE", "BEGIN PRIVATE KEY", "BEGIN EC PRIVATE KEY", "BEGIN RSA PRIVATE KEY"] {
        if log.contains(marker) {
            found.push(marker.to_owned());
        }
    }
    found
}

#[test]
fn install_cni_at_trace_keeps_the_token_out_of_its_log_and_the_kubeconfig_out_of_net_d() {
    let cluster = Cluster::new();
    let mut installer = Installer::new(&cluster);
    installer.env("LOG_LEVEL", "trace");
    std::fs::write(
        installer.net_d.join("10-bridge.conflist"),
        serde_json::to_string_pretty(&cluster.node.conflist(vec![])).unwrap(),
    )
    .unwrap();
    let run = installer.start();
    run.wait_readyz(200);
    let token_one = std::fs::read_to_string(installer.sa.path().join("token")).expect("service account token");
    let token_two = cluster
        .api
        .rotate_service_account_token(chart::NAMESPACE, chart::CNI_SERVICE_ACCOUNT)
        .expect("rotate the token");
    installer.sa.rotate(&token_two);
    run.until("the rotated token reaches the kubeconfig", || {
        std::fs::read_to_string(installer.kubeconfig()).ok().filter(|k| k.contains(&token_two)).map(drop)
    });

    let kubeconfig = installer.kubeconfig();
    assert_eq!(kubeconfig.parent(), Some(installer.run_dir.as_path()), "the kubeconfig lives in the run dir");
    assert_eq!(kubeconfig.file_name().and_then(|n| n.to_str()), Some(paths::KUBECONFIG_FILE));
    assert_eq!(mode(&kubeconfig), 0o600, "kubeconfig mode {:o}", mode(&kubeconfig));
    for entry in std::fs::read_dir(&installer.net_d).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        let held = [&token_one, &token_two].iter().any(|t| text.contains(t.as_str()));
        assert!(!held, "{} holds the service-account token", path.display());
    }
    let log = run.log();
    assert!(log.contains("TRACE") || log.contains("DEBUG"), "the log is verbose: {log}");
    let found = leaks(&log, &[&token_one, &token_two, &ca_body_line(&cluster)]);
    assert!(found.is_empty(), "install-cni logged secrets {found:?}:\n{log}");
}

#[test]
fn the_agent_and_the_plugin_at_trace_log_no_token_and_no_certificate() {
    let mut cluster = Cluster::with_backend(RuleBackend::Nftables);
    cluster.plugin_overrides["plugin_log_level"] = json!("trace");
    cluster.api.upsert(namespace(NS, json!({}))).expect("store namespace");
    let agent = NodeAgent::start(&cluster, &[("LOG_LEVEL", "trace")]);
    let _peer = ZdsPeer::connect(&agent);
    cluster.create(&ambient_pod(NS, "web"));
    let mut pod = cluster.add_with(ambient_conflist(&cluster), "web", NS).expect("ADD");
    cluster.delete_pod(NS, "web", Some(&mut pod));

    let plugin_log = std::fs::read_to_string(cluster.run_dir().join("istio-cni.log")).unwrap_or_default();
    assert!(
        plugin_log.contains("web") && (plugin_log.contains("DEBUG") || plugin_log.contains("TRACE")),
        "the plugin logged the pod verbosely: {plugin_log}"
    );
    let plugin_token = token_of(&cluster.run_dir().join(paths::KUBECONFIG_FILE));
    let found = leaks(&plugin_log, &[&plugin_token]);
    assert!(found.is_empty(), "the plugin logged secrets {found:?}:\n{plugin_log}");
    let log = agent.log();
    assert!(log.contains("TRACE"), "the agent logs at trace");
    let found = leaks(&log, &[&token_of(&agent.kubeconfig())]);
    assert!(found.is_empty(), "the agent logged secrets {found:?}");
}

/// Every binary talks to the API server as in production: over https (the test API server serves nothing else,
/// and checks certificates against its own CA), each with its own service account's token, and the chart's RBAC
/// grants everything it asks for: the request log holds no 401 or 403 and no other user.
#[test]
fn every_binary_talks_https_to_the_api_server_as_its_own_service_account_and_nothing_is_refused() {
    let cluster = Cluster::with_backend(RuleBackend::Nftables);
    cluster.api.upsert(namespace(NS, json!({}))).expect("store namespace");
    assert!(cluster.api.url().starts_with("https://"), "the API server serves https: {}", cluster.api.url());
    let account = |name: &str| format!("system:serviceaccount:{}:{name}", chart::NAMESPACE);
    let (cni, proxy_account) = (account(chart::CNI_SERVICE_ACCOUNT), account(chart::PROXY_SERVICE_ACCOUNT));

    // Our DaemonSet as the chart renders it, and this node, so install-cni's safe-upgrade check on SIGTERM finds
    // an upgrade and leaves the plugin's kubeconfig in place.
    let daemonset = Rendered::new(&CHART_SETS).get("DaemonSet", names::CNI_DAEMONSET).clone();
    cluster.api.upsert(daemonset).expect("store the DaemonSet");
    let node = json!({ "apiVersion": "v1", "kind": "Node",
        "metadata": { "name": "node-1", "labels": { "kubernetes.io/os": "linux" } } });
    cluster.api.upsert(node).expect("store the node");

    // install-cni, on its in-cluster credentials, writes the plugin's kubeconfig; the plugin's ADD of a sidecar
    // pod reads the pod with it, before anything else that reads pods runs.
    let mut installer = Installer::new(&cluster);
    installer.env("AMBIENT_ENABLED", "true");
    let primary = serde_json::to_string_pretty(&cluster.node.conflist(vec![])).expect("conflist JSON");
    std::fs::write(installer.net_d.join("10-bridge.conflist"), primary).expect("write the primary conflist");
    let mut install = installer.start();
    install.wait_readyz(200);
    let kubeconfig = std::fs::read_to_string(installer.kubeconfig()).expect("install-cni wrote the kubeconfig");
    let https = format!("server: {}", cluster.api.url());
    assert!(kubeconfig.contains(&https) && kubeconfig.contains("certificate-authority-data"), "{kubeconfig}");
    let sidecar = cluster.run(&sidecar_pod(NS, "web"));
    let pod_path = |name: &str| format!("/api/v1/namespaces/{NS}/pods/{name}");
    let plugin_read = cluster
        .api
        .cluster()
        .requests()
        .iter()
        .any(|r| r.user == cni && r.verb == "get" && r.path == pod_path("web") && r.status == 200);
    assert!(plugin_read, "the plugin read its pod as {cni}: {:#?}", cluster.api.cluster().requests());
    let made = |user: &str, verb: &str, path: &str| {
        cluster.api.cluster().requests().iter().any(|r| r.user == user && r.verb == verb && r.path == path)
    };

    // install-cni's safe-upgrade check on SIGTERM reads our DaemonSet (and this node), and finds an upgrade.
    install.terminate();
    let daemonset = format!("/apis/apps/v1/namespaces/{}/daemonsets/{}", chart::NAMESPACE, names::CNI_DAEMONSET);
    assert!(made(&cni, "get", &daemonset), "install-cni asked for its DaemonSet as {cni}:\n{}", install.log());
    assert!(installer.kubeconfig().exists(), "an upgrade keeps the plugin's kubeconfig:\n{}", install.log());

    // The node agent and the node proxy (on its Kubernetes workload source), and an ambient pod enrolled.
    let agent = NodeAgent::start(&cluster, &[]);
    let dir = tempfile::tempdir().expect("proxy dir");
    let proxy_kubeconfig = dir.path().join("kubeconfig");
    cluster.write_kubeconfig_for(&proxy_kubeconfig, chart::PROXY_SERVICE_ACCOUNT);
    let env = [("KUBECONFIG", proxy_kubeconfig.to_str().expect("UTF-8 path"))];
    let proxy = Proxy::start(&cluster, &agent, dir.path(), &dir.path().join("workloads.yaml"), &env);
    cluster.create(&ambient_pod(NS, "frontend"));
    let mut ambient = cluster.add_with(ambient_conflist(&cluster), "frontend", NS).expect("ambient ADD");
    assert_eq!(redirection(&cluster, NS, "frontend").as_deref(), Some("enabled"));
    assert!(made(&cni, "patch", &format!("{}/status", pod_path("frontend"))), "the agent annotated as {cni}");
    let pods = "/api/v1/pods";
    testbed::wait::eventually("the proxy watches pods as its own service account", || {
        made(&proxy_account, "watch", pods).then_some(())
    });
    ambient.del().expect("ambient DEL");
    drop(sidecar);
    drop(proxy);

    let requests = cluster.api.cluster().requests();
    let odd: Vec<_> = requests
        .iter()
        .filter(|r| matches!(r.status, 401 | 403) || (r.user != cni && r.user != proxy_account))
        .collect();
    assert!(odd.is_empty(), "requests refused or not made as the chart's service accounts: {odd:#?}");
}

//! The demo's steps, in the order a real node goes through them. Every process, pod and namespace is owned by a
//! local guard, so returning early (a failed step, Ctrl-C) or panicking tears down what exists so far, newest
//! first: pods (CNI DEL), proxy, node agent, installer, then the node netns, the fake API and the temp dirs.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use istio_contract::ports;
use serde_json::{json, Value};
use testbed::hbone_proxy::Proxy;
use testbed::install_cni::Installer;
use testbed::mesh::sidecar_pod;
use testbed::node_agent::{ambient_pod, namespace, redirection, uid, NodeAgent};
use testbed::{Cluster, Pod};

use crate::control::{checkpoint, track_dir, track_process, wait_for, Stop};
use crate::{proxy_log, rules, traffic};

/// How many steps print a progress line.
const STEPS: usize = 9;
/// Namespace of the demo's pods.
const NS: &str = "shop";
/// The ambient client and server pods (each runs as the service account of the same name).
const CLIENT: &str = "frontend";
const SERVER: &str = "backend";
/// Port the server app listens on.
const APP_PORT: u16 = 8080;
/// Bytes the client app sends (and gets echoed back).
const PAYLOAD: usize = 1024 * 1024;
/// The primary CNI config the runtime starts with.
const CONF_FILE: &str = "10-bridge.conflist";
/// Where install-cni answers `/readyz` in the demo.
const INSTALLER_READINESS_PORT: u16 = 8001;
/// How long a single step may wait for something to happen.
const LIMIT: Duration = Duration::from_secs(15);

fn progress(step: usize, text: impl std::fmt::Display) -> Result<(), Stop> {
    checkpoint()?;
    println!("[{step}/{STEPS}] {text}");
    Ok(())
}

fn detail(text: impl std::fmt::Display) {
    println!("      {text}");
}

fn failed(what: &str, e: impl std::fmt::Display) -> Stop {
    Stop::Failed(format!("{what}: {e}"))
}

/// Runs every step; all it created is gone when it returns.
pub fn run() -> Result<(), Stop> {
    checkpoint()?;
    let mut cluster = Cluster::new();
    // The plugin and the agent run on their embedded defaults (rule backend included).
    cluster.plugin_overrides = json!({});
    track_dir(cluster.node.dir().to_path_buf());
    cluster.api.upsert(namespace(NS, json!({}))).map_err(|e| failed("store namespace", e))?;
    progress(
        1,
        format_args!(
            "node: netns {}, pod subnet {}, fake Kubernetes API at {}",
            cluster.node.netns().name(),
            cluster.node.subnet(),
            cluster.api.url()
        ),
    )?;

    let conf_file = cluster.node.conf_dir().join(CONF_FILE);
    let mut primary = cluster.node.conflist(vec![]);
    // A default route through the bridge, as pods have on a real node (replies to host probes need it).
    primary["plugins"][0]["ipam"]["routes"] = json!([{ "dst": "0.0.0.0/0" }]);
    write_json(&conf_file, &primary)?;
    progress(2, format_args!("conf dir: {CONF_FILE} = {}", plugin_chain(&primary)))?;

    let mut installer = Installer::new(&cluster);
    // Its probe and metrics ports move aside: the node agent serves the default ones in the same (node) netns.
    let readiness_port = INSTALLER_READINESS_PORT.to_string();
    installer.env("AMBIENT_ENABLED", "true").env("READINESS_PORT", &readiness_port).env("MONITORING_PORT", "15015");
    track_dir(installer.sa.path().to_path_buf());
    if let Some(scratch) = installer.source_dir.parent() {
        track_dir(scratch.to_path_buf());
    }
    let install = installer.start();
    track_process("install-cni", install.pid());
    wait_for("install-cni answers /readyz with 200", LIMIT, || {
        matches!(install.get(INSTALLER_READINESS_PORT, "/readyz"), Ok((200, _))).then_some(())
    })?;
    let conflist = read_json(&conf_file)?;
    progress(3, format_args!("install-cni (pid {}): chained our plugin: {}", install.pid(), plugin_chain(&conflist)))?;

    // As the chart runs it: install-cni's metrics (15015) appended to its own on 15014.
    let agent = NodeAgent::start(&cluster, &[("INSTALL_CNI_METRICS_PORT", "15015")]);
    track_process("node-agent", agent.pid());
    if let Some(scratch) = agent.zds_socket().parent() {
        track_dir(scratch.to_path_buf());
    }
    progress(4, format_args!("node-agent (pid {}): ready, serving the plugin and ZDS", agent.pid()))?;

    let proxy_dir = tempfile::Builder::new().prefix("demo-proxy-").tempdir().map_err(|e| failed("proxy dir", e))?;
    track_dir(proxy_dir.path().to_path_buf());
    let kubeconfig = proxy_dir.path().join("kubeconfig");
    let proxy_credentials = cluster.kubeconfig_for(testbed::chart::PROXY_SERVICE_ACCOUNT);
    std::fs::write(&kubeconfig, proxy_credentials).map_err(|e| failed("proxy kubeconfig", e))?;
    let kubeconfig = kubeconfig.display().to_string();
    // Both ambient pods run on this one node: the same-node fast path (on by default) would carry their bytes
    // without TLS; the demo turns it off to show HBONE, the path between nodes.
    let env = [("KUBECONFIG", kubeconfig.as_str()), ("LOG_LEVEL", "info"), ("SAME_NODE_FAST_PATH", "false")];
    let proxy = Proxy::start(&cluster, &agent, proxy_dir.path(), &proxy_dir.path().join("workloads.yaml"), &env);
    track_process("hbone-proxy", proxy.pid());
    progress(5, format_args!("hbone-proxy (pid {}): connected to the agent over ZDS, pods from the API", proxy.pid()))?;
    detail(format_args!(
        "SAME_NODE_FAST_PATH=false: pods on one node talk HBONE here, as across nodes (the default carries them \
         without TLS, see docs/hbone-proxy.md)"
    ));

    let web = add_pod(&cluster, &conflist, sidecar_pod(NS, "web"))?;
    progress(6, format_args!("pod {NS}/web (sidecar) {}", web.ip))?;
    detail(format_args!("rules: {}", rules::summarize(&web.netns)));

    let mut ambient = Vec::new();
    for (step, name) in [(7, CLIENT), (8, SERVER)] {
        ambient.push(add_ambient_pod(&cluster, &conflist, &proxy, step, name)?);
    }
    let (client, server) = (&ambient[0], &ambient[1]);
    wait_for("the proxy lists both ambient pods from the API", LIMIT, || {
        (proxy.kubernetes_addresses() == Some(2)).then_some(())
    })?;

    show_traffic(&cluster, &proxy, client, server)?;
    checkpoint()?;
    println!("teardown: deleting pods, stopping processes, removing namespaces and temp dirs");
    Ok(())
}

/// The client app in the client pod echoes a payload through the server app; prints what the proxies logged about
/// the connection (identities, bytes) and what the app measured, and checks they agree.
fn show_traffic(cluster: &Cluster, proxy: &Proxy, client: &Pod, server: &Pod) -> Result<(), Stop> {
    let app = traffic::echo_app(&server.netns, APP_PORT)?;
    let exchange = traffic::echo(&client.netns, SocketAddr::from((server.ip, APP_PORT)), PAYLOAD, app)?;
    let (outbound, inbound) = wait_for("both proxies logged the connection", LIMIT, || {
        let lines = proxy_log::accesses(&proxy.log());
        let find = |direction: &str| lines.iter().find(|a| a.direction == direction && a.protocol == "HBONE").cloned();
        Some((find("outbound")?, find("inbound")?))
    })?;
    progress(9, format_args!("traffic: {NS}/{CLIENT} app -> {}, {} KiB each way", outbound.dst_addr, PAYLOAD / 1024))?;
    detail(format_args!(
        "HBONE (mTLS to {}:{}): {} -> {}",
        server.ip,
        ports::HBONE,
        outbound.src_identity,
        outbound.dst_identity
    ));
    detail(format_args!(
        "bytes: {} sent, {} echoed back (client proxy's access log); server proxy: {} in, {} out; \
         the server app saw the client's own IP {}",
        outbound.bytes_received, outbound.bytes_sent, inbound.bytes_received, inbound.bytes_sent, exchange.server_saw
    ));
    let node = cluster.node.netns().path();
    let handshake = wait_for("the proxy's HBONE connect histogram counts the connection", LIMIT, || {
        let (status, body) = testbed::http::get(&node, ports::STATS, "/metrics").ok()?;
        let value = |name: &str| body.lines().find_map(|l| l.strip_prefix(name)?.trim().parse::<f64>().ok());
        let count = value("hbone_connect_duration_seconds_count ")?;
        (status == 200 && count >= 1.0).then_some(value("hbone_connect_duration_seconds_sum ")? / count)
    })?;
    detail(format_args!(
        "connect latency: HBONE connect {:.1} ms (proxy's hbone_connect_duration_seconds), first echoed byte after \
         {:.1} ms; {} KiB echoed in {:.1} ms",
        handshake * 1e3,
        exchange.first_echo.as_secs_f64() * 1e3,
        exchange.bytes / 1024,
        exchange.total.as_secs_f64() * 1e3
    ));
    let identity = |sa: &str| format!("spiffe://cluster.local/ns/{NS}/sa/{sa}");
    let agreed = [&outbound, &inbound].iter().all(|a| {
        a.src_identity == identity(CLIENT)
            && a.dst_identity == identity(SERVER)
            && [a.bytes_sent, a.bytes_received] == [PAYLOAD as u64; 2]
    });
    if !agreed || exchange.server_saw != client.ip {
        return Err(Stop::Failed(format!(
            "the connection is not what both sides should see: {outbound:?}, {inbound:?}, {exchange:?}"
        )));
    }
    Ok(())
}

/// Stores `pod` in the API and creates it through the runtime with the conf dir's conflist.
fn add_pod(cluster: &Cluster, conflist: &Value, pod: Value) -> Result<Pod, Stop> {
    checkpoint()?;
    let name = pod["metadata"]["name"].as_str().unwrap_or_default().to_owned();
    cluster.create(&pod);
    cluster.add_with(conflist.clone(), &name, NS).map_err(|e| failed(&format!("CNI ADD of {name}"), e))
}

/// Creates ambient pod `name` (running as service account `name`), prints its rules and its ZDS enrollment, and
/// plays the kubelet's part: reports the pod running with its IP, so the proxy's API source lists it.
fn add_ambient_pod(cluster: &Cluster, conflist: &Value, proxy: &Proxy, step: usize, name: &str) -> Result<Pod, Stop> {
    let mut object = ambient_pod(NS, name);
    object["spec"]["serviceAccountName"] = json!(name);
    let pod = add_pod(cluster, conflist, object)?;
    wait_for(&format!("the agent annotated {name} as redirected"), LIMIT, || {
        (redirection(cluster, NS, name).as_deref() == Some("enabled")).then_some(())
    })?;
    report_running(cluster, name, &pod)?;
    let uid = uid(cluster, NS, name);
    let identity = wait_for(&format!("the proxy started {name}'s pod proxy"), LIMIT, || {
        proxy_log::started_identity(&proxy.log(), &uid)
    })?;
    progress(step, format_args!("pod {NS}/{name} (ambient) {}", pod.ip))?;
    detail(format_args!("rules: {}", rules::summarize(&pod.netns)));
    let ports = listening_ports(&pod);
    let short = uid.get(..8).unwrap_or(&uid);
    detail(format_args!("ZDS: AddWorkload uid {short}... acked; pod proxy {identity} listens in the pod on {ports}"));
    Ok(pod)
}

/// What the kubelet does once a pod's sandbox is up: phase Running and the pod's IPs in its status.
fn report_running(cluster: &Cluster, name: &str, pod: &Pod) -> Result<(), Stop> {
    let mut object = cluster.api.get("Pod", Some(NS), name).ok_or_else(|| failed("pod vanished", name))?;
    object["status"] = json!({ "phase": "Running", "podIP": pod.ip, "podIPs": [{ "ip": pod.ip }] });
    cluster.api.upsert(object).map(drop).map_err(|e| failed(&format!("update {name}'s status"), e))
}

/// The TCP ports something listens on inside the pod (the proxy's in-pod listeners), e.g. `:15001 :15006`.
fn listening_ports(pod: &Pod) -> String {
    let out = pod.netns.exec(&["ss", "-Hltn"]);
    let mut ports: Vec<u16> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().nth(3)?.rsplit(':').next()?.parse().ok())
        .collect();
    ports.sort_unstable();
    ports.dedup();
    ports.iter().map(|p| format!(":{p}")).collect::<Vec<_>>().join(" ")
}

fn plugin_chain(conflist: &Value) -> String {
    let plugins = conflist["plugins"].as_array().cloned().unwrap_or_default();
    let describe = |p: &Value| match p["type"].as_str().unwrap_or("?") {
        "bridge" => format!(
            "bridge {} + {} {}",
            p["bridge"].as_str().unwrap_or("?"),
            p["ipam"]["type"].as_str().unwrap_or("?"),
            p["ipam"]["ranges"][0][0]["subnet"].as_str().unwrap_or("?")
        ),
        "istio-cni" => format!("istio-cni (ambient_enabled={})", p["ambient_enabled"]),
        other => other.to_owned(),
    };
    plugins.iter().map(describe).collect::<Vec<_>>().join(" -> ")
}

fn write_json(path: &Path, value: &Value) -> Result<(), Stop> {
    let text = serde_json::to_string_pretty(value).map_err(|e| failed("render conflist", e))?;
    std::fs::write(path, text).map_err(|e| failed(&format!("write {}", path.display()), e))
}

fn read_json(path: &Path) -> Result<Value, Stop> {
    let text = std::fs::read_to_string(path).map_err(|e| failed(&format!("read {}", path.display()), e))?;
    serde_json::from_str(&text).map_err(|e| failed(&format!("parse {}", path.display()), e))
}

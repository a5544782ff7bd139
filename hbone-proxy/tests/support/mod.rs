//! The real `hbone-proxy` in a test node's netns, and a node with ambient pods A and B around it, shared by the
//! end-to-end tests of this crate.
#![allow(dead_code)] // not every test binary uses every helper

pub mod capture;
pub mod traffic;

use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{json, Value};
use tests::mesh::RuleBackend;
use tests::node_agent::{ambient_conflist, ambient_pod, namespace, uid, NodeAgent};
use tests::wait::eventually;
use tests::{Cluster, NetnsGuard, Pod};

pub use tests::hbone_proxy::Proxy;

/// Namespace of the scene's pods.
pub const NS: &str = "shop";
/// The trust domain the scene's workloads are listed in.
pub const TD: &str = "cluster.local";
/// Port B's app listens on.
pub const APP_PORT: u16 = 8080;

/// A GET from inside `netns` to 127.0.0.1:`port`: (status, body).
pub fn http_get(netns: &Path, port: u16, path: &str) -> Option<(u16, String)> {
    tests::http::get(netns, port, path).ok()
}

/// The value on the line of the proxy's `/metrics` (in `netns`) that starts with `line_prefix`.
pub fn metric(netns: &Path, line_prefix: &str) -> Option<f64> {
    let (_, body) = http_get(netns, tests::hbone_proxy::METRICS_PORT, "/metrics")?;
    body.lines().find_map(|l| l.strip_prefix(line_prefix)?.trim().parse().ok())
}

/// Whether anything listens on `port` in `ns`.
pub fn listening(ns: &NetnsGuard, port: u16) -> bool {
    !ns.exec_ok(&["ss", "-Hltn", &format!("sport = :{port}")]).trim().is_empty()
}

/// A local-workloads entry for pod `name` of `cluster` on `node`, speaking HBONE as service account `sa`.
pub fn workload(cluster: &Cluster, name: &str, sa: &str, ip: IpAddr, node: &str) -> Value {
    json!({
        "uid": uid(cluster, NS, name), "name": name, "namespace": NS, "serviceAccount": sa,
        "trustDomain": TD, "workloadIps": [ip], "protocol": "HBONE", "node": node,
    })
}

/// Writes `workloads` to the local workloads file `path` of `proxy` and waits until the proxy loaded it.
pub fn write_workloads(proxy: &Proxy, path: &Path, workloads: Vec<Value>) {
    let addresses: usize = workloads.iter().map(|w| w["workloadIps"].as_array().map_or(0, Vec::len)).sum();
    let loaded = format!("workload directory updated source=\"local-file\" addresses={addresses}");
    let before = proxy.log().matches(&loaded).count();
    let listing = json!({ "workloads": workloads });
    std::fs::write(path, serde_yaml::to_string(&listing).expect("yaml")).expect("write workloads");
    eventually("the proxy reloaded the workloads file", || {
        (proxy.log().matches(&loaded).count() > before).then_some(())
    });
}

/// Creates ambient pod `name` with service account `sa` in `cluster` through the fake CNI runtime; returns once
/// the node's proxy acked it (CNI ADD waits for that), i.e. its listeners are up.
pub fn ambient_member(cluster: &Cluster, name: &str, sa: &str) -> Pod {
    let mut pod = ambient_pod(NS, name);
    pod["spec"]["serviceAccountName"] = json!(sa);
    cluster.create(&pod);
    cluster.node.try_add_pod_with(ambient_conflist(cluster), name, NS).expect("CNI ADD")
}

/// An app in `pod` connects to `dst`.
pub fn connect_from(pod: &Pod, dst: SocketAddr) -> TcpStream {
    let ns = pod.netns.open().expect("open pod netns");
    let stream = ns
        .run(|| TcpStream::connect_timeout(&dst, Duration::from_secs(10)))
        .expect("enter pod netns")
        .unwrap_or_else(|e| panic!("connect to {dst}: {e}"));
    stream.set_read_timeout(Some(Duration::from_secs(30))).expect("read timeout");
    stream
}

/// An app socket of `pod` listening on `port`.
pub fn listen_on(pod: &Pod, port: u16) -> TcpListener {
    let ns = pod.netns.open().expect("open pod netns");
    ns.run(|| TcpListener::bind(("0.0.0.0", port))).expect("enter pod netns").expect("bind the app's port")
}

/// A node with the agent and the proxy running, and ambient pods A (service account a-sa) and B (b-sa) listed in
/// the proxy's local workloads file.
pub struct Scene {
    // Field order is drop order: the pods' CNI DEL needs the node's bin dir, and the proxy goes while its log
    // file in `dir` still exists.
    pub a: Pod,
    pub b: Pod,
    pub proxy: Proxy,
    pub agent: NodeAgent,
    pub cluster: Cluster,
    pub dir: tempfile::TempDir,
}

impl Scene {
    /// Starts the proxy with `env` and state under `dir` (where the caller may have put files `env` points at),
    /// creates A and B, and lists B with service account `b_listed_sa`.
    pub fn new(dir: tempfile::TempDir, b_listed_sa: &str, env: &[(&str, &str)]) -> Self {
        let cluster = Cluster::with_backend(RuleBackend::Nftables);
        cluster.api.upsert(namespace(NS, json!({}))).expect("store namespace");
        let agent = NodeAgent::start(&cluster, &[]);
        let proxy = Proxy::start(&cluster, &agent, dir.path(), &dir.path().join("workloads.yaml"), env);
        let (a, b) = (ambient_member(&cluster, "a", "a-sa"), ambient_member(&cluster, "b", "b-sa"));
        let scene = Scene { a, b, proxy, agent, cluster, dir };
        scene.list_b_as(b_listed_sa);
        scene
    }

    /// The proxy's local workloads file.
    pub fn workloads(&self) -> PathBuf {
        self.dir.path().join("workloads.yaml")
    }

    /// Rewrites the local workloads file with B under service account `sa` and waits for the proxy to reload it.
    pub fn list_b_as(&self, sa: &str) {
        let listing = vec![
            workload(&self.cluster, "a", "a-sa", self.a.ip.into(), "node-1"),
            workload(&self.cluster, "b", sa, self.b.ip.into(), "node-1"),
        ];
        write_workloads(&self.proxy, &self.workloads(), listing);
    }

    /// A's app connects to B:8080 (captured by A's proxy).
    pub fn a_connects_to_b(&self) -> TcpStream {
        connect_from(&self.a, SocketAddr::from((self.b.ip, APP_PORT)))
    }

    /// B's app socket on 8080.
    pub fn b_listener(&self) -> TcpListener {
        listen_on(&self.b, APP_PORT)
    }
}

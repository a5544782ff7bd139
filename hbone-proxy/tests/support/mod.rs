//! The real `hbone-proxy` in a test node's netns, and a node with ambient pods A and B around it, shared by the
//! end-to-end tests of this crate.
#![allow(dead_code)] // not every test binary uses every helper

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

/// Whether anything listens on `port` in `ns`.
pub fn listening(ns: &NetnsGuard, port: u16) -> bool {
    !ns.exec_ok(&["ss", "-Hltn", &format!("sport = :{port}")]).trim().is_empty()
}

fn workload(cluster: &Cluster, name: &str, sa: &str, ip: IpAddr) -> Value {
    json!({
        "uid": uid(cluster, NS, name), "name": name, "namespace": NS, "serviceAccount": sa,
        "trustDomain": TD, "workloadIps": [ip], "protocol": "HBONE", "node": "node-1",
    })
}

/// A node with the agent and the proxy running, and ambient pods A (service account a-sa) and B (b-sa) listed in
/// the proxy's local workloads file.
pub struct Scene {
    // Dropped first, while its log file in `dir` still exists.
    pub proxy: Proxy,
    pub cluster: Cluster,
    pub agent: NodeAgent,
    pub dir: tempfile::TempDir,
    pub a: Pod,
    pub b: Pod,
}

impl Scene {
    /// Starts the proxy with `env` and state under `dir` (where the caller may have put files `env` points at),
    /// creates A and B, and lists B with service account `b_listed_sa`.
    pub fn new(dir: tempfile::TempDir, b_listed_sa: &str, env: &[(&str, &str)]) -> Self {
        let cluster = Cluster::with_backend(RuleBackend::Nftables);
        cluster.api.upsert(namespace(NS, json!({}))).expect("store namespace");
        let agent = NodeAgent::start(&cluster, &[]);
        let proxy = Proxy::start(&cluster, &agent, dir.path(), &dir.path().join("workloads.yaml"), env);
        let mut pods = Vec::new();
        for (name, sa) in [("a", "a-sa"), ("b", "b-sa")] {
            let mut pod = ambient_pod(NS, name);
            pod["spec"]["serviceAccountName"] = json!(sa);
            cluster.create(&pod);
            // ADD returns only after the proxy acked the pod, i.e. its listeners are up.
            pods.push(cluster.node.try_add_pod_with(ambient_conflist(&cluster), name, NS).expect("CNI ADD"));
        }
        let (b, a) = (pods.pop().unwrap(), pods.pop().unwrap());
        let scene = Scene { proxy, cluster, agent, dir, a, b };
        scene.list_b_as(b_listed_sa);
        scene
    }

    /// The proxy's local workloads file.
    pub fn workloads(&self) -> PathBuf {
        self.dir.path().join("workloads.yaml")
    }

    /// Rewrites the local workloads file with B under service account `sa` and waits for the proxy to reload it.
    pub fn list_b_as(&self, sa: &str) {
        let listing = json!({ "workloads": [
            workload(&self.cluster, "a", "a-sa", self.a.ip.into()),
            workload(&self.cluster, "b", sa, self.b.ip.into()),
        ]});
        let loaded = "workload directory updated source=\"local-file\" addresses=2";
        let before = self.proxy.log().matches(loaded).count();
        std::fs::write(self.workloads(), serde_yaml::to_string(&listing).expect("yaml")).expect("write workloads");
        eventually("the proxy reloaded the workloads file", || {
            (self.proxy.log().matches(loaded).count() > before).then_some(())
        });
    }

    /// A's app connects to B:8080 (captured by A's proxy).
    pub fn a_connects_to_b(&self) -> TcpStream {
        let a_ns = self.a.netns.open().expect("open pod A netns");
        let dst = SocketAddr::from((self.b.ip, APP_PORT));
        let stream = a_ns
            .run(|| TcpStream::connect_timeout(&dst, Duration::from_secs(10)))
            .expect("enter pod A netns")
            .expect("A connects to B:8080");
        stream.set_read_timeout(Some(Duration::from_secs(30))).expect("read timeout");
        stream
    }

    /// B's app socket on 8080.
    pub fn b_listener(&self) -> TcpListener {
        let ns = self.b.netns.open().expect("open pod B netns");
        ns.run(|| TcpListener::bind(("0.0.0.0", APP_PORT))).expect("enter pod B netns").expect("bind B's app")
    }
}

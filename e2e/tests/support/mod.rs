//! The real `hbone-proxy` in a test node's netns, and a node with ambient pods A and B around it, shared by the
//! end-to-end tests of this crate.
#![allow(dead_code)] // not every test binary uses every helper

pub mod capture;
pub mod mesh_client;
pub mod metrics;
pub mod traffic;
pub mod two_nodes;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use istio_contract::ports;
use serde_json::{json, Value};
use testbed::mesh::RuleBackend;
use testbed::node_agent::{ambient_conflist, ambient_pod, namespace, uid, NodeAgent};
use testbed::wait::eventually;
use testbed::{Cluster, NetnsGuard, Pod};

pub use testbed::hbone_proxy::Proxy;
use testbed::hbone_proxy::LOCAL_FILE_SOURCE;

/// Namespace of the scene's pods.
pub const NS: &str = "shop";
/// The trust domain the scene's workloads are listed in.
pub const TD: &str = "cluster.local";
/// Port B's app listens on.
pub const APP_PORT: u16 = 8080;
/// B's service account: the identity its Pod object gives it and its certificate proves.
pub const B_SA: &str = "b-sa";
/// The proxy setting that turns its same-node fast path off, for the tests of HBONE itself between two pods of one
/// node: with the fast path on, their connections never reach 15008 (`e2e/tests/proxy_fast_path.rs`).
pub const HBONE_ON_ONE_NODE: (&str, &str) = ("SAME_NODE_FAST_PATH", "false");

/// Which address families the scene's pods get.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stack {
    /// One IPv4 address per pod.
    V4,
    /// An IPv4 and an IPv6 address per pod (host-local with one range of each family).
    Dual,
}

/// A GET from inside `netns` to 127.0.0.1:`port`: (status, body).
pub fn http_get(netns: &Path, port: u16, path: &str) -> Option<(u16, String)> {
    testbed::http::get(netns, port, path).ok()
}

/// Whether the proxy whose readiness port is `port` (in `netns`) has stopped being ready, as the kubelet's probe
/// sees a drain: `/healthz/ready` answers 503, or its listener is closed.
pub fn unready(netns: &Path, port: u16) -> bool {
    http_get(netns, port, "/healthz/ready").is_none_or(|(status, _)| status == 503)
}

/// The value on the line of the proxy's `/metrics` (in `netns`) that starts with `line_prefix`.
pub fn metric(netns: &Path, line_prefix: &str) -> Option<f64> {
    let (_, body) = http_get(netns, ports::STATS, "/metrics")?;
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

/// The proxy's `/config_dump` (on the node's loopback), parsed.
pub fn config_dump(scene: &Scene) -> Value {
    let (status, body) = http_get(&scene.cluster.node.netns().path(), ports::ADMIN, "/config_dump").expect("GET");
    assert_eq!(status, 200, "/config_dump answers: {body}");
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("/config_dump is not JSON ({e}): {body}"))
}

/// The dump's entry for pod `name`.
pub fn dumped_pod(dump: &Value, name: &str) -> Value {
    let pods = dump["pods"].as_array().expect("pods list");
    pods.iter().find(|p| p["name"] == name).cloned().unwrap_or_else(|| panic!("pod {name} in {dump}"))
}

/// Every address (without prefix) of `pod`'s CNI ADD result, in its order.
pub fn pod_ips(pod: &Pod) -> Vec<IpAddr> {
    let ips = pod.result["ips"].as_array().expect("ADD result ips");
    ips.iter().filter_map(|ip| ip["address"].as_str()?.split('/').next()?.parse().ok()).collect()
}

/// `pod`'s IPv6 address from its ADD result (a [`Stack::Dual`] pod has one).
pub fn ipv6_of(pod: &Pod) -> Ipv6Addr {
    let v6 = pod_ips(pod).into_iter().find_map(|ip| match ip {
        IpAddr::V6(v6) => Some(v6),
        IpAddr::V4(_) => None,
    });
    v6.unwrap_or_else(|| panic!("no IPv6 address in {}", pod.result))
}

/// `cluster`'s ambient conflist for `stack`: [`Stack::Dual`] adds an IPv6 range `fd00:X:Y::/64` (X, Y from the
/// node's `10.X.Y.0/24`, so it is as unique as the IPv4 one) and an IPv6 default route through the bridge.
pub fn conflist_for(cluster: &Cluster, stack: Stack) -> Value {
    let mut list = ambient_conflist(cluster);
    if stack == Stack::Dual {
        let subnet = cluster.node.subnet();
        let octets: Vec<&str> = subnet.split('.').collect();
        let v6 = format!("fd00:{}:{}::/64", octets[1], octets[2]);
        let ipam = &mut list["plugins"][0]["ipam"];
        ipam["ranges"].as_array_mut().expect("ranges").push(json!([{ "subnet": v6 }]));
        ipam["routes"].as_array_mut().expect("routes").push(json!({ "dst": "::/0" }));
    }
    list
}

/// Writes `workloads` to the local workloads file `path` of `proxy` and waits until the proxy's `/config_dump`
/// lists exactly them from that file: as many workloads, each with every field as written (its addresses among
/// them), so a rewrite that changes one field only (`requireMtls`, say) is waited for too.
pub fn write_workloads(proxy: &Proxy, path: &Path, workloads: Vec<Value>) {
    let listing = json!({ "workloads": workloads });
    std::fs::write(path, serde_yaml::to_string(&listing).expect("yaml")).expect("write workloads");
    eventually("the proxy's /config_dump lists the written workloads from its local file", || {
        let listed = proxy.listed_workloads(LOCAL_FILE_SOURCE)?;
        lists_exactly(&listed, &workloads).then_some(())
    });
}

/// Whether `listed` (dumped workloads) and `written` (local-file entries) pair up one to one, each listed entry
/// holding every field of its written one with the same value.
fn lists_exactly(listed: &[Value], written: &[Value]) -> bool {
    let mut unmatched: Vec<&Value> = listed.iter().collect();
    listed.len() == written.len()
        && written.iter().all(|entry| {
            let fields = entry.as_object().expect("a workload entry is an object");
            let found = unmatched.iter().position(|l| fields.iter().all(|(key, value)| l[key] == *value));
            found.map(|i| unmatched.swap_remove(i)).is_some()
        })
}

/// Records the addresses of `pod` (named `name`) as its Pod object's `status.podIPs` (phase Running), as the
/// kubelet does once the sandbox is up: what the proxy's Kubernetes source lists it by.
pub fn record_pod_ips(cluster: &Cluster, name: &str, pod: &Pod) {
    let ips: Vec<Value> = pod_ips(pod).iter().map(|ip| json!({ "ip": ip.to_string() })).collect();
    let mut object = cluster.api.get("Pod", Some(NS), name).unwrap_or_else(|| panic!("no pod {name}"));
    object["status"] = json!({ "phase": "Running", "podIP": ips[0]["ip"], "podIPs": ips });
    cluster.api.upsert(object).expect("store pod status");
}

/// Waits until the Kubernetes workload source of `proxy` lists `addresses` addresses.
pub fn await_kubernetes_listing(proxy: &Proxy, addresses: usize) {
    eventually(&format!("the proxy's Kubernetes source lists {addresses} addresses"), || {
        (proxy.kubernetes_addresses() == Some(addresses)).then_some(())
    });
}

/// Creates ambient pod `name` with service account `sa` in `cluster` through the fake CNI runtime and records its
/// addresses in its Pod object ([`record_pod_ips`]); returns once the node's proxy acked it (CNI ADD waits for
/// that), i.e. its listeners are up. The proxy's Kubernetes source lists it soon after
/// ([`await_kubernetes_listing`]).
pub fn ambient_member(cluster: &Cluster, name: &str, sa: &str) -> Pod {
    ambient_member_on(cluster, Stack::V4, name, sa)
}

/// Like [`ambient_member`], with the addresses of `stack`.
pub fn ambient_member_on(cluster: &Cluster, stack: Stack, name: &str, sa: &str) -> Pod {
    let mut pod = ambient_pod(NS, name);
    pod["spec"]["serviceAccountName"] = json!(sa);
    cluster.create(&pod);
    let pod = cluster.add_with(conflist_for(cluster, stack), name, NS).expect("CNI ADD");
    record_pod_ips(cluster, name, &pod);
    pod
}

/// Creates pod `name` outside the mesh (not labelled for ambient) in `cluster` through the fake CNI runtime.
pub fn plain_member(cluster: &Cluster, name: &str) -> Pod {
    cluster.create(&testbed::mesh::plain_pod(NS, name));
    cluster.add_with(ambient_conflist(cluster), name, NS).expect("CNI ADD")
}

/// How many file descriptors process `pid` holds open (entries of `/proc/<pid>/fd`).
pub fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map(Iterator::count).unwrap_or_else(|e| panic!("/proc/{pid}/fd: {e}"))
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

/// An app in `from` sends `hello` to `to`:[`APP_PORT`], shuts down its write side and reads to the end: what came
/// back (an echo app there sends it all back).
pub fn say_hello(from: &Pod, to: &Pod, hello: &[u8]) -> std::io::Result<Vec<u8>> {
    use std::io::{Read, Write};
    let dst = SocketAddr::from((to.ip, APP_PORT));
    let ns = from.netns.open().expect("open pod netns");
    let mut stream = ns.run(|| TcpStream::connect_timeout(&dst, Duration::from_secs(10))).expect("enter pod netns")?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    stream.write_all(hello)?;
    stream.shutdown(std::net::Shutdown::Write)?;
    let mut back = Vec::new();
    stream.read_to_end(&mut back)?;
    Ok(back)
}

/// An app socket of `pod` listening on `port` (IPv4).
pub fn listen_on(pod: &Pod, port: u16) -> TcpListener {
    listen_at(pod, SocketAddr::from((Ipv4Addr::UNSPECIFIED, port)))
}

/// An app socket of `pod` bound to `addr`.
pub fn listen_at(pod: &Pod, addr: SocketAddr) -> TcpListener {
    let ns = pod.netns.open().expect("open pod netns");
    ns.run(|| TcpListener::bind(addr)).expect("enter pod netns").expect("bind the app's port")
}

/// A node with the agent and the proxy running, and ambient pods A (service account a-sa) and B ([`B_SA`]) that the
/// proxy knows from their Pod objects (its Kubernetes source), or from its local workloads file when B is listed
/// under another identity.
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
    /// creates A and B, and returns once the proxy lists B with service account `b_listed_sa`.
    ///
    /// With [`B_SA`] the proxy finds A and B through its Kubernetes source, as in a cluster. Any other
    /// `b_listed_sa` is a directory that contradicts B's Pod object, which the API cannot express (a pod's
    /// `serviceAccountName` is what its certificate proves, and cannot change): such a scene runs the proxy on its
    /// local workloads file alone (`KUBE_WORKLOADS=false`), where the test writes what it wants listed.
    pub fn new(dir: tempfile::TempDir, b_listed_sa: &str, env: &[(&str, &str)]) -> Self {
        Self::with_stack(Stack::V4, dir, b_listed_sa, env)
    }

    /// Like [`Scene::new`], with pods that get the addresses of `stack` (all of them listed in the workloads file).
    pub fn with_stack(stack: Stack, dir: tempfile::TempDir, b_listed_sa: &str, env: &[(&str, &str)]) -> Self {
        let cluster = Cluster::with_backend(RuleBackend::Nftables);
        cluster.api.upsert(namespace(NS, json!({}))).expect("store namespace");
        let agent = NodeAgent::start(&cluster, &[]);
        let from_file = b_listed_sa != B_SA;
        let mut env = env.to_vec();
        if from_file {
            env.push(testbed::hbone_proxy::KUBE_WORKLOADS_OFF);
        }
        let proxy = Proxy::start(&cluster, &agent, dir.path(), &dir.path().join("workloads.yaml"), &env);
        let (a, b) = (ambient_member_on(&cluster, stack, "a", "a-sa"), ambient_member_on(&cluster, stack, "b", B_SA));
        let scene = Scene { a, b, proxy, agent, cluster, dir };
        if from_file {
            scene.list_b_as(b_listed_sa);
        } else {
            await_kubernetes_listing(&scene.proxy, pod_ips(&scene.a).len() + pod_ips(&scene.b).len());
        }
        scene
    }

    /// Like [`Scene::new`] in a fresh scratch dir, with a mesh CA the test made there (`CA_DIR`), so the test can
    /// sign client certificates of its own ([`Scene::cacerts`]).
    pub fn with_test_ca(b_listed_sa: &str, env: &[(&str, &str)]) -> Self {
        let dir = tempfile::tempdir().expect("scratch dir");
        let cacerts = dir.path().join("cacerts");
        hbone::MeshCa::load_or_create(&cacerts, TD).expect("test mesh CA");
        let ca_dir = cacerts.to_str().expect("UTF-8 path").to_owned();
        let mut all = vec![("CA_DIR", ca_dir.as_str())];
        all.extend_from_slice(env);
        Self::new(dir, b_listed_sa, &all)
    }

    /// The mesh CA directory of a scene made by [`Scene::with_test_ca`].
    pub fn cacerts(&self) -> PathBuf {
        self.dir.path().join("cacerts")
    }

    /// The proxy's local workloads file.
    pub fn workloads(&self) -> PathBuf {
        self.dir.path().join("workloads.yaml")
    }

    /// Rewrites the local workloads file with A, and B under service account `sa`, and waits for the proxy to
    /// reload it; for scenes on the local file ([`Scene::new`] with another service account than [`B_SA`]).
    pub fn list_b_as(&self, sa: &str) {
        let listed = |pod: &Pod, name, sa| {
            let mut entry = workload(&self.cluster, name, sa, pod.ip.into(), "node-1");
            entry["workloadIps"] = json!(pod_ips(pod));
            entry
        };
        let listing = vec![listed(&self.a, "a", "a-sa"), listed(&self.b, "b", sa)];
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

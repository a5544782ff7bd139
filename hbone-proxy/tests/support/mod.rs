//! The real `hbone-proxy` in a test node's netns, and a node with ambient pods A and B around it, shared by the
//! end-to-end tests of this crate.
#![allow(dead_code)] // not every test binary uses every helper

use std::fs::File;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tests::mesh::RuleBackend;
use tests::node_agent::{ambient_conflist, ambient_pod, namespace, uid, NodeAgent};
use tests::wait::eventually;
use tests::{Cluster, NetnsGuard, Pod};

/// Namespace of the scene's pods.
pub const NS: &str = "shop";
/// The trust domain the scene's workloads are listed in.
pub const TD: &str = "cluster.local";
/// Port B's app listens on.
pub const APP_PORT: u16 = 8080;

/// Where the proxy serves `/healthz/ready` (Istio's port), inside the node netns.
const READY_PORT: u16 = 15021;

/// The `hbone-proxy` binary running in the node netns; killed on drop, its log printed if the test failed.
pub struct Proxy {
    child: Child,
    log: PathBuf,
}

impl Proxy {
    /// Starts the proxy with the agent's ZDS socket, a state dir and local workloads file under `dir`, plus
    /// `env`; returns once it answers `/healthz/ready` with 200.
    pub fn start(cluster: &Cluster, agent: &NodeAgent, dir: &Path, workloads: &Path, env: &[(&str, &str)]) -> Self {
        let log =
            (0..).map(|n| dir.join(format!("hbone-proxy-{n}.log"))).find(|p| !p.exists()).expect("a free log name");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_hbone-proxy"));
        cmd.env_clear()
            .env("INPOD_UDS", agent.zds_socket())
            .env("STATE_DIR", dir.join("state"))
            .env("LOCAL_WORKLOADS", workloads)
            .env("LOG_LEVEL", "debug,h2=info,rustls=info,hyper=info")
            .env("NO_COLOR", "1")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(File::create(&log).expect("proxy log file"));
        let node = cluster.node.netns().open().expect("open node netns");
        let child = node.run(|| cmd.spawn()).expect("enter node netns").expect("spawn hbone-proxy");
        let mut proxy = Proxy { child, log };
        let netns = cluster.node.netns().path();
        eventually("hbone-proxy answers /healthz/ready with 200", || {
            if let Ok(Some(status)) = proxy.child.try_wait() {
                panic!("hbone-proxy exited with {status}; log:\n{}", proxy.log());
            }
            (http_get(&netns, READY_PORT, "/healthz/ready").map(|(status, _)| status) == Some(200)).then_some(())
        });
        proxy
    }

    /// Everything the proxy logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Kills the proxy (as a crash or a node reboot would) and reaps it.
    pub fn stop(&mut self) {
        self.child.kill().expect("kill hbone-proxy");
        self.child.wait().expect("reap hbone-proxy");
    }

    /// Sends SIGTERM, as the kubelet does; returns when it was sent.
    pub fn terminate(&self) -> Instant {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).expect("SIGTERM hbone-proxy");
        Instant::now()
    }

    /// The exit status once the proxy has exited, polled until `limit` after `since`.
    pub fn exit_within(&mut self, since: Instant, limit: Duration) -> Option<ExitStatus> {
        loop {
            if let Some(status) = self.child.try_wait().expect("poll hbone-proxy") {
                return Some(status);
            }
            if since.elapsed() > limit {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("hbone-proxy log:\n{}", self.log());
        }
    }
}

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

//! An ambient node for the scenarios that need the whole path: the fake API, the node agent and the HBONE proxy
//! in the node netns, pods created through the fake runtime with the ambient conflist. Everything is torn down
//! on drop (pods first, then processes, then namespaces).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::json;
use tempfile::TempDir;
use testbed::hbone_proxy::Proxy;
use testbed::install_cni::Installer;
use testbed::mesh::RuleBackend;
use testbed::node_agent::{ambient_conflist, ambient_pod, namespace, redirection, NodeAgent};
use testbed::{Cluster, NetworkConfigList};

use crate::attach::{timed_add, Attached};

/// Namespace of every benchmark pod.
pub const NS: &str = "bench";
/// Log level of the agent and proxy: logging every connection would be measured too.
const QUIET: &str = "warn";

/// The node and its daemons. Field order is drop order: proxy, agent, then the cluster.
pub struct AmbientNode {
    /// The HBONE proxy.
    pub proxy: Proxy,
    /// The node agent.
    pub agent: NodeAgent,
    /// The ambient conflist (bridge + host-local + istio-cni with ambient enabled).
    pub list: NetworkConfigList,
    /// The proxy's state dir and workloads file.
    pub proxy_dir: TempDir,
    /// The shared mesh CA the proxy uses, if not its own.
    ca_dir: Option<PathBuf>,
    /// Extra environment of the proxy (kept for restarts), e.g. `SAME_NODE_FAST_PATH=false`.
    proxy_env: Vec<(String, String)>,
    /// The ZDS socket of the first agent, which every later agent and proxy use.
    zds_socket: PathBuf,
    /// Agents replaced by a restart: their scratch dir holds the ZDS socket, so they stay until the end.
    retired: Vec<NodeAgent>,
    /// Node netns, bridge, runtime and fake API.
    pub cluster: Cluster,
}

impl AmbientNode {
    /// Starts a node whose rules use `backend`, with the agent and proxy on their defaults (quiet logs); the
    /// proxy learns workloads from the fake API. `subnet` overrides the pod range (e.g. a /20 for 1,000 pods).
    pub fn start(backend: RuleBackend, subnet: Option<(&str, &str)>) -> AmbientNode {
        Self::start_with_ca(backend, subnet, None)
    }

    /// Like [`AmbientNode::start`], with the proxy's mesh CA taken from `ca_dir` (Istio's `cacerts` layout), so
    /// several nodes share one mesh.
    pub fn start_with_ca(backend: RuleBackend, subnet: Option<(&str, &str)>, ca_dir: Option<&Path>) -> AmbientNode {
        Self::start_with_proxy_env(backend, subnet, ca_dir, &[])
    }

    /// Like [`AmbientNode::start_with_ca`], with `proxy_env` added to the proxy's environment, so a scenario can
    /// compare the proxy's settings (the same-node fast path on and off) in one run.
    pub fn start_with_proxy_env(
        backend: RuleBackend,
        subnet: Option<(&str, &str)>,
        ca_dir: Option<&Path>,
        proxy_env: &[(&str, &str)],
    ) -> AmbientNode {
        let cluster = Cluster::with_backend(backend);
        install_kubeconfig(&cluster);
        cluster.api.upsert(namespace(NS, json!({}))).expect("store namespace");
        let mut conflist = ambient_conflist(&cluster);
        if let Some((range, gateway)) = subnet {
            conflist["plugins"][0]["ipam"]["ranges"] = json!([[{ "subnet": range, "gateway": gateway }]]);
        }
        let list = NetworkConfigList::from_value(conflist).expect("ambient conflist");
        let agent = NodeAgent::start(&cluster, &[("LOG_LEVEL", QUIET)]);
        let proxy_dir = tempfile::Builder::new().prefix("bench-proxy-").tempdir().expect("proxy dir");
        let kubeconfig = proxy_dir.path().join("kubeconfig");
        cluster.write_kubeconfig_for(&kubeconfig, testbed::chart::PROXY_SERVICE_ACCOUNT);
        let ca_dir = ca_dir.map(Path::to_path_buf);
        let zds_socket = agent.zds_socket();
        let proxy_env: Vec<(String, String)> = proxy_env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let proxy = start_proxy(&cluster, &agent, &zds_socket, proxy_dir.path(), ca_dir.as_deref(), &proxy_env);
        AmbientNode { proxy, agent, list, proxy_dir, ca_dir, proxy_env, zds_socket, retired: Vec::new(), cluster }
    }

    /// Restarts the proxy (killed first), returning how long the new one took to be ready.
    pub fn restart_proxy(&mut self) -> Duration {
        self.proxy.stop();
        let start = Instant::now();
        let (dir, ca) = (self.proxy_dir.path(), self.ca_dir.as_deref());
        self.proxy = start_proxy(&self.cluster, &self.agent, &self.zds_socket, dir, ca, &self.proxy_env);
        start.elapsed()
    }

    /// Kills the agent (SIGKILL, as a crash) and starts a new one on the same ZDS socket, returning how long the
    /// new one took to report ready.
    pub fn restart_agent(&mut self) -> Duration {
        self.agent.kill();
        let socket = self.zds_socket.display().to_string();
        let start = Instant::now();
        let agent = NodeAgent::start(&self.cluster, &[("LOG_LEVEL", QUIET), ("ZTUNNEL_UDS_ADDRESS", &socket)]);
        let ready = start.elapsed();
        self.retired.push(std::mem::replace(&mut self.agent, agent));
        ready
    }

    /// Stores ambient pod `name` (service account `name`) and creates it through the runtime; returns the
    /// attachment (its `took` is the ADD alone) once the agent annotated the pod, and the time from the start of
    /// ADD until the annotation was visible in the API.
    pub fn add_pod(&self, name: &str) -> (Attached, Duration) {
        let mut pod = ambient_pod(NS, name);
        pod["spec"]["serviceAccountName"] = json!(name);
        self.cluster.create(&pod);
        let attached = timed_add(&self.cluster.node, &self.list, NS, name);
        // From the start of ADD, as (a) and (c) are: the netns the runtime makes before ADD is not the plugin's.
        while redirection(&self.cluster, NS, name).as_deref() != Some("enabled") {
            assert!(attached.started.elapsed() < Duration::from_secs(20), "{name} was never annotated");
            std::thread::yield_now();
        }
        let enrolled = attached.started.elapsed();
        let mut object = self.cluster.api.get("Pod", Some(NS), name).expect("pod stored");
        let ip = attached.ip();
        object["status"] = json!({ "phase": "Running", "podIP": ip, "podIPs": [{ "ip": ip }] });
        self.cluster.api.upsert(object).expect("report the pod running");
        (attached, enrolled)
    }

    /// Removes pod `name`: CNI DEL (by dropping the attachment) and the Pod object.
    pub fn remove_pod(&self, name: &str, attached: Attached) {
        drop(attached);
        self.cluster.api.delete("Pod", Some(NS), name);
    }
}

/// Has install-cni write the plugin's kubeconfig, as on a real node: the istio-cni service account's token and
/// the cluster CA inlined, from its in-cluster credentials. The installer is stopped once the file is there.
pub fn install_kubeconfig(cluster: &Cluster) {
    let installer = Installer::new(cluster);
    let running = installer.start();
    let path = installer.kubeconfig();
    let start = Instant::now();
    while !std::fs::read_to_string(&path).is_ok_and(|t| t.contains("certificate-authority-data")) {
        assert!(start.elapsed() < Duration::from_secs(20), "install-cni wrote no kubeconfig:\n{}", running.log());
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Starts the proxy on the ZDS socket `zds` (which `agent` or a successor serves; `INPOD_UDS` overrides the
/// agent's own path), with the node's kubeconfig, when given that mesh CA, and `extra` in its environment.
fn start_proxy(
    cluster: &Cluster,
    agent: &NodeAgent,
    zds: &Path,
    dir: &Path,
    ca_dir: Option<&Path>,
    extra: &[(String, String)],
) -> Proxy {
    let kubeconfig = dir.join("kubeconfig").display().to_string();
    let ca = ca_dir.map(|d| d.display().to_string());
    let zds = zds.display().to_string();
    let mut env = vec![("KUBECONFIG", kubeconfig.as_str()), ("LOG_LEVEL", QUIET), ("INPOD_UDS", zds.as_str())];
    if let Some(ca) = &ca {
        env.push(("CA_DIR", ca.as_str()));
    }
    env.extend(extra.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    Proxy::start(cluster, agent, dir, &dir.join("workloads.yaml"), &env)
}

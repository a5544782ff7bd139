//! "A node in a cluster": a [`Node`] plus the fake Kubernetes API serving its pods, and our `istio-cni`
//! chained after `bridge` with a kubeconfig in its run dir, the way install-cni leaves a real node.

use std::path::PathBuf;

use fake_apiserver::FakeApiServer;
use serde_json::{json, Value};

use crate::node::{Node, Pod};
use crate::runtime::RuntimeError;
use crate::NetnsGuard;

/// The three ways the plugin can program rules; traffic scenarios run on each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RuleBackend {
    /// Native nftables over netlink (`native_nftables: true`).
    Nftables,
    /// `iptables-nft-restore`.
    IptablesNft,
    /// `iptables-legacy-restore`.
    IptablesLegacy,
}

impl RuleBackend {
    /// Every backend, for parametrized scenarios.
    pub const ALL: [RuleBackend; 3] = [RuleBackend::Nftables, RuleBackend::IptablesNft, RuleBackend::IptablesLegacy];

    /// The netconf keys that select this backend.
    pub fn netconf(self) -> Value {
        match self {
            RuleBackend::Nftables => json!({ "native_nftables": true }),
            RuleBackend::IptablesNft => json!({ "force_iptables_binary": "iptables-nft" }),
            RuleBackend::IptablesLegacy => json!({ "force_iptables_binary": "iptables-legacy" }),
        }
    }

    /// Everything this backend holds in `ns`, as its own tool prints it (tests only).
    pub fn dump(self, ns: &NetnsGuard) -> String {
        let tools: &[&[&str]] = match self {
            RuleBackend::Nftables => &[&["nft", "list", "ruleset"]],
            RuleBackend::IptablesNft => &[&["iptables-nft-save"], &["ip6tables-nft-save"]],
            RuleBackend::IptablesLegacy => &[&["iptables-legacy-save"], &["ip6tables-legacy-save"]],
        };
        tools.iter().map(|argv| ns.exec_ok(argv)).collect::<Vec<_>>().join("\n")
    }

    /// Every rule any backend holds in `ns`: for asserting that a pod got no rules at all.
    pub fn dump_all(ns: &NetnsGuard) -> String {
        Self::ALL.iter().map(|b| b.dump(ns)).collect::<Vec<_>>().join("\n")
    }
}

/// A node whose pods are served by a fake API server.
pub struct Cluster {
    /// The node (netns, bridge, runtime).
    pub node: Node,
    /// The fake API server holding the pods.
    pub api: FakeApiServer,
    /// Extra netconf keys merged into the istio-cni entry (e.g. `force_iptables_binary`).
    pub plugin_overrides: Value,
}

impl Cluster {
    /// Starts the API server and writes its kubeconfig to `<run dir>/istio-cni-kubeconfig`.
    pub fn new() -> Self {
        Self::with_backend(RuleBackend::IptablesNft)
    }

    /// A cluster whose plugin programs rules with `backend`.
    pub fn with_backend(backend: RuleBackend) -> Self {
        let node = Node::new();
        // Plugins run in the node netns, so the server listens on that namespace's loopback, as a real API
        // server is reachable from a real node's host network.
        let ns = node.netns().open().expect("open node netns");
        let listener = ns.run(|| std::net::TcpListener::bind("127.0.0.1:0")).expect("enter node netns");
        let api = FakeApiServer::start_with_listener(listener.expect("bind API server in node netns"))
            .expect("start fake API server");
        let cluster = Self { node, api, plugin_overrides: backend.netconf() };
        std::fs::create_dir_all(cluster.run_dir()).expect("run dir");
        let kubeconfig = cluster.run_dir().join("istio-cni-kubeconfig");
        cluster.api.write_kubeconfig(&kubeconfig).expect("write kubeconfig");
        cluster
    }

    /// The plugin's `cni_agent_run_dir`.
    pub fn run_dir(&self) -> PathBuf {
        self.node.dir().join("run")
    }

    /// The istio-cni conflist entry, as Istio's chart renders it, with short pod-lookup retries.
    pub fn istio_cni(&self) -> Value {
        let mut entry = json!({
            "type": "istio-cni",
            "plugin_log_level": "debug",
            "cni_agent_run_dir": self.run_dir(),
            "ambient_enabled": false,
            "exclude_namespaces": ["kube-system"],
            "pod_namespace": "istio-system",
            "native_nftables": false,
            "pod_lookup_attempts": 3,
            "pod_lookup_interval_ms": 100,
        });
        for (k, v) in self.plugin_overrides.as_object().into_iter().flatten() {
            entry[k] = v.clone();
        }
        entry
    }

    /// The node's conflist: bridge followed by istio-cni.
    pub fn conflist(&self) -> Value {
        self.node.conflist(vec![self.istio_cni()])
    }

    /// Stores `pod` in the API server.
    pub fn create(&self, pod: &Value) {
        self.api.upsert(pod.clone()).expect("store pod in fake API server");
    }

    /// Creates the pod through the runtime (bridge + istio-cni); the Pod object must already be stored.
    pub fn add(&self, pod: &Value) -> Result<Pod, RuntimeError> {
        let (ns, name) = (pod["metadata"]["namespace"].as_str().unwrap(), pod["metadata"]["name"].as_str().unwrap());
        self.node.try_add_pod_with(self.conflist(), name, ns)
    }

    /// Stores the Pod object, then runs ADD, panicking on failure.
    pub fn run(&self, pod: &Value) -> Pod {
        self.create(pod);
        self.add(pod).unwrap_or_else(|e| panic!("CNI ADD of {} failed: {e}", pod["metadata"]["name"]))
    }
}

impl Default for Cluster {
    fn default() -> Self {
        Self::new()
    }
}

/// A Pod object with an injected sidecar (`istio-proxy` container and the `sidecar.istio.io/status`
/// annotation), as the injector leaves it.
pub fn sidecar_pod(namespace: &str, name: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "annotations": { "sidecar.istio.io/status": "{\"containers\":[\"istio-proxy\"]}" },
        },
        "spec": {
            "nodeName": "node-1",
            "containers": [
                { "name": "app", "image": "app" },
                { "name": "istio-proxy", "image": "proxyv2", "args": ["proxy", "sidecar"], "securityContext": {} },
            ],
        },
    })
}

/// A Pod object without a sidecar.
pub fn plain_pod(namespace: &str, name: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": { "name": name, "namespace": namespace },
        "spec": { "nodeName": "node-1", "containers": [{ "name": "app", "image": "app" }] },
    })
}

/// Sets an annotation on a Pod object.
pub fn annotate(mut pod: Value, key: &str, value: &str) -> Value {
    pod["metadata"]["annotations"][key] = json!(value);
    pod
}

/// Adds an env var to the pod's `istio-proxy` container.
pub fn proxy_env(mut pod: Value, key: &str, value: &str) -> Value {
    let proxy = pod["spec"]["containers"].as_array_mut().unwrap().iter_mut().find(|c| c["name"] == "istio-proxy");
    let proxy = proxy.expect("pod has istio-proxy");
    if proxy.get("env").is_none() {
        proxy["env"] = json!([]);
    }
    proxy["env"].as_array_mut().unwrap().push(json!({ "name": key, "value": value }));
    pod
}

//! "A node in a cluster": a [`Node`] plus the fake Kubernetes API serving its pods, and our `istio-cni`
//! chained after `bridge` with a kubeconfig in its run dir, the way install-cni leaves a real node.
//!
//! The API server is as strict as a real one about who may do what: https with its own CA, a bearer token on
//! every request, and the chart's own RBAC ([`CHART_SETS`]), so each binary connects with the credentials it
//! has in production (its service account's token and the cluster CA) and a request the chart does not grant
//! gets 403. Deletion and watches have the real server's shape too ([`api_config`]): a pod DELETE only marks the
//! pod terminating until its kubelet's final delete ([`Cluster::delete_pod`]), and every watch ends within
//! seconds and may have to relist.

use std::path::{Path, PathBuf};
use std::time::Duration;

use fake_apiserver::{Config, FakeApiServer, RequestRecord, WatchConfig};
use serde_json::{json, Value};

use crate::chart::{self, Rendered};
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

/// The chart values a test cluster's RBAC is rendered with: ambient and the bundled node proxy on, repair as
/// the chart's default ([`Cluster::seed_chart_rbac`] adds more).
pub const CHART_SETS: [&str; 2] = ["ambient.enabled=true", "proxy.enabled=true"];

/// The server-side watch timeout of test clusters: each watch ends after a random time in `[5s, 10s]`, so
/// every client re-watches many times in a test, as it does over hours in production.
pub const WATCH_TIMEOUT: Duration = Duration::from_secs(5);
/// How often a test cluster's watch that asked for bookmarks gets one (the real server: about a minute, well
/// under its history's age; here well under [`HISTORY_AGE`] and [`WATCH_TIMEOUT`]).
pub const BOOKMARK_INTERVAL: Duration = Duration::from_secs(2);
/// How long a test cluster keeps events for watches to resume from (the real server's watch cache: about 75
/// seconds): a client that re-watches from an older resourceVersion (stopped, partitioned, or never asking for
/// bookmarks while nothing it watches changes) gets 410 and must relist within a test.
pub const HISTORY_AGE: Duration = Duration::from_secs(15);

/// The fake API server's configuration for test clusters: as strict as a real kube-apiserver
/// ([`Config::strict`]): https with its own CA, a bearer token required, RBAC enforced, graceful deletion
/// (a pod DELETE sets `deletionTimestamp`; the pod goes only after its grace period or its kubelet's final
/// delete, [`Cluster::delete_pod`]), the real server's field selectors, and watches shaped like the real
/// server's with test-short times: each ends within [`WATCH_TIMEOUT`] to twice that, bookmarks every
/// [`BOOKMARK_INTERVAL`] only when asked for, history compacted after [`HISTORY_AGE`], and resourceVersions it
/// never issued answered with 410. The CA and token key are kept in `state_dir`, so a server restarted there is
/// trusted by the running binaries and accepts their tokens (while every resourceVersion the previous server
/// handed out is expired there: clients relist, as after a real restart on a restored store).
pub fn api_config(state_dir: &Path) -> Config {
    let strict = Config::strict();
    Config {
        state_dir: Some(state_dir.to_path_buf()),
        watch: WatchConfig {
            min_timeout: Some(WATCH_TIMEOUT),
            bookmark_interval: BOOKMARK_INTERVAL,
            history_age: Some(HISTORY_AGE),
            ..strict.watch
        },
        ..strict
    }
}

/// The API server's state dir, under the node's dir.
const API_STATE_DIR: &str = "apiserver";

/// The chart's service accounts, roles and bindings, rendered with [`CHART_SETS`] plus `sets`.
pub fn chart_rbac(sets: &[&str]) -> Vec<Value> {
    let sets: Vec<&str> = CHART_SETS.iter().chain(sets).copied().collect();
    Rendered::new(&sets).rbac()
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
    /// Starts the API server ([`api_config`], seeded with the chart's RBAC) and writes the plugin's kubeconfig
    /// to `<run dir>/istio-cni-kubeconfig` as install-cni does: https, the cluster CA, the istio-cni service
    /// account's token.
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
        let api = FakeApiServer::builder()
            .config(api_config(&node.dir().join(API_STATE_DIR)))
            .listener(listener.expect("bind API server in node netns"))
            .start()
            .expect("start fake API server");
        let cluster = Self { node, api, plugin_overrides: backend.netconf() };
        cluster.seed_chart_rbac(&[]);
        std::fs::create_dir_all(cluster.run_dir()).expect("run dir");
        let kubeconfig = cluster.run_dir().join(istio_contract::paths::KUBECONFIG_FILE);
        cluster.write_kubeconfig_for(&kubeconfig, chart::CNI_SERVICE_ACCOUNT);
        cluster
    }

    /// Where the API server keeps its CA and token key; a server restarted with [`api_config`] on it is trusted
    /// by the running binaries and accepts their tokens.
    pub fn api_state_dir(&self) -> PathBuf {
        self.node.dir().join(API_STATE_DIR)
    }

    /// Stores the chart's service accounts, roles and bindings, rendered with [`CHART_SETS`] plus `sets` (e.g.
    /// `repair.labelPods=true`), in the API server; what they do not grant gets 403.
    pub fn seed_chart_rbac(&self, sets: &[&str]) {
        for object in chart_rbac(sets) {
            self.api.upsert(object).expect("store the chart's RBAC");
        }
    }

    /// A fresh token of the chart's service account `service_account` (in the chart's namespace), as a pod
    /// mounts it.
    pub fn token(&self, service_account: &str) -> String {
        self.api.service_account_token(chart::NAMESPACE, service_account)
    }

    /// A kubeconfig for the API server (https, its CA) that authenticates as the chart's `service_account`.
    pub fn kubeconfig_for(&self, service_account: &str) -> String {
        self.api.kubeconfig_with_token(&self.token(service_account))
    }

    /// Writes [`Cluster::kubeconfig_for`] to `path`.
    #[track_caller]
    pub fn write_kubeconfig_for(&self, path: &Path, service_account: &str) {
        fake_apiserver::write_file_atomically(path, &self.kubeconfig_for(service_account)).expect("write kubeconfig");
    }

    /// The API server's CA certificate (PEM), as a pod finds it in its service account's `ca.crt`.
    pub fn ca_pem(&self) -> String {
        self.api.ca_pem().expect("the test API server serves https")
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
        self.add_with(self.conflist(), name, ns)
    }

    /// Creates pod `namespace/name` through the runtime with `conflist`, passing the stored Pod's UID as
    /// `K8S_POD_UID` as containerd does (empty when the pod is not stored).
    pub fn add_with(&self, conflist: Value, name: &str, namespace: &str) -> Result<Pod, RuntimeError> {
        let stored = self.api.get("Pod", Some(namespace), name);
        let uid = stored.as_ref().and_then(|p| p["metadata"]["uid"].as_str()).unwrap_or_default();
        self.node.try_add_pod_with_uid(conflist, name, namespace, uid)
    }

    /// Stores the Pod object, then runs ADD, panicking on failure.
    pub fn run(&self, pod: &Value) -> Pod {
        self.create(pod);
        self.add(pod).unwrap_or_else(|e| panic!("CNI ADD of {} failed: {e}", pod["metadata"]["name"]))
    }

    /// Deletes pod `namespace/name` the way `kubectl delete` and the pod's kubelet do it together on a real
    /// node: a graceful DELETE (the pod's own grace period; the API server sets `deletionTimestamp` and watchers
    /// see MODIFIED), then the kubelet stops the pod: the runtime's CNI DEL of `sandbox`, the pod the testbed
    /// runs (`None` when no sandbox runs, or when the test keeps it running on purpose), then its final DELETE
    /// with grace period 0 (DELETED, unless a finalizer still holds the pod). Returns the pod's state after the
    /// graceful DELETE (with `deletionTimestamp`).
    ///
    /// The test cluster's server deletes gracefully, so this is how tests delete pods. A test that needs the pod
    /// gone at once, with no terminating phase, says so by calling `api.delete` (the fake's test control).
    #[track_caller]
    pub fn delete_pod(&self, namespace: &str, name: &str, sandbox: Option<&mut Pod>) -> Value {
        let terminating = self
            .api
            .delete_gracefully("Pod", Some(namespace), name, None)
            .unwrap_or_else(|| panic!("no pod {namespace}/{name} to delete"));
        if let Some(pod) = sandbox {
            pod.del().unwrap_or_else(|e| panic!("CNI DEL of pod {namespace}/{name}: {e}"));
        }
        self.api.delete_gracefully("Pod", Some(namespace), name, Some(0));
        terminating
    }
}

/// A test that passes while a binary was refused by the API server has missed something: every request must be
/// authenticated and granted by the chart's RBAC (checked when the cluster goes, unless the test already failed).
/// A 403 without a user is a fault the test injected before authentication, not a refusal.
impl Drop for Cluster {
    fn drop(&mut self) {
        if std::thread::panicking() {
            return;
        }
        let refused = |r: &RequestRecord| r.status == 401 || (r.status == 403 && !r.user.is_empty());
        let refused: Vec<_> = self.api.cluster().requests().into_iter().filter(refused).collect();
        assert!(refused.is_empty(), "the API server refused requests (401: no valid token, 403: RBAC): {refused:#?}");
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

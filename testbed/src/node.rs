//! "A node": a netns with a CNI bridge network, a bin dir with the reference plugins and our binaries,
//! and a runtime bound to it, so tests can say `node.add_pod(...)` and look at what happened.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use serde_json::{json, Value};
use tempfile::TempDir;

use crate::podman::Podman;
use crate::runtime::{NetworkConfigList, Runtime, RuntimeConf, RuntimeError};
use crate::{bins, NetnsGuard};

/// Reference plugins every node has in its bin dir.
const REFERENCE_PLUGINS: [&str; 3] = ["bridge", "host-local", "loopback"];
/// Workspace binaries linked into the bin dir when they have been built.
const WORKSPACE_PLUGINS: [&str; 1] = ["istio-cni"];
/// Name of the node's network in its conflist (`--network` for podman).
pub const NETWORK_NAME: &str = "cni-test-net";
/// Name of the Linux bridge the `bridge` plugin creates inside the node netns.
pub const BRIDGE: &str = "cni0";

static COUNTER: AtomicUsize = AtomicUsize::new(0);

/// A simulated Kubernetes node: its own netns (holding the bridge and the host ends of pod veths), a
/// temp dir with `bin/`, `net.d/`, `cache/` and `ipam/`, and a runtime that execs plugins from the node netns.
#[derive(Debug)]
pub struct Node {
    netns: NetnsGuard,
    dir: TempDir,
    subnet: (u8, u8),
    runtime: Runtime,
    /// Whether new pod netns get IPv6 turned off ([`Node::turn_off_ipv6`]).
    ipv6_off: AtomicBool,
}

/// The sysctls that turn IPv6 off in a netns, for its existing and its future interfaces.
const IPV6_OFF: [&str; 2] = ["net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1"];

impl Node {
    /// Creates the node netns and dirs and populates the bin dir. Panics on failure (test setup).
    pub fn new() -> Self {
        let netns = NetnsGuard::new("node");
        let dir = tempfile::Builder::new().prefix("cni-node-").tempdir().expect("node tempdir");
        for sub in ["bin", "net.d", "cache", "ipam"] {
            std::fs::create_dir(dir.path().join(sub)).expect("node subdir");
        }
        let bin = dir.path().join("bin");
        for name in REFERENCE_PLUGINS {
            symlink(&bins::reference_plugin(name), &bin.join(name));
        }
        for name in WORKSPACE_PLUGINS {
            let built = bins::target_dir().join(name);
            if built.is_file() {
                symlink(&built, &bin.join(name));
            }
        }
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let subnet = (100 + (std::process::id() % 100) as u8, n as u8);
        let runtime = Runtime::new(vec![bin], dir.path().join("cache")).in_netns(netns.path());
        Self { netns, dir, subnet, runtime, ipv6_off: AtomicBool::new(false) }
    }

    /// The node's network namespace (where the bridge lives).
    pub fn netns(&self) -> &NetnsGuard {
        &self.netns
    }

    /// The runtime bound to this node.
    pub fn runtime(&self) -> &Runtime {
        &self.runtime
    }

    /// Root of the node's temp dir.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The CNI bin dir (`CNI_PATH`).
    pub fn bin_dir(&self) -> PathBuf {
        self.dir.path().join("bin")
    }

    /// The CNI config dir (like `/etc/cni/net.d`), empty until a test writes to it.
    pub fn conf_dir(&self) -> PathBuf {
        self.dir.path().join("net.d")
    }

    /// Puts `src` into the bin dir as plugin `name` (e.g. a fake plugin script).
    pub fn install_plugin(&self, name: &str, src: &Path) {
        symlink(src, &self.bin_dir().join(name));
    }

    /// The node's pod subnet, `10.x.y.0/24`; the gateway (bridge address) is `.1`.
    pub fn subnet(&self) -> String {
        format!("10.{}.{}.0/24", self.subnet.0, self.subnet.1)
    }

    /// The bridge's (gateway) address.
    pub fn gateway(&self) -> Ipv4Addr {
        Ipv4Addr::new(10, self.subnet.0, self.subnet.1, 1)
    }

    /// The node's conflist: `bridge` (gateway, no masquerade, host-local IPAM in the node's dir) followed
    /// by `extra_plugins` (chained plugins such as istio-cni).
    pub fn conflist(&self, extra_plugins: Vec<Value>) -> Value {
        let bridge = json!({
            "type": "bridge",
            "bridge": BRIDGE,
            "isGateway": true,
            "ipMasq": false,
            "ipam": {
                "type": "host-local",
                "ranges": [[{"subnet": self.subnet(), "gateway": self.gateway().to_string()}]],
                "dataDir": self.dir.path().join("ipam"),
            },
        });
        let mut plugins = vec![bridge];
        plugins.extend(extra_plugins);
        json!({"cniVersion": "1.0.0", "name": NETWORK_NAME, "plugins": plugins})
    }

    /// A private podman whose CNI config dir holds this node's conflist (with `extra_plugins`), run from
    /// the node netns; `podman.run(NETWORK_NAME, ...)` attaches containers to the node's bridge.
    pub fn podman(&self, extra_plugins: Vec<Value>) -> Podman {
        let podman = Podman::new(&self.bin_dir()).in_netns(self.netns.path());
        podman.add_network(&self.conflist(extra_plugins));
        podman
    }

    /// A fresh, empty pod netns (not attached to anything); IPv6 is off in it after [`Node::turn_off_ipv6`].
    pub fn pod_netns(&self) -> NetnsGuard {
        let netns = NetnsGuard::new("pod");
        if self.ipv6_off.load(Ordering::Relaxed) {
            netns.exec_ok(&[&["sysctl", "-q", "-w"][..], &IPV6_OFF[..]].concat());
        }
        netns
    }

    /// Turns IPv6 off in the node netns (the bridge and the host ends of the veths made from now on) and in every
    /// pod netns made from now on. Without it, every new bridge port's IPv6 duplicate-address detection and
    /// multicast-listener reports are flooded to every other port: kernel work per pod that grows with the pods
    /// already on the bridge (the node-scale benchmark measures our cost with and without it).
    pub fn turn_off_ipv6(&self) {
        self.netns.exec_ok(&[&["sysctl", "-q", "-w"][..], &IPV6_OFF[..]].concat());
        self.ipv6_off.store(true, Ordering::Relaxed);
    }

    /// Runs CNI ADD for a new pod `namespace/name` with the node's conflist plus `extra_plugins`, with the
    /// `CNI_ARGS` kubelet's runtimes pass. Panics if ADD fails; see [`Node::try_add_pod`].
    pub fn add_pod(&self, name: &str, namespace: &str, extra_plugins: Vec<Value>) -> Pod {
        self.try_add_pod(name, namespace, extra_plugins)
            .unwrap_or_else(|e| panic!("CNI ADD of pod {namespace}/{name} failed: {e}"))
    }

    /// Like [`Node::add_pod`] but returns ADD's error; on error the attachment is torn down with DEL (as
    /// containerd does) and the pod netns removed.
    pub fn try_add_pod(&self, name: &str, namespace: &str, extra_plugins: Vec<Value>) -> Result<Pod, RuntimeError> {
        self.try_add_pod_with(self.conflist(extra_plugins), name, namespace)
    }

    /// Like [`Node::try_add_pod`] with a conflist the test built itself (e.g. another cniVersion or a
    /// dual-stack IPAM range).
    pub fn try_add_pod_with(&self, conflist: Value, name: &str, namespace: &str) -> Result<Pod, RuntimeError> {
        self.try_add_pod_with_uid(conflist, name, namespace, "")
    }

    /// Like [`Node::try_add_pod_with`] for a pod whose UID is known (the Pod object's `metadata.uid`), sent as
    /// `K8S_POD_UID` as containerd does; [`Node::try_add_pod_with`] sends it empty.
    pub fn try_add_pod_with_uid(
        &self,
        conflist: Value,
        name: &str,
        namespace: &str,
        uid: &str,
    ) -> Result<Pod, RuntimeError> {
        let list = NetworkConfigList::from_value(conflist)?;
        let netns = self.pod_netns();
        let conf = pod_attachment(&netns, namespace, name, uid);
        match self.runtime.add(&list, &conf) {
            Ok(result) => {
                let ip = first_ipv4(&result)
                    .unwrap_or_else(|| panic!("ADD result of {namespace}/{name} has no IPv4: {result}"));
                Ok(Pod { netns, ip, result, conf, list, runtime: self.runtime.clone(), deleted: false })
            }
            Err(e) => {
                if let Err(del) = self.runtime.del(&list, &conf) {
                    eprintln!("DEL after failed ADD of {namespace}/{name}: {del}");
                }
                Err(e)
            }
        }
    }
}

impl Default for Node {
    fn default() -> Self {
        Self::new()
    }
}

/// A pod attached by CNI ADD; DEL runs and its netns is removed on drop unless [`Pod::del`] ran.
#[derive(Debug)]
pub struct Pod {
    /// The pod's network namespace.
    pub netns: NetnsGuard,
    /// Its IPv4 address from the ADD result.
    pub ip: Ipv4Addr,
    /// The final ADD result.
    pub result: Value,
    /// The attachment parameters used for ADD (container id, CNI_ARGS, ...).
    pub conf: RuntimeConf,
    /// The conflist used for ADD.
    pub list: NetworkConfigList,
    runtime: Runtime,
    deleted: bool,
}

impl Pod {
    /// Runs CNI CHECK for this pod.
    pub fn check(&self) -> Result<(), RuntimeError> {
        self.runtime.check(&self.list, &self.conf)
    }

    /// Runs CNI DEL for this pod (may be repeated); the netns stays until the pod is dropped.
    pub fn del(&mut self) -> Result<(), RuntimeError> {
        self.deleted = true;
        self.runtime.del(&self.list, &self.conf)
    }

    /// Runs CNI DEL for this pod as containerd does once the sandbox's netns is gone (a repeated
    /// StopPodSandbox): with `CNI_NETNS=""`. Plugins must succeed.
    pub fn del_without_netns(&mut self) -> Result<(), RuntimeError> {
        self.deleted = true;
        let mut conf = self.conf.clone();
        conf.netns = PathBuf::new();
        self.runtime.del(&self.list, &conf)
    }

    /// Where the runtime cached this pod's ADD result.
    pub fn cache_path(&self) -> PathBuf {
        self.runtime.cache_path(&self.list.name, &self.conf)
    }
}

impl Drop for Pod {
    fn drop(&mut self) {
        if !self.deleted {
            if let Err(e) = self.runtime.del(&self.list, &self.conf) {
                eprintln!("DEL of pod {} on drop: {e}", self.conf.container_id);
            }
        }
    }
}

/// The attachment of pod `namespace/name` (UID `uid`) in `netns` as containerd's CRI describes it: the sandbox
/// id as container id, the netns, and the `CNI_ARGS` containerd sends (`toCNILabels`): `IgnoreUnknown=1`,
/// `K8S_POD_NAMESPACE`, `K8S_POD_NAME`, `K8S_POD_INFRA_CONTAINER_ID` (the sandbox id) and `K8S_POD_UID`, the
/// last empty when the sandbox config names no UID. Containerd keeps them in a Go map, so their order differs
/// from call to call; here each pod gets its own order (fixed by its sandbox id, so a failure replays), so a
/// plugin that depends on the order fails on some pods.
pub fn pod_attachment(netns: &NetnsGuard, namespace: &str, name: &str, uid: &str) -> RuntimeConf {
    let id = format!("{}-{name}", netns.name());
    let mut args = [
        ("IgnoreUnknown", "1"),
        ("K8S_POD_NAMESPACE", namespace),
        ("K8S_POD_NAME", name),
        ("K8S_POD_INFRA_CONTAINER_ID", id.as_str()),
        ("K8S_POD_UID", uid),
    ];
    // A permutation drawn from the sandbox id (FNV-1a, then a Fisher-Yates shuffle on it).
    let mut seed = id.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    for i in (1..args.len()).rev() {
        args.swap(i, (seed % (i as u64 + 1)) as usize);
        seed = seed.rotate_right(7).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
    args.iter().fold(RuntimeConf::new(&id, netns.path()), |conf, (k, v)| conf.arg(k, v))
}

/// The first IPv4 address (without prefix) in a CNI result's `ips`.
pub fn first_ipv4(result: &Value) -> Option<Ipv4Addr> {
    result["ips"].as_array()?.iter().filter_map(|ip| ip["address"].as_str()?.split('/').next()?.parse().ok()).next()
}

fn symlink(src: &Path, dst: &Path) {
    std::os::unix::fs::symlink(src, dst)
        .unwrap_or_else(|e| panic!("symlink {} -> {}: {e}", dst.display(), src.display()));
}

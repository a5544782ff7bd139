//! Running Istio's own ambient node agent (its `install-cni` with `AMBIENT_ENABLED=true`, built by
//! `scripts/istio-ref/build.sh`; a test reference only, issue #29) on a test node, the way Istio's DaemonSet runs
//! it, so the same pods can be enrolled by Istio's agent and by ours and the results compared, or Istio's agent can
//! drive our node proxy.
//!
//! What [`IstioAgent`] guarantees:
//! - The agent runs in the node netns of the [`Cluster`] (so its "host" rules, the probe SNAT, land in the node
//!   netns, as ours do; `ALLOW_SWITCH_TO_HOST_NS` stays unset) and reaches the cluster's fake API server as
//!   Istio's `istio-cni` service account (the chart's RBAC; the kubeconfig from `KUBECONFIG`, the token and CA also
//!   in its service account dir).
//! - It never sees the machine's real CNI dirs or ZDS socket: it runs chrooted into a root of its own, built in a
//!   private mount namespace (a slave of the machine's, so network namespaces created later still appear): the
//!   machine's top-level dirs bound in, except a fresh `/run` (with the service account dir at
//!   `/var/run/secrets/kubernetes.io/serviceaccount`), a fresh `/opt` (with Istio's plugin alone in
//!   `/opt/cni/bin`) and `/host`, where `/host/proc` is the machine's `/proc` (but `/host/proc/1`, whose netns
//!   Istio takes for the host's, is the agent itself, in the node netns), `/host/var/run/netns` the machine's
//!   netns dir (where test pods' netns live: Istio opens a CNI event's netns under `/host`), and
//!   `/host/etc/cni/net.d`, `/host/opt/cni/bin` are dirs of this runner's scratch dir. Nothing is created
//!   outside the scratch dir; the mounts go with the process's mount namespace when it exits.
//! - Its run dir (plugin event and log sockets, the plugin's kubeconfig) and the ZDS socket dir are its own; the
//!   conflist Istio's installer writes (the node's `bridge` conflist with Istio's `istio-cni` entry appended) is
//!   available from [`IstioAgent::conflist`], with the entry's `type` renamed to [`ISTIO_PLUGIN_TYPE`] (Istio's
//!   plugin binary, installed in the node's bin dir under that name beside ours).
//! - A stand-in [`Kubelet`] runs beside it, as on a node (Istio's native nftables host probe rule matches the
//!   kubelet's uid, found in `/host/proc`); another kubelet on the machine (a real node's,
//!   [`crate::kubelet::foreign_kubelets`]) is hidden from its `/host/proc` under an empty dir.
//! - [`IstioAgent::start`] returns once Istio's `/readyz` answers 200 (its informers synced, the ZDS server
//!   listening, the conflist written). The process is killed on drop (its log printed if the test failed).

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};

use istio_contract::ports;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde_json::{json, Value};
use tempfile::TempDir;

use crate::chart;
use crate::kubelet::Kubelet;
use crate::mesh::Cluster;
use crate::wait::eventually;

/// The plugin type Istio's `istio-cni` binary is installed under in the node's bin dir (ours is `istio-cni`).
pub const ISTIO_PLUGIN_TYPE: &str = "istio-cni-istio";
/// The node name Istio's agent runs as (the test pods' `spec.nodeName`).
pub const NODE_NAME: &str = "node-1";
/// The conflist the node has before Istio's installer chains its entry into it.
const NODE_CONFLIST: &str = "10-test.conflist";

static RUNS: AtomicUsize = AtomicUsize::new(0);

/// Istio's binaries dir (`scripts/istio-ref/build.sh bin-dir`), whether or not they are built.
pub fn istio_bin_dir() -> PathBuf {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/istio-ref/build.sh");
    let out = Command::new("bash").arg(&script).arg("bin-dir").output().expect("run scripts/istio-ref/build.sh");
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

/// Whether Istio's `install-cni` and `istio-cni` are built.
pub fn istio_built() -> bool {
    let dir = istio_bin_dir();
    dir.join("install-cni").is_file() && dir.join("istio-cni").is_file()
}

/// Istio's `install-cni` running as the ambient node agent on a [`Cluster`]'s node; killed on drop.
#[derive(Debug)]
pub struct IstioAgent {
    child: Child,
    netns: PathBuf,
    scratch: TempDir,
    log: PathBuf,
    zds_socket: PathBuf,
    exit: Option<ExitStatus>,
    _kubelet: Kubelet,
}

impl IstioAgent {
    /// Starts Istio's agent on `cluster`'s node with its ZDS socket `ztunnel.sock` in `zds_dir` (created if
    /// missing), the chart's defaults (ambient on, Istio's default enablement selectors, DNS capture and IPv6
    /// on, repair off, `kube-system` excluded), then `env` (Istio's env names, e.g. `AMBIENT_DNS_CAPTURE`);
    /// installs Istio's plugin in the node's bin dir as [`ISTIO_PLUGIN_TYPE`]. Returns once `/readyz` answers 200.
    #[track_caller]
    pub fn start(cluster: &Cluster, zds_dir: &Path, env: &[(&str, &str)]) -> Self {
        let bin = istio_bin_dir();
        assert!(istio_built(), "Istio's binaries are not built in {}: run scripts/istio-ref/build.sh", bin.display());
        let plugin = bin.join("istio-cni");
        if !cluster.node.bin_dir().join(ISTIO_PLUGIN_TYPE).exists() {
            cluster.node.install_plugin(ISTIO_PLUGIN_TYPE, &plugin);
        }
        std::fs::create_dir_all(zds_dir).expect("ZDS socket dir");
        // Istio's native nftables host rule matches the kubelet's uid, which it finds in /host/proc.
        let kubelet = Kubelet::start();
        let scratch = tempfile::Builder::new().prefix("istio-agent-").tempdir().expect("Istio agent tempdir");
        let s = scratch.path();
        for sub in ["root", "net.d", "hostbin", "cnibin", "sa", "run"] {
            std::fs::create_dir(s.join(sub)).expect("Istio agent scratch subdir");
        }
        std::os::unix::fs::symlink(&plugin, s.join("cnibin/istio-cni")).expect("link Istio's plugin");
        // The service account dir as the kubelet mounts it.
        let token = cluster.token(chart::CNI_SERVICE_ACCOUNT);
        std::fs::write(s.join("sa/token"), &token).expect("write token");
        std::fs::write(s.join("sa/ca.crt"), cluster.ca_pem()).expect("write ca.crt");
        std::fs::write(s.join("sa/namespace"), chart::NAMESPACE).expect("write namespace");
        cluster.write_kubeconfig_for(&s.join("kubeconfig"), chart::CNI_SERVICE_ACCOUNT);
        // The node's own network before Istio chains into it: bridge, with the default route ambient needs for
        // the probe replies (see `node_agent::ambient_conflist`).
        let mut list = cluster.node.conflist(vec![]);
        list["plugins"][0]["ipam"]["routes"] = json!([{ "dst": "0.0.0.0/0" }]);
        std::fs::write(s.join("net.d").join(NODE_CONFLIST), serde_json::to_vec_pretty(&list).unwrap())
            .expect("write the node's conflist");

        let zds_socket = zds_dir.join("ztunnel.sock");
        let log = s.join(format!("istio-agent-{}.log", RUNS.fetch_add(1, Ordering::Relaxed)));
        let api = cluster.api.addr();
        let selectors = istio_contract::enablement::Selectors::default().to_json().to_string();
        let path = |p: &Path| p.display().to_string();
        let mut vars: Vec<(String, String)> = [
            ("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".to_owned()),
            ("AMBIENT_ENABLED", "true".into()),
            ("AMBIENT_ENABLEMENT_SELECTOR", selectors),
            ("AMBIENT_DNS_CAPTURE", "true".into()),
            ("AMBIENT_IPV6", "true".into()),
            ("AMBIENT_DISABLE_SAFE_UPGRADE", "true".into()),
            ("REPAIR_ENABLED", "false".into()),
            ("CHAINED_CNI_PLUGIN", "true".into()),
            ("EXCLUDE_NAMESPACES", "kube-system".into()),
            ("CNI_AGENT_RUN_DIR", path(&s.join("run"))),
            ("ZTUNNEL_UDS_ADDRESS", path(&zds_socket)),
            ("KUBECONFIG", path(&s.join("kubeconfig"))),
            ("KUBERNETES_SERVICE_PROTOCOL", "https".into()),
            ("KUBERNETES_SERVICE_HOST", api.ip().to_string()),
            ("KUBERNETES_SERVICE_PORT", api.port().to_string()),
            ("KUBERNETES_NODE_NAME", NODE_NAME.into()),
            ("NODE_NAME", NODE_NAME.into()),
            ("POD_NAME", "istio-cni-node-test".into()),
            ("POD_NAMESPACE", chart::NAMESPACE.into()),
            ("PLUGIN_LOG_LEVEL", "debug".into()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
        for (key, value) in env {
            vars.retain(|(k, _)| k != key);
            vars.push(((*key).to_owned(), (*value).to_owned()));
        }

        let stderr = File::create(&log).expect("Istio agent log file");
        let stdout = stderr.try_clone().expect("Istio agent log file");
        let mut cmd = Command::new("unshare");
        let foreign: Vec<String> = crate::kubelet::foreign_kubelets().iter().map(u32::to_string).collect();
        cmd.args(["--mount", "--propagation", "slave", "sh", "-c", ROOT_SCRIPT, "istio-agent-root"])
            .arg(s)
            .arg(foreign.join(" "))
            .arg(bin.join("install-cni"))
            .args(["--log_output_level", "default:debug"])
            .env_clear()
            .envs(vars)
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr);
        let ns = cluster.node.netns().open().expect("open node netns");
        let child = ns.run(|| cmd.spawn()).expect("enter node netns").expect("spawn Istio's install-cni");
        let netns = cluster.node.netns().path();
        let mut agent = Self { child, netns, scratch, log, zds_socket, exit: None, _kubelet: kubelet };
        agent.wait_ready();
        agent
    }

    #[track_caller]
    fn wait_ready(&mut self) {
        /// How long Istio's agent may take to become ready.
        const READY_LIMIT: std::time::Duration = std::time::Duration::from_secs(180);
        let netns = self.netns.clone();
        let child = &mut self.child;
        // Istio's agent reports ready only once it has rebuilt its snapshot of every enrolled pod: with a thousand
        // pods (node-scale) that took 19 s here, so it gets a limit of its own, longer than the tests' usual one.
        let started = std::time::Instant::now();
        let ready = crate::wait::within(started, READY_LIMIT, || {
            if let Ok(Some(status)) = child.try_wait() {
                return Some(Err(status));
            }
            let code = crate::http::get(&netns, ports::CNI_READINESS, "/readyz").ok().map(|(status, _)| status);
            (code == Some(200)).then_some(Ok(()))
        });
        let Some(ready) = ready else {
            panic!("Istio's agent did not answer /readyz with 200 within {READY_LIMIT:?}; log:\n{}", self.log());
        };
        if let Err(status) = ready {
            self.exit = Some(status);
            panic!("Istio's agent exited with {status} before becoming ready; log:\n{}", self.log());
        }
    }

    /// The process id of Istio's `install-cni` (the same process the runner spawned: the mount setup execs it).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The ZDS socket the node proxy connects to.
    pub fn zds_socket(&self) -> &Path {
        &self.zds_socket
    }

    /// The agent's run dir (`CNI_AGENT_RUN_DIR`: `pluginevent.sock`, `log.sock`, the plugin's kubeconfig).
    pub fn run_dir(&self) -> PathBuf {
        self.scratch.path().join("run")
    }

    /// The conflist Istio's installer wrote (the node's `bridge` conflist with Istio's `istio-cni` entry), with
    /// the entry's `type` set to [`ISTIO_PLUGIN_TYPE`] so the node's runtime runs Istio's plugin.
    #[track_caller]
    pub fn conflist(&self) -> Value {
        let file = self.scratch.path().join("net.d").join(NODE_CONFLIST);
        let mut list: Value = eventually("Istio's installer chained istio-cni into the node's conflist", || {
            let list: Value = serde_json::from_slice(&std::fs::read(&file).ok()?).ok()?;
            list["plugins"].as_array()?.iter().any(|p| p["type"] == "istio-cni").then_some(list)
        });
        for plugin in list["plugins"].as_array_mut().expect("plugins") {
            if plugin["type"] == "istio-cni" {
                plugin["type"] = json!(ISTIO_PLUGIN_TYPE);
            }
        }
        list
    }

    /// The agent's `/metrics` text (Istio's monitoring port, 15014), from inside the node netns.
    pub fn metrics(&self) -> String {
        crate::http::get(&self.netns, ports::CNI_MONITORING, "/metrics").map(|(_, body)| body).unwrap_or_default()
    }

    /// How many node proxy connections the agent holds, by its `ztunnel_connected` gauge; `None` before the gauge
    /// was first set. Istio notices a closed connection only at its next keepalive check (every 5 s), and until
    /// then still sends deletions to it.
    pub fn proxy_connections(&self) -> Option<u64> {
        self.metrics().lines().find_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            name.ends_with("ztunnel_connected").then(|| value.parse::<f64>().ok()).flatten().map(|v| v as u64)
        })
    }

    /// The process's output (stdout and stderr) so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Sends SIGTERM (as the kubelet does) and waits for the exit.
    #[track_caller]
    pub fn stop(&mut self) -> ExitStatus {
        if let Some(status) = self.exit {
            return status;
        }
        kill(Pid::from_raw(self.child.id() as i32), Signal::SIGTERM).expect("SIGTERM Istio's agent");
        let child = &mut self.child;
        let status = eventually("Istio's agent exits", || child.try_wait().expect("wait for Istio's agent"));
        self.exit = Some(status);
        status
    }
}

impl Drop for IstioAgent {
    fn drop(&mut self) {
        if self.exit.is_none() && matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        if std::thread::panicking() {
            eprintln!("Istio agent log:\n{}", self.log());
        }
    }
}

/// Builds the agent's root in `$1/root` (see the module doc), hides the `/host/proc` entries of the pids in `$2`,
/// and execs `$3` with the remaining arguments chrooted into it. Runs in a fresh mount namespace whose mounts are slaves of the machine's.
const ROOT_SCRIPT: &str = r#"set -eu
s=$1; hide=$2; bin=$3; shift 3
r=$s/root
mount -t tmpfs istio-agent-root "$r"
for d in /*; do
  n=${d#/}
  case $n in host|run|opt|lost+found) continue ;; esac
  if [ -L "$d" ]; then cp -P "$d" "$r/$n"
  elif [ -d "$d" ]; then mkdir "$r/$n"; mount --rbind "$d" "$r/$n"
  fi
done
mkdir -p "$r/run/secrets/kubernetes.io/serviceaccount" "$r/opt/cni/bin" \
  "$r/host/proc" "$r/host/var/run/netns" "$r/host/etc/cni/net.d" "$r/host/opt/cni/bin"
mount --bind "$s/sa" "$r/run/secrets/kubernetes.io/serviceaccount"
mount --bind "$s/cnibin" "$r/opt/cni/bin"
mount --rbind /proc "$r/host/proc"
# Istio takes /host/proc/1's netns for the host's; here that is the node netns this very process (it execs the
# agent) runs in. The machine's own pid 1 may not be inspectable at all.
mount --bind "/proc/$$" "$r/host/proc/1"
# Another kubelet on the machine (a real node's) is not this node's: hidden, as NodeAgent hides it.
mkdir "$s/hidden-proc"
for pid in $hide; do mount --bind "$s/hidden-proc" "$r/host/proc/$pid" || true; done
mount --rbind /run/netns "$r/host/var/run/netns"
mount --bind "$s/net.d" "$r/host/etc/cni/net.d"
mount --bind "$s/hostbin" "$r/host/opt/cni/bin"
cd /
exec chroot "$r" "$bin" "$@"
"#;

//! Running the real `node-agent` binary on a test node, the way the istio-cni DaemonSet runs it on a real one:
//! inside the node netns (it reaches the fake API server at 127.0.0.1, programs the host probe SNAT there, and
//! its probe ports are private to the node), with the node's run dir shared with the plugin and the node's
//! stand-in kubelet beside it. Killed on drop; its log, metrics and probes are readable while it runs.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};

use istio_contract::ports;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde_json::json;
use tempfile::TempDir;

use super::{namespace, netns_id};
use crate::kubelet::Kubelet;
use crate::mesh::{Cluster, RuleBackend};
use crate::wait::eventually;
use crate::{bins, chart, NetnsGuard};

/// On a machine that also runs another kubelet (a real node started by `scripts/cluster.sh up`, see
/// [`crate::kubelet::foreign_kubelets`]), the agent runs in a mount namespace of its own (a slave of the host's, so
/// netns and other mounts made later still reach it) where each such process's `/proc/<pid>` is hidden under an
/// empty directory: as on a node, the only kubelet it finds is this node's ([`Kubelet`]), whose uid its nftables
/// host probe rule must match. Without another kubelet the agent is spawned as it always was.
fn hide_foreign_kubelets(cmd: &mut Command, scratch: &Path) {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt as _;
    use std::os::unix::process::CommandExt as _;

    let foreign = crate::kubelet::foreign_kubelets();
    if foreign.is_empty() {
        return;
    }
    let empty = scratch.join("hidden-proc");
    std::fs::create_dir(&empty).expect("create the dir that hides foreign kubelets");
    let empty = CString::new(empty.as_os_str().as_bytes()).expect("dir path without NUL");
    let targets: Vec<CString> =
        foreign.iter().map(|pid| CString::new(format!("/proc/{pid}")).expect("proc path without NUL")).collect();
    // SAFETY: between fork and exec this only makes system calls (unshare, mount) on memory prepared before the
    // fork; it allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            use nix::mount::{mount, MsFlags};
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS)?;
            mount(None::<&str>, "/", None::<&str>, MsFlags::MS_REC | MsFlags::MS_SLAVE, None::<&str>)?;
            for target in &targets {
                // A process that exited meanwhile has nothing left to hide.
                let _ = mount(Some(empty.as_c_str()), target.as_c_str(), None::<&str>, MsFlags::MS_BIND, None::<&str>);
            }
            Ok(())
        });
    }
}

/// The agent's own debug logs, without the HTTP and TLS client chatter.
const LOG_LEVEL: &str = "debug,hyper_util=info,kube_client=info,tower=info,rustls=info,rustls_platform_verifier=info";

static RUNS: AtomicUsize = AtomicUsize::new(0);

/// The agent env that selects the same rule backend as the cluster's plugin netconf.
fn backend_env(cluster: &Cluster) -> Vec<(String, String)> {
    let overrides = &cluster.plugin_overrides;
    let mut env = Vec::new();
    if overrides["native_nftables"].as_bool() == Some(true) {
        env.push(("NATIVE_NFTABLES".to_owned(), "true".to_owned()));
    }
    if let Some(binary) = overrides["force_iptables_binary"].as_str() {
        env.push(("FORCE_IPTABLES_BINARY".to_owned(), binary.to_owned()));
    }
    env
}

/// A cluster on `backend` with namespace `ns` stored (unlabelled: pods opt in by their own label) and the agent
/// running on its node with `overrides`: where every ambient end-to-end test starts.
pub fn ambient_node(backend: RuleBackend, ns: &str, overrides: &[(&str, &str)]) -> (Cluster, NodeAgent) {
    let cluster = Cluster::with_backend(backend);
    cluster.api.upsert(namespace(ns, json!({}))).expect("store namespace");
    let agent = NodeAgent::start(&cluster, overrides);
    (cluster, agent)
}

/// A running `node-agent`, with the node's kubelet it finds through `/proc`; killed with SIGKILL on drop unless it
/// already exited.
#[derive(Debug)]
pub struct NodeAgent {
    child: Child,
    netns: PathBuf,
    scratch: TempDir,
    log: PathBuf,
    exit: Option<ExitStatus>,
    _kubelet: Kubelet,
}

impl NodeAgent {
    /// Spawns the agent inside `cluster`'s node netns with a cleared env: node `node-1`, a kubeconfig with the
    /// istio-cni service account's token and the cluster CA (the chart's RBAC for its repair settings is
    /// seeded), the cluster's run dir, a private ZDS socket, the cluster's rule backend, then `overrides`; a
    /// stand-in [`Kubelet`] runs beside it, as on a node. Returns once `/readyz` answers 200, i.e. the caches
    /// synced and both sockets are served.
    #[track_caller]
    pub fn start(cluster: &Cluster, overrides: &[(&str, &str)]) -> Self {
        let mut agent = Self::spawn(cluster, overrides);
        agent.wait_ready();
        agent
    }

    /// Spawns the agent as [`NodeAgent::start`] does, for settings or a node it cannot work with, and waits until
    /// it exits without ever answering `/readyz` with 200. Returns its exit status and its log.
    #[track_caller]
    pub fn start_expecting_exit(cluster: &Cluster, overrides: &[(&str, &str)]) -> (ExitStatus, String) {
        let mut agent = Self::spawn(cluster, overrides);
        let netns = agent.netns.clone();
        let child = &mut agent.child;
        let exited = eventually("node-agent exits at start (or becomes ready)", || {
            if let Ok(Some(status)) = child.try_wait() {
                return Some(Ok(status));
            }
            (readyz(&netns) == Some(200)).then_some(Err(()))
        });
        let Ok(status) = exited else { panic!("node-agent became ready; log:\n{}", agent.log()) };
        agent.exit = Some(status);
        (status, agent.log())
    }

    #[track_caller]
    fn spawn(cluster: &Cluster, overrides: &[(&str, &str)]) -> Self {
        let kubelet = Kubelet::start();
        let scratch = tempfile::Builder::new().prefix("node-agent-").tempdir().expect("node agent tempdir");
        let kubeconfig = scratch.path().join("kubeconfig");
        cluster.write_kubeconfig_for(&kubeconfig, chart::CNI_SERVICE_ACCOUNT);
        cluster.seed_chart_rbac(&repair_sets(overrides));
        let log = scratch.path().join(format!("node-agent-{}.log", RUNS.fetch_add(1, Ordering::Relaxed)));
        let path = |p: &Path| p.display().to_string();
        let mut env: Vec<(String, String)> = [
            ("PATH", std::env::var("PATH").unwrap_or_default()),
            ("NODE_NAME", "node-1".into()),
            ("KUBECONFIG", path(&kubeconfig)),
            ("CNI_AGENT_RUN_DIR", path(&cluster.run_dir())),
            ("ZTUNNEL_UDS_ADDRESS", path(&scratch.path().join("ztunnel.sock"))),
            ("HOST_PROC", "/proc".into()),
            ("LOG_LEVEL", LOG_LEVEL.into()),
            ("NO_COLOR", "1".into()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
        env.extend(backend_env(cluster));
        for (key, value) in overrides {
            env.retain(|(k, _)| k != key);
            env.push(((*key).to_owned(), (*value).to_owned()));
        }
        let stderr = File::create(&log).expect("node agent log file");
        let mut cmd = Command::new(bins::path("node-agent"));
        cmd.env_clear().envs(env).stdin(Stdio::null()).stdout(Stdio::null()).stderr(stderr);
        hide_foreign_kubelets(&mut cmd, scratch.path());
        let ns = cluster.node.netns().open().expect("open node netns");
        let child = ns.run(|| cmd.spawn()).expect("enter node netns").expect("spawn node-agent");
        Self { child, netns: cluster.node.netns().path(), scratch, log, exit: None, _kubelet: kubelet }
    }

    /// The process id, so a caller can tell whether it is still running.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The kubeconfig the agent runs with (the istio-cni service account's token and the cluster CA).
    pub fn kubeconfig(&self) -> PathBuf {
        self.scratch.path().join("kubeconfig")
    }

    /// The ZDS socket the node proxy connects to.
    pub fn zds_socket(&self) -> PathBuf {
        self.scratch.path().join("ztunnel.sock")
    }

    /// The process's log (its stderr) so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    #[track_caller]
    fn wait_ready(&mut self) {
        let netns = self.netns.clone();
        let child = &mut self.child;
        let ready = eventually("node-agent answers /readyz with 200 (or exits)", || {
            if let Ok(Some(status)) = child.try_wait() {
                return Some(Err(status));
            }
            (readyz(&netns) == Some(200)).then_some(Ok(()))
        });
        if let Err(status) = ready {
            self.exit = Some(status);
            panic!("node-agent exited with {status} before becoming ready; log:\n{}", self.log());
        }
    }

    /// Sends SIGKILL (a crash, an OOM kill) and reaps the process.
    pub fn kill(&mut self) -> ExitStatus {
        self.child.kill().expect("SIGKILL node-agent");
        let status = self.child.wait().expect("reap node-agent");
        self.exit = Some(status);
        status
    }

    /// The agent's `/metrics` text, from inside the node netns.
    pub fn metrics(&self) -> String {
        crate::http::get(&self.netns, ports::CNI_MONITORING, "/metrics").map(|(_, body)| body).unwrap_or_default()
    }

    /// The value of the `/metrics` sample `series` (name with its labels, e.g. `x_total{type="a"}`), if exposed.
    pub fn metric(&self, series: &str) -> Option<u64> {
        self.metrics().lines().find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
    }

    /// [`Self::metric`] for a sample that is not a whole number (a histogram's `_sum`).
    pub fn metric_f64(&self, series: &str) -> Option<f64> {
        self.metrics().lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
    }

    /// How many of the agent's open descriptors refer to the network namespace `ns` (an enrolled pod's netns is
    /// held until the pod is removed).
    pub fn netns_handles(&self, ns: &NetnsGuard) -> usize {
        use std::os::unix::fs::MetadataExt as _;
        let id = netns_id(ns);
        let dir = format!("/proc/{}/fd", self.pid());
        std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{dir}: {e}"))
            .filter_map(|fd| std::fs::metadata(fd.ok()?.path()).ok())
            .filter(|m| (m.dev(), m.ino()) == id)
            .count()
    }

    /// `/healthz` and `/readyz` status codes (`None` when it did not answer).
    pub fn probes(&self) -> (Option<u16>, Option<u16>) {
        let code = |path| crate::http::get(&self.netns, ports::CNI_READINESS, path).ok().map(|(status, _)| status);
        (code("/healthz"), code("/readyz"))
    }

    /// Sends SIGTERM (as the kubelet does) and waits for the exit.
    #[track_caller]
    pub fn terminate(&mut self) -> ExitStatus {
        let pid = Pid::from_raw(self.child.id() as i32);
        kill(pid, Signal::SIGTERM).expect("SIGTERM node-agent");
        let child = &mut self.child;
        let status = eventually("node-agent exits", || child.try_wait().expect("wait for node-agent"));
        self.exit = Some(status);
        status
    }
}

impl Drop for NodeAgent {
    fn drop(&mut self) {
        if self.exit.is_none() && matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        if std::thread::panicking() {
            eprintln!("node-agent log:\n{}", self.log());
        }
    }
}

/// The chart values that grant what the agent's repair `overrides` make it do (labelling or deleting broken
/// pods), as a user enabling them in the chart would get.
fn repair_sets(overrides: &[(&str, &str)]) -> Vec<&'static str> {
    let on = |key: &str| overrides.iter().any(|(k, v)| *k == key && *v == "true");
    let mut sets = Vec::new();
    if on("REPAIR_LABEL_PODS") {
        sets.push("repair.labelPods=true");
    }
    if on("REPAIR_DELETE_PODS") {
        sets.push("repair.deletePods=true");
    }
    sets
}

/// `/readyz`'s status code from inside the node netns, if it answered.
fn readyz(netns: &Path) -> Option<u16> {
    crate::http::get(netns, ports::CNI_READINESS, "/readyz").ok().map(|(status, _)| status)
}

//! Running the real `node-agent` binary on a test node, the way the istio-cni DaemonSet runs it on a real one:
//! inside the node netns (it reaches the fake API server at 127.0.0.1, programs the host probe SNAT there, and
//! its probe ports are private to the node), with the node's run dir shared with the plugin. A [`ZdsPeer`]
//! stands in for the node proxy: it connects to the agent's ZDS socket, records every request with its fds and
//! acks as told. Tests then look at what a user would: CNI results, rules, traffic, annotations, the log.

use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;

use istio_contract::{names, ports};
use netns::Netns;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde_json::{json, Value};
use tempfile::TempDir;
use zds::messages::{workload_request::Payload, WorkloadInfo};

use crate::kubelet::Kubelet;
use crate::mesh::{plain_pod, Cluster, RuleBackend};
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

/// A Pod object without a sidecar, labelled into ambient.
pub fn ambient_pod(namespace: &str, name: &str) -> Value {
    let mut pod = plain_pod(namespace, name);
    pod["metadata"]["labels"] = json!({ names::DATAPLANE_MODE_LABEL: "ambient" });
    pod
}

/// A Namespace object with `labels`; the plugin looks the namespace up when the pod's own labels do not decide.
pub fn namespace(name: &str, labels: Value) -> Value {
    json!({ "apiVersion": "v1", "kind": "Namespace", "metadata": { "name": name, "labels": labels } })
}

/// The init container Istio injects into sidecar pods to check redirection; it exits 126 when rules are missing.
pub const VALIDATION_CONTAINER: &str = "istio-validation";
/// The label the repair controller puts on broken pods in label mode (Istio's default key).
pub const BROKEN_POD_LABEL: &str = "cni.istio.io/uninitialized";

/// A sidecar-injected pod (annotated `sidecar.istio.io/status` unless `annotated` is false) on `node` whose init
/// container `init` is crash-looping: last terminated with `exit_code`, now waiting. With `istio-validation` and
/// 126 it is what the repair controller calls broken.
pub fn crash_looping_pod(
    namespace: &str,
    name: &str,
    node: &str,
    init: &str,
    exit_code: i32,
    annotated: bool,
) -> Value {
    let mut pod = plain_pod(namespace, name);
    pod["spec"]["nodeName"] = json!(node);
    pod["spec"]["initContainers"] = json!([{ "name": init, "image": "proxyv2" }]);
    if annotated {
        pod["metadata"]["annotations"] =
            json!({ "sidecar.istio.io/status": "{\"initContainers\":[\"istio-validation\"]}" });
    }
    pod["status"] = json!({
        "phase": "Pending",
        "initContainerStatuses": [{
            "name": init, "ready": false, "restartCount": 2, "image": "proxyv2", "imageID": "",
            "state": { "waiting": { "reason": "CrashLoopBackOff" } },
            "lastState": { "terminated": { "exitCode": exit_code, "reason": "Error" } },
        }],
    });
    pod
}

/// The connmark policy routing rule the in-pod rules give every enrolled pod.
pub const CONNMARK_RULE: &str = "fwmark 0x111/0xfff lookup 100";

/// A cluster on `backend` with namespace `ns` stored (unlabelled: pods opt in by their own label) and the agent
/// running on its node with `overrides`: where every ambient end-to-end test starts.
pub fn ambient_node(backend: RuleBackend, ns: &str, overrides: &[(&str, &str)]) -> (Cluster, NodeAgent) {
    let cluster = Cluster::with_backend(backend);
    cluster.api.upsert(namespace(ns, json!({}))).expect("store namespace");
    let agent = NodeAgent::start(&cluster, overrides);
    (cluster, agent)
}

/// `cluster`'s conflist with the istio-cni entry's `ambient_enabled` set, as Istio's chart renders it for ambient.
/// Pods also get a default route through the bridge, as on a real node: the replies to host probes, whose
/// source is the off-subnet 169.254.7.127, need it.
pub fn ambient_conflist(cluster: &Cluster) -> Value {
    let mut entry = cluster.istio_cni();
    entry["ambient_enabled"] = json!(true);
    let mut list = cluster.node.conflist(vec![entry]);
    list["plugins"][0]["ipam"]["routes"] = json!([{ "dst": "0.0.0.0/0" }]);
    list
}

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

/// What kind of request the agent sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestKind {
    /// `AddWorkload`.
    Add,
    /// `KeepWorkload`.
    Keep,
    /// `DelWorkload`.
    Del,
    /// `SnapshotSent`.
    SnapshotSent,
    /// A request without payload (a protocol error on the agent's side).
    Empty,
}

/// One request the peer received, as the node proxy would see it.
#[derive(Debug, Clone, PartialEq)]
pub struct Received {
    /// Which request.
    pub kind: RequestKind,
    /// The pod UID (empty for `SnapshotSent`).
    pub uid: String,
    /// `(dev, ino)` of every fd that came with it, to compare with `Netns::id()`.
    pub fds: Vec<(u64, u64)>,
    /// The `AddWorkload`'s workload info.
    pub info: Option<WorkloadInfo>,
}

/// How the peer answers every request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// An empty ack (success).
    Ack,
    /// An ack carrying this error.
    Nack(String),
}

#[derive(Default)]
struct PeerState {
    received: Vec<Received>,
    /// The fds of every Add, by pod UID, kept open as the node proxy keeps them.
    netns: Vec<(String, OwnedFd)>,
}

/// A test node proxy on its own thread: connected to the agent's ZDS socket, it records every request (and
/// keeps the netns fds), and answers each with [`Reply`]. Disconnects on drop.
pub struct ZdsPeer {
    state: Arc<Mutex<PeerState>>,
    reply: Arc<Mutex<Reply>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl ZdsPeer {
    /// Connects to `agent`'s ZDS socket and returns after the (empty or not) snapshot ended with `SnapshotSent`,
    /// so the agent routes new pods to this connection.
    #[track_caller]
    pub fn connect(agent: &NodeAgent) -> Self {
        let peer = Self::connect_to(&agent.zds_socket());
        eventually("the peer received SnapshotSent", || {
            peer.received().iter().any(|r| r.kind == RequestKind::SnapshotSent).then_some(())
        });
        peer
    }

    /// Like [`ZdsPeer::connect`] for any agent's ZDS socket at `path` (e.g. Istio's agent,
    /// [`crate::istio_agent::IstioAgent::zds_socket`]).
    #[track_caller]
    pub fn connect_at(path: &Path) -> Self {
        let peer = Self::connect_to(path);
        eventually("the peer received SnapshotSent", || {
            peer.received().iter().any(|r| r.kind == RequestKind::SnapshotSent).then_some(())
        });
        peer
    }

    fn connect_to(path: &Path) -> Self {
        let state = Arc::new(Mutex::new(PeerState::default()));
        let reply = Arc::new(Mutex::new(Reply::Ack));
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel();
        let (connected_tx, connected_rx) = mpsc::channel();
        let (path, st, rp) = (path.to_path_buf(), state.clone(), reply.clone());
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("peer runtime");
            rt.block_on(serve(path, st, rp, stop_rx, connected_tx));
        });
        match connected_rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => panic!("ZDS peer could not connect: {e}"),
            Err(_) => panic!("ZDS peer thread ended before connecting"),
        }
        Self { state, reply, stop: Some(stop_tx), thread: Some(thread) }
    }

    /// Changes how the following requests are answered.
    pub fn set_reply(&self, reply: Reply) {
        *self.reply.lock().unwrap() = reply;
    }

    /// Every request received so far, in order.
    pub fn received(&self) -> Vec<Received> {
        self.state.lock().unwrap().received.clone()
    }

    /// The requests of kind `kind` for pod `uid`.
    pub fn received_for(&self, kind: RequestKind, uid: &str) -> Vec<Received> {
        self.received().into_iter().filter(|r| r.kind == kind && r.uid == uid).collect()
    }

    /// The netns of pod `uid` from the fd of its latest `AddWorkload`, as the node proxy enters it.
    pub fn netns(&self, uid: &str) -> Netns {
        let state = self.state.lock().unwrap();
        let (_, fd) = state
            .netns
            .iter()
            .rev()
            .find(|(u, _)| u == uid)
            .unwrap_or_else(|| panic!("the peer received no netns fd for pod {uid}"));
        let fd = fd.try_clone().expect("dup netns fd");
        Netns::from_fd(fd, format!("netns of {uid} received over ZDS")).expect("received fd is a netns")
    }
}

impl Drop for ZdsPeer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

async fn serve(
    path: PathBuf,
    state: Arc<Mutex<PeerState>>,
    reply: Arc<Mutex<Reply>>,
    mut stop: tokio::sync::oneshot::Receiver<()>,
    connected: mpsc::Sender<Result<(), String>>,
) {
    let client = match zds::ZdsClient::connect(&path).await {
        Ok(c) => {
            let _ = connected.send(Ok(()));
            c
        }
        Err(e) => {
            let _ = connected.send(Err(e.to_string()));
            return;
        }
    };
    loop {
        let (request, fds) = tokio::select! {
            _ = &mut stop => return,
            received = client.recv() => match received {
                Ok(r) => r,
                Err(e) => return eprintln!("ZDS peer: connection ended: {e}"),
            },
        };
        let (kind, uid, info) = match request.payload {
            Some(Payload::Add(add)) => (RequestKind::Add, add.uid, add.workload_info),
            Some(Payload::Keep(keep)) => (RequestKind::Keep, keep.uid, None),
            Some(Payload::Del(del)) => (RequestKind::Del, del.uid, None),
            Some(Payload::SnapshotSent(_)) => (RequestKind::SnapshotSent, String::new(), None),
            None => (RequestKind::Empty, String::new(), None),
        };
        let ids = fds.iter().map(fd_id).collect();
        {
            let mut state = state.lock().unwrap();
            state.received.push(Received { kind, uid: uid.clone(), fds: ids, info });
            state.netns.extend(fds.into_iter().map(|fd| (uid.clone(), fd)));
        }
        let answer = match reply.lock().unwrap().clone() {
            Reply::Ack => None,
            Reply::Nack(reason) => Some(reason),
        };
        if let Err(e) = client.ack(answer).await {
            return eprintln!("ZDS peer: ack failed: {e}");
        }
    }
}

fn fd_id(fd: &OwnedFd) -> (u64, u64) {
    let st = nix::sys::stat::fstat(fd.as_fd()).expect("fstat received fd");
    (st.st_dev as u64, st.st_ino as u64)
}

/// The `ambient.istio.io/redirection` annotation of pod `namespace/name` in the fake API.
pub fn redirection(cluster: &Cluster, namespace: &str, name: &str) -> Option<String> {
    let pod = cluster.api.get("Pod", Some(namespace), name)?;
    pod["metadata"]["annotations"][names::AMBIENT_REDIRECTION].as_str().map(String::from)
}

/// The UID the fake API gave pod `namespace/name`.
pub fn uid(cluster: &Cluster, namespace: &str, name: &str) -> String {
    let pod = cluster.api.get("Pod", Some(namespace), name).unwrap_or_else(|| panic!("no pod {namespace}/{name}"));
    pod["metadata"]["uid"].as_str().expect("pod has a uid").to_owned()
}

/// The pod netns of a test pod, as a handle (for comparing ids).
pub fn netns_id(ns: &NetnsGuard) -> (u64, u64) {
    ns.open().expect("open pod netns").id()
}

/// The node agent's enrollment pause, a test hook of its debug builds (`node-agent/src/enroll/mod.rs`, module doc):
/// every enrollment reaching the chosen stage announces itself with `<dir>/<pod uid>.paused` and waits for
/// `<dir>/<pod uid>.resume`. For deleting a pod at a precise point of its enrollment.
#[derive(Debug)]
pub struct EnrollmentPause {
    stage: &'static str,
    dir: TempDir,
}

impl EnrollmentPause {
    /// The agent's enrollment stages in order (its `enroll::Stage` names; a node-agent unit test keeps the two
    /// equal): before the in-pod rules, before the proxy's Add, before the host probe entry, before the
    /// annotation, and after it.
    pub const STAGES: [&'static str; 5] = ["rules", "proxy", "probe", "annotate", "enrolled"];
    /// Names the stage to pause at.
    pub const STAGE_ENV: &'static str = "NODE_AGENT_TEST_PAUSE_STAGE";
    /// Names the directory of the pause files.
    pub const DIR_ENV: &'static str = "NODE_AGENT_TEST_PAUSE_DIR";

    /// A pause at `stage` (one of [`EnrollmentPause::STAGES`]), with a fresh directory for its files.
    pub fn at(stage: &'static str) -> Self {
        assert!(Self::STAGES.contains(&stage), "{stage} is none of the agent's enrollment stages {:?}", Self::STAGES);
        let dir = tempfile::Builder::new().prefix("enroll-pause-").tempdir().expect("pause dir");
        Self { stage, dir }
    }

    /// The agent env that arms the pause, for [`NodeAgent::start`]'s overrides.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![(Self::STAGE_ENV, self.stage.to_owned()), (Self::DIR_ENV, self.dir.path().display().to_string())]
    }

    /// Waits until the enrollment of pod `uid` is paused at the stage.
    #[track_caller]
    pub fn wait_paused(&self, uid: &str) {
        let paused = self.dir.path().join(format!("{uid}.paused"));
        eventually(&format!("the enrollment of {uid} pauses at stage {}", self.stage), || {
            paused.exists().then_some(())
        });
    }

    /// Lets the enrollment of pod `uid` go on.
    pub fn resume(&self, uid: &str) {
        std::fs::write(self.dir.path().join(format!("{uid}.resume")), b"").expect("write resume file");
    }
}

//! Running the real `hbone-proxy` binary on a test node, the way its DaemonSet runs it on a real one: inside the
//! node netns, connected to the node agent's ZDS socket, with a state dir, a local workloads file and its own
//! service account's kubeconfig, so its default workload source (the enrolled Pod objects in the API server) is on.
//! Shared by the proxy's end-to-end tests and the demo.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::node_agent::NodeAgent;
use crate::wait::eventually;
use crate::{bins, chart, Cluster};
use istio_contract::ports;
use serde_json::Value;

/// The file in the proxy's dir holding the kubeconfig of its service account.
const KUBECONFIG: &str = "hbone-proxy.kubeconfig";
/// The environment setting that turns the proxy's Kubernetes workload source off (leaving the local file).
pub const KUBE_WORKLOADS_OFF: (&str, &str) = ("KUBE_WORKLOADS", "false");
/// The path the proxy's Kubernetes source lists and watches: every pod of the cluster.
const PODS_PATH: &str = "/api/v1/pods";
/// The `source` the proxy's `/config_dump` gives workloads from its local workloads file.
pub const LOCAL_FILE_SOURCE: &str = "local-file";
/// The `source` the proxy's `/config_dump` gives workloads from its Kubernetes source (enrolled Pod objects).
pub const KUBERNETES_SOURCE: &str = "kubernetes";

/// The `hbone-proxy` binary running in the node netns; killed on drop, its log printed if the test failed.
pub struct Proxy {
    child: Child,
    log: PathBuf,
    /// The node netns it runs in, where its admin endpoint listens on loopback.
    netns: PathBuf,
    /// Its admin port (`ADMIN_PORT`, Istio's 15000 unless the test set another).
    admin_port: u16,
}

impl Proxy {
    /// Starts the proxy with the agent's ZDS socket, a state dir and local workloads file under `dir`, the
    /// kubeconfig of its chart service account (its Kubernetes workload source on, unless `env` has
    /// `KUBE_WORKLOADS=false`), plus `env`; returns once it answers `/healthz/ready` with 200 and, with the
    /// Kubernetes source on, has listed the pods (readiness waits for that list too).
    pub fn start(cluster: &Cluster, agent: &NodeAgent, dir: &Path, workloads: &Path, env: &[(&str, &str)]) -> Self {
        Self::start_with_open_files(cluster, agent, dir, workloads, env, None)
    }

    /// Like [`Proxy::start`], with the open-files limit (`RLIMIT_NOFILE`) the process starts with set to
    /// `(soft, hard)` when given, as a container runtime or systemd would set it (`None`: this process's own).
    pub fn start_with_open_files(
        cluster: &Cluster,
        agent: &NodeAgent,
        dir: &Path,
        workloads: &Path,
        env: &[(&str, &str)],
        open_files: Option<(u64, u64)>,
    ) -> Self {
        Self::start_on(cluster, &agent.zds_socket(), dir, workloads, env, open_files)
    }

    /// Like [`Proxy::start_with_open_files`] with the ZDS socket `zds` of any node agent (e.g. Istio's,
    /// [`crate::istio_agent::IstioAgent::zds_socket`]).
    pub fn start_on(
        cluster: &Cluster,
        zds: &Path,
        dir: &Path,
        workloads: &Path,
        env: &[(&str, &str)],
        open_files: Option<(u64, u64)>,
    ) -> Self {
        let mut proxy = Self::spawn_with_open_files(cluster, zds, dir, workloads, env, open_files, true);
        let netns = cluster.node.netns().path();
        eventually("hbone-proxy answers /healthz/ready with 200", || {
            proxy.assert_running();
            let ready = crate::http::get(&netns, ports::READINESS, "/healthz/ready").map(|(status, _)| status);
            (ready == Ok(200)).then_some(())
        });
        proxy
    }

    /// Like [`Proxy::start`] but returns once it serves `/metrics`, ready or not (for tests of readiness), and
    /// its Kubernetes source (when on) has listed the pods and started watching them.
    pub fn spawn(cluster: &Cluster, agent: &NodeAgent, dir: &Path, workloads: &Path, env: &[(&str, &str)]) -> Self {
        Self::spawn_with_open_files(cluster, &agent.zds_socket(), dir, workloads, env, None, true)
    }

    /// Like [`Proxy::spawn`] without waiting for its Kubernetes source to list the pods (for tests of what the
    /// proxy does before that list).
    pub fn spawn_unlisted(
        cluster: &Cluster,
        agent: &NodeAgent,
        dir: &Path,
        workloads: &Path,
        env: &[(&str, &str)],
    ) -> Self {
        Self::spawn_with_open_files(cluster, &agent.zds_socket(), dir, workloads, env, None, false)
    }

    fn spawn_with_open_files(
        cluster: &Cluster,
        zds: &Path,
        dir: &Path,
        workloads: &Path,
        env: &[(&str, &str)],
        open_files: Option<(u64, u64)>,
        wait_listed: bool,
    ) -> Self {
        let log =
            (0..).map(|n| dir.join(format!("hbone-proxy-{n}.log"))).find(|p| !p.exists()).expect("a free log name");
        let kubeconfig = dir.join(KUBECONFIG);
        cluster.write_kubeconfig_for(&kubeconfig, chart::PROXY_SERVICE_ACCOUNT);
        let watches_before = pod_watches(cluster);
        let mut cmd = Command::new(bins::path("hbone-proxy"));
        cmd.env_clear()
            .env("INPOD_UDS", zds)
            .env("STATE_DIR", dir.join("state"))
            .env("LOCAL_WORKLOADS", workloads)
            .env("KUBECONFIG", &kubeconfig)
            .env("LOG_LEVEL", "debug,h2=info,rustls=info,hyper=info")
            .env("NO_COLOR", "1")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(File::create(&log).expect("proxy log file"));
        if let Some((soft, hard)) = open_files {
            use nix::sys::resource::{setrlimit, Resource};
            use std::os::unix::process::CommandExt;
            // SAFETY: between fork and exec the closure only makes one async-signal-safe system call.
            unsafe {
                cmd.pre_exec(move || setrlimit(Resource::RLIMIT_NOFILE, soft, hard).map_err(std::io::Error::from));
            }
        }
        let node = cluster.node.netns().open().expect("open node netns");
        let child = node.run(|| cmd.spawn()).expect("enter node netns").expect("spawn hbone-proxy");
        let netns = cluster.node.netns().path();
        let admin_port = env
            .iter()
            .find(|(name, _)| *name == "ADMIN_PORT")
            .map_or(ports::ADMIN, |(_, port)| port.parse().unwrap_or_else(|e| panic!("ADMIN_PORT={port}: {e}")));
        let mut proxy = Proxy { child, log, netns: netns.clone(), admin_port };
        eventually("hbone-proxy serves /metrics", || {
            proxy.assert_running();
            crate::http::get(&netns, ports::STATS, "/metrics").ok().map(|_| ())
        });
        // With `CONTROL_PLANE=istiod` the workloads come from istiod: no Kubernetes source runs.
        let istiod = env.iter().any(|(name, value)| *name == "CONTROL_PLANE" && value.eq_ignore_ascii_case("istiod"));
        if wait_listed && !env.contains(&KUBE_WORKLOADS_OFF) && !istiod {
            // The watcher watches only once its list is in the directory: a new watch means the pods are listed.
            eventually("hbone-proxy's Kubernetes source listed the pods and watches them", || {
                proxy.assert_running();
                (pod_watches(cluster) > watches_before).then_some(())
            });
        }
        proxy
    }

    /// How many addresses the proxy's Kubernetes workload source holds in its directory, as its `/config_dump`
    /// counts them; `None` while the dump does not answer or the source has listed nothing yet.
    pub fn kubernetes_addresses(&self) -> Option<usize> {
        let dump = self.config_dump()?;
        let addresses = dump["workload_sources"][KUBERNETES_SOURCE]["addresses"].as_u64()?;
        usize::try_from(addresses).ok()
    }

    /// The workloads the proxy's `/config_dump` lists from `source` ([`LOCAL_FILE_SOURCE`] or
    /// [`KUBERNETES_SOURCE`]), in ztunnel's shape (`uid`, `name`, `namespace`, `serviceAccount`, `workloadIps`,
    /// ...); `None` while the dump does not answer.
    pub fn listed_workloads(&self, source: &str) -> Option<Vec<Value>> {
        let dump = self.config_dump()?;
        let listed = dump["workloads"].as_array()?;
        Some(listed.iter().filter(|w| w["source"] == source).cloned().collect())
    }

    /// The proxy's `/config_dump`, parsed; `None` while it does not answer 200 with JSON.
    pub fn config_dump(&self) -> Option<Value> {
        match crate::http::get(&self.netns, self.admin_port, "/config_dump") {
            Ok((200, body)) => serde_json::from_str(&body).ok(),
            _ => None,
        }
    }

    /// Panics with the log if the proxy exited.
    fn assert_running(&mut self) {
        if let Ok(Some(status)) = self.child.try_wait() {
            panic!("hbone-proxy exited with {status}; log:\n{}", self.log());
        }
    }

    /// The process id, so a caller can tell whether it is still running.
    pub fn pid(&self) -> u32 {
        self.child.id()
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
        crate::wait::exit_within(&mut self.child, since, limit)
    }
}

/// How many pod watches the proxy's service account has opened on `cluster`'s API server.
fn pod_watches(cluster: &Cluster) -> usize {
    let user = fake_apiserver::User::service_account(chart::NAMESPACE, chart::PROXY_SERVICE_ACCOUNT).name;
    let requests = cluster.api.cluster().requests();
    requests.iter().filter(|r| r.user == user && r.path == PODS_PATH && r.is_watch()).count()
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

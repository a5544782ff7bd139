//! Running the real `hbone-proxy` binary on a test node, the way its DaemonSet runs it on a real one: inside the
//! node netns, connected to the node agent's ZDS socket, with a state dir and a local workloads file. Shared by
//! the proxy's end-to-end tests and the demo.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::node_agent::NodeAgent;
use crate::wait::eventually;
use crate::{bins, Cluster};
use istio_contract::ports;

/// The `hbone-proxy` binary running in the node netns; killed on drop, its log printed if the test failed.
pub struct Proxy {
    child: Child,
    log: PathBuf,
}

impl Proxy {
    /// Starts the proxy with the agent's ZDS socket, a state dir and local workloads file under `dir`, plus
    /// `env`; returns once it answers `/healthz/ready` with 200.
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
        let mut proxy = Self::spawn_with_open_files(cluster, agent, dir, workloads, env, open_files);
        let netns = cluster.node.netns().path();
        eventually("hbone-proxy answers /healthz/ready with 200", || {
            proxy.assert_running();
            let ready = crate::http::get(&netns, ports::READINESS, "/healthz/ready").map(|(status, _)| status);
            (ready == Ok(200)).then_some(())
        });
        proxy
    }

    /// Like [`Proxy::start`] but returns once it serves `/metrics`, ready or not (for tests of readiness).
    pub fn spawn(cluster: &Cluster, agent: &NodeAgent, dir: &Path, workloads: &Path, env: &[(&str, &str)]) -> Self {
        Self::spawn_with_open_files(cluster, agent, dir, workloads, env, None)
    }

    fn spawn_with_open_files(
        cluster: &Cluster,
        agent: &NodeAgent,
        dir: &Path,
        workloads: &Path,
        env: &[(&str, &str)],
        open_files: Option<(u64, u64)>,
    ) -> Self {
        let log =
            (0..).map(|n| dir.join(format!("hbone-proxy-{n}.log"))).find(|p| !p.exists()).expect("a free log name");
        let mut cmd = Command::new(bins::path("hbone-proxy"));
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
        let mut proxy = Proxy { child, log };
        let netns = cluster.node.netns().path();
        eventually("hbone-proxy serves /metrics", || {
            proxy.assert_running();
            crate::http::get(&netns, ports::STATS, "/metrics").ok().map(|_| ())
        });
        proxy
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

impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("hbone-proxy log:\n{}", self.log());
        }
    }
}

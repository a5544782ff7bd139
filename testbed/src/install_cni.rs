//! Running the real `install-cni` binary on a test node, the way the DaemonSet's container runs on a real one:
//! inside the node netns (so it reaches the fake API server at 127.0.0.1 and its probe ports are private to the
//! node), with the node's net.d, bin dir and run dir as its host mounts and a projected-volume-style service
//! account dir. Tests then look at what a user would: files on disk, `/readyz`, `/metrics` and the log.

use std::fs::File;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};

use istio_contract::{names, paths, ports};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use crate::wait::{eventually, eventually_or};
use tempfile::TempDir;

use crate::{bins, chart, Cluster};

static RUNS: AtomicUsize = AtomicUsize::new(0);

/// A service-account volume laid out as the kubelet projects it: `..<timestamp>/{token,ca.crt,namespace}`,
/// `..data -> ..<timestamp>`, and `token`, `ca.crt`, `namespace` linked through `..data`, so a rotation is one
/// atomic rename of `..data`.
#[derive(Debug)]
pub struct ServiceAccountDir {
    dir: TempDir,
    ca_pem: String,
    generation: u32,
}

impl ServiceAccountDir {
    /// A volume holding `token`, the cluster CA `ca_pem` and namespace `istio-system`.
    pub fn new(token: &str, ca_pem: &str) -> Self {
        let dir = tempfile::Builder::new().prefix("sa-").tempdir().expect("service account tempdir");
        let mut sa = Self { dir, ca_pem: ca_pem.to_owned(), generation: 0 };
        sa.rotate(token);
        for name in ["token", "ca.crt", "namespace"] {
            symlink(format!("..data/{name}"), sa.path().join(name)).expect("service account file link");
        }
        sa
    }

    /// The token the volume holds now.
    pub fn token(&self) -> String {
        std::fs::read_to_string(self.path().join("token")).expect("read the service account token")
    }

    /// The dir to pass as `SERVICE_ACCOUNT_DIR`.
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// The kubelet's rotation: a new timestamped dir with `token`, then `..data_tmp` renamed over `..data`.
    pub fn rotate(&mut self, token: &str) {
        self.generation += 1;
        let stamp = format!("..2026_11_30_00_00_{:02}.{}", self.generation, self.generation);
        let data = self.path().join(&stamp);
        std::fs::create_dir(&data).expect("timestamped dir");
        for (name, content) in [("token", token), ("ca.crt", self.ca_pem.as_str()), ("namespace", chart::NAMESPACE)] {
            std::fs::write(data.join(name), content).expect("service account file");
        }
        let tmp = self.path().join("..data_tmp");
        symlink(&stamp, &tmp).expect("..data_tmp link");
        std::fs::rename(&tmp, self.path().join("..data")).expect("swap ..data");
    }
}

/// Everything an `install-cni` run needs on a [`Cluster`]'s node: the image's bin dir (a copy of the built
/// plugin), the service account (the istio-cni service account's token and the cluster CA: install-cni's
/// in-cluster credentials, for its own API requests and the plugin's kubeconfig) and the env.
#[derive(Debug)]
pub struct Installer {
    env: Vec<(String, String)>,
    args: Vec<String>,
    netns: PathBuf,
    scratch: TempDir,
    /// The projected service-account volume the installer reads its token from.
    pub sa: ServiceAccountDir,
    /// The run dir shared with the plugin, where the kubeconfig goes.
    pub run_dir: PathBuf,
    /// The node's CNI config dir (`MOUNTED_CNI_NET_DIR`).
    pub net_d: PathBuf,
    /// The node's CNI bin dir (`HOST_CNI_BIN_DIR`, the runtime's `CNI_PATH`).
    pub bin_dir: PathBuf,
    /// The image's bin dir (`CNI_BIN_SOURCE_DIR`) holding the built plugin.
    pub source_dir: PathBuf,
}

impl Installer {
    /// Prepares a run on `cluster`'s node. The kubeconfig `Cluster::new` put into the run dir is removed, so
    /// the run dir starts empty, as on a fresh node.
    pub fn new(cluster: &Cluster) -> Self {
        let scratch = tempfile::Builder::new().prefix("install-cni-").tempdir().expect("installer tempdir");
        let source_dir = scratch.path().join("image-bin");
        std::fs::create_dir(&source_dir).expect("image bin dir");
        let built = bins::path(names::PLUGIN_TYPE);
        let copy = source_dir.join(names::PLUGIN_TYPE);
        std::fs::hard_link(&built, &copy).or_else(|_| std::fs::copy(&built, &copy).map(drop)).expect("copy plugin");
        let run_dir = cluster.run_dir();
        let _ = std::fs::remove_file(run_dir.join(paths::KUBECONFIG_FILE));
        let sa = ServiceAccountDir::new(&cluster.token(chart::CNI_SERVICE_ACCOUNT), &cluster.ca_pem());
        let path = |p: &Path| p.display().to_string();
        let env = [
            ("PATH", std::env::var("PATH").unwrap_or_default()),
            ("MOUNTED_CNI_NET_DIR", path(&cluster.node.conf_dir())),
            ("CNI_BIN_SOURCE_DIR", path(&source_dir)),
            ("HOST_CNI_BIN_DIR", path(&cluster.node.bin_dir())),
            ("CNI_AGENT_RUN_DIR", path(&run_dir)),
            ("SERVICE_ACCOUNT_DIR", path(sa.path())),
            ("KUBERNETES_SERVICE_HOST", cluster.api.addr().ip().to_string()),
            ("KUBERNETES_SERVICE_PORT", cluster.api.addr().port().to_string()),
            ("POD_NAMESPACE", chart::NAMESPACE.into()),
            ("POD_NAME", "istio-cni-node-test".into()),
            ("NODE_NAME", "node-1".into()),
            ("EXCLUDE_NAMESPACES", "kube-system".into()),
            ("LOG_LEVEL", "debug".into()),
        ];
        Self {
            env: env.into_iter().map(|(k, v)| (k.to_owned(), v)).collect(),
            args: Vec::new(),
            netns: cluster.node.netns().path(),
            scratch,
            sa,
            run_dir,
            net_d: cluster.node.conf_dir(),
            bin_dir: cluster.node.bin_dir(),
            source_dir,
        }
    }

    /// Sets (or overrides) one env var of the next runs.
    pub fn env(&mut self, key: &str, value: &str) -> &mut Self {
        self.env.retain(|(k, _)| k != key);
        self.env.push((key.to_owned(), value.to_owned()));
        self
    }

    /// Adds a command-line argument to the next runs (Istio's chart passes some settings as flags).
    pub fn arg(&mut self, arg: &str) -> &mut Self {
        self.args.push(arg.to_owned());
        self
    }

    /// The kubeconfig the installer writes for the plugin.
    pub fn kubeconfig(&self) -> PathBuf {
        self.run_dir.join(paths::KUBECONFIG_FILE)
    }

    /// Spawns `install-cni` inside the node netns with a cleared env plus ours; stderr goes to a log file.
    pub fn start(&self) -> InstallCni {
        let log = self.scratch.path().join(format!("install-cni-{}.log", RUNS.fetch_add(1, Ordering::Relaxed)));
        let stderr = File::create(&log).expect("installer log file");
        let mut cmd = Command::new(bins::path("install-cni"));
        cmd.args(&self.args)
            .env_clear()
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr);
        let ns = netns::Netns::open(&self.netns).expect("open node netns");
        let child = ns.run(|| cmd.spawn()).expect("enter node netns").expect("spawn install-cni");
        InstallCni { child, netns: self.netns.clone(), log, exit: None }
    }
}

/// A running `install-cni`; killed with SIGKILL on drop unless it already exited.
#[derive(Debug)]
pub struct InstallCni {
    child: Child,
    netns: PathBuf,
    log: PathBuf,
    exit: Option<ExitStatus>,
}

impl InstallCni {
    /// The process id, so a caller can tell whether it is still running.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The process's log (its stderr) so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// `GET path` on `port` from inside the node netns: status code and body, or why the request failed.
    pub fn get(&self, port: u16, path: &str) -> Result<(u16, String), String> {
        crate::http::get(&self.netns, port, path)
    }

    /// [`eventually`](crate::wait::eventually), with the installer's log in the panic message.
    #[track_caller]
    pub fn until<T>(&self, what: &str, probe: impl FnMut() -> Option<T>) -> T {
        eventually_or(what, probe, || format!("install-cni log:\n{}", self.log()))
    }

    /// Waits until `/readyz` answers `status`, and returns its body.
    #[track_caller]
    pub fn wait_readyz(&self, status: u16) -> String {
        self.until(&format!("/readyz answers {status}"), || match self.get(ports::CNI_READINESS, "/readyz") {
            Ok((s, body)) if s == status => Some(body),
            _ => None,
        })
    }

    /// The value of sample `name` (e.g. `istio_cni_config_fights_total`) in `/metrics`, if exposed.
    pub fn metric(&self, name: &str) -> Option<f64> {
        let (status, body) = self.get(ports::CNI_MONITORING, "/metrics").ok()?;
        assert_eq!(status, 200, "/metrics answered {status}: {body}");
        body.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
    }

    /// Sends SIGTERM (as the kubelet does) and waits for the exit.
    #[track_caller]
    pub fn terminate(&mut self) -> ExitStatus {
        let pid = Pid::from_raw(self.child.id() as i32);
        kill(pid, Signal::SIGTERM).expect("SIGTERM install-cni");
        self.wait_exit()
    }

    /// Waits for the process to exit on its own.
    #[track_caller]
    pub fn wait_exit(&mut self) -> ExitStatus {
        let status = eventually("install-cni exits", || self.child.try_wait().expect("wait for install-cni"));
        self.exit = Some(status);
        status
    }
}

impl Drop for InstallCni {
    fn drop(&mut self) {
        if self.exit.is_none() && matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

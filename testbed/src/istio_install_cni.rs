//! Running ISTIO's own `install-cni` (the test reference built by `scripts/istio-ref/build.sh`; nothing of it is in
//! our code or images) on a test node, for differential tests against ours.
//!
//! Istio's installer hard-codes its paths: it copies everything in `/opt/cni/bin` to `/host/opt/cni/bin` and reads
//! its service account from `/var/run/secrets/kubernetes.io/serviceaccount`. So each run gets a private root: a temp
//! dir holding that layout, whose dirs are bind mounts of the test's own dirs (the conf dir on
//! `/host/etc/cni/net.d`, the bin dir on `/host/opt/cni/bin`, a dir holding only Istio's `istio-cni` plugin on
//! `/opt/cni/bin`, the service-account dir, and the run dir on [`RUN_DIR`]), and the binary is run chrooted into it,
//! in a private mount namespace (`unshare --mount --propagation private`) and its own network namespace (its
//! readiness port 8000, monitoring port 15014 and ctrlz port 9876 then never collide with anything else).
//!
//! Guarantees: nothing is created or mounted outside the temp dirs, and no mount is visible outside the process's
//! own mount namespace, which the kernel tears down when the process exits; the machine's real `/etc/cni/net.d`,
//! `/opt/cni/bin` and `/host` are never touched. A running process is killed on drop (also when the test panics),
//! and the netns is deleted after it.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tempfile::TempDir;

use crate::wait::eventually_or;
use crate::NetnsGuard;

static RUNS: AtomicUsize = AtomicUsize::new(0);

/// The conf dir as Istio's installer sees it (`MOUNTED_CNI_NET_DIR`'s default).
pub const NET_DIR: &str = "/host/etc/cni/net.d";
/// The run dir as Istio's installer sees it (`CNI_AGENT_RUN_DIR`, also written into the plugin's netconf).
pub const RUN_DIR: &str = "/var/run/istio-cni";
/// Istio's readiness port (hard-coded).
pub const READINESS_PORT: u16 = 8000;

/// Mounts the test's dirs into the private root and execs the installer chrooted into it. Positional arguments:
/// root, conf dir, bin dir, service-account dir, run dir, Istio's plugin, Istio's installer, then its arguments.
const ENTER_ROOT: &str = r#"set -eu
root=$1
mount --bind "$2" "$root/host/etc/cni/net.d"
mount --bind "$3" "$root/host/opt/cni/bin"
mount --bind "$4" "$root/var/run/secrets/kubernetes.io/serviceaccount"
mount --bind "$5" "$root/var/run/istio-cni"
mount --bind "$6" "$root/opt/cni/bin/istio-cni"
mount --bind "$7" "$root/install-cni"
mount --bind /proc "$root/proc"
mount --bind /dev "$root/dev"
shift 7
exec chroot "$root" /install-cni "$@"
"#;

/// One of Istio's installers, ready to start: its own netns and private root, the test's dirs, and the env.
#[derive(Debug)]
pub struct IstioInstaller {
    installer: PathBuf,
    plugin: PathBuf,
    netns: NetnsGuard,
    root: TempDir,
    env: Vec<(String, String)>,
    args: Vec<String>,
    /// The conf dir (mounted on [`NET_DIR`]).
    pub net_d: PathBuf,
    /// The host's CNI bin dir (mounted on `/host/opt/cni/bin`).
    pub bin_dir: PathBuf,
    /// The run dir (mounted on [`RUN_DIR`]), where the plugin's kubeconfig goes.
    pub run_dir: PathBuf,
    /// The service-account dir (`token`, `ca.crt`, `namespace`).
    pub sa_dir: PathBuf,
}

impl IstioInstaller {
    /// A run of `<istio_bin>/install-cni` installing `<istio_bin>/istio-cni` into `bin_dir` and chaining it into
    /// `net_d`, with `run_dir` and `sa_dir`. The env starts with `MOUNTED_CNI_NET_DIR`, `CNI_AGENT_RUN_DIR` and
    /// `REPAIR_ENABLED=false` (the repair controller would need the API server); add the rest with [`Self::env`].
    pub fn new(istio_bin: &Path, net_d: &Path, bin_dir: &Path, run_dir: &Path, sa_dir: &Path) -> Self {
        let root = tempfile::Builder::new().prefix("istio-root-").tempdir().expect("private root tempdir");
        for dir in [
            "host/etc/cni/net.d",
            "host/opt/cni/bin",
            "opt/cni/bin",
            "var/run/secrets/kubernetes.io/serviceaccount",
            "var/run/istio-cni",
            "tmp",
            "proc",
            "dev",
        ] {
            std::fs::create_dir_all(root.path().join(dir)).expect("private root dir");
        }
        for file in ["install-cni", "opt/cni/bin/istio-cni"] {
            File::create(root.path().join(file)).expect("bind mount target");
        }
        let env = [
            ("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
            ("MOUNTED_CNI_NET_DIR", NET_DIR),
            ("CNI_AGENT_RUN_DIR", RUN_DIR),
            ("REPAIR_ENABLED", "false"),
        ];
        Self {
            installer: istio_bin.join("install-cni"),
            plugin: istio_bin.join("istio-cni"),
            netns: NetnsGuard::new("istio-install"),
            root,
            env: env.into_iter().map(|(k, v)| (k.to_owned(), v.to_owned())).collect(),
            args: Vec::new(),
            net_d: net_d.to_owned(),
            bin_dir: bin_dir.to_owned(),
            run_dir: run_dir.to_owned(),
            sa_dir: sa_dir.to_owned(),
        }
    }

    /// Sets (or overrides) one env var of the next runs.
    pub fn env(&mut self, key: &str, value: &str) -> &mut Self {
        self.env.retain(|(k, _)| k != key);
        self.env.push((key.to_owned(), value.to_owned()));
        self
    }

    /// Adds a command-line argument to the next runs.
    pub fn arg(&mut self, arg: &str) -> &mut Self {
        self.args.push(arg.to_owned());
        self
    }

    /// Spawns the installer in its netns and private root; stdout and stderr go to a log file.
    pub fn start(&self) -> IstioInstallCni {
        let log = self.root.path().with_extension(format!("install-cni-{}.log", RUNS.fetch_add(1, Ordering::Relaxed)));
        let out = File::create(&log).expect("installer log file");
        let err = out.try_clone().expect("installer log file");
        let mut cmd = Command::new("unshare");
        cmd.args(["--mount", "--propagation", "private", "--", "sh", "-c", ENTER_ROOT, "sh"])
            .arg(self.root.path())
            .args([&self.net_d, &self.bin_dir, &self.sa_dir, &self.run_dir, &self.plugin, &self.installer])
            .args(&self.args)
            .env_clear()
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err);
        let ns = self.netns.open().expect("open the installer's netns");
        let child = ns.run(|| cmd.spawn()).expect("enter the installer's netns").expect("spawn Istio's install-cni");
        IstioInstallCni { child, netns: self.netns.path(), log, exit: None }
    }
}

/// A running Istio `install-cni` (the spawned process execs into it, so its pid is the installer's); killed with
/// SIGKILL on drop unless it already exited. Its log file is removed on drop.
#[derive(Debug)]
pub struct IstioInstallCni {
    child: Child,
    netns: PathBuf,
    log: PathBuf,
    exit: Option<ExitStatus>,
}

impl IstioInstallCni {
    /// The process's output so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Whether `/readyz` answers 200 now.
    pub fn ready(&self) -> bool {
        matches!(crate::http::get(&self.netns, READINESS_PORT, "/readyz"), Ok((200, _)))
    }

    /// [`eventually`](crate::wait::eventually), with the installer's log in the panic message; also fails at once
    /// when the process has exited.
    #[track_caller]
    pub fn until<T>(&mut self, what: &str, mut probe: impl FnMut(&Self) -> Option<T>) -> T {
        let log = self.log.clone();
        let context =
            move || format!("Istio's install-cni log:\n{}", std::fs::read_to_string(&log).unwrap_or_default());
        eventually_or(
            what,
            || {
                if let Ok(Some(status)) = self.child.try_wait() {
                    panic!("Istio's install-cni exited ({status}) before {what}\n{}", self.log());
                }
                probe(self)
            },
            context,
        )
    }

    /// Sends SIGTERM (as the kubelet does) and waits for the exit.
    #[track_caller]
    pub fn terminate(&mut self) -> ExitStatus {
        kill(Pid::from_raw(self.child.id() as i32), Signal::SIGTERM).expect("SIGTERM Istio's install-cni");
        let log = self.log.clone();
        let status = eventually_or(
            "Istio's install-cni exits",
            || self.child.try_wait().expect("wait for Istio's install-cni"),
            move || std::fs::read_to_string(&log).unwrap_or_default(),
        );
        self.exit = Some(status);
        status
    }
}

impl Drop for IstioInstallCni {
    fn drop(&mut self) {
        if self.exit.is_none() && matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        let _ = std::fs::remove_file(&self.log);
    }
}

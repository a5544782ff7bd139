//! Running real podman (CNI network backend) against a test conflist, with all of podman's state in a
//! temp dir. Verified with Debian 12's podman 4.3.1.
//!
//! What makes it work:
//! - podman 4.3 has no `--network-backend` flag; the backend, plugin dirs and config dir come from a
//!   private `containers.conf` passed via `CONTAINERS_CONF`.
//! - `--rootfs` is a boolean: the first positional argument is the rootfs dir, so every other flag must
//!   come *before* it (flags after it become the container command).
//! - The sandbox lacks CAP_SYS_RESOURCE, so podman's default rlimits (nofile 1048576) make runc fail;
//!   every run passes explicit `--ulimit nofile=4096:4096 --ulimit nproc=4096:4096`, and `default_ulimits`
//!   sets the same for any other podman command.
//! - `lock_type = "file"` keeps locks in the temp dir instead of the shared `/dev/shm/libpod_lock`.
//! - podman must be spawned with a plain `setns` into the node netns (not `ip netns exec`, which remounts
//!   /sys and hides the cgroup mount from runc). Plugins then run in the node netns.
//! - podman passes its own environment to plugins and sets `CNI_ARGS` to
//!   `IgnoreUnknown=1;K8S_POD_NAME=<container name>;<$CNI_ARGS>`.
//! - libcni's result cache is always `/var/lib/cni/results` (not configurable); `--rm` DEL removes it.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use tempfile::TempDir;

use crate::runtime::{exec, RawOutput};

/// Deadline for one `podman run`.
const PODMAN_DEADLINE: Duration = Duration::from_secs(120);
/// Busybox applets linked into the rootfs.
const APPLETS: [&str; 8] = ["sh", "ip", "nc", "cat", "sleep", "wget", "id", "ls"];

/// A private podman installation: containers.conf, network config dir, storage, and a busybox rootfs.
#[derive(Debug)]
pub struct Podman {
    dir: TempDir,
    netns: Option<PathBuf>,
}

impl Podman {
    /// Prepares the temp dir; plugins are found in `cni_bin_dir`. Panics on setup failure.
    pub fn new(cni_bin_dir: &Path) -> Self {
        let dir = tempfile::Builder::new().prefix("podman-").tempdir().expect("podman tempdir");
        let rootfs_bin = dir.path().join("rootfs/bin");
        std::fs::create_dir_all(&rootfs_bin).expect("rootfs/bin");
        std::fs::create_dir(dir.path().join("net.d")).expect("net.d");
        std::fs::copy("/bin/busybox", rootfs_bin.join("busybox"))
            .expect("copy /bin/busybox (run scripts/install-deps.sh)");
        for applet in APPLETS {
            std::os::unix::fs::symlink("busybox", rootfs_bin.join(applet)).expect("applet symlink");
        }
        let conf = format!(
            "[network]\nnetwork_backend = \"cni\"\ncni_plugin_dirs = [{:?}]\nnetwork_config_dir = {:?}\n\
             [containers]\ndefault_ulimits = [\"nofile=4096:4096\", \"nproc=4096:4096\"]\n\
             [engine]\ncgroup_manager = \"cgroupfs\"\nevents_logger = \"none\"\nruntime = \"runc\"\n\
             lock_type = \"file\"\n",
            cni_bin_dir.display().to_string(),
            dir.path().join("net.d").display().to_string(),
        );
        std::fs::write(dir.path().join("containers.conf"), conf).expect("containers.conf");
        Self { dir, netns: None }
    }

    /// Runs podman from inside the netns at `path` (the node netns, where the bridge lives).
    pub fn in_netns(mut self, path: impl Into<PathBuf>) -> Self {
        self.netns = Some(path.into());
        self
    }

    /// The busybox rootfs containers run in.
    pub fn rootfs(&self) -> PathBuf {
        self.dir.path().join("rootfs")
    }

    /// Writes `conflist` into podman's network config dir as `<name>.conflist`.
    pub fn add_network(&self, conflist: &Value) {
        let name = conflist["name"].as_str().expect("conflist has a name");
        let path = self.dir.path().join("net.d").join(format!("{name}.conflist"));
        std::fs::write(&path, conflist.to_string()).expect("write conflist");
    }

    /// A `podman` command with the private config and storage; add a subcommand and its args.
    pub fn command(&self) -> Command {
        let d = self.dir.path();
        let mut cmd = Command::new("podman");
        cmd.env("CONTAINERS_CONF", d.join("containers.conf"))
            .arg("--root")
            .arg(d.join("root"))
            .arg("--runroot")
            .arg(d.join("runroot"))
            .arg("--tmpdir")
            .arg(d.join("tmp"))
            .args(["--storage-driver", "vfs"]);
        cmd
    }

    /// `podman run --rm --name <name> --network <network> --rootfs <rootfs> <argv...>` with `CNI_ARGS`
    /// from `cni_args`, under a deadline.
    pub fn run(&self, network: &str, name: &str, cni_args: &[(&str, &str)], argv: &[&str]) -> RawOutput {
        self.run_with(&["--rm"], network, name, cni_args, argv)
    }

    /// Like [`Podman::run`] but keeps the container, so a test can observe DEL at [`Podman::rm`].
    pub fn run_kept(&self, network: &str, name: &str, cni_args: &[(&str, &str)], argv: &[&str]) -> RawOutput {
        self.run_with(&[], network, name, cni_args, argv)
    }

    /// `podman rm <name>`: tears the container's network down (CNI DEL).
    pub fn rm(&self, name: &str) -> RawOutput {
        let mut cmd = self.command();
        cmd.args(["rm", name]);
        self.exec(cmd)
    }

    fn run_with(
        &self,
        extra: &[&str],
        network: &str,
        name: &str,
        cni_args: &[(&str, &str)],
        argv: &[&str],
    ) -> RawOutput {
        let mut cmd = self.command();
        let args: Vec<String> = cni_args.iter().map(|(k, v)| format!("{k}={v}")).collect();
        cmd.env("CNI_ARGS", args.join(";"))
            .arg("run")
            .args(extra)
            .args(["--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096"])
            .args(["--name", name, "--network", network, "--rootfs"])
            .arg(self.rootfs())
            .args(argv);
        self.exec(cmd)
    }

    fn exec(&self, cmd: Command) -> RawOutput {
        exec::run(cmd, Path::new("podman"), self.netns.as_deref(), Vec::new(), PODMAN_DEADLINE)
            .unwrap_or_else(|e| panic!("podman: {e}"))
    }
}

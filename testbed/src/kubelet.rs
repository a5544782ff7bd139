//! "The node's kubelet is running": a real process the node agent finds through `/proc` the way it finds the
//! kubelet on a node (a process named `kubelet` whose command line mentions kubelet), running as
//! [`KUBELET_UID`]. In nftables mode the agent's host probe rule SNATs only that uid's sockets, so a test that
//! stands in for a kubelet probe connects as that uid.

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use tempfile::TempDir;

use crate::wait::eventually;

/// The uid the test node's kubelet runs as. Not root, so a host probe rule that fell back to root's uid would miss
/// its probes; not the proxy's 1337 nor a test app's uid.
pub const KUBELET_UID: u32 = 4040;

/// How long the stand-in kubelet lives if its guard never runs (the test process was killed).
const LIFETIME_SECS: &str = "3600";

/// `sleep` run through a link named `kubelet`, started as [`KUBELET_UID`] (gid the same); killed, reaped and removed on
/// drop, also when the test panics.
#[derive(Debug)]
pub struct Kubelet {
    child: Child,
    _dir: TempDir,
}

impl Kubelet {
    /// Starts it; returns once `/proc` shows it under its name with its uid.
    #[track_caller]
    pub fn start() -> Self {
        let dir = tempfile::Builder::new().prefix("kubelet-").tempdir().expect("kubelet dir");
        // The kubelet's uid must reach and run the binary.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod kubelet dir");
        // A symlink, not a copy: the kernel names the process after the path it execs (so `comm` is `kubelet`),
        // and a freshly written copy can fail with ETXTBSY while a parallel test forks with its write fd open.
        let bin = dir.path().join("kubelet");
        std::os::unix::fs::symlink(sleep_binary(), &bin).expect("link kubelet to sleep");
        let child = Command::new(&bin)
            .arg(LIFETIME_SECS)
            .uid(KUBELET_UID)
            .gid(KUBELET_UID)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn the stand-in kubelet");
        let pid = child.id();
        eventually("the stand-in kubelet shows in /proc under its name and uid", || {
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
            let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
            let uid = status.lines().find_map(|l| l.strip_prefix("Uid:")?.split_whitespace().next()?.parse().ok());
            (comm.trim_end() == "kubelet" && uid == Some(KUBELET_UID)).then_some(())
        });
        Self { child, _dir: dir }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Kubelet {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `sleep` as found on `PATH` (a standalone binary on every distribution we run on, so it still sleeps when run
/// under another name).
fn sleep_binary() -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/bin:/bin".into());
    std::env::split_paths(&path)
        .map(|dir| dir.join("sleep"))
        .find(|candidate| candidate.is_file())
        .expect("sleep on PATH")
}

/// Every process other than a stand-in (one running as [`KUBELET_UID`]) the node agent would take for the kubelet:
/// named `kubelet`, `kubelite` or `k3s`, as `redirect::hostprobe::find_kubelet_uid` looks for them. On a machine that
/// also runs a real node (`scripts/cluster.sh up`, whose kubelet runs as root in its own PID namespace but shows in
/// the host's `/proc` with a lower pid than any stand-in), the agent would find that one first and SNAT root's
/// sockets instead of the test kubelet's.
pub fn foreign_kubelets() -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            if !matches!(comm.trim_end(), "kubelet" | "kubelite" | "k3s") {
                return false;
            }
            let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
            let uid = status.lines().find_map(|l| l.strip_prefix("Uid:")?.split_whitespace().next()?.parse().ok());
            uid.is_some_and(|uid: u32| uid != KUBELET_UID)
        })
        .collect()
}

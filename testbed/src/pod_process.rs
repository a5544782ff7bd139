//! "A pod's container is running": a real process inside the pod netns, in a cgroup v2 directory named the way
//! the kubelet names it (`kubepods/besteffort/pod<uid>/<container id>`). That is all the node agent's `/proc`
//! scan needs to find a pod that did not come through the CNI path, or to find every enrolled pod again after
//! it restarts.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};

use netns::Netns;

use crate::wait::eventually;
use crate::NetnsGuard;

static COUNTER: AtomicUsize = AtomicUsize::new(0);

/// The cgroup v2 mount point (found through `/proc/self/mountinfo`; `/sys/fs/cgroup/unified` on hybrid hosts).
pub fn cgroup2_root() -> PathBuf {
    let mounts = fs::read_to_string("/proc/self/mountinfo").expect("read /proc/self/mountinfo");
    mounts
        .lines()
        .find_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let mount_point = left.split(' ').nth(4)?;
            (right.split(' ').next() == Some("cgroup2")).then(|| PathBuf::from(mount_point))
        })
        .expect("a cgroup2 mount")
}

/// A `sleep` in the pod netns, moved into `<cgroup2>/podproc-<pid>-<n>/kubepods/besteffort/pod<uid>/<ctr>`.
/// On drop it is moved back to the root cgroup, killed and reaped, and its cgroup dirs are removed (also when
/// the test panics).
#[derive(Debug)]
pub struct PodProcess {
    child: Child,
    root: PathBuf,
    top: PathBuf,
}

impl PodProcess {
    /// Starts the pod's "container" in `netns` for pod `uid`; returns once `/proc` shows it in both.
    #[track_caller]
    pub fn start(netns: &NetnsGuard, uid: &str) -> Self {
        let ns = netns.open().expect("open pod netns");
        let want = ns.id();
        let mut cmd = Command::new("sleep");
        cmd.arg("600").stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
        // A child forked from a thread inside the netns starts in that netns.
        let child = ns.run(|| cmd.spawn()).expect("enter pod netns").expect("spawn pod process");
        let root = cgroup2_root();
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let top = root.join(format!("podproc-{}-{n}", std::process::id()));
        let process = Self { child, root, top };
        let pid = process.pid();
        let ctr = format!("{:064x}", (u128::from(pid) << 32) | n as u128);
        let dir = process.top.join(format!("kubepods/besteffort/pod{uid}/{ctr}"));
        fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("create cgroup {}: {e}", dir.display()));
        fs::write(dir.join("cgroup.procs"), pid.to_string()).expect("move the pod process into its cgroup");
        eventually("the pod process shows in its netns and cgroup", || {
            let cgroup = fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
            let inside = Netns::open(format!("/proc/{pid}/ns/net")).ok()?.id() == want;
            (inside && cgroup.contains(&format!("pod{uid}"))).then_some(())
        });
        process
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for PodProcess {
    fn drop(&mut self) {
        // Out of the tree first, so the dirs are empty and can go at once.
        let _ = fs::write(self.root.join("cgroup.procs"), self.pid().to_string());
        let _ = self.child.kill();
        let _ = self.child.wait();
        remove_tree(&self.top);
    }
}

/// Removes a cgroup tree bottom-up (cgroup dirs are removed with rmdir, never with their control files).
fn remove_tree(dir: &Path) {
    for entry in fs::read_dir(dir).into_iter().flatten().flatten() {
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            remove_tree(&entry.path());
        }
    }
    if let Err(e) = fs::remove_dir(dir) {
        eprintln!("remove cgroup {}: {e}", dir.display());
    }
}

//! `find_pod_netns` against real processes in real netns and real cgroup v2 directories named the way the
//! kubelet names them. Needs root.

use std::fs;
use std::net::IpAddr;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use netns::discover::find_pod_netns;
use netns::Netns;

static COUNTER: AtomicU32 = AtomicU32::new(0);

fn unique() -> u32 {
    COUNTER.fetch_add(1, Ordering::Relaxed)
}

fn run(cmd: &[&str]) {
    let status = Command::new(cmd[0]).args(&cmd[1..]).status().expect("spawn");
    assert!(status.success(), "{cmd:?}: {status}");
}

/// A named netns holding `ip` on its loopback (this kernel has no dummy module); deleted on drop.
struct TestNetns {
    name: String,
    ip: IpAddr,
}

impl TestNetns {
    fn with_ip(ip: &str) -> Self {
        let name = format!("disc-{}-{}", std::process::id(), unique());
        run(&["ip", "netns", "add", &name]);
        let ns = Self { name, ip: ip.parse().unwrap() };
        let exec = |args: &[&str]| run(&[&["ip", "netns", "exec", &ns.name, "ip"], args].concat());
        exec(&["addr", "add", &format!("{ip}/32"), "dev", "lo"]);
        exec(&["link", "set", "lo", "up"]);
        ns
    }

    fn path(&self) -> PathBuf {
        Path::new("/run/netns").join(&self.name)
    }

    fn id(&self) -> (u64, u64) {
        Netns::open(self.path()).unwrap().id()
    }
}

impl Drop for TestNetns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.name]).status();
    }
}

fn cgroup2_root() -> PathBuf {
    let mounts = fs::read_to_string("/proc/self/mountinfo").unwrap();
    mounts
        .lines()
        .find_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            (right.split(' ').next() == Some("cgroup2")).then(|| PathBuf::from(left.split(' ').nth(4).unwrap()))
        })
        .expect("a cgroup2 mount")
}

/// A cgroup tree `<cgroup2>/disc-<pid>-<n>/<kubelet path>`; its processes are moved out and the tree
/// removed on drop. The unique top keeps parallel tests from sharing (and racing on) parent dirs.
struct PodCgroup {
    root: PathBuf,
    top: PathBuf,
}

impl PodCgroup {
    fn new() -> Self {
        let root = cgroup2_root();
        let top = root.join(format!("disc-{}-{}", std::process::id(), unique()));
        fs::create_dir(&top).expect("create a cgroup v2 dir");
        Self { root, top }
    }

    /// Moves `pid` into the container cgroup at `rel` (created as needed).
    fn add(&self, rel: &str, pid: u32) {
        let dir = self.top.join(rel);
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("cgroup.procs"), pid.to_string()).unwrap();
        let own = fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
        assert!(own.contains(rel), "{pid} not moved into {rel}: {own}");
    }
}

impl Drop for PodCgroup {
    fn drop(&mut self) {
        fn remove(dir: &Path, root: &Path) {
            for entry in fs::read_dir(dir).into_iter().flatten().flatten() {
                if entry.file_type().is_ok_and(|t| t.is_dir()) {
                    remove(&entry.path(), root);
                }
            }
            for pid in fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default().lines() {
                let _ = fs::write(root.join("cgroup.procs"), pid);
            }
            let _ = fs::remove_dir(dir);
        }
        remove(&self.top, &self.root);
    }
}

/// A `sleep` process, killed and reaped on drop.
struct Sleeper(Child);

impl Sleeper {
    /// Starts it in `ns` (or the test's own netns) and waits until it is really there.
    fn start(ns: Option<&TestNetns>) -> Self {
        let mut cmd = match ns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", &ns.name, "sleep", "600"]);
                c
            }
            None => {
                let mut c = Command::new("sleep");
                c.arg("600");
                c
            }
        };
        let sleeper = Self(cmd.stdin(Stdio::null()).spawn().unwrap());
        let want = ns.map_or_else(|| Netns::current().unwrap().id(), TestNetns::id);
        testbed::wait::eventually("the sleeper enters its netns", || {
            (Netns::open(format!("/proc/{}/ns/net", sleeper.pid())).map(|n| n.id()).ok() == Some(want)).then_some(())
        });
        sleeper
    }

    fn pid(&self) -> u32 {
        self.0.id()
    }

    fn start_time(&self) -> u64 {
        let stat = fs::read_to_string(format!("/proc/{}/stat", self.pid())).unwrap();
        stat[stat.rfind(')').unwrap() + 1..].split_whitespace().nth(19).unwrap().parse().unwrap()
    }
}

impl Drop for Sleeper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn pod_uid() -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
    format!("{:08x}-{:04x}-4d1c-9e2f-{:012x}", nanos, unique(), std::process::id())
}

fn systemd_containerd(uid: &str, ctr: &str) -> String {
    let uid = uid.replace('-', "_");
    format!("kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{uid}.slice/cri-containerd-{ctr}.scope")
}

fn cgroupfs_crio(uid: &str, ctr: &str) -> String {
    format!("kubepods/burstable/pod{uid}/crio-{ctr}")
}

fn found(uid: &str, ips: &[IpAddr]) -> Option<(u64, u64)> {
    find_pod_netns(Path::new("/proc"), uid, ips).expect("scan /proc").map(|ns| ns.id())
}

#[test]
fn systemd_containerd_pod_is_found_only_by_its_uid_and_ip() {
    let ns = TestNetns::with_ip("10.250.1.2");
    let cgroup = PodCgroup::new();
    let uid = pod_uid();
    let sleeper = Sleeper::start(Some(&ns));
    cgroup.add(&systemd_containerd(&uid, "a1b2c3"), sleeper.pid());

    assert_eq!(found(&uid, &[ns.ip]), Some(ns.id()));
    assert_eq!(found(&uid, &["10.250.1.3".parse().unwrap()]), None, "wrong IP");
    assert_eq!(found(&pod_uid(), &[ns.ip]), None, "unknown uid");
}

#[test]
fn cgroupfs_crio_pod_is_found() {
    let ns = TestNetns::with_ip("10.250.2.2");
    let cgroup = PodCgroup::new();
    let uid = pod_uid();
    let sleeper = Sleeper::start(Some(&ns));
    cgroup.add(&cgroupfs_crio(&uid, "d4e5f6"), sleeper.pid());

    let v6: IpAddr = "fd00::2".parse().unwrap();
    assert_eq!(found(&uid, &[v6, ns.ip]), Some(ns.id()));
}

#[test]
fn oldest_matching_process_wins() {
    let older_ns = TestNetns::with_ip("10.250.3.2");
    let younger_ns = TestNetns::with_ip("10.250.3.2");
    let cgroup = PodCgroup::new();
    let uid = pod_uid();
    let older = Sleeper::start(Some(&older_ns));
    // Start times have clock-tick resolution: make sure the second one is strictly younger.
    let deadline = Instant::now() + Duration::from_secs(10);
    let younger = loop {
        let s = Sleeper::start(Some(&younger_ns));
        if s.start_time() > older.start_time() {
            break s;
        }
        assert!(Instant::now() < deadline, "start time never advanced");
    };
    cgroup.add(&systemd_containerd(&uid, "young"), younger.pid());
    cgroup.add(&systemd_containerd(&uid, "old"), older.pid());

    assert_eq!(found(&uid, &[older_ns.ip]), Some(older_ns.id()));
}

#[test]
fn host_network_pod_is_skipped() {
    let host_ip = nix::ifaddrs::getifaddrs()
        .unwrap()
        .find_map(|ifa| ifa.address?.as_sockaddr_in().map(|a| IpAddr::V4(a.ip())))
        .expect("the test's netns has an IPv4 address");
    let cgroup = PodCgroup::new();
    let uid = pod_uid();
    let sleeper = Sleeper::start(None);
    cgroup.add(&cgroupfs_crio(&uid, "hostnet"), sleeper.pid());

    assert_eq!(found(&uid, &[host_ip]), None);
}

/// Real processes get increasing pids and start times together, so only a fake proc tree can show that the
/// order is by start time and not by pid.
#[test]
fn start_time_not_pid_decides_in_a_fake_proc_tree() {
    let older_ns = TestNetns::with_ip("10.250.4.2");
    let younger_ns = TestNetns::with_ip("10.250.4.2");
    let uid = pod_uid();
    let proc_dir = tempfile::tempdir().unwrap();
    let fake = |pid: u32, start_time: u64, ns: &TestNetns| {
        let dir = proc_dir.path().join(pid.to_string());
        fs::create_dir_all(dir.join("ns")).unwrap();
        fs::write(dir.join("cgroup"), format!("0::/{}\n", cgroupfs_crio(&uid, &pid.to_string()))).unwrap();
        let mut fields = vec!["0"; 50];
        let start = start_time.to_string();
        fields[19] = &start;
        fs::write(dir.join("stat"), format!("{pid} (pause) S {}\n", fields[1..].join(" "))).unwrap();
        symlink(ns.path(), dir.join("ns/net")).unwrap();
    };
    fake(100, 9000, &younger_ns);
    fake(200, 8000, &older_ns);

    let ns = find_pod_netns(proc_dir.path(), &uid, &[older_ns.ip]).unwrap().expect("a netns");
    assert_eq!(ns.id(), older_ns.id());
}

#[test]
fn one_scan_finds_every_asked_pod_and_only_those() {
    let (ns_a, ns_b) = (TestNetns::with_ip("10.250.5.2"), TestNetns::with_ip("10.250.5.3"));
    let cgroup = PodCgroup::new();
    let (uid_a, uid_b, absent) = (pod_uid(), pod_uid(), pod_uid());
    let (a, b) = (Sleeper::start(Some(&ns_a)), Sleeper::start(Some(&ns_b)));
    cgroup.add(&systemd_containerd(&uid_a, "aa"), a.pid());
    cgroup.add(&cgroupfs_crio(&uid_b, "bb"), b.pid());

    let (ips_a, ips_b) = ([ns_a.ip], [ns_b.ip]);
    let asked: [(&str, &[IpAddr]); 3] = [(&uid_a, &ips_a), (&uid_b, &ips_b), (&absent, &ips_a)];
    let found = netns::discover::find_pods_netns(Path::new("/proc"), &asked).expect("scan /proc");
    assert_eq!(found.len(), 2, "only the two running pods: {:?}", found.keys().collect::<Vec<_>>());
    assert_eq!(found[&uid_a].id(), ns_a.id());
    assert_eq!(found[&uid_b].id(), ns_b.id());
}

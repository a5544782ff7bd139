//! Finding the network namespace of a pod that is already running, by scanning `/proc`.
//!
//! Pods enrolled after they started (a namespace gets labelled, the node agent restarts) have no CNI event
//! carrying a netns path. Their processes are found through the pod UID that the kubelet puts in every
//! container's cgroup path; the netns is then accepted only if it holds one of the pod's IPs, so a stale or
//! unrelated process cannot hand us the wrong namespace.

use std::collections::HashMap;
use std::fs;
use std::io;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use crate::{Netns, NetnsError};

/// Errors that make a `/proc` scan impossible. Per-process failures (exits mid-scan, permissions) are not
/// errors: such processes are skipped.
#[derive(Debug, thiserror::Error)]
pub enum DiscoverError {
    /// The proc directory itself could not be listed.
    #[error("list {path}: {source}")]
    ListProc {
        /// The proc directory.
        path: PathBuf,
        /// Underlying I/O error.
        source: io::Error,
    },
    /// The caller's own netns could not be opened, so host-network processes could not be told apart.
    #[error("open own netns to skip host-network processes: {0}")]
    OwnNetns(#[source] NetnsError),
}

/// Finds the netns of the pod `pod_uid` among the processes under `proc_dir` (normally `/proc`).
///
/// A process belongs to the pod when a component of its cgroup path names the pod UID in the cgroupfs
/// (`pod<uid>`) or systemd (`kubepods-…-pod<uid_with_underscores>.slice`) form; container runtimes
/// (containerd, CRI-O) only add components below it. Its netns counts only if it holds one of `pod_ips`
/// and is not the host's (host-network pods have no netns of their own). When several processes qualify,
/// the oldest wins: it is the sandbox, whose netns every container joins. Returns `Ok(None)` when nothing
/// qualifies, including when `pod_ips` is empty.
///
/// This blocks (it reads every process's files and enters candidate namespaces); call it off async threads.
pub fn find_pod_netns(proc_dir: &Path, pod_uid: &str, pod_ips: &[IpAddr]) -> Result<Option<Netns>, DiscoverError> {
    let mut found = find_pods_netns(proc_dir, &[(pod_uid, pod_ips)])?;
    Ok(found.remove(pod_uid))
}

/// [`find_pod_netns`] for many pods in one pass over `proc_dir`: every process's cgroup file is read once,
/// however many pods are asked for (a node agent restarting on a node with hundreds of pods would otherwise
/// read every process once per pod). Pods without a qualifying netns are absent from the map.
pub fn find_pods_netns(proc_dir: &Path, pods: &[(&str, &[IpAddr])]) -> Result<HashMap<String, Netns>, DiscoverError> {
    let wanted: HashMap<String, (&str, &[IpAddr])> = pods
        .iter()
        .filter(|(uid, ips)| !uid.is_empty() && !ips.is_empty())
        .map(|(uid, ips)| (uid.replace('_', "-"), (*uid, *ips)))
        .collect();
    let mut out = HashMap::new();
    if wanted.is_empty() {
        return Ok(out);
    }
    let mut host_ids = vec![Netns::current().map_err(DiscoverError::OwnNetns)?.id()];
    if let Ok(init) = Netns::open(proc_dir.join("1/ns/net")) {
        host_ids.push(init.id());
    }

    for (uid, mut candidates) in pod_processes(proc_dir, &wanted)? {
        let ips = wanted[&uid.replace('_', "-")].1;
        candidates.sort_unstable();
        // Containers of one pod share the sandbox netns: check each namespace's addresses once.
        let mut checked: HashMap<(u64, u64), bool> = HashMap::new();
        for (start_time, pid) in candidates {
            let pid_dir = proc_dir.join(pid.to_string());
            let Ok(ns) = Netns::open(pid_dir.join("ns/net")) else { continue };
            // The pid may have been reused between reading its stat and opening its netns.
            if start_time_of(&pid_dir) != Some(start_time) || host_ids.contains(&ns.id()) {
                continue;
            }
            if *checked.entry(ns.id()).or_insert_with(|| holds_any(&ns, ips)) {
                out.insert(uid.to_owned(), ns);
                break;
            }
        }
    }
    Ok(out)
}

/// `(start_time, pid)` of the processes of one pod.
type Processes = Vec<(u64, u32)>;

/// `(start_time, pid)` of every process whose cgroup names one of the `wanted` pods (keyed by dashed UID), by
/// the pod's UID as the caller spelled it.
fn pod_processes<'a>(
    proc_dir: &Path,
    wanted: &HashMap<String, (&'a str, &[IpAddr])>,
) -> Result<HashMap<&'a str, Processes>, DiscoverError> {
    let entries =
        fs::read_dir(proc_dir).map_err(|source| DiscoverError::ListProc { path: proc_dir.to_path_buf(), source })?;
    let mut found: HashMap<&str, Processes> = HashMap::new();
    for entry in entries.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
        let pid_dir = entry.path();
        let Ok(cgroups) = fs::read_to_string(pid_dir.join("cgroup")) else { continue };
        let named = pod_uids_named(&cgroups).filter_map(|candidate| wanted.get(&candidate).map(|(uid, _)| *uid));
        let Some(uid) = named.into_iter().find(|uid| cgroup_names_pod(&cgroups, uid)) else { continue };
        if let Some(start_time) = start_time_of(&pid_dir) {
            found.entry(uid).or_default().push((start_time, pid));
        }
    }
    Ok(found)
}

/// Every pod UID (dashed) a cgroup file's paths might name: the text after `pod` in a component that starts
/// with it, or after the last `-pod` of a `.slice` component. A cheap pre-filter; [`cgroup_names_pod`] decides.
fn pod_uids_named(cgroups: &str) -> impl Iterator<Item = String> + '_ {
    cgroups.lines().filter_map(|line| line.splitn(3, ':').nth(2)).flat_map(|path| path.split('/')).filter_map(
        |component| {
            let component = component.split(':').next().unwrap_or(component);
            let uid = match component.strip_suffix(".slice") {
                Some(slice) => slice.strip_prefix("pod").or_else(|| slice.rsplit_once("-pod").map(|(_, u)| u))?,
                None => component.strip_prefix("pod")?,
            };
            Some(uid.replace('_', "-"))
        },
    )
}

/// Whether any line of a `/proc/<pid>/cgroup` file (`id:controllers:path`) has a path component naming the pod.
fn cgroup_names_pod(cgroups: &str, pod_uid: &str) -> bool {
    let dashed = format!("pod{pod_uid}");
    let underscored = format!("pod{}", pod_uid.replace('-', "_"));
    let names_pod = |component: &str| {
        // Nested runtimes sometimes show the systemd cgroupsPath form `slice:prefix:name`.
        let component = component.split(':').next().unwrap_or(component);
        [&dashed, &underscored].iter().any(|pod| {
            component == pod.as_str()
                || component.strip_suffix(".slice").is_some_and(|slice| {
                    slice.strip_suffix(pod.as_str()).is_some_and(|parent| parent.is_empty() || parent.ends_with('-'))
                })
        })
    };
    cgroups.lines().filter_map(|line| line.splitn(3, ':').nth(2)).any(|path| path.split('/').any(names_pod))
}

/// Field 22 of `/proc/<pid>/stat`: start time in clock ticks since boot.
fn start_time_of(pid_dir: &Path) -> Option<u64> {
    let stat = fs::read_to_string(pid_dir.join("stat")).ok()?;
    // The command name (field 2) is in parentheses and may itself contain spaces and ')'.
    let after_comm = &stat[stat.rfind(')')? + 1..];
    after_comm.split_whitespace().nth(22 - 3)?.parse().ok()
}

/// Whether the namespace has any of `ips` on one of its interfaces. Failing to enter it counts as no.
fn holds_any(ns: &Netns, ips: &[IpAddr]) -> bool {
    // Our own dump rather than getifaddrs(3), whose netlink socket has no receive timeout.
    let addrs = ns.run(crate::netlink::addresses);
    matches!(addrs, Ok(Ok(addrs)) if addrs.iter().any(|a| ips.contains(a)))
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "4f1c9a2e-7b3d-4e8f-9a01-23456789abcd";

    fn v1_and_v2(path: &str) -> String {
        format!("12:memory:{path}\n1:name=systemd:{path}\n0::{path}\n")
    }

    #[test]
    fn runtime_cgroup_forms_name_the_pod() {
        let forms = [
            "/kubepods/burstable/pod4f1c9a2e-7b3d-4e8f-9a01-23456789abcd/0123abcd",
            "/kubepods/pod4f1c9a2e-7b3d-4e8f-9a01-23456789abcd/crio-0123abcd",
            "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod4f1c9a2e_7b3d_4e8f_9a01_23456789abcd.slice/cri-containerd-0123abcd.scope",
            "/kubepods.slice/kubepods-pod4f1c9a2e_7b3d_4e8f_9a01_23456789abcd.slice/crio-0123abcd.scope",
            "/system.slice/containerd.service/kubepods-burstable-pod4f1c9a2e_7b3d_4e8f_9a01_23456789abcd.slice:cri-containerd:0123abcd",
            "/docker/5e6f/kubepods/besteffort/pod4f1c9a2e-7b3d-4e8f-9a01-23456789abcd/0123abcd",
        ];
        for form in forms {
            assert!(cgroup_names_pod(&v1_and_v2(form), UID), "{form}");
        }
    }

    #[test]
    fn other_pods_and_partial_uids_do_not_match() {
        let other = [
            "/kubepods/burstable/pod4f1c9a2e-7b3d-4e8f-9a01-23456789abcd0/0123abcd",
            "/kubepods.slice/kubepods-besteffort-pod4f1c9a2e_7b3d_4e8f_9a01_23456789abc.slice/x.scope",
            "/kubepods.slice/kubepods-besteffort-xpod4f1c9a2e_7b3d_4e8f_9a01_23456789abcd.slice/x.scope",
            "/user.slice/pod4f1c9a2e-7b3d-4e8f-9a01-23456789abcd.service",
            "/",
        ];
        for path in other {
            assert!(!cgroup_names_pod(&v1_and_v2(path), UID), "{path}");
        }
    }

    #[test]
    fn start_time_survives_parentheses_in_the_command_name() {
        let dir = tempfile::tempdir().unwrap();
        let fields: Vec<String> = (4..=52).map(|n| n.to_string()).collect();
        fs::write(dir.path().join("stat"), format!("42 (a) b) (c) S {}\n", fields.join(" "))).unwrap();
        assert_eq!(start_time_of(dir.path()), Some(22));
    }
}

//! The pods this agent has enrolled: what a reconnecting proxy receives as its snapshot, and what removal
//! needs (IPs for the host probe set, the netns to clean).

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};

use zds::messages::WorkloadInfo;
use zds::server::{PodSnapshotEntry, SnapshotSource};

use crate::pod::PodUid;

/// One enrolled pod.
#[derive(Debug, Clone)]
pub struct Enrolled {
    /// Pod UID (the cache key).
    pub uid: PodUid,
    /// Name, namespace and service account, as the proxy needs them.
    pub info: WorkloadInfo,
    /// The pod's IPs (host probe set entries).
    pub ips: Vec<IpAddr>,
    /// The pod's netns; `None` when it could not be found again after a restart.
    pub netns: Option<Arc<OwnedFd>>,
}

/// Shared, cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct PodCache {
    pods: Arc<Mutex<BTreeMap<PodUid, Enrolled>>>,
}

impl PodCache {
    /// Adds or replaces a pod.
    pub fn insert(&self, pod: Enrolled) {
        self.lock().insert(pod.uid.clone(), pod);
    }

    /// Removes a pod, returning what was known about it.
    pub fn remove(&self, uid: &PodUid) -> Option<Enrolled> {
        self.lock().remove(uid)
    }

    /// Looks a pod up.
    pub fn get(&self, uid: &PodUid) -> Option<Enrolled> {
        self.lock().get(uid).cloned()
    }

    /// Every enrolled pod's UID with its name and namespace: what a relist checks against the fresh list.
    pub fn enrolled(&self) -> Vec<(PodUid, WorkloadInfo)> {
        self.lock().values().map(|p| (p.uid.clone(), p.info.clone())).collect()
    }

    /// Every enrolled pod, in UID order: what the host probe self-test picks its pod from.
    pub fn pods(&self) -> Vec<Enrolled> {
        self.lock().values().cloned().collect()
    }

    /// Number of enrolled pods.
    pub fn count(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<PodUid, Enrolled>> {
        self.pods.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl SnapshotSource for PodCache {
    fn snapshot(&self) -> Vec<PodSnapshotEntry> {
        self.lock()
            .values()
            .map(|p| PodSnapshotEntry { uid: p.uid.to_string(), info: p.info.clone(), netns: p.netns.clone() })
            .collect()
    }
}

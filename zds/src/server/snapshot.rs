//! What a newly connected proxy is sent first: the agent's current set of enrolled pods.

use std::os::fd::OwnedFd;
use std::sync::Arc;

use crate::messages::WorkloadInfo;

/// One enrolled pod as the agent's cache knows it, for the snapshot a new proxy connection receives.
#[derive(Clone, Debug)]
pub struct PodSnapshotEntry {
    /// Pod UID.
    pub uid: String,
    /// Pod identity, sent with the Add.
    pub info: WorkloadInfo,
    /// The pod's netns; `None` (not found) sends `KeepWorkload` instead of `AddWorkload`.
    pub netns: Option<Arc<OwnedFd>>,
}

/// Where the server gets the current set of enrolled pods each time a proxy connects.
pub trait SnapshotSource: Send + Sync + 'static {
    /// The pods to send, in the order to send them.
    fn snapshot(&self) -> Vec<PodSnapshotEntry>;
}

impl<F> SnapshotSource for F
where
    F: Fn() -> Vec<PodSnapshotEntry> + Send + Sync + 'static,
{
    fn snapshot(&self) -> Vec<PodSnapshotEntry> {
        self()
    }
}

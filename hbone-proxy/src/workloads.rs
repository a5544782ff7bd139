//! The ZDS client loop: keeps a connection to the node agent, starts and stops pod proxies as it is told,
//! and reconciles after each snapshot. Pod proxies keep running while the agent is away.

use std::collections::{HashMap, HashSet};
use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use daemon::probes::ProbeState;
use netns::Netns;
use zds::messages::workload_request::Payload;
use zds::{ZdsClient, ZdsError};

use crate::mesh::Mesh;
use crate::pod::PodProxy;

/// First reconnect delay; doubled per failure up to [`MAX_BACKOFF`].
const MIN_BACKOFF: Duration = Duration::from_millis(100);
/// Longest reconnect delay.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// The running pod proxies by pod uid, and the ZDS session state around them.
#[derive(Debug)]
pub struct Workloads {
    mesh: Arc<Mesh>,
    probes: ProbeState,
    pods: HashMap<String, PodProxy>,
    /// Uids seen since the connection started, until `SnapshotSent` ends the snapshot.
    snapshot: Option<HashSet<String>>,
}

impl Workloads {
    /// No pods yet; not ready until the first snapshot has been applied.
    pub fn new(mesh: Arc<Mesh>, probes: ProbeState) -> Self {
        probes.set_not_ready("waiting for the node agent's snapshot");
        Workloads { mesh, probes, pods: HashMap::new(), snapshot: None }
    }

    /// Connects to `uds` forever, reconnecting with backoff whenever the agent goes away.
    pub async fn run(mut self, uds: &Path) {
        let mut backoff = MIN_BACKOFF;
        loop {
            match ZdsClient::connect(uds).await {
                Ok(client) => {
                    tracing::info!(socket = %uds.display(), "connected to the node agent");
                    backoff = MIN_BACKOFF;
                    let error = self.session(&client).await;
                    tracing::warn!(%error, running = self.pods.len(), "ZDS connection lost; pod proxies keep running");
                }
                Err(error) => tracing::info!(socket = %uds.display(), %error, ?backoff, "cannot reach the node agent"),
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }

    /// Answers requests until the connection fails.
    async fn session(&mut self, client: &ZdsClient) -> ZdsError {
        self.snapshot = Some(HashSet::new());
        loop {
            let (request, fds) = match client.recv().await {
                Ok(received) => received,
                Err(e) => return e,
            };
            let result = self.apply(request.payload, fds);
            if let Err(error) = &result {
                tracing::warn!(%error, "ZDS request failed");
            }
            if let Err(e) = client.ack(result.err()).await {
                return e;
            }
        }
    }

    fn apply(&mut self, payload: Option<Payload>, mut fds: Vec<OwnedFd>) -> Result<(), String> {
        match payload {
            Some(Payload::Add(add)) => {
                self.seen(&add.uid);
                if fds.len() != 1 {
                    return Err(format!("AddWorkload {} carried {} fds, expected the pod netns", add.uid, fds.len()));
                }
                let netns = Netns::from_fd(fds.remove(0), format!("netns of pod {}", add.uid))
                    .map_err(|e| format!("pod {}: {e}", add.uid))?;
                if self.pods.get(&add.uid).is_some_and(|p| p.netns_id() == netns.id()) {
                    tracing::debug!(uid = add.uid, "pod already running in this netns");
                    return Ok(());
                }
                let proxy = PodProxy::start(&self.mesh, &add.uid, add.workload_info.as_ref(), netns)
                    .map_err(|e| e.to_string())?;
                if self.pods.insert(add.uid.clone(), proxy).is_some() {
                    tracing::info!(uid = add.uid, "pod netns changed: replaced its proxy");
                }
            }
            Some(Payload::Keep(keep)) => self.seen(&keep.uid),
            Some(Payload::Del(del)) => {
                if self.pods.remove(&del.uid).is_some() {
                    tracing::info!(uid = del.uid, "pod proxy stopped");
                }
            }
            Some(Payload::SnapshotSent(_)) => {
                if let Some(seen) = self.snapshot.take() {
                    self.pods.retain(|uid, _| {
                        let keep = seen.contains(uid);
                        if !keep {
                            tracing::info!(uid, "pod absent from the snapshot: proxy stopped");
                        }
                        keep
                    });
                }
                self.probes.set_ready();
            }
            None => return Err("request without payload".to_owned()),
        }
        self.mesh.metrics.active_proxies.set(self.pods.len() as i64);
        Ok(())
    }

    fn seen(&mut self, uid: &str) {
        if let Some(seen) = &mut self.snapshot {
            seen.insert(uid.to_owned());
        }
    }
}

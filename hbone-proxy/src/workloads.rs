//! The ZDS client loop: keeps a connection to the node agent, starts and stops pod proxies as it is told,
//! and reconciles after each snapshot. Pod proxies keep running while the agent is away. A pod whose proxy
//! failed to start is counted as pending and retried every [`RETRY_INTERVAL`]; the proxy is ready once the first
//! snapshot is applied and nothing is pending.
//!
//! A live Add is acked once its pod's proxy listens (or with the error that stopped it): the agent reports the pod
//! enrolled only then. The Adds of a snapshot (pods the agent enrolled before this connection) start concurrently,
//! at most [`SNAPSHOT_STARTS`] at once: each is acked as soon as its start is under way, and `SnapshotSent` is acked
//! once every one of them has finished (running, or pending with its error), so a proxy restart re-adopts a node's
//! pods in a fraction of the time one after the other would take. A Del, a repeated uid or the end of the
//! snapshot waits for the starts under way first, so requests still take effect in the order the agent sent them.

use std::collections::{HashMap, HashSet};
use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use daemon::probes::{Blocker, ProbeState};
use netns::Netns;
use serde_json::{json, Value};
use tokio::task::JoinSet;
use zds::messages::workload_request::Payload;
use zds::messages::WorkloadInfo;
use zds::{ZdsClient, ZdsError};

use crate::mesh::{Certificates, Mesh};
use crate::pod::{PodProxy, StartError};

/// First reconnect delay; doubled per failure up to [`MAX_BACKOFF`].
const MIN_BACKOFF: Duration = Duration::from_millis(100);
/// Longest reconnect delay.
const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// How often pods whose proxy failed to start are tried again.
pub const RETRY_INTERVAL: Duration = Duration::from_secs(5);
/// The most directory workloads `/config_dump` lists (a cluster-wide source can hold many more); the rest are
/// only counted, so the dump stays small whatever the cluster's size.
pub const MAX_DUMPED_WORKLOADS: usize = 1000;
/// How many pod proxies of a snapshot start at once: enough to overlap each start's waits (key generation, the
/// socket threads' binds), few enough that a snapshot of thousands of pods holds a bounded number of half-started
/// pods (descriptors, tasks) at a time.
pub const SNAPSHOT_STARTS: usize = 32;
/// Why the proxy is not ready before it has a snapshot.
const WAITING_FOR_SNAPSHOT: &str = "waiting for the node agent's snapshot";

/// A pod the agent sent whose proxy could not start yet.
#[derive(Debug)]
struct Pending {
    info: Option<WorkloadInfo>,
    netns: Arc<Netns>,
    error: String,
}

/// The running and pending pod proxies by pod uid, and the ZDS session state around them.
#[derive(Debug, Default)]
struct State {
    pods: HashMap<String, PodProxy>,
    pending: HashMap<String, Pending>,
    /// Uids seen since the connection started, until `SnapshotSent` ends the snapshot.
    snapshot: Option<HashSet<String>>,
    /// Whether a snapshot has been applied since the process started.
    synced: bool,
}

/// One pod proxy start of a snapshot, finished: the pod, what it came with, and the proxy or why it did not start.
type Started = (String, Option<WorkloadInfo>, Arc<Netns>, Result<PodProxy, StartError>);

/// The snapshot's pod proxy starts under way, and their uids.
#[derive(Default)]
struct Starting {
    tasks: JoinSet<Started>,
    uids: HashSet<String>,
}

/// The ZDS client and the pod proxies it manages. Dropping it stops every pod proxy.
#[derive(Debug)]
pub struct Workloads {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    mesh: Arc<Mesh>,
    /// Blocks readiness until the first snapshot is applied and while pods are pending.
    ready: Blocker,
    /// Held only to read or change the maps, never while a pod proxy starts (key generation, threads, binds), so
    /// `/config_dump` and readiness never wait on a start.
    state: Mutex<State>,
    /// Serializes what starts and stops pod proxies (a ZDS request, the retry of one pending pod) across the
    /// awaits of a start, so a Del cannot slip between a start and the insert of its result.
    changes: tokio::sync::Mutex<()>,
}

/// A read-only handle for the admin endpoint that does not keep the pods (or the mesh) alive, so shutdown is
/// not held up by it.
#[derive(Debug, Clone)]
pub struct View(Weak<Inner>);

impl View {
    /// What `/config_dump` shows (see [`Workloads::dump`]); `None` once the proxy is shutting down.
    pub fn dump(&self) -> Option<Value> {
        self.0.upgrade().map(|inner| Workloads { inner }.dump())
    }
}

impl Workloads {
    /// No pods yet; registers the `workloads` readiness blocker in `probes`, which blocks until the first
    /// snapshot has been applied.
    pub fn new(mesh: Arc<Mesh>, probes: &ProbeState) -> Self {
        let ready = probes.blocker("workloads", WAITING_FOR_SNAPSHOT);
        let inner = Inner { mesh, ready, state: Mutex::default(), changes: tokio::sync::Mutex::new(()) };
        Workloads { inner: Arc::new(inner) }
    }

    /// A handle for the admin endpoint.
    pub fn view(&self) -> View {
        View(Arc::downgrade(&self.inner))
    }

    /// Connects to `uds` forever, reconnecting with backoff whenever the agent goes away; retries pending pods
    /// every [`RETRY_INTERVAL`] meanwhile.
    pub async fn run(&self, uds: &Path) {
        tokio::join!(self.retry_pending(), self.connect(uds));
    }

    async fn connect(&self, uds: &Path) {
        let mut backoff = MIN_BACKOFF;
        loop {
            match ZdsClient::connect(uds).await {
                Ok(client) => {
                    tracing::info!(socket = %uds.display(), "connected to the node agent");
                    backoff = MIN_BACKOFF;
                    let error = self.session(&client).await;
                    let running = self.lock().pods.len();
                    tracing::warn!(%error, running, "ZDS connection lost; pod proxies keep running");
                }
                Err(error) => tracing::info!(socket = %uds.display(), %error, ?backoff, "cannot reach the node agent"),
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }

    /// What `/config_dump` shows: every running pod (uid, name, namespace, netns, identity, certificate expiry),
    /// every pending one with its last error, and the workload directory (at most [`MAX_DUMPED_WORKLOADS`]
    /// workloads, each with the source that listed it, plus every source's counts).
    pub fn dump(&self) -> Value {
        let directory = self.inner.mesh.directory.listing(MAX_DUMPED_WORKLOADS);
        let mut workloads = serde_json::to_value(&directory.workloads).unwrap_or_default();
        // Listed without a cluster: the proxy's own, as the traffic metrics label them.
        for workload in workloads.as_array_mut().into_iter().flatten() {
            if workload["clusterId"].as_str().is_some_and(str::is_empty) {
                workload["clusterId"] = json!(self.inner.mesh.cluster_id);
            }
        }
        let state = self.lock();
        let mut pods: Vec<Value> = state.pods.iter().map(|(uid, pod)| pod.dump(uid)).collect();
        pods.sort_by(|a, b| a["uid"].as_str().cmp(&b["uid"].as_str()));
        let mut pending: Vec<Value> = state
            .pending
            .iter()
            .map(|(uid, p)| {
                let info = p.info.clone().unwrap_or_default();
                let (dev, ino) = p.netns.id();
                json!({
                    "uid": uid, "name": info.name, "namespace": info.namespace,
                    "netns": { "dev": dev, "ino": ino }, "error": p.error,
                })
            })
            .collect();
        pending.sort_by(|a, b| a["uid"].as_str().cmp(&b["uid"].as_str()));
        let mesh = &self.inner.mesh;
        // As ztunnel's dump: each identity's certificate state (istiod's CA), and the policies held.
        let (control_plane, certificates) = match &mesh.certificates {
            Certificates::Local(_) => ("local", Value::Array(Vec::new())),
            Certificates::Istiod(manager) => ("istiod", serde_json::to_value(manager.snapshot()).unwrap_or_default()),
        };
        let policies: Vec<Value> = mesh
            .policies
            .listing()
            .into_iter()
            .map(|(name, action, dry_run)| json!({ "name": name, "action": format!("{action:?}").to_uppercase(), "dryRun": dry_run }))
            .collect();
        let unenforceable: Vec<Value> =
            mesh.policies.unenforceable().into_iter().map(|(name, why)| json!({ "name": name, "why": why })).collect();
        json!({
            "control_plane": control_plane, "trust_domain": mesh.trust_domain(), "pods": pods, "pending": pending,
            "synced": state.synced, "workloads": workloads, "workload_sources": directory.sources,
            "workloads_omitted": directory.omitted, "certificates": certificates, "policies": policies,
            "policies_unenforceable": unenforceable,
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.inner.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Answers requests until the connection fails; the snapshot's starts under way then still finish.
    async fn session(&self, client: &ZdsClient) -> ZdsError {
        self.lock().snapshot = Some(HashSet::new());
        let mut starting = Starting::default();
        let error = loop {
            let (request, fds) = match client.recv().await {
                Ok(received) => received,
                Err(e) => break e,
            };
            let result = self.apply(request.payload, fds, &mut starting).await;
            if let Err(error) = &result {
                tracing::warn!(%error, "ZDS request failed");
            }
            if let Err(e) = client.ack(result.err()).await {
                break e;
            }
        };
        let _changing = self.inner.changes.lock().await;
        self.finish(&mut starting).await;
        self.publish(&self.lock());
        error
    }

    async fn apply(&self, payload: Option<Payload>, fds: Vec<OwnedFd>, starting: &mut Starting) -> Result<(), String> {
        let _changing = self.inner.changes.lock().await;
        let in_snapshot = self.lock().snapshot.is_some();
        let result = match payload {
            Some(Payload::Add(add)) if in_snapshot => {
                if starting.uids.contains(&add.uid) {
                    self.finish(starting).await;
                }
                self.add(add.uid, add.workload_info, fds, Some(starting)).await
            }
            Some(Payload::Add(add)) => self.add(add.uid, add.workload_info, fds, None).await,
            Some(Payload::Keep(keep)) => {
                self.lock().seen(&keep.uid);
                Ok(())
            }
            Some(Payload::Del(del)) => {
                self.finish(starting).await;
                let (stopped, pending) = {
                    let mut state = self.lock();
                    (state.pods.remove(&del.uid), state.pending.remove(&del.uid))
                };
                if stopped.is_some() {
                    tracing::info!(uid = del.uid, "pod proxy stopped");
                }
                if pending.is_some() {
                    tracing::info!(uid = del.uid, "pending pod deleted: no more retries");
                }
                Ok(())
            }
            Some(Payload::SnapshotSent(_)) => {
                self.finish(starting).await;
                let mut stopped = Vec::new();
                {
                    let mut state = self.lock();
                    if let Some(seen) = state.snapshot.take() {
                        let absent: Vec<String> =
                            state.pods.keys().filter(|uid| !seen.contains(*uid)).cloned().collect();
                        for uid in absent {
                            stopped.extend(state.pods.remove(&uid));
                            tracing::info!(uid, "pod absent from the snapshot: proxy stopped");
                        }
                        state.pending.retain(|uid, _| seen.contains(uid));
                    }
                    state.synced = true;
                }
                // Stopped outside the lock.
                drop(stopped);
                Ok(())
            }
            None => Err("request without payload".to_owned()),
        };
        self.publish(&self.lock());
        result
    }

    /// Starts the proxy of the pod `uid` in the netns it came with, unless it already runs there. With
    /// `starting` (a snapshot's Add), the start is only begun there (after one under way finished, when
    /// [`SNAPSHOT_STARTS`] are), and its outcome recorded by [`Workloads::finish`].
    async fn add(
        &self,
        uid: String,
        info: Option<WorkloadInfo>,
        mut fds: Vec<OwnedFd>,
        starting: Option<&mut Starting>,
    ) -> Result<(), String> {
        self.lock().seen(&uid);
        if fds.len() != 1 {
            return Err(format!("AddWorkload {uid} carried {} fds, expected the pod netns", fds.len()));
        }
        let netns =
            Netns::from_fd(fds.remove(0), format!("netns of pod {uid}")).map_err(|e| format!("pod {uid}: {e}"))?;
        if self.lock().pods.get(&uid).is_some_and(|p| p.netns_id() == netns.id()) {
            tracing::debug!(uid, "pod already running in this netns");
            return Ok(());
        }
        let netns = Arc::new(netns);
        let Some(starting) = starting else {
            return self.start(&uid, info, netns).await;
        };
        while starting.tasks.len() >= SNAPSHOT_STARTS {
            let Some(joined) = starting.tasks.join_next().await else { break };
            self.started(starting, joined);
        }
        // Not retried meanwhile: the outcome of this start decides whether it is still pending.
        self.lock().pending.remove(&uid);
        starting.uids.insert(uid.clone());
        let mesh = self.inner.mesh.clone();
        starting.tasks.spawn(async move {
            let started = PodProxy::start(&mesh, &uid, info.as_ref(), netns.clone()).await;
            (uid, info, netns, started)
        });
        Ok(())
    }

    /// Waits for every start under way in `starting` and records each outcome. The caller holds
    /// [`Inner::changes`].
    async fn finish(&self, starting: &mut Starting) {
        while let Some(joined) = starting.tasks.join_next().await {
            self.started(starting, joined);
        }
    }

    /// Records one finished start of `starting`: a start that panicked panics here too, as it would have inline.
    fn started(&self, starting: &mut Starting, joined: Result<Started, tokio::task::JoinError>) {
        let (uid, info, netns, started) = joined.unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
        starting.uids.remove(&uid);
        // A failure was acked as begun: the pod is pending, and readiness and `/config_dump` say why.
        let _ = self.record(&uid, info, netns, started);
    }

    /// Starts `uid`'s proxy without holding the state lock, then records it as running (replacing a proxy of the
    /// pod in an older netns) or, on failure, as pending (retried later) and returns the error for the ack. The
    /// caller holds [`Inner::changes`].
    async fn start(&self, uid: &str, info: Option<WorkloadInfo>, netns: Arc<Netns>) -> Result<(), String> {
        let started = PodProxy::start(&self.inner.mesh, uid, info.as_ref(), netns.clone()).await;
        self.record(uid, info, netns, started)
    }

    /// Records the outcome of `uid`'s start: running (replacing a proxy of the pod in an older netns), or pending
    /// with the error, which it returns for the ack.
    fn record(
        &self,
        uid: &str,
        info: Option<WorkloadInfo>,
        netns: Arc<Netns>,
        started: Result<PodProxy, StartError>,
    ) -> Result<(), String> {
        let (replaced, result) = {
            let mut state = self.lock();
            match started {
                Ok(proxy) => {
                    state.pending.remove(uid);
                    (state.pods.insert(uid.to_owned(), proxy), Ok(()))
                }
                Err(e) => {
                    let error = e.to_string();
                    tracing::warn!(uid, %error, retry_in = ?RETRY_INTERVAL, "pod proxy failed to start");
                    state.pending.insert(uid.to_owned(), Pending { info, netns, error: error.clone() });
                    (state.pods.remove(uid), Err(error))
                }
            }
        };
        if replaced.is_some() && result.is_ok() {
            tracing::info!(uid, "pod netns changed: replaced its proxy");
        }
        // A replaced proxy stops here, outside the lock.
        drop(replaced);
        result
    }

    /// Every [`RETRY_INTERVAL`], tries to start the pending pods again, one at a time, each between two ZDS
    /// requests.
    async fn retry_pending(&self) {
        let mut tick = tokio::time::interval(RETRY_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            let uids: Vec<String> = self.lock().pending.keys().cloned().collect();
            for uid in uids {
                let _changing = self.inner.changes.lock().await;
                // Deleted, left out of a snapshot or started by a new Add meanwhile: nothing to retry.
                let Some((info, netns)) = self.lock().pending.get(&uid).map(|p| (p.info.clone(), p.netns.clone()))
                else {
                    continue;
                };
                tracing::info!(uid, "retrying the pod proxy start");
                if self.start(&uid, info, netns).await.is_ok() {
                    tracing::info!(uid, "pod proxy started on retry");
                }
                self.publish(&self.lock());
            }
        }
    }

    /// Updates the proxy counts and readiness: ready once synced with nothing pending.
    fn publish(&self, state: &State) {
        let metrics = &self.inner.mesh.metrics;
        metrics.active_proxies.set(state.pods.len() as i64);
        metrics.pending_proxies.set(state.pending.len() as i64);
        if !state.synced {
            self.inner.ready.block(WAITING_FOR_SNAPSHOT);
        } else if !state.pending.is_empty() {
            self.inner.ready.block(format!("{} pod proxies failed to start; retrying", state.pending.len()));
        } else {
            self.inner.ready.clear();
        }
    }
}

impl State {
    fn seen(&mut self, uid: &str) {
        if let Some(seen) = &mut self.snapshot {
            seen.insert(uid.to_owned());
        }
    }
}

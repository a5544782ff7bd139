//! Keeps enrollment in step with the API: the events of this node's shared pod watch ([`crate::node_pods`]) and
//! a watch of all namespaces each re-decide the affected pods. Running pods are found through `/proc` (the CNI
//! path handles new ones): a namespace label change, or the startup, finds the netns of every pod it enrolls in
//! one scan, whatever their number (scans are counted in `nodeagent_proc_scans_total`); the scans run on
//! blocking threads. A deleted pod is marked deleted at once, so an enrollment of it in flight (from the plugin)
//! rolls back, and is removed in a task of its own, which waits for that enrollment to end without holding up
//! the watch (see [`crate::enroll`]).
//!
//! **Terminating pods, as Istio's agent handles them.** A pod being deleted gracefully (`deletionTimestamp` set,
//! its grace period or finalizers still running) is still running and shutting down: it stays enrolled, rules,
//! proxy and probe entry, so its in-flight and shutdown traffic stays in the mesh. It leaves when the API server
//! deletes it (the DELETED event after the grace period, or once its last finalizer is gone), when it reaches a
//! terminal phase (`Succeeded`/`Failed`: its containers are gone), or when it is no longer wanted (its namespace
//! or labels opt it out). A pod that is already terminating is never newly enrolled (through `/proc`).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::IpAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::runtime::reflector::{store::Writer, Store};
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt as _;
use kube::{Api, Client};

use crate::config::Config;
use istio_contract::names::{AMBIENT_REDIRECTION, AMBIENT_REDIRECTION_ENABLED};

use crate::enroll::Enroller;
use crate::metrics::{EventType, Metrics};
use crate::node_pods::{PodEvent, PodEvents};
use crate::pod::{ips as pod_ips, is_terminal as terminal, is_terminating as terminating, PodUid};
use crate::timeline::{Clock, Timed};
use istio_contract::enablement::{should_enroll, PodFacts, Selectors};

/// Longest pause before a failed pod is retried.
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// Why a running pod could not be enrolled: no process of it (by UID in its cgroup) in a netns holding its IPs.
fn not_found(proc_dir: &Path) -> String {
    format!(
        "netns not found through {}: no process there has the pod's UID in its cgroup and a netns holding one of \
         its IPs",
        proc_dir.display()
    )
}

/// What a `/proc` search found for one pod, or why it found nothing, and when it ran: the pod's enrollment record
/// shows it as its `netns` step.
struct Searched {
    netns: Result<netns::Netns, String>,
    step: Timed,
}

/// One `/proc` scan for one or more pods: the netns it found by pod UID, when it ran, and why a pod it did not
/// find is missing (not there, or the scan's own error).
struct Scan {
    found: HashMap<String, netns::Netns>,
    step: Timed,
    missing: String,
}

impl Scan {
    /// What the scan says of pod `id` (its netns is taken out).
    fn take(&mut self, id: &PodUid) -> Searched {
        Searched { netns: self.found.remove(id.as_str()).ok_or_else(|| self.missing.clone()), step: self.step }
    }
}

enum Change {
    Pod(PodEvent),
    Namespace(Box<watcher::Event<Namespace>>),
    Retry(PodUid),
}

/// What enrollment follows.
pub struct Sources {
    /// This node's pod events, from the shared watch (see [`crate::node_pods::NodePods`]).
    pub pods: PodEvents,
    /// The client the namespaces are watched through, here.
    pub client: Client,
    /// Where the namespace watch keeps every namespace: the plugin's pod lookups read it.
    pub namespace_store: Writer<Namespace>,
}

/// Reconciles until the streams end; `synced` fires once both caches are complete and the pods that were
/// enrolled before a restart are back in the cache.
pub async fn run(
    Sources { pods, client, namespace_store }: Sources,
    config: Config,
    selectors: Selectors,
    enroller: Arc<Enroller>,
    metrics: Metrics,
    synced: tokio::sync::oneshot::Sender<()>,
) {
    let store = pods.store();
    let pods = pods.into_stream().map(|e| Ok(Change::Pod(e)));
    // Without a backoff a failing watch is retried at once, in a loop: an API outage would pin a core and
    // flood the log and the API server. kube's default: 0.8 s doubling to 30 s, reset by the next event.
    let namespaces = watcher::watcher(Api::<Namespace>::all(client), watcher::Config::default())
        .default_backoff()
        .reflect(namespace_store)
        .map(|e| e.map(|e| Change::Namespace(Box::new(e))));
    let (retry_tx, retry_rx) = tokio::sync::mpsc::unbounded_channel::<PodUid>();
    let retries = tokio_stream_from(retry_rx).map(|uid| Ok(Change::Retry(uid)));
    let mut changes = std::pin::pin!(futures::stream::select(futures::stream::select(pods, namespaces), retries));

    let mut state = State {
        config,
        selectors,
        enroller,
        metrics,
        pods: store,
        namespaces: HashMap::new(),
        backoff: HashMap::new(),
        retry_tx,
        relist: None,
    };
    let mut synced = Some(synced);
    let (mut pods_synced, mut ns_synced) = (false, false);
    while let Some(change) = changes.next().await {
        let change = match change {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "namespace watch error (the watcher retries)");
                continue;
            }
        };
        match change {
            Change::Pod(event) => match &*event {
                Event::InitDone => {
                    pods_synced = true;
                    state.relist_done();
                }
                Event::Init => state.relist_started(synced.is_none()),
                Event::InitApply(p) => {
                    state.relisted(p);
                    state.pod_changed(p, synced.is_none()).await
                }
                Event::Apply(p) => state.pod_changed(p, synced.is_none()).await,
                Event::Delete(p) => state.pod_deleted(p),
            },
            Change::Namespace(event) => match *event {
                Event::InitDone => ns_synced = true,
                Event::Init => {}
                Event::Apply(ns) | Event::InitApply(ns) => state.namespace_changed(ns, synced.is_none()).await,
                Event::Delete(ns) => {
                    state.namespaces.remove(ns.metadata.name.as_deref().unwrap_or_default());
                }
            },
            Change::Retry(uid) => state.retry(&uid).await,
        }
        if pods_synced && ns_synced {
            if let Some(tx) = synced.take() {
                state.startup().await;
                let _ = tx.send(());
            }
        }
    }
}

fn tokio_stream_from<T: Send + 'static>(
    mut rx: tokio::sync::mpsc::UnboundedReceiver<T>,
) -> impl futures::Stream<Item = T> {
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

struct State {
    config: Config,
    selectors: Selectors,
    enroller: Arc<Enroller>,
    metrics: Metrics,
    /// This node's pods, shared with the watch (lookups only).
    pods: Store<Pod>,
    namespaces: HashMap<String, BTreeMap<String, String>>,
    backoff: HashMap<PodUid, Duration>,
    retry_tx: tokio::sync::mpsc::UnboundedSender<PodUid>,
    /// The UIDs a relist of the live watch has listed so far (after a 410 or a dropped watch); `None` outside one.
    relist: Option<HashSet<PodUid>>,
}

impl State {
    fn count(&self, kind: &str) {
        self.metrics.reconcile_events.get_or_create(&EventType { r#type: kind.into() }).inc();
    }

    /// Whether `pod` belongs in the mesh: ambient on, not finished, and selected. A terminating pod still does
    /// (it keeps its enrollment until it is gone); only a new enrollment of it is refused, in
    /// [`State::reconcile_with`].
    fn wanted(&self, pod: &Pod) -> bool {
        let empty = BTreeMap::new();
        let facts = PodFacts::of(pod, &empty);
        let ns = facts.namespace;
        self.config.ambient_enabled
            && !terminal(pod)
            && should_enroll(
                &self.selectors,
                &facts,
                self.namespaces.get(ns).unwrap_or(&empty),
                &self.config.excluded(),
            )
    }

    /// A pod added or changed: reconciled with the event's own version (during a relist the store still holds the
    /// previous list until it completes).
    async fn pod_changed(&mut self, pod: &Pod, live: bool) {
        self.count("update");
        if live {
            self.reconcile(pod).await;
        }
    }

    /// A pod deleted: marked first (an enrollment of it in flight rolls back, later ones are refused), then
    /// counted, then removed in a task that waits for such an enrollment to end, while the watch goes on.
    fn pod_deleted(&mut self, pod: &Pod) {
        self.enroller.mark_deleted(pod);
        self.count("delete");
        self.backoff.remove(&PodUid::of(pod));
        let (enroller, pod) = (self.enroller.clone(), pod.clone());
        tokio::spawn(async move {
            if let Err(e) = enroller.remove(&pod, true).await {
                tracing::warn!(pod = %PodUid::of(&pod), error = %e, "removing deleted pod");
            }
        });
    }

    /// The watch starts listing again. The first list is the startup's; a later one (the watch expired with 410,
    /// or broke and resumed too late) delivers no Delete for the pods deleted while it was down, so the listed
    /// UIDs are collected and compared with the enrolled ones when the list is complete.
    fn relist_started(&mut self, live: bool) {
        self.relist = live.then(HashSet::new);
    }

    /// A pod of the relist.
    fn relisted(&mut self, pod: &Pod) {
        if let Some(seen) = self.relist.as_mut() {
            seen.insert(PodUid::of(pod));
        }
    }

    /// The relist is complete: every enrolled pod it did not list is checked with the API and, when gone (or
    /// replaced by a pod of another UID), removed as a deleted pod. The check is a consistent read, so a pod
    /// enrolled while the list (possibly served from a cache) was being taken is not mistaken for a deleted one.
    fn relist_done(&mut self) {
        let Some(seen) = self.relist.take() else { return };
        let enrolled = self.enroller.state().cache().enrolled();
        // A pod never enrolled (its enrollment failed) leaves only its record; it goes with the pod.
        let kept: HashSet<&str> =
            seen.iter().map(PodUid::as_str).chain(enrolled.iter().map(|(id, _)| id.as_str())).collect();
        self.enroller.state().timelines().retain_ended(|id| kept.contains(id));
        for (id, info) in enrolled {
            if seen.contains(&id) {
                continue;
            }
            let (enroller, metrics) = (self.enroller.clone(), self.metrics.clone());
            tokio::spawn(async move {
                match enroller.still_exists(&info.namespace, &info.name, &id).await {
                    Ok(true) => {}
                    Ok(false) => {
                        tracing::info!(pod = %format!("{}/{}", info.namespace, info.name), uid = %id,
                            "enrolled pod missing from the relist and gone from the API: removing it");
                        metrics.reconcile_events.get_or_create(&EventType { r#type: "delete".into() }).inc();
                        let pod = Pod {
                            metadata: kube::api::ObjectMeta {
                                name: Some(info.name.clone()),
                                namespace: Some(info.namespace.clone()),
                                uid: Some(id.to_string()),
                                ..Default::default()
                            },
                            ..Default::default()
                        };
                        enroller.mark_deleted(&pod);
                        if let Err(e) = enroller.remove(&pod, true).await {
                            tracing::warn!(uid = %id, error = %e, "removing a pod deleted during a relist");
                        }
                    }
                    Err(e) => tracing::warn!(uid = %id, error = %e,
                        "checking an enrolled pod missing from the relist (kept; the next relist checks again)"),
                }
            });
        }
    }

    async fn namespace_changed(&mut self, ns: Namespace, live: bool) {
        self.count("namespace");
        let name = ns.metadata.name.clone().unwrap_or_default();
        let labels = ns.metadata.labels.unwrap_or_default();
        let changed = self.namespaces.insert(name.clone(), labels.clone()).is_none_or(|old| old != labels);
        if live && changed {
            let affected = self.pods.state_filter(|p| p.metadata.namespace.as_deref() == Some(name.as_str()));
            self.reconcile_all(affected).await;
        }
    }

    /// Whether reconciling `pod` would enroll it through `/proc`: wanted, not terminating, not enrolled, with IPs
    /// to match.
    fn needs_netns(&self, pod: &Pod) -> bool {
        self.wanted(pod)
            && !terminating(pod)
            && self.enroller.state().cache().get(&PodUid::of(pod)).is_none()
            && !pod_ips(pod).is_empty()
    }

    /// Reconciles every pod of `pods`, finding the netns of those it enrolls in one `/proc` scan.
    async fn reconcile_all(&mut self, pods: Vec<Arc<Pod>>) {
        let to_enroll: Vec<Arc<Pod>> = pods.iter().filter(|p| self.needs_netns(p)).cloned().collect();
        let mut scan = self.find_all_netns(&to_enroll).await;
        for pod in pods {
            let id = PodUid::of(&pod);
            let scanned = to_enroll.iter().any(|p| PodUid::of(p) == id).then(|| scan.take(&id));
            self.reconcile_with(&pod, scanned).await;
        }
    }

    /// A failed pod's turn again, if it is still on this node.
    async fn retry(&mut self, id: &PodUid) {
        if let Some(pod) = self.pods.find(|p| PodUid::of(p) == *id) {
            self.reconcile(&pod).await;
        }
    }

    /// Enrolls or removes one pod so that the cache matches the decision; a terminating pod keeps what it has.
    async fn reconcile(&mut self, pod: &Pod) {
        self.reconcile_with(pod, None).await;
    }

    /// [`State::reconcile`], with what a scan for several pods found of the pod's netns when it already looked.
    async fn reconcile_with(&mut self, pod: &Pod, scanned: Option<Searched>) {
        let id = PodUid::of(pod);
        let enrolled = self.enroller.state().cache().get(&id).is_some();
        let result = match (self.wanted(pod), enrolled) {
            // Shutting down: an enrolled pod stays so until it is gone, and a pod not enrolled is left out.
            (true, false) if terminating(pod) => Ok(()),
            (true, false) => self.enroll_running(pod, scanned).await,
            (false, true) => self.enroller.remove(pod, terminal(pod)).await.map_err(|e| e.to_string()),
            // Enrolled: only an annotation that failed at the enrollment is still to do (retried with backoff).
            (true, true) if !terminating(pod) => self.enroller.annotate_pending(pod).await.map_err(|e| e.to_string()),
            _ => Ok(()),
        };
        match result {
            Ok(()) => {
                self.backoff.remove(&id);
            }
            Err(e) => {
                let delay = self.backoff.get(&id).map_or(Duration::from_millis(200), |d| (*d * 2).min(MAX_BACKOFF));
                self.backoff.insert(id.clone(), delay);
                tracing::warn!(pod = %id, error = %e, retry_in = ?delay, "reconcile failed");
                let tx = self.retry_tx.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(delay).await;
                    let _ = tx.send(id);
                });
            }
        }
    }

    /// A running pod (not coming through the CNI path): its netns is found through /proc, unless `scanned`
    /// says what a scan for several pods found. A failed search is the pod's failed enrollment, for `explain`.
    async fn enroll_running(&self, pod: &Pod, scanned: Option<Searched>) -> Result<(), String> {
        let ips = pod_ips(pod);
        if ips.is_empty() {
            return Ok(()); // still being created: the plugin hands it over
        }
        let searched = match scanned {
            Some(searched) => searched,
            None => self.find_netns(pod, &ips).await,
        };
        match searched.netns {
            Ok(netns) => self.enroller.enroll(pod, netns, ips, searched.step).await.map_err(|e| e.to_string()),
            Err(error) => {
                self.enroller.search_failed(pod, &ips, searched.step, &error).await;
                Err(error)
            }
        }
    }

    /// One pod's search; the pod's enrollment (or its failed search) records it as its `netns` step.
    async fn find_netns(&self, pod: &Pod, ips: &[IpAddr]) -> Searched {
        let id = PodUid::of(pod);
        let mut scan = self.scan(vec![(id.to_string(), ips.to_vec())]).await;
        scan.take(&id)
    }

    /// The netns of every pod in `pods`, found in one `/proc` scan (a scan per pod would read every process once
    /// per pod: quadratic on a busy node); no scan for no pods. Each pod's record (and the `netns` phase of the
    /// histogram) gets the scan's time in its `netns` step, as its own scan would.
    async fn find_all_netns(&self, pods: &[Arc<Pod>]) -> Scan {
        if pods.is_empty() {
            let step = Clock::start().stop();
            return Scan { found: HashMap::new(), step, missing: not_found(&self.config.host_proc) };
        }
        self.scan(pods.iter().map(|p| (PodUid::of(p).into(), pod_ips(p))).collect()).await
    }

    /// Scans `/proc` once for the pods `asked` (UID and IPs) on a blocking thread; a failed scan is logged, and
    /// every pod's search fails with its error.
    async fn scan(&self, asked: Vec<(String, Vec<IpAddr>)>) -> Scan {
        let proc_dir = self.config.host_proc.clone();
        let clock = Clock::start();
        self.metrics.proc_scans.inc();
        let scanned = tokio::task::spawn_blocking(move || {
            let borrowed: Vec<(&str, &[IpAddr])> = asked.iter().map(|(u, ips)| (u.as_str(), ips.as_slice())).collect();
            netns::discover::find_pods_netns(&proc_dir, &borrowed)
        })
        .await;
        let step = clock.stop();
        let failed = match scanned {
            Ok(Ok(found)) => return Scan { found, step, missing: not_found(&self.config.host_proc) },
            Ok(Err(e)) => format!("scanning {}: {e}", self.config.host_proc.display()),
            Err(e) => format!("the /proc scan task failed: {e}"),
        };
        tracing::warn!(error = %failed, "scanning /proc for pods' netns");
        Scan { found: HashMap::new(), step, missing: failed }
    }

    /// After a restart: pods annotated as enrolled go back into the cache (their netns found through /proc), with
    /// their rules re-programmed when `AMBIENT_RECONCILE_POD_RULES_ON_STARTUP` asks for it; then every pod is
    /// reconciled once.
    async fn startup(&mut self) {
        let annotated = self.pods.state_filter(|p| {
            p.metadata.annotations.as_ref().and_then(|a| a.get(AMBIENT_REDIRECTION)).map(String::as_str)
                == Some(AMBIENT_REDIRECTION_ENABLED)
        });
        let mut scan = self.find_all_netns(&annotated).await;
        for pod in annotated {
            let ips = pod_ips(&pod);
            let searched = scan.take(&PodUid::of(&pod));
            if let Err(error) = &searched.netns {
                tracing::warn!(pod = %PodUid::of(&pod), %error, "enrolled pod's netns not found; the proxy gets Keep");
            }
            let reprogram = self.config.ambient_reconcile_pod_rules_on_startup;
            if let Err(e) = self.enroller.restore(&pod, searched.netns, ips, reprogram, searched.step).await {
                tracing::warn!(pod = %PodUid::of(&pod), error = %e, "restoring enrolled pod");
            }
        }
        self.reconcile_all(self.pods.state()).await;
        tracing::info!(enrolled = self.enroller.state().cache().count(), "caches synced");
    }
}

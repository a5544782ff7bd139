//! The plugin's side door on `<run dir>/pluginevent.sock`, served by the daemon's HTTP server:
//! - `POST /cmdadd` (Istio's event, ambient only): the reply comes only after the pod is fully enrolled, so the
//!   plugin's ADD (and so the pod's start) waits for it;
//! - `POST /podsetup` (our plugin's one round trip at ADD): the pod comes from the agent's watch
//!   ([`crate::pod_lookup`]), not from the API; an ambient pod is enrolled as for `/cmdadd`, any other is answered
//!   with what the sidecar decision needs; a pod the watch has not delivered within the bounded wait gets 404 and
//!   the plugin asks the API itself.
//!
//! `/cmdadd` also takes the pod from the watch, and GETs it only when the watch has not delivered it in time.
//!
//! The socket is mode 0666 (the plugin runs as the runtime's user), so nothing in an event is taken on faith.
//! Before anything is programmed the agent checks, in this order, that the peer is root (`SO_PEERCRED`, from the
//! kernel, not from the request); that the event is well formed; that `Netns` is a network namespace
//! (`NS_GET_NSTYPE`, so a mount or user namespace, a regular file or a FIFO is refused); that it is neither the
//! host's (`HOST_NETNS`) nor the agent's own (compared by device and inode); that the pod is scheduled on this node;
//! and that its UID is the one the plugin read from `CNI_ARGS`, when the event carries one (Istio's plugin sends
//! none, and such an event is accepted without that check). A refusal is a 4xx whose body says why (the plugin
//! puts it into its CNI error), counted in `istio_cni_plugin_requests_total{response_code}` and logged at most once
//! per reason and [`daemon::throttle::LOG_INTERVAL`], since a peer can repeat it at will.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use anyhow::Context as _;
use cni::plugin_event::{
    CmdAdd, PodSetup, PodSetupAnswer, CMDADD_PATH, INVALID_POD_STATUS, PODSETUP_PATH, UNKNOWN_POD_STATUS,
};
use daemon::drain::DrainWatcher;
use daemon::http::{self, reply, Body, JSON, TEXT};
use daemon::listener::PeerCredentials;
use daemon::throttle::Throttle;
use http_body_util::BodyExt;
use hyper::{Method, Request, Response, StatusCode};
use istio_contract::enablement::{decide_without_namespace, PodFacts, Selectors};
use istio_contract::paths::PLUGIN_EVENT_SOCKET;
use istio_contract::pod::PodInfo;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use netns::{Netns, NetnsError};

use crate::config::Config;
use crate::enroll::{EnrollError, Enroller, API_CALL_TIMEOUT};
use crate::metrics::{Metrics, ResponseCode};
use crate::plugin_socket;
use crate::pod::PodUid;
use crate::pod_lookup::{PodLookup, WAIT};

/// Largest event body accepted.
const MAX_BODY: usize = 64 * 1024;
/// The only uid allowed to post events: the container runtime runs CNI plugins as root.
const ROOT: u32 = 0;

/// Binds `<run dir>/pluginevent.sock`.
pub fn bind(run_dir: &Path) -> anyhow::Result<(tokio::net::UnixListener, PathBuf)> {
    plugin_socket::bind(run_dir, PLUGIN_EVENT_SOCKET)
}

/// What an event is checked against besides its peer: this node's name, and the network namespaces that belong to
/// the node rather than to a pod. Found once at startup; these namespaces live as long as the node (or the agent).
#[derive(Debug, Clone)]
pub struct EventChecks {
    node_name: String,
    node_netns: Vec<NodeNetns>,
}

/// A network namespace of the node, which no event may name, and what it is (for the refusal).
#[derive(Debug, Clone)]
struct NodeNetns {
    id: (u64, u64),
    what: &'static str,
}

impl EventChecks {
    /// Records `NODE_NAME` and the node's own network namespaces: `host`, the one the host probe rules go to
    /// (`HOST_NETNS`, which the chart sets to the host's `/host/proc/1/ns/net`, or the agent's own when it runs
    /// with hostNetwork), and the agent's own.
    pub fn new(config: &Config, host: &Netns) -> anyhow::Result<Self> {
        let own = Netns::current().context("opening the agent's own netns")?;
        let node_netns = vec![
            NodeNetns { id: host.id(), what: "the host's" },
            NodeNetns { id: own.id(), what: "the node agent's own" },
        ];
        Ok(Self { node_name: config.node_name.clone(), node_netns })
    }

    /// Opens the event's `Netns` and checks that it is a pod's: a network namespace, and none of the node's.
    fn open_netns(&self, path: &str) -> Result<Netns, EventError> {
        let netns = Netns::open(path).map_err(|e| match e {
            NetnsError::NotNetns(_) | NetnsError::OtherNamespace { .. } => EventError::Refused(Refusal::NotNetns(e)),
            // Gone (the sandbox died before we got here) or unreadable: not the peer's fault, and worth a retry.
            e => EventError::Failed(format!("open netns: {e}")),
        })?;
        match self.node_netns.iter().find(|n| n.id == netns.id()) {
            Some(node) => Err(EventError::Refused(Refusal::NodeNetns { path: path.to_owned(), what: node.what })),
            None => Ok(netns),
        }
    }

    /// Checks that `pod` is the event's: scheduled on this node, and with the event's UID when it names one.
    fn check_pod(&self, pod: &Pod, event: &CmdAdd) -> Result<(), Refusal> {
        let name = format!("{}/{}", event.pod_namespace, event.pod_name);
        let node = pod.spec.as_ref().and_then(|s| s.node_name.clone());
        if node.as_deref() != Some(self.node_name.as_str()) {
            return Err(Refusal::OtherNode { pod: name, node, this: self.node_name.clone() });
        }
        if let Some(claimed) = &event.pod_uid {
            let actual = PodUid::of(pod);
            if claimed.as_str() != actual.as_str() {
                return Err(Refusal::UidMismatch { pod: name, claimed: claimed.clone(), actual: actual.into() });
            }
        }
        Ok(())
    }
}

/// Why an event is refused: the peer's fault, so a 4xx whose body (this message) the plugin puts into its CNI error.
#[derive(Debug, thiserror::Error)]
enum Refusal {
    /// The connection carries no peer credentials (the kernel would not say who connected).
    #[error("refused: the peer's credentials are unknown")]
    NoPeer,
    /// The peer is not root.
    #[error(
        "refused: the peer runs as uid {0}; only root (the container runtime running the CNI plugin) may post events"
    )]
    NotRoot(u32),
    /// Anything but `POST /cmdadd` (ambient only) and `POST /podsetup`.
    #[error("refused: {0} is not served here")]
    NotServed(String),
    /// The body is not a bounded `CmdAdd`.
    #[error("refused: {0}")]
    Malformed(String),
    /// `Netns` is not a network namespace.
    #[error("refused: Netns: {0}")]
    NotNetns(NetnsError),
    /// `Netns` is one of the node's own network namespaces.
    #[error("refused: Netns {path} is {what} network namespace, not a pod's")]
    NodeNetns {
        /// The event's `Netns`.
        path: String,
        /// Which of the node's namespaces it is.
        what: &'static str,
    },
    /// The pod is scheduled on another node, or on none yet.
    #[error("refused: pod {pod} is scheduled on node {node:?}, not on this node ({this})")]
    OtherNode {
        /// namespace/name.
        pod: String,
        /// Its `spec.nodeName`.
        node: Option<String>,
        /// This agent's `NODE_NAME`.
        this: String,
    },
    /// The pod's UID is not the one the plugin got from the runtime.
    #[error("refused: pod {pod} has UID {actual:?}, the event names UID {claimed:?}")]
    UidMismatch {
        /// namespace/name.
        pod: String,
        /// The event's `PodUID`.
        claimed: String,
        /// The API server's.
        actual: String,
    },
}

impl Refusal {
    fn status(&self) -> StatusCode {
        match self {
            Refusal::NotServed(_) => StatusCode::NOT_FOUND,
            Refusal::Malformed(_) => StatusCode::BAD_REQUEST,
            _ => StatusCode::FORBIDDEN,
        }
    }

    /// The refusal's kind in logs, and the key its log line is throttled by.
    fn kind(&self) -> &'static str {
        match self {
            Refusal::NoPeer => "no_peer_credentials",
            Refusal::NotRoot(_) => "peer_not_root",
            Refusal::NotServed(_) => "not_served",
            Refusal::Malformed(_) => "malformed",
            Refusal::NotNetns(_) => "not_a_netns",
            Refusal::NodeNetns { .. } => "node_netns",
            Refusal::OtherNode { .. } => "other_node",
            Refusal::UidMismatch { .. } => "uid_mismatch",
        }
    }
}

/// How an event can end other than enrolled.
#[derive(Debug)]
enum EventError {
    /// `/podsetup` for a pod the watch has not delivered in time (404): the plugin asks the API.
    UnknownPod(String),
    /// Refused before anything was programmed (4xx).
    Refused(Refusal),
    /// Could not be enrolled (500): the API server, a vanished netns.
    Failed(String),
    /// The enrollment itself failed or was refused; [`enroll_status`] picks the status.
    Enroll(EnrollError),
}

/// The status of a failed enrollment: 422 for annotations that cannot become rules (the plugin fails ADD with
/// CNI code 7, as on the sidecar path), 410 for a pod deleted meanwhile, 500 for the rest (the plugin's code 11:
/// try again).
fn enroll_status(e: &EnrollError) -> StatusCode {
    const _: () = assert!(StatusCode::UNPROCESSABLE_ENTITY.as_u16() == INVALID_POD_STATUS, "the plugin's contract");
    match e {
        EnrollError::Invalid { .. } => StatusCode::UNPROCESSABLE_ENTITY,
        EnrollError::Deleted { .. } => StatusCode::GONE,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

/// What the agent decides ambient enrollment with (ambient enabled only): the same selectors and exclusions as
/// its watch.
#[derive(Clone)]
pub struct Ambient {
    /// Enrolls the pods.
    pub enroller: Arc<Enroller>,
    /// `AMBIENT_ENABLEMENT_SELECTOR`.
    pub selectors: Selectors,
    /// `EXCLUDE_NAMESPACES`.
    pub excluded: Vec<String>,
}

/// The plugin's contract: an unknown pod sends it to the API.
const UNKNOWN_POD: StatusCode = StatusCode::NOT_FOUND;
const _: () = assert!(UNKNOWN_POD.as_u16() == UNKNOWN_POD_STATUS, "the plugin's contract");

/// Everything a request needs, shared by every connection.
struct EventServer {
    ambient: Option<Ambient>,
    lookup: PodLookup,
    client: kube::Client,
    metrics: Metrics,
    checks: EventChecks,
    /// One log throttle per refusal kind (a closed set).
    refusals: Mutex<HashMap<&'static str, Throttle>>,
}

/// What a request asks for.
enum Asked {
    /// Istio's `/cmdadd`.
    CmdAdd(CmdAdd),
    /// Our plugin's `/podsetup`.
    PodSetup(PodSetup),
}

/// Serves plugin events until the drain starts; on a graceful drain, an enrollment in progress finishes and is
/// answered. Without `ambient` only `/podsetup` is served, and it answers every pod for the sidecar path.
pub async fn serve(
    listener: tokio::net::UnixListener,
    ambient: Option<Ambient>,
    lookup: PodLookup,
    client: kube::Client,
    metrics: Metrics,
    checks: EventChecks,
    drain: DrainWatcher,
) {
    let server = Arc::new(EventServer { ambient, lookup, client, metrics, checks, refusals: Mutex::default() });
    let routes = move |req| {
        let server = server.clone();
        async move { server.handle(req).await }
    };
    http::Server::new("plugin events")
        .max_connections(plugin_socket::MAX_CONNECTIONS)
        .serve(listener, drain, routes)
        .await;
}

impl EventServer {
    async fn handle(&self, req: Request<hyper::body::Incoming>) -> Response<Body> {
        let peer = req.extensions().get::<PeerCredentials>().copied();
        let arrived = std::time::Instant::now();
        let answered = self.answer(req, peer).await;
        self.metrics.plugin_request_seconds.observe(arrived.elapsed().as_secs_f64());
        let (status, content_type, body) = match answered {
            Ok(None) => (StatusCode::OK, TEXT, String::new()),
            Ok(Some(answer)) => match serde_json::to_string(&answer) {
                Ok(json) => (StatusCode::OK, JSON, json),
                Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, TEXT, format!("encoding the answer: {e}")),
            },
            Err(EventError::UnknownPod(reason)) => (UNKNOWN_POD, TEXT, reason),
            Err(EventError::Failed(reason)) => (StatusCode::INTERNAL_SERVER_ERROR, TEXT, reason),
            Err(EventError::Enroll(e)) => (enroll_status(&e), TEXT, e.to_string()),
            Err(EventError::Refused(refusal)) => {
                self.log_refusal(&refusal, peer);
                (refusal.status(), TEXT, refusal.to_string())
            }
        };
        self.metrics.plugin_requests.get_or_create(&ResponseCode { response_code: status.as_u16().to_string() }).inc();
        reply(status, content_type, body)
    }

    /// Checks who asks and what, then answers; the body is read only for a root peer. `None` answers `/cmdadd`
    /// (an empty 200).
    async fn answer(
        &self,
        req: Request<hyper::body::Incoming>,
        peer: Option<PeerCredentials>,
    ) -> Result<Option<PodSetupAnswer>, EventError> {
        let answer_by = std::time::Instant::now() + cni::plugin_event::AGENT_ANSWER_DEADLINE;
        match peer {
            None => return Err(EventError::Refused(Refusal::NoPeer)),
            Some(peer) if peer.uid != ROOT => return Err(EventError::Refused(Refusal::NotRoot(peer.uid))),
            Some(_) => {}
        }
        let path = req.uri().path().to_owned();
        let request = match (req.method(), path.as_str()) {
            (&Method::POST, CMDADD_PATH) if self.ambient.is_some() => Asked::CmdAdd(read_json(req).await?),
            (&Method::POST, PODSETUP_PATH) => Asked::PodSetup(read_json(req).await?),
            (method, _) => return Err(EventError::Refused(Refusal::NotServed(format!("{method} {path}")))),
        };
        match request {
            Asked::CmdAdd(event) => {
                let pod = match self.lookup.pod(&event.pod_namespace, &event.pod_name, event.pod_uid.as_deref()).await {
                    Some(pod) => pod,
                    None => Arc::new(self.get(&event, answer_by).await?),
                };
                self.checks.check_pod(&pod, &event).map_err(EventError::Refused)?;
                self.enroll(&pod, &event, answer_by).await.map(|()| None)
            }
            Asked::PodSetup(setup) => self.pod_setup(setup, answer_by).await.map(Some),
        }
    }

    /// `/podsetup`: the pod from the watch (or 404), checked as an event's, then enrolled if it is ambient.
    async fn pod_setup(&self, setup: PodSetup, answer_by: std::time::Instant) -> Result<PodSetupAnswer, EventError> {
        let event = &setup.event;
        let name = format!("{}/{}", event.pod_namespace, event.pod_name);
        let Some(pod) = self.lookup.pod(&event.pod_namespace, &event.pod_name, event.pod_uid.as_deref()).await else {
            return Err(EventError::UnknownPod(format!(
                "pod {name} (UID {:?}) not seen by the node agent's watch within {WAIT:?}",
                event.pod_uid.as_deref().unwrap_or("any")
            )));
        };
        self.checks.check_pod(&pod, event).map_err(EventError::Refused)?;
        let ambient = match &self.ambient {
            Some(ambient) if setup.ambient_enabled => self.is_ambient(ambient, &pod)?,
            _ => false,
        };
        if ambient {
            self.enroll(&pod, event, answer_by).await?;
            return Ok(PodSetupAnswer::Enrolled);
        }
        Ok(PodSetupAnswer::Sidecar { pod: PodInfo::from(&*pod) })
    }

    /// The agent's enablement rule on `pod`, the namespace's labels from the namespace watch when the selectors
    /// need them; a namespace the watch has not delivered is a 404 like an unknown pod (the plugin asks the API).
    fn is_ambient(&self, ambient: &Ambient, pod: &Pod) -> Result<bool, EventError> {
        let empty = BTreeMap::new();
        let facts = PodFacts::of(pod, &empty);
        if let Some(answer) = decide_without_namespace(&ambient.selectors, &facts, &ambient.excluded) {
            return Ok(answer);
        }
        let namespace = facts.namespace;
        let labels = self.lookup.namespace_labels(namespace).ok_or_else(|| {
            EventError::UnknownPod(format!("namespace {namespace} not seen by the node agent's namespace watch"))
        })?;
        Ok(ambient.selectors.matches(facts.labels, &labels))
    }

    /// GETs the event's pod: the watch did not deliver it in time. Bounded by the answer deadline (the plugin
    /// stops waiting then) as well as by [`API_CALL_TIMEOUT`].
    async fn get(&self, event: &CmdAdd, answer_by: std::time::Instant) -> Result<Pod, EventError> {
        let name = format!("{}/{}", event.pod_namespace, event.pod_name);
        let api = Api::<Pod>::namespaced(self.client.clone(), &event.pod_namespace);
        let bound = answer_by.saturating_duration_since(std::time::Instant::now()).min(API_CALL_TIMEOUT);
        match tokio::time::timeout(bound, api.get(&event.pod_name)).await {
            Ok(answer) => answer.map_err(|e| EventError::Failed(format!("get pod {name}: {e}"))),
            Err(_) => Err(EventError::Failed(format!("get pod {name}: no answer within {bound:?}"))),
        }
    }

    /// Checks the event's netns, then enrolls the (checked) pod, all or nothing, and undone if it ends after
    /// `answer_by` (see [`Enroller::enroll_for_plugin`]).
    async fn enroll(&self, pod: &Pod, event: &CmdAdd, answer_by: std::time::Instant) -> Result<(), EventError> {
        let Some(ambient) = &self.ambient else {
            return Err(EventError::Failed("ambient is not enabled on this node agent".into()));
        };
        let checks = self.checks.clone();
        let path = event.netns.clone();
        // Opening a path and asking the kernel about it may block (a slow filesystem): not on an async worker.
        let netns = tokio::task::spawn_blocking(move || checks.open_netns(&path))
            .await
            .map_err(|e| EventError::Failed(format!("open netns: {e}")))??;
        let enrolled = ambient.enroller.enroll_for_plugin(pod, netns, event.addresses(), answer_by).await;
        enrolled.map_err(EventError::Enroll)
    }

    fn log_refusal(&self, refusal: &Refusal, peer: Option<PeerCredentials>) {
        let mut throttles = self.refusals.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(suppressed) = throttles.entry(refusal.kind()).or_default().hit() {
            tracing::warn!(
                kind = refusal.kind(),
                peer_uid = peer.map(|p| p.uid),
                peer_pid = peer.and_then(|p| p.pid),
                suppressed_since_last = suppressed,
                "plugin event {refusal}"
            );
        }
    }
}

async fn read_json<T: serde::de::DeserializeOwned>(req: Request<hyper::body::Incoming>) -> Result<T, EventError> {
    let malformed = |e: String| EventError::Refused(Refusal::Malformed(e));
    let limited = http_body_util::Limited::new(req.into_body(), MAX_BODY);
    let bytes = limited.collect().await.map_err(|e| malformed(format!("reading event: {e}")))?.to_bytes();
    serde_json::from_slice(&bytes).map_err(|e| malformed(format!("invalid event: {e}")))
}

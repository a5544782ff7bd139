//! The proxy's shared state, and who holds whom: the node-wide [`Mesh`] every pod proxy shares, the
//! [`PodContext`] every connection handler of one pod shares, and [`LocalPods`], the mesh's register of the pods
//! enrolled on this node. They are one module because they hold each other: a pod holds the mesh, the mesh holds
//! the register, the register names the pods. The pod proxy that builds a context and the handlers that use it
//! depend on this module, not on each other.
//!
//! What it guarantees:
//! - the register holds no pod alive (it keeps [`Weak`] references), so there is no reference cycle: a pod's
//!   context is dropped with its last connection, and the mesh with the last pod and connection (that is when
//!   `main`'s drain completes, see [`Mesh::drain`]);
//! - the newest enrollment at an address wins it, and a pod leaving takes only the addresses where it is still the
//!   one listed, so a pod replaced at an address never removes its successor;
//! - a pod's certificate is replaced whole: new connections present the new one, open ones keep the one they began
//!   with.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, PoisonError, RwLock, Weak};
use std::time::Duration;

use daemon::drain::DrainWatcher;
use hbone::{Baggage, ConnectionCaps, ConnectionLimiter, Identity, MeshCa, MeshTls, Pool, WorkloadCert};
use tokio::sync::Semaphore;

use crate::config::{Config, MtlsMode};
use crate::directory::Directory;
use crate::dns::upstreams::Upstreams;
use crate::metrics::{Direction, Metrics, RefusalReason};
use crate::ratelimit::{RateLimitedLog, REFUSAL_LOG_INTERVAL};
use crate::sockets::PodNetns;
use crate::traffic::Peer;

/// Shared by all pod proxies of the node: the CA that mints pod certificates, the mesh TLS policy, the workload
/// directory, the DNS upstreams, the inbound HBONE limits, the enrolled pods and the metrics.
#[derive(Debug)]
pub struct Mesh {
    /// Mints each pod's workload certificate.
    pub ca: MeshCa,
    /// Trust domain and roots for both TLS sides.
    pub tls: MeshTls,
    /// Which destinations speak HBONE, and as whom.
    pub directory: Directory,
    /// Where the pods' DNS forwarders send queries.
    pub dns: Upstreams,
    /// Connection and proxy counters.
    pub metrics: Metrics,
    /// The cluster this node belongs to (`CLUSTER_ID`): the metrics' cluster of workloads listed without one.
    pub cluster_id: String,
    /// Every pod and every connection holds the mesh (through its pod), so this watcher lives until the last
    /// of them is gone: that is when `main`'s drain completes.
    pub drain: DrainWatcher,
    /// How long open connections may take to finish once the pod or the proxy is stopping
    /// (`CONNECTION_TERMINATION_DEADLINE`).
    pub termination_deadline: Duration,
    /// Whether plaintext inbound connections reach the apps (`MTLS_MODE`).
    pub mtls_mode: MtlsMode,
    /// The limits every pod's HBONE server shares.
    pub hbone: InboundHbone,
    /// Whether connections between two enrolled pods take the same-node fast path (`SAME_NODE_FAST_PATH`).
    pub same_node_fast_path: bool,
    /// The node-wide budget for buffered tunnel bytes (`BUFFER_BUDGET_MIB`); each pod's pool and HBONE server
    /// charge one account in it.
    pub buffers: hbone::MemoryBudget,
    /// The enrolled pods by address: where the fast path finds a destination pod.
    pub local_pods: LocalPods,
}

/// How many workload certificates are minted at once. Each mint is CPU work on the blocking pool; a snapshot
/// of many pods (and their rotations, at half the lifetime of certificates minted together) would otherwise start
/// a blocking thread per pod, each keeping its stack and malloc arena after the burst.
pub const MINTS_AT_ONCE: usize = 2;

impl Mesh {
    /// The trust domain local identities are minted in.
    pub fn trust_domain(&self) -> &str {
        self.tls.trust_domain()
    }

    /// A new workload certificate for `identity`, minted on the blocking pool (key generation is CPU work, kept
    /// off the runtime's workers), at most [`MINTS_AT_ONCE`] at a time.
    pub async fn mint(self: &Arc<Self>, identity: &Identity) -> Result<WorkloadCert, String> {
        static MINTING: Semaphore = Semaphore::const_new(MINTS_AT_ONCE);
        let _turn = MINTING.acquire().await.map_err(|e| e.to_string())?;
        let (mesh, identity) = (self.clone(), identity.clone());
        tokio::task::spawn_blocking(move || mesh.ca.mint(&identity).map_err(|e| e.to_string()))
            .await
            .unwrap_or_else(|e| Err(format!("minting on the blocking pool: {e}")))
    }
}

/// The limits of the HBONE servers on 15008, node-wide: every pod's inbound connections count against one budget.
#[derive(Debug)]
pub struct InboundHbone {
    /// Connections open at once, in all (`HBONE_MAX_CONNECTIONS`) and per client identity
    /// (`HBONE_MAX_CONNECTIONS_PER_IDENTITY`).
    pub limiter: Arc<ConnectionLimiter>,
    /// Connections without streams for this long are closed (`HBONE_SERVER_IDLE_TIMEOUT`).
    pub idle_timeout: Duration,
    /// What a peer can repeat at will (refusals, limit breaches) is logged at most once per reason and interval.
    pub log: RateLimitedLog<&'static str>,
}

impl InboundHbone {
    /// The limits `config` sets.
    pub fn new(config: &Config) -> Self {
        let caps = ConnectionCaps {
            total: config.hbone_max_connections,
            per_identity: config.hbone_max_connections_per_identity,
        };
        InboundHbone {
            limiter: ConnectionLimiter::new(caps),
            idle_timeout: config.hbone_server_idle_timeout,
            log: RateLimitedLog::new(REFUSAL_LOG_INTERVAL),
        }
    }
}

/// What every connection handler of one pod needs.
#[derive(Debug)]
pub struct PodContext {
    /// The pod's uid, for logs.
    pub uid: String,
    /// The pod's network namespace, where a socket thread creates its upstream sockets.
    pub netns: PodNetns,
    /// The pod's current workload certificate; replaced at half life by the pod proxy.
    cert: RwLock<Arc<WorkloadCert>>,
    /// HBONE connections from this pod (dialled from its netns).
    pub pool: Pool,
    /// Who the pod is, sent with each CONNECT.
    pub baggage: Baggage,
    /// The node-wide state.
    pub mesh: Arc<Mesh>,
    /// The pod's own addresses: plaintext inbound forwards only to them, and the proxy's ports on them are
    /// never a destination.
    pub ips: Vec<IpAddr>,
    /// Refused connections are logged at most once per direction, reason and interval for this pod.
    pub refusal_log: RateLimitedLog<(Direction, RefusalReason)>,
    /// Failed inbound HBONE handshakes, logged at most once per error text and interval (a peer can repeat them,
    /// and vary the text, so at most 64 texts are tracked).
    pub handshake_log: RateLimitedLog<String>,
}

impl PodContext {
    /// The context of the pod `uid` with addresses `ips`, presenting `cert` until it is replaced.
    pub fn new(
        uid: &str,
        netns: PodNetns,
        cert: Arc<WorkloadCert>,
        pool: Pool,
        baggage: Baggage,
        mesh: Arc<Mesh>,
        ips: Vec<IpAddr>,
    ) -> Self {
        let refusal_log = RateLimitedLog::new(REFUSAL_LOG_INTERVAL);
        let handshake_log = RateLimitedLog::bounded(REFUSAL_LOG_INTERVAL, 64);
        PodContext {
            uid: uid.to_owned(),
            netns,
            cert: RwLock::new(cert),
            pool,
            baggage,
            mesh,
            ips,
            refusal_log,
            handshake_log,
        }
    }

    /// The pod's current workload certificate: new connections present it, open ones keep the one they began with.
    pub fn cert(&self) -> Arc<WorkloadCert> {
        self.cert.read().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Makes `cert` the one new connections present (certificate rotation).
    pub fn replace_cert(&self, cert: WorkloadCert) {
        *self.cert.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(cert);
    }

    /// The pod as its own end of a connection's traffic labels ([`Peer::local`]): its current identity as
    /// principal.
    pub fn peer(&self) -> Peer {
        let cert = self.cert();
        Peer::local(&self.mesh.directory, &self.mesh.cluster_id, &self.ips, cert.identity(), &self.baggage.namespace)
    }
}

/// The pods this proxy enrolled, by address: where the fast path ([`crate::fast_path`]) finds a destination. Holds
/// no pod alive (the pods hold the mesh that holds this), and a pod leaves it as soon as its proxy stops.
#[derive(Debug, Default)]
pub struct LocalPods {
    by_ip: RwLock<HashMap<IpAddr, Weak<PodContext>>>,
}

impl LocalPods {
    /// Lists `pod` at each of its addresses (replacing an earlier pod there: the newest enrollment wins).
    pub fn insert(&self, pod: &Arc<PodContext>) {
        let mut by_ip = self.by_ip.write().unwrap_or_else(PoisonError::into_inner);
        for ip in &pod.ips {
            by_ip.insert(*ip, Arc::downgrade(pod));
        }
    }

    /// Takes `pod` off its addresses, where it is still the one listed.
    pub fn remove(&self, pod: &Arc<PodContext>) {
        let mut by_ip = self.by_ip.write().unwrap_or_else(PoisonError::into_inner);
        for ip in &pod.ips {
            if by_ip.get(ip).is_some_and(|listed| std::ptr::eq(listed.as_ptr(), Arc::as_ptr(pod))) {
                by_ip.remove(ip);
            }
        }
    }

    /// The running pod enrolled at `ip`.
    pub fn get(&self, ip: IpAddr) -> Option<Arc<PodContext>> {
        self.by_ip.read().unwrap_or_else(PoisonError::into_inner).get(&ip)?.upgrade()
    }
}

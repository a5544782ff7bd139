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
use hbone_proxy::authorization::{Connection, Denied, Governed, Policies};
use mesh_ca::manager::CertificateManager;
use tokio::sync::Semaphore;

use crate::config::{Config, MtlsMode};
use crate::directory::Directory;
use crate::dns::upstreams::Upstreams;
use crate::metrics::{Direction, Metrics, RefusalReason};
use crate::ratelimit::{RateLimitedLog, REFUSAL_LOG_INTERVAL};
use crate::sockets::PodNetns;
use crate::traffic::Peer;

/// Where the pods' workload certificates come from (`CONTROL_PLANE`).
#[derive(Debug)]
pub enum Certificates {
    /// Minted here, by the mesh CA from `CA_DIR` or the self-signed one in `STATE_DIR`.
    Local(Arc<MeshCa>),
    /// Issued by istiod's CA on the pods' behalf (impersonation), fetched ahead and refreshed at half-life by the
    /// manager; a pod proxy registers its identity for as long as it runs.
    Istiod(CertificateManager),
}

/// How long a pod start waits for istiod's CA to issue its certificate before the start fails (and is retried).
pub const ISTIOD_CERT_WAIT: Duration = Duration::from_secs(30);

/// Shared by all pod proxies of the node: where pod certificates come from, the mesh TLS policy, the workload
/// directory and authorization policies, the DNS upstreams, the inbound HBONE limits, the enrolled pods and the
/// metrics.
#[derive(Debug)]
pub struct Mesh {
    /// Gives each pod its workload certificate.
    pub certificates: Certificates,
    /// istiod's authorization policies (empty, so allowing everything, without istiod).
    pub policies: Policies,
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

    /// A workload certificate for `identity`: minted on the blocking pool (key generation is CPU work, kept off
    /// the runtime's workers), at most [`MINTS_AT_ONCE`] at a time; or, from istiod, the manager's current one
    /// (waiting at most [`ISTIOD_CERT_WAIT`] for the first).
    pub async fn mint(self: &Arc<Self>, identity: &Identity) -> Result<WorkloadCert, String> {
        match &self.certificates {
            Certificates::Local(ca) => {
                static MINTING: Semaphore = Semaphore::const_new(MINTS_AT_ONCE);
                let _turn = MINTING.acquire().await.map_err(|e| e.to_string())?;
                let (ca, identity) = (ca.clone(), identity.clone());
                tokio::task::spawn_blocking(move || ca.mint(&identity).map_err(|e| e.to_string()))
                    .await
                    .unwrap_or_else(|e| Err(format!("minting on the blocking pool: {e}")))
            }
            Certificates::Istiod(manager) => {
                let issued = tokio::time::timeout(ISTIOD_CERT_WAIT, manager.certificate(identity))
                    .await
                    .map_err(|_| format!("istiod's CA gave no certificate for {identity} within {ISTIOD_CERT_WAIT:?}"))?
                    .map_err(|e| e.to_string())?;
                let (identity, chain, key, not_before, not_after) = issued.to_workload_cert_parts();
                Ok(WorkloadCert::new(identity, chain, key, not_before, not_after))
            }
        }
    }

    /// Keeps istiod's CA fetching and refreshing `identity`'s certificate until the guard is dropped (nothing to
    /// keep for the local CA).
    pub fn hold_identity(&self, identity: &Identity) -> IdentityHold {
        match &self.certificates {
            Certificates::Istiod(manager) => {
                manager.register(identity);
                IdentityHold(Some((manager.clone(), identity.clone())))
            }
            Certificates::Local(_) => IdentityHold(None),
        }
    }
}

/// A pod's registration of its identity with istiod's certificate manager; dropping it forgets the registration.
#[derive(Debug)]
pub struct IdentityHold(Option<(CertificateManager, Identity)>);

impl Drop for IdentityHold {
    fn drop(&mut self) {
        if let Some((manager, identity)) = self.0.take() {
            manager.forget(&identity);
        }
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

    /// Whether istiod's policies let a connection from `source` (proven identity, `None` in plaintext) at `source_ip`
    /// reach `destination` in this pod. The pod is governed as the workload the directory lists at the destination
    /// address (istiod's uid selects its policies), in its own namespace either way.
    pub fn authorize(
        &self,
        source: Option<&Identity>,
        source_ip: IpAddr,
        destination: std::net::SocketAddr,
    ) -> Result<(), Denied> {
        if self.mesh.policies.is_empty() {
            return Ok(());
        }
        let listed = self.mesh.directory.lookup(destination.ip());
        let uid = listed.as_ref().map(|d| d.workload.uid.as_str()).unwrap_or_default();
        let workload = Governed { uid, namespace: &self.baggage.namespace };
        self.mesh.policies.check(workload, &Connection { source, source_ip, destination })
    }

    /// [`PodContext::authorize`], with a denial counted (`istio_tcp_connections_refused_total{direction="inbound",
    /// reason="authorization_policy"}`) and logged at most once per pod and interval; whether it may go ahead.
    pub fn admits(&self, source: Option<&Identity>, source_ip: IpAddr, destination: std::net::SocketAddr) -> bool {
        let Err(denied) = self.authorize(source, source_ip, destination) else { return true };
        let reason = RefusalReason::AuthorizationPolicy;
        self.mesh.metrics.refused(Direction::Inbound, reason);
        if let Some(suppressed) = self.refusal_log.admit((Direction::Inbound, reason)) {
            let source = source.map(ToString::to_string).unwrap_or_default();
            tracing::warn!(uid = %self.uid, %source, %source_ip, %destination, %denied, suppressed, "connection denied");
        }
        false
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

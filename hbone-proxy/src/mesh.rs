//! The node-wide state every pod proxy shares: the CA that mints pod certificates, the mesh TLS policy,
//! the workload directory, the DNS upstreams, the inbound HBONE limits, the enrolled pods and the metrics.

use std::sync::Arc;
use std::time::Duration;

use daemon::drain::DrainWatcher;
use hbone::{ConnectionCaps, ConnectionLimiter, MeshCa, MeshTls};

use crate::config::{Config, MtlsMode};
use crate::directory::Directory;
use crate::dns::Upstreams;
use crate::fast_path::LocalPods;
use crate::metrics::Metrics;
use crate::ratelimit::{RateLimitedLog, REFUSAL_LOG_INTERVAL};

/// Shared by all pod proxies of the node.
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
    /// The enrolled pods by address: where the fast path finds a destination pod.
    pub local_pods: LocalPods,
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

impl Mesh {
    /// The trust domain local identities are minted in.
    pub fn trust_domain(&self) -> &str {
        self.tls.trust_domain()
    }
}

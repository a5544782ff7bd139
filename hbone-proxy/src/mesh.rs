//! The node-wide state every pod proxy shares: the CA that mints pod certificates, the mesh TLS policy,
//! the workload directory, the DNS upstreams and the metrics.

use std::time::Duration;

use daemon::drain::DrainWatcher;
use hbone::{MeshCa, MeshTls};

use crate::config::MtlsMode;
use crate::directory::Directory;
use crate::dns::Upstreams;
use crate::metrics::Metrics;

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
    /// Every pod and every connection holds the mesh (through its pod), so this watcher lives until the last
    /// of them is gone: that is when `main`'s drain completes.
    pub drain: DrainWatcher,
    /// How long open connections may take to finish once the pod or the proxy is stopping
    /// (`CONNECTION_TERMINATION_DEADLINE`).
    pub termination_deadline: Duration,
    /// Whether plaintext inbound connections reach the apps (`MTLS_MODE`).
    pub mtls_mode: MtlsMode,
}

impl Mesh {
    /// The trust domain local identities are minted in.
    pub fn trust_domain(&self) -> &str {
        self.tls.trust_domain()
    }
}

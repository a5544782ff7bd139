//! What every connection handler of one pod shares. Its own module so the pod proxy that builds it and the
//! inbound and outbound handlers that use it depend on it, not on each other.

use std::net::IpAddr;
use std::sync::{Arc, PoisonError, RwLock};

use hbone::{Baggage, Pool, WorkloadCert};

use crate::mesh::Mesh;
use crate::metrics::{Direction, RefusalReason};
use crate::ratelimit::{RateLimitedLog, REFUSAL_LOG_INTERVAL};
use crate::sockets::PodNetns;

/// What every connection handler of one pod needs.
#[derive(Debug)]
pub struct PodContext {
    /// The pod's uid, for logs.
    pub uid: String,
    /// The pod's network namespace and the thread that creates its upstream sockets there.
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
}

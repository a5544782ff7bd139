//! What every connection handler of one pod shares. Its own module so the pod proxy that builds it and the
//! inbound and outbound handlers that use it depend on it, not on each other.

use std::sync::{Arc, PoisonError, RwLock};

use hbone::{Baggage, Pool, WorkloadCert};
use netns::Netns;

use crate::mesh::Mesh;

/// What every connection handler of one pod needs.
#[derive(Debug)]
pub struct PodContext {
    /// The pod's uid, for logs.
    pub uid: String,
    /// The pod's network namespace: upstream sockets are created there.
    pub netns: Arc<Netns>,
    /// The pod's current workload certificate; replaced at half life by the pod proxy.
    cert: RwLock<Arc<WorkloadCert>>,
    /// HBONE connections from this pod (dialled from its netns).
    pub pool: Pool,
    /// Who the pod is, sent with each CONNECT.
    pub baggage: Baggage,
    /// The node-wide state.
    pub mesh: Arc<Mesh>,
}

impl PodContext {
    /// The context of the pod `uid`, presenting `cert` until it is replaced.
    pub fn new(
        uid: &str,
        netns: Arc<Netns>,
        cert: Arc<WorkloadCert>,
        pool: Pool,
        baggage: Baggage,
        mesh: Arc<Mesh>,
    ) -> Self {
        PodContext { uid: uid.to_owned(), netns, cert: RwLock::new(cert), pool, baggage, mesh }
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

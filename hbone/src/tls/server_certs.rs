//! The certificates the HBONE server presents, chosen by the IP the client dialled (clients send no SNI).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, RwLock};

use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;

use crate::ca::WorkloadCert;

/// Destination IP → certificate of the workload owning it. Replacing an entry rotates the certificate:
/// handshakes after the change present the new one, established connections keep theirs.
#[derive(Clone, Default, Debug)]
pub struct ServerCerts {
    by_ip: Arc<RwLock<HashMap<IpAddr, Arc<CertifiedKey>>>>,
}

impl ServerCerts {
    /// An empty set; handshakes for IPs without a certificate fail.
    pub fn new() -> Self {
        Self::default()
    }

    /// Presents `cert` for connections dialled to `ip`, replacing any earlier certificate.
    pub fn set(&self, ip: IpAddr, cert: &WorkloadCert) -> Result<(), rustls::Error> {
        let key = cert.certified_key()?;
        self.write().insert(ip.to_canonical(), key);
        Ok(())
    }

    /// Stops serving `ip` (e.g. its pod went away).
    pub fn remove(&self, ip: IpAddr) {
        self.write().remove(&ip.to_canonical());
    }

    /// The certificate presented for `ip`, if any.
    pub fn get(&self, ip: IpAddr) -> Option<Arc<CertifiedKey>> {
        self.by_ip.read().unwrap_or_else(|poisoned| poisoned.into_inner()).get(&ip.to_canonical()).cloned()
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<IpAddr, Arc<CertifiedKey>>> {
        self.by_ip.write().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// Resolves the certificate for one accepted connection, looked up at handshake time.
#[derive(Debug)]
pub(crate) struct ByLocalIp {
    pub(crate) certs: ServerCerts,
    pub(crate) local_ip: IpAddr,
}

impl ResolvesServerCert for ByLocalIp {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        let found = self.certs.get(self.local_ip);
        if found.is_none() {
            tracing::warn!(ip = %self.local_ip, "no workload certificate for the dialled IP");
        }
        found
    }
}

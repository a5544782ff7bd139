//! A minted workload certificate with its key, and when it should be replaced.

use std::sync::Arc;
use std::time::SystemTime;

use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use rustls::sign::CertifiedKey;

use crate::identity::Identity;

/// A leaf certificate chain and private key for one workload identity.
pub struct WorkloadCert {
    identity: Identity,
    chain: Vec<CertificateDer<'static>>,
    key: PrivatePkcs8KeyDer<'static>,
    issued_at: SystemTime,
    expires_at: SystemTime,
}

impl std::fmt::Debug for WorkloadCert {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkloadCert")
            .field("identity", &self.identity.to_string())
            .field("issued_at", &self.issued_at)
            .field("expires_at", &self.expires_at)
            .finish_non_exhaustive()
    }
}

impl WorkloadCert {
    /// A certificate from its parts: the chain (leaf first), the leaf's PKCS#8 key, when it was issued and when it
    /// expires. The caller vouches that the chain names `identity` and matches the key (the local CA mints them so;
    /// `mesh-ca` verifies what istiod's CA returns before it gives the parts out).
    pub fn new(
        identity: Identity,
        chain: Vec<CertificateDer<'static>>,
        pkcs8_key: Vec<u8>,
        issued_at: SystemTime,
        expires_at: SystemTime,
    ) -> Self {
        WorkloadCert { identity, chain, key: PrivatePkcs8KeyDer::from(pkcs8_key), issued_at, expires_at }
    }

    /// The identity the leaf speaks for.
    pub fn identity(&self) -> &Identity {
        &self.identity
    }

    /// The chain to present: leaf first, then the CA certificate and any intermediates.
    pub fn chain(&self) -> &[CertificateDer<'static>] {
        &self.chain
    }

    /// The leaf's private key (PKCS#8).
    pub fn private_key(&self) -> PrivateKeyDer<'static> {
        PrivateKeyDer::Pkcs8(self.key.clone_key())
    }

    /// When the leaf was issued (its notBefore is a little earlier, to tolerate clock skew).
    pub fn issued_at(&self) -> SystemTime {
        self.issued_at
    }

    /// The leaf's notAfter.
    pub fn expires_at(&self) -> SystemTime {
        self.expires_at
    }

    /// Whether the leaf is past half of its lifetime and should be replaced, leaving the other half as
    /// margin for retries.
    pub fn needs_rotation(&self, now: SystemTime) -> bool {
        let lifetime = self.expires_at.duration_since(self.issued_at).unwrap_or_default();
        now >= self.issued_at + lifetime / 2
    }

    /// The chain and key in the form rustls presents.
    pub fn certified_key(&self) -> Result<Arc<CertifiedKey>, rustls::Error> {
        let key = rustls::crypto::ring::sign::any_supported_type(&self.private_key())?;
        Ok(Arc::new(CertifiedKey::new(self.chain.clone(), key)))
    }
}

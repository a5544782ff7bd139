//! An issued workload certificate: the verified chain, its roots and the private key it was requested with.
//!
//! Guarantees: a [`WorkloadCertificate`] is only built from a chain that passed [`crate::chain::verify_chain`]
//! for its identity and key, so its leaf names exactly its identity and matches its key; the key is never printed
//! (`Debug` leaves it out).

use std::time::SystemTime;

use hbone::identity::Identity;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

use crate::chain::VerifiedChain;

/// A leaf chain and private key for one workload identity, with the trust roots that came with it.
pub struct WorkloadCertificate {
    identity: Identity,
    verified: VerifiedChain,
    key: PrivatePkcs8KeyDer<'static>,
}

impl std::fmt::Debug for WorkloadCertificate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkloadCertificate")
            .field("identity", &self.identity.to_string())
            .field("serial", &self.verified.serial)
            .field("not_before", &self.verified.not_before)
            .field("not_after", &self.verified.not_after)
            .finish_non_exhaustive()
    }
}

impl WorkloadCertificate {
    /// Pairs a verified chain with the key of its request.
    pub fn new(identity: Identity, verified: VerifiedChain, key: PrivatePkcs8KeyDer<'static>) -> Self {
        WorkloadCertificate { identity, verified, key }
    }

    /// The identity the leaf speaks for.
    pub fn identity(&self) -> &Identity {
        &self.identity
    }

    /// The chain to present: the leaf, then the intermediates (no root).
    pub fn chain(&self) -> &[CertificateDer<'static>] {
        &self.verified.chain
    }

    /// The mesh trust roots that came with the certificate (those within their validity period).
    pub fn roots(&self) -> &[CertificateDer<'static>] {
        &self.verified.roots
    }

    /// The leaf's private key (PKCS#8).
    pub fn private_key(&self) -> PrivateKeyDer<'static> {
        PrivateKeyDer::Pkcs8(self.key.clone_key())
    }

    /// The leaf's notBefore.
    pub fn not_before(&self) -> SystemTime {
        self.verified.not_before
    }

    /// The leaf's notAfter.
    pub fn not_after(&self) -> SystemTime {
        self.verified.not_after
    }

    /// When the certificate should be replaced: half-way through its validity
    /// (`not_before + (not_after - not_before) / 2`), as ztunnel does.
    pub fn refresh_at(&self) -> SystemTime {
        let lifetime = self.not_after().duration_since(self.not_before()).unwrap_or_default();
        self.not_before() + lifetime / 2
    }

    /// Whether the leaf is still valid at `now`.
    pub fn is_valid_at(&self, now: SystemTime) -> bool {
        now >= self.not_before() && now < self.not_after()
    }

    /// The leaf's serial number, decimal.
    pub fn serial(&self) -> &str {
        &self.verified.serial
    }

    /// The leaf's issuer (RFC 4514).
    pub fn issuer(&self) -> &str {
        &self.verified.issuer
    }

    /// The parts `hbone::ca::WorkloadCert::new` takes, in its order: identity, chain (leaf first), PKCS#8 key
    /// bytes, issued at (notBefore), expires at (notAfter). For the proxy's adapter (that constructor is
    /// crate-private in `hbone` today; see docs/mesh-ca.md).
    pub fn to_workload_cert_parts(&self) -> (Identity, Vec<CertificateDer<'static>>, Vec<u8>, SystemTime, SystemTime) {
        (
            self.identity.clone(),
            self.verified.chain.clone(),
            self.key.secret_pkcs8_der().to_vec(),
            self.verified.not_before,
            self.verified.not_after,
        )
    }

    /// The chain and key in the form rustls presents (what `hbone`'s TLS configurations take, as
    /// `hbone::ca::WorkloadCert::certified_key` gives today).
    #[cfg(feature = "runtime")]
    pub fn certified_key(&self) -> Result<std::sync::Arc<rustls::sign::CertifiedKey>, rustls::Error> {
        let key = rustls::crypto::ring::sign::any_supported_type(&self.private_key())?;
        let certified = rustls::sign::CertifiedKey::new(self.chain().to_vec(), key);
        certified.keys_match()?;
        Ok(std::sync::Arc::new(certified))
    }
}

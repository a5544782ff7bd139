//! A fresh key and PKCS#10 request per certificate, as ztunnel makes them.
//!
//! Guarantees: every [`KeyAndCsr::generate`] makes a new ECDSA P-256 key (ring's system random); the request has an
//! empty subject, one URI SAN (the SPIFFE identity; critical, since the subject is empty) and is signed with the
//! key (ECDSA with SHA-256). The private key never leaves this process.

use hbone::identity::Identity;
use rcgen::{CertificateParams, DistinguishedName, KeyPair, SanType, PKCS_ECDSA_P256_SHA256};
use rustls_pki_types::PrivatePkcs8KeyDer;

/// Why a request could not be built (rcgen or the random source failed).
#[derive(Debug, thiserror::Error)]
#[error("building the certificate request: {0}")]
pub struct CsrError(#[from] rcgen::Error);

/// A new key pair and the PEM request for one identity.
pub struct KeyAndCsr {
    key: KeyPair,
    csr_pem: String,
}

impl std::fmt::Debug for KeyAndCsr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyAndCsr").finish_non_exhaustive()
    }
}

impl KeyAndCsr {
    /// A fresh P-256 key and a request for `identity`.
    pub fn generate(identity: &Identity) -> Result<Self, CsrError> {
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256)?;
        let mut params = CertificateParams::default();
        params.distinguished_name = DistinguishedName::new();
        let uri = identity.to_string().try_into()?;
        params.subject_alt_names = vec![SanType::URI(uri)];
        let csr_pem = params.serialize_request(&key)?.pem()?;
        Ok(KeyAndCsr { key, csr_pem })
    }

    /// The PEM request.
    pub fn csr_pem(&self) -> &str {
        &self.csr_pem
    }

    /// The public key as it appears in a certificate's `subjectPublicKey` (an uncompressed P-256 point).
    pub fn public_key_raw(&self) -> &[u8] {
        self.key.public_key_raw()
    }

    /// The private key, PKCS#8.
    pub fn private_key(&self) -> PrivatePkcs8KeyDer<'static> {
        PrivatePkcs8KeyDer::from(self.key.serialize_der())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use x509_parser::prelude::*;

    #[test]
    fn the_request_names_only_the_identity_and_each_key_is_new() {
        let id: Identity = "spiffe://cluster.local/ns/a/sa/b".parse().unwrap();
        let first = KeyAndCsr::generate(&id).unwrap();
        let second = KeyAndCsr::generate(&id).unwrap();
        assert_ne!(first.public_key_raw(), second.public_key_raw());
        let (_, pem) = x509_parser::pem::parse_x509_pem(first.csr_pem().as_bytes()).unwrap();
        assert_eq!(pem.label, "CERTIFICATE REQUEST");
        let (_, csr) = X509CertificationRequest::from_der(&pem.contents).unwrap();
        csr.verify_signature().unwrap();
        assert_eq!(csr.certification_request_info.subject.iter().count(), 0);
        assert_eq!(csr.certification_request_info.subject_pki.subject_public_key.data.as_ref(), first.public_key_raw());
        let mut uris = Vec::new();
        for ext in csr.requested_extensions().into_iter().flatten() {
            if let ParsedExtension::SubjectAlternativeName(san) = ext {
                for name in &san.general_names {
                    match name {
                        GeneralName::URI(u) => uris.push(u.to_string()),
                        other => panic!("unexpected SAN {other:?}"),
                    }
                }
            }
        }
        assert_eq!(uris, ["spiffe://cluster.local/ns/a/sa/b"]);
    }
}

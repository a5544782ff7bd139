//! Certificate verifiers for mesh mTLS: the chain must reach the mesh roots, and the SPIFFE URI SAN
//! decides who the peer is (host names play no part).

use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::WebPkiSupportedAlgorithms;
use rustls::pki_types::{CertificateDer, ServerName, TrustAnchor, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{CertificateError, DigitallySignedStruct, DistinguishedName, OtherError, SignatureScheme};
use x509_parser::extensions::GeneralName;
use x509_parser::prelude::{FromDer, X509Certificate};

use crate::identity::Identity;

/// Why a peer certificate's identity was not acceptable.
#[derive(Debug, thiserror::Error)]
pub enum PeerIdentityError {
    /// The certificate could not be parsed to read its SANs.
    #[error("cannot read the peer certificate's SANs: {0}")]
    Unreadable(String),
    /// A client certificate had no SPIFFE identity in the server's trust domain.
    #[error("client certificate has no spiffe:// URI SAN in trust domain {trust_domain} (URI SANs: {found:?})")]
    WrongTrustDomain {
        /// The server's trust domain.
        trust_domain: String,
        /// The URI SANs the certificate carries.
        found: Vec<String>,
    },
    /// A server certificate did not carry the identity the client expected.
    #[error("server certificate is not {expected} (URI SANs: {found:?})")]
    Mismatch {
        /// The identity the client dialled for.
        expected: String,
        /// The URI SANs the certificate carries.
        found: Vec<String>,
    },
}

/// The URI SANs of a DER certificate.
pub(crate) fn uri_sans(cert: &CertificateDer<'_>) -> Result<Vec<String>, PeerIdentityError> {
    let (_, parsed) = X509Certificate::from_der(cert).map_err(|e| PeerIdentityError::Unreadable(e.to_string()))?;
    let san = parsed.subject_alternative_name().map_err(|e| PeerIdentityError::Unreadable(e.to_string()))?;
    Ok(san
        .map(|ext| {
            ext.value
                .general_names
                .iter()
                .filter_map(|name| match name {
                    GeneralName::URI(uri) => Some(uri.to_string()),
                    _ => None,
                })
                .collect()
        })
        .unwrap_or_default())
}

/// The first SPIFFE identity in `trust_domain` that a certificate carries.
pub(crate) fn identity_in_trust_domain(
    cert: &CertificateDer<'_>,
    trust_domain: &str,
) -> Result<Identity, PeerIdentityError> {
    let found = uri_sans(cert)?;
    found
        .iter()
        .filter_map(|uri| uri.parse::<Identity>().ok())
        .find(|id| id.in_trust_domain(trust_domain))
        .ok_or_else(|| PeerIdentityError::WrongTrustDomain { trust_domain: trust_domain.to_string(), found })
}

fn rejected(e: PeerIdentityError) -> rustls::Error {
    rustls::Error::InvalidCertificate(CertificateError::Other(OtherError(Arc::new(e))))
}

/// Chain verification shared by both sides.
#[derive(Debug)]
pub(crate) struct Chain {
    pub(crate) anchors: Arc<[TrustAnchor<'static>]>,
    pub(crate) algs: WebPkiSupportedAlgorithms,
}

impl Chain {
    /// Verifies `end_entity`'s chain to the mesh roots for `usage`, then lets `peer_check` judge its identity.
    fn verify_peer(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
        usage: webpki::KeyUsage,
        peer_check: impl FnOnce(&CertificateDer<'_>) -> Result<(), PeerIdentityError>,
    ) -> Result<(), rustls::Error> {
        let cert = webpki::EndEntityCert::try_from(end_entity).map_err(pki_error)?;
        cert.verify_for_usage(self.algs.all, &self.anchors, intermediates, now, usage, None, None)
            .map_err(pki_error)?;
        peer_check(end_entity).map_err(rejected)
    }
}

/// The handshake signature checks and schemes that both verifier traits ask for, answered from the
/// verifier's `chain` so the client and server sides cannot drift apart.
macro_rules! signatures_from_chain {
    () => {
        fn verify_tls12_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            rustls::crypto::verify_tls12_signature(message, cert, dss, &self.chain.algs)
        }

        fn verify_tls13_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            rustls::crypto::verify_tls13_signature(message, cert, dss, &self.chain.algs)
        }

        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            self.chain.algs.supported_schemes()
        }
    };
}

fn pki_error(e: webpki::Error) -> rustls::Error {
    let kind = match e {
        webpki::Error::UnknownIssuer => CertificateError::UnknownIssuer,
        webpki::Error::CertExpired { .. } => CertificateError::Expired,
        webpki::Error::CertNotValidYet { .. } => CertificateError::NotValidYet,
        webpki::Error::BadDer | webpki::Error::BadDerTime => CertificateError::BadEncoding,
        other => CertificateError::Other(OtherError(Arc::new(other))),
    };
    rustls::Error::InvalidCertificate(kind)
}

/// Server side: accepts clients whose chain reaches the mesh roots and who are in our trust domain.
#[derive(Debug)]
pub(crate) struct MeshClientVerifier {
    pub(crate) chain: Chain,
    pub(crate) trust_domain: String,
}

impl ClientCertVerifier for MeshClientVerifier {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.chain.verify_peer(end_entity, intermediates, now, webpki::KeyUsage::client_auth(), |cert| {
            identity_in_trust_domain(cert, &self.trust_domain).map(|_| ())
        })?;
        Ok(ClientCertVerified::assertion())
    }

    signatures_from_chain!();
}

/// Client side: accepts a server whose chain reaches the mesh roots and which is the expected identity.
#[derive(Debug)]
pub(crate) struct MeshServerVerifier {
    pub(crate) chain: Chain,
    pub(crate) expected: Identity,
}

impl ServerCertVerifier for MeshServerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.chain.verify_peer(end_entity, intermediates, now, webpki::KeyUsage::server_auth(), |cert| {
            let expected = self.expected.to_string();
            let found = uri_sans(cert)?;
            if found.contains(&expected) {
                Ok(())
            } else {
                Err(PeerIdentityError::Mismatch { expected, found })
            }
        })?;
        Ok(ServerCertVerified::assertion())
    }

    signatures_from_chain!();
}

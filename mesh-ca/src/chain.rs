//! Decoding and validation of the certificate chain istiod returns, before anything uses it.
//!
//! istiod's `cert_chain` is: the leaf, each intermediate as its own element, then the root bundle, unsplit, last
//! (it may hold several roots during a root rotation). [`verify_chain`] accepts a chain only if:
//! * it has between 2 and `max_elements` elements, each within its byte bound, each element but the last one
//!   PEM certificate and the last one to `max_roots` certificates (other PEM sections are ignored);
//! * the leaf carries the public key of the request's key and exactly one URI SAN, the requested identity;
//! * at least one root of the bundle is within its validity period, and the leaf chains through the intermediates
//!   to such a root (webpki, ring algorithms), every certificate on the path valid now, for both server and client
//!   authentication (the proxy presents the certificate in both roles).
//!
//! Parsing is bounded by those limits and never panics on input; the roots returned are the trust anchors the
//! certificate's user should trust (ztunnel takes its mesh roots from the same place).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use hbone::identity::Identity;
use prost::Message;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, UnixTime};
use webpki::{EndEntityCert, KeyUsage};
use x509_parser::prelude::{FromDer, GeneralName, X509Certificate};

use crate::wire::IstioCertificateResponse;

/// Bounds on a response, checked before parsing.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Most elements in `cert_chain` (leaf + intermediates + the root bundle).
    pub max_elements: usize,
    /// Largest leaf or intermediate element, in bytes of PEM.
    pub max_element_bytes: usize,
    /// Largest root bundle element, in bytes of PEM.
    pub max_bundle_bytes: usize,
    /// Most certificates in the root bundle.
    pub max_roots: usize,
}

impl Default for Limits {
    /// 16 elements, 64 KiB per certificate element, a 1 MiB bundle of at most 64 roots: far above what istiod
    /// sends (leaf + a few intermediates + one or two roots of 1–2 KiB each).
    fn default() -> Self {
        Limits { max_elements: 16, max_element_bytes: 64 * 1024, max_bundle_bytes: 1024 * 1024, max_roots: 64 }
    }
}

/// Why a chain was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChainError {
    /// The response message does not decode.
    #[error("the response does not decode: {0}")]
    Decode(String),
    /// Fewer than two elements: istiod always sends the leaf and the root bundle.
    #[error("the CA returned {0} chain elements, need the leaf and the root bundle")]
    TooShort(usize),
    /// More elements than the limit.
    #[error("the CA returned {count} chain elements, over the limit of {max}")]
    TooManyElements {
        /// Elements received.
        count: usize,
        /// The limit.
        max: usize,
    },
    /// An element over its byte limit.
    #[error("chain element {index} is {len} bytes, over the limit of {max}")]
    ElementTooLarge {
        /// Index in `cert_chain`.
        index: usize,
        /// Its size.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// An element's PEM is malformed or holds the wrong number of certificates.
    #[error("chain element {index}: {reason}")]
    Pem {
        /// Index in `cert_chain`.
        index: usize,
        /// What is wrong.
        reason: String,
    },
    /// The leaf does not parse as X.509.
    #[error("the leaf certificate does not parse: {0}")]
    Leaf(String),
    /// The leaf is not for the key of the request.
    #[error("the leaf certificate is not for the requested key")]
    KeyMismatch,
    /// The leaf's URI SANs are not exactly the requested identity.
    #[error("the leaf certificate names {found:?}, not the requested {expected}")]
    SanMismatch {
        /// The requested identity.
        expected: String,
        /// The URI SANs found.
        found: Vec<String>,
    },
    /// No root of the bundle is within its validity period.
    #[error("no usable root in the CA's bundle: {0}")]
    NoValidRoot(String),
    /// The leaf does not chain to a valid root, or a certificate on the path is not valid now.
    #[error("the certificate chain does not verify: {0}")]
    Verify(String),
}

/// A chain that passed [`verify_chain`].
#[derive(Clone, Debug)]
pub struct VerifiedChain {
    /// The leaf then the intermediates, in the order to present them.
    pub chain: Vec<CertificateDer<'static>>,
    /// The roots of the bundle that are within their validity period.
    pub roots: Vec<CertificateDer<'static>>,
    /// The leaf's notBefore.
    pub not_before: SystemTime,
    /// The leaf's notAfter.
    pub not_after: SystemTime,
    /// The leaf's serial number, decimal.
    pub serial: String,
    /// The leaf's issuer, as an RFC 4514 string.
    pub issuer: String,
}

/// Decodes a serialized `IstioCertificateResponse`, refusing more than `max_elements` chain elements by counting
/// them on the wire before prost allocates them.
pub fn decode_response(bytes: &[u8], limits: &Limits) -> Result<IstioCertificateResponse, ChainError> {
    let [count] = xds::wire::scan::count_fields(bytes, [1]).map_err(|e| ChainError::Decode(e.to_string()))?;
    if count > limits.max_elements {
        return Err(ChainError::TooManyElements { count, max: limits.max_elements });
    }
    IstioCertificateResponse::decode(bytes).map_err(|e| ChainError::Decode(e.to_string()))
}

fn pem_certs(index: usize, pem: &str, max: usize) -> Result<Vec<CertificateDer<'static>>, ChainError> {
    let mut certs = Vec::new();
    for cert in CertificateDer::pem_slice_iter(pem.as_bytes()) {
        let cert = cert.map_err(|e| ChainError::Pem { index, reason: e.to_string() })?;
        if certs.len() == max {
            return Err(ChainError::Pem { index, reason: format!("more than {max} certificates") });
        }
        certs.push(cert);
    }
    if certs.is_empty() {
        return Err(ChainError::Pem { index, reason: "no PEM certificate".into() });
    }
    Ok(certs)
}

fn system_time(seconds: i64) -> SystemTime {
    match u64::try_from(seconds) {
        Ok(s) => UNIX_EPOCH + Duration::from_secs(s),
        Err(_) => UNIX_EPOCH,
    }
}

/// Checks `cert_chain` as returned for a request for `identity` made with the key whose raw public key is
/// `public_key`, at time `now`; see the module documentation for what is checked.
pub fn verify_chain(
    cert_chain: &[String],
    identity: &Identity,
    public_key: &[u8],
    now: SystemTime,
    limits: &Limits,
) -> Result<VerifiedChain, ChainError> {
    let count = cert_chain.len();
    if count > limits.max_elements {
        return Err(ChainError::TooManyElements { count, max: limits.max_elements });
    }
    let Some((bundle, certs)) = cert_chain.split_last().filter(|(_, certs)| !certs.is_empty()) else {
        return Err(ChainError::TooShort(count));
    };
    for (index, element) in certs.iter().enumerate() {
        if element.len() > limits.max_element_bytes {
            return Err(ChainError::ElementTooLarge { index, len: element.len(), max: limits.max_element_bytes });
        }
    }
    if bundle.len() > limits.max_bundle_bytes {
        return Err(ChainError::ElementTooLarge { index: count - 1, len: bundle.len(), max: limits.max_bundle_bytes });
    }
    let mut chain = Vec::with_capacity(certs.len());
    for (index, element) in certs.iter().enumerate() {
        chain.extend(pem_certs(index, element, 1)?);
    }
    let bundle = pem_certs(count - 1, bundle, limits.max_roots)?;

    let leaf = &chain[0];
    let (_, parsed) = X509Certificate::from_der(leaf).map_err(|e| ChainError::Leaf(e.to_string()))?;
    if parsed.public_key().subject_public_key.data.as_ref() != public_key {
        return Err(ChainError::KeyMismatch);
    }
    let sans = parsed.subject_alternative_name().map_err(|e| ChainError::Leaf(e.to_string()))?;
    let found: Vec<String> = sans
        .iter()
        .flat_map(|san| san.value.general_names.iter())
        .filter_map(|name| match name {
            GeneralName::URI(uri) => Some((*uri).to_owned()),
            _ => None,
        })
        .collect();
    let expected = identity.to_string();
    if found.len() != 1 || found[0] != expected {
        return Err(ChainError::SanMismatch { expected, found });
    }
    let not_before = system_time(parsed.validity().not_before.timestamp());
    let not_after = system_time(parsed.validity().not_after.timestamp());
    let serial = parsed.serial.to_string();
    let issuer = parsed.issuer().to_string();

    let now_secs = now.duration_since(UNIX_EPOCH).unwrap_or_default().as_secs();
    let now_i64 = i64::try_from(now_secs).unwrap_or(i64::MAX);
    let mut roots = Vec::with_capacity(bundle.len());
    let mut unusable = Vec::new();
    for (i, root) in bundle.into_iter().enumerate() {
        match X509Certificate::from_der(&root) {
            Ok((_, cert)) => {
                let validity = cert.validity();
                if validity.not_after.timestamp() < now_i64 {
                    unusable.push(format!("root {i} ({}) expired at {}", cert.subject(), validity.not_after));
                } else if validity.not_before.timestamp() > now_i64 {
                    unusable.push(format!("root {i} ({}) is not valid before {}", cert.subject(), validity.not_before));
                } else {
                    roots.push(root.clone());
                }
            }
            Err(e) => unusable.push(format!("root {i} does not parse: {e}")),
        }
    }
    if roots.is_empty() {
        return Err(ChainError::NoValidRoot(unusable.join("; ")));
    }
    let anchors = roots.iter().filter_map(|root| webpki::anchor_from_trusted_cert(root).ok()).collect::<Vec<_>>();
    let end_entity = EndEntityCert::try_from(leaf).map_err(|e| ChainError::Verify(format!("{e:?}")))?;
    let time = UnixTime::since_unix_epoch(Duration::from_secs(now_secs));
    for usage in [KeyUsage::server_auth(), KeyUsage::client_auth()] {
        end_entity
            .verify_for_usage(webpki::ALL_VERIFICATION_ALGS, &anchors, &chain[1..], time, usage, None, None)
            .map_err(|e| ChainError::Verify(format!("{e:?}")))?;
    }
    Ok(VerifiedChain { chain, roots, not_before, not_after, serial, issuer })
}

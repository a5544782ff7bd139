//! The fake's own PKI: a CA, a serving certificate it signs, and the rustls server configuration.
//!
//! With a state directory both live in files (kubeadm's names: `ca.crt`, `ca.key`, `apiserver.crt`,
//! `apiserver.key`), so a restarted server presents a certificate its old clients already trust. The serving
//! certificate is reused while it covers every name asked for, and re-issued by the same CA otherwise.

use crate::state;
use crate::Error;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
    PKCS_ECDSA_P256_SHA256,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Arc;

const CA_CERT: &str = "ca.crt";
const CA_KEY: &str = "ca.key";
const SERVING_CERT: &str = "apiserver.crt";
const SERVING_KEY: &str = "apiserver.key";

/// Names every serving certificate carries, besides the configured ones: what in-cluster clients and local
/// tests dial.
const DEFAULT_SANS: [&str; 7] = [
    "localhost",
    "127.0.0.1",
    "::1",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
];

/// The CA clients trust and the server side of TLS.
pub(crate) struct Pki {
    /// PEM of the CA certificate, for kubeconfigs and in-cluster `ca.crt` files.
    pub ca_pem: String,
    /// rustls configuration presenting the serving certificate (ALPN h2 and http/1.1).
    pub server: Arc<rustls::ServerConfig>,
}

impl std::fmt::Debug for Pki {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pki").finish_non_exhaustive()
    }
}

fn cert_err(what: &str) -> impl Fn(rcgen::Error) -> Error + '_ {
    move |e| Error::Certificate(format!("{what}: {e}"))
}

/// Loads the PKI from `dir` (creating what is missing there), or creates it in memory without a directory.
pub(crate) fn load_or_create(dir: Option<&Path>, extra_sans: &[String]) -> Result<Pki, Error> {
    let sans: BTreeSet<String> = DEFAULT_SANS.iter().map(|s| s.to_string()).chain(extra_sans.iter().cloned()).collect();
    let (ca_pem, ca_key_pem) = match dir.and_then(|d| read_pair(d, CA_CERT, CA_KEY).transpose()) {
        Some(pair) => pair?,
        None => {
            let (cert, key) = new_ca()?;
            if let Some(d) = dir {
                state::write(d, CA_KEY, &key, true)?;
                state::write(d, CA_CERT, &cert, false)?;
            }
            (cert, key)
        }
    };
    let ca_key = KeyPair::from_pem(&ca_key_pem).map_err(cert_err("reading the CA key"))?;
    let issuer = Issuer::from_ca_cert_pem(&ca_pem, ca_key).map_err(cert_err("reading the CA certificate"))?;
    let existing = dir.and_then(|d| read_pair(d, SERVING_CERT, SERVING_KEY).transpose()).transpose()?;
    let (cert_pem, key_pem) = match existing.filter(|(cert, _)| covers(cert, &sans)) {
        Some(pair) => pair,
        None => {
            let (cert, key) = new_serving(&issuer, &sans)?;
            if let Some(d) = dir {
                state::write(d, SERVING_KEY, &key, true)?;
                state::write(d, SERVING_CERT, &cert, false)?;
            }
            (cert, key)
        }
    };
    let server = server_config(&cert_pem, &key_pem)?;
    Ok(Pki { ca_pem, server })
}

/// Both files of a certificate and key pair, `None` when either is missing.
fn read_pair(dir: &Path, cert: &str, key: &str) -> Result<Option<(String, String)>, Error> {
    match (state::read(dir, cert)?, state::read(dir, key)?) {
        (Some(c), Some(k)) => Ok(Some((c, k))),
        _ => Ok(None),
    }
}

fn new_ca() -> Result<(String, String), Error> {
    let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).map_err(cert_err("generating the CA key"))?;
    let mut params = CertificateParams::default();
    params.distinguished_name.push(DnType::CommonName, "fake-apiserver-ca");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    let cert = params.self_signed(&key).map_err(cert_err("signing the CA certificate"))?;
    Ok((cert.pem(), key.serialize_pem()))
}

fn new_serving(issuer: &Issuer<'_, KeyPair>, sans: &BTreeSet<String>) -> Result<(String, String), Error> {
    let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).map_err(cert_err("generating the serving key"))?;
    let mut params = CertificateParams::new(sans.iter().cloned().collect::<Vec<_>>())
        .map_err(cert_err("the serving certificate's names"))?;
    params.distinguished_name.push(DnType::CommonName, "kube-apiserver");
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
    params.use_authority_key_identifier_extension = true;
    let cert = params.signed_by(&key, issuer).map_err(cert_err("signing the serving certificate"))?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// Whether the certificate in `pem` names every one of `sans`.
fn covers(pem: &str, sans: &BTreeSet<String>) -> bool {
    use x509_parser::extensions::GeneralName;
    let Ok(der) = CertificateDer::from_pem_slice(pem.as_bytes()) else { return false };
    let Ok((_, cert)) = x509_parser::parse_x509_certificate(&der) else { return false };
    let Ok(Some(san)) = cert.subject_alternative_name() else { return false };
    let names: BTreeSet<String> = san
        .value
        .general_names
        .iter()
        .filter_map(|name| match name {
            GeneralName::DNSName(dns) => Some(dns.to_string()),
            GeneralName::IPAddress(bytes) => match bytes.len() {
                4 => <[u8; 4]>::try_from(*bytes).ok().map(|b| std::net::IpAddr::from(b).to_string()),
                16 => <[u8; 16]>::try_from(*bytes).ok().map(|b| std::net::IpAddr::from(b).to_string()),
                _ => None,
            },
            _ => None,
        })
        .collect();
    sans.is_subset(&names)
}

fn server_config(cert_pem: &str, key_pem: &str) -> Result<Arc<rustls::ServerConfig>, Error> {
    let tls_err = |what: &str, e: &dyn std::fmt::Display| Error::Certificate(format!("{what}: {e}"));
    let cert = CertificateDer::from_pem_slice(cert_pem.as_bytes()).map_err(|e| tls_err("serving certificate", &e))?;
    let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).map_err(|e| tls_err("serving key", &e))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| tls_err("TLS versions", &e))?
        .with_no_client_auth()
        .with_single_cert(vec![cert], key)
        .map_err(|e| tls_err("serving certificate and key", &e))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_state_dir_keeps_the_ca_and_reissues_only_for_new_names() {
        let dir = tempfile::tempdir().unwrap();
        let first = load_or_create(Some(dir.path()), &[]).unwrap();
        let serving = std::fs::read_to_string(dir.path().join(SERVING_CERT)).unwrap();
        let again = load_or_create(Some(dir.path()), &["127.0.0.1".into()]).unwrap();
        assert_eq!(first.ca_pem, again.ca_pem, "the CA survives a restart");
        assert_eq!(std::fs::read_to_string(dir.path().join(SERVING_CERT)).unwrap(), serving, "covered: reused");
        let wider = load_or_create(Some(dir.path()), &["10.9.8.7".into(), "api.example".into()]).unwrap();
        assert_eq!(wider.ca_pem, first.ca_pem);
        let reissued = std::fs::read_to_string(dir.path().join(SERVING_CERT)).unwrap();
        assert_ne!(reissued, serving, "a new name needs a new serving certificate");
        let want: BTreeSet<String> = ["10.9.8.7", "api.example", "localhost"].map(String::from).into();
        assert!(covers(&reissued, &want));
        assert!(!covers(&serving, &want));
    }
}

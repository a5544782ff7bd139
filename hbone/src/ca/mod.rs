//! The mesh certificate authority: loaded from Istio's `cacerts` layout or created self-signed in a state
//! directory, it mints the short-lived workload certificates the proxy presents on HBONE.

mod keys;
mod workload;

pub use workload::WorkloadCert;

use std::fs;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType, SerialNumber, PKCS_ECDSA_P256_SHA256,
};
use ring::rand::{SecureRandom, SystemRandom};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;

use crate::identity::Identity;

/// The signing certificate (Istio `cacerts` name).
pub const CA_CERT_FILE: &str = "ca-cert.pem";
/// The signing key (Istio `cacerts` name).
pub const CA_KEY_FILE: &str = "ca-key.pem";
/// The trust anchors peers are verified against (Istio `cacerts` name).
pub const ROOT_CERT_FILE: &str = "root-cert.pem";
/// The chain from the signing certificate up to the root (Istio `cacerts` name).
pub const CERT_CHAIN_FILE: &str = "cert-chain.pem";

/// The default leaf lifetime, as in Istio.
pub const DEFAULT_LEAF_LIFETIME: Duration = Duration::from_secs(24 * 3600);
/// How long a self-created CA is valid.
const SELF_SIGNED_LIFETIME: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
/// Leaves are backdated this much so peers whose clocks run slightly behind still accept them.
const CLOCK_SKEW_ALLOWANCE: Duration = Duration::from_secs(60);

/// Why the CA could not be loaded, created, or could not mint.
#[derive(Debug, thiserror::Error)]
pub enum CaError {
    /// A CA file could not be read or written.
    #[error("{action} {path}: {source}")]
    Io {
        /// What was being done, e.g. "reading".
        action: &'static str,
        /// The file concerned.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A CA file did not hold what it should.
    #[error("{path}: {reason}")]
    Invalid {
        /// The file concerned.
        path: PathBuf,
        /// What was wrong with it.
        reason: String,
    },
    /// rcgen failed to build or sign a certificate.
    #[error("{what}: {source}")]
    Sign {
        /// Which certificate was being made.
        what: String,
        /// The underlying error.
        source: rcgen::Error,
    },
}

/// A mesh CA able to sign workload leaves; the roots it carries are the trust bundle for peers.
pub struct MeshCa {
    issuer: Issuer<'static, KeyPair>,
    ca_cert: CertificateDer<'static>,
    chain: Vec<CertificateDer<'static>>,
    roots: Vec<CertificateDer<'static>>,
    leaf_lifetime: Duration,
}

impl std::fmt::Debug for MeshCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MeshCa")
            .field("roots", &self.roots.len())
            .field("leaf_lifetime", &self.leaf_lifetime)
            .finish_non_exhaustive()
    }
}

impl MeshCa {
    /// Loads a CA from a directory in Istio's `cacerts` layout. `cert-chain.pem` is optional; without
    /// `root-cert.pem` the signing certificate itself is the root.
    pub fn load(dir: &Path) -> Result<Self, CaError> {
        let ca_cert_path = dir.join(CA_CERT_FILE);
        let ca_cert = read_certs(&ca_cert_path)?.remove(0);
        let key_path = dir.join(CA_KEY_FILE);
        let key_pem = read(&key_path)?;
        let key =
            keys::key_pair_from_pem(&key_pem).map_err(|reason| CaError::Invalid { path: key_path.clone(), reason })?;
        let issuer = Issuer::from_ca_cert_der(&ca_cert, key).map_err(|source| CaError::Invalid {
            path: ca_cert_path.clone(),
            reason: format!("cannot use as issuer: {source}"),
        })?;
        let root_path = dir.join(ROOT_CERT_FILE);
        let roots = if root_path.exists() { read_certs(&root_path)? } else { vec![ca_cert.clone()] };
        let chain_path = dir.join(CERT_CHAIN_FILE);
        let chain = if chain_path.exists() {
            read_certs(&chain_path)?.into_iter().filter(|c| *c != ca_cert).collect()
        } else {
            Vec::new()
        };
        Ok(MeshCa { issuer, ca_cert, chain, roots, leaf_lifetime: DEFAULT_LEAF_LIFETIME })
    }

    /// Loads the CA kept in `state_dir`, creating a self-signed one there first if there is none, so
    /// that a restarted proxy keeps issuing certificates its peers already trust.
    pub fn load_or_create(state_dir: &Path, trust_domain: &str) -> Result<Self, CaError> {
        if !state_dir.join(CA_CERT_FILE).exists() {
            create_self_signed(state_dir, trust_domain)?;
            tracing::info!(
                dir = %state_dir.display(),
                trust_domain,
                "no mesh CA configured: created a self-signed mesh CA"
            );
        }
        Self::load(state_dir)
    }

    /// Changes the lifetime of the leaves minted from now on (tests use short ones to see rotation).
    pub fn with_leaf_lifetime(mut self, lifetime: Duration) -> Self {
        self.leaf_lifetime = lifetime;
        self
    }

    /// The trust anchors every mesh peer must chain to.
    pub fn roots(&self) -> &[CertificateDer<'static>] {
        &self.roots
    }

    /// Mints a leaf for `identity`: P-256, its SPIFFE URI as the only SAN, EKU serverAuth + clientAuth,
    /// valid for the leaf lifetime from now.
    pub fn mint(&self, identity: &Identity) -> Result<WorkloadCert, CaError> {
        let sign_err = |source| CaError::Sign { what: format!("leaf for {identity}"), source };
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).map_err(sign_err)?;
        let issued_at = whole_seconds(SystemTime::now());
        let expires_at = issued_at + self.leaf_lifetime;
        let mut params = CertificateParams::default();
        params.distinguished_name = DistinguishedName::new();
        params.subject_alt_names = vec![SanType::URI(identity.to_string().try_into().map_err(sign_err)?)];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
        params.not_before = offset_time(issued_at - CLOCK_SKEW_ALLOWANCE);
        params.not_after = offset_time(expires_at);
        params.serial_number = Some(random_serial());
        params.use_authority_key_identifier_extension = true;
        let cert = params.signed_by(&key, &self.issuer).map_err(sign_err)?;
        let mut chain = vec![cert.der().clone(), self.ca_cert.clone()];
        chain.extend(self.chain.iter().cloned());
        Ok(WorkloadCert::new(identity.clone(), chain, key.serialize_der(), issued_at, expires_at))
    }
}

fn create_self_signed(dir: &Path, trust_domain: &str) -> Result<(), CaError> {
    let sign_err = |source| CaError::Sign { what: format!("self-signed mesh CA in {}", dir.display()), source };
    // A new state directory is the proxy's alone; an existing one keeps the permissions it was given.
    fs::DirBuilder::new().recursive(true).mode(0o700).create(dir).map_err(|source| CaError::Io {
        action: "creating",
        path: dir.to_path_buf(),
        source,
    })?;
    let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).map_err(sign_err)?;
    let now = whole_seconds(SystemTime::now());
    let mut params = CertificateParams::default();
    params.distinguished_name = DistinguishedName::new();
    params.distinguished_name.push(DnType::OrganizationName, trust_domain);
    params.distinguished_name.push(DnType::CommonName, "hbone mesh CA");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    params.not_before = offset_time(now - CLOCK_SKEW_ALLOWANCE);
    params.not_after = offset_time(now + SELF_SIGNED_LIFETIME);
    params.serial_number = Some(random_serial());
    let cert = params.self_signed(&key).map_err(sign_err)?;
    // The certificate goes last: its presence is what marks the directory as holding a CA.
    write(&dir.join(CA_KEY_FILE), key.serialize_pem().as_bytes(), 0o600)?;
    write(&dir.join(ROOT_CERT_FILE), cert.pem().as_bytes(), 0o644)?;
    write(&dir.join(CERT_CHAIN_FILE), cert.pem().as_bytes(), 0o644)?;
    write(&dir.join(CA_CERT_FILE), cert.pem().as_bytes(), 0o644)
}

fn read(path: &Path) -> Result<Vec<u8>, CaError> {
    fs::read(path).map_err(|source| CaError::Io { action: "reading", path: path.to_path_buf(), source })
}

/// The certificates of the PEM file at `path` (at least one), e.g. a mesh root bundle (`root-cert.pem`).
pub fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, CaError> {
    parse_certs(&read(path)?, path)
}

/// The certificates of `pem` (at least one); `origin` names where it came from in errors.
pub fn parse_certs(pem: &[u8], origin: &Path) -> Result<Vec<CertificateDer<'static>>, CaError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| CaError::Invalid { path: origin.to_path_buf(), reason: format!("bad PEM: {e}") })?;
    if certs.is_empty() {
        return Err(CaError::Invalid { path: origin.to_path_buf(), reason: "no certificate".to_string() });
    }
    Ok(certs)
}

/// Writes `data` to `path` with permissions `mode`: into a new file of an unpredictable name beside it (see
/// [`write_new`]), then renamed over `path`. A crash never leaves a half-written file behind, and a symlink
/// planted at `path` is replaced, never followed.
fn write(path: &Path, data: &[u8], mode: u32) -> Result<(), CaError> {
    let io_err = |source| CaError::Io { action: "writing", path: path.to_path_buf(), source };
    let mut nonce = [0u8; 8];
    SystemRandom::new().fill(&mut nonce).expect("the system random source works");
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("ca");
    let hex: String = nonce.iter().map(|b| format!("{b:02x}")).collect();
    let tmp = path.with_file_name(format!(".{name}.{hex}.tmp"));
    write_new(&tmp, data, mode)?;
    if let Err(source) = fs::rename(&tmp, path) {
        let _ = fs::remove_file(&tmp);
        return Err(io_err(source));
    }
    // Make the rename itself durable.
    if let Some(dir) = path.parent() {
        let _ = fs::File::open(dir).and_then(|d| d.sync_all());
    }
    Ok(())
}

/// Creates `path` with `O_CREAT | O_EXCL | O_NOFOLLOW` (an existing file or symlink there is an error, never
/// written through) and permissions exactly `mode` whatever the umask, writes `data` and syncs it. On failure
/// after creating it, removes it again.
fn write_new(path: &Path, data: &[u8], mode: u32) -> Result<(), CaError> {
    let io_err = |source| CaError::Io { action: "writing", path: path.to_path_buf(), source };
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .mode(mode)
        .open(path)
        .map_err(io_err)?;
    let written = file
        .set_permissions(fs::Permissions::from_mode(mode))
        .and_then(|()| file.write_all(data))
        .and_then(|()| file.sync_all());
    if let Err(source) = written {
        let _ = fs::remove_file(path);
        return Err(io_err(source));
    }
    Ok(())
}

fn random_serial() -> SerialNumber {
    let mut bytes = [0u8; 16];
    SystemRandom::new().fill(&mut bytes).expect("the system random source works");
    // Positive and a full 16 bytes long.
    bytes[0] = (bytes[0] & 0x7f) | 0x40;
    SerialNumber::from_slice(&bytes)
}

fn whole_seconds(t: SystemTime) -> SystemTime {
    let secs = t.duration_since(UNIX_EPOCH).unwrap_or_default().as_secs();
    UNIX_EPOCH + Duration::from_secs(secs)
}

fn offset_time(t: SystemTime) -> time::OffsetDateTime {
    let secs = t.duration_since(UNIX_EPOCH).unwrap_or_default().as_secs();
    time::OffsetDateTime::from_unix_timestamp(secs as i64).expect("a representable time")
}

#[cfg(test)]
mod tests;

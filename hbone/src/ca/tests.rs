use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rustls::pki_types::UnixTime;
use x509_parser::extensions::GeneralName;
use x509_parser::prelude::{FromDer, X509Certificate};

use super::*;

fn id() -> Identity {
    "spiffe://cluster.local/ns/default/sa/web".parse().unwrap()
}

fn unix(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH).unwrap().as_secs() as i64
}

#[test]
fn mint_makes_a_p256_spiffe_leaf_for_both_tls_roles() {
    let dir = tempfile::tempdir().unwrap();
    let ca = MeshCa::load_or_create(dir.path(), "cluster.local").unwrap();
    let before = whole_seconds(SystemTime::now());
    let leaf = ca.mint(&id()).unwrap();
    let (_, cert) = X509Certificate::from_der(&leaf.chain()[0]).unwrap();

    let sans: Vec<String> = cert
        .subject_alternative_name()
        .unwrap()
        .unwrap()
        .value
        .general_names
        .iter()
        .map(|n| format!("{n:?}"))
        .collect();
    assert_eq!(sans, vec![format!("{:?}", GeneralName::URI("spiffe://cluster.local/ns/default/sa/web"))]);
    assert!(cert.subject().iter().next().is_none(), "subject is empty");

    let eku = cert.extended_key_usage().unwrap().unwrap().value;
    assert!(eku.server_auth && eku.client_auth);
    assert!(!cert.is_ca());

    let spki = cert.public_key();
    assert_eq!(spki.algorithm.algorithm.to_id_string(), "1.2.840.10045.2.1");
    let curve = spki.algorithm.parameters.as_ref().unwrap().as_oid().unwrap();
    assert_eq!(curve.to_id_string(), "1.2.840.10045.3.1.7", "P-256");

    let not_after = cert.validity().not_after.timestamp();
    assert_eq!(not_after, unix(leaf.expires_at()));
    let lifetime = leaf.expires_at().duration_since(leaf.issued_at()).unwrap();
    assert_eq!(lifetime, DEFAULT_LEAF_LIFETIME);
    assert!(leaf.issued_at() >= before);
    assert!(cert.validity().not_before.timestamp() <= unix(before));

    // Chain: leaf then the CA certificate, and it verifies against the roots.
    assert_eq!(leaf.chain()[1], ca.roots()[0]);
    assert!(!leaf.needs_rotation(leaf.issued_at()));
    assert!(leaf.needs_rotation(leaf.issued_at() + lifetime / 2));
}

#[test]
fn leaf_lifetime_is_configurable() {
    let dir = tempfile::tempdir().unwrap();
    let ca = MeshCa::load_or_create(dir.path(), "cluster.local").unwrap().with_leaf_lifetime(Duration::from_secs(120));
    let leaf = ca.mint(&id()).unwrap();
    let (_, cert) = X509Certificate::from_der(&leaf.chain()[0]).unwrap();
    assert_eq!(cert.validity().not_after.timestamp(), unix(leaf.issued_at()) + 120);
}

#[test]
fn self_signed_ca_persists_across_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let first = MeshCa::load_or_create(dir.path(), "cluster.local").unwrap();
    for file in [CA_CERT_FILE, CA_KEY_FILE, ROOT_CERT_FILE, CERT_CHAIN_FILE] {
        assert!(dir.path().join(file).exists(), "{file}");
    }
    let mode = std::fs::metadata(dir.path().join(CA_KEY_FILE)).unwrap().permissions();
    assert_eq!(std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777, 0o600);
    let second = MeshCa::load_or_create(dir.path(), "cluster.local").unwrap();
    assert_eq!(first.roots(), second.roots());
}

#[test]
fn loads_istio_cacerts_with_an_intermediate() {
    // root -> intermediate (ca-cert) -> leaf; cert-chain.pem = intermediate + root, as Istio's plugin certs.
    let root_key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).unwrap();
    let mut root_params = CertificateParams::default();
    root_params.distinguished_name.push(DnType::CommonName, "Root CA");
    root_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    root_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let root = root_params.self_signed(&root_key).unwrap();
    let root_issuer = Issuer::new(root_params, root_key);

    let int_key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).unwrap();
    let mut int_params = CertificateParams::default();
    int_params.distinguished_name.push(DnType::OrganizationName, "Istio");
    int_params.distinguished_name.push(DnType::CommonName, "Intermediate CA");
    int_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    int_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let int = int_params.signed_by(&int_key, &root_issuer).unwrap();

    let dir = tempfile::tempdir().unwrap();
    let p = |f: &str| dir.path().join(f);
    std::fs::write(p(CA_CERT_FILE), int.pem()).unwrap();
    std::fs::write(p(CA_KEY_FILE), int_key.serialize_pem()).unwrap();
    std::fs::write(p(ROOT_CERT_FILE), root.pem()).unwrap();
    std::fs::write(p(CERT_CHAIN_FILE), format!("{}{}", int.pem(), root.pem())).unwrap();

    let ca = MeshCa::load(dir.path()).unwrap();
    assert_eq!(ca.roots(), &[root.der().clone()]);
    let leaf = ca.mint(&id()).unwrap();
    assert_eq!(leaf.chain().len(), 3, "leaf, intermediate, root");
    assert_eq!(&leaf.chain()[1], int.der());

    let anchor = webpki::anchor_from_trusted_cert(root.der()).unwrap();
    let ee = webpki::EndEntityCert::try_from(&leaf.chain()[0]).unwrap();
    ee.verify_for_usage(
        webpki::ALL_VERIFICATION_ALGS,
        &[anchor],
        &leaf.chain()[1..],
        UnixTime::now(),
        webpki::KeyUsage::client_auth(),
        None,
        None,
    )
    .expect("the leaf chains to the Istio root");
}

#[test]
fn load_names_the_missing_file() {
    let dir = tempfile::tempdir().unwrap();
    let err = MeshCa::load(dir.path()).unwrap_err().to_string();
    assert!(err.contains(CA_CERT_FILE), "{err}");
}

#[test]
fn ca_files_are_created_exclusively_without_following_symlinks() {
    use std::os::unix::fs::{symlink, PermissionsExt};

    let dir = tempfile::tempdir().unwrap();
    let victim = dir.path().join("victim");
    std::fs::write(&victim, "do not overwrite").unwrap();
    let state = dir.path().join("state");
    std::fs::create_dir(&state).unwrap();
    // Symlinks planted where a CA file or a predictable temporary file of one would go.
    for name in [CA_KEY_FILE, "ca-key.tmp", ".ca-key.pem.tmp", CA_CERT_FILE, "ca-cert.tmp"] {
        symlink(&victim, state.join(name)).unwrap();
    }
    // The certificate's symlink marks the directory as holding a CA; remove it so one is created.
    std::fs::remove_file(state.join(CA_CERT_FILE)).unwrap();
    MeshCa::load_or_create(&state, "cluster.local").unwrap();
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "do not overwrite", "a symlink was written through");
    let key = std::fs::symlink_metadata(state.join(CA_KEY_FILE)).unwrap();
    assert!(key.file_type().is_file(), "the key replaced the planted symlink");
    assert_eq!(key.permissions().mode() & 0o777, 0o600);
    let state_mode = std::fs::metadata(&state).unwrap().permissions().mode() & 0o777;
    assert_ne!(state_mode & 0o077, 0, "an existing state directory keeps its permissions");
    let fresh = dir.path().join("fresh");
    MeshCa::load_or_create(&fresh, "cluster.local").unwrap();
    assert_eq!(std::fs::metadata(&fresh).unwrap().permissions().mode() & 0o777, 0o700, "a new state directory");
    let leftovers: Vec<_> = std::fs::read_dir(&fresh)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "temporary files left behind: {leftovers:?}");
}

#[test]
fn write_new_refuses_an_existing_file_or_symlink_and_sets_the_exact_mode() {
    use std::os::unix::fs::{symlink, PermissionsExt};

    let dir = tempfile::tempdir().unwrap();
    let victim = dir.path().join("victim");
    std::fs::write(&victim, "do not overwrite").unwrap();
    let link = dir.path().join("link");
    symlink(&victim, &link).unwrap();
    let dangling = dir.path().join("dangling");
    symlink(dir.path().join("nowhere"), &dangling).unwrap();
    for path in [&victim, &link, &dangling] {
        let err = write_new(path, b"secret", 0o600).unwrap_err().to_string();
        assert!(err.contains("exists") || err.contains("symbolic"), "{}: {err}", path.display());
    }
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "do not overwrite");
    assert!(!dir.path().join("nowhere").exists(), "the dangling symlink was followed");

    let key = dir.path().join("key");
    write_new(&key, b"secret", 0o600).unwrap();
    assert_eq!(std::fs::metadata(&key).unwrap().permissions().mode() & 0o777, 0o600);
    assert_eq!(std::fs::read(&key).unwrap(), b"secret");
}

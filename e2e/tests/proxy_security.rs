//! Security checks against the real `hbone-proxy` on a node with ambient pods A and B: B's HBONE port refuses
//! client certificates that are expired, not yet valid or without a SPIFFE identity; nobody reaches B's app by
//! speaking plaintext to 15008; and the proxy logs neither keys nor certificates, even at trace.
//!
//! Covered elsewhere: a certificate from another CA or trust domain (`errors.rs::b_rejects_client_certificates_
//! outside_its_trust_domain`), a peer proving another identity than the listed one (`errors.rs::a_refuses_b_
//! when_b_does_not_prove_the_listed_identity`), CONNECT to the proxy's own ports (`errors.rs::b_answers_protocol_
//! errors_with_400_and_503`).

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Empty;
use hyper_util::rt::{TokioExecutor, TokioIo};
use istio_contract::ports;
use istio_contract::proxy::PROXY_MARK;
use netns::Netns;
use nix::sys::socket::{connect, setsockopt, socket, sockopt, AddressFamily, SockFlag, SockType, SockaddrStorage};
use rcgen::{
    date_time_ymd, CertificateParams, ExtendedKeyUsagePurpose, Issuer, KeyPair, KeyUsagePurpose, SanType,
    PKCS_ECDSA_P256_SHA256,
};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};
use testbed::mesh::plain_pod;
use testbed::node_agent::ambient_conflist;
use testbed::wait::eventually;
use testbed::Pod;

mod support;
use support::{APP_PORT, NS, TD};

/// The shared scene with a mesh CA the test made (`CA_DIR`), so it can sign client certificates of its own.
struct Scene {
    base: support::Scene,
    cacerts: PathBuf,
}

impl Scene {
    fn new(env: &[(&str, &str)]) -> Self {
        let base = support::Scene::with_test_ca("b-sa", env);
        Scene { cacerts: base.cacerts(), base }
    }

    fn ca_file(&self, name: &str) -> String {
        std::fs::read_to_string(self.cacerts.join(name)).expect("read the CA file")
    }

    /// Signs a client certificate with the mesh CA: URI SAN `uri` (a DNS SAN when `None`), valid between the
    /// given years. Returns the chain (leaf, CA) and the key.
    fn client_cert(
        &self,
        uri: Option<&str>,
        valid: (i32, i32),
    ) -> (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>) {
        let ca_pem = self.ca_file("ca-cert.pem");
        let issuer = Issuer::from_ca_cert_pem(&ca_pem, KeyPair::from_pem(&self.ca_file("ca-key.pem")).expect("CA key"))
            .expect("CA issuer");
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).expect("client key");
        let mut params = CertificateParams::default();
        params.subject_alt_names = vec![match uri {
            Some(uri) => SanType::URI(uri.try_into().expect("URI SAN")),
            None => SanType::DnsName("tester.shop.svc".try_into().expect("DNS SAN")),
        }];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth, ExtendedKeyUsagePurpose::ServerAuth];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.not_before = date_time_ymd(valid.0, 1, 1);
        params.not_after = date_time_ymd(valid.1, 1, 1);
        let cert = params.signed_by(&key, &issuer).expect("sign the client certificate");
        let ca = rustls::pki_types::CertificateDer::from_pem_slice(ca_pem.as_bytes()).expect("CA DER");
        (vec![cert.der().clone(), ca], PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())))
    }

    /// B's app as an echo server; counts the connections it accepted.
    fn b_echo(&self) -> Arc<AtomicUsize> {
        support::traffic::echo_app(self.base.b_listener())
    }
}

/// Accepts any server certificate: these tests are about what B's server accepts from clients.
#[derive(Debug)]
struct AnyServer(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for AnyServer {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// How long a dial may take.
const DIAL_TIMEOUT_SECS: i64 = 5;
/// How long one mTLS + CONNECT attempt may take once dialled.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(10);

/// Opens a TCP connection from `netns` to `dst`, with the proxy mark when `marked` (so A's capture lets it by,
/// as A's proxy's own connections).
fn dial_std(netns: &Path, dst: SocketAddr, marked: bool) -> io::Result<TcpStream> {
    let ns = Netns::open(netns).map_err(|e| io::Error::other(e.to_string()))?;
    ns.run(|| -> io::Result<TcpStream> {
        let fd = socket(AddressFamily::Inet, SockType::Stream, SockFlag::SOCK_CLOEXEC, None)?;
        if marked {
            setsockopt(&fd, sockopt::Mark, &PROXY_MARK)?;
        }
        // A blocking connect gives up after the send timeout, not after the kernel's minute of SYN retries.
        setsockopt(&fd, sockopt::SendTimeout, &nix::sys::time::TimeVal::new(DIAL_TIMEOUT_SECS, 0))?;
        connect(fd.as_raw_fd(), &SockaddrStorage::from(dst))?;
        Ok(TcpStream::from(fd))
    })
    .map_err(|e| io::Error::other(e.to_string()))?
}

/// [`dial_std`] for the tokio runtime.
fn dial(netns: &Path, dst: SocketAddr, marked: bool) -> io::Result<tokio::net::TcpStream> {
    let stream = dial_std(netns, dst, marked)?;
    stream.set_nonblocking(true)?;
    tokio::net::TcpStream::from_std(stream)
}

/// HTTP/2 CONNECT to `authority` over `io`; the response status, or why there was none.
async fn h2_connect<T>(io: T, authority: SocketAddr) -> Result<u16, String>
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut send, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(io))
        .await
        .map_err(|e| format!("HTTP/2 handshake: {e}"))?;
    tokio::spawn(conn);
    let request = http::Request::connect(authority.to_string()).body(Empty::<Bytes>::new()).expect("request");
    let response = send.send_request(request).await.map_err(|e| format!("CONNECT: {e}"))?;
    Ok(response.status().as_u16())
}

/// `exchange`'s result, or an error when it got no answer within 30 s: an exchange that never completes did not
/// reach the app either, which is what these cases assert (the app's accept count is checked separately). Said on
/// stderr, since a refusal is expected to be prompt.
async fn refused_or_unanswered(
    what: &str,
    exchange: impl std::future::Future<Output = Result<u16, String>>,
) -> Result<u16, String> {
    match tokio::time::timeout(Duration::from_secs(30), exchange).await {
        Ok(result) => result,
        Err(_) => {
            eprintln!("{what}: no answer within 30 s (counted as not reaching the app)");
            Err("no answer within 30 s".into())
        }
    }
}

/// mTLS from A's netns (marked, like another mesh proxy) to B's 15008 with `chain`/`key`, then CONNECT to B's
/// app: the status, or where it failed.
async fn connect_with(
    scene: &Scene,
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> Result<u16, Attempt> {
    let b = &scene.base.b;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("TLS 1.3")
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyServer(provider)))
        .with_client_auth_cert(chain, key)
        .expect("client config");
    config.alpn_protocols = vec![b"h2".to_vec()];
    let (netns, dst) = (scene.base.a.netns.path(), SocketAddr::from((b.ip, ports::HBONE)));
    let tcp = tokio::task::spawn_blocking(move || dial(&netns, dst, true))
        .await
        .expect("dial thread")
        .map_err(|e| Attempt::Unreached(format!("dial: {e}")))?;
    let name = ServerName::IpAddress(std::net::IpAddr::from(b.ip).into());
    let exchange = async {
        let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect(name, tcp)
            .await
            .map_err(|e| format!("TLS handshake: {e}"))?;
        h2_connect(tls, SocketAddr::from((b.ip, APP_PORT))).await
    };
    match tokio::time::timeout(ATTEMPT_TIMEOUT, exchange).await {
        Ok(result) => result.map_err(Attempt::Failed),
        Err(_) => Err(Attempt::Unreached(format!("no answer within {ATTEMPT_TIMEOUT:?}"))),
    }
}

/// Why an attempt gave no status.
#[derive(Debug)]
enum Attempt {
    /// The connection never got an answer (a lost dial or a stalled exchange): says nothing about the certificate.
    Unreached(String),
    /// B's side failed the handshake or the CONNECT.
    Failed(String),
}

/// [`connect_with`], tried again when an attempt went unanswered, so only B's verdict decides the result.
async fn verdict(
    scene: &Scene,
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> Result<u16, String> {
    let mut unreached = Vec::new();
    while unreached.len() < 3 {
        match connect_with(scene, chain.clone(), key.clone_key()).await {
            Ok(status) => return Ok(status),
            Err(Attempt::Failed(why)) => return Err(why),
            Err(Attempt::Unreached(why)) => {
                eprintln!("an attempt from A to B's 15008 went unanswered, trying again: {why}");
                unreached.push(why);
            }
        }
    }
    panic!("three attempts from A to B's 15008 went unanswered: {unreached:?}")
}

/// The current year (UTC, near enough for whole-year validity windows).
fn this_year() -> i32 {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_secs();
    1970 + (secs / 31_556_952) as i32
}

fn block_on<T>(test: impl std::future::Future<Output = T>) -> T {
    let runtime = tokio::runtime::Runtime::new().expect("tokio runtime");
    runtime.block_on(async { tokio::time::timeout(Duration::from_secs(180), test).await.expect("test timed out") })
}

#[test]
fn b_refuses_client_certificates_that_are_expired_not_yet_valid_or_without_a_spiffe_identity() {
    let scene = Scene::new(&[]);
    let accepted = scene.b_echo();
    let tester = format!("spiffe://{TD}/ns/{NS}/sa/tester");
    let now = this_year();
    block_on(async {
        // The same client with a proper certificate gets through: the refusals below are about the certificate.
        let (chain, key) = scene.client_cert(Some(&tester), (now - 1, now + 5));
        assert_eq!(verdict(&scene, chain, key).await, Ok(200), "a valid mesh certificate");
        let cases = [
            ("an expired certificate", Some(tester.as_str()), (2000, 2001)),
            ("a certificate not valid yet", Some(tester.as_str()), (now + 10, now + 11)),
            ("a certificate without a URI SAN", None, (now - 1, now + 5)),
            ("a certificate with a non-SPIFFE URI SAN", Some("https://tester.shop.example/"), (now - 1, now + 5)),
        ];
        for (what, uri, valid) in cases {
            let (chain, key) = scene.client_cert(uri, valid);
            let result = verdict(&scene, chain, key).await;
            assert!(result.is_err(), "{what} was accepted: {result:?}");
        }
    });
    let log = eventually("B's proxy logs the four rejected handshakes", || {
        let log = scene.base.proxy.log();
        (log.matches("inbound HBONE handshake failed").count() >= 4).then_some(log)
    });
    assert!(log.contains("xpired"), "the expiry is named in the log");
    assert!(log.contains("no spiffe:// URI SAN"), "the missing identity is named in the log");
    assert_eq!(accepted.load(Ordering::SeqCst), 1, "only the valid client reached B's app");
}

#[test]
fn plaintext_to_b_15008_never_reaches_b_app() {
    let scene = Scene::new(&[]);
    let accepted = scene.b_echo();
    let cluster = &scene.base.cluster;
    // C is outside the mesh: its connections are not captured, so they reach B's 15008 as sent.
    cluster.create(&plain_pod(NS, "c"));
    let c: Pod = cluster.add_with(ambient_conflist(cluster), "c", NS).expect("ADD of c");
    let b_hbone = SocketAddr::from((scene.base.b.ip, ports::HBONE));
    let b_app = SocketAddr::from((scene.base.b.ip, APP_PORT));

    // The HTTP/2 preface and an empty SETTINGS frame, raw: the answer is a TLS alert or nothing, never HTTP/2.
    let mut raw = dial_std(&c.netns.path(), b_hbone, false).expect("C reaches B:15008");
    raw.set_read_timeout(Some(Duration::from_secs(10))).expect("read timeout");
    raw.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00").expect("send preface");
    let mut answer = Vec::new();
    let _ = raw.read_to_end(&mut answer);
    assert!(answer.is_empty() || answer[0] == 0x15, "B's 15008 answered plaintext HTTP/2 with {answer:?}");

    block_on(async {
        // A plaintext HTTP/2 CONNECT from outside the mesh, straight to B's 15008.
        let tcp = dial(&c.netns.path(), b_hbone, false).expect("C reaches B:15008");
        let result = refused_or_unanswered("plaintext CONNECT from a non-mesh pod", h2_connect(tcp, b_app)).await;
        assert!(result.is_err(), "plaintext CONNECT from a non-mesh pod: {result:?}");
        // The same from A's app: captured by A's proxy, whose tunnel to B's own 15008 is refused.
        let tcp = dial(&scene.base.a.netns.path(), b_hbone, false).expect("A's app connects to B:15008");
        let result = refused_or_unanswered("plaintext CONNECT from A's app", h2_connect(tcp, b_app)).await;
        assert!(result.is_err(), "plaintext CONNECT from A's app: {result:?}");
    });
    assert_eq!(accepted.load(Ordering::SeqCst), 0, "B's app got a connection");
}

#[test]
fn the_proxy_at_trace_logs_no_key_and_no_certificate() {
    let scene = Scene::new(&[("LOG_LEVEL", "trace")]);
    let accepted = scene.b_echo();
    let mut stream = scene.base.a_connects_to_b();
    stream.write_all(b"hello").expect("A writes");
    let mut got = [0; 5];
    stream.read_exact(&mut got).expect("A reads the echo");
    assert_eq!(&got, b"hello");
    assert_eq!(accepted.load(Ordering::SeqCst), 1);

    let log = scene.base.proxy.log();
    assert!(log.contains("TRACE"), "the proxy logs at trace");
    assert!(!log.contains("-----BEGIN"), "a PEM block in the proxy's log");
    for file in ["ca-key.pem", "ca-cert.pem"] {
        let pem = scene.ca_file(file);
        let body: Vec<&str> = pem.lines().filter(|l| !l.starts_with("-----") && l.len() >= 32).collect();
        assert!(!body.is_empty(), "{file} has a body");
        for line in body {
            assert!(!log.contains(line), "a line of {file} is in the proxy's log: {line}");
        }
    }
}

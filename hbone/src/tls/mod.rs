//! Mutual TLS for HBONE: TLS 1.3 only, AES-GCM suites only, ALPN `h2`, no SNI, SPIFFE identities checked
//! against the mesh roots on both sides.

mod server_certs;
mod verify;

pub use server_certs::ServerCerts;
pub use verify::PeerIdentityError;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use rustls::client::Resumption;
use rustls::crypto::ring::cipher_suite::{TLS13_AES_128_GCM_SHA256, TLS13_AES_256_GCM_SHA384};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, ServerName, TrustAnchor};
use rustls::server::{Acceptor, NoServerSessionStorage};
use rustls::{ClientConfig, ServerConfig};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio_rustls::LazyConfigAcceptor;

use crate::ca::WorkloadCert;
use crate::identity::Identity;
use verify::{Chain, MeshClientVerifier, MeshServerVerifier};

/// The only application protocol HBONE speaks.
pub const ALPN_H2: &[u8] = b"h2";
/// How long an inbound TLS handshake may take.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// A plaintext TLS record holding a fatal `no_application_protocol` (120) alert: what a server sends a client
/// whose ALPN offer it cannot accept (RFC 7301, section 3.2).
const NO_APPLICATION_PROTOCOL_ALERT: [u8; 7] = [0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 0x78];
/// Ciphertext a TLS stream queues before it waits for its socket: room for one whole DATA frame of
/// [`crate::copy`]'s largest read, with its frame header and record overhead. rustls's default (64 KiB) cut every
/// such frame into four writes and four `writev`s; one write per frame took about 8% off the proxies' CPU per GB
/// across nodes (BENCHMARKS.md, #19). It bounds what one connection holds for a slow peer.
const TLS_SEND_BUFFER: usize = crate::copy::LARGE_READ + 64 * 1024;

/// Why a TLS config could not be built or a handshake failed.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A mesh root certificate could not be used as a trust anchor.
    #[error("mesh root certificate is not a usable trust anchor: {0}")]
    BadRoot(webpki::Error),
    /// rustls refused the configuration (e.g. an unusable key).
    #[error("building the TLS config: {0}")]
    Config(rustls::Error),
    /// The handshake failed (I/O, alert, or a rejected certificate).
    #[error("TLS handshake with {peer}: {source}")]
    Handshake {
        /// The other end of the connection.
        peer: SocketAddr,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The handshake failed because the peer's certificate was not acceptable.
    #[error("TLS handshake with {peer}: certificate rejected: {reason}")]
    Rejected {
        /// The other end of the connection.
        peer: SocketAddr,
        /// Why the certificate was rejected.
        reason: String,
    },
    /// The handshake did not finish within [`HANDSHAKE_TIMEOUT`].
    #[error("TLS handshake with {0} timed out")]
    Timeout(SocketAddr),
    /// Reading the socket's addresses failed.
    #[error("reading socket addresses: {0}")]
    Socket(std::io::Error),
    /// The client did not offer the ALPN protocol `h2` (HBONE is HTTP/2 only); refused before the handshake with a
    /// `no_application_protocol` alert.
    #[error("TLS handshake with {peer}: refused: the client offered no ALPN protocol h2 (HBONE requires h2)")]
    NoAlpn {
        /// The other end of the connection.
        peer: SocketAddr,
    },
    /// The verified client certificate did not yield an identity (should not happen after verification).
    #[error("client {peer}: {source}")]
    PeerIdentity {
        /// The other end of the connection.
        peer: SocketAddr,
        /// What was wrong.
        source: PeerIdentityError,
    },
}

/// The mesh's TLS policy: trust domain, roots and the crypto provider, from which per-connection client and
/// server configs are made.
#[derive(Clone, Debug)]
pub struct MeshTls {
    trust_domain: String,
    anchors: Arc<[TrustAnchor<'static>]>,
    provider: Arc<CryptoProvider>,
}

impl MeshTls {
    /// A policy for `trust_domain` trusting `roots` (e.g. [`crate::MeshCa::roots`]).
    pub fn new(trust_domain: impl Into<String>, roots: &[CertificateDer<'_>]) -> Result<Self, TlsError> {
        let anchors = roots
            .iter()
            .map(|root| webpki::anchor_from_trusted_cert(root).map(|a| a.to_owned()).map_err(TlsError::BadRoot))
            .collect::<Result<Vec<_>, _>>()?;
        let mut provider = rustls::crypto::ring::default_provider();
        provider.cipher_suites = vec![TLS13_AES_256_GCM_SHA384, TLS13_AES_128_GCM_SHA256];
        Ok(MeshTls { trust_domain: trust_domain.into(), anchors: anchors.into(), provider: Arc::new(provider) })
    }

    /// The trust domain clients must belong to.
    pub fn trust_domain(&self) -> &str {
        &self.trust_domain
    }

    fn chain(&self) -> Chain {
        Chain { anchors: self.anchors.clone(), algs: self.provider.signature_verification_algorithms }
    }

    /// The server config for one connection accepted on `local_ip`: presents that IP's certificate from
    /// `certs` and requires a client certificate from the mesh.
    pub fn server_config(&self, certs: &ServerCerts, local_ip: IpAddr) -> Result<Arc<ServerConfig>, TlsError> {
        let verifier = MeshClientVerifier { chain: self.chain(), trust_domain: self.trust_domain.clone() };
        let mut config = ServerConfig::builder_with_provider(self.provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(TlsError::Config)?
            .with_client_cert_verifier(Arc::new(verifier))
            .with_cert_resolver(Arc::new(server_certs::ByLocalIp {
                certs: certs.clone(),
                local_ip: local_ip.to_canonical(),
            }));
        config.alpn_protocols = vec![ALPN_H2.to_vec()];
        // Every handshake verifies the peer afresh: no tickets, no resumption.
        config.send_tls13_tickets = 0;
        config.session_storage = Arc::new(NoServerSessionStorage {});
        Ok(Arc::new(config))
    }

    /// The client config for dialling `expected` as `src`: presents `src`'s chain and accepts only a
    /// server carrying `expected` as a URI SAN. Sends no SNI and never resumes sessions.
    pub fn client_config(&self, src: &WorkloadCert, expected: &Identity) -> Result<Arc<ClientConfig>, TlsError> {
        let verifier = MeshServerVerifier { chain: self.chain(), expected: expected.clone() };
        let mut config = ClientConfig::builder_with_provider(self.provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(TlsError::Config)?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(verifier))
            .with_client_auth_cert(src.chain().to_vec(), src.private_key())
            .map_err(TlsError::Config)?;
        config.alpn_protocols = vec![ALPN_H2.to_vec()];
        config.enable_sni = false;
        config.resumption = Resumption::disabled();
        Ok(Arc::new(config))
    }

    /// Connects TLS to `dst` over `tcp` as a client (see [`MeshTls::client_config`]).
    pub async fn connect(
        &self,
        tcp: TcpStream,
        src: &WorkloadCert,
        expected: &Identity,
    ) -> Result<tokio_rustls::client::TlsStream<TcpStream>, TlsError> {
        let peer = tcp.peer_addr().map_err(TlsError::Socket)?;
        let config = self.client_config(src, expected)?;
        // SNI is off, so the name only satisfies the API; an IP is never sent anyway.
        let name = ServerName::IpAddress(peer.ip().into());
        let mut stream = tokio_rustls::TlsConnector::from(config)
            .connect(name, tcp)
            .await
            .map_err(|source| handshake_error(peer, source))?;
        stream.get_mut().1.set_buffer_limit(Some(TLS_SEND_BUFFER));
        Ok(stream)
    }
}

/// Names a rejected certificate's reason in words (rustls only shows it in debug form).
fn handshake_error(peer: SocketAddr, source: std::io::Error) -> TlsError {
    let reason = source.get_ref().and_then(|inner| inner.downcast_ref::<rustls::Error>()).and_then(|e| match e {
        rustls::Error::InvalidCertificate(rustls::CertificateError::Other(other)) => Some(other.0.to_string()),
        rustls::Error::InvalidCertificate(kind) => Some(format!("{kind:?}")),
        _ => None,
    });
    match reason {
        Some(reason) => TlsError::Rejected { peer, reason },
        None => TlsError::Handshake { peer, source },
    }
}

/// Whether a ClientHello's ALPN offer includes `h2`.
fn offers_h2<'a>(offer: Option<impl Iterator<Item = &'a [u8]>>) -> bool {
    offer.is_some_and(|mut protocols| protocols.any(|p| p == ALPN_H2))
}

/// An inbound connection after a successful mTLS handshake.
#[derive(Debug)]
pub struct Accepted {
    /// The TLS stream to serve HBONE on.
    pub stream: tokio_rustls::server::TlsStream<TcpStream>,
    /// The address the client dialled (our side of the socket).
    pub local: SocketAddr,
    /// The client's address.
    pub peer: SocketAddr,
    /// The client's verified identity.
    pub peer_identity: Identity,
}

/// Accepts mesh mTLS on connections whose destination IPs are served from a [`ServerCerts`].
#[derive(Clone, Debug)]
pub struct InboundTls {
    tls: MeshTls,
    certs: ServerCerts,
}

impl InboundTls {
    /// An acceptor for `tls`'s mesh, presenting certificates from `certs`.
    pub fn new(tls: MeshTls, certs: ServerCerts) -> Self {
        InboundTls { tls, certs }
    }

    /// Runs the server handshake on an accepted socket, presenting the certificate of the IP it was dialled
    /// on, and returns the stream with the client's verified identity. A client whose ClientHello does not offer
    /// ALPN `h2` is refused before the handshake ([`TlsError::NoAlpn`]).
    pub async fn accept(&self, tcp: TcpStream) -> Result<Accepted, TlsError> {
        let local = tcp.local_addr().map_err(TlsError::Socket)?;
        let peer = tcp.peer_addr().map_err(TlsError::Socket)?;
        let local = SocketAddr::new(local.ip().to_canonical(), local.port());
        let config = self.tls.server_config(&self.certs, local.ip())?;
        // One deadline for the whole handshake, ClientHello included.
        let deadline = tokio::time::Instant::now() + HANDSHAKE_TIMEOUT;
        let timeout = |_| TlsError::Timeout(peer);
        let start = tokio::time::timeout_at(deadline, LazyConfigAcceptor::new(Acceptor::default(), tcp))
            .await
            .map_err(timeout)?
            .map_err(|source| handshake_error(peer, source))?;
        if !offers_h2(start.client_hello().alpn()) {
            let mut tcp = start.io;
            let _ = tokio::time::timeout_at(deadline, tcp.write_all(&NO_APPLICATION_PROTOCOL_ALERT)).await;
            return Err(TlsError::NoAlpn { peer });
        }
        let mut stream = tokio::time::timeout_at(deadline, start.into_stream(config))
            .await
            .map_err(timeout)?
            .map_err(|source| handshake_error(peer, source))?;
        // The offer was checked above; this makes sure nothing else was negotiated.
        if stream.get_ref().1.alpn_protocol() != Some(ALPN_H2) {
            return Err(TlsError::NoAlpn { peer });
        }
        let leaf =
            stream.get_ref().1.peer_certificates().and_then(|certs| certs.first()).ok_or(TlsError::PeerIdentity {
                peer,
                source: PeerIdentityError::Unreadable("no client certificate".to_string()),
            })?;
        let peer_identity = verify::identity_in_trust_domain(leaf, &self.tls.trust_domain)
            .map_err(|source| TlsError::PeerIdentity { peer, source })?;
        stream.get_mut().1.set_buffer_limit(Some(TLS_SEND_BUFFER));
        Ok(Accepted { stream, local, peer, peer_identity })
    }
}

//! The connection to istiod shared by the xDS and CA clients: TCP + TLS (rustls, ring) + HTTP/2 (h2), and gRPC
//! calls on it, streaming or unary, carrying istiod's authentication headers.
//!
//! Guarantees:
//! * the address's host is resolved at every connect as [`crate::resolve`] describes (resolv.conf, no NSS; a
//!   literal IP is used as is), and each resolved address is tried in turn;
//! * each [`Channel::connect`] re-reads the root certificates, so a rotated root is picked up on reconnect;
//! * the server certificate must chain to those roots and name the address's host, or the configured alternate
//!   hostname; no client certificate is sent;
//! * each call re-reads the bearer token, so a rotated projected token is used by the next stream;
//! * every call carries `authorization: Bearer <token>` (when a token is configured), `clusterid` and the extra
//!   headers;
//! * received gRPC messages are bounded by `max_message_bytes` before they are buffered in full, and response
//!   header lists by [`MAX_HEADER_LIST_BYTES`]; a dead connection is noticed by HTTP/2 pings within
//!   `ping_interval + ping_timeout`, and by TCP keepalive.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use h2::client::SendRequest;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tokio::task::JoinHandle;

use crate::grpc::{self, Code, FrameDecoder, FrameError, GrpcStatus};
use crate::resolve::{resolve, NameResolution, ResolveError};

/// Largest response header list accepted from the server.
pub const MAX_HEADER_LIST_BYTES: u32 = 16 * 1024;
/// Largest token file read.
const MAX_TOKEN_BYTES: u64 = 64 * 1024;
/// Largest root certificate file read.
const MAX_ROOTS_BYTES: u64 = 4 * 1024 * 1024;

/// Where the server's trust roots come from.
#[derive(Clone, Debug)]
pub enum Roots {
    /// PEM certificates held in memory.
    Pem(Vec<u8>),
    /// A PEM file, re-read at every connect.
    File(PathBuf),
    /// The operating system's store (`XDS_ROOT_CA=SYSTEM`), loaded at every connect.
    System,
}

/// Where the bearer token comes from.
#[derive(Clone, Debug, Default)]
pub enum Token {
    /// No `authorization` header.
    #[default]
    None,
    /// A fixed token.
    Literal(String),
    /// A file (a projected service account token), re-read at every call.
    File(PathBuf),
}

/// How to reach and authenticate to istiod.
#[derive(Clone, Debug)]
pub struct ChannelConfig {
    /// `https://host:port` or `host:port` (https is assumed); plaintext is refused.
    pub address: String,
    /// Trust roots for the server certificate.
    pub roots: Roots,
    /// A second name the server certificate may carry (`ALT_XDS_HOSTNAME`/`ALT_CA_HOSTNAME`).
    pub alt_hostname: Option<String>,
    /// The bearer token.
    pub token: Token,
    /// Sent as `clusterid`.
    pub cluster_id: String,
    /// Extra request headers (`XDS_HEADER_<K>`/`CA_HEADER_<K>`).
    pub headers: Vec<(String, String)>,
    /// Largest gRPC message accepted from the server.
    pub max_message_bytes: usize,
    /// TCP + TLS + HTTP/2 handshake deadline.
    pub connect_timeout: Duration,
    /// HTTP/2 ping period.
    pub ping_interval: Duration,
    /// How long a ping may go unanswered before the connection is dropped.
    pub ping_timeout: Duration,
    /// How the address's host name is resolved (resolv.conf; a literal IP bypasses it).
    pub resolution: NameResolution,
}

impl ChannelConfig {
    /// ztunnel's defaults: 200 MiB messages, 5 s connect, 30 s pings with a 10 s timeout, cluster `Kubernetes`.
    pub fn new(address: impl Into<String>, roots: Roots) -> Self {
        ChannelConfig {
            address: address.into(),
            roots,
            alt_hostname: None,
            token: Token::None,
            cluster_id: "Kubernetes".into(),
            headers: Vec::new(),
            max_message_bytes: 200 * 1024 * 1024,
            connect_timeout: Duration::from_secs(5),
            ping_interval: Duration::from_secs(30),
            ping_timeout: Duration::from_secs(10),
            resolution: NameResolution::default(),
        }
    }
}

/// Errors of the channel and of calls on it.
#[derive(Debug, thiserror::Error)]
pub enum ChannelError {
    /// The configuration is unusable.
    #[error("channel configuration: {0}")]
    Config(String),
    /// Reading the roots or the token failed.
    #[error("reading {what}: {source}")]
    Read {
        /// Which file.
        what: &'static str,
        /// Why.
        source: std::io::Error,
    },
    /// The host name did not resolve.
    #[error("connecting to {address}: {source}")]
    Resolve {
        /// The address.
        address: String,
        /// Why.
        source: ResolveError,
    },
    /// TCP connect or TLS handshake failed.
    #[error("connecting to {address}: {source}")]
    Connect {
        /// The address.
        address: String,
        /// Why.
        source: std::io::Error,
    },
    /// The connect deadline passed.
    #[error("connecting to {0}: timed out")]
    ConnectTimeout(String),
    /// HTTP/2 failed (handshake, reset, GOAWAY, I/O).
    #[error("HTTP/2: {0}")]
    Http2(#[from] h2::Error),
    /// The server answered with a non-200 HTTP status and no gRPC status.
    #[error("HTTP status {0} without a gRPC status")]
    HttpStatus(u16),
    /// The server ended the call with a non-OK gRPC status.
    #[error(transparent)]
    Status(#[from] GrpcStatus),
    /// The response body broke gRPC framing (or the size limit).
    #[error(transparent)]
    Frame(#[from] FrameError),
    /// A response message did not decode.
    #[error("decoding a response message: {0}")]
    Decode(#[from] prost::DecodeError),
    /// A unary call ended without a response message.
    #[error("call ended without a response message")]
    NoResponse,
}

impl ChannelError {
    /// True if the failure happened before a call could start (no connection, TLS, handshake, config).
    pub fn is_connection_error(&self) -> bool {
        matches!(
            self,
            ChannelError::Config(_)
                | ChannelError::Read { .. }
                | ChannelError::Resolve { .. }
                | ChannelError::Connect { .. }
                | ChannelError::ConnectTimeout(_)
                | ChannelError::HttpStatus(_)
        )
    }
}

/// A configured way to istiod; cheap to clone.
#[derive(Clone, Debug)]
pub struct Channel {
    config: Arc<ChannelConfig>,
    host: String,
    port: u16,
    authority: String,
}

impl Channel {
    /// Checks the configuration (address, header names and values); does not connect.
    pub fn new(config: ChannelConfig) -> Result<Self, ChannelError> {
        let address = config.address.trim();
        if address.is_empty() {
            return Err(ChannelError::Config("empty address".into()));
        }
        let with_scheme = if address.contains("://") { address.to_owned() } else { format!("https://{address}") };
        let uri: http::Uri =
            with_scheme.parse().map_err(|e| ChannelError::Config(format!("address {address:?}: {e}")))?;
        if uri.scheme_str() != Some("https") {
            return Err(ChannelError::Config(format!("address {address:?}: only https is supported")));
        }
        let authority = uri.authority().ok_or_else(|| ChannelError::Config(format!("address {address:?}: no host")))?;
        let host = authority.host().trim_start_matches('[').trim_end_matches(']').to_owned();
        let port = authority.port_u16().unwrap_or(443);
        for (k, v) in &config.headers {
            http::HeaderName::from_bytes(k.as_bytes())
                .map_err(|e| ChannelError::Config(format!("header {k:?}: {e}")))?;
            http::HeaderValue::from_str(v).map_err(|e| ChannelError::Config(format!("header {k:?} value: {e}")))?;
        }
        http::HeaderValue::from_str(&config.cluster_id)
            .map_err(|e| ChannelError::Config(format!("cluster id {:?}: {e}", config.cluster_id)))?;
        if let Some(alt) = &config.alt_hostname {
            ServerName::try_from(alt.clone())
                .map_err(|e| ChannelError::Config(format!("alt hostname {alt:?}: {e}")))?;
        }
        ServerName::try_from(host.clone()).map_err(|e| ChannelError::Config(format!("host {host:?}: {e}")))?;
        Ok(Channel { authority: authority.to_string(), host, port, config: Arc::new(config) })
    }

    /// The configuration.
    pub fn config(&self) -> &ChannelConfig {
        &self.config
    }

    /// Opens a new connection (re-reading the roots), within the connect timeout.
    pub async fn connect(&self) -> Result<Connection, ChannelError> {
        let tls = Arc::new(self.tls_config().await?);
        match tokio::time::timeout(self.config.connect_timeout, self.connect_inner(tls)).await {
            Ok(result) => result,
            Err(_) => Err(ChannelError::ConnectTimeout(self.authority.clone())),
        }
    }

    async fn connect_inner(&self, tls: Arc<rustls::ClientConfig>) -> Result<Connection, ChannelError> {
        let connect_err = |source| ChannelError::Connect { address: self.authority.clone(), source };
        let addresses = resolve(&self.host, self.port, &self.config.resolution)
            .await
            .map_err(|source| ChannelError::Resolve { address: self.authority.clone(), source })?;
        let mut last_error = None;
        let mut connected = None;
        for address in addresses {
            match TcpStream::connect(address).await {
                Ok(tcp) => {
                    connected = Some(tcp);
                    break;
                }
                Err(e) => {
                    tracing::debug!(%address, error = %e, "control plane address refused the connection");
                    last_error = Some(e);
                }
            }
        }
        let tcp = match (connected, last_error) {
            (Some(tcp), _) => tcp,
            (None, Some(e)) => return Err(connect_err(e)),
            (None, None) => return Err(connect_err(std::io::Error::other("no address"))),
        };
        tcp.set_nodelay(true).map_err(connect_err)?;
        // ztunnel's keepalive: 300 s idle, 75 s between probes, 9 probes.
        let keepalive = socket2::TcpKeepalive::new()
            .with_time(Duration::from_secs(300))
            .with_interval(Duration::from_secs(75))
            .with_retries(9);
        socket2::SockRef::from(&tcp).set_tcp_keepalive(&keepalive).map_err(connect_err)?;
        let name = ServerName::try_from(self.host.clone())
            .map_err(|e| ChannelError::Config(format!("host {:?}: {e}", self.host)))?;
        let stream = tokio_rustls::TlsConnector::from(tls).connect(name, tcp).await.map_err(connect_err)?;
        let window = u32::try_from(self.config.max_message_bytes.clamp(1 << 16, 4 << 20)).unwrap_or(1 << 20);
        let (send, mut connection) = h2::client::Builder::new()
            .initial_window_size(window)
            .initial_connection_window_size(window)
            .max_header_list_size(MAX_HEADER_LIST_BYTES)
            .handshake::<_, Bytes>(stream)
            .await?;
        let ping_pong = connection.ping_pong();
        let (interval, timeout) = (self.config.ping_interval, self.config.ping_timeout);
        let driver = tokio::spawn(async move {
            let keepalive = async move {
                let Some(mut ping_pong) = ping_pong else { return std::future::pending().await };
                loop {
                    tokio::time::sleep(interval).await;
                    match tokio::time::timeout(timeout, ping_pong.ping(h2::Ping::opaque())).await {
                        Ok(Ok(_)) => {}
                        Ok(Err(e)) => {
                            tracing::debug!(error = %e, "control plane connection: ping failed");
                            return;
                        }
                        Err(_) => {
                            tracing::warn!("control plane connection: ping unanswered, closing");
                            return;
                        }
                    }
                }
            };
            tokio::select! {
                result = &mut connection => {
                    if let Err(e) = result {
                        tracing::debug!(error = %e, "control plane connection ended");
                    }
                }
                () = keepalive => {}
            }
        });
        Ok(Connection { send, driver, channel: self.clone() })
    }

    async fn tls_config(&self) -> Result<rustls::ClientConfig, ChannelError> {
        let mut roots = RootCertStore::empty();
        let pem = match &self.config.roots {
            Roots::Pem(pem) => pem.clone(),
            Roots::File(path) => read_bounded(path, MAX_ROOTS_BYTES, "root certificates").await?,
            Roots::System => {
                let native = tokio::task::spawn_blocking(rustls_native_certs::load_native_certs)
                    .await
                    .map_err(|e| ChannelError::Config(format!("system roots: {e}")))?;
                let (added, ignored) = roots.add_parsable_certificates(native.certs);
                tracing::debug!(added, ignored, errors = native.errors.len(), "system roots loaded");
                Vec::new()
            }
        };
        for cert in CertificateDer::pem_slice_iter(&pem) {
            let cert = cert.map_err(|e| ChannelError::Config(format!("root certificates: {e}")))?;
            roots.add(cert).map_err(|e| ChannelError::Config(format!("root certificate: {e}")))?;
        }
        if roots.is_empty() {
            return Err(ChannelError::Config("no root certificate".into()));
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let webpki = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
            .build()
            .map_err(|e| ChannelError::Config(format!("root certificates: {e}")))?;
        let alt = match &self.config.alt_hostname {
            Some(alt) => Some(
                ServerName::try_from(alt.clone())
                    .map_err(|e| ChannelError::Config(format!("alt hostname {alt:?}: {e}")))?,
            ),
            None => None,
        };
        let verifier = Arc::new(AltNameVerifier { inner: webpki, alt });
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| ChannelError::Config(format!("TLS: {e}")))?
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_no_client_auth();
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(config)
    }

    async fn token(&self) -> Result<Option<String>, ChannelError> {
        match &self.config.token {
            Token::None => Ok(None),
            Token::Literal(t) => Ok(Some(t.clone())),
            Token::File(path) => {
                let bytes = read_bounded(path, MAX_TOKEN_BYTES, "token").await?;
                let token = String::from_utf8_lossy(&bytes).trim().to_owned();
                Ok(Some(token))
            }
        }
    }

    async fn request(&self, path: &str) -> Result<http::Request<()>, ChannelError> {
        let mut builder = http::Request::builder()
            .method(http::Method::POST)
            .uri(format!("https://{}{}", self.authority, path))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .header("user-agent", concat!("istio-cni-rs-xds/", env!("CARGO_PKG_VERSION")))
            .header("clusterid", self.config.cluster_id.as_str());
        if let Some(token) = self.token().await? {
            builder = builder.header("authorization", format!("Bearer {token}"));
        }
        for (k, v) in &self.config.headers {
            builder = builder.header(k.as_str(), v.as_str());
        }
        builder.body(()).map_err(|e| ChannelError::Config(format!("request headers: {e}")))
    }
}

async fn read_bounded(path: &PathBuf, max: u64, what: &'static str) -> Result<Vec<u8>, ChannelError> {
    let file = tokio::fs::File::open(path).await.map_err(|source| ChannelError::Read { what, source })?;
    let mut bytes = Vec::new();
    file.take(max + 1).read_to_end(&mut bytes).await.map_err(|source| ChannelError::Read { what, source })?;
    if bytes.len() as u64 > max {
        return Err(ChannelError::Read { what, source: std::io::Error::other(format!("over {max} bytes")) });
    }
    Ok(bytes)
}

/// Accepts the certificate if it is valid for the dialled name or, failing that, for the alternate name.
#[derive(Debug)]
struct AltNameVerifier {
    inner: Arc<WebPkiServerVerifier>,
    alt: Option<ServerName<'static>>,
}

impl ServerCertVerifier for AltNameVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self.inner.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now) {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) if self.alt.is_some() => {
                let alt = self.alt.as_ref().unwrap_or(server_name);
                self.inner.verify_server_cert(end_entity, intermediates, alt, ocsp_response, now)
            }
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// One HTTP/2 connection to istiod; calls on it are independent streams, and may run concurrently (share it behind
/// an `Arc`). Dropping it closes the connection.
pub struct Connection {
    send: SendRequest<Bytes>,
    driver: JoinHandle<()>,
    channel: Channel,
}

impl Drop for Connection {
    fn drop(&mut self) {
        self.driver.abort();
    }
}

impl Connection {
    /// True once the HTTP/2 connection has ended (closed by the server, a failed ping, an I/O error): calls on it
    /// fail, make a new one.
    pub fn is_closed(&self) -> bool {
        self.driver.is_finished()
    }

    /// Starts a bidirectional streaming call on `path` (e.g. `/pkg.Service/Method`). Does not wait for the
    /// response headers: a grpc-go server (istiod) sends them only with its first message, which it sends only
    /// after the client's first request. The headers (or a trailers-only refusal) are read by the first
    /// [`ResponseStream::message`].
    pub async fn streaming(&self, path: &str) -> Result<(RequestSink, ResponseStream), ChannelError> {
        let request = self.channel.request(path).await?;
        let mut send = self.send.clone().ready().await?;
        let (response, body) = send.send_request(request, false)?;
        let max = self.channel.config.max_message_bytes;
        Ok((RequestSink { body }, ResponseStream { state: ResponseState::Headers(response), max }))
    }

    /// A unary call: sends `request`, returns the one response message.
    pub async fn unary<Req: prost::Message, Resp: prost::Message + Default>(
        &self,
        path: &str,
        request: &Req,
    ) -> Result<Resp, ChannelError> {
        let (mut sink, mut stream) = self.streaming(path).await?;
        sink.send(request)?;
        sink.finish()?;
        let response = stream.message::<Resp>().await?.ok_or(ChannelError::NoResponse)?;
        // Read to the trailers so a non-OK status after the message is reported.
        while stream.message::<Resp>().await?.is_some() {}
        Ok(response)
    }
}

/// The request half of a call.
pub struct RequestSink {
    body: h2::SendStream<Bytes>,
}

impl RequestSink {
    /// Queues one message (messages this crate sends are small; h2 buffers them under flow control).
    pub fn send(&mut self, message: &impl prost::Message) -> Result<(), ChannelError> {
        self.body.send_data(grpc::encode_frame(message), false)?;
        Ok(())
    }

    /// Ends the request half.
    pub fn finish(&mut self) -> Result<(), ChannelError> {
        self.body.send_data(Bytes::new(), true)?;
        Ok(())
    }
}

/// The response half of a call.
pub struct ResponseStream {
    state: ResponseState,
    max: usize,
}

enum ResponseState {
    Headers(h2::client::ResponseFuture),
    Body { recv: h2::RecvStream, decoder: FrameDecoder },
    Ended,
}

/// The status in `grpc-status`/`grpc-message` of a header block (trailers, or the headers of a trailers-only
/// response); `None` if there is no `grpc-status`.
fn status_of(headers: &http::HeaderMap) -> Option<Result<(), GrpcStatus>> {
    let code = Code::from_header(headers.get("grpc-status")?.as_bytes());
    if code == Code::Ok {
        return Some(Ok(()));
    }
    let message = headers.get("grpc-message").map(|m| grpc::decode_status_message(m.as_bytes())).unwrap_or_default();
    Some(Err(GrpcStatus { code, message }))
}

impl ResponseStream {
    /// The next message; `Ok(None)` when the server ended the call with status OK, the status as an error
    /// otherwise. The first call waits for the response headers.
    pub async fn message<M: prost::Message + Default>(&mut self) -> Result<Option<M>, ChannelError> {
        match self.message_bytes().await? {
            Some(bytes) => Ok(Some(M::decode(bytes)?)),
            None => Ok(None),
        }
    }

    /// The next message, still serialized (at most `max_message_bytes`), for a caller that inspects it before
    /// decoding; otherwise as [`ResponseStream::message`].
    pub async fn message_bytes(&mut self) -> Result<Option<Bytes>, ChannelError> {
        loop {
            match &mut self.state {
                ResponseState::Ended => return Ok(None),
                ResponseState::Headers(response) => {
                    let response = response.await?;
                    let (parts, recv) = response.into_parts();
                    if let Some(status) = status_of(&parts.headers) {
                        // Trailers-only: the call ended without a message.
                        self.state = ResponseState::Ended;
                        status?;
                        return Ok(None);
                    }
                    if parts.status != http::StatusCode::OK {
                        self.state = ResponseState::Ended;
                        return Err(ChannelError::HttpStatus(parts.status.as_u16()));
                    }
                    self.state = ResponseState::Body { recv, decoder: FrameDecoder::new(self.max) };
                }
                ResponseState::Body { recv, decoder } => {
                    if let Some(bytes) = decoder.next_message()? {
                        return Ok(Some(bytes));
                    }
                    match recv.data().await {
                        Some(chunk) => {
                            let chunk = chunk?;
                            let _ = recv.flow_control().release_capacity(chunk.len());
                            decoder.push(&chunk);
                        }
                        None => {
                            decoder.finish()?;
                            let trailers = recv.trailers().await?;
                            self.state = ResponseState::Ended;
                            return match trailers.as_ref().and_then(status_of) {
                                Some(Ok(())) => Ok(None),
                                Some(Err(status)) => Err(status.into()),
                                None => {
                                    Err(GrpcStatus { code: Code::Unknown, message: "no grpc-status trailer".into() }
                                        .into())
                                }
                            };
                        }
                    }
                }
            }
        }
    }
}

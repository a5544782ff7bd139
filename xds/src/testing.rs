//! A scripted fake istiod for tests (feature `testing`): TLS with rcgen-made certificates, Delta ADS over h2.
//!
//! Guarantees: like istiod it refuses a stream whose bearer token is not the expected one (`Unauthenticated`),
//! and one whose first request has no node or a node id that is not 4 `~`-separated parts of type `ztunnel` with
//! a valid IP (`InvalidArgument`), or every ztunnel stream when playing istiod without ambient (`Unknown: ztunnel
//! requires PILOT_ENABLE_AMBIENT=true`); it can also refuse the next streams with scripted statuses, and freeze
//! (stop reading its connections, so pings go unanswered). Like grpc-go it sends response headers only with the
//! first message. Every accepted stream is handed to the test as a [`FakeStream`], through which the test reads
//! the client's requests and sends responses (or raw bytes), ends or resets the stream. Every request and every stream attempt is recorded. The test
//! helpers' waits are bounded by [`WAIT`] and wake on events (no polling); a helper that times out panics, which
//! fails the test. A harness that serves for as long as it runs takes streams and requests without a bound
//! ([`FakeIstiod::accept_stream`], [`FakeStream::next_request`]). The fake serves on 127.0.0.1 or on a listener the
//! caller bound ([`FakeIstiod::start_on`]), and can present the same certificate across starts
//! ([`FakeIstiod::start_with`], [`ServingCert`]).

use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use prost::Message;
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::net::TcpListener;
use tokio::sync::mpsc;

use crate::ads::DELTA_ADS_PATH;
use crate::grpc::{self, Code, FrameDecoder};
use crate::wire::{DeltaDiscoveryRequest, DeltaDiscoveryResponse};

/// The longest a test helper waits for the client.
pub const WAIT: Duration = Duration::from_secs(10);

/// The DNS name in the fake server's certificate (the address is 127.0.0.1, so clients use it as alt hostname).
pub const SERVER_NAME: &str = "istiod.istio-system.svc";

/// The fake's TLS identity: a fresh CA (its root, [`ServingCert::ca_pem`], is what clients trust) and a serving
/// certificate it signed for [`SERVER_NAME`]. Cloned into each start, so a fake started again presents the same one.
#[derive(Debug)]
pub struct ServingCert {
    ca_pem: String,
    chain: Vec<CertificateDer<'static>>,
    key: PrivatePkcs8KeyDer<'static>,
}

impl Clone for ServingCert {
    fn clone(&self) -> Self {
        ServingCert { ca_pem: self.ca_pem.clone(), chain: self.chain.clone(), key: self.key.clone_key() }
    }
}

impl Default for ServingCert {
    fn default() -> Self {
        Self::new()
    }
}

impl ServingCert {
    /// A fresh CA and a serving certificate for [`SERVER_NAME`] signed by it.
    pub fn new() -> ServingCert {
        let ca_key = KeyPair::generate().expect("CA key");
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca_cert = ca_params.self_signed(&ca_key).expect("CA cert");
        let issuer = Issuer::new(ca_params, ca_key);
        let key = KeyPair::generate().expect("server key");
        let params = CertificateParams::new(vec![SERVER_NAME.to_owned()]).expect("server params");
        let cert = params.signed_by(&key, &issuer).expect("server cert");
        ServingCert {
            ca_pem: ca_cert.pem(),
            chain: vec![CertificateDer::from(cert.der().to_vec())],
            key: PrivatePkcs8KeyDer::from(key.serialize_der()),
        }
    }

    /// The CA certificate (PEM) that signed the serving certificate.
    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    /// A TLS acceptor presenting this certificate and offering HTTP/2 only (as istiod's gRPC port does).
    pub fn acceptor(&self) -> tokio_rustls::TlsAcceptor {
        let mut tls = rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .expect("TLS versions")
            .with_no_client_auth()
            .with_single_cert(self.chain.clone(), PrivateKeyDer::Pkcs8(self.key.clone_key()))
            .expect("server TLS config");
        tls.alpn_protocols = vec![b"h2".to_vec()];
        tokio_rustls::TlsAcceptor::from(Arc::new(tls))
    }
}

/// `listener` moved onto the current tokio runtime, with its address.
pub fn on_runtime(listener: std::net::TcpListener) -> (TcpListener, SocketAddr) {
    listener.set_nonblocking(true).expect("non-blocking listener");
    let listener = TcpListener::from_std(listener).expect("listener on the runtime");
    let addr = listener.local_addr().expect("local addr");
    (listener, addr)
}

/// A stream attempt as the server saw it.
#[derive(Clone, Debug)]
pub struct Attempt {
    /// When the request headers arrived.
    pub at: Instant,
    /// Its request headers.
    pub headers: http::HeaderMap,
    /// `None` if accepted and handed to the test, else the status it was refused with.
    pub refused: Option<(Code, String)>,
}

struct Shared {
    /// False: istiod without `PILOT_ENABLE_AMBIENT=true`, which refuses ztunnel nodes.
    ambient: bool,
    /// Bumped at every attempt, so tests wait on it instead of polling.
    attempts_changed: tokio::sync::watch::Sender<usize>,
    token: Option<String>,
    refusals: VecDeque<(Code, String)>,
    attempts: Vec<Attempt>,
    requests: Vec<DeltaDiscoveryRequest>,
}

/// The fake istiod. Dropping it stops accepting connections.
pub struct FakeIstiod {
    addr: SocketAddr,
    ca_pem: String,
    shared: Arc<Mutex<Shared>>,
    streams: mpsc::UnboundedReceiver<FakeStream>,
    task: tokio::task::JoinHandle<()>,
    frozen: tokio::sync::watch::Sender<bool>,
}

impl Drop for FakeIstiod {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn lock(shared: &Mutex<Shared>) -> std::sync::MutexGuard<'_, Shared> {
    shared.lock().unwrap_or_else(|e| e.into_inner())
}

impl FakeIstiod {
    /// Starts on 127.0.0.1 with a fresh CA and a serving certificate for [`SERVER_NAME`]; `token` is the bearer
    /// token required (`None`: no check).
    pub async fn start(token: Option<&str>) -> FakeIstiod {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        Self::start_on(listener, token).await
    }

    /// Like [`FakeIstiod::start`], serving on `listener` (bound wherever the caller chose: another address, a
    /// network namespace) instead of a fresh one on 127.0.0.1.
    pub async fn start_on(listener: std::net::TcpListener, token: Option<&str>) -> FakeIstiod {
        Self::start_with(listener, token, &ServingCert::new()).await
    }

    /// Like [`FakeIstiod::start_on`], presenting `cert` (so an istiod started again presents the same certificate,
    /// which its clients' `XDS_ROOT_CA` already trusts).
    pub async fn start_with(listener: std::net::TcpListener, token: Option<&str>, cert: &ServingCert) -> FakeIstiod {
        let acceptor = cert.acceptor();
        let (listener, addr) = on_runtime(listener);
        let shared = Arc::new(Mutex::new(Shared {
            ambient: true,
            attempts_changed: tokio::sync::watch::channel(0).0,
            token: token.map(str::to_owned),
            refusals: VecDeque::new(),
            attempts: Vec::new(),
            requests: Vec::new(),
        }));
        let (streams_tx, streams) = mpsc::unbounded_channel();
        let task_shared = shared.clone();
        let (frozen_tx, frozen) = tokio::sync::watch::channel(false);
        let task = tokio::spawn(async move {
            let mut connections = tokio::task::JoinSet::new();
            loop {
                let Ok((tcp, _)) = listener.accept().await else { continue };
                // As istiod's (Go sets TCP_NODELAY on every connection): no Nagle delay on small writes.
                let _ = tcp.set_nodelay(true);
                let (acceptor, shared, streams_tx) = (acceptor.clone(), task_shared.clone(), streams_tx.clone());
                let mut frozen = frozen.clone();
                connections.spawn(async move {
                    let Ok(tls) = acceptor.accept(tcp).await else { return };
                    let Ok(mut conn) = h2::server::handshake(tls).await else { return };
                    let mut calls = tokio::task::JoinSet::new();
                    let froze = loop {
                        tokio::select! {
                            accepted = conn.accept() => {
                                let Some(Ok((request, respond))) = accepted else { break false };
                                calls.spawn(serve_call(request, respond, shared.clone(), streams_tx.clone()));
                            }
                            () = async { let _ = frozen.wait_for(|f| *f).await; } => break true,
                        }
                    };
                    if froze {
                        // Frozen: the connection is kept open but no longer read, so pings go unanswered.
                        let _hold = (conn, calls);
                        std::future::pending::<()>().await;
                    }
                });
            }
        });
        FakeIstiod { addr, ca_pem: cert.ca_pem.clone(), shared, streams, task, frozen: frozen_tx }
    }

    /// The listener's `address:port` (`127.0.0.1:port` from [`FakeIstiod::start`]).
    pub fn address(&self) -> String {
        self.addr.to_string()
    }

    /// The CA certificate (PEM) that signed the serving certificate.
    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    /// Changes the token required from now on.
    pub fn set_token(&self, token: Option<&str>) {
        lock(&self.shared).token = token.map(str::to_owned);
    }

    /// Stops reading every open connection while keeping it open (a hung istiod or a black-holed path): HTTP/2
    /// pings go unanswered. Irreversible; connections made afterwards freeze at once.
    pub fn freeze(&self) {
        self.frozen.send_replace(true);
    }

    /// Plays istiod with ambient off (`false`): after the first request, every stream ends with `Unknown: ztunnel
    /// requires PILOT_ENABLE_AMBIENT=true` (istiod returns a plain error, which grpc-go sends as `Unknown`).
    pub fn set_ambient(&self, ambient: bool) {
        lock(&self.shared).ambient = ambient;
    }

    /// Refuses the next stream attempt with this status (queued; one per call).
    pub fn refuse_next(&self, code: Code, message: &str) {
        lock(&self.shared).refusals.push_back((code, message.to_owned()));
    }

    /// Every stream attempt so far.
    pub fn attempts(&self) -> Vec<Attempt> {
        lock(&self.shared).attempts.clone()
    }

    /// Every request received so far, on any stream.
    pub fn requests(&self) -> Vec<DeltaDiscoveryRequest> {
        lock(&self.shared).requests.clone()
    }

    /// The next accepted stream; panics after [`WAIT`].
    pub async fn next_stream(&mut self) -> FakeStream {
        tokio::time::timeout(WAIT, self.streams.recv())
            .await
            .expect("timed out waiting for an ADS stream")
            .expect("fake istiod stopped")
    }

    /// The next accepted stream, waiting as long as it takes; `None` once the server stopped. For harnesses that
    /// serve for as long as they run (a test helper wants [`FakeIstiod::next_stream`]).
    pub async fn accept_stream(&mut self) -> Option<FakeStream> {
        self.streams.recv().await
    }

    /// Waits until `condition` holds on the attempts; panics after [`WAIT`].
    pub async fn wait_attempts(&self, condition: impl Fn(&[Attempt]) -> bool) -> Vec<Attempt> {
        let mut changed = lock(&self.shared).attempts_changed.subscribe();
        let wait = async {
            loop {
                let attempts = self.attempts();
                if condition(&attempts) {
                    return attempts;
                }
                if changed.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
        };
        tokio::time::timeout(WAIT, wait)
            .await
            .unwrap_or_else(|_| panic!("timed out waiting on attempts: {:?}", self.attempts()))
    }
}

enum Command {
    Send(DeltaDiscoveryResponse),
    SendRaw(Bytes),
    End(Code, String),
    Reset,
}

/// One accepted ADS stream, as the test drives it.
pub struct FakeStream {
    /// Request headers of the stream.
    pub headers: http::HeaderMap,
    requests: mpsc::UnboundedReceiver<DeltaDiscoveryRequest>,
    commands: mpsc::UnboundedSender<Command>,
}

impl FakeStream {
    /// The next request from the client; panics after [`WAIT`] or if the stream closed.
    pub async fn request(&mut self) -> DeltaDiscoveryRequest {
        tokio::time::timeout(WAIT, self.requests.recv())
            .await
            .expect("timed out waiting for a request")
            .expect("stream closed before a request")
    }

    /// The next request from the client, waiting as long as it takes; `None` once the stream closed. For
    /// harnesses that serve for as long as they run (a test helper wants [`FakeStream::request`]).
    pub async fn next_request(&mut self) -> Option<DeltaDiscoveryRequest> {
        self.requests.recv().await
    }

    /// Sends a response.
    pub fn send(&self, response: DeltaDiscoveryResponse) {
        let _ = self.commands.send(Command::Send(response));
    }

    /// Sends `bytes` as one gRPC message, whatever they hold (for malformed-response tests).
    pub fn send_raw(&self, bytes: impl Into<Bytes>) {
        let _ = self.commands.send(Command::SendRaw(bytes.into()));
    }

    /// Ends the stream with this status in the trailers.
    pub fn end(&self, code: Code, message: &str) {
        let _ = self.commands.send(Command::End(code, message.to_owned()));
    }

    /// Resets the stream (RST_STREAM CANCEL).
    pub fn reset(&self) {
        let _ = self.commands.send(Command::Reset);
    }

    /// Waits until the client closes or resets the stream; panics after [`WAIT`].
    pub async fn closed(&mut self) {
        let deadline = tokio::time::Instant::now() + WAIT;
        while tokio::time::timeout_at(deadline, self.requests.recv()).await.expect("stream still open").is_some() {}
    }
}

/// Checks a node id as istiod does: `type~ip~id~domain` with type `ztunnel` and a valid IP.
pub fn check_node_id(id: &str) -> Result<(), String> {
    let parts: Vec<&str> = id.split('~').collect();
    if parts.len() != 4 {
        return Err(format!("missing parts in the service node {id:?}"));
    }
    if parts[0] != "ztunnel" {
        return Err(format!("invalid node type (valid types: sidecar, router, ztunnel) in the service node {id:?}"));
    }
    if parts[1].parse::<IpAddr>().is_err() {
        return Err(format!("invalid IP address {:?} in the service node {id:?}", parts[1]));
    }
    Ok(())
}

fn trailers(code: Code, message: &str) -> http::HeaderMap {
    let mut t = http::HeaderMap::new();
    t.insert("grpc-status", http::HeaderValue::from((code as i32).to_string().parse::<u32>().unwrap_or(2)));
    if let Ok(v) = http::HeaderValue::from_str(&grpc::encode_status_message(message)) {
        t.insert("grpc-message", v);
    }
    t
}

fn trailers_only(code: Code, message: &str) -> http::Response<()> {
    let mut response = http::Response::builder().status(200).header("content-type", "application/grpc");
    for (k, v) in &trailers(code, message) {
        response = response.header(k, v);
    }
    response.body(()).unwrap_or_default()
}

async fn serve_call(
    request: http::Request<h2::RecvStream>,
    mut respond: h2::server::SendResponse<Bytes>,
    shared: Arc<Mutex<Shared>>,
    streams_tx: mpsc::UnboundedSender<FakeStream>,
) {
    let (parts, mut body) = request.into_parts();
    let refusal = {
        let mut s = lock(&shared);
        let bearer = parts.headers.get("authorization").and_then(|v| v.to_str().ok()).map(str::to_owned);
        let refusal = if parts.uri.path() != DELTA_ADS_PATH {
            Some((Code::Unimplemented, format!("unknown method {}", parts.uri.path())))
        } else if s.token.as_ref().is_some_and(|t| bearer.as_deref() != Some(format!("Bearer {t}").as_str())) {
            Some((Code::Unauthenticated, "authentication failure".to_owned()))
        } else {
            s.refusals.pop_front()
        };
        s.attempts.push(Attempt { at: Instant::now(), headers: parts.headers.clone(), refused: refusal.clone() });
        s.attempts_changed.send_replace(s.attempts.len());
        refusal
    };
    if let Some((code, message)) = refusal {
        let _ = respond.send_response(trailers_only(code, &message), true);
        return;
    }
    // Like grpc-go, the response headers go out with the first message (or as a trailers-only response).
    let mut send: Option<h2::SendStream<Bytes>> = None;
    let finish =
        |respond: &mut h2::server::SendResponse<Bytes>, send: Option<h2::SendStream<Bytes>>, code, message: &str| {
            match send {
                Some(mut send) => {
                    let _ = send.send_trailers(trailers(code, message));
                }
                None => {
                    let _ = respond.send_response(trailers_only(code, message), true);
                }
            }
        };
    let mut decoder = FrameDecoder::new(64 * 1024 * 1024);
    let (requests_tx, requests) = mpsc::unbounded_channel();
    let (commands, mut commands_rx) = mpsc::unbounded_channel();
    let mut stream = Some(FakeStream { headers: parts.headers, requests, commands });
    loop {
        tokio::select! {
            data = body.data() => {
                let Some(Ok(chunk)) = data else { return };
                let _ = body.flow_control().release_capacity(chunk.len());
                decoder.push(&chunk);
                while let Ok(Some(bytes)) = decoder.next_message() {
                    let Ok(request) = DeltaDiscoveryRequest::decode(bytes) else {
                        finish(&mut respond, send.take(), Code::Internal, "bad request message");
                        return;
                    };
                    lock(&shared).requests.push(request.clone());
                    if let Some(first) = stream.take() {
                        // istiod: the first request must carry a valid node.
                        let ambient = lock(&shared).ambient;
                        let check = match &request.node {
                            None => Err((Code::InvalidArgument, "missing node information".to_owned())),
                            Some(node) => check_node_id(&node.id).map_err(|m| (Code::InvalidArgument, m)),
                        }
                        .and_then(|()| {
                            if ambient {
                                Ok(())
                            } else {
                                Err((Code::Unknown, "ztunnel requires PILOT_ENABLE_AMBIENT=true".to_owned()))
                            }
                        });
                        if let Err((code, message)) = check {
                            let mut s = lock(&shared);
                            if let Some(last) = s.attempts.last_mut() {
                                last.refused = Some((code, message.clone()));
                            }
                            drop(s);
                            finish(&mut respond, send.take(), code, &message);
                            return;
                        }
                        let _ = streams_tx.send(first);
                    }
                    let _ = requests_tx.send(request);
                }
            }
            command = commands_rx.recv() => match command {
                Some(command @ (Command::Send(_) | Command::SendRaw(_))) => {
                    let frame = match command {
                        Command::Send(response) => grpc::encode_frame(&response),
                        Command::SendRaw(bytes) => raw_frame(&bytes),
                        _ => return,
                    };
                    if send.is_none() {
                        let headers = http::Response::builder().status(200).header("content-type", "application/grpc");
                        match respond.send_response(headers.body(()).unwrap_or_default(), false) {
                            Ok(s) => send = Some(s),
                            Err(_) => return,
                        }
                    }
                    if let Some(s) = &mut send {
                        if s.send_data(frame, false).is_err() {
                            return;
                        }
                    }
                }
                Some(Command::End(code, message)) => {
                    finish(&mut respond, send.take(), code, &message);
                    return;
                }
                Some(Command::Reset) => {
                    match &mut send {
                        Some(s) => s.send_reset(h2::Reason::CANCEL),
                        None => respond.send_reset(h2::Reason::CANCEL),
                    }
                    return;
                }
                None => return,
            }
        }
    }
}

fn raw_frame(bytes: &[u8]) -> Bytes {
    let mut frame = Vec::with_capacity(grpc::PREFIX_LEN + bytes.len());
    frame.push(0);
    frame.extend_from_slice(&u32::try_from(bytes.len()).unwrap_or(u32::MAX).to_be_bytes());
    frame.extend_from_slice(bytes);
    frame.into()
}

/// Builds a `Resource` wrapping `message` as `type_url`.
pub fn resource(name: &str, version: &str, type_url: &str, message: &impl Message) -> crate::wire::Resource {
    crate::wire::Resource {
        name: name.to_owned(),
        version: version.to_owned(),
        resource: Some(crate::wire::Any { type_url: type_url.to_owned(), value: message.encode_to_vec() }),
        aliases: Vec::new(),
    }
}

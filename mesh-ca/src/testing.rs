//! A fake istiod CA for tests (feature `testing`), applying istiod's checks of `CreateCertificate`
//! (`security/pkg/server/ca/server.go`, `node_auth.go`) to a table of callers and pods the test gives.
//!
//! Guarantees, in istiod's order, with istiod's exact status codes and messages:
//! 1. the bearer token must be one the test registered ([`FakeCa::add_caller`]: token → namespace, service
//!    account, pod name, pod UID), else `Unauthenticated: request authenticate failure`;
//! 2. with an `ImpersonatedIdentity`: the trusted node accounts (`CA_TRUSTED_NODE_ACCOUNTS`,
//!    [`FakeCa::trust_node_account`]) must be set and hold the caller's `ns/sa`; the identity must parse as
//!    `spiffe://<td>/ns/<ns>/sa/<sa>`; the caller's pod must exist with the same UID and service account; and a
//!    pod of the requested `ns/sa` that has not failed must run on the caller pod's node — any failure is
//!    `Unauthenticated: request impersonation authentication failure`. Without it, the caller's own identity is
//!    signed;
//! 3. the CSR must parse and its signature verify, else `InvalidArgument: CSR signing error (…)`; a TTL of 0 or less
//!    becomes the default (24 h), one over the maximum (90 d) is `InvalidArgument: CSR signing error (requested TTL
//!    … is greater than the max allowed TTL …)`; the CSR's SANs are ignored, as istiod ignores them;
//! 4. the response is istiod's: the leaf, the intermediate, then the root bundle last, each ending in `\n`.
//!
//! The CA is a root and an intermediate made with rcgen (P-256); leaves are signed by the intermediate for
//! `[now - 2 min, now + ttl]` on the fake's [`Clock`] (istiod's back-dating; notAfter clamped to the
//! intermediate's), with increasing serial numbers; an expired intermediate is istiod's `Internal: CSR signing
//! error (signing certificate has expired at …)`. A test can also script refusals,
//! tamper with responses (another SAN, a given chain, raw bytes), and hold requests to count how many are in
//! flight. The fake is reachable in process ([`FakeCa::signer`], for paused-time tests) or over TLS + HTTP/2
//! ([`FakeCa::serve`] on 127.0.0.1, [`FakeCa::serve_on`] on a listener the caller bound), every server of one fake
//! presenting the same TLS certificate. Every request is recorded; waits are bounded by [`WAIT`].

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use hbone::identity::Identity;
use prost::Message;
use rcgen::{
    BasicConstraints, CertificateParams, CertificateSigningRequestParams, DistinguishedName, DnType,
    ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose, SanType, SerialNumber,
};
use tokio::sync::watch;
use xds::grpc::{self, Code, FrameDecoder, GrpcStatus};
use xds::testing::ServingCert;

use crate::chain::decode_response;
use crate::client::{request_certificate, FetchError, RequestSettings, SignFuture, Signer};
use crate::clock::Clock;
use crate::wire::{IstioCertificateRequest, IstioCertificateResponse, CREATE_CERTIFICATE_PATH};

/// The longest a test helper waits.
pub const WAIT: Duration = Duration::from_secs(10);
/// The DNS name in the fake server's TLS certificate (the fake xDS server's: one istiod serves both).
pub use xds::testing::SERVER_NAME;
/// istiod's exact authentication failure message.
pub const AUTHENTICATE_FAILURE: &str = "request authenticate failure";
/// istiod's exact impersonation failure message.
pub const IMPERSONATION_FAILURE: &str = "request impersonation authentication failure";
/// The prefix of istiod's signing failures.
pub const CSR_SIGNING_ERROR: &str = "CSR signing error";
/// istiod's `DEFAULT_WORKLOAD_CERT_TTL`.
pub const DEFAULT_TTL: Duration = Duration::from_secs(24 * 3600);
/// How far istiod back-dates a leaf's notBefore (`ClockSkewGracePeriod`).
pub const CLOCK_SKEW_GRACE_PERIOD: Duration = Duration::from_secs(120);
/// istiod's `MAX_WORKLOAD_CERT_TTL`.
pub const MAX_TTL: Duration = Duration::from_secs(90 * 24 * 3600);

/// Who a bearer token authenticates (what istiod's TokenReview returns for a pod-bound token).
#[derive(Clone, Debug)]
pub struct Caller {
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's service account.
    pub service_account: String,
    /// The pod's name.
    pub pod_name: String,
    /// The pod's UID.
    pub pod_uid: String,
}

/// A pod as istiod's informer sees it.
#[derive(Clone, Debug)]
pub struct Pod {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// UID.
    pub uid: String,
    /// Service account.
    pub service_account: String,
    /// `spec.nodeName`.
    pub node: String,
    /// `status.phase == Failed` (istiod's informer filters those out).
    pub failed: bool,
}

/// A deliberate fault in the fake's successful responses.
#[derive(Clone, Debug)]
pub enum Tamper {
    /// Sign the leaf for this URI instead of the checked identity.
    San(String),
    /// Answer with this chain instead.
    Chain(Vec<String>),
    /// Answer with these bytes as the response message.
    Raw(Vec<u8>),
}

/// One request as the fake saw it.
#[derive(Clone, Debug)]
pub struct Recorded {
    /// When it arrived (tokio's clock).
    pub at: tokio::time::Instant,
    /// The `ImpersonatedIdentity`, if any.
    pub impersonated: Option<String>,
    /// `validity_duration`.
    pub validity_duration: i64,
    /// Request headers (over the network only).
    pub headers: Option<http::HeaderMap>,
    /// The SAN signed, or the refusal.
    pub outcome: Result<String, (Code, String)>,
}

struct State {
    trust_domain: String,
    clock: Clock,
    callers: HashMap<String, Caller>,
    pods: Vec<Pod>,
    trusted: Vec<(String, String)>,
    max_ttl: Duration,
    issuer: Issuer<'static, KeyPair>,
    intermediate_pem: String,
    intermediate_not_after: SystemTime,
    root_pem: String,
    serial: u64,
    tamper: Option<Tamper>,
    refusals: VecDeque<(Code, String)>,
    recorded: Vec<Recorded>,
    in_flight: usize,
    max_in_flight: usize,
}

/// The fake CA; cheap to clone (clones share the state).
#[derive(Clone)]
pub struct FakeCa {
    /// The TLS certificate every server of this CA presents: made at the first serve.
    tls: Arc<std::sync::OnceLock<ServingCert>>,
    state: Arc<Mutex<State>>,
    changed: watch::Sender<usize>,
    held: watch::Sender<bool>,
}

fn lock(state: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    state.lock().unwrap_or_else(|e| e.into_inner())
}

fn offset(at: SystemTime) -> time::OffsetDateTime {
    time::OffsetDateTime::from(at)
}

/// Go's `time.Duration.String()` for whole seconds (`2400h0m0s`, `1m30s`, `45s`).
pub fn go_duration(d: Duration) -> String {
    let s = d.as_secs();
    let (h, m, s) = (s / 3600, (s / 60) % 60, s % 60);
    if h > 0 {
        format!("{h}h{m}m{s}s")
    } else if m > 0 {
        format!("{m}m{s}s")
    } else {
        format!("{s}s")
    }
}

impl FakeCa {
    /// A CA for `trust_domain` whose root and intermediate are valid from an hour before `clock`'s now for ten
    /// years.
    pub fn new(trust_domain: &str, clock: Clock) -> FakeCa {
        let now = clock.now();
        Self::with_root_validity(
            trust_domain,
            clock,
            now - Duration::from_secs(3600),
            now + Duration::from_secs(10 * 365 * 86400),
        )
    }

    /// A CA whose root is valid over `[not_before, not_after]` (an expired root: both past); the intermediate that
    /// signs leaves stays valid from an hour ago for ten years (a plugged-in intermediate outliving its root).
    pub fn with_root_validity(
        trust_domain: &str,
        clock: Clock,
        not_before: SystemTime,
        not_after: SystemTime,
    ) -> FakeCa {
        let ca_params = |cn: &str, not_before: SystemTime, not_after: SystemTime| {
            let mut p = CertificateParams::default();
            p.distinguished_name = DistinguishedName::new();
            p.distinguished_name.push(DnType::OrganizationName, trust_domain);
            p.distinguished_name.push(DnType::CommonName, cn);
            p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            p.key_usages =
                vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
            p.not_before = offset(not_before);
            p.not_after = offset(not_after);
            p
        };
        let now = clock.now();
        let root_key = KeyPair::generate().expect("root key");
        let root_params = ca_params("fake istiod root", not_before, not_after);
        let root = root_params.self_signed(&root_key).expect("root certificate");
        let root_issuer = Issuer::new(root_params, root_key);
        let intermediate_key = KeyPair::generate().expect("intermediate key");
        let intermediate_not_after = now + Duration::from_secs(10 * 365 * 86400);
        let intermediate_params =
            ca_params("fake istiod intermediate", now - Duration::from_secs(3600), intermediate_not_after);
        let intermediate = intermediate_params.signed_by(&intermediate_key, &root_issuer).expect("intermediate");
        let issuer = Issuer::new(intermediate_params, intermediate_key);
        let (changed, _) = watch::channel(0);
        let (held, _) = watch::channel(false);
        FakeCa {
            tls: Arc::default(),
            state: Arc::new(Mutex::new(State {
                trust_domain: trust_domain.to_owned(),
                clock,
                callers: HashMap::new(),
                pods: Vec::new(),
                trusted: Vec::new(),
                max_ttl: MAX_TTL,
                issuer,
                intermediate_pem: intermediate.pem(),
                intermediate_not_after,
                root_pem: root.pem(),
                serial: 1000,
                tamper: None,
                refusals: VecDeque::new(),
                recorded: Vec::new(),
                in_flight: 0,
                max_in_flight: 0,
            })),
            changed,
            held,
        }
    }

    /// The root certificate (PEM): the mesh trust anchor.
    pub fn root_pem(&self) -> String {
        lock(&self.state).root_pem.clone()
    }

    /// Registers a pod-bound token: `token` authenticates `caller`.
    pub fn add_caller(&self, token: &str, caller: Caller) {
        lock(&self.state).callers.insert(token.to_owned(), caller);
    }

    /// Adds a pod to the informer's view.
    pub fn add_pod(&self, pod: Pod) {
        lock(&self.state).pods.push(pod);
    }

    /// Removes a pod.
    pub fn remove_pod(&self, namespace: &str, name: &str) {
        lock(&self.state).pods.retain(|p| !(p.namespace == namespace && p.name == name));
    }

    /// Adds `namespace/service_account` to `CA_TRUSTED_NODE_ACCOUNTS`.
    pub fn trust_node_account(&self, namespace: &str, service_account: &str) {
        lock(&self.state).trusted.push((namespace.to_owned(), service_account.to_owned()));
    }

    /// Changes `MAX_WORKLOAD_CERT_TTL`.
    pub fn set_max_ttl(&self, max: Duration) {
        lock(&self.state).max_ttl = max;
    }

    /// Tampers with every later successful response (`None`: stop).
    pub fn set_tamper(&self, tamper: Option<Tamper>) {
        lock(&self.state).tamper = tamper;
    }

    /// Refuses the next request with this status (queued; one per request), before any check.
    pub fn refuse_next(&self, code: Code, message: &str) {
        lock(&self.state).refusals.push_back((code, message.to_owned()));
    }

    /// Holds every request (`true`) until released (`false`); see [`FakeCa::max_in_flight`].
    pub fn hold(&self, held: bool) {
        self.held.send_replace(held);
    }

    /// Requests being answered right now.
    pub fn in_flight(&self) -> usize {
        lock(&self.state).in_flight
    }

    /// The most requests answered at once so far.
    pub fn max_in_flight(&self) -> usize {
        lock(&self.state).max_in_flight
    }

    /// Every request so far.
    pub fn requests(&self) -> Vec<Recorded> {
        lock(&self.state).recorded.clone()
    }

    /// Waits until `condition` holds on the recorded requests (woken by each request); panics after [`WAIT`].
    pub async fn wait_requests(&self, condition: impl Fn(&[Recorded]) -> bool) -> Vec<Recorded> {
        let mut changed = self.changed.subscribe();
        let wait = async {
            loop {
                let recorded = self.requests();
                if condition(&recorded) {
                    return recorded;
                }
                if changed.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
        };
        tokio::time::timeout(WAIT, wait).await.unwrap_or_else(|_| panic!("timed out waiting on requests"))
    }

    /// Waits until `n` requests are held at once; panics after [`WAIT`].
    pub async fn wait_in_flight(&self, n: usize) {
        let mut changed = self.changed.subscribe();
        let wait = async {
            while self.in_flight() < n {
                if changed.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
        };
        tokio::time::timeout(WAIT, wait).await.unwrap_or_else(|_| panic!("timed out waiting for {n} in flight"))
    }

    /// Answers one request as istiod would, as the serialized response (or the status it fails with). `bearer` is
    /// the `authorization` header's value.
    pub async fn create_certificate(
        &self,
        bearer: Option<&str>,
        request: &IstioCertificateRequest,
        headers: Option<http::HeaderMap>,
    ) -> Result<Vec<u8>, (Code, String)> {
        {
            let mut s = lock(&self.state);
            s.in_flight += 1;
            s.max_in_flight = s.max_in_flight.max(s.in_flight);
        }
        self.changed.send_modify(|n| *n += 1);
        let mut held = self.held.subscribe();
        let _ = held.wait_for(|h| !*h).await;
        let mut s = lock(&self.state);
        s.in_flight -= 1;
        let outcome = s.answer(bearer, request);
        s.recorded.push(Recorded {
            at: tokio::time::Instant::now(),
            impersonated: request.impersonated_identity().map(str::to_owned),
            validity_duration: request.validity_duration,
            headers,
            outcome: outcome.as_ref().map(|(san, _)| san.clone()).map_err(Clone::clone),
        });
        drop(s);
        self.changed.send_modify(|n| *n += 1);
        outcome.map(|(_, bytes)| bytes)
    }

    /// A [`Signer`] calling this CA in process with `token`; responses go through the same decoding and
    /// verification as the network client's.
    pub fn signer(&self, token: &str, settings: RequestSettings) -> FakeSigner {
        FakeSigner { ca: self.clone(), bearer: format!("Bearer {token}"), settings }
    }

    /// Serves `CreateCertificate` over TLS + HTTP/2 on 127.0.0.1 until the returned server is dropped.
    pub async fn serve(&self) -> FakeCaServer {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        self.serve_on(listener).await
    }

    /// Like [`FakeCa::serve`], on `listener` (bound wherever the caller chose: another address, a network
    /// namespace). Every server of this CA (and of its clones) presents the same TLS certificate, as one istiod
    /// started again does, so a client's `CA_ROOT_CA` keeps trusting it.
    pub async fn serve_on(&self, listener: std::net::TcpListener) -> FakeCaServer {
        let serving = self.tls.get_or_init(ServingCert::new);
        let acceptor = serving.acceptor();
        let (listener, addr) = xds::testing::on_runtime(listener);
        let ca = self.clone();
        let (kick, kicked) = watch::channel(0u64);
        let task = tokio::spawn(async move {
            let mut connections = tokio::task::JoinSet::new();
            loop {
                let Ok((tcp, _)) = listener.accept().await else { continue };
                // As istiod's (Go sets TCP_NODELAY on every connection): no Nagle delay on small writes.
                let _ = tcp.set_nodelay(true);
                let (acceptor, ca, mut kicked) = (acceptor.clone(), ca.clone(), kicked.clone());
                kicked.mark_unchanged();
                connections.spawn(async move {
                    let Ok(tls) = acceptor.accept(tcp).await else { return };
                    let Ok(mut conn) = h2::server::handshake(tls).await else { return };
                    let mut calls = tokio::task::JoinSet::new();
                    loop {
                        tokio::select! {
                            accepted = conn.accept() => {
                                let Some(Ok((request, respond))) = accepted else { return };
                                calls.spawn(serve_call(ca.clone(), request, respond));
                            }
                            // Dropping the connection closes the TCP socket without a GOAWAY.
                            _ = kicked.changed() => return,
                        }
                    }
                });
            }
        });
        FakeCaServer { addr, tls_root_pem: serving.ca_pem().to_owned(), task, kick }
    }
}

impl State {
    fn answer(
        &mut self,
        bearer: Option<&str>,
        request: &IstioCertificateRequest,
    ) -> Result<(String, Vec<u8>), (Code, String)> {
        if let Some(refusal) = self.refusals.pop_front() {
            return Err(refusal);
        }
        let caller = bearer
            .and_then(|b| b.strip_prefix("Bearer "))
            .and_then(|token| self.callers.get(token))
            .cloned()
            .ok_or((Code::Unauthenticated, AUTHENTICATE_FAILURE.to_owned()))?;
        let san = match request.impersonated_identity() {
            Some(requested) => {
                self.authorize_impersonation(&caller, requested)
                    .map_err(|_reason| (Code::Unauthenticated, IMPERSONATION_FAILURE.to_owned()))?;
                requested.to_owned()
            }
            None => format!("spiffe://{}/ns/{}/sa/{}", self.trust_domain, caller.namespace, caller.service_account),
        };
        let signing_error = |e: String| (Code::InvalidArgument, format!("{CSR_SIGNING_ERROR} ({e})"));
        let csr = CertificateSigningRequestParams::from_pem(&request.csr).map_err(|e| signing_error(e.to_string()))?;
        let ttl = match request.validity_duration {
            n if n <= 0 => DEFAULT_TTL,
            n => Duration::from_secs(n.unsigned_abs()),
        };
        if ttl > self.max_ttl {
            return Err(signing_error(format!(
                "requested TTL {} is greater than the max allowed TTL {}",
                go_duration(ttl),
                go_duration(self.max_ttl)
            )));
        }
        let san = match &self.tamper {
            Some(Tamper::San(other)) => other.clone(),
            _ => san,
        };
        // istiod (`genCertTemplateFromCSR`): refuse when the signing certificate has expired, back-date notBefore
        // by `ClockSkewGracePeriod` (2 min), clamp notAfter to the signing certificate's.
        let now = self.clock.now();
        if now >= self.intermediate_not_after {
            let at = jiff::Timestamp::try_from(self.intermediate_not_after).map(|t| t.to_string()).unwrap_or_default();
            return Err((Code::Internal, format!("{CSR_SIGNING_ERROR} (signing certificate has expired at {at})")));
        }
        let mut params = CertificateParams::default();
        params.distinguished_name = DistinguishedName::new();
        params.subject_alt_names =
            vec![SanType::URI(san.clone().try_into().map_err(|e: rcgen::Error| signing_error(e.to_string()))?)];
        params.not_before = offset(now - CLOCK_SKEW_GRACE_PERIOD);
        params.not_after = offset((now + ttl).min(self.intermediate_not_after));
        params.is_ca = IsCa::NoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        self.serial += 1;
        params.serial_number = Some(SerialNumber::from(self.serial.to_be_bytes().to_vec()));
        let leaf = params.signed_by(&csr.public_key, &self.issuer).map_err(|e| signing_error(e.to_string()))?;
        let with_newline = |pem: &str| format!("{}\n", pem.trim_end());
        let chain = vec![with_newline(&leaf.pem()), with_newline(&self.intermediate_pem), self.root_pem.clone()];
        let bytes = match &self.tamper {
            Some(Tamper::Chain(chain)) => IstioCertificateResponse { cert_chain: chain.clone() }.encode_to_vec(),
            Some(Tamper::Raw(bytes)) => bytes.clone(),
            _ => IstioCertificateResponse { cert_chain: chain }.encode_to_vec(),
        };
        Ok((san, bytes))
    }

    /// `node_auth.go`'s `authenticateImpersonation`; the reason is only for the test's eyes (istiod logs it).
    fn authorize_impersonation(&self, caller: &Caller, requested: &str) -> Result<(), String> {
        if !self.trusted.iter().any(|(ns, sa)| *ns == caller.namespace && *sa == caller.service_account) {
            return Err(format!(
                "caller {}/{} is not allowed to impersonate",
                caller.namespace, caller.service_account
            ));
        }
        let requested: Identity =
            requested.parse().map_err(|_| format!("failed to validate impersonated identity {requested}"))?;
        let caller_pod = self
            .pods
            .iter()
            .find(|p| !p.failed && p.namespace == caller.namespace && p.name == caller.pod_name)
            .ok_or("caller pod not found")?;
        if caller_pod.uid != caller.pod_uid || caller_pod.service_account != caller.service_account {
            return Err("caller pod UID or service account mismatch".into());
        }
        let on_node = self.pods.iter().any(|p| {
            !p.failed
                && p.node == caller_pod.node
                && p.namespace == requested.namespace
                && p.service_account == requested.service_account
        });
        if !on_node {
            return Err(format!("no instances of {requested} found on node {}", caller_pod.node));
        }
        Ok(())
    }
}

/// The in-process [`Signer`] of a [`FakeCa`].
pub struct FakeSigner {
    ca: FakeCa,
    bearer: String,
    settings: RequestSettings,
}

impl Signer for FakeSigner {
    fn sign<'a>(&'a self, identity: &'a Identity) -> SignFuture<'a> {
        Box::pin(request_certificate(identity, &self.settings, move |request| async move {
            let bytes = self
                .ca
                .create_certificate(Some(&self.bearer), &request, None)
                .await
                .map_err(|(code, message)| FetchError::Signing(GrpcStatus { code, message }))?;
            Ok(decode_response(&bytes, &self.settings.limits)?)
        }))
    }
}

/// A [`FakeCa`] served over TLS; dropping it stops accepting connections.
pub struct FakeCaServer {
    addr: SocketAddr,
    tls_root_pem: String,
    task: tokio::task::JoinHandle<()>,
    kick: watch::Sender<u64>,
}

impl Drop for FakeCaServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FakeCaServer {
    /// The listener's `address:port` (`127.0.0.1:port` from [`FakeCa::serve`]).
    pub fn address(&self) -> String {
        self.addr.to_string()
    }

    /// Closes every open connection abruptly (a restarted istiod, a connection age limit); new ones are accepted.
    pub fn close_connections(&self) {
        self.kick.send_modify(|n| *n += 1);
    }

    /// The root of the server's TLS certificate (for [`SERVER_NAME`]).
    pub fn tls_root_pem(&self) -> &str {
        &self.tls_root_pem
    }
}

fn trailers(code: Code, message: &str) -> http::HeaderMap {
    let mut t = http::HeaderMap::new();
    t.insert("grpc-status", http::HeaderValue::from(code as i32));
    if let Ok(v) = http::HeaderValue::from_str(&grpc::encode_status_message(message)) {
        t.insert("grpc-message", v);
    }
    t
}

async fn serve_call(ca: FakeCa, request: http::Request<h2::RecvStream>, mut respond: h2::server::SendResponse<Bytes>) {
    let (parts, mut body) = request.into_parts();
    let refuse = |respond: &mut h2::server::SendResponse<Bytes>, code: Code, message: &str| {
        let mut response = http::Response::builder().status(200).header("content-type", "application/grpc");
        for (k, v) in &trailers(code, message) {
            response = response.header(k, v);
        }
        let _ = respond.send_response(response.body(()).unwrap_or_default(), true);
    };
    if parts.uri.path() != CREATE_CERTIFICATE_PATH {
        refuse(&mut respond, Code::Unimplemented, &format!("unknown method {}", parts.uri.path()));
        return;
    }
    let mut decoder = FrameDecoder::new(1024 * 1024);
    let mut message = None;
    while let Some(Ok(chunk)) = body.data().await {
        let _ = body.flow_control().release_capacity(chunk.len());
        decoder.push(&chunk);
        if let Ok(Some(bytes)) = decoder.next_message() {
            message = Some(bytes);
        }
    }
    let Some(request) = message.and_then(|m| IstioCertificateRequest::decode(m).ok()) else {
        refuse(&mut respond, Code::Internal, "bad request message");
        return;
    };
    let bearer = parts.headers.get("authorization").and_then(|v| v.to_str().ok()).map(str::to_owned);
    match ca.create_certificate(bearer.as_deref(), &request, Some(parts.headers)).await {
        Err((code, message)) => refuse(&mut respond, code, &message),
        Ok(bytes) => {
            let headers = http::Response::builder().status(200).header("content-type", "application/grpc");
            let Ok(mut send) = respond.send_response(headers.body(()).unwrap_or_default(), false) else { return };
            let mut frame = Vec::with_capacity(grpc::PREFIX_LEN + bytes.len());
            frame.push(0);
            frame.extend_from_slice(&u32::try_from(bytes.len()).unwrap_or(u32::MAX).to_be_bytes());
            frame.extend_from_slice(&bytes);
            let _ = send.send_data(frame.into(), false);
            let _ = send.send_trailers(trailers(Code::Ok, ""));
        }
    }
}

//! The CA client: one `CreateCertificate` call per certificate, on the `xds` channel to istiod.
//!
//! Guarantees:
//! * each request carries a fresh P-256 key's CSR ([`crate::csr`]), `validity_duration` = the configured TTL
//!   (`SECRET_TTL`, default 24 h) in seconds, and `metadata = {"ImpersonatedIdentity": "spiffe://…"}`, with the
//!   channel's headers (bearer token re-read per call, `clusterid`, `CA_HEADER_*`);
//! * calls share one HTTP/2 connection, made on first use and again after a connection failure; a call that finds
//!   the shared connection closed is made on a new one (checked before the call, and the call is made again once
//!   if a reused connection fails with an HTTP/2 error);
//! * the response is bounded (one gRPC message of at most [`MAX_RESPONSE_BYTES`], a second message is refused,
//!   the number of chain elements is counted before prost decodes) and verified ([`crate::chain`]) before a
//!   [`WorkloadCertificate`] is built; a call that takes longer than the call timeout fails;
//! * a gRPC error from istiod is reported as ztunnel words it: `signing gRPC error ({code}): {message}`.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use hbone::identity::Identity;
use xds::channel::{Channel, ChannelConfig, ChannelError, Connection};
use xds::grpc::{Code, GrpcStatus};

use crate::certificate::WorkloadCertificate;
use crate::chain::{decode_response, verify_chain, ChainError, Limits};
use crate::clock::Clock;
use crate::csr::{CsrError, KeyAndCsr};
use crate::wire::{IstioCertificateRequest, IstioCertificateResponse, CREATE_CERTIFICATE_PATH};

/// istiod's (and ztunnel's) default workload certificate lifetime.
pub const DEFAULT_SECRET_TTL: Duration = Duration::from_secs(24 * 3600);
/// Largest response message accepted: the chain limits' sum with room for protobuf overhead.
pub const MAX_RESPONSE_BYTES: usize = 2 * 1024 * 1024;
/// Default bound on one call, connection included.
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(60);

/// `SECRET_TTL` (a Go duration such as `24h` or `12h30m`), default [`DEFAULT_SECRET_TTL`]. Zero or negative is
/// refused: istiod would silently replace it by its own default.
pub fn secret_ttl(vars: &BTreeMap<String, String>) -> Result<Duration, String> {
    let Some(text) = vars.get("SECRET_TTL").map(|t| t.trim()).filter(|t| !t.is_empty()) else {
        return Ok(DEFAULT_SECRET_TTL);
    };
    let signed =
        jiff::fmt::friendly::SpanParser::new().parse_duration(text).map_err(|e| format!("SECRET_TTL {text:?}: {e}"))?;
    match Duration::try_from(signed) {
        Ok(d) if d >= Duration::from_secs(1) => Ok(d),
        _ => Err(format!("SECRET_TTL {text:?}: must be at least 1s")),
    }
}

/// tonic's wording of a status code, which ztunnel prints in its signing errors.
pub fn code_description(code: Code) -> &'static str {
    match code {
        Code::Ok => "The operation completed successfully",
        Code::Cancelled => "The operation was cancelled",
        Code::Unknown => "Unknown error",
        Code::InvalidArgument => "Client specified an invalid argument",
        Code::DeadlineExceeded => "Deadline expired before operation could complete",
        Code::NotFound => "Some requested entity was not found",
        Code::AlreadyExists => "Some entity that we attempted to create already exists",
        Code::PermissionDenied => "The caller does not have permission to execute the specified operation",
        Code::ResourceExhausted => "Some resource has been exhausted",
        Code::FailedPrecondition => "The system is not in a state required for the operation's execution",
        Code::Aborted => "The operation was aborted",
        Code::OutOfRange => "Operation was attempted past the valid range",
        Code::Unimplemented => "Operation is not implemented or not supported",
        Code::Internal => "Internal error",
        Code::Unavailable => "The service is currently unavailable",
        Code::DataLoss => "Unrecoverable data loss or corruption",
        Code::Unauthenticated => "The request does not have valid authentication credentials",
    }
}

/// Why no certificate was obtained.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// The key or the CSR could not be made.
    #[error(transparent)]
    Csr(#[from] CsrError),
    /// istiod answered with a gRPC error.
    #[error("signing gRPC error ({}): {}", code_description(.0.code), .0.message)]
    Signing(GrpcStatus),
    /// istiod could not be reached, or the call broke (TLS, HTTP/2, framing).
    #[error("CA connection: {0}")]
    Connection(ChannelError),
    /// The call did not finish in time.
    #[error("CA call timed out after {0:?}")]
    Timeout(Duration),
    /// The response was refused.
    #[error("invalid CA response: {0}")]
    Response(#[from] ChainError),
}

impl FetchError {
    /// The gRPC status istiod answered with, if that is the failure.
    pub fn status(&self) -> Option<&GrpcStatus> {
        match self {
            FetchError::Signing(status) => Some(status),
            _ => None,
        }
    }
}

impl From<ChannelError> for FetchError {
    fn from(e: ChannelError) -> Self {
        match e {
            ChannelError::Status(status) => FetchError::Signing(status),
            other => FetchError::Connection(other),
        }
    }
}

/// A boxed future of the [`Signer`] trait.
pub type SignFuture<'a> = Pin<Box<dyn Future<Output = Result<WorkloadCertificate, FetchError>> + Send + 'a>>;

/// Something that obtains a certificate for an identity: [`CaClient`], or a fake in tests.
pub trait Signer: Send + Sync + 'static {
    /// One attempt to obtain a certificate for `identity`.
    fn sign<'a>(&'a self, identity: &'a Identity) -> SignFuture<'a>;
}

/// What one request needs besides the call itself; shared by [`CaClient`] and the in-process fake signer.
#[derive(Clone, Debug)]
pub struct RequestSettings {
    /// Requested lifetime.
    pub ttl: Duration,
    /// Response bounds.
    pub limits: Limits,
    /// The clock responses are verified by.
    pub clock: Clock,
}

impl Default for RequestSettings {
    fn default() -> Self {
        RequestSettings { ttl: DEFAULT_SECRET_TTL, limits: Limits::default(), clock: Clock::System }
    }
}

/// Makes the key and request for `identity`, passes the request to `call`, and verifies what comes back.
pub async fn request_certificate<F, Fut>(
    identity: &Identity,
    settings: &RequestSettings,
    call: F,
) -> Result<WorkloadCertificate, FetchError>
where
    F: FnOnce(IstioCertificateRequest) -> Fut,
    Fut: Future<Output = Result<IstioCertificateResponse, FetchError>>,
{
    let key = KeyAndCsr::generate(identity)?;
    let ttl = i64::try_from(settings.ttl.as_secs()).unwrap_or(i64::MAX);
    let request = IstioCertificateRequest::impersonating(key.csr_pem().to_owned(), ttl, &identity.to_string());
    let response = call(request).await?;
    let verified =
        verify_chain(&response.cert_chain, identity, key.public_key_raw(), settings.clock.now(), &settings.limits)?;
    Ok(WorkloadCertificate::new(identity.clone(), verified, key.private_key()))
}

/// The client of istiod's `IstioCertificateService`.
pub struct CaClient {
    channel: Channel,
    settings: RequestSettings,
    call_timeout: Duration,
    connection: tokio::sync::Mutex<Option<Arc<Connection>>>,
}

impl std::fmt::Debug for CaClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CaClient").field("settings", &self.settings).finish_non_exhaustive()
    }
}

impl CaClient {
    /// A client on `config` (its `max_message_bytes` is lowered to [`MAX_RESPONSE_BYTES`]); does not connect.
    pub fn new(mut config: ChannelConfig, settings: RequestSettings) -> Result<Self, ChannelError> {
        config.max_message_bytes = config.max_message_bytes.min(MAX_RESPONSE_BYTES);
        Ok(CaClient {
            channel: Channel::new(config)?,
            settings,
            call_timeout: DEFAULT_CALL_TIMEOUT,
            connection: tokio::sync::Mutex::new(None),
        })
    }

    /// The client ztunnel's variables describe: the channel of `CA_ADDRESS`, `CA_ROOT_CA`, `ALT_CA_HOSTNAME`,
    /// `AUTH_TOKEN`, `CA_HEADER_*`, the cluster id ([`xds::settings::channel_config`]) and the TTL of `SECRET_TTL`;
    /// `None` when `CA_ADDRESS` is set but empty (no CA). `exists` tells which files exist (the token path test).
    pub fn from_env(
        vars: &BTreeMap<String, String>,
        exists: impl Fn(&std::path::Path) -> bool,
    ) -> Result<Option<Self>, String> {
        let Some(config) = xds::settings::channel_config(xds::settings::Endpoint::Ca, vars, exists)? else {
            return Ok(None);
        };
        let settings = RequestSettings { ttl: secret_ttl(vars)?, ..RequestSettings::default() };
        CaClient::new(config, settings).map(Some).map_err(|e| e.to_string())
    }

    /// The request settings (TTL, limits, clock).
    pub fn settings(&self) -> &RequestSettings {
        &self.settings
    }

    /// Changes the bound on one call (default [`DEFAULT_CALL_TIMEOUT`]).
    pub fn with_call_timeout(mut self, timeout: Duration) -> Self {
        self.call_timeout = timeout;
        self
    }

    /// One `CreateCertificate` call for `identity`, verified.
    pub async fn fetch(&self, identity: &Identity) -> Result<WorkloadCertificate, FetchError> {
        let timeout = self.call_timeout;
        match tokio::time::timeout(timeout, request_certificate(identity, &self.settings, |r| self.call(r))).await {
            Ok(result) => result,
            Err(_) => Err(FetchError::Timeout(timeout)),
        }
    }

    /// Whether a connection to istiod is held and open (for diagnostics and tests).
    pub async fn connection_is_open(&self) -> bool {
        self.connection.lock().await.as_ref().is_some_and(|c| !c.is_closed())
    }

    /// The shared connection (replaced if it has closed), and whether it was made for this call.
    async fn connection(&self) -> Result<(Arc<Connection>, bool), FetchError> {
        let mut held = self.connection.lock().await;
        if let Some(connection) = held.as_ref().filter(|c| !c.is_closed()) {
            return Ok((connection.clone(), false));
        }
        let connection = Arc::new(self.channel.connect().await.map_err(FetchError::Connection)?);
        *held = Some(connection.clone());
        Ok((connection, true))
    }

    async fn forget_connection(&self, connection: &Arc<Connection>) {
        let mut held = self.connection.lock().await;
        if held.as_ref().is_some_and(|c| Arc::ptr_eq(c, connection)) {
            *held = None;
        }
    }

    /// One call; a reused connection that turns out closed (istiod's connection age limit, a restart) is replaced
    /// and the call made again once, so an idle period does not cost a failed attempt and a backoff.
    async fn call(&self, request: IstioCertificateRequest) -> Result<IstioCertificateResponse, FetchError> {
        let (connection, fresh) = self.connection().await?;
        let result = unary(&connection, &request, &self.settings.limits).await;
        let Err(FetchError::Connection(e)) = &result else { return result };
        tracing::debug!(error = %e, "CA connection failed; the next call reconnects");
        self.forget_connection(&connection).await;
        if fresh || !matches!(e, ChannelError::Http2(_)) {
            return result;
        }
        let (connection, _) = self.connection().await?;
        let result = unary(&connection, &request, &self.settings.limits).await;
        if let Err(FetchError::Connection(_)) = &result {
            self.forget_connection(&connection).await;
        }
        result
    }
}

async fn unary(
    connection: &Connection,
    request: &IstioCertificateRequest,
    limits: &Limits,
) -> Result<IstioCertificateResponse, FetchError> {
    let (mut sink, mut stream) = connection.streaming(CREATE_CERTIFICATE_PATH).await?;
    sink.send(request)?;
    sink.finish()?;
    let bytes = stream.message_bytes().await?.ok_or(ChannelError::NoResponse)?;
    if stream.message_bytes().await?.is_some() {
        return Err(FetchError::Response(ChainError::Decode("more than one response message".into())));
    }
    Ok(decode_response(&bytes, limits)?)
}

impl Signer for CaClient {
    fn sign<'a>(&'a self, identity: &'a Identity) -> SignFuture<'a> {
        Box::pin(self.fetch(identity))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secret_ttl_defaults_to_a_day_and_takes_go_durations() {
        let vars = |v: &str| BTreeMap::from([("SECRET_TTL".to_owned(), v.to_owned())]);
        assert_eq!(secret_ttl(&BTreeMap::new()).unwrap(), DEFAULT_SECRET_TTL);
        assert_eq!(secret_ttl(&vars("12h30m")).unwrap(), Duration::from_secs(45_000));
        assert_eq!(secret_ttl(&vars("90s")).unwrap(), Duration::from_secs(90));
        assert!(secret_ttl(&vars("0s")).unwrap_err().contains("at least 1s"));
        assert!(secret_ttl(&vars("-1h")).is_err());
        assert!(secret_ttl(&vars("soon")).unwrap_err().starts_with("SECRET_TTL"));
    }

    #[test]
    fn the_client_follows_ztunnels_variables() {
        let vars: BTreeMap<String, String> =
            [("CA_ADDRESS", "istiod.istio-system.svc:15012"), ("SECRET_TTL", "12h"), ("CA_ROOT_CA", "/roots.pem")]
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect();
        let client = CaClient::from_env(&vars, |_| false).unwrap().unwrap();
        assert_eq!(client.settings().ttl, Duration::from_secs(12 * 3600));
        let disabled = BTreeMap::from([("CA_ADDRESS".to_owned(), String::new())]);
        assert!(CaClient::from_env(&disabled, |_| false).unwrap().is_none());
    }

    #[test]
    fn signing_errors_read_as_ztunnel_writes_them() {
        let e = FetchError::from(ChannelError::Status(GrpcStatus {
            code: Code::Unauthenticated,
            message: "request impersonation authentication failure".into(),
        }));
        assert_eq!(
            e.to_string(),
            "signing gRPC error (The request does not have valid authentication credentials): request impersonation \
             authentication failure"
        );
        assert!(e.status().is_some());
    }
}

//! The HBONE server: accepts CONNECT streams on an mTLS HTTP/2 connection, enforces the protocol rules,
//! lets a handler connect to the target first, then answers 200 and splices the two streams.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderMap, Response, StatusCode};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::task::JoinSet;

pub use crate::connect::{check_connect, ILLEGAL_TARGET_PORTS};
use crate::identity::Identity;
use crate::keepalive::{self, Keepalive};
use crate::settings;
use crate::stream::H2Stream;
use crate::tls::Accepted;

/// A CONNECT request that passed the protocol checks, as the handler sees it.
#[derive(Debug, Clone)]
pub struct InboundRequest {
    /// The target (`:authority`); its IP equals the IP the client dialled.
    pub authority: SocketAddr,
    /// The request headers (`forwarded`, `baggage`, `traceparent`, ...).
    pub headers: HeaderMap,
    /// The client's verified identity.
    pub peer_identity: Identity,
    /// The client's address.
    pub peer: SocketAddr,
    /// The address the client dialled.
    pub local: SocketAddr,
}

/// What became of an accepted tunnel, for metrics and access logs.
#[derive(Debug)]
pub struct Transfer {
    /// Bytes carried from the client to the target.
    pub to_target: u64,
    /// Bytes carried from the target to the client.
    pub from_target: u64,
    /// How long the tunnel lasted after the 200.
    pub duration: Duration,
    /// Why the splice ended abnormally, if it did.
    pub error: Option<io::Error>,
}

/// Decides what an inbound tunnel connects to.
pub trait ConnectHandler: Send + Sync + 'static {
    /// The connection to the target.
    type Target: AsyncRead + AsyncWrite + Send + Unpin + 'static;

    /// Connects to the target. Only after this succeeds does the client get 200; an error status
    /// (typically 503) is sent as the answer instead.
    fn connect(&self, req: &InboundRequest) -> impl Future<Output = Result<Self::Target, StatusCode>> + Send;

    /// Reports how the tunnel ended.
    fn finished(&self, req: &InboundRequest, transfer: Transfer);
}

/// Server timers.
#[derive(Debug, Clone, Copy)]
pub struct ServeOptions {
    /// PING keepalive on the connection.
    pub keepalive: Keepalive,
    /// After shutdown is requested (GOAWAY sent), open streams get this long to finish.
    pub drain_deadline: Duration,
}

impl Default for ServeOptions {
    /// Default keepalive; Istio's 5 s `CONNECTION_TERMINATION_DEADLINE`.
    fn default() -> Self {
        ServeOptions { keepalive: Keepalive::default(), drain_deadline: Duration::from_secs(5) }
    }
}

/// Why serving a connection ended with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The HTTP/2 handshake or connection failed.
    #[error("HBONE connection from {peer}: {source}")]
    H2 {
        /// The client.
        peer: SocketAddr,
        /// The underlying error.
        source: h2::Error,
    },
    /// The client stopped answering PINGs.
    #[error("HBONE connection from {0} stopped answering PINGs")]
    Unresponsive(SocketAddr),
    /// Streams were still open when the drain deadline passed; they were cut.
    #[error("HBONE connection from {0} did not drain before the deadline")]
    DrainDeadline(SocketAddr),
}

/// Serves HBONE on one accepted mTLS connection until the client closes it, or `shutdown` resolves; then
/// sends GOAWAY and lets open streams finish within the drain deadline.
pub async fn serve<H: ConnectHandler>(
    accepted: Accepted,
    handler: Arc<H>,
    options: ServeOptions,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServeError> {
    let Accepted { stream, local, peer, peer_identity } = accepted;
    let h2_err = |source| ServeError::H2 { peer, source };
    let mut conn = settings::server().handshake(stream).await.map_err(h2_err)?;
    let alive = keepalive::until_unresponsive(conn.ping_pong(), options.keepalive);
    tokio::pin!(alive, shutdown);
    let mut tunnels = JoinSet::new();
    let conn_info = Arc::new((peer_identity, peer, local));
    let mut deadline = None;
    let result = loop {
        tokio::select! {
            next = conn.accept() => match next {
                Some(Ok((request, respond))) => {
                    tunnels.spawn(tunnel(request, respond, handler.clone(), conn_info.clone()));
                }
                Some(Err(e)) => break Err(h2_err(e)),
                None => break Ok(()),
            },
            Some(_) = tunnels.join_next() => {}
            () = &mut alive => break Err(ServeError::Unresponsive(peer)),
            () = &mut shutdown, if deadline.is_none() => {
                tracing::debug!(%peer, "draining HBONE connection");
                conn.graceful_shutdown();
                deadline = Some(tokio::time::Instant::now() + options.drain_deadline);
            }
            () = sleep_until(deadline) => break Err(ServeError::DrainDeadline(peer)),
        }
    };
    // With the connection gone every remaining stream fails promptly, so the tunnels can report how they
    // ended; a tunnel stuck elsewhere (e.g. in the handler's connect) is cut at the deadline.
    drop(conn);
    let rest = deadline.unwrap_or_else(|| tokio::time::Instant::now() + options.drain_deadline);
    let finished = async { while tunnels.join_next().await.is_some() {} };
    if tokio::time::timeout_at(rest, finished).await.is_err() {
        tunnels.abort_all();
    }
    result
}

/// Sleeps until `deadline`, or forever without one.
async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

async fn tunnel<H: ConnectHandler>(
    request: http::Request<h2::RecvStream>,
    mut respond: h2::server::SendResponse<bytes::Bytes>,
    handler: Arc<H>,
    conn_info: Arc<(Identity, SocketAddr, SocketAddr)>,
) {
    let (peer_identity, peer, local) = (*conn_info).clone();
    let refuse = |respond: &mut h2::server::SendResponse<bytes::Bytes>, status: StatusCode| {
        let response = Response::builder().status(status).body(()).expect("a status-only response");
        if let Err(e) = respond.send_response(response, true) {
            tracing::debug!(%peer, error = %e, "could not send HBONE refusal");
        }
    };
    let authority = match check_connect(request.method(), request.uri(), local) {
        Ok(authority) => authority,
        Err(status) => {
            tracing::info!(%peer, method = %request.method(), uri = %request.uri(), %status, "refused HBONE request");
            return refuse(&mut respond, status);
        }
    };
    let (parts, body) = request.into_parts();
    let req = InboundRequest { authority, headers: parts.headers, peer_identity, peer, local };
    let mut target = match handler.connect(&req).await {
        Ok(target) => target,
        Err(status) => return refuse(&mut respond, status),
    };
    let ok = Response::builder().status(StatusCode::OK).body(()).expect("a status-only response");
    let send = match respond.send_response(ok, false) {
        Ok(send) => send,
        Err(e) => {
            tracing::debug!(%peer, error = %e, "client went away before the 200");
            return;
        }
    };
    let started = tokio::time::Instant::now();
    let mut client = crate::counting::Counting::new(H2Stream::new(send, body, None));
    let result = tokio::io::copy_bidirectional_with_sizes(&mut client, &mut target, 64 * 1024, 64 * 1024).await;
    let (to_target, from_target) = client.totals();
    handler.finished(&req, Transfer { to_target, from_target, duration: started.elapsed(), error: result.err() });
}

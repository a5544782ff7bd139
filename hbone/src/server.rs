//! The HBONE server: accepts CONNECT streams on an mTLS HTTP/2 connection, enforces the protocol rules,
//! lets a handler connect to the target first, then answers 200 and splices the two streams.
//!
//! What one client can make it hold is bounded: the HTTP/2 limits of [`crate::settings`] (100 concurrent streams,
//! 16 KiB header lists, reset-stream bounds), the HTTP/2 handshake and idle timeouts of [`ServeOptions`], and the
//! connection caps of [`crate::limits`], whose excess [`refuse`] turns away.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::{BufMut, BytesMut};
use http::{HeaderMap, Response, StatusCode};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::task::JoinSet;

use crate::budget::{Account, ConnLedger, Metered};
pub use crate::connect::{check_connect, ILLEGAL_TARGET_PORTS};
use crate::identity::Identity;
use crate::keepalive::{self, Keepalive};
use crate::settings;
use crate::stream::H2Stream;
use crate::tls::{Accepted, HANDSHAKE_TIMEOUT};

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
    /// A connection without open streams for this long is closed (GOAWAY, then as after a shutdown). The client
    /// must also complete the HTTP/2 handshake (send its preface) within this, or [`HANDSHAKE_TIMEOUT`] if shorter.
    pub idle_timeout: Duration,
}

/// How long an inbound connection may go without streams by default: twice ztunnel's 5 minute
/// `POOL_UNUSED_RELEASE_TIMEOUT`, so well-behaved clients let their idle connections go first.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(600);

impl Default for ServeOptions {
    /// Default keepalive; Istio's 5 s `CONNECTION_TERMINATION_DEADLINE`; [`DEFAULT_IDLE_TIMEOUT`].
    fn default() -> Self {
        ServeOptions {
            keepalive: Keepalive::default(),
            drain_deadline: Duration::from_secs(5),
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
        }
    }
}

/// How a connection ended without error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// The client closed it.
    ClientClosed,
    /// It had no open stream for the idle timeout: the server sent GOAWAY and closed it.
    IdleTimeout,
    /// Shutdown was requested and its streams finished in time.
    Drained,
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
    /// The client did not send the HTTP/2 connection preface in time.
    #[error("HBONE connection from {0} sent no HTTP/2 preface in time")]
    HandshakeTimeout(SocketAddr),
}

impl ServeError {
    /// The error code of the GOAWAY this server sent because the client broke one of its HTTP/2 limits, if that
    /// is how the connection ended, in lower snake case (a metric label): `enhance_your_calm` (too many reset
    /// streams, CONTINUATION frames or header bytes), `compression_error` (a header block too long even to
    /// skip), `frame_size_error` (a frame over [`settings::MAX_FRAME_SIZE`]).
    pub fn limit_exceeded(&self) -> Option<&'static str> {
        let ServeError::H2 { source, .. } = self else { return None };
        if !(source.is_go_away() && source.is_library()) {
            return None;
        }
        match source.reason()? {
            h2::Reason::ENHANCE_YOUR_CALM => Some("enhance_your_calm"),
            h2::Reason::COMPRESSION_ERROR => Some("compression_error"),
            h2::Reason::FRAME_SIZE_ERROR => Some("frame_size_error"),
            _ => None,
        }
    }
}

/// Serves HBONE on one accepted mTLS connection until the client closes it, it goes idle, or `shutdown`
/// resolves; then sends GOAWAY and lets open streams finish within the drain deadline.
pub async fn serve<H: ConnectHandler>(
    accepted: Accepted,
    handler: Arc<H>,
    options: ServeOptions,
    shutdown: impl Future<Output = ()>,
) -> Result<Ended, ServeError> {
    serve_budgeted(accepted, handler, options, None, shutdown).await
}

/// [`serve`], with what the connection holds (received DATA not yet written to the targets, answers not yet
/// written to the socket) charged to `memory`: the connection stops reading its socket while the account has no
/// room (see [`crate::budget`]).
pub async fn serve_budgeted<H: ConnectHandler>(
    accepted: Accepted,
    handler: Arc<H>,
    options: ServeOptions,
    memory: Option<Account>,
    shutdown: impl Future<Output = ()>,
) -> Result<Ended, ServeError> {
    let Accepted { stream, local, peer, peer_identity } = accepted;
    let h2_err = |source| ServeError::H2 { peer, source };
    let ledger = memory.map(ConnLedger::new);
    let stream = Metered::new(stream, ledger.clone());
    let handshake = settings::server().handshake(stream);
    let mut conn = tokio::time::timeout(options.idle_timeout.min(HANDSHAKE_TIMEOUT), handshake)
        .await
        .map_err(|_| ServeError::HandshakeTimeout(peer))?
        .map_err(h2_err)?;
    let alive = keepalive::until_unresponsive(conn.ping_pong(), options.keepalive);
    let idle = tokio::time::sleep(options.idle_timeout);
    tokio::pin!(alive, shutdown, idle);
    let mut tunnels = JoinSet::new();
    let conn_info = Arc::new((peer_identity, peer, local));
    let mut deadline = None;
    let mut closing = Ended::ClientClosed;
    let result = loop {
        tokio::select! {
            next = conn.accept() => match next {
                Some(Ok((request, respond))) => {
                    tunnels.spawn(tunnel(request, respond, handler.clone(), conn_info.clone(), ledger.clone()));
                }
                // After our GOAWAY a client may close before our final frames are written.
                Some(Err(e)) if e.is_io() && closing != Ended::ClientClosed => break Ok(closing),
                Some(Err(e)) => break Err(h2_err(e)),
                None => break Ok(closing),
            },
            Some(_) = tunnels.join_next() => {
                if tunnels.is_empty() {
                    // After the idle GOAWAY, streams opened in the race finished: the client has a drain deadline
                    // to close.
                    let wait = if closing == Ended::IdleTimeout { options.drain_deadline } else { options.idle_timeout };
                    idle.as_mut().reset(tokio::time::Instant::now() + wait);
                }
            }
            () = &mut alive => break Err(ServeError::Unresponsive(peer)),
            () = &mut shutdown, if deadline.is_none() => {
                tracing::debug!(%peer, "draining HBONE connection");
                conn.graceful_shutdown();
                deadline = Some(tokio::time::Instant::now() + options.drain_deadline);
                closing = Ended::Drained;
            }
            () = &mut idle, if tunnels.is_empty() && deadline.is_none() => {
                // The second time: the client neither closed nor used the connection after the GOAWAY.
                if closing == Ended::IdleTimeout {
                    break Ok(Ended::IdleTimeout);
                }
                tracing::debug!(%peer, timeout = ?options.idle_timeout, "closing idle HBONE connection");
                // Streams that were already on their way are still served; the connection closes after them.
                conn.graceful_shutdown();
                closing = Ended::IdleTimeout;
                idle.as_mut().reset(tokio::time::Instant::now() + options.drain_deadline);
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

/// How long [`refuse`] waits for the client to read its GOAWAY and close.
pub const REFUSE_LINGER: Duration = Duration::from_secs(1);

/// Refuses a connection over a cap (see [`crate::limits`]) without serving anything on it: sends the HTTP/2
/// server preface (an empty SETTINGS) and GOAWAY(REFUSED_STREAM, last stream 0) with `why` as debug data, so the
/// client learns that none of its streams were processed and why, then closes TLS. It does not wait for the
/// client's preface; it reads and discards what the client still sends until it closes too, for at most
/// [`REFUSE_LINGER`], so the GOAWAY is not lost to a reset.
pub async fn refuse(accepted: Accepted, why: &str) {
    let Accepted { mut stream, peer, .. } = accepted;
    let frames = refusal_frames(why);
    let exchange = async {
        stream.write_all(&frames).await?;
        stream.shutdown().await?;
        let mut discard = [0u8; 4096];
        while stream.read(&mut discard).await? > 0 {}
        Ok::<(), io::Error>(())
    };
    if let Ok(Err(e)) = tokio::time::timeout(REFUSE_LINGER, exchange).await {
        tracing::debug!(%peer, error = %e, "refusing an HBONE connection");
    }
}

/// An empty SETTINGS frame, then GOAWAY(last stream 0, REFUSED_STREAM) with `why` (at most 256 bytes) as debug data.
fn refusal_frames(why: &str) -> BytesMut {
    const SETTINGS: u8 = 0x4;
    const GOAWAY: u8 = 0x7;
    let debug = &why.as_bytes()[..why.len().min(256)];
    let mut out = BytesMut::with_capacity(9 + 9 + 8 + debug.len());
    // Frame header: 24-bit length, type, flags, 31-bit stream id (0: the connection).
    out.put_uint(0, 3);
    out.put_u8(SETTINGS);
    out.put_u8(0);
    out.put_u32(0);
    out.put_uint(8 + debug.len() as u64, 3);
    out.put_u8(GOAWAY);
    out.put_u8(0);
    out.put_u32(0);
    out.put_u32(0);
    out.put_u32(h2::Reason::REFUSED_STREAM.into());
    out.put_slice(debug);
    out
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
    ledger: Option<Arc<ConnLedger>>,
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
    let mut client = H2Stream::new(send, body, None).budgeted(ledger);
    let copied = crate::copy::bidirectional(&mut client, &mut target).await;
    let (to_target, from_target) = (copied.from_tunnel, copied.to_tunnel);
    handler.finished(&req, Transfer { to_target, from_target, duration: started.elapsed(), error: copied.error });
}

//! The HBONE client: CONNECT streams multiplexed over pooled mTLS HTTP/2 connections, one pool entry per
//! (source identity, destination identity, destination address).

mod conn;

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http::{HeaderMap, Method, Request, StatusCode};
use tokio::net::TcpStream;
use tokio::sync::watch;

use crate::budget::{Account, ConnLedger, Metered};
use crate::ca::WorkloadCert;
use crate::headers::{self, Baggage};
use crate::identity::Identity;
use crate::keepalive::Keepalive;
use crate::settings;
use crate::stream::H2Stream;
use crate::tls::{MeshTls, TlsError};
use conn::{Conn, Conns, Driver, PoolKey, StreamSlot};

/// Pool limits and timers.
#[derive(Debug, Clone)]
pub struct PoolConfig {
    /// Streams per connection at most. The server's `SETTINGS_MAX_CONCURRENT_STREAMS` applies too: a new
    /// connection is pooled only once the server's SETTINGS arrived, and a connection at the lower of the two
    /// takes no more streams (another connection is dialled instead).
    pub max_streams_per_connection: usize,
    /// A connection without streams for this long is closed. One that is not the only connection for its source,
    /// destination and identity goes sooner, after 5 s without streams (what a burst dialled is not kept).
    pub idle_timeout: Duration,
    /// Dialling (TCP, TLS and HTTP/2 handshakes) must finish within this, and so must the wait for the
    /// CONNECT answer.
    pub connect_timeout: Duration,
    /// PING keepalive on every connection.
    pub keepalive: Keepalive,
    /// Told how long each new connection took to dial (TCP, TLS and HTTP/2 handshakes), for latency metrics.
    pub on_connected: Option<ConnectObserver>,
    /// The source pod's account in the node's memory budget: what its tunnels hold is charged to it, and they
    /// stop reading while it has no room (see [`crate::budget`]). `None`: not budgeted.
    pub memory: Option<Account>,
}

/// A callback the pool calls with the dial time of every connection it establishes.
#[derive(Clone)]
pub struct ConnectObserver(pub Arc<dyn Fn(Duration) + Send + Sync>);

impl std::fmt::Debug for ConnectObserver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ConnectObserver")
    }
}

impl Default for PoolConfig {
    /// ztunnel's values: 100 streams, 5 min idle, 10 s connect timeout, default keepalive.
    fn default() -> Self {
        PoolConfig {
            max_streams_per_connection: 100,
            idle_timeout: Duration::from_secs(300),
            connect_timeout: Duration::from_secs(10),
            keepalive: Keepalive::default(),
            on_connected: None,
            memory: None,
        }
    }
}

/// One tunnel to open: who we are, where to go, whom we expect there, and what to ask for.
#[derive(Debug, Clone)]
pub struct ConnectRequest {
    /// The source workload's certificate (its identity keys the pool).
    pub src: Arc<WorkloadCert>,
    /// The original client address, sent as `forwarded`.
    pub src_addr: SocketAddr,
    /// Where the destination's HBONE server listens: its IP and port [`istio_contract::ports::HBONE`].
    pub dst: SocketAddr,
    /// The identity the destination must prove.
    pub dst_identity: Identity,
    /// The target the server should connect to (`:authority`, `ip:port`).
    pub authority: SocketAddr,
    /// The source workload description sent as `baggage`.
    pub baggage: Baggage,
    /// Any further request headers.
    pub extra_headers: HeaderMap,
}

/// Why a tunnel could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// TCP connect to the destination's HBONE port failed.
    #[error("connecting to {dst}: {source}")]
    Tcp {
        /// The HBONE address dialled.
        dst: SocketAddr,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The TLS handshake failed, e.g. the server is not the expected identity.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// Dialling did not finish within the connect timeout.
    #[error("connecting to {0} timed out")]
    Timeout(SocketAddr),
    /// HTTP/2 failed (handshake, stream refused, connection lost).
    #[error("HTTP/2 with {dst}: {source}")]
    H2 {
        /// The HBONE address dialled.
        dst: SocketAddr,
        /// The underlying error.
        source: h2::Error,
    },
    /// The server answered CONNECT with a non-200 status.
    #[error("{dst} answered CONNECT {authority} with {status}")]
    Status {
        /// The HBONE address dialled.
        dst: SocketAddr,
        /// The requested target.
        authority: SocketAddr,
        /// The status received.
        status: StatusCode,
    },
}

/// Opens the TCP connection an HBONE connection runs on. The node proxy supplies one that creates the socket
/// inside the source pod's network namespace with the proxy mark; [`Pool::new`] connects from the caller's
/// namespace.
pub type Dialer =
    Arc<dyn Fn(SocketAddr) -> Pin<Box<dyn Future<Output = std::io::Result<TcpStream>> + Send>> + Send + Sync>;

struct Inner {
    tls: MeshTls,
    config: PoolConfig,
    dialer: Option<Dialer>,
    conns: Arc<Mutex<Conns>>,
    /// One dial at a time per key, so concurrent first connects share one handshake.
    dialing: Mutex<HashMap<PoolKey, Arc<tokio::sync::Mutex<()>>>>,
    next_id: AtomicU64,
}

/// The HBONE client. Cloning shares the pool.
#[derive(Clone)]
pub struct Pool {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool").field("connections", &self.connection_count()).finish_non_exhaustive()
    }
}

impl Pool {
    /// A pool dialling with `tls`'s mesh policy.
    pub fn new(tls: MeshTls, config: PoolConfig) -> Self {
        Self::build(tls, config, None)
    }

    /// A pool whose connections run on TCP streams opened by `dialer`.
    pub fn with_dialer(tls: MeshTls, config: PoolConfig, dialer: Dialer) -> Self {
        Self::build(tls, config, Some(dialer))
    }

    fn build(tls: MeshTls, config: PoolConfig, dialer: Option<Dialer>) -> Self {
        Pool {
            inner: Arc::new(Inner {
                tls,
                config,
                dialer,
                conns: Arc::default(),
                dialing: Mutex::new(HashMap::new()),
                next_id: AtomicU64::new(0),
            }),
        }
    }

    /// The account the pool's tunnels are charged to in the memory budget (its `PoolConfig::memory`): the source
    /// pod's, which its HBONE server charges too.
    pub fn memory(&self) -> Option<&Account> {
        self.inner.config.memory.as_ref()
    }

    /// How many pooled connections can still take streams (for config dumps and tests).
    pub fn connection_count(&self) -> usize {
        self.conns().values().flatten().filter(|conn| conn.usable()).count()
    }

    /// Opens a tunnel: reuses a pooled connection with a free stream or dials one (concurrent first
    /// dials for the same key share one handshake), sends CONNECT and waits for 200.
    pub async fn connect(&self, req: &ConnectRequest) -> Result<H2Stream, ConnectError> {
        let key = PoolKey { src: req.src.identity().clone(), dst_identity: req.dst_identity.clone(), dst: req.dst };
        let h2_err = |source| ConnectError::H2 { dst: req.dst, source };
        let mut slot = self.slot(&key, &req.src).await?;
        let mut send = match slot.conn.send.clone().ready().await {
            Ok(send) => send,
            Err(_) => {
                // The connection got a GOAWAY or died after we picked it: retire it and use another.
                slot.conn.closed.store(true, Ordering::Release);
                slot = self.slot(&key, &req.src).await?;
                slot.conn.send.clone().ready().await.map_err(h2_err)?
            }
        };
        let (response, body) = send.send_request(build_request(req), false).map_err(h2_err)?;
        // The server answers only after it reached the target, so this wait is part of connecting.
        let response = tokio::time::timeout(self.inner.config.connect_timeout, response)
            .await
            .map_err(|_| ConnectError::Timeout(req.dst))?
            .map_err(h2_err)?;
        if response.status() != StatusCode::OK {
            return Err(ConnectError::Status { dst: req.dst, authority: req.authority, status: response.status() });
        }
        let ledger = slot.conn.ledger.clone();
        Ok(H2Stream::new(body, response.into_body(), Some(Box::new(slot))).budgeted(ledger))
    }

    fn conns(&self) -> std::sync::MutexGuard<'_, Conns> {
        self.inner.conns.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn reserve(&self, key: &PoolKey) -> Option<StreamSlot> {
        let max = self.inner.config.max_streams_per_connection;
        self.conns().get(key)?.iter().find_map(|conn| conn.try_reserve(max))
    }

    async fn slot(&self, key: &PoolKey, src: &WorkloadCert) -> Result<StreamSlot, ConnectError> {
        if let Some(slot) = self.reserve(key) {
            return Ok(slot);
        }
        let gate = self
            .inner
            .dialing
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .entry(key.clone())
            .or_default()
            .clone();
        let result = self.slot_gated(key, src, &gate).await;
        let mut dialing = self.inner.dialing.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        // Forget the gate once nobody else waits on it (the map and we hold the only references).
        if Arc::strong_count(&gate) == 2 {
            dialing.remove(key);
        }
        result
    }

    async fn slot_gated(
        &self,
        key: &PoolKey,
        src: &WorkloadCert,
        gate: &tokio::sync::Mutex<()>,
    ) -> Result<StreamSlot, ConnectError> {
        let _dialing = gate.lock().await;
        // Whoever held the gate before us may have dialled a connection with room for us.
        if let Some(slot) = self.reserve(key) {
            return Ok(slot);
        }
        let conn = tokio::time::timeout(self.inner.config.connect_timeout, self.dial(key, src))
            .await
            .map_err(|_| ConnectError::Timeout(key.dst))??;
        let slot = conn
            .try_reserve(self.inner.config.max_streams_per_connection)
            .ok_or_else(|| ConnectError::H2 { dst: key.dst, source: h2::Error::from(h2::Reason::REFUSED_STREAM) })?;
        Ok(slot)
    }

    async fn dial(&self, key: &PoolKey, src: &WorkloadCert) -> Result<Arc<Conn>, ConnectError> {
        let started = Instant::now();
        let tcp = match &self.inner.dialer {
            Some(dialer) => dialer(key.dst).await,
            None => TcpStream::connect(key.dst).await,
        };
        let tcp = tcp.map_err(|source| ConnectError::Tcp { dst: key.dst, source })?;
        let _ = tcp.set_nodelay(true);
        let tls = self.inner.tls.connect(tcp, src, &key.dst_identity).await?;
        let h2_err = |source| ConnectError::H2 { dst: key.dst, source };
        let ledger = self.inner.config.memory.clone().map(ConnLedger::new);
        let metered = Metered::new(tls, ledger.clone());
        let (send, mut connection) = settings::client().handshake(metered).await.map_err(h2_err)?;
        let mut ping_pong = connection.ping_pong();
        server_settings_received(&mut connection, ping_pong.as_mut()).await.map_err(h2_err)?;
        let (active, _) = watch::channel(0);
        let conn = Arc::new(Conn {
            id: self.inner.next_id.fetch_add(1, Ordering::Relaxed),
            send,
            active,
            closed: AtomicBool::new(false),
            ledger,
        });
        let took = started.elapsed();
        tracing::debug!(dst = %key.dst, identity = %key.dst_identity, id = conn.id, ?took, "HBONE connection established");
        if let Some(ConnectObserver(observe)) = &self.inner.config.on_connected {
            observe(took);
        }
        // Pooled before its driver starts, so the driver's removal can never precede the insertion.
        self.conns().entry(key.clone()).or_default().push(conn.clone());
        let driver = Driver { conns: Arc::downgrade(&self.inner.conns), key: key.clone(), conn: conn.clone() };
        tokio::spawn(driver.run(connection, ping_pong, self.inner.config.keepalive, self.inner.config.idle_timeout));
        Ok(conn)
    }
}

/// Drives a new connection until the server's SETTINGS have been applied, so that its stream limit is known
/// before any stream is counted against the connection: h2 applies frames in order, and the server sends its
/// SETTINGS before it answers our PING. (Until then h2 assumes no limit and would send every request at once.)
async fn server_settings_received<T>(
    connection: &mut h2::client::Connection<T, bytes::Bytes>,
    ping_pong: Option<&mut h2::PingPong>,
) -> Result<(), h2::Error>
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let Some(ping_pong) = ping_pong else { return Ok(()) };
    tokio::select! {
        pong = ping_pong.ping(h2::Ping::opaque()) => pong.map(|_| ()),
        ended = &mut *connection => Err(ended.err().unwrap_or_else(|| h2::Error::from(h2::Reason::NO_ERROR))),
    }
}

fn build_request(req: &ConnectRequest) -> Request<()> {
    let mut request = Request::builder()
        .method(Method::CONNECT)
        .uri(req.authority.to_string())
        .body(())
        .expect("an ip:port authority is a valid CONNECT target");
    let headers = request.headers_mut();
    headers.extend(req.extra_headers.clone());
    headers.insert(http::header::FORWARDED, headers::forwarded(req.src_addr));
    if let Ok(baggage) = http::HeaderValue::from_str(&req.baggage.header_value()) {
        headers.insert("baggage", baggage);
    }
    headers.insert("traceparent", headers::traceparent());
    request
}

//! Listening sockets and the one accept loop every server of the node side runs on. The loop caps how many
//! connections are served at once (the excess is closed at once, and counted in a rate-limited warning), backs
//! off when accepting fails (say, out of file descriptors) instead of spinning, and stops accepting when the
//! drain starts; each connection holds the drain open until it is done. [`crate::http`] serves HTTP/1 on it; a
//! plain stream socket (the node agent's plugin log socket) uses [`serve`] directly. Every accepted connection can
//! tell who is at the other end of a unix socket ([`Connection::peer_credentials`]), so a server that must know
//! its peer (the node agent's plugin event socket) asks the kernel rather than believe the request. A server that
//! takes connections from others raises its open-files limit at start ([`raise_open_files_limit`]).

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio::sync::Semaphore;

use crate::drain::DrainWatcher;
use crate::throttle::Throttle;
use crate::Error;

/// How many connections a server serves at once unless it says otherwise: far more than the kubelet's probes,
/// Prometheus and an operator's curl need, few enough that a flood cannot exhaust the process's descriptors.
pub const DEFAULT_MAX_CONNECTIONS: usize = 64;
/// First pause after a failed accept; doubled per consecutive failure up to [`MAX_BACKOFF`].
const MIN_BACKOFF: Duration = Duration::from_millis(10);
/// Longest pause after failed accepts.
const MAX_BACKOFF: Duration = Duration::from_secs(1);

/// A listening socket the accept loop takes connections from: TCP for the probe, metrics and admin ports, a
/// unix socket for the node agent's plugin sockets.
pub trait Listen: Send + 'static {
    /// One accepted connection.
    type Conn: Connection;
    /// Waits for the next connection.
    fn accept(&self) -> impl Future<Output = io::Result<Self::Conn>> + Send;
}

/// Who connected to a unix socket, as the kernel recorded it when the peer called `connect(2)` (`SO_PEERCRED`):
/// what a server may trust about a local peer, unlike anything the peer sends. [`crate::http`] attaches it to every
/// request of the connection as an extension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerCredentials {
    /// The peer's effective uid at connect time.
    pub uid: u32,
    /// The peer's effective gid at connect time.
    pub gid: u32,
    /// The peer's pid at connect time, when the kernel could map it into our pid namespace.
    pub pid: Option<i32>,
}

/// An accepted connection: a byte stream that can say who is at the other end when the kernel knows.
pub trait Connection: AsyncRead + AsyncWrite + Unpin + Send + 'static {
    /// The peer's credentials: `Some` for a unix socket (unless the kernel refused to tell), `None` for TCP, whose
    /// peer is only an address.
    fn peer_credentials(&self) -> Option<PeerCredentials>;
}

impl Connection for TcpStream {
    fn peer_credentials(&self) -> Option<PeerCredentials> {
        None
    }
}

impl Connection for UnixStream {
    fn peer_credentials(&self) -> Option<PeerCredentials> {
        self.peer_cred().ok().map(|cred| PeerCredentials { uid: cred.uid(), gid: cred.gid(), pid: cred.pid() })
    }
}

impl Listen for TcpListener {
    type Conn = TcpStream;
    async fn accept(&self) -> io::Result<TcpStream> {
        TcpListener::accept(self).await.map(|(stream, _peer)| stream)
    }
}

impl Listen for UnixListener {
    type Conn = UnixStream;
    async fn accept(&self) -> io::Result<UnixStream> {
        UnixListener::accept(self).await.map(|(stream, _peer)| stream)
    }
}

/// Binds a TCP listener, separately from serving it, so a binary fails at startup with the address in the error
/// and tests can bind port 0 and learn the port.
pub async fn bind_tcp(addr: SocketAddr) -> Result<TcpListener, Error> {
    TcpListener::bind(addr).await.map_err(|source| Error::Bind { addr, source })
}

/// Binds a unix socket at `path` with file mode `mode`, replacing a stale socket a previous run left behind (a
/// restarted agent must be able to serve at the same path).
pub fn bind_unix(path: &Path, mode: u32) -> Result<UnixListener, Error> {
    let fail = |source| Error::BindUnix { path: path.to_owned(), source };
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(fail(e)),
        _ => {}
    }
    let listener = UnixListener::bind(path).map_err(fail)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).map_err(fail)?;
    Ok(listener)
}

/// The open-files limit (`RLIMIT_NOFILE`) of this process, as [`raise_open_files_limit`] found and left it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpenFilesLimit {
    /// The soft limit the process started with.
    pub soft_before: u64,
    /// The soft limit now: the hard limit.
    pub soft: u64,
    /// The hard limit, which only a privileged process may raise.
    pub hard: u64,
}

/// Raises this process's soft limit on open files to its hard limit, and logs both. The soft limit a process
/// inherits is often 1024, far below what a node's worth of connections or pods needs, while the hard limit is
/// what the operator (the container runtime, systemd) allows; Go programs such as Istio's agents do the same at
/// start, and so does ztunnel. Returns the limits found and set.
pub fn raise_open_files_limit() -> io::Result<OpenFilesLimit> {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (soft_before, hard) = getrlimit(Resource::RLIMIT_NOFILE)?;
    if soft_before < hard {
        setrlimit(Resource::RLIMIT_NOFILE, hard, hard)?;
    }
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE)?;
    tracing::info!(soft_before, soft, hard, "open files limit (RLIMIT_NOFILE): soft limit set to the hard limit");
    Ok(OpenFilesLimit { soft_before, soft, hard })
}

/// Accepts connections on `listener` until `drain` is signalled, then closes it. Each connection runs
/// `handle(connection, drain)` on its own task, which holds the drain open until it ends; the watcher tells it when
/// to stop. At most `max_connections` run at once: one more is closed as soon as it is accepted.
/// `name` says which server it is in logs.
pub async fn serve<L, H, F>(listener: L, name: &'static str, max_connections: usize, drain: DrainWatcher, mut handle: H)
where
    L: Listen,
    H: FnMut(L::Conn, DrainWatcher) -> F,
    F: Future<Output = ()> + Send + 'static,
{
    let permits = Arc::new(Semaphore::new(max_connections));
    let mut backoff = MIN_BACKOFF;
    let mut failures = Throttle::default();
    let mut refusals = Throttle::default();
    loop {
        let accepted = tokio::select! {
            biased;
            _ = drain.signaled() => break,
            accepted = listener.accept() => accepted,
        };
        let conn = match accepted {
            Ok(conn) => {
                backoff = MIN_BACKOFF;
                conn
            }
            // The peer gave up between connecting and our accept: nothing is wrong with the listener.
            Err(error) if is_per_connection(&error) => {
                tracing::debug!(server = name, %error, "connection gone before accept");
                continue;
            }
            Err(error) => {
                if let Some(also) = failures.hit() {
                    tracing::warn!(server = name, %error, retry_in = ?backoff, failures_since_last_warning = also, "accept failed");
                }
                tokio::select! {
                    _ = drain.signaled() => break,
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(MAX_BACKOFF);
                continue;
            }
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            drop(conn);
            if let Some(also) = refusals.hit() {
                tracing::warn!(
                    server = name,
                    max_connections,
                    refused_since_last_warning = also,
                    "connection cap reached: closing new connections"
                );
            }
            continue;
        };
        // The guard holds the drain open while the connection is served, whether or not `handle` keeps its watcher.
        let guard = drain.guard();
        let work = handle(conn, drain.clone());
        tokio::spawn(async move {
            work.await;
            drop((permit, guard));
        });
    }
    tracing::debug!(server = name, "stopped accepting");
}

/// Accept errors that concern one connection only, not the listener.
fn is_per_connection(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::ConnectionAborted | io::ErrorKind::ConnectionReset | io::ErrorKind::ConnectionRefused
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_open_files_soft_limit_is_raised_to_the_hard_limit() {
        use nix::sys::resource::{getrlimit, setrlimit, Resource};
        let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
        // Lower the soft limit (any process may), as a runtime's default would leave it.
        let lowered = soft.min(hard).min(512);
        setrlimit(Resource::RLIMIT_NOFILE, lowered, hard).unwrap();
        let limit = raise_open_files_limit().unwrap();
        assert_eq!(limit, OpenFilesLimit { soft_before: lowered, soft: hard, hard });
        assert_eq!(getrlimit(Resource::RLIMIT_NOFILE).unwrap(), (hard, hard));
        setrlimit(Resource::RLIMIT_NOFILE, soft, hard).unwrap();
    }
}

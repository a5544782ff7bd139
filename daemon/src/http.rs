//! The one HTTP/1 server every endpoint of the node side runs on: the probes and metrics of every binary, the
//! proxy's admin `/config_dump`, and the node agent's plugin event socket. It runs on [`listener::serve`] (so it
//! has a connection cap, backs off on accept errors and stops accepting when the drain starts), disconnects a
//! client that does not send its request headers in time (so nobody can hold a drain open by saying nothing), and
//! on a graceful drain lets each connection finish the request in progress, while an immediate drain drops it.
//! What it answers is a closure from request to a future of the response. On a unix socket every request carries
//! the peer's [`PeerCredentials`] as an extension (`request.extensions().get::<PeerCredentials>()`), read once per
//! connection from the kernel, so a handler can refuse a peer by who it is.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};

use crate::drain::{DrainMode, DrainWatcher};
use crate::listener::{self, Connection, Listen, PeerCredentials};

/// The body of every response: all of it at once (probe bodies, metrics, a JSON dump are all small).
pub type Body = Full<Bytes>;

/// Content type of the plain-text answers.
pub const TEXT: &str = "text/plain; charset=utf-8";
/// Content type of the JSON answers.
pub const JSON: &str = "application/json";
/// A client that has not sent its request headers by then is disconnected.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// One HTTP/1 server: its name in logs and its limits. Build it, then [`serve`](Self::serve) a listener.
#[derive(Debug, Clone)]
pub struct Server {
    name: &'static str,
    max_connections: usize,
    header_read_timeout: Duration,
}

impl Server {
    /// A server called `name` in logs, with [`listener::DEFAULT_MAX_CONNECTIONS`] and a 10 s header read timeout.
    pub fn new(name: &'static str) -> Self {
        Server { name, max_connections: listener::DEFAULT_MAX_CONNECTIONS, header_read_timeout: HEADER_READ_TIMEOUT }
    }

    /// Serves at most `max` connections at once; further ones are closed as soon as they are accepted.
    pub fn max_connections(mut self, max: usize) -> Self {
        self.max_connections = max;
        self
    }

    /// Disconnects a client that has not sent a request's headers within `timeout`.
    pub fn header_read_timeout(mut self, timeout: Duration) -> Self {
        self.header_read_timeout = timeout;
        self
    }

    /// Answers every request on `listener` with `routes` until `drain` is signalled, then stops accepting and
    /// closes the listener. Open connections hold `drain` open: on a graceful drain they finish the request in
    /// progress and close; on an immediate drain they are dropped.
    pub async fn serve<L, R, F>(self, listener: L, drain: DrainWatcher, routes: R)
    where
        L: Listen,
        R: Fn(Request<Incoming>) -> F + Send + Sync + 'static,
        F: Future<Output = Response<Body>> + Send + 'static,
    {
        let routes = Arc::new(routes);
        let Server { name, max_connections, header_read_timeout } = self;
        listener::serve(listener, name, max_connections, drain, move |conn, drain| {
            serve_connection(conn, routes.clone(), header_read_timeout, name, drain)
        })
        .await;
    }
}

async fn serve_connection<C, R, F>(
    conn: C,
    routes: Arc<R>,
    header_read_timeout: Duration,
    name: &str,
    drain: DrainWatcher,
) where
    C: Connection,
    R: Fn(Request<Incoming>) -> F + Send + Sync + 'static,
    F: Future<Output = Response<Body>> + Send + 'static,
{
    let peer: Option<PeerCredentials> = conn.peer_credentials();
    let service = service_fn(move |mut request: Request<Incoming>| {
        if let Some(peer) = peer {
            request.extensions_mut().insert(peer);
        }
        let response = routes(request);
        async move { Ok::<_, Infallible>(response.await) }
    });
    let connection = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(header_read_timeout)
        .serve_connection(TokioIo::new(conn), service);
    let mut connection = std::pin::pin!(connection);
    let result = tokio::select! {
        result = connection.as_mut() => result,
        mode = drain.signaled() => match mode {
            DrainMode::Graceful => {
                connection.as_mut().graceful_shutdown();
                connection.await
            }
            DrainMode::Immediate => return,
        },
    };
    if let Err(error) = result {
        tracing::debug!(server = name, %error, "connection ended with an error");
    }
}

/// A response with `status`, a `Content-Type` and `body`.
pub fn reply(status: StatusCode, content_type: &'static str, body: impl Into<Bytes>) -> Response<Body> {
    let mut response = Response::new(Full::new(body.into()));
    *response.status_mut() = status;
    response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

//! The health, readiness and metrics HTTP server the kubelet and Prometheus scrape.
//!
//! `GET /healthz` answers 200 while the process can serve at all, `GET /readyz` 200 only while
//! [`ProbeState::is_ready`] (else 503 with the reason), `GET /metrics` the registry in the OpenMetrics
//! text format. Other paths are 404; other methods on those paths 405.

mod state;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::header::{HeaderValue, ALLOW, CONTENT_TYPE};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};

use crate::drain::{DrainMode, DrainWatcher};
use crate::Error;

pub use state::ProbeState;

/// What `prometheus_client::encoding::text::encode` produces (it ends with `# EOF`).
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
const TEXT: &str = "text/plain; charset=utf-8";
/// A client that has not sent its request headers by then is disconnected, so it cannot hold a
/// drain open.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Binds the probe server's listener, separately from [`serve`], so the binary fails at startup with
/// the address in the error and tests can bind port 0 and learn the port.
pub async fn bind(addr: SocketAddr) -> Result<TcpListener, Error> {
    TcpListener::bind(addr).await.map_err(|source| Error::Bind { addr, source })
}

/// Serves the probe endpoints on `listener` until `drain` is signalled, then stops accepting and
/// closes the listener. Open connections hold `drain` open: on a graceful drain they finish the
/// request in progress and close; on an immediate drain they are dropped.
pub async fn serve(listener: TcpListener, state: ProbeState, drain: DrainWatcher) {
    loop {
        let stream = tokio::select! {
            biased;
            _ = drain.signaled() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _peer)) => stream,
                Err(error) => {
                    // Usually out of file descriptors; back off instead of spinning.
                    tracing::warn!(%error, "probe server accept failed");
                    tokio::select! {
                        _ = drain.signaled() => break,
                        _ = tokio::time::sleep(Duration::from_millis(100)) => continue,
                    }
                }
            },
        };
        tokio::spawn(serve_connection(stream, state.clone(), drain.clone()));
    }
    tracing::debug!("probe server stopped accepting");
}

async fn serve_connection(stream: TcpStream, state: ProbeState, drain: DrainWatcher) {
    let service = service_fn(move |request| {
        let response = respond(&request, &state);
        async move { Ok::<_, Infallible>(response) }
    });
    let connection = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .serve_connection(TokioIo::new(stream), service);
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
        tracing::debug!(%error, "probe connection ended with an error");
    }
}

fn respond<B>(request: &Request<B>, state: &ProbeState) -> Response<Full<Bytes>> {
    let path = request.uri().path();
    if !matches!(path, "/healthz" | "/readyz" | "/metrics") {
        return reply(StatusCode::NOT_FOUND, TEXT, "not found\n".into());
    }
    if request.method() != Method::GET {
        let mut response = reply(StatusCode::METHOD_NOT_ALLOWED, TEXT, "method not allowed\n".into());
        response.headers_mut().insert(ALLOW, HeaderValue::from_static("GET"));
        return response;
    }
    match path {
        "/healthz" => reply(StatusCode::OK, TEXT, "ok\n".into()),
        "/readyz" => match state.reason() {
            None => reply(StatusCode::OK, TEXT, "ready\n".into()),
            Some(reason) => reply(StatusCode::SERVICE_UNAVAILABLE, TEXT, format!("{reason}\n")),
        },
        _ => metrics(state),
    }
}

fn metrics(state: &ProbeState) -> Response<Full<Bytes>> {
    let mut body = String::new();
    let encoded = {
        let registry = state.registry().lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        prometheus_client::encoding::text::encode(&mut body, &registry)
    };
    match encoded {
        Ok(()) => reply(StatusCode::OK, OPENMETRICS, body),
        Err(error) => {
            tracing::warn!(%error, "encoding metrics failed");
            reply(StatusCode::INTERNAL_SERVER_ERROR, TEXT, "encoding metrics failed\n".into())
        }
    }
}

fn reply(status: StatusCode, content_type: &'static str, body: String) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

//! The health, readiness and metrics endpoints the kubelet and Prometheus scrape, served by [`crate::http`].
//!
//! With the daemon's [`Paths`]: `GET /healthz` answers 200 while the process can serve at all, `GET /readyz` 200
//! only while no [`Blocker`] blocks (else 503, the body naming each blocker still blocking and why), `GET /metrics`
//! the registry in the OpenMetrics text format. Other paths are 404; other methods on those paths 405. A binary
//! whose users probe other paths (the proxy: Istio's `/healthz/ready`) serves the same answers there.

mod state;

use bytes::Bytes;
use hyper::header::{HeaderValue, ALLOW};
use hyper::{Method, Request, Response, StatusCode};
use tokio::net::TcpListener;

use crate::drain::DrainWatcher;
use crate::http::{self, reply, Body, TEXT};

pub use state::{Blocker, ProbeState};

/// What `prometheus_client::encoding::text::encode` produces (it ends with `# EOF`).
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Which path answers what, so a binary keeps the paths its users' probes already use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Paths {
    /// Liveness (always 200), if served.
    pub live: Option<&'static str>,
    /// Readiness (200, or 503 with the blockers).
    pub ready: &'static str,
    /// Prometheus metrics.
    pub metrics: &'static str,
}

impl Paths {
    /// The daemon's own: `/healthz`, `/readyz`, `/metrics` (what Istio's CNI DaemonSet probes).
    pub const DAEMON: Paths = Paths { live: Some("/healthz"), ready: "/readyz", metrics: "/metrics" };
}

impl Default for Paths {
    fn default() -> Self {
        Paths::DAEMON
    }
}

/// Serves the probe endpoints at `paths` on `listener` until `drain` is signalled (see [`http::Server::serve`]).
pub async fn serve(listener: TcpListener, state: ProbeState, paths: Paths, drain: DrainWatcher) {
    http::Server::new("probes")
        .serve(listener, drain, move |request| std::future::ready(respond(&request, &state, paths)))
        .await;
}

fn respond<B>(request: &Request<B>, state: &ProbeState, paths: Paths) -> Response<Body> {
    let path = request.uri().path();
    let live = paths.live == Some(path);
    if !live && path != paths.ready && path != paths.metrics {
        return reply(StatusCode::NOT_FOUND, TEXT, "not found\n");
    }
    if request.method() != Method::GET {
        let mut response = reply(StatusCode::METHOD_NOT_ALLOWED, TEXT, "method not allowed\n");
        response.headers_mut().insert(ALLOW, HeaderValue::from_static("GET"));
        return response;
    }
    if live {
        return reply(StatusCode::OK, TEXT, "ok\n");
    }
    if path == paths.ready {
        return readiness(state);
    }
    metrics(state)
}

/// 200 `ready`, or 503 with one `name: reason` line per blocker still blocking.
fn readiness(state: &ProbeState) -> Response<Body> {
    let blocking = state.blocking();
    if blocking.is_empty() {
        return reply(StatusCode::OK, TEXT, "ready\n");
    }
    let body: String = blocking.iter().map(|(name, reason)| format!("{name}: {reason}\n")).collect();
    reply(StatusCode::SERVICE_UNAVAILABLE, TEXT, body)
}

fn metrics(state: &ProbeState) -> Response<Body> {
    let mut body = String::new();
    match state.with_registry(|registry| prometheus_client::encoding::text::encode(&mut body, registry)) {
        Ok(()) => reply(StatusCode::OK, OPENMETRICS, Bytes::from(body)),
        Err(error) => {
            tracing::warn!(%error, "encoding metrics failed");
            reply(StatusCode::INTERNAL_SERVER_ERROR, TEXT, "encoding metrics failed\n")
        }
    }
}

//! The health, readiness and metrics endpoints the kubelet and Prometheus scrape, served by [`crate::http`].
//!
//! With the daemon's [`Paths`]: `GET /healthz` answers 200 while the process can serve at all, `GET /readyz` 200
//! only while no [`Blocker`] blocks (else 503, the body naming each blocker still blocking and why), `GET /metrics`
//! the registry in the OpenMetrics text format, followed by another local process's metrics when
//! [`ProbeState::append_metrics_from`] names one ([`merge`]). Other paths are 404; other methods on those paths 405. A binary
//! whose users probe other paths (the proxy: Istio's `/healthz/ready`) serves the same answers there.

pub mod merge;
mod state;

use std::sync::{Mutex, PoisonError};

use bytes::Bytes;
use hyper::header::{HeaderValue, ALLOW};
use hyper::{Method, Request, Response, StatusCode};
use tokio::net::TcpListener;

use crate::drain::DrainWatcher;
use crate::http::{self, reply, Body, TEXT};
use crate::throttle::Throttle;

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
        .serve(listener, drain, move |request| {
            let state = state.clone();
            async move { respond(&request, &state, paths).await }
        })
        .await;
}

async fn respond<B>(request: &Request<B>, state: &ProbeState, paths: Paths) -> Response<Body> {
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
    metrics(state).await
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

async fn metrics(state: &ProbeState) -> Response<Body> {
    let mut body = String::new();
    if let Err(error) = state.with_registry(|registry| prometheus_client::encoding::text::encode(&mut body, registry)) {
        tracing::warn!(%error, "encoding metrics failed");
        return reply(StatusCode::INTERNAL_SERVER_ERROR, TEXT, "encoding metrics failed\n");
    }
    if let Some(source) = state.appended_metrics_source() {
        let appended = source.append_to(&mut body).await;
        // Every scrape tries again; a source that is down or broken costs a warning per interval, and its metrics.
        static FAILED: Mutex<Throttle> = Mutex::new(Throttle::new());
        static SKIPPED: Mutex<Throttle> = Mutex::new(Throttle::new());
        let throttle = |t: &Mutex<Throttle>| t.lock().unwrap_or_else(PoisonError::into_inner).hit();
        match appended {
            Err(error) => {
                if let Some(held) = throttle(&FAILED) {
                    tracing::warn!(%error, failures_since_last_warning = held, "serving our metrics without theirs");
                }
            }
            Ok(skipped) if !skipped.is_empty() => {
                if let Some(held) = throttle(&SKIPPED) {
                    tracing::debug!(%source, ?skipped, scrapes_since_last = held, "left out families we export too");
                }
            }
            Ok(_) => {}
        }
    }
    reply(StatusCode::OK, OPENMETRICS, Bytes::from(body))
}

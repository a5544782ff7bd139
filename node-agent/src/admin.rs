//! The agent's admin port (`ADMIN_PORT`, default `istio_contract::ports::CNI_ADMIN`), on loopback only (127.0.0.1, and ::1
//! when the node has IPv6): what `node-agent explain` asks.
//! - `GET /debug/pods/NAMESPACE/NAME`: one pod's explain report (JSON), or 404 with `{"error": ...}`;
//! - `GET /debug/pods`: every pod on this node with its mode and verdict (JSON list);
//! - `POST /debug/drift-check` (`node-agent explain --check-drift`): a drift check of every pod now, rather than at
//!   the next `DRIFT_CHECK_INTERVAL` (202; its results show in the reports and in `nodeagent_drift_*`).
//!
//! The reports say which pods run where and why, so the port is never bound beyond loopback: only a process in
//! the agent's network namespace (`kubectl exec` into the agent's pod, or the node itself with host networking)
//! can ask. It runs on the daemon's HTTP server, with its connection cap and header read timeout.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

use daemon::drain::DrainWatcher;
use daemon::http::{self, reply, Body, JSON};
use hyper::{Method, Request, Response, StatusCode};

use crate::admin_api::{DRIFT_CHECK_PATH, PODS_PATH, PORT_ENV};
use crate::explain::build::Explainer;

/// At most this many connections at once: explain is an operator's tool, not a service.
const MAX_CONNECTIONS: usize = 8;

/// Binds the admin port on loopback and serves `explainer` there until the drain. A port that cannot be bound
/// is logged, and the agent runs on without it: explain is a diagnosis, never a reason for the agent to stop.
pub async fn serve(port: u16, explainer: Arc<Explainer>, drain: DrainWatcher) {
    if port == 0 {
        tracing::info!("{PORT_ENV}=0: no admin port (node-agent explain is off)");
        return;
    }
    let v4 = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    match daemon::listener::bind_tcp(v4).await {
        Ok(listener) => {
            tracing::info!(address = %v4, "serving the admin port (node-agent explain)");
            tokio::spawn(serve_on(listener, explainer.clone(), drain.clone()));
        }
        Err(e) => tracing::warn!(error = %e, "cannot bind the admin port: node-agent explain will not answer"),
    }
    let v6 = SocketAddr::from((Ipv6Addr::LOCALHOST, port));
    // Only where the node has IPv6: its absence is no error.
    if let Ok(listener) = daemon::listener::bind_tcp(v6).await {
        tokio::spawn(serve_on(listener, explainer, drain));
    }
}

async fn serve_on(listener: tokio::net::TcpListener, explainer: Arc<Explainer>, drain: DrainWatcher) {
    let routes = move |req: Request<hyper::body::Incoming>| {
        let explainer = explainer.clone();
        async move { answer(&explainer, req.method(), req.uri().path()).await }
    };
    http::Server::new("admin").max_connections(MAX_CONNECTIONS).serve(listener, drain, routes).await;
}

/// `{"error": message}` with `status`.
fn error(status: StatusCode, message: String) -> Response<Body> {
    reply(status, JSON, serde_json::json!({ "error": message }).to_string())
}

fn json<T: serde::Serialize>(value: &T) -> Response<Body> {
    match serde_json::to_string_pretty(value) {
        Ok(body) => reply(StatusCode::OK, JSON, body),
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, format!("encoding the report: {e}")),
    }
}

async fn answer(explainer: &Explainer, method: &Method, path: &str) -> Response<Body> {
    if path == DRIFT_CHECK_PATH {
        if method != Method::POST {
            return error(StatusCode::METHOD_NOT_ALLOWED, format!("{method} is not served here; use POST"));
        }
        if !explainer.check_drift_now() {
            return error(StatusCode::NOT_FOUND, "drift is not checked on this node agent".into());
        }
        let requested = serde_json::json!({ "status": "drift check requested" });
        return reply(StatusCode::ACCEPTED, JSON, requested.to_string());
    }
    if method != Method::GET {
        return error(StatusCode::METHOD_NOT_ALLOWED, format!("{method} is not served here; use GET"));
    }
    let Some(rest) = path.strip_prefix(PODS_PATH) else {
        return error(StatusCode::NOT_FOUND, format!("{path} is not served here; try {PODS_PATH}"));
    };
    match rest.trim_end_matches('/').strip_prefix('/').map(|p| p.split('/').collect::<Vec<_>>()).as_deref() {
        None => json(&explainer.all()),
        Some([namespace, name]) if !namespace.is_empty() && !name.is_empty() => {
            match explainer.pod(namespace, name).await {
                Some(report) => json(&report),
                None => error(
                    StatusCode::NOT_FOUND,
                    format!("pod {namespace}/{name} is not on this node ({})", explainer.node()),
                ),
            }
        }
        Some(_) => error(StatusCode::NOT_FOUND, format!("{path}: expected {PODS_PATH}/NAMESPACE/NAME")),
    }
}

//! The plugin's side door: `POST /cmdadd` on `<run dir>/pluginevent.sock`, served by the daemon's HTTP server. The
//! reply comes only after the pod is fully enrolled, so the plugin's ADD (and so the pod's start) waits for it.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use cni::plugin_event::{CmdAdd, CMDADD_PATH};
use daemon::drain::DrainWatcher;
use daemon::http::{self, reply, Body, TEXT};
use http_body_util::BodyExt;
use hyper::{Method, Request, Response, StatusCode};
use istio_contract::paths::PLUGIN_EVENT_SOCKET;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use netns::Netns;

use crate::enroll::Enroller;
use crate::metrics::{Metrics, ResponseCode};
use crate::plugin_socket;

/// Largest event body accepted.
const MAX_BODY: usize = 64 * 1024;

/// Binds `<run dir>/pluginevent.sock`.
pub fn bind(run_dir: &Path) -> anyhow::Result<(tokio::net::UnixListener, PathBuf)> {
    plugin_socket::bind(run_dir, PLUGIN_EVENT_SOCKET)
}

/// Serves plugin events until the drain starts; on a graceful drain, an enrollment in progress finishes and is
/// answered.
pub async fn serve(
    listener: tokio::net::UnixListener,
    enroller: Arc<Enroller>,
    client: kube::Client,
    metrics: Metrics,
    drain: DrainWatcher,
) {
    let routes = move |req| {
        let (enroller, client, metrics) = (enroller.clone(), client.clone(), metrics.clone());
        async move { handle(req, &enroller, &client, &metrics).await }
    };
    http::Server::new("plugin events")
        .max_connections(plugin_socket::MAX_CONNECTIONS)
        .serve(listener, drain, routes)
        .await;
}

async fn handle(
    req: Request<hyper::body::Incoming>,
    enroller: &Enroller,
    client: &kube::Client,
    metrics: &Metrics,
) -> Response<Body> {
    let (status, body) = if req.method() != Method::POST || req.uri().path() != CMDADD_PATH {
        (StatusCode::NOT_FOUND, format!("only POST {CMDADD_PATH} is served here"))
    } else {
        match read_event(req).await {
            Err(e) => (StatusCode::BAD_REQUEST, e),
            Ok(event) => match add(&event, enroller, client).await {
                Ok(()) => (StatusCode::OK, String::new()),
                Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e),
            },
        }
    };
    metrics.plugin_requests.get_or_create(&ResponseCode { response_code: status.as_u16().to_string() }).inc();
    reply(status, TEXT, body)
}

async fn read_event(req: Request<hyper::body::Incoming>) -> Result<CmdAdd, String> {
    let limited = http_body_util::Limited::new(req.into_body(), MAX_BODY);
    let bytes = limited.collect().await.map_err(|e| format!("reading event: {e}"))?.to_bytes();
    serde_json::from_slice(&bytes).map_err(|e| format!("invalid event: {e}"))
}

async fn add(event: &CmdAdd, enroller: &Enroller, client: &kube::Client) -> Result<(), String> {
    let pod = Api::<Pod>::namespaced(client.clone(), &event.pod_namespace)
        .get(&event.pod_name)
        .await
        .map_err(|e| format!("get pod {}/{}: {e}", event.pod_namespace, event.pod_name))?;
    let netns = Netns::open(&event.netns).map_err(|e| format!("open netns: {e}"))?;
    enroller.enroll(&pod, netns, event.addresses()).await.map_err(|e| e.to_string())
}

//! The plugin's side door: `POST /cmdadd` on `<run dir>/pluginevent.sock`. The reply comes only after the pod is
//! fully enrolled, so the plugin's ADD (and so the pod's start) waits for it.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use cni::plugin_event::{CmdAdd, CMDADD_PATH};
use istio_contract::paths::PLUGIN_EVENT_SOCKET;
use daemon::drain::DrainWatcher;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, Response, StatusCode};
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use netns::Netns;

use crate::enroll::Enroller;
use crate::metrics::{Metrics, ResponseCode};
use crate::plugin_socket;

/// Largest event body accepted.
const MAX_BODY: usize = 64 * 1024;

/// Binds `<run dir>/pluginevent.sock`.
pub fn bind(run_dir: &Path) -> std::io::Result<(tokio::net::UnixListener, PathBuf)> {
    plugin_socket::bind(run_dir, PLUGIN_EVENT_SOCKET)
}

/// Serves plugin events until the drain starts.
pub async fn serve(
    listener: tokio::net::UnixListener,
    enroller: Arc<Enroller>,
    client: kube::Client,
    metrics: Metrics,
    drain: DrainWatcher,
) {
    plugin_socket::accept_until_drained(listener, drain, "plugin events", move |stream| {
        let (enroller, client, metrics) = (enroller.clone(), client.clone(), metrics.clone());
        async move {
            let service = hyper::service::service_fn(move |req| {
                let (enroller, client, metrics) = (enroller.clone(), client.clone(), metrics.clone());
                async move { Ok::<_, std::convert::Infallible>(handle(req, &enroller, &client, &metrics).await) }
            });
            let io = hyper_util::rt::TokioIo::new(stream);
            if let Err(e) = hyper::server::conn::http1::Builder::new().serve_connection(io, service).await {
                tracing::debug!(error = %e, "plugin connection");
            }
        }
    })
    .await;
}

async fn handle(
    req: Request<hyper::body::Incoming>,
    enroller: &Enroller,
    client: &kube::Client,
    metrics: &Metrics,
) -> Response<Full<Bytes>> {
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
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response
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

//! Istio's proxy endpoints: `/healthz/ready` (the kubelet's readiness probe) and `/metrics` (Prometheus).
//! The daemon crate's probe server has fixed paths (`/readyz`), so the proxy serves its own.

use std::convert::Infallible;
use std::net::SocketAddr;

use bytes::Bytes;
use daemon::probes::ProbeState;
use http_body_util::Full;
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

/// Binds `addr` and serves both paths there until the process exits.
pub async fn serve(addr: SocketAddr, state: ProbeState) -> std::io::Result<()> {
    let listener = TcpListener::bind(addr).await?;
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else { continue };
            let state = state.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req| {
                    let response = respond(&req, &state);
                    async move { Ok::<_, Infallible>(response) }
                });
                let _ = http1::Builder::new().serve_connection(TokioIo::new(stream), service).await;
            });
        }
    });
    Ok(())
}

fn respond<B>(req: &Request<B>, state: &ProbeState) -> Response<Full<Bytes>> {
    match req.uri().path() {
        "/healthz/ready" => match state.reason() {
            None => reply(StatusCode::OK, "text/plain", "ready\n".into()),
            Some(reason) => reply(StatusCode::SERVICE_UNAVAILABLE, "text/plain", format!("{reason}\n")),
        },
        "/metrics" => {
            let mut body = String::new();
            let registry = state.registry().lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            match prometheus_client::encoding::text::encode(&mut body, &registry) {
                Ok(()) => reply(StatusCode::OK, "application/openmetrics-text; version=1.0.0; charset=utf-8", body),
                Err(_) => reply(StatusCode::INTERNAL_SERVER_ERROR, "text/plain", "encoding metrics failed\n".into()),
            }
        }
        _ => reply(StatusCode::NOT_FOUND, "text/plain", "not found\n".into()),
    }
}

fn reply(status: StatusCode, content_type: &'static str, body: String) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

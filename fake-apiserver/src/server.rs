//! The HTTP layer: accepts connections, logs requests, injects faults and hands requests to the router.

use crate::cluster::{Cluster, Fault, RequestRecord};
use crate::query::Query;
use crate::routes::{self, Call};
use crate::status::ApiError;
use crate::watch::Body;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use std::future::Future;
use tokio::net::TcpListener;

/// Returned by the service to make hyper drop the connection for `Fault::Refuse`.
#[derive(Debug, thiserror::Error)]
#[error("connection refused by injected fault")]
struct Refused;

async fn respond(cluster: Cluster, req: Request<Incoming>) -> Result<Response<Body>, Refused> {
    let record = RequestRecord {
        method: req.method().to_string(),
        path: req.uri().path().to_string(),
        query: req.uri().query().unwrap_or_default().to_string(),
    };
    tracing::debug!(method = %record.method, path = %record.path, query = %record.query, "request");
    cluster.log_request(record.clone());
    match cluster.fault() {
        Some(Fault::Refuse) => return Err(Refused),
        Some(Fault::Status(code)) => return Ok(routes::error_response(&ApiError::injected(code))),
        Some(Fault::Delay(d)) => tokio::time::sleep(d).await,
        None => {}
    }
    let content_type =
        req.headers().get("content-type").and_then(|v| v.to_str().ok()).unwrap_or("application/json").to_string();
    let method = req.method().clone();
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => return Ok(routes::error_response(&ApiError::bad_request(format!("reading request body: {e}")))),
    };
    Ok(routes::handle(
        &cluster,
        Call {
            method: &method,
            path: &record.path,
            query: Query::parse(&record.query),
            content_type: &content_type,
            body,
        },
    ))
}

/// Serves `cluster` on `listener` until `shutdown` completes, then ends every open watch and returns.
/// Connections still open at that point are abandoned with the runtime that runs them.
pub async fn serve(listener: TcpListener, cluster: Cluster, shutdown: impl Future<Output = ()>) {
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    tracing::warn!("accepting a connection failed: {e}");
                    continue;
                }
            },
        };
        if cluster.fault() == Some(Fault::Refuse) {
            drop(stream);
            continue;
        }
        let cluster = cluster.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| respond(cluster.clone(), req));
            if let Err(e) =
                auto::Builder::new(TokioExecutor::new()).serve_connection(TokioIo::new(stream), service).await
            {
                tracing::debug!("connection ended with error: {e}");
            }
        });
    }
    cluster.drop_watches();
}

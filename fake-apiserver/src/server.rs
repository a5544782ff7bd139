//! The HTTP layer: accepts connections (TLS when configured), and runs each request through the real server's
//! filter order: request log, injected faults, authentication (401), throttling (429), authorization (403),
//! then the router. Every answer is counted in the traffic counters of the front end (listener) it left by
//! ([`crate::traffic`]). It also ends graceful deletions whose grace period is over.

use crate::auth::{Unauthenticated, User};
use crate::cluster::{Cluster, Fault, RequestRecord};
use crate::debug;
use crate::query::Query;
use crate::rbac::{self, RequestInfo};
use crate::routes::{self, Call};
use crate::status::ApiError;
use crate::watch::Body;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use std::future::Future;
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;

/// Returned by the service to make hyper drop the connection for `Fault::Refuse`.
#[derive(Debug, thiserror::Error)]
#[error("connection refused by injected fault")]
struct Refused;

async fn respond(cluster: Cluster, front_end: Arc<str>, req: Request<Incoming>) -> Result<Response<Body>, Refused> {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let raw_query = req.uri().query().unwrap_or_default().to_string();
    let authorization =
        req.headers().get(hyper::header::AUTHORIZATION).and_then(|v| v.to_str().ok()).map(str::to_string);
    let content_type =
        req.headers().get("content-type").and_then(|v| v.to_str().ok()).unwrap_or("application/json").to_string();
    let body = req.into_body().collect().await.map(|b| b.to_bytes());
    if debug::is_debug(&path) {
        return Ok(debug::handle(&cluster, &method, &path, body.as_deref().unwrap_or_default()));
    }
    let query = Query::parse(&raw_query);
    let info = RequestInfo::parse(&method, &path, &query);
    let record = RequestRecord {
        method: method.to_string(),
        path: path.clone(),
        query: raw_query,
        verb: info.verb().to_string(),
        user: String::new(),
        status: 0,
    };
    tracing::debug!(method = %record.method, path = %record.path, query = %record.query, "request");
    let seq = cluster.log_request(record);
    let answer = |user: &str, response: Response<Body>| {
        let status = response.status().as_u16();
        cluster.log_answer(seq, info.verb(), user, status);
        let key = (front_end.to_string(), user.to_string(), info.verb().to_string(), info.resource());
        let (parts, body) = response.into_parts();
        Response::from_parts(parts, cluster.traffic_counters().count(key, status, body).boxed_unsync())
    };
    match cluster.fault() {
        Some(Fault::Refuse) => return Err(Refused),
        Some(Fault::Status(code)) => return Ok(answer("", routes::error_response(&ApiError::injected(code)))),
        Some(Fault::Delay(d)) => tokio::time::sleep(d).await,
        None => {}
    }
    // As kube-apiserver with its default --anonymous-auth=true: a request without a token runs as
    // system:anonymous (RBAC decides, 403), a token that does not authenticate gets 401.
    let user = match cluster.authenticate(authorization.as_deref()) {
        Ok(user) => user,
        Err(Unauthenticated::Invalid) if cluster.config().authentication => {
            return Ok(answer("", routes::error_response(&ApiError::unauthorized())))
        }
        Err(_) => User::anonymous(),
    };
    if let Some(retry_after) = cluster.throttled() {
        let mut response = routes::error_response(&ApiError::too_many_requests(retry_after));
        response.headers_mut().insert(hyper::header::RETRY_AFTER, retry_after.into());
        return Ok(answer(&user.name, response));
    }
    if cluster.config().rbac {
        if let Err(e) = cluster.with_store(|s| rbac::authorize(s, &user, &info)) {
            return Ok(answer(&user.name, routes::error_response(&e)));
        }
    }
    let body = match body {
        Ok(b) => b,
        Err(e) => {
            let e = ApiError::bad_request(format!("reading request body: {e}"));
            return Ok(answer(&user.name, routes::error_response(&e)));
        }
    };
    let call = Call { method: &method, path: &path, query, content_type: &content_type, body };
    Ok(answer(&user.name, routes::handle(&cluster, call)))
}

async fn serve_connection<I>(io: I, cluster: Cluster, front_end: Arc<str>)
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let service = hyper::service::service_fn(move |req| respond(cluster.clone(), front_end.clone(), req));
    if let Err(e) = auto::Builder::new(TokioExecutor::new()).serve_connection(TokioIo::new(io), service).await {
        tracing::debug!("connection ended with error: {e}");
    }
}

/// Ends graceful deletions as their grace periods run out (what the kubelet's final delete does).
async fn reap(cluster: Cluster) {
    let (mut changed, _) = cluster.subscribe();
    loop {
        let next = cluster.with_store(|s| {
            s.reap(std::time::Instant::now());
            s.next_deadline()
        });
        let due = async {
            match next {
                Some(at) => tokio::time::sleep_until(tokio::time::Instant::from_std(at)).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = due => {}
            r = changed.changed() => if r.is_err() { return },
        }
    }
}

/// Serves `cluster` on `listener` (https when the cluster was configured with TLS) until `shutdown`
/// completes, then ends every open watch and returns. Connections still open at that point are abandoned
/// with the runtime that runs them.
pub async fn serve(listener: TcpListener, cluster: Cluster, shutdown: impl Future<Output = ()>) {
    serve_front_end(listener, cluster, FrontEnd { name: Arc::from(""), owns_watches: true }, shutdown).await;
}

/// One listener of a cluster: its name in [`Cluster::traffic`], and whether it is the cluster's own (whose end
/// ends every watch) rather than one more front end of a cluster served elsewhere too (whose end ends only its
/// own connections).
pub(crate) struct FrontEnd {
    pub name: Arc<str>,
    pub owns_watches: bool,
}

/// [`serve`] as front end `front_end`.
pub(crate) async fn serve_front_end(
    listener: TcpListener,
    cluster: Cluster,
    front_end: FrontEnd,
    shutdown: impl Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    let reaper = tokio::spawn(reap(cluster.clone()));
    let tls = cluster.tls_config().map(tokio_rustls::TlsAcceptor::from);
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
        let tls = tls.clone();
        let name = front_end.name.clone();
        tokio::spawn(async move {
            match tls {
                None => serve_connection(stream, cluster, name).await,
                Some(acceptor) => match acceptor.accept(stream).await {
                    Ok(stream) => serve_connection(stream, cluster, name).await,
                    Err(e) => tracing::debug!("TLS handshake failed: {e}"),
                },
            }
        });
    }
    reaper.abort();
    if front_end.owns_watches {
        cluster.drop_watches();
    }
}

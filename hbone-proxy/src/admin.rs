//! The admin endpoint on 127.0.0.1 (Istio's port 15000): `/config_dump`, a JSON view of what the proxy runs —
//! each pod's uid, name, namespace, netns, identity and certificate validity, the pods still pending, and the
//! workload directory (every workload the proxy knows, with ztunnel's field names and the source that listed it).

use std::net::{Ipv4Addr, SocketAddr};

use daemon::drain::DrainWatcher;
use daemon::http::{reply, Body, Server, TEXT};
use http::{Request, Response, StatusCode};

use crate::workloads::View;

/// Binds 127.0.0.1:`port` (only local users may read the dump) and serves it until the drain starts.
pub async fn serve(port: u16, workloads: View, drain: DrainWatcher) -> Result<(), daemon::Error> {
    let listener = daemon::listener::bind_tcp(SocketAddr::from((Ipv4Addr::LOCALHOST, port))).await?;
    let routes = move |request: Request<_>| std::future::ready(respond(&request, &workloads));
    tokio::spawn(Server::new("admin").serve(listener, drain, routes));
    Ok(())
}

fn respond<B>(request: &Request<B>, workloads: &View) -> Response<Body> {
    match (request.uri().path(), workloads.dump()) {
        ("/config_dump", Some(dump)) => {
            let mut body = serde_json::to_string_pretty(&dump).unwrap_or_default();
            body.push('\n');
            reply(StatusCode::OK, "application/json", body)
        }
        ("/config_dump", None) => reply(StatusCode::SERVICE_UNAVAILABLE, TEXT, "shutting down\n"),
        _ => reply(StatusCode::NOT_FOUND, TEXT, "not found\n"),
    }
}

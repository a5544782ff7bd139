//! Outbound capture ([`ports::OUTBOUND`]): a connection the pod's app opened, redirected by the in-pod rules. Mesh
//! destinations are reached over HBONE as the pod's identity, or over the same-node fast path ([`fast_path`]) when
//! this proxy enrolled the destination pod too; anything else is passed through as plain TCP from the pod's netns.
//! Connections to the proxy itself are refused first ([`refusal`]).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use hbone::ConnectRequest;
use istio_contract::{ports, telemetry};
use tokio::net::TcpStream;

use crate::directory::Protocol;
use crate::mesh::PodContext;
use crate::metrics::Direction;
use crate::traffic::{Peer, Security, TrafficLabels};
use crate::{fast_path, refusal, sockets};

/// Proxies one captured outbound connection until both sides are done.
pub async fn handle(pod: Arc<PodContext>, app: TcpStream, peer: SocketAddr) {
    let started = Instant::now();
    let Some((mut app, dst)) = refusal::screen(&pod, Direction::Outbound, ports::OUTBOUND, app, peer) else {
        return;
    };
    let _ = app.set_nodelay(true);
    let listed = pod.mesh.directory.lookup(dst.ip());
    let destination_peer = listed.as_ref().map(|d| Peer::listed(d, &pod.mesh.cluster_id)).unwrap_or_default();
    if listed.as_ref().is_some_and(|d| d.workload.protocol != Protocol::Hbone && d.workload.require_mtls) {
        // Never in plaintext: the app's connection is reset instead of being passed through.
        sockets::reset(app);
        let labels = TrafficLabels::outbound(pod.peer(), destination_peer, Security::Plaintext);
        pod.mesh.metrics.opened(&labels);
        pod.mesh.metrics.closed(&labels, telemetry::RESPONSE_FLAG_DENIED, 0, 0);
        tracing::info!(
            target: "access",
            direction = "outbound",
            protocol = "TCP",
            src.addr = %peer,
            src.identity = %pod.cert().identity(),
            dst.addr = %dst,
            error = "destination requires mTLS but does not speak HBONE: refused",
            "connection complete"
        );
        return;
    }
    let destination = listed.filter(|d| d.workload.protocol == Protocol::Hbone);
    if let Some(d) = &destination {
        if let Some(server) = fast_path::target(&pod, dst, d) {
            return fast_path::carry(&pod, server, app, peer, dst, d).await;
        }
    }
    let (protocol, dst_identity) = match &destination {
        Some(d) => ("HBONE", d.identity.to_string()),
        None => ("TCP", String::new()),
    };
    let metrics = &pod.mesh.metrics;
    let security = if destination.is_some() { Security::MutualTls } else { Security::Plaintext };
    let labels = TrafficLabels::outbound(pod.peer(), destination_peer, security);
    metrics.opened(&labels);
    let result = match destination {
        Some(d) => {
            let request = ConnectRequest {
                src: pod.cert(),
                src_addr: peer,
                dst: SocketAddr::new(dst.ip(), ports::HBONE),
                dst_identity: d.identity.clone(),
                authority: dst,
                baggage: pod.baggage.clone(),
                extra_headers: Default::default(),
            };
            match pod.pool.connect(&request).await {
                Ok(mut tunnel) => {
                    let copied = hbone::copy::bidirectional(&mut tunnel, &mut app).await;
                    let (from_app, to_app) = (copied.to_tunnel, copied.from_tunnel);
                    match copied.error {
                        None => Ok((from_app, to_app)),
                        Some(e) => Err((from_app, to_app, e.to_string())),
                    }
                }
                Err(e) => Err((0, 0, e.to_string())),
            }
        }
        None => match sockets::connect_in(&pod.netns, dst, None).await {
            Ok(mut upstream) => splice(&mut app, &mut upstream).await,
            Err(e) => Err((0, 0, format!("connecting to {dst}: {e}"))),
        },
    };
    let (from_app, to_app, error) = match result {
        Ok((from_app, to_app)) => (from_app, to_app, None),
        Err((from_app, to_app, error)) => (from_app, to_app, Some(error)),
    };
    metrics.closed(&labels, telemetry::RESPONSE_FLAGS_NONE, from_app, to_app);
    tracing::info!(
        target: "access",
        direction = "outbound",
        protocol,
        src.addr = %peer,
        src.identity = %pod.cert().identity(),
        dst.addr = %dst,
        dst.identity = %dst_identity,
        bytes_sent = to_app,
        bytes_received = from_app,
        duration_ms = started.elapsed().as_millis() as u64,
        error = error.as_deref().unwrap_or(""),
        "connection complete"
    );
}

/// Moves bytes both ways with half-close through the kernel (`splice(2)`): a passthrough connection holds no
/// user-space buffer, so it takes nothing from the buffer budget whatever its peers do. Returns (client → upstream,
/// upstream → client) bytes.
async fn splice(client: &mut TcpStream, upstream: &mut TcpStream) -> Result<(u64, u64), (u64, u64, String)> {
    crate::splice::bidirectional(client, upstream).await.map_err(|((up, down), e)| (up, down, e.to_string()))
}

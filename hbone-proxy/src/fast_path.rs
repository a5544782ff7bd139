//! The same-node fast path: a connection between two pods that this proxy both enrolled is connected inside the
//! destination pod's netns directly, as inbound HBONE connects to the app (proxy mark, the client's IP as the
//! source), and its bytes are spliced between the two sockets ([`crate::splice`]) without TLS: they never leave the
//! node's kernel, and the proxy that would have encrypted them is the one that would have decrypted them.
//!
//! It admits exactly what HBONE would, as HBONE would report it:
//! - only a destination the directory lists as HBONE, and only when the pod enrolled at that address is the
//!   identity the directory lists there (over HBONE, a server certificate of another identity fails the
//!   handshake); anything else takes the ordinary path and fails or succeeds there as before;
//! - not to a port HBONE refuses as a target (the proxy's own, [`hbone::server::ILLEGAL_TARGET_PORTS`]): those
//!   take HBONE too, and get its refusal;
//! - istiod's authorization policies of the server pod are checked as over HBONE, with the client pod's enrolled
//!   identity: a denied connection is reset (over HBONE the client's proxy gets 401 and resets it too);
//! - `MTLS_MODE=STRICT` and `requireMtls` refuse plaintext only, and this is not plaintext: the client's identity
//!   is the one the proxy enrolled its pod as (the identity its certificate would prove);
//! - both sides are recorded, as over HBONE: the client pod's outbound series (`reporter="source"`) and the server
//!   pod's inbound series (`reporter="destination"`), each with the enrolled identities as principals and
//!   `connection_security_policy="same_node"`, and an access-log line for each direction with
//!   `protocol="SAME_NODE"`.
//!
//! `SAME_NODE_FAST_PATH=false` sends these connections over HBONE instead.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use istio_contract::telemetry;
use tokio::net::TcpStream;

use crate::directory::Destination;
use crate::mesh::PodContext;
use crate::traffic::{Peer, Security, TrafficLabels};
use crate::{sockets, splice};

/// What the access log calls the fast path's connections.
const PROTOCOL: &str = "SAME_NODE";

/// The pod a connection from `source` to `dst`, which the directory lists as the HBONE `destination`, is
/// carried to over the fast path; `None` when it must take HBONE (switched off, the destination not enrolled here,
/// enrolled as another identity than listed, or a port HBONE refuses as a target).
pub fn target(source: &PodContext, dst: SocketAddr, destination: &Destination) -> Option<Arc<PodContext>> {
    if !source.mesh.same_node_fast_path || hbone::server::ILLEGAL_TARGET_PORTS.contains(&dst.port()) {
        return None;
    }
    let pod = source.mesh.local_pods.get(dst.ip())?;
    (*pod.cert().identity() == destination.identity).then_some(pod)
}

/// Carries the app's connection `app` (from `peer`, in `source`'s pod) to `dst` in pod `server` until both sides
/// are done, recording it on both sides as described in the module's documentation.
pub async fn carry(
    source: &PodContext,
    server: Arc<PodContext>,
    mut app: TcpStream,
    peer: SocketAddr,
    dst: SocketAddr,
    destination: &Destination,
) {
    let started = Instant::now();
    let metrics = &source.mesh.metrics;
    let client_identity = source.cert().identity().clone();
    // The server pod's policies, as over HBONE (where they would answer 401): the app's connection is reset.
    if !server.admits(Some(&client_identity), peer.ip(), dst) {
        crate::sockets::reset(app);
        return;
    }
    let outbound =
        TrafficLabels::outbound(source.peer(), Peer::listed(destination, &source.mesh.cluster_id), Security::SameNode);
    let (directory, cluster) = (&server.mesh.directory, &server.mesh.cluster_id);
    let inbound = TrafficLabels::inbound(
        Peer::verified_client(directory, cluster, peer.ip(), &client_identity),
        server.peer(),
        Security::SameNode,
    );
    metrics.opened(&outbound);
    metrics.opened(&inbound);
    let (moved, error, flag) = match sockets::connect_in(&server.netns, dst, Some(peer.ip())).await {
        Ok(mut upstream) => match splice::bidirectional(&mut app, &mut upstream).await {
            Ok(moved) => (moved, None, telemetry::RESPONSE_FLAGS_NONE),
            Err((moved, e)) => (moved, Some(e.to_string()), telemetry::RESPONSE_FLAGS_NONE),
        },
        Err(e) => {
            tracing::info!(uid = %server.uid, authority = %dst, source = %peer.ip(), error = %e, "same-node target unreachable");
            ((0, 0), Some(format!("connecting to {dst}: {e}")), telemetry::RESPONSE_FLAG_CONNECTION_FAILURE)
        }
    };
    let (from_app, to_app) = moved;
    // As over HBONE: the client's side reports no flag when the server's app could not be reached, the server's does.
    metrics.closed(&outbound, telemetry::RESPONSE_FLAGS_NONE, from_app, to_app);
    metrics.closed(&inbound, flag, from_app, to_app);
    let duration_ms = started.elapsed().as_millis() as u64;
    let server_identity = server.cert().identity().clone();
    let error = error.unwrap_or_default();
    for direction in ["outbound", "inbound"] {
        tracing::info!(
            target: "access",
            direction,
            protocol = PROTOCOL,
            src.addr = %peer,
            src.identity = %client_identity,
            dst.addr = %dst,
            dst.identity = %server_identity,
            bytes_sent = to_app,
            bytes_received = from_app,
            duration_ms,
            error,
            "connection complete"
        );
    }
}

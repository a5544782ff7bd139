//! Inbound traffic of a pod: HBONE tunnels on Istio's HBONE port (mutual TLS, then CONNECT to the app) and
//! captured plaintext on Istio's plaintext inbound port. Both connect to the app from inside the pod's netns with the
//! client's IP as the source (transparent socket), so the app sees the real peer.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use hbone::{ConnectHandler, Ended, InboundRequest, InboundTls, OverCap, ServeError, ServeOptions, TlsError, Transfer};
use http::StatusCode;
use istio_contract::{ports, telemetry};
use tokio::net::TcpStream;
use tokio::sync::watch;

use crate::config::MtlsMode;
use crate::mesh::PodContext;
use crate::metrics::{Direction, HboneLimitLabels};
use crate::traffic::{Peer, Security, TrafficLabels};
use crate::{refusal, sockets};

/// Connects HBONE tunnels to the pod's apps.
struct ToApp {
    pod: Arc<PodContext>,
}

impl ToApp {
    /// The traffic labels of a tunnel: the client as its certificate proves it (and the directory lists it),
    /// this pod as the server. Derived again when the tunnel ends, from the same request.
    fn labels(&self, req: &InboundRequest) -> TrafficLabels {
        let (directory, cluster) = (&self.pod.mesh.directory, &self.pod.mesh.cluster_id);
        let client = Peer::verified_client(directory, cluster, req.peer.ip(), &req.peer_identity);
        TrafficLabels::inbound(client, self.pod.peer(), Security::MutualTls)
    }
}

impl ConnectHandler for ToApp {
    type Target = TcpStream;

    fn connect(&self, req: &InboundRequest) -> impl std::future::Future<Output = Result<TcpStream, StatusCode>> + Send {
        let (pod, authority, source) = (self.pod.clone(), req.authority, req.peer.ip());
        let labels = self.labels(req);
        // As ztunnel: a connection istiod's policies deny gets 401 before anything is connected for it.
        let admitted = pod.admits(Some(&req.peer_identity), source, authority);
        async move {
            if !admitted {
                return Err(StatusCode::UNAUTHORIZED);
            }
            pod.mesh.metrics.opened(&labels);
            sockets::connect_in(&pod.netns, authority, Some(source)).await.map_err(|error| {
                tracing::info!(uid = %pod.uid, %authority, %source, %error, "HBONE target unreachable");
                pod.mesh.metrics.closed(&labels, telemetry::RESPONSE_FLAG_CONNECTION_FAILURE, 0, 0);
                StatusCode::SERVICE_UNAVAILABLE
            })
        }
    }

    fn finished(&self, req: &InboundRequest, transfer: Transfer) {
        let labels = self.labels(req);
        self.pod.mesh.metrics.closed(&labels, telemetry::RESPONSE_FLAGS_NONE, transfer.to_target, transfer.from_target);
        let error = transfer.error.map(|e| e.to_string()).unwrap_or_default();
        tracing::info!(
            target: "access",
            direction = "inbound",
            protocol = "HBONE",
            src.addr = %req.peer,
            src.identity = %req.peer_identity,
            dst.addr = %req.authority,
            dst.identity = %self.pod.cert().identity(),
            bytes_sent = transfer.from_target,
            bytes_received = transfer.to_target,
            duration_ms = transfer.duration.as_millis() as u64,
            error,
            "connection complete"
        );
    }
}

/// Serves one connection accepted on the HBONE port until it ends or the pod proxy stops (then it drains).
///
/// The node-wide limits of [`crate::mesh::InboundHbone`] apply: a client that does not offer ALPN `h2` is refused
/// in the TLS handshake, a connection over the caps (in all, or for the client's identity) gets GOAWAY
/// (REFUSED_STREAM), one without streams is closed after the idle timeout, and one that breaks an HTTP/2 limit
/// gets GOAWAY from h2. Each is counted (`hbone_connections_refused_total`, `hbone_connections_terminated_total`)
/// and logged at most once per reason and interval.
pub async fn hbone(pod: Arc<PodContext>, tls: InboundTls, tcp: TcpStream, mut stop: watch::Receiver<()>) {
    // HTTP/2 frames are written as they are ready; Nagle would hold back the small ones (WINDOW_UPDATE, PING).
    let _ = tcp.set_nodelay(true);
    let limits = &pod.mesh.metrics.hbone_limits;
    let accepted = match tls.accept(tcp).await {
        Ok(accepted) => accepted,
        Err(error @ TlsError::NoAlpn { peer }) => {
            limits.refused.get_or_create(&HboneLimitLabels { reason: "no_alpn" }).inc();
            return log_limit(&pod, "no_alpn", peer, &error);
        }
        Err(error) => {
            let text = error.to_string();
            if let Some(suppressed) = pod.handshake_log.admit(text.clone()) {
                tracing::info!(uid = %pod.uid, error = %text, suppressed, "inbound HBONE handshake failed");
            }
            return;
        }
    };
    // Held for as long as the connection is served: its place under the caps.
    let _permit = match pod.mesh.hbone.limiter.try_acquire(&accepted.peer_identity) {
        Ok(permit) => permit,
        Err(over) => {
            let reason = match over {
                OverCap::Total { .. } => "max_connections",
                OverCap::PerIdentity { .. } => "max_connections_per_identity",
            };
            limits.refused.get_or_create(&HboneLimitLabels { reason }).inc();
            log_limit(&pod, reason, accepted.peer, &over);
            hbone::refuse(accepted, &over.to_string()).await;
            return;
        }
    };
    let (uid, peer) = (pod.uid.clone(), accepted.peer);
    let options = ServeOptions {
        drain_deadline: pod.mesh.termination_deadline,
        idle_timeout: pod.mesh.hbone.idle_timeout,
        ..ServeOptions::default()
    };
    let drain = pod.mesh.drain.clone();
    let stopped = async move {
        // The sender never sends: the pod proxy dropping it is the signal; so is the proxy's drain (SIGTERM).
        let pod_stopped = async { while stop.changed().await.is_ok() {} };
        tokio::select! {
            () = pod_stopped => {}
            _ = drain.signaled() => {}
        }
    };
    let terminated = |reason| {
        pod.mesh.metrics.hbone_limits.terminated.get_or_create(&HboneLimitLabels { reason }).inc();
    };
    let memory = pod.pool.memory().cloned();
    match hbone::serve_budgeted(accepted, Arc::new(ToApp { pod: pod.clone() }), options, memory, stopped).await {
        // Idle connections are closed in the normal course of things: counted, not logged.
        Ok(Ended::IdleTimeout) => terminated("idle_timeout"),
        Ok(Ended::ClientClosed | Ended::Drained) => {}
        Err(error @ ServeError::HandshakeTimeout(_)) => {
            terminated("handshake_timeout");
            log_limit(&pod, "handshake_timeout", peer, &error);
        }
        Err(error) => match error.limit_exceeded() {
            Some(reason) => {
                terminated(reason);
                log_limit(&pod, reason, peer, &error);
            }
            None => tracing::info!(%uid, %error, "inbound HBONE connection ended"),
        },
    }
}

/// Logs a limit the HBONE server enforced on `peer`, at most once per reason and interval node-wide (a peer can
/// repeat it at will); the line says how many were left out since the previous one.
fn log_limit(pod: &PodContext, reason: &'static str, peer: SocketAddr, error: &dyn std::fmt::Display) {
    if let Some(suppressed) = pod.mesh.hbone.log.admit(reason) {
        tracing::warn!(uid = %pod.uid, reason, %peer, %error, suppressed, "inbound HBONE limit enforced");
    }
}

/// Forwards one connection captured on the plaintext inbound port to its original destination in the pod; in
/// `MTLS_MODE=STRICT` resets it instead, so only HBONE reaches the apps. Connections to the proxy itself or to an
/// address that is not the pod's are refused first ([`refusal`]).
pub async fn plaintext(pod: Arc<PodContext>, client: TcpStream, peer: SocketAddr) {
    let started = Instant::now();
    let Some((mut client, dst)) = refusal::screen(&pod, Direction::Inbound, ports::INBOUND_PLAINTEXT, client, peer)
    else {
        return;
    };
    let result = if pod.mesh.mtls_mode == MtlsMode::Strict {
        sockets::reset(client);
        Err("plaintext refused: MTLS_MODE=STRICT".to_owned())
    } else if !pod.admits(None, peer.ip(), dst) {
        sockets::reset(client);
        Err("plaintext refused: authorization policy".to_owned())
    } else {
        let metrics = &pod.mesh.metrics;
        let source = Peer::plaintext_client(&pod.mesh.directory, &pod.mesh.cluster_id, peer.ip());
        let labels = TrafficLabels::inbound(source, pod.peer(), Security::Plaintext);
        metrics.opened(&labels);
        let (result, flag) = match sockets::connect_in(&pod.netns, dst, Some(peer.ip())).await {
            Ok(mut app) => (
                // Through the kernel (`splice(2)`): no user-space buffer, so nothing for the buffer budget to hold.
                crate::splice::bidirectional(&mut client, &mut app).await.map_err(|(_, e)| e.to_string()),
                telemetry::RESPONSE_FLAGS_NONE,
            ),
            Err(e) => (Err(format!("connecting to {dst}: {e}")), telemetry::RESPONSE_FLAG_CONNECTION_FAILURE),
        };
        let (received, sent) = result.as_ref().copied().unwrap_or((0, 0));
        metrics.closed(&labels, flag, received, sent);
        result
    };
    let (received, sent) = result.as_ref().copied().unwrap_or((0, 0));
    tracing::info!(
        target: "access",
        direction = "inbound",
        protocol = "TCP",
        src.addr = %peer,
        dst.addr = %dst,
        dst.identity = %pod.cert().identity(),
        bytes_sent = sent,
        bytes_received = received,
        duration_ms = started.elapsed().as_millis() as u64,
        error = result.err().unwrap_or_default(),
        "connection complete"
    );
}

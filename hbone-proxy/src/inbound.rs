//! Inbound traffic of a pod: HBONE tunnels on Istio's HBONE port (mutual TLS, then CONNECT to the app) and
//! captured plaintext on Istio's plaintext inbound port. Both connect to the app from inside the pod's netns with the
//! client's IP as the source (transparent socket), so the app sees the real peer.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use hbone::{ConnectHandler, InboundRequest, InboundTls, ServeOptions, Transfer};
use http::StatusCode;
use tokio::net::TcpStream;
use tokio::sync::watch;

use crate::config::MtlsMode;
use crate::context::PodContext;
use crate::metrics::Direction;
use crate::sockets;

/// Connects HBONE tunnels to the pod's apps.
struct ToApp {
    pod: Arc<PodContext>,
}

impl ConnectHandler for ToApp {
    type Target = TcpStream;

    fn connect(&self, req: &InboundRequest) -> impl std::future::Future<Output = Result<TcpStream, StatusCode>> + Send {
        let (pod, authority, source) = (self.pod.clone(), req.authority, req.peer.ip());
        async move {
            pod.mesh.metrics.opened(Direction::Inbound, "HBONE");
            sockets::connect_in(&pod.netns, authority, Some(source)).await.map_err(|error| {
                tracing::info!(uid = %pod.uid, %authority, %source, %error, "HBONE target unreachable");
                pod.mesh.metrics.closed(Direction::Inbound, "HBONE", 0, 0);
                StatusCode::SERVICE_UNAVAILABLE
            })
        }
    }

    fn finished(&self, req: &InboundRequest, transfer: Transfer) {
        self.pod.mesh.metrics.closed(Direction::Inbound, "HBONE", transfer.to_target, transfer.from_target);
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
pub async fn hbone(pod: Arc<PodContext>, tls: InboundTls, tcp: TcpStream, mut stop: watch::Receiver<()>) {
    // HTTP/2 frames are written as they are ready; Nagle would hold back the small ones (WINDOW_UPDATE, PING).
    let _ = tcp.set_nodelay(true);
    let accepted = match tls.accept(tcp).await {
        Ok(accepted) => accepted,
        Err(error) => {
            tracing::info!(uid = %pod.uid, %error, "inbound HBONE handshake failed");
            return;
        }
    };
    let uid = pod.uid.clone();
    let options = ServeOptions { drain_deadline: pod.mesh.termination_deadline, ..ServeOptions::default() };
    let drain = pod.mesh.drain.clone();
    let stopped = async move {
        // The sender never sends: the pod proxy dropping it is the signal; so is the proxy's drain (SIGTERM).
        let pod_stopped = async { while stop.changed().await.is_ok() {} };
        tokio::select! {
            () = pod_stopped => {}
            _ = drain.signaled() => {}
        }
    };
    if let Err(error) = hbone::serve(accepted, Arc::new(ToApp { pod }), options, stopped).await {
        tracing::info!(%uid, %error, "inbound HBONE connection ended");
    }
}

/// Forwards one connection captured on the plaintext inbound port to its original destination in the pod; in
/// `MTLS_MODE=STRICT` resets it instead, so only HBONE reaches the apps.
pub async fn plaintext(pod: Arc<PodContext>, mut client: TcpStream, peer: SocketAddr) {
    let started = Instant::now();
    let dst = match sockets::original_dst(&client) {
        Ok(dst) => dst,
        Err(error) => {
            tracing::warn!(uid = %pod.uid, %peer, %error, "inbound connection without an original destination");
            return;
        }
    };
    let result = if pod.mesh.mtls_mode == MtlsMode::Strict {
        sockets::reset(client);
        Err("plaintext refused: MTLS_MODE=STRICT".to_owned())
    } else {
        let metrics = &pod.mesh.metrics;
        metrics.opened(Direction::Inbound, "TCP");
        let result = match sockets::connect_in(&pod.netns, dst, Some(peer.ip())).await {
            Ok(mut app) => tokio::io::copy_bidirectional(&mut client, &mut app).await.map_err(|e| e.to_string()),
            Err(e) => Err(format!("connecting to {dst}: {e}")),
        };
        let (received, sent) = result.as_ref().copied().unwrap_or((0, 0));
        metrics.closed(Direction::Inbound, "TCP", received, sent);
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

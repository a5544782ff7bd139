//! One enrolled pod's proxy: its identity and certificate, its HBONE client pool, and the in-pod listeners
//! (outbound on [`ports::OUTBOUND`], inbound plaintext on [`ports::INBOUND_PLAINTEXT`], inbound HBONE on
//! [`ports::HBONE`], DNS on [`ports::DNS`]) that live as long as this value.

use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use daemon::drain::DrainWatcher;
use hbone::{Baggage, ConnectObserver, Identity, InboundTls, Pool, PoolConfig, ServerCerts};
use istio_contract::ports;
use netns::Netns;
use serde_json::{json, Value};
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tracing::Instrument;
use zds::messages::WorkloadInfo;

use crate::mesh::{IdentityHold, Mesh, PodContext};
use crate::sockets::PodNetns;
use crate::{dns, inbound, outbound, sockets};

/// Why a pod's proxy could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The AddWorkload had no workload info to derive an identity from.
    #[error("pod {0}: AddWorkload without workload_info")]
    NoWorkloadInfo(String),
    /// The workload info does not form a SPIFFE identity.
    #[error("pod {uid}: {source}")]
    Identity {
        /// The pod.
        uid: String,
        /// What was wrong.
        source: hbone::IdentityError,
    },
    /// Minting or installing the pod's certificate failed.
    #[error("pod {uid}: certificate: {reason}")]
    Certificate {
        /// The pod.
        uid: String,
        /// What failed.
        reason: String,
    },
    /// Reading the pod's addresses or binding a listener in its netns failed.
    #[error("pod {uid}: {what}: {source}")]
    Netns {
        /// The pod.
        uid: String,
        /// What was being done.
        what: String,
        /// The underlying error.
        source: std::io::Error,
    },
}

/// A running pod proxy. Dropping it closes the pod's listeners at once and asks open HBONE connections to
/// drain (GOAWAY); plain connections already accepted finish on their own.
#[derive(Debug)]
pub struct PodProxy {
    netns_id: (u64, u64),
    ctx: Arc<PodContext>,
    name: String,
    namespace: String,
    ips: Vec<IpAddr>,
    _stop: watch::Sender<()>,
    _listeners: JoinSet<()>,
    /// istiod's CA keeps this pod's identity's certificate fresh while the pod proxy runs.
    _identity: IdentityHold,
}

impl PodProxy {
    /// Mints the pod's certificate and starts its listeners inside `netns`. Returns once all listeners are
    /// bound, so the caller can ack the agent. Never blocks the runtime: the key is generated on the blocking pool
    /// ([`Mesh::mint`]), and every socket is made on a socket thread ([`PodNetns`]).
    pub async fn start(
        mesh: &Arc<Mesh>,
        uid: &str,
        info: Option<&WorkloadInfo>,
        netns: Arc<Netns>,
    ) -> Result<Self, StartError> {
        let info = info.ok_or_else(|| StartError::NoWorkloadInfo(uid.to_owned()))?;
        let service_account = if info.service_account.is_empty() { "default" } else { &info.service_account };
        let identity = Identity::new(mesh.trust_domain(), &info.namespace, service_account)
            .map_err(|source| StartError::Identity { uid: uid.to_owned(), source })?;
        let cert_err = |reason: String| StartError::Certificate { uid: uid.to_owned(), reason };
        let netns_err = |what: &str, source| StartError::Netns { uid: uid.to_owned(), what: what.to_owned(), source };
        let hold = mesh.hold_identity(&identity);
        let (minted, entered) = tokio::join!(mesh.mint(&identity), PodNetns::enter(netns));
        let cert = Arc::new(minted.map_err(cert_err)?);
        let netns = entered.map_err(|e| netns_err("entering the pod's netns", e))?;
        let ips = sockets::pod_ips(&netns).await.map_err(|e| netns_err("reading the pod's addresses", e))?;
        let certs = ServerCerts::new();
        for ip in &ips {
            certs.set(*ip, &cert).map_err(|e| cert_err(e.to_string()))?;
        }

        let netns_id = netns.id();
        let dial_ns = netns.clone();
        let dialer: hbone::Dialer = Arc::new(move |dst| {
            let ns = dial_ns.clone();
            Box::pin(async move { sockets::connect_in(&ns, dst, None).await })
        });
        let latency = mesh.metrics.hbone_connect_seconds.clone();
        let observer = ConnectObserver(Arc::new(move |took: Duration| latency.observe(took.as_secs_f64())));
        // The pod's account in the buffer budget: its pool and its HBONE server share it (`Pool::memory`).
        let memory = Some(mesh.buffers.account());
        let pool_config = PoolConfig { on_connected: Some(observer), memory, ..PoolConfig::default() };
        let pool = Pool::with_dialer(mesh.tls.clone(), pool_config, dialer);
        let mut baggage = Baggage::namespace(&info.namespace);
        if !info.name.is_empty() {
            baggage.workload = Some(("pod".to_owned(), info.name.clone()));
        }
        let ctx = Arc::new(PodContext::new(uid, netns.clone(), cert, pool, baggage, mesh.clone(), ips.clone()));

        let (stop, _) = watch::channel(());
        let inbound_tls = InboundTls::new(mesh.tls.clone(), certs.clone());
        let mut listeners = JoinSet::new();
        listeners.spawn(rotate_certs(ctx.clone(), identity.clone(), certs.clone(), ips.clone()));
        // At the level of the loops' warnings, so they name the pod whatever the log level; one span for all of
        // them (a span is kept, with its fields, for as long as it is entered anywhere).
        let span = tracing::warn_span!("pod", uid);
        let accept = Acceptor { span: &span, drain: &mesh.drain };
        for addr in any_addrs(&ips) {
            let (ns, netns_err) = (&netns, &netns_err);
            let bind = |port| {
                let addr = SocketAddr::new(addr, port);
                async move { sockets::listen_in(ns, addr).await.map_err(|e| netns_err(&format!("listening on {addr}"), e)) }
            };
            let ctx_out = ctx.clone();
            listeners.spawn(accept.serve(bind(ports::OUTBOUND).await?, "outbound", move |s, peer| {
                outbound::handle(ctx_out.clone(), s, peer)
            }));
            let ctx_in = ctx.clone();
            listeners.spawn(accept.serve(
                bind(ports::INBOUND_PLAINTEXT).await?,
                "inbound plaintext",
                move |s, peer| inbound::plaintext(ctx_in.clone(), s, peer),
            ));
            let (ctx_hbone, tls, stop) = (ctx.clone(), inbound_tls.clone(), stop.clone());
            listeners.spawn(accept.serve(bind(ports::HBONE).await?, "inbound HBONE", move |s, _peer| {
                inbound::hbone(ctx_hbone.clone(), tls.clone(), s, stop.subscribe())
            }));
        }
        let forwarder = dns::Forwarder::new(uid, netns.clone(), mesh.dns.clone(), mesh.metrics.dns.clone())
            .await
            .map_err(|e| netns_err("creating the dns upstream sockets", e))?;
        for addr in dns::listen_addrs(&ips) {
            let tcp = sockets::listen_in(&netns, addr)
                .await
                .map_err(|e| netns_err(&format!("listening on tcp {addr}"), e))?;
            let udp =
                sockets::bind_udp_in(&netns, addr).await.map_err(|e| netns_err(&format!("binding udp {addr}"), e))?;
            let fwd = forwarder.clone();
            listeners.spawn(accept.serve(tcp, "dns tcp", move |s, peer| dns::serve_tcp(fwd.clone(), s, peer)));
            listeners.spawn(dns::serve_udp(forwarder.clone(), udp));
        }
        tracing::info!(uid, %identity, ?ips, "pod proxy started");
        mesh.local_pods.insert(&ctx);
        Ok(PodProxy {
            netns_id,
            ctx,
            name: info.name.clone(),
            namespace: info.namespace.clone(),
            ips,
            _stop: stop,
            _listeners: listeners,
            _identity: hold,
        })
    }

    /// The pod as `/config_dump` shows it.
    pub fn dump(&self, uid: &str) -> Value {
        let cert = self.ctx.cert();
        let (dev, ino) = self.netns_id;
        json!({
            "uid": uid,
            "name": self.name,
            "namespace": self.namespace,
            "netns": { "dev": dev, "ino": ino },
            "ips": self.ips,
            "identity": cert.identity().to_string(),
            "certificate": {
                "issued_at": rfc3339(cert.issued_at()),
                "expires_at": rfc3339(cert.expires_at()),
                "expires_at_unix": unix_seconds(cert.expires_at()),
            },
        })
    }

    /// The (dev, ino) of the pod's netns: an Add with the same one is a no-op.
    pub fn netns_id(&self) -> (u64, u64) {
        self.netns_id
    }
}

impl Drop for PodProxy {
    /// The pod is no destination of the same-node fast path any more: new connections to it take HBONE, and find
    /// its listeners closed.
    fn drop(&mut self) {
        self.ctx.mesh.local_pods.remove(&self.ctx);
    }
}

/// How long to wait before trying again when minting a replacement certificate failed.
const ROTATION_RETRY: Duration = Duration::from_secs(10);
/// How often a pod looks for istiod's refreshed certificate once its own is past half-life.
const REFRESH_POLL: Duration = Duration::from_secs(5);

/// Replaces the pod's certificate at half its lifetime, for as long as the pod proxy runs: new handshakes (both
/// as client and server) present the new one; established connections are left alone.
async fn rotate_certs(ctx: Arc<PodContext>, identity: Identity, certs: ServerCerts, ips: Vec<IpAddr>) {
    loop {
        let current = ctx.cert();
        let lifetime = current.expires_at().duration_since(current.issued_at()).unwrap_or_default();
        let due = current.issued_at() + lifetime / 2;
        tokio::time::sleep(due.duration_since(SystemTime::now()).unwrap_or_default()).await;
        let rotated = match ctx.mesh.mint(&identity).await {
            // istiod's CA: the manager refreshes at the same half-life, and may not have yet; look again shortly
            // (the certificate in use stays valid for the other half of its life).
            Ok(cert) if cert.expires_at() <= current.expires_at() => {
                tokio::time::sleep(REFRESH_POLL).await;
                continue;
            }
            Ok(cert) => ips.iter().try_for_each(|ip| certs.set(*ip, &cert)).map(|()| cert).map_err(|e| e.to_string()),
            Err(error) => Err(error),
        };
        match rotated {
            Ok(cert) => {
                tracing::info!(uid = ctx.uid, %identity, expires_at = %rfc3339(cert.expires_at()), "workload certificate rotated");
                ctx.replace_cert(cert);
            }
            Err(error) => {
                tracing::warn!(uid = ctx.uid, %error, retry_in = ?ROTATION_RETRY, "workload certificate rotation failed");
                tokio::time::sleep(ROTATION_RETRY).await;
            }
        }
    }
}

/// `at` as an RFC 3339 UTC timestamp with whole seconds (`2026-11-30T10:18:13Z`), as `/config_dump` and the
/// logs show certificate times.
fn rfc3339(at: SystemTime) -> String {
    OffsetDateTime::from(at).truncate_to_second().format(&Rfc3339).unwrap_or_default()
}

fn unix_seconds(at: SystemTime) -> u64 {
    at.duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or_default()
}

/// The wildcard addresses to listen on: IPv4 always, IPv6 when the pod has an IPv6 address.
fn any_addrs(ips: &[IpAddr]) -> Vec<IpAddr> {
    let mut addrs = vec![IpAddr::V4(Ipv4Addr::UNSPECIFIED)];
    if ips.iter().any(IpAddr::is_ipv6) {
        addrs.push(IpAddr::V6(Ipv6Addr::UNSPECIFIED));
    }
    addrs
}

/// How many connections one listener of one pod serves at once; one more is closed as soon as it is accepted (and
/// counted in a rate-limited warning). Far above what one pod's apps open, it bounds the descriptors a single pod
/// (or its peers) can make the node proxy hold through one port.
pub const MAX_CONNECTIONS_PER_LISTENER: usize = 16_384;

/// Runs a pod's accept loops on the one accept loop of the node side ([`daemon::listener::serve`]): at most
/// [`MAX_CONNECTIONS_PER_LISTENER`] connections at once, a back-off when accepting fails (out of file descriptors,
/// say) instead of spinning, warnings at most once per interval and listener, and no new connections once the
/// proxy drains.
#[derive(Clone, Copy)]
struct Acceptor<'a> {
    span: &'a tracing::Span,
    drain: &'a DrainWatcher,
}

impl Acceptor<'_> {
    /// Accepts on `listener` (`name` in logs, under the pod's span) until the task is aborted or the proxy drains,
    /// handing every connection and its peer address to its own task.
    fn serve<F, Fut>(self, listener: TcpListener, name: &'static str, handle: F) -> impl Future<Output = ()> + Send
    where
        F: Fn(TcpStream, SocketAddr) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let serve = daemon::listener::serve(
            listener,
            name,
            MAX_CONNECTIONS_PER_LISTENER,
            self.drain.clone(),
            move |stream: TcpStream, _drain| {
                // No peer address: the connection is already gone.
                let work = stream.peer_addr().ok().map(|peer| handle(stream, peer));
                async move {
                    if let Some(work) = work {
                        work.await;
                    }
                }
            },
        );
        serve.instrument(self.span.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn certificate_times_are_rfc3339_utc_in_whole_seconds() {
        assert_eq!(rfc3339(SystemTime::UNIX_EPOCH), "1970-01-01T00:00:00Z");
        let at = SystemTime::UNIX_EPOCH + Duration::from_millis(1_796_033_893_250);
        assert_eq!(rfc3339(at), "2026-11-30T10:18:13Z");
        let leap = SystemTime::UNIX_EPOCH + Duration::from_secs(951_782_400);
        assert_eq!(rfc3339(leap), "2000-02-29T00:00:00Z");
    }
}

//! One pod's forwarder and its serving: admitting a pod's queries within the pod's bounds, resolving each
//! through the upstreams in order, and serving the pod's UDP socket and TCP connections.
//!
//! Guarantees:
//! - Every query gets the first upstream answer, or SERVFAIL once [`QUERY_TIMEOUT`] has passed (each upstream
//!   gets an equal share of it); a message shorter than a header, or longer than [`MAX_UDP_PAYLOAD`], gets
//!   nothing and is counted.
//! - At most [`MAX_IN_FLIGHT`] queries of a pod are in flight (UDP and TCP together, from admission until the
//!   answer is handed back), at most [`MAX_TCP_CONNECTIONS`] client TCP connections are open, and each has at most
//!   [`MAX_TCP_PIPELINE`] queries in flight; over a bound, a query is dropped and counted, a connection reset.
//! - A UDP answer is at most what its query allows ([`wire::udp_answer_limit`]), cut with TC set when longer, and
//!   the query sent upstream asks for no more than [`MAX_UDP_PAYLOAD`].
//! - A query goes upstream over the transport it came on, so a truncated UDP answer makes the client retry over
//!   TCP end to end.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use istio_contract::ports;
use prometheus_client::metrics::gauge::Gauge;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpStream, UdpSocket};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};

use super::transport::{read_frame, write_frame, TcpUpstreams, UdpUpstream};
use super::upstreams::Upstreams;
use super::wire::{self, HEADER_LEN, MAX_UDP_PAYLOAD};
use crate::metrics::{DnsDropLabels, DnsLabels, DnsMetrics};
use crate::ratelimit::{RateLimitedLog, REFUSAL_LOG_INTERVAL};
use crate::sockets::{self, PodNetns};

/// How long one query may take across all upstreams before the client gets SERVFAIL.
pub const QUERY_TIMEOUT: Duration = Duration::from_secs(5);
/// Queries one pod may have in flight, UDP and TCP together; more are dropped.
pub const MAX_IN_FLIGHT: usize = 256;
/// Client TCP connections one pod may hold open to the forwarder; more are reset.
pub const MAX_TCP_CONNECTIONS: usize = 32;
/// Queries one client TCP connection may have in flight; the connection is not read further until one is answered.
pub const MAX_TCP_PIPELINE: usize = 16;
/// How long a client TCP connection may sit idle between queries.
const TCP_IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// The addresses the forwarder listens on inside the pod: loopback, because a REDIRECT of locally generated
/// packets rewrites their destination to loopback, and a reply from there matches the NAT entry (so the
/// client sees it come from the resolver it asked). IPv6 only when the pod has an IPv6 address.
pub fn listen_addrs(pod_ips: &[IpAddr]) -> Vec<SocketAddr> {
    let mut addrs = vec![SocketAddr::from((Ipv4Addr::LOCALHOST, ports::DNS))];
    if pod_ips.iter().any(IpAddr::is_ipv6) {
        addrs.push(SocketAddr::from((Ipv6Addr::LOCALHOST, ports::DNS)));
    }
    addrs
}

/// How a query reached the forwarder; it goes upstream the same way, so a truncated UDP answer makes the
/// client retry over TCP end to end.
#[derive(Debug, Clone, Copy)]
enum Transport {
    Udp,
    Tcp,
}

impl Transport {
    /// The `request_protocol` label value.
    fn as_str(self) -> &'static str {
        match self {
            Transport::Udp => "udp",
            Transport::Tcp => "tcp",
        }
    }
}

/// Why a query was dropped unanswered.
#[derive(Debug, Clone, Copy)]
enum DropReason {
    /// The pod already has [`MAX_IN_FLIGHT`] queries in flight.
    InFlightLimit,
    /// The pod already has [`MAX_TCP_CONNECTIONS`] client TCP connections open (the connection is reset).
    TcpConnectionLimit,
    /// Longer than [`MAX_UDP_PAYLOAD`] (over TCP the connection is closed too).
    Oversized,
    /// Shorter than a DNS header.
    Malformed,
}

impl DropReason {
    /// The `reason` label value.
    fn as_str(self) -> &'static str {
        match self {
            DropReason::InFlightLimit => "in_flight_limit",
            DropReason::TcpConnectionLimit => "tcp_connection_limit",
            DropReason::Oversized => "oversized",
            DropReason::Malformed => "malformed",
        }
    }
}

/// Which way a query goes upstream.
#[derive(Debug, Clone, Copy)]
enum Via<'a> {
    /// Through the pod's UDP socket for each upstream.
    Udp,
    /// Through the client connection's TCP connection to each upstream.
    Tcp(&'a TcpUpstreams),
}

/// One of a pod's in-flight slots, held from a query's admission until its answer is handed to the client.
#[derive(Debug)]
struct InFlight {
    _permit: OwnedSemaphorePermit,
    gauge: Gauge,
}

impl InFlight {
    fn new(permit: OwnedSemaphorePermit, gauge: &Gauge) -> Self {
        gauge.inc();
        InFlight { _permit: permit, gauge: gauge.clone() }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.gauge.dec();
    }
}

/// One pod's forwarder: its upstream sockets, created in its netns, and its bounds.
#[derive(Debug)]
pub struct Forwarder {
    uid: String,
    netns: PodNetns,
    upstreams: Upstreams,
    /// One per upstream, in the same order; an error for an upstream whose address family the host lacks.
    udp: Vec<Result<UdpUpstream, Arc<str>>>,
    in_flight: Arc<Semaphore>,
    tcp_connections: Arc<Semaphore>,
    metrics: DnsMetrics,
    /// Drops and SERVFAILs are logged at most once per reason and interval for the pod.
    log: RateLimitedLog<&'static str>,
}

impl Forwarder {
    /// A forwarder for pod `uid`, with one marked UDP socket per upstream created in `netns` (on the pod's socket
    /// thread); TCP upstream connections are opened there too. An upstream of an address family the host does not
    /// have (IPv6 disabled) only fails its queries; any other error fails the pod's start.
    pub async fn new(uid: &str, netns: PodNetns, upstreams: Upstreams, metrics: DnsMetrics) -> io::Result<Arc<Self>> {
        let addrs = upstreams.clone();
        let fds = netns
            .run(move || Ok(addrs.addrs().iter().map(|addr| sockets::marked_udp_socket(addr.ip())).collect::<Vec<_>>()))
            .await?;
        let mut udp = Vec::with_capacity(fds.len());
        for (addr, fd) in upstreams.addrs().iter().zip(fds) {
            udp.push(match fd {
                Ok(fd) => Ok(UdpUpstream::new(*addr, UdpSocket::from_std(std::net::UdpSocket::from(fd))?)),
                Err(error) if error.raw_os_error() == Some(nix::libc::EAFNOSUPPORT) => {
                    tracing::warn!(uid, upstream = %addr, %error, "dns upstream unusable from this pod");
                    Err(Arc::from(error.to_string()))
                }
                Err(error) => return Err(error),
            });
        }
        Ok(Arc::new(Forwarder {
            uid: uid.to_owned(),
            netns,
            upstreams,
            udp,
            in_flight: Arc::new(Semaphore::new(MAX_IN_FLIGHT)),
            tcp_connections: Arc::new(Semaphore::new(MAX_TCP_CONNECTIONS)),
            metrics,
            log: RateLimitedLog::new(REFUSAL_LOG_INTERVAL),
        }))
    }

    /// Counts `message`, received over `transport`, and gives it one of the pod's in-flight slots; `None` (it is
    /// dropped and counted) when it cannot be a query or the pod has no slot free.
    fn admit(&self, transport: Transport, message: &[u8]) -> Option<InFlight> {
        self.metrics.requests.get_or_create(&DnsLabels { request_protocol: transport.as_str() }).inc();
        let reason = if message.len() > MAX_UDP_PAYLOAD {
            DropReason::Oversized
        } else if message.len() < HEADER_LEN {
            DropReason::Malformed
        } else {
            match self.in_flight.clone().try_acquire_owned() {
                Ok(permit) => return Some(InFlight::new(permit, &self.metrics.in_flight)),
                Err(_) => DropReason::InFlightLimit,
            }
        };
        self.dropped(transport, reason);
        None
    }

    /// Counts a query dropped for `reason`, and logs it unless the same reason was logged for this pod lately.
    fn dropped(&self, transport: Transport, reason: DropReason) {
        let labels = DnsDropLabels { request_protocol: transport.as_str(), reason: reason.as_str() };
        self.metrics.dropped.get_or_create(&labels).inc();
        if let Some(suppressed) = self.log.admit(reason.as_str()) {
            let (protocol, reason) = (transport.as_str(), reason.as_str());
            tracing::warn!(uid = self.uid, protocol, reason, suppressed, "dns query dropped");
        }
    }

    /// The upstream answer to `query`, or SERVFAIL when no upstream answered within [`QUERY_TIMEOUT`] (each
    /// upstream gets an equal share of it). `None` for a message too short to answer.
    async fn resolve(&self, query: &[u8], via: Via<'_>) -> Option<Vec<u8>> {
        let fallback = wire::servfail(query)?;
        let transport = match via {
            Via::Udp => Transport::Udp,
            Via::Tcp(_) => Transport::Tcp,
        };
        let labels = DnsLabels { request_protocol: transport.as_str() };
        let upstreams = self.upstreams.addrs();
        let share = QUERY_TIMEOUT / u32::try_from(upstreams.len().max(1)).unwrap_or(u32::MAX);
        for (index, upstream) in upstreams.iter().enumerate() {
            self.metrics.upstream_requests.get_or_create(&labels).inc();
            let exchange = async {
                match via {
                    Via::Udp => match &self.udp[index] {
                        Ok(upstream) => upstream.exchange(query).await,
                        Err(unusable) => Err(io::Error::other(unusable.to_string())),
                    },
                    Via::Tcp(channels) => channels.exchange(&self.netns, index, *upstream, query).await,
                }
            };
            match tokio::time::timeout(share, exchange).await {
                Ok(Ok(answer)) => {
                    tracing::debug!(uid = self.uid, %upstream, ?transport, "dns answer relayed");
                    return Some(answer);
                }
                Ok(Err(error)) => tracing::debug!(uid = self.uid, %upstream, ?transport, %error, "dns upstream failed"),
                Err(_) => tracing::debug!(uid = self.uid, %upstream, ?transport, ?share, "dns upstream timed out"),
            }
            self.metrics.upstream_failures.get_or_create(&labels).inc();
        }
        if let Some(suppressed) = self.log.admit("servfail") {
            tracing::info!(uid = self.uid, ?transport, suppressed, "no dns upstream answered: SERVFAIL");
        }
        Some(fallback)
    }
}

/// An answer on its way back to a UDP client, holding its query's in-flight slot until it is sent.
type UdpAnswer = Box<(Vec<u8>, SocketAddr, InFlight)>;

/// Serves UDP queries on `socket` until the task is aborted. Each admitted query is resolved on its own task;
/// answers come back through a channel, so aborting this task closes the socket at once.
///
/// An idle pod's forwarder holds no receive buffer (one is allocated per datagram, once the socket is readable)
/// and a small channel (its items are boxed): thousands of pods that ask nothing cost little (BENCHMARKS.md,
/// node-scale).
pub async fn serve_udp(forwarder: Arc<Forwarder>, socket: UdpSocket) {
    // Never full: every answer in it holds one of the pod's in-flight slots.
    let (tx, mut rx) = mpsc::channel::<UdpAnswer>(MAX_IN_FLIGHT);
    loop {
        tokio::select! {
            readable = socket.readable() => {
                if let Err(error) = readable {
                    tracing::debug!(uid = forwarder.uid, %error, "dns udp socket not readable");
                    continue;
                }
                // One byte more than a query may have, to tell an oversized one.
                let mut buf = vec![0; MAX_UDP_PAYLOAD + 1];
                match socket.try_recv_from(&mut buf) {
                    Ok((n, client)) => {
                        if let Some(in_flight) = forwarder.admit(Transport::Udp, &buf[..n]) {
                            // Sized to the query: it may wait for its answer for seconds.
                            let mut query = buf[..n].to_vec();
                            let limit = wire::udp_answer_limit(&query);
                            wire::clamp_edns_payload_size(&mut query);
                            let (forwarder, tx) = (forwarder.clone(), tx.clone());
                            tokio::spawn(async move {
                                if let Some(answer) = forwarder.resolve(&query, Via::Udp).await {
                                    let answer = Box::new((wire::fit_udp_answer(answer, limit), client, in_flight));
                                    let _ = tx.send(answer).await;
                                }
                            });
                        }
                    }
                    Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(error) => tracing::debug!(uid = forwarder.uid, %error, "dns udp receive failed"),
                }
            },
            Some(answer) = rx.recv() => {
                let (answer, client, _in_flight) = *answer;
                if let Err(error) = socket.send_to(&answer, client).await {
                    tracing::debug!(uid = forwarder.uid, %client, %error, "dns udp answer not sent");
                }
            }
        }
    }
}

/// Serves one client TCP connection: length-prefixed queries, up to [`MAX_TCP_PIPELINE`] resolved at once,
/// answers written as they arrive. Ends when the client closes (after the pending answers) or idles. Reset at once
/// when the pod already has [`MAX_TCP_CONNECTIONS`] open.
pub async fn serve_tcp(forwarder: Arc<Forwarder>, stream: TcpStream, client: SocketAddr) {
    let Ok(_connection) = forwarder.tcp_connections.clone().try_acquire_owned() else {
        forwarder.dropped(Transport::Tcp, DropReason::TcpConnectionLimit);
        sockets::reset(stream);
        return;
    };
    let (mut reader, mut writer) = stream.into_split();
    let upstreams = Arc::new(TcpUpstreams::new(forwarder.upstreams.addrs().len()));
    let pipeline = Arc::new(Semaphore::new(MAX_TCP_PIPELINE));
    // Never full: every answer in it holds one of the connection's pipeline slots.
    let (tx, mut rx) = mpsc::channel::<(Vec<u8>, OwnedSemaphorePermit, InFlight)>(MAX_TCP_PIPELINE);
    let uid = forwarder.uid.clone();
    let read_queries = async move {
        // A slot first: with the pipeline full, the next query stays unread in the socket.
        while let Ok(slot) = pipeline.clone().acquire_owned().await {
            if tx.is_closed() {
                break; // the answers can no longer be written
            }
            let query = match tokio::time::timeout(TCP_IDLE_TIMEOUT, read_frame(&mut reader, MAX_UDP_PAYLOAD)).await {
                Ok(Ok(Some(query))) => query,
                Ok(Ok(None)) | Err(_) => break,
                Ok(Err(error)) if error.kind() == io::ErrorKind::InvalidData => {
                    forwarder.dropped(Transport::Tcp, DropReason::Oversized);
                    break;
                }
                Ok(Err(error)) => {
                    tracing::debug!(uid, %client, %error, "dns tcp read failed");
                    break;
                }
            };
            let Some(in_flight) = forwarder.admit(Transport::Tcp, &query) else { continue };
            let (forwarder, upstreams, tx) = (forwarder.clone(), upstreams.clone(), tx.clone());
            tokio::spawn(async move {
                if let Some(answer) = forwarder.resolve(&query, Via::Tcp(&upstreams)).await {
                    let _ = tx.send((answer, slot, in_flight)).await;
                }
            });
        }
    };
    // A client that stops reading its answers is cut off after the idle timeout, giving its slots back.
    let write_answers = async move {
        while let Some((answer, _slot, _in_flight)) = rx.recv().await {
            if !matches!(tokio::time::timeout(TCP_IDLE_TIMEOUT, write_frame(&mut writer, &answer)).await, Ok(Ok(()))) {
                return;
            }
        }
        let _ = writer.shutdown().await;
    };
    tokio::join!(read_queries, write_answers);
}

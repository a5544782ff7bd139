//! The in-pod DNS forwarder on [`ports::DNS`]. The in-pod rules redirect the pod's DNS (UDP and TCP port 53)
//! here by default, so without it an enrolled pod cannot resolve names. Each query is relayed to the upstream
//! resolvers from inside the pod netns (source: the pod IP; the proxy mark [`PROXY_MARK`], so the rules do not
//! capture it again), and the answer goes back. A query no upstream answers in time gets SERVFAIL instead of
//! silence, so clients fail fast rather than retrying into their own timeouts.
//!
//! Everything a pod can make the forwarder hold is bounded per pod, so one pod flooding it cannot starve others:
//! - At most [`MAX_IN_FLIGHT`] queries of a pod are in flight (UDP and TCP together, from admission until the
//!   answer is handed back); more are dropped and counted. A slot comes back when its query is answered, or after
//!   [`QUERY_TIMEOUT`] at the latest.
//! - Upstream sockets are reused. Each pod has one connected UDP socket per upstream, made with the pod on its
//!   socket thread ([`PodNetns`]); every UDP query of the pod goes through it with its id remapped to a
//!   random free one, and an answer is taken only from that upstream, with that id and echoing the question. Over
//!   TCP, each client connection gets one upstream connection per upstream, carrying all of its queries the same
//!   way.
//! - Buffers are sized to messages: a query is at most [`MAX_UDP_PAYLOAD`] bytes, and a UDP answer is relayed up
//!   to the size its query allows (the EDNS0 UDP payload size, at most [`MAX_UDP_PAYLOAD`]; 512 without EDNS). A
//!   longer one is cut to its question with TC set, so the client retries over TCP.
//! - At most [`MAX_TCP_CONNECTIONS`] client TCP connections per pod (more are reset at once), each with at most
//!   [`MAX_TCP_PIPELINE`] queries in flight: the connection is not read further until one of them is answered.
//!
//! Messages are opaque bytes except for the header (id, QR, TC, RCODE, counts), the question section (compared
//! and echoed) and the OPT record's UDP payload size (read, and lowered to [`MAX_UDP_PAYLOAD`] when larger).

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use istio_contract::ports;
use istio_contract::proxy::PROXY_MARK;
use nix::sys::socket::{bind, setsockopt, socket, sockopt, AddressFamily, SockFlag, SockType, SockaddrStorage};
use prometheus_client::metrics::gauge::Gauge;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::{TcpStream, UdpSocket};
use tokio::sync::{mpsc, oneshot, OnceCell, OwnedSemaphorePermit, Semaphore};
use tokio::task::AbortHandle;

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
/// The largest UDP message relayed either way, and the largest query taken over any transport. A query's larger
/// EDNS0 UDP payload size is lowered to it, so upstreams do not send more.
pub const MAX_UDP_PAYLOAD: usize = 4096;
/// The UDP answer size every client takes (RFC 1035), and the least an EDNS0 payload size means (RFC 6891).
const MIN_UDP_PAYLOAD: usize = 512;
/// How long a client TCP connection may sit idle between queries.
const TCP_IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// Port of an upstream given without one.
const DEFAULT_UPSTREAM_PORT: u16 = 53;
/// Size of the DNS message header.
const HEADER_LEN: usize = 12;
/// RCODE of SERVFAIL.
const RCODE_SERVFAIL: u8 = 2;
/// The QR (response) flag in header byte 2.
const FLAG_QR: u8 = 0x80;
/// The TC (truncated) flag in header byte 2.
const FLAG_TC: u8 = 0x02;
/// The type of the EDNS0 OPT pseudo-record.
const TYPE_OPT: u16 = 41;

/// Why the upstream resolvers could not be determined.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamsError {
    /// The host's resolver configuration could not be read.
    #[error("reading {path}: {source}")]
    ResolvConf {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
}

/// The upstream resolvers every pod's forwarder relays to, tried in order.
#[derive(Debug, Clone)]
pub struct Upstreams(Arc<[SocketAddr]>);

impl Upstreams {
    /// `configured` (`DNS_UPSTREAMS`) when given, otherwise the nameservers of the host's `resolv_conf`.
    pub fn new(configured: &[SocketAddr], resolv_conf: &Path) -> Result<Self, UpstreamsError> {
        if !configured.is_empty() {
            return Ok(Upstreams(configured.into()));
        }
        let text = std::fs::read_to_string(resolv_conf)
            .map_err(|source| UpstreamsError::ResolvConf { path: resolv_conf.to_path_buf(), source })?;
        Ok(Upstreams(nameservers(&text).into()))
    }

    /// The resolvers, in the order they are tried.
    pub fn addrs(&self) -> &[SocketAddr] {
        &self.0
    }
}

/// Parses one `DNS_UPSTREAMS` entry: `ip`, `ip:port` or `[ipv6]:port`; the port defaults to 53.
pub fn parse_upstream(text: &str) -> Result<SocketAddr, String> {
    let text = text.trim();
    text.parse::<SocketAddr>()
        .or_else(|_| text.parse::<IpAddr>().map(|ip| SocketAddr::new(ip, DEFAULT_UPSTREAM_PORT)))
        .map_err(|_| format!("{text:?} is not an ip or ip:port"))
}

/// The `nameserver` addresses of a resolv.conf text, on port 53. Scoped IPv6 addresses (`fe80::1%eth0`) are
/// skipped: the scope names a host interface that does not exist in the pod.
fn nameservers(resolv_conf: &str) -> Vec<SocketAddr> {
    resolv_conf
        .lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            (words.next()? == "nameserver").then_some(())?;
            let ip: IpAddr = words.next()?.parse().ok()?;
            Some(SocketAddr::new(ip, DEFAULT_UPSTREAM_PORT))
        })
        .collect()
}

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

/// The SERVFAIL answer to `query`: a copy of it with QR set, RCODE 2 and only the CD flag kept. `None` when
/// `query` is shorter than a header (there is no id to answer to).
pub fn servfail(query: &[u8]) -> Option<Vec<u8>> {
    if query.len() < HEADER_LEN {
        return None;
    }
    let mut answer = query.to_vec();
    // Byte 2: QR | OPCODE(4) | AA | TC | RD. Keep OPCODE and RD, set QR, clear AA and TC.
    answer[2] = (answer[2] & 0x79) | FLAG_QR;
    // Byte 3: RA | Z | AD | CD | RCODE(4). Keep CD.
    answer[3] = (answer[3] & 0x10) | RCODE_SERVFAIL;
    Some(answer)
}

/// The transaction id of a message at least 2 bytes long.
fn id_of(message: &[u8]) -> u16 {
    u16::from_be_bytes([message[0], message[1]])
}

/// The 16-bit header field at `at` (QDCOUNT 4, ANCOUNT 6, NSCOUNT 8, ARCOUNT 10) of a message with a full header.
fn header_count(message: &[u8], at: usize) -> usize {
    usize::from(u16::from_be_bytes([message[at], message[at + 1]]))
}

/// Where the domain name starting at `pos` ends (just past its last label or its compression pointer); `None`
/// when it runs off the message or uses a reserved label type.
fn skip_name(message: &[u8], mut pos: usize) -> Option<usize> {
    // A name has at most 127 labels; a longer one is not a name.
    for _ in 0..128 {
        let len = *message.get(pos)?;
        match len & 0xc0 {
            0x00 if len == 0 => return Some(pos + 1),
            0x00 => pos += 1 + usize::from(len),
            0xc0 => return message.get(pos + 1).map(|_| pos + 2),
            _ => return None,
        }
    }
    None
}

/// Where the question section of a message with a full header ends; `None` when it does not parse.
fn question_end(message: &[u8]) -> Option<usize> {
    let mut pos = HEADER_LEN;
    for _ in 0..header_count(message, 4) {
        pos = skip_name(message, pos)? + 4;
    }
    (pos <= message.len()).then_some(pos)
}

/// The question section of a message with a full header (empty when it does not parse).
fn question_of(message: &[u8]) -> &[u8] {
    question_end(message).map_or(&[], |end| &message[HEADER_LEN..end])
}

/// The offset of the OPT record's CLASS field (the requestor's UDP payload size) in a message with a full header;
/// `None` without one, or when the message does not parse that far.
fn opt_payload_size_at(message: &[u8]) -> Option<usize> {
    let mut pos = question_end(message)?;
    let additional_from = header_count(message, 6) + header_count(message, 8);
    // Each record takes at least 11 bytes, so a message of at most MAX_UDP_PAYLOAD bytes ends this loop early.
    for index in 0..additional_from + header_count(message, 10) {
        let fixed = skip_name(message, pos)?;
        let rr = message.get(fixed..fixed + 10)?;
        if index >= additional_from && u16::from_be_bytes([rr[0], rr[1]]) == TYPE_OPT {
            return Some(fixed + 2);
        }
        pos = fixed + 10 + usize::from(u16::from_be_bytes([rr[8], rr[9]]));
    }
    None
}

/// The largest UDP answer the client of `query` takes: its EDNS0 UDP payload size (at least 512), at most
/// [`MAX_UDP_PAYLOAD`]; 512 without EDNS.
fn udp_answer_limit(query: &[u8]) -> usize {
    let size = opt_payload_size_at(query).map(|at| usize::from(u16::from_be_bytes([query[at], query[at + 1]])));
    size.unwrap_or(MIN_UDP_PAYLOAD).clamp(MIN_UDP_PAYLOAD, MAX_UDP_PAYLOAD)
}

/// Lowers the EDNS0 UDP payload size of `query` to [`MAX_UDP_PAYLOAD`] when it is larger, so the upstream does not
/// answer with more than the forwarder relays.
fn clamp_edns_payload_size(query: &mut [u8]) {
    if let Some(at) = opt_payload_size_at(query) {
        if usize::from(u16::from_be_bytes([query[at], query[at + 1]])) > MAX_UDP_PAYLOAD {
            query[at..at + 2].copy_from_slice(&(MAX_UDP_PAYLOAD as u16).to_be_bytes());
        }
    }
}

/// `answer` as a UDP client taking at most `limit` bytes may get it: unchanged when it fits, otherwise its header
/// and question with TC set and no records (the header alone when the question does not fit), so the client
/// asks again over TCP.
fn fit_udp_answer(answer: Vec<u8>, limit: usize) -> Vec<u8> {
    if answer.len() <= limit || answer.len() < HEADER_LEN {
        return answer;
    }
    let end = question_end(&answer).filter(|end| *end <= limit);
    let mut cut = answer[..end.unwrap_or(HEADER_LEN)].to_vec();
    cut[2] |= FLAG_TC;
    if end.is_none() {
        cut[4..6].fill(0);
    }
    cut[6..HEADER_LEN].fill(0);
    cut
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

/// Aborts a task when dropped: ties an upstream socket's reader to the forwarder or connection that owns it.
#[derive(Debug)]
struct AbortOnDrop(AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The queries sent on one upstream socket or connection and not answered yet, by the id they were sent with.
/// Its size is bounded by the in-flight slots of the pod that sends on it.
#[derive(Debug)]
struct Pending {
    state: Mutex<PendingState>,
    /// Keys the id choice, so the ids sent upstream cannot be predicted.
    ids: RandomState,
}

#[derive(Debug, Default)]
struct PendingState {
    waiters: HashMap<u16, Waiter>,
    /// Set when the connection is gone: nothing more is registered.
    closed: bool,
    /// Registrations so far: tells a registration from a later one that reused its id.
    registered: u64,
}

#[derive(Debug)]
struct Waiter {
    registration: u64,
    /// The id the client chose, put back into the answer.
    client_id: u16,
    /// The query's question section, which the answer must echo (unchecked when empty: it did not parse).
    question: Box<[u8]>,
    answer: oneshot::Sender<Vec<u8>>,
}

impl Pending {
    fn new() -> Arc<Self> {
        Arc::new(Pending { state: Mutex::default(), ids: RandomState::new() })
    }

    fn lock(&self) -> MutexGuard<'_, PendingState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Registers `query` (at least a header long) under a random id no other pending query has. Returns the query
    /// as it is to be sent (with that id) and the registration; `None` once the connection is closed.
    fn register(self: &Arc<Self>, query: &[u8]) -> Option<(Vec<u8>, Waiting)> {
        let mut state = self.lock();
        if state.closed || state.waiters.len() > usize::from(u16::MAX) {
            return None;
        }
        let registration = state.registered;
        state.registered += 1;
        // Few of the 65536 ids are taken (a pod's in-flight slots bound them), so a probe or two finds a free one.
        let id = (0u64..)
            .map(|probe| self.ids.hash_one((registration, probe)) as u16)
            .find(|id| !state.waiters.contains_key(id))?;
        let (answer, receiver) = oneshot::channel();
        let waiter = Waiter { registration, client_id: id_of(query), question: question_of(query).into(), answer };
        state.waiters.insert(id, waiter);
        let mut sent = query.to_vec();
        sent[..2].copy_from_slice(&id.to_be_bytes());
        Some((sent, Waiting { pending: self.clone(), id, registration, answer: receiver }))
    }

    /// Hands `answer` to the query it answers: the one pending under its id, when it echoes that query's question
    /// (or has none, as some error answers do). Anything else (a late answer to a query that gave up, a stray or
    /// forged message) is dropped.
    fn deliver(&self, mut answer: Vec<u8>) {
        if answer.len() < HEADER_LEN || answer[2] & FLAG_QR == 0 {
            return;
        }
        let id = id_of(&answer);
        let waiter = {
            let mut state = self.lock();
            let Some(waiter) = state.waiters.get(&id) else { return };
            let echoes = header_count(&answer, 4) == 0
                || waiter.question.is_empty()
                || question_of(&answer).eq_ignore_ascii_case(&waiter.question);
            if !echoes {
                return;
            }
            state.waiters.remove(&id)
        };
        if let Some(waiter) = waiter {
            answer[..2].copy_from_slice(&waiter.client_id.to_be_bytes());
            let _ = waiter.answer.send(answer);
        }
    }

    /// Fails every pending query: their exchanges return an error at once (the upstream refused them).
    fn fail_all(&self) {
        self.lock().waiters.clear();
    }

    /// Fails every pending query and registers no more: the connection is gone.
    fn close(&self) {
        let mut state = self.lock();
        state.closed = true;
        state.waiters.clear();
    }

    fn is_closed(&self) -> bool {
        self.lock().closed
    }
}

/// A query waiting for its answer; unregisters it when dropped (answered, failed, or given up on at a timeout).
#[derive(Debug)]
struct Waiting {
    pending: Arc<Pending>,
    id: u16,
    registration: u64,
    answer: oneshot::Receiver<Vec<u8>>,
}

impl Waiting {
    /// The answer, with the client's id; an error when the socket or connection failed first.
    async fn answer(&mut self) -> io::Result<Vec<u8>> {
        (&mut self.answer).await.map_err(|_| io::Error::new(io::ErrorKind::ConnectionAborted, "upstream failed"))
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        let mut state = self.pending.lock();
        if state.waiters.get(&self.id).is_some_and(|w| w.registration == self.registration) {
            state.waiters.remove(&self.id);
        }
    }
}

/// One upstream's UDP socket in one pod: created with the pod, connected (and its reader started) at first use.
#[derive(Debug)]
struct UdpUpstream {
    addr: SocketAddr,
    socket: Arc<UdpSocket>,
    pending: Arc<Pending>,
    /// The reader, once connected; aborted when the forwarder goes.
    reader: OnceCell<AbortOnDrop>,
}

impl UdpUpstream {
    /// Sends `query` under a fresh id and waits for its answer.
    async fn exchange(&self, query: &[u8]) -> io::Result<Vec<u8>> {
        self.reader
            .get_or_try_init(|| async {
                // The socket's namespace is the one it was created in, whatever thread connects it.
                self.socket.connect(self.addr).await?;
                let reader = tokio::spawn(read_udp_answers(self.socket.clone(), self.pending.clone()));
                Ok::<_, io::Error>(AbortOnDrop(reader.abort_handle()))
            })
            .await?;
        let (sent, mut waiting) = self.pending.register(query).ok_or_else(|| io::Error::other("no free query id"))?;
        self.socket.send(&sent).await?;
        waiting.answer().await
    }
}

/// Hands every answer arriving on an upstream UDP socket to its query, until aborted. A receive error (the
/// upstream's port is closed: ICMP port unreachable) fails the queries pending on it, so they move on to the next
/// upstream at once.
async fn read_udp_answers(socket: Arc<UdpSocket>, pending: Arc<Pending>) {
    // One datagram more than is ever relayed: a longer one is cut to its question anyway.
    let mut buf = vec![0; MAX_UDP_PAYLOAD + 1];
    loop {
        match socket.recv(&mut buf).await {
            Ok(n) => pending.deliver(buf[..n].to_vec()),
            Err(error) => {
                tracing::debug!(%error, "dns upstream udp receive failed");
                pending.fail_all();
                // Such errors come once per ICMP message; the pause only keeps a stream of them from spinning.
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
}

/// One upstream TCP connection of one client connection: every query of the client to that upstream goes over
/// it, pipelined under fresh ids.
#[derive(Debug)]
struct TcpChannel {
    writer: tokio::sync::Mutex<OwnedWriteHalf>,
    pending: Arc<Pending>,
    _reader: AbortOnDrop,
}

impl TcpChannel {
    fn start(stream: TcpStream) -> Arc<Self> {
        let (mut reader, writer) = stream.into_split();
        let pending = Pending::new();
        let answers = pending.clone();
        let reader = tokio::spawn(async move {
            while let Ok(Some(answer)) = read_frame(&mut reader, usize::from(u16::MAX)).await {
                answers.deliver(answer);
            }
            answers.close();
        });
        Arc::new(TcpChannel {
            writer: tokio::sync::Mutex::new(writer),
            pending,
            _reader: AbortOnDrop(reader.abort_handle()),
        })
    }

    /// Sends `query` under a fresh id and waits for its answer. A write that fails or is given up on midway
    /// closes the channel (the stream would be out of frame).
    async fn exchange(&self, query: &[u8]) -> io::Result<Vec<u8>> {
        let closed = || io::Error::new(io::ErrorKind::ConnectionAborted, "upstream connection closed");
        let (sent, mut waiting) = self.pending.register(query).ok_or_else(closed)?;
        {
            let mut writer = self.writer.lock().await;
            let mut unfinished = CloseUnlessFinished { pending: &self.pending, finished: false };
            write_frame(&mut *writer, &sent).await?;
            unfinished.finished = true;
        }
        waiting.answer().await
    }
}

/// Closes a [`Pending`] when dropped before `finished` is set: a frame was written in part.
struct CloseUnlessFinished<'a> {
    pending: &'a Pending,
    finished: bool,
}

impl Drop for CloseUnlessFinished<'_> {
    fn drop(&mut self) {
        if !self.finished {
            self.pending.close();
        }
    }
}

/// The upstream TCP connections of one client connection, one slot per upstream, each opened at first use.
#[derive(Debug)]
struct TcpUpstreams {
    channels: Vec<tokio::sync::Mutex<Option<Arc<TcpChannel>>>>,
}

impl TcpUpstreams {
    fn new(upstreams: usize) -> Self {
        TcpUpstreams { channels: (0..upstreams).map(|_| tokio::sync::Mutex::new(None)).collect() }
    }

    /// Sends `query` to upstream `index` (at `addr`) and waits for its answer. A connection already used may have
    /// been closed by the upstream meanwhile: then the query is tried once more on a new one.
    async fn exchange(&self, netns: &PodNetns, index: usize, addr: SocketAddr, query: &[u8]) -> io::Result<Vec<u8>> {
        let (channel, fresh) = self.channel(netns, index, addr).await?;
        match channel.exchange(query).await {
            Err(_) if !fresh => self.channel(netns, index, addr).await?.0.exchange(query).await,
            result => result,
        }
    }

    /// The open connection to upstream `index`, or a new one; `true` when new.
    async fn channel(&self, netns: &PodNetns, index: usize, addr: SocketAddr) -> io::Result<(Arc<TcpChannel>, bool)> {
        let mut slot = self.channels[index].lock().await;
        if let Some(channel) = slot.as_ref().filter(|channel| !channel.pending.is_closed()) {
            return Ok((channel.clone(), false));
        }
        let channel = TcpChannel::start(sockets::connect_in(netns, addr, None).await?);
        *slot = Some(channel.clone());
        Ok((channel, true))
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
            .run(move || Ok(addrs.addrs().iter().map(|addr| marked_udp_socket(addr.ip(), None)).collect::<Vec<_>>()))
            .await?;
        let mut udp = Vec::with_capacity(fds.len());
        for (addr, fd) in upstreams.addrs().iter().zip(fds) {
            udp.push(match fd {
                Ok(fd) => {
                    let socket = Arc::new(UdpSocket::from_std(std::net::UdpSocket::from(fd))?);
                    Ok(UdpUpstream { addr: *addr, socket, pending: Pending::new(), reader: OnceCell::new() })
                }
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
        let fallback = servfail(query)?;
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

/// A non-blocking UDP socket of `ip`'s family with the proxy mark, created in the calling thread's netns; with
/// `listen`, a `SO_REUSEPORT` socket bound there (IPv6 ones v6-only).
fn marked_udp_socket(ip: IpAddr, listen: Option<SocketAddr>) -> io::Result<OwnedFd> {
    let family = if ip.is_ipv4() { AddressFamily::Inet } else { AddressFamily::Inet6 };
    let fd = socket(family, SockType::Datagram, SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK, None)?;
    setsockopt(&fd, sockopt::Mark, &PROXY_MARK)?;
    if let Some(addr) = listen {
        setsockopt(&fd, sockopt::ReuseAddr, &true)?;
        setsockopt(&fd, sockopt::ReusePort, &true)?;
        if addr.is_ipv6() {
            setsockopt(&fd, sockopt::Ipv6V6Only, &true)?;
        }
        bind(fd.as_raw_fd(), &SockaddrStorage::from(addr))?;
    }
    Ok(fd)
}

/// Binds the forwarder's UDP listener on `addr` inside `ns` (on the pod's socket thread).
pub async fn bind_udp(ns: &PodNetns, addr: SocketAddr) -> io::Result<UdpSocket> {
    let fd = ns.run(move || marked_udp_socket(addr.ip(), Some(addr))).await?;
    UdpSocket::from_std(std::net::UdpSocket::from(fd))
}

/// Serves UDP queries on `socket` until the task is aborted. Each admitted query is resolved on its own task;
/// answers come back through a channel, so aborting this task closes the socket at once.
pub async fn serve_udp(forwarder: Arc<Forwarder>, socket: UdpSocket) {
    // Never full: every answer in it holds one of the pod's in-flight slots.
    let (tx, mut rx) = mpsc::channel::<(Vec<u8>, SocketAddr, InFlight)>(MAX_IN_FLIGHT);
    // One byte more than a query may have, to tell an oversized one.
    let mut buf = vec![0; MAX_UDP_PAYLOAD + 1];
    loop {
        tokio::select! {
            received = socket.recv_from(&mut buf) => match received {
                Ok((n, client)) => {
                    if let Some(in_flight) = forwarder.admit(Transport::Udp, &buf[..n]) {
                        let mut query = buf[..n].to_vec();
                        let limit = udp_answer_limit(&query);
                        clamp_edns_payload_size(&mut query);
                        let (forwarder, tx) = (forwarder.clone(), tx.clone());
                        tokio::spawn(async move {
                            if let Some(answer) = forwarder.resolve(&query, Via::Udp).await {
                                let _ = tx.send((fit_udp_answer(answer, limit), client, in_flight)).await;
                            }
                        });
                    }
                }
                Err(error) => tracing::debug!(uid = forwarder.uid, %error, "dns udp receive failed"),
            },
            Some((answer, client, _in_flight)) = rx.recv() => {
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

/// Reads one 2-byte length-prefixed message; `None` at a clean end of stream, an `InvalidData` error for one
/// longer than `max` (left unread).
async fn read_frame<R: AsyncRead + Unpin>(reader: &mut R, max: usize) -> io::Result<Option<Vec<u8>>> {
    let mut len = [0; 2];
    match reader.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = usize::from(u16::from_be_bytes(len));
    if len > max {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("dns message of {len} bytes, over {max}")));
    }
    let mut message = vec![0; len];
    reader.read_exact(&mut message).await?;
    Ok(Some(message))
}

/// Writes `message` with its 2-byte length prefix.
async fn write_frame<W: AsyncWrite + Unpin>(writer: &mut W, message: &[u8]) -> io::Result<()> {
    let len = u16::try_from(message.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "dns message longer than 65535 bytes"))?;
    let mut frame = Vec::with_capacity(2 + message.len());
    frame.extend_from_slice(&len.to_be_bytes());
    frame.extend_from_slice(message);
    writer.write_all(&frame).await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A query for `example.com. A` with id 0xbeef, RD and CD set, and an EDNS OPT record.
    fn query() -> Vec<u8> {
        let mut q = vec![0xbe, 0xef, 0x01, 0x10, 0, 1, 0, 0, 0, 0, 0, 1];
        q.extend_from_slice(b"\x07example\x03com\x00\x00\x01\x00\x01");
        q.extend_from_slice(&[0, 0, 41, 0x04, 0xd0, 0, 0, 0, 0, 0, 0]);
        q
    }

    #[test]
    fn servfail_answers_the_query_with_rcode_2() {
        let q = query();
        let answer = servfail(&q).expect("a full header");
        assert_eq!(answer[..2], [0xbe, 0xef], "same transaction id");
        assert_eq!(answer[2], 0x81, "QR set, OPCODE QUERY, RD kept");
        assert_eq!(answer[3], 0x12, "CD kept, RCODE SERVFAIL");
        assert_eq!(answer[4..], q[4..], "counts and question echoed unchanged");
    }

    #[test]
    fn servfail_clears_flags_a_query_should_not_carry() {
        let mut q = query();
        q[2] = 0x7f; // every flag but QR in byte 2
        q[3] = 0xff;
        let answer = servfail(&q).expect("a full header");
        assert_eq!(answer[2], 0xf9, "QR and OPCODE/RD set, AA and TC cleared");
        assert_eq!(answer[3], 0x12, "RA, Z, AD cleared; CD kept; RCODE 2");
    }

    /// `query()` with the OPT record's UDP payload size set to `size`.
    fn query_with_edns(size: u16) -> Vec<u8> {
        let mut q = query();
        let at = q.len() - 11 + 3;
        q[at..at + 2].copy_from_slice(&size.to_be_bytes());
        q
    }

    /// `query()` without its OPT record.
    fn query_without_edns() -> Vec<u8> {
        let mut q = query();
        q.truncate(q.len() - 11);
        q[11] = 0;
        q
    }

    /// An answer to `query` (its question echoed, id `id`) with one A record whose data is `rdata_len` bytes.
    fn answer_to(query: &[u8], id: u16, rdata_len: u16) -> Vec<u8> {
        let end = question_end(query).unwrap();
        let mut a = id.to_be_bytes().to_vec();
        a.extend_from_slice(&[0x81, 0x80, 0, 1, 0, 1, 0, 0, 0, 0]);
        a.extend_from_slice(&query[HEADER_LEN..end]);
        a.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1, 0, 0, 0, 60]);
        a.extend_from_slice(&rdata_len.to_be_bytes());
        a.extend(std::iter::repeat_n(7, usize::from(rdata_len)));
        a
    }

    #[test]
    fn udp_answer_limit_is_the_edns_size_between_512_and_4_kib() {
        assert_eq!(udp_answer_limit(&query()), 1232, "the OPT record's payload size");
        assert_eq!(udp_answer_limit(&query_without_edns()), 512, "512 without EDNS");
        assert_eq!(udp_answer_limit(&query_with_edns(100)), 512, "sizes below 512 mean 512");
        assert_eq!(udp_answer_limit(&query_with_edns(65535)), MAX_UDP_PAYLOAD, "at most 4 KiB");
        let mut garbled = query();
        garbled.truncate(20);
        assert_eq!(udp_answer_limit(&garbled), 512, "a question that does not parse: 512");
    }

    #[test]
    fn a_larger_edns_size_is_lowered_to_4_kib_and_others_left_alone() {
        let mut q = query_with_edns(65535);
        clamp_edns_payload_size(&mut q);
        assert_eq!(q, query_with_edns(4096));
        let mut q = query();
        clamp_edns_payload_size(&mut q);
        assert_eq!(q, query(), "1232 is kept");
        let mut q = query_without_edns();
        clamp_edns_payload_size(&mut q);
        assert_eq!(q, query_without_edns(), "no OPT record, nothing changed");
    }

    #[test]
    fn the_opt_record_is_found_after_answer_records() {
        let q = query();
        let mut message = answer_to(&q, 1, 40);
        message[11] = 1; // ARCOUNT
        message.extend_from_slice(&[0, 0, 41, 0x02, 0x00, 0, 0, 0, 0, 0, 0]);
        assert_eq!(udp_answer_limit(&message), 512);
        let at = opt_payload_size_at(&message).expect("the OPT record");
        assert_eq!(message[at..at + 2], [0x02, 0x00]);
    }

    #[test]
    fn an_answer_too_long_for_the_client_is_cut_to_its_question_with_tc() {
        let q = query();
        let fits = answer_to(&q, 0xbeef, 100);
        assert_eq!(fit_udp_answer(fits.clone(), 512), fits, "an answer that fits is relayed unchanged");
        let long = answer_to(&q, 0xbeef, 600);
        let cut = fit_udp_answer(long.clone(), 512);
        assert_eq!(cut.len(), question_end(&q).unwrap(), "header and question only");
        assert_eq!(cut[..2], [0xbe, 0xef], "same id");
        assert_eq!(cut[2], long[2] | FLAG_TC, "TC set, other flags kept");
        assert_eq!(cut[3], long[3], "RCODE kept");
        assert_eq!(cut[4..6], [0, 1], "the question is kept");
        assert_eq!(cut[6..12], [0; 6], "no records");
        assert_eq!(cut[HEADER_LEN..], q[HEADER_LEN..question_end(&q).unwrap()]);
        let mut upstream_tc = fits.clone();
        upstream_tc[2] |= FLAG_TC;
        assert_eq!(fit_udp_answer(upstream_tc.clone(), 512), upstream_tc, "an upstream's TC is relayed as is");
    }

    #[test]
    fn pending_queries_get_distinct_ids_and_their_answers_with_the_clients_id() {
        let pending = Pending::new();
        let q = query();
        let (sent_a, mut a) = pending.register(&q).expect("registered");
        let (sent_b, mut b) = pending.register(&q).expect("registered");
        assert_ne!(id_of(&sent_a), id_of(&sent_b), "two queries with the same client id are told apart");
        assert_eq!(sent_a[2..], q[2..], "only the id is changed");
        pending.deliver(answer_to(&q, id_of(&sent_b), 4));
        let answer = b.answer.try_recv().expect("b answered");
        assert_eq!(answer, answer_to(&q, 0xbeef, 4), "with the client's id back");
        assert!(a.answer.try_recv().is_err(), "a still waits");
        pending.deliver(answer_to(&q, id_of(&sent_b), 4));
        assert!(a.answer.try_recv().is_err(), "a second answer to b goes nowhere");
        drop(b);
        assert_eq!(pending.lock().waiters.len(), 1);
        drop(a);
        assert!(pending.lock().waiters.is_empty(), "a query that gives up is forgotten");
    }

    #[test]
    fn an_answer_must_echo_the_question_and_be_a_response() {
        let pending = Pending::new();
        let q = query();
        let (sent, mut waiting) = pending.register(&q).expect("registered");
        let mut other = answer_to(&q, id_of(&sent), 4);
        other[HEADER_LEN + 1] = b'X'; // another name
        pending.deliver(other);
        let mut not_a_response = answer_to(&q, id_of(&sent), 4);
        not_a_response[2] &= !FLAG_QR;
        pending.deliver(not_a_response);
        assert!(waiting.answer.try_recv().is_err(), "neither is taken as the answer");
        let mut upper = answer_to(&q, id_of(&sent), 4);
        upper[HEADER_LEN + 1..HEADER_LEN + 8].make_ascii_uppercase();
        pending.deliver(upper);
        assert!(waiting.answer.try_recv().is_ok(), "names compare case-insensitively");
    }

    #[test]
    fn failing_or_closing_ends_every_wait() {
        let pending = Pending::new();
        let (_, mut a) = pending.register(&query()).expect("registered");
        pending.fail_all();
        assert!(a.answer.try_recv().is_err_and(|e| e == oneshot::error::TryRecvError::Closed));
        assert!(pending.register(&query()).is_some(), "a UDP socket takes queries after a failure");
        pending.close();
        assert!(pending.register(&query()).is_none(), "a closed connection takes none");
    }

    #[test]
    fn a_late_waiter_does_not_unregister_a_later_query_with_its_id() {
        let pending = Pending::new();
        let (sent, first) = pending.register(&query()).expect("registered");
        let id = id_of(&sent);
        // Answered: the waiter is gone from the table, but `first` is not dropped yet.
        pending.deliver(answer_to(&query(), id, 4));
        let later = Waiter { registration: 99, client_id: 1, question: Box::default(), answer: oneshot::channel().0 };
        pending.lock().waiters.insert(id, later);
        drop(first);
        assert!(pending.lock().waiters.contains_key(&id), "the later registration stays");
    }

    #[test]
    fn servfail_needs_a_header() {
        assert_eq!(servfail(&[0xbe, 0xef, 1]), None);
    }

    #[test]
    fn upstreams_parse_with_and_without_port() {
        assert_eq!(parse_upstream("10.0.0.2"), Ok(SocketAddr::from(([10, 0, 0, 2], 53))));
        assert_eq!(parse_upstream(" 10.0.0.2:5353"), Ok(SocketAddr::from(([10, 0, 0, 2], 5353))));
        assert_eq!(parse_upstream("fd00::1"), Ok("[fd00::1]:53".parse().unwrap()));
        assert_eq!(parse_upstream("[fd00::1]:54"), Ok("[fd00::1]:54".parse().unwrap()));
        assert!(parse_upstream("resolver.local").is_err());
    }

    #[test]
    fn resolv_conf_nameservers_in_order() {
        let text = "# generated\nsearch svc.cluster.local\nnameserver 10.0.0.2\nnameserver fe80::1%eth0\n\
                    options ndots:5\nnameserver  fd00::53 \n";
        assert_eq!(nameservers(text), vec![SocketAddr::from(([10, 0, 0, 2], 53)), "[fd00::53]:53".parse().unwrap()]);
    }
}

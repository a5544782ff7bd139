//! The in-pod DNS forwarder on [`ports::DNS`]. The in-pod rules redirect the pod's DNS (UDP and TCP port 53)
//! here by default, so without it an enrolled pod cannot resolve names. Each query is relayed unchanged to the
//! upstream resolvers from inside the pod netns (source: the pod IP; the proxy mark [`PROXY_MARK`], so the rules
//! do not capture it again), and the answer goes back unchanged. A query no upstream answers in time gets
//! SERVFAIL instead of silence, so clients fail fast rather than retrying into their own timeouts.
//!
//! Messages are opaque bytes except for the 12-byte header fields read or set here (id, QR, RCODE).

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use istio_contract::ports;
use istio_contract::proxy::PROXY_MARK;
use netns::Netns;
use nix::sys::socket::{bind, setsockopt, socket, sockopt, AddressFamily, SockFlag, SockType, SockaddrStorage};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpStream, UdpSocket};
use tokio::sync::mpsc;

use crate::sockets;

/// How long one query may take across all upstreams before the client gets SERVFAIL.
pub const QUERY_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a client TCP connection may sit idle between queries.
const TCP_IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// Port of an upstream given without one.
const DEFAULT_UPSTREAM_PORT: u16 = 53;
/// Size of the DNS message header.
const HEADER_LEN: usize = 12;
/// RCODE of SERVFAIL.
const RCODE_SERVFAIL: u8 = 2;

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
    answer[2] = (answer[2] & 0x79) | 0x80;
    // Byte 3: RA | Z | AD | CD | RCODE(4). Keep CD.
    answer[3] = (answer[3] & 0x10) | RCODE_SERVFAIL;
    Some(answer)
}

/// Whether `answer` is a response to `query` (same transaction id, QR set).
fn answers(query: &[u8], answer: &[u8]) -> bool {
    answer.len() >= HEADER_LEN && answer[..2] == query[..2] && answer[2] & 0x80 != 0
}

/// How a query reached the forwarder; it goes upstream the same way, so a truncated UDP answer makes the
/// client retry over TCP end to end.
#[derive(Debug, Clone, Copy)]
enum Transport {
    Udp,
    Tcp,
}

/// One pod's forwarder: where its upstream sockets are created and where they go.
#[derive(Debug)]
pub struct Forwarder {
    uid: String,
    netns: Arc<Netns>,
    upstreams: Upstreams,
}

impl Forwarder {
    /// A forwarder for pod `uid` whose upstream sockets are created in `netns`.
    pub fn new(uid: &str, netns: Arc<Netns>, upstreams: Upstreams) -> Arc<Self> {
        Arc::new(Forwarder { uid: uid.to_owned(), netns, upstreams })
    }

    /// The upstream answer to `query`, or SERVFAIL when no upstream answered within [`QUERY_TIMEOUT`] (each
    /// upstream gets an equal share of it). `None` for a message too short to answer.
    async fn resolve(&self, query: &[u8], transport: Transport) -> Option<Vec<u8>> {
        let fallback = servfail(query)?;
        let upstreams = self.upstreams.addrs();
        let share = QUERY_TIMEOUT / u32::try_from(upstreams.len().max(1)).unwrap_or(u32::MAX);
        for upstream in upstreams {
            let exchange = async {
                match transport {
                    Transport::Udp => self.udp_exchange(*upstream, query).await,
                    Transport::Tcp => self.tcp_exchange(*upstream, query).await,
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
        }
        tracing::info!(uid = self.uid, ?transport, "no dns upstream answered: SERVFAIL");
        Some(fallback)
    }

    /// Sends `query` from a fresh marked socket in the pod netns and waits for the answer with its id.
    async fn udp_exchange(&self, upstream: SocketAddr, query: &[u8]) -> io::Result<Vec<u8>> {
        let socket = udp_socket_in(&self.netns, upstream.ip(), None)?;
        socket.connect(upstream).await?;
        socket.send(query).await?;
        let mut buf = vec![0; usize::from(u16::MAX)];
        loop {
            let n = socket.recv(&mut buf).await?;
            if answers(query, &buf[..n]) {
                buf.truncate(n);
                return Ok(buf);
            }
        }
    }

    /// Sends `query` over a fresh marked TCP connection from the pod netns and reads one answer.
    async fn tcp_exchange(&self, upstream: SocketAddr, query: &[u8]) -> io::Result<Vec<u8>> {
        let mut stream = sockets::connect_in(&self.netns, upstream, None).await?;
        write_frame(&mut stream, query).await?;
        loop {
            let answer = read_frame(&mut stream)
                .await?
                .ok_or_else(|| io::Error::new(io::ErrorKind::UnexpectedEof, "upstream closed before answering"))?;
            if answers(query, &answer) {
                return Ok(answer);
            }
        }
    }
}

fn netns_err(e: netns::NetnsError) -> io::Error {
    io::Error::other(e.to_string())
}

/// A non-blocking UDP socket of `ip`'s family with the proxy mark, created in `ns`; with `listen`, a
/// `SO_REUSEPORT` socket bound there (IPv6 ones v6-only). Must be called within a tokio runtime.
fn udp_socket_in(ns: &Netns, ip: IpAddr, listen: Option<SocketAddr>) -> io::Result<UdpSocket> {
    let fd = ns
        .run(move || -> io::Result<OwnedFd> {
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
        })
        .map_err(netns_err)??;
    UdpSocket::from_std(std::net::UdpSocket::from(fd))
}

/// Binds the forwarder's UDP listener on `addr` inside `ns`.
pub fn bind_udp(ns: &Netns, addr: SocketAddr) -> io::Result<UdpSocket> {
    udp_socket_in(ns, addr.ip(), Some(addr))
}

/// Serves UDP queries on `socket` until the task is aborted. Each query is resolved on its own task; answers
/// come back through a channel, so aborting this task closes the socket at once.
pub async fn serve_udp(forwarder: Arc<Forwarder>, socket: UdpSocket) {
    let (tx, mut rx) = mpsc::channel::<(Vec<u8>, SocketAddr)>(256);
    let mut buf = vec![0; usize::from(u16::MAX)];
    loop {
        tokio::select! {
            received = socket.recv_from(&mut buf) => match received {
                Ok((n, client)) => {
                    let (query, forwarder, tx) = (buf[..n].to_vec(), forwarder.clone(), tx.clone());
                    tokio::spawn(async move {
                        if let Some(answer) = forwarder.resolve(&query, Transport::Udp).await {
                            let _ = tx.send((answer, client)).await;
                        }
                    });
                }
                Err(error) => tracing::debug!(uid = forwarder.uid, %error, "dns udp receive failed"),
            },
            Some((answer, client)) = rx.recv() => {
                if let Err(error) = socket.send_to(&answer, client).await {
                    tracing::debug!(uid = forwarder.uid, %client, %error, "dns udp answer not sent");
                }
            }
        }
    }
}

/// Serves one client TCP connection: length-prefixed queries, any number, resolved concurrently; answers are
/// written as they arrive. Ends when the client closes (after the pending answers) or idles.
pub async fn serve_tcp(forwarder: Arc<Forwarder>, stream: TcpStream, client: SocketAddr) {
    let (mut reader, mut writer) = stream.into_split();
    let (tx, mut rx) = mpsc::channel::<Vec<u8>>(64);
    let uid = forwarder.uid.clone();
    let read_queries = async move {
        loop {
            let query = match tokio::time::timeout(TCP_IDLE_TIMEOUT, read_frame(&mut reader)).await {
                Ok(Ok(Some(query))) => query,
                Ok(Ok(None)) | Err(_) => break,
                Ok(Err(error)) => {
                    tracing::debug!(uid, %client, %error, "dns tcp read failed");
                    break;
                }
            };
            let (forwarder, tx) = (forwarder.clone(), tx.clone());
            tokio::spawn(async move {
                if let Some(answer) = forwarder.resolve(&query, Transport::Tcp).await {
                    let _ = tx.send(answer).await;
                }
            });
        }
    };
    let write_answers = async move {
        while let Some(answer) = rx.recv().await {
            if write_frame(&mut writer, &answer).await.is_err() {
                return;
            }
        }
        let _ = writer.shutdown().await;
    };
    tokio::join!(read_queries, write_answers);
}

/// Reads one 2-byte length-prefixed message; `None` at a clean end of stream.
async fn read_frame<R: AsyncRead + Unpin>(reader: &mut R) -> io::Result<Option<Vec<u8>>> {
    let mut len = [0; 2];
    match reader.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let mut message = vec![0; usize::from(u16::from_be_bytes(len))];
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
        assert!(answers(&q, &answer), "the client accepts it as the answer to its query");
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

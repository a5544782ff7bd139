//! Sockets inside a pod's network namespace: created on the pod's socket thread, which entered the namespace once
//! when the pod's proxy started (a socket belongs to the namespace it was created in), marked so the in-pod rules
//! let them through, then handed to tokio. No runtime worker ever waits for a thread: a request goes to the
//! pod's thread over a channel and the answer comes back on a oneshot. Every socket the proxy opens in a pod is
//! made here, with the mark: TCP listeners and connections, and the DNS forwarder's UDP sockets. Also reads a
//! redirected connection's original destination.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::ops::Deref;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use istio_contract::proxy::PROXY_MARK;
use netns::{Netns, NetnsThread};
use nix::sys::socket::{
    bind, listen, setsockopt, socket, sockopt, AddressFamily, Backlog, SockFlag, SockType, SockaddrStorage,
};
use tokio::net::{TcpListener, TcpSocket, TcpStream, UdpSocket};
use tokio::sync::oneshot;

/// How long an upstream connect may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// The name of each pod's socket thread (as `/proc/<pid>/task/*/comm` shows it).
pub const SOCKET_THREAD: &str = "pod-sockets";

fn netns_err(e: netns::NetnsError) -> io::Error {
    io::Error::other(e.to_string())
}

/// A pod's network namespace and the one long-lived thread that creates the pod's sockets inside it, for as long
/// as the pod's proxy or any of its connections needs one: the thread exits when the last clone is dropped.
/// Derefs to the namespace handle (its id, its path).
#[derive(Debug, Clone)]
pub struct PodNetns {
    netns: Arc<Netns>,
    thread: Arc<NetnsThread>,
}

impl PodNetns {
    /// Starts the pod's socket thread in `netns`. Blocks for as long as spawning a thread and entering the
    /// namespace take: call it off the runtime's workers (`spawn_blocking`).
    pub fn enter(netns: Arc<Netns>) -> io::Result<Self> {
        let thread = netns.spawn_thread(SOCKET_THREAD).map_err(netns_err)?;
        Ok(PodNetns { netns, thread: Arc::new(thread) })
    }

    /// Runs `make` on the pod's socket thread, inside its namespace, and awaits its result without blocking the
    /// runtime. If the caller goes away first, whatever `make` returns is dropped (a socket is closed).
    pub async fn run<T, F>(&self, make: F) -> io::Result<T>
    where
        F: FnOnce() -> io::Result<T> + Send + 'static,
        T: Send + 'static,
    {
        let (reply, answer) = oneshot::channel();
        self.thread
            .execute(move || {
                let _ = reply.send(make());
            })
            .map_err(netns_err)?;
        answer.await.map_err(|_| io::Error::other("the pod's socket thread dropped the request"))?
    }
}

impl Deref for PodNetns {
    type Target = Netns;

    fn deref(&self) -> &Netns {
        &self.netns
    }
}

fn family(ip: IpAddr) -> AddressFamily {
    if ip.is_ipv4() {
        AddressFamily::Inet
    } else {
        AddressFamily::Inet6
    }
}

/// A non-blocking socket of `ip`'s family and type `ty` carrying the proxy mark (the in-pod rules neither
/// capture nor loop its packets), created in the calling thread's netns.
fn marked(ip: IpAddr, ty: SockType) -> io::Result<OwnedFd> {
    let flags = SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK;
    let fd = socket(family(ip), ty, flags, None)?;
    setsockopt(&fd, sockopt::Mark, &PROXY_MARK)?;
    Ok(fd)
}

/// A non-blocking TCP socket of `ip`'s family with the proxy mark, created in the calling thread's netns.
fn marked_socket(ip: IpAddr) -> io::Result<OwnedFd> {
    marked(ip, SockType::Stream)
}

/// A non-blocking UDP socket of `ip`'s family with the proxy mark, unbound, created in the calling thread's
/// netns: call it on a pod's socket thread ([`PodNetns::run`]). The DNS forwarder's upstream sockets.
pub fn marked_udp_socket(ip: IpAddr) -> io::Result<OwnedFd> {
    marked(ip, SockType::Datagram)
}

/// Makes `fd` a `SO_REUSEPORT` socket bound to `addr` (IPv6 ones v6-only), so a proxy taking over from a draining
/// one binds the same address.
fn bind_reusable(fd: &OwnedFd, addr: SocketAddr) -> io::Result<()> {
    setsockopt(fd, sockopt::ReuseAddr, &true)?;
    setsockopt(fd, sockopt::ReusePort, &true)?;
    if addr.is_ipv6() {
        setsockopt(fd, sockopt::Ipv6V6Only, &true)?;
    }
    bind(fd.as_raw_fd(), &SockaddrStorage::from(addr))?;
    Ok(())
}

/// Asks the calling thread's netns to hand connections still queued on a closing `SO_REUSEPORT` listener to
/// another listener of the group (`net.ipv4.tcp_migrate_req`), so a proxy taking over from a draining one loses
/// none. Best effort: where `/proc/sys` is read-only (most containers) the kernel resets them as before.
fn allow_accept_queue_migration() {
    if let Err(e) = std::fs::write("/proc/sys/net/ipv4/tcp_migrate_req", "1") {
        tracing::debug!(error = %e, "cannot enable tcp_migrate_req in the pod netns");
    }
}

/// Binds a marked `SO_REUSEPORT` listener on `addr` inside `ns` (IPv6 listeners are v6-only) and hands it
/// to tokio. Must be called within a tokio runtime.
pub async fn listen_in(ns: &PodNetns, addr: SocketAddr) -> io::Result<TcpListener> {
    let fd = ns
        .run(move || -> io::Result<OwnedFd> {
            allow_accept_queue_migration();
            let fd = marked_socket(addr.ip())?;
            bind_reusable(&fd, addr)?;
            listen(&fd, Backlog::new(1024)?)?;
            Ok(fd)
        })
        .await?;
    TcpListener::from_std(std::net::TcpListener::from(fd))
}

/// Binds a marked `SO_REUSEPORT` UDP socket on `addr` inside `ns` (IPv6 ones v6-only) and hands it to tokio: the
/// DNS forwarder's listener. Must be called within a tokio runtime.
pub async fn bind_udp_in(ns: &PodNetns, addr: SocketAddr) -> io::Result<UdpSocket> {
    let fd = ns
        .run(move || -> io::Result<OwnedFd> {
            let fd = marked_udp_socket(addr.ip())?;
            bind_reusable(&fd, addr)?;
            Ok(fd)
        })
        .await?;
    UdpSocket::from_std(std::net::UdpSocket::from(fd))
}

/// Connects to `dst` from inside `ns` with the proxy mark. With `source`, the socket is transparent and
/// bound to that address first, so the target sees the original client's IP (the in-pod connmark rules
/// route the replies back to us).
pub async fn connect_in(ns: &PodNetns, dst: SocketAddr, source: Option<IpAddr>) -> io::Result<TcpStream> {
    let fd = ns
        .run(move || -> io::Result<OwnedFd> {
            let fd = marked_socket(dst.ip())?;
            if let Some(source) = source {
                setsockopt(&fd, sockopt::IpTransparent, &true)?;
                setsockopt(&fd, sockopt::IpFreebind, &true)?;
                bind(fd.as_raw_fd(), &SockaddrStorage::from(SocketAddr::new(source, 0)))?;
            }
            Ok(fd)
        })
        .await?;
    let socket = TcpSocket::from_std_stream(std::net::TcpStream::from(fd));
    let stream = tokio::time::timeout(CONNECT_TIMEOUT, socket.connect(dst))
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, format!("connecting to {dst} timed out")))??;
    let _ = stream.set_nodelay(true);
    Ok(stream)
}

/// Where a captured connection was headed: `SO_ORIGINAL_DST` (IPv4) or `IP6T_SO_ORIGINAL_DST` (IPv6) for
/// redirected connections, the local address when there is no NAT entry (TPROXY).
pub fn original_dst(stream: &TcpStream) -> io::Result<SocketAddr> {
    let local = stream.local_addr()?;
    let original = match local {
        SocketAddr::V4(_) => nix::sys::socket::getsockopt(stream, sockopt::OriginalDst).map(|sa| {
            let ip = std::net::Ipv4Addr::from(u32::from_be(sa.sin_addr.s_addr));
            SocketAddr::from((ip, u16::from_be(sa.sin_port)))
        }),
        SocketAddr::V6(_) => nix::sys::socket::getsockopt(stream, sockopt::Ip6tOriginalDst).map(|sa| {
            let ip = std::net::Ipv6Addr::from(sa.sin6_addr.s6_addr);
            SocketAddr::from((ip, u16::from_be(sa.sin6_port)))
        }),
    };
    match original {
        Ok(addr) => Ok(SocketAddr::new(addr.ip().to_canonical(), addr.port())),
        Err(nix::errno::Errno::ENOENT) => Ok(local),
        Err(e) => Err(e.into()),
    }
}

/// The pod's own addresses: every global address on a non-loopback interface of `ns`.
pub async fn pod_ips(ns: &PodNetns) -> io::Result<Vec<IpAddr>> {
    ns.run(|| -> io::Result<Vec<IpAddr>> {
        let mut ips = Vec::new();
        // A netlink dump with a receive timeout: a kernel that never answers cannot hang a worker.
        for ip in netns::netlink::addresses()? {
            let link_local = matches!(ip, IpAddr::V6(v6) if (v6.segments()[0] & 0xffc0) == 0xfe80);
            if !ip.is_loopback() && !link_local && !ips.contains(&ip) {
                ips.push(ip);
            }
        }
        Ok(ips)
    })
    .await
}

/// Closes `stream` with a TCP reset (linger 0), so the client sees its connection refused rather than a clean end.
pub fn reset(stream: TcpStream) {
    let _ = stream.set_zero_linger();
    drop(stream);
}

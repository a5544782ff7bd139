//! A mesh client of the test's own, for scenarios that must behave as no proxy would: workload certificates from
//! the scene's CA (`CA_DIR`), TCP from a pod's netns with the proxy mark (so the pod's in-pod rules let it by, as
//! they let its proxy's own connections by), TLS 1.3 with the mesh's client config, and h2's raw HTTP/2 client.

use std::io;
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::Arc;

use hbone::{Identity, MeshCa, MeshTls, WorkloadCert};
use istio_contract::proxy::PROXY_MARK;
use netns::Netns;
use nix::sys::socket::{connect, setsockopt, socket, sockopt, AddressFamily, SockFlag, SockType, SockaddrStorage};
use rustls::pki_types::ServerName;

/// The TLS stream of a client connection.
pub type Tls = tokio_rustls::client::TlsStream<tokio::net::TcpStream>;

/// Mints workload certificates from a CA directory in Istio's `cacerts` layout and builds mesh client configs.
pub struct MeshClient {
    ca: MeshCa,
    tls: MeshTls,
}

impl MeshClient {
    /// A client of the mesh whose CA is in `cacerts`, in trust domain `td`.
    pub fn new(cacerts: &Path, td: &str) -> Self {
        let ca = MeshCa::load(cacerts).expect("the scene's mesh CA");
        let tls = MeshTls::new(td, ca.roots()).expect("mesh TLS policy");
        MeshClient { ca, tls }
    }

    /// A workload certificate for `identity`.
    pub fn cert(&self, identity: &Identity) -> Arc<WorkloadCert> {
        Arc::new(self.ca.mint(identity).expect("mint a workload certificate"))
    }

    /// The mesh's client config as `src` dialling `server` (TLS 1.3, ALPN `h2`, the server's identity checked).
    pub fn config(&self, src: &WorkloadCert, server: &Identity) -> rustls::ClientConfig {
        (*self.tls.client_config(src, server).expect("client config")).clone()
    }
}

/// Opens `n` TCP connections from `netns` to `dst`, each with the proxy mark.
pub fn dial_marked(netns: &Path, dst: SocketAddr, n: usize) -> io::Result<Vec<TcpStream>> {
    let ns = Netns::open(netns).map_err(|e| io::Error::other(e.to_string()))?;
    ns.run(|| -> io::Result<Vec<TcpStream>> {
        (0..n)
            .map(|_| {
                let family = if dst.is_ipv4() { AddressFamily::Inet } else { AddressFamily::Inet6 };
                let fd = socket(family, SockType::Stream, SockFlag::SOCK_CLOEXEC, None)?;
                setsockopt(&fd, sockopt::Mark, &PROXY_MARK)?;
                // A blocking connect gives up after the send timeout, not after the kernel's minute of SYN retries.
                setsockopt(&fd, sockopt::SendTimeout, &nix::sys::time::TimeVal::new(5, 0))?;
                connect(fd.as_raw_fd(), &SockaddrStorage::from(dst))?;
                Ok(TcpStream::from(fd))
            })
            .collect()
    })
    .map_err(|e| io::Error::other(e.to_string()))?
}

/// TLS with `config` over `tcp` (a socket from [`dial_marked`]) to its peer.
pub async fn tls(config: Arc<rustls::ClientConfig>, tcp: TcpStream) -> io::Result<Tls> {
    tcp.set_nonblocking(true)?;
    let tcp = tokio::net::TcpStream::from_std(tcp)?;
    let name = ServerName::IpAddress(tcp.peer_addr()?.ip().into());
    tokio_rustls::TlsConnector::from(config).connect(name, tcp).await
}

/// h2's HTTP/2 client handshake over `tls`; the connection is driven by a task of its own, whose handle tells
/// when (and how) the connection ended.
pub async fn h2_client(
    tls: Tls,
) -> Result<(h2::client::SendRequest<bytes::Bytes>, tokio::task::JoinHandle<Result<(), h2::Error>>), h2::Error> {
    let (send, connection) = h2::client::handshake(tls).await?;
    Ok((send, tokio::spawn(connection)))
}

/// A CONNECT request for `authority`.
pub fn connect_request(authority: SocketAddr) -> http::Request<()> {
    http::Request::builder().method(http::Method::CONNECT).uri(authority.to_string()).body(()).expect("CONNECT")
}

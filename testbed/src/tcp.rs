//! TCP probes run inside a netns: a one-shot listener that reports where connections really arrived
//! (local address and the pre-NAT `SO_ORIGINAL_DST`), and a client that connects as a given uid
//! (e.g. 1337, the proxy's uid that redirect rules exempt).

use std::net::{SocketAddr, SocketAddrV4, TcpListener};
use std::os::fd::AsRawFd;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use netns::Netns;
use nix::sys::socket::{getsockopt, sockopt::OriginalDst};

use crate::runtime::exec;
use crate::NetnsGuard;

/// How long a listener waits for its one connection, and a client for its connect.
const PROBE_DEADLINE: Duration = Duration::from_secs(30);
/// Static busybox (package busybox-static), whose `nc` is the client.
const BUSYBOX: &str = "/bin/busybox";

/// One accepted connection, as seen by the server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Accepted {
    /// Address the connection arrived at (after any redirect).
    pub local: SocketAddr,
    /// The client's address.
    pub peer: SocketAddr,
    /// `SO_ORIGINAL_DST`: destination before NAT; `None` when conntrack has no entry for the socket.
    pub original_dst: Option<SocketAddrV4>,
}

/// A listener waiting in a netns for one connection; created by [`NetnsGuard::listen_tcp`].
#[derive(Debug)]
pub struct TcpProbe {
    /// The bound address (port resolved if 0 was asked for).
    pub addr: SocketAddr,
    rx: mpsc::Receiver<Result<Accepted, String>>,
}

impl TcpProbe {
    /// Waits up to `timeout` for the connection; `None` if none arrived (e.g. the rules dropped it).
    pub fn accepted_within(&self, timeout: Duration) -> Option<Accepted> {
        match self.rx.recv_timeout(timeout) {
            Ok(Ok(a)) => Some(a),
            Ok(Err(e)) => panic!("listener on {} failed: {e}", self.addr),
            Err(_) => None,
        }
    }

    /// Waits for the connection and panics if none arrives within the probe deadline.
    pub fn accepted(&self) -> Accepted {
        self.accepted_within(PROBE_DEADLINE)
            .unwrap_or_else(|| panic!("no connection arrived at {} within {PROBE_DEADLINE:?}", self.addr))
    }
}

impl NetnsGuard {
    /// Listens on `0.0.0.0:port` inside this netns (bound before returning, so connecting right after is
    /// race-free) and accepts one connection on a background thread, closing it immediately.
    pub fn listen_tcp(&self, port: u16) -> TcpProbe {
        self.listen(port, false)
    }

    /// Like [`NetnsGuard::listen_tcp`] with `IP_TRANSPARENT` set, as a TPROXY proxy listens: it accepts
    /// connections addressed to any IP, and the accepted socket's local address is the original destination.
    pub fn listen_tcp_transparent(&self, port: u16) -> TcpProbe {
        self.listen(port, true)
    }

    fn listen(&self, port: u16, transparent: bool) -> TcpProbe {
        let ns = self.open().unwrap_or_else(|e| panic!("open netns {}: {e}", self.name()));
        listen_in(ns, port, transparent)
    }
}

/// Like [`NetnsGuard::listen_tcp`] (`transparent`: [`NetnsGuard::listen_tcp_transparent`]) in a netns known only
/// by a handle, e.g. one received as a file descriptor over ZDS, the way the node proxy listens in a pod.
pub fn listen_in(ns: Netns, port: u16, transparent: bool) -> TcpProbe {
    let (ready_tx, ready_rx) = mpsc::channel();
    let (tx, rx) = mpsc::channel();
    let ns_name = ns.path().to_path_buf();
    std::thread::spawn(move || {
        let ran = ns.run(|| {
            let listener = match bind(port, transparent).and_then(|l| {
                l.set_nonblocking(true)?;
                Ok((l.local_addr()?, l))
            }) {
                Ok((addr, l)) => {
                    let _ = ready_tx.send(Ok(addr));
                    l
                }
                Err(e) => return ready_tx.send(Err(e.to_string())).unwrap_or(()),
            };
            let _ = tx.send(accept_one(&listener));
        });
        if let Err(e) = ran {
            let _ = ready_tx.send(Err(e.to_string()));
        }
    });
    let addr = ready_rx
        .recv()
        .expect("listener thread ended")
        .unwrap_or_else(|e| panic!("listen on port {port} in netns {}: {e}", ns_name.display()));
    TcpProbe { addr, rx }
}

impl NetnsGuard {
    /// Connects to `addr` from inside this netns from a socket carrying `SO_MARK` `mark` (as the node proxy
    /// marks its own traffic), and closes at once. `Ok` if the TCP handshake succeeded.
    pub fn connect_tcp_marked(&self, addr: SocketAddrV4, mark: u32) -> Result<(), String> {
        let ns = self.open().map_err(|e| e.to_string())?;
        ns.run(|| connect_marked(addr, mark)).map_err(|e| e.to_string())?.map_err(|e| e.to_string())
    }

    /// Connects to `addr` from inside this netns (as `uid`/gid `uid` when given, root otherwise) using
    /// `busybox nc`, and closes at once. `Ok` if the TCP handshake succeeded, `Err(stderr)` otherwise.
    pub fn connect_tcp(&self, addr: SocketAddr, uid: Option<u32>) -> Result<(), String> {
        assert!(Path::new(BUSYBOX).is_file(), "{BUSYBOX} missing; run scripts/install-deps.sh");
        let mut cmd = Command::new(BUSYBOX);
        cmd.args(["nc", "-w", &PROBE_DEADLINE.as_secs().to_string(), &addr.ip().to_string()])
            .arg(addr.port().to_string())
            .stdin(Stdio::null());
        if let Some(uid) = uid {
            std::os::unix::process::CommandExt::uid(&mut cmd, uid);
            std::os::unix::process::CommandExt::gid(&mut cmd, uid);
        }
        let out = exec::run(cmd, Path::new(BUSYBOX), Some(&self.path()), Vec::new(), PROBE_DEADLINE * 2)
            .map_err(|e| e.to_string())?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!("{}: {}", out.status, out.stderr_str().trim()))
        }
    }
}

fn connect_marked(addr: SocketAddrV4, mark: u32) -> std::io::Result<()> {
    use nix::sys::socket::{self, sockopt, AddressFamily, SockFlag, SockType, SockaddrIn};
    let fd = socket::socket(AddressFamily::Inet, SockType::Stream, SockFlag::SOCK_CLOEXEC, None)?;
    socket::setsockopt(&fd, sockopt::Mark, &mark)?;
    let timeout = nix::sys::time::TimeVal::new(PROBE_DEADLINE.as_secs() as i64, 0);
    socket::setsockopt(&fd, sockopt::SendTimeout, &timeout)?;
    socket::connect(fd.as_raw_fd(), &SockaddrIn::from(addr))?;
    Ok(())
}

fn bind(port: u16, transparent: bool) -> std::io::Result<TcpListener> {
    use nix::sys::socket::{self, sockopt, AddressFamily, Backlog, SockFlag, SockType, SockaddrIn};
    let fd = socket::socket(AddressFamily::Inet, SockType::Stream, SockFlag::SOCK_CLOEXEC, None)?;
    socket::setsockopt(&fd, sockopt::ReuseAddr, &true)?;
    if transparent {
        socket::setsockopt(&fd, sockopt::IpTransparent, &true)?;
    }
    socket::bind(fd.as_raw_fd(), &SockaddrIn::new(0, 0, 0, 0, port))?;
    socket::listen(&fd, Backlog::new(16).map_err(std::io::Error::from)?)?;
    Ok(TcpListener::from(fd))
}

fn accept_one(listener: &TcpListener) -> Result<Accepted, String> {
    let deadline = Instant::now() + PROBE_DEADLINE;
    let (stream, peer) = loop {
        match listener.accept() {
            Ok(conn) => break conn,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5))
            }
            Err(e) => return Err(e.to_string()),
        }
    };
    let local = stream.local_addr().map_err(|e| e.to_string())?;
    let original_dst = getsockopt(&stream, OriginalDst)
        .ok()
        .map(|sa| SocketAddrV4::new(u32::from_be(sa.sin_addr.s_addr).into(), u16::from_be(sa.sin_port)));
    Ok(Accepted { local, peer, original_dst })
}

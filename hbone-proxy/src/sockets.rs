//! Sockets inside a pod's network namespace: created on one of the proxy's few socket threads, which enters the
//! pod's namespace for the job (a socket belongs to the namespace it was created in), marked so the in-pod rules
//! let them through, then handed to tokio. No runtime worker ever waits for a thread: a request goes to a socket
//! thread over a channel and the answer comes back on a oneshot. Every socket the proxy opens in a pod is made
//! here, with the mark: TCP listeners and connections, and the DNS forwarder's UDP sockets. Also reads a
//! redirected connection's original destination.
//!
//! What it guarantees:
//! - the proxy has [`SOCKET_THREADS`] socket threads whatever the number of pods, started once; neither a pod nor a
//!   connection starts a thread (a thread per pod cost a stack and a malloc cache per pod: BENCHMARKS.md,
//!   node-scale);
//! - one pod's jobs run in order, on the same thread, which enters the pod's namespace once for a run of them;
//! - a socket thread with nothing queued goes back to the proxy's own namespace before it waits, so no thread
//!   idles inside a pod's namespace, and none keeps a deleted pod's namespace alive.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::ops::Deref;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::panic::AssertUnwindSafe;
use std::sync::{mpsc, Arc, OnceLock};
use std::time::Duration;

use istio_contract::proxy::PROXY_MARK;
use netns::Netns;
use nix::sched::{setns, CloneFlags};
use nix::sys::socket::{
    bind, listen, setsockopt, socket, sockopt, AddressFamily, Backlog, SockFlag, SockType, SockaddrStorage,
};
use tokio::net::{TcpListener, TcpSocket, TcpStream, UdpSocket};
use tokio::sync::oneshot;

/// How long an upstream connect may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// The name of the socket threads (as `/proc/<pid>/task/*/comm` shows it).
pub const SOCKET_THREAD: &str = "pod-sockets";
/// How many socket threads the proxy runs. A job is a few system calls that no pod or peer can make wait (no
/// connect, no read: those happen on tokio), so two keep up with any node.
pub const SOCKET_THREADS: usize = 2;

/// One job of a socket thread: the namespace to run it in, and the work, told whether entering it failed.
type Job = (Arc<Netns>, Box<dyn FnOnce(io::Result<()>) + Send>);

/// The job queues of the socket threads, started on first use.
fn socket_threads() -> &'static [mpsc::Sender<Job>] {
    static THREADS: OnceLock<Vec<mpsc::Sender<Job>>> = OnceLock::new();
    THREADS.get_or_init(|| {
        // The proxy's own namespace, which every thread goes back to when idle.
        let home = match std::fs::File::open("/proc/thread-self/ns/net") {
            Ok(home) => Arc::new(home),
            Err(error) => {
                // Without it no job could run safely: every one fails (the pod is pending, retried).
                tracing::error!(%error, "cannot open the proxy's own netns: no socket threads");
                return Vec::new();
            }
        };
        (0..SOCKET_THREADS)
            .filter_map(|_| {
                let (jobs, queue) = mpsc::channel::<Job>();
                let home = home.clone();
                let spawned = std::thread::Builder::new()
                    .name(SOCKET_THREAD.to_owned())
                    .spawn(move || run_jobs(home.as_fd(), &queue));
                match spawned {
                    Ok(_) => Some(jobs),
                    Err(error) => {
                        tracing::error!(%error, "cannot start a socket thread");
                        None
                    }
                }
            })
            .collect()
    })
}

/// Where a socket thread is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    /// In the proxy's own namespace.
    Home,
    /// In the pod namespace with this (dev, ino). While the thread is inside it, the namespace is alive, so no
    /// other can have its id.
    Pod((u64, u64)),
    /// Not known (entering a namespace failed): treated as away from home.
    Unknown,
}

/// A socket thread: runs each job inside its namespace (entered once for a run of jobs of one pod), and goes back
/// to `home` whenever the queue is empty.
fn run_jobs(home: BorrowedFd<'_>, queue: &mpsc::Receiver<Job>) {
    let mut place = Place::Home;
    loop {
        let (netns, work) = match queue.try_recv() {
            Ok(job) => job,
            Err(mpsc::TryRecvError::Empty) => {
                if place != Place::Home {
                    match setns(home, CloneFlags::CLONE_NEWNET) {
                        Ok(()) => place = Place::Home,
                        Err(error) => tracing::error!(%error, "a socket thread cannot return to the proxy's netns"),
                    }
                }
                match queue.recv() {
                    Ok(job) => job,
                    Err(_) => return,
                }
            }
            Err(mpsc::TryRecvError::Disconnected) => return,
        };
        let entered = if place == Place::Pod(netns.id()) {
            Ok(())
        } else {
            match setns(netns.file().as_fd(), CloneFlags::CLONE_NEWNET) {
                Ok(()) => {
                    place = Place::Pod(netns.id());
                    Ok(())
                }
                Err(e) => {
                    place = Place::Unknown;
                    Err(io::Error::other(format!("entering {}: {e}", netns.path().display())))
                }
            }
        };
        // A job that panics loses its own result (its reply channel is dropped), not the thread.
        let _ = std::panic::catch_unwind(AssertUnwindSafe(|| work(entered)));
    }
}

/// A pod's network namespace, and the socket thread that makes the pod's sockets inside it. Cheap to clone.
/// Derefs to the namespace handle (its id, its path).
#[derive(Debug, Clone)]
pub struct PodNetns {
    netns: Arc<Netns>,
    /// Which socket thread runs this pod's jobs (the same one for all of them, so they run in order).
    thread: usize,
}

impl PodNetns {
    /// The pod whose namespace is `netns`; checks that a socket thread can enter it, so a namespace that cannot be
    /// entered fails here, not on the first socket, and lets the namespace migrate accept queues
    /// ([`allow_accept_queue_migration`]) before any listener is made there.
    pub async fn enter(netns: Arc<Netns>) -> io::Result<Self> {
        let (dev, ino) = netns.id();
        let threads = socket_threads().len().max(1);
        let pod = PodNetns { netns, thread: (dev ^ ino) as usize % threads };
        pod.run(|| {
            allow_accept_queue_migration();
            Ok(())
        })
        .await?;
        Ok(pod)
    }

    /// Runs `make` on the pod's socket thread, inside its namespace, and awaits its result without blocking the
    /// runtime. If the caller goes away first, whatever `make` returns is dropped (a socket is closed).
    pub async fn run<T, F>(&self, make: F) -> io::Result<T>
    where
        F: FnOnce() -> io::Result<T> + Send + 'static,
        T: Send + 'static,
    {
        let (reply, answer) = oneshot::channel();
        let work = Box::new(move |entered: io::Result<()>| {
            let _ = reply.send(entered.and_then(|()| make()));
        });
        let thread = socket_threads().get(self.thread).ok_or_else(|| io::Error::other("no socket thread runs"))?;
        thread.send((self.netns.clone(), work)).map_err(|_| io::Error::other("the socket thread is gone"))?;
        answer.await.map_err(|_| io::Error::other("the socket thread dropped the request"))?
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
///
/// Once per pod, when it is entered: opening a `/proc/sys/net` file costs time in proportion to the namespaces
/// on the node (the kernel walks one `net` entry per namespace, under a lock each), so at 1,000 pods doing it for
/// every listener was most of a pod start's time (BENCHMARKS.md, node-scale).
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

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::os::unix::fs::MetadataExt as _;

    use super::*;

    /// A new network namespace (made on a thread of its own, which leaves it at once), as a pod's would be.
    fn new_netns() -> Arc<Netns> {
        std::thread::spawn(|| {
            nix::sched::unshare(CloneFlags::CLONE_NEWNET).expect("unshare a netns (tests run as root)");
            Arc::new(Netns::open("/proc/thread-self/ns/net").expect("open the new netns"))
        })
        .join()
        .expect("netns thread")
    }

    /// The (dev, ino) of the netns the calling thread is in.
    fn netns_here() -> io::Result<(u64, u64)> {
        let meta = std::fs::metadata("/proc/thread-self/ns/net")?;
        Ok((meta.dev(), meta.ino()))
    }

    /// The netns of every socket thread of this process.
    fn socket_thread_netns() -> Vec<(u64, u64)> {
        let tasks = std::fs::read_dir("/proc/self/task").expect("list threads");
        tasks
            .filter_map(|task| {
                let path = task.ok()?.path();
                let comm = std::fs::read_to_string(path.join("comm")).ok()?;
                let meta = std::fs::metadata(path.join("ns/net")).ok()?;
                (comm.trim() == SOCKET_THREAD).then_some((meta.dev(), meta.ino()))
            })
            .collect()
    }

    #[tokio::test]
    async fn a_pods_jobs_run_inside_its_netns_in_order_on_one_thread() {
        let (a, b) = (new_netns(), new_netns());
        let (pod_a, pod_b) = (PodNetns::enter(a.clone()).await.unwrap(), PodNetns::enter(b.clone()).await.unwrap());
        let job = || Ok((netns_here()?, nix::unistd::gettid()));
        let mut threads = HashSet::new();
        for _ in 0..3 {
            let (in_a, thread_a) = pod_a.run(job).await.unwrap();
            let (in_b, _) = pod_b.run(job).await.unwrap();
            assert_eq!((in_a, in_b), (a.id(), b.id()), "each pod's jobs run in its own netns");
            threads.insert(thread_a);
        }
        assert_eq!(threads.len(), 1, "one thread runs all of a pod's jobs");
        // Listening on every address of the pod's netns (its loopback is down): nothing listens on that port here.
        let listener = pod_a.run(|| std::net::TcpListener::bind("0.0.0.0:0")).await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let refused = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap_err();
        assert_eq!(refused.kind(), io::ErrorKind::ConnectionRefused, "the socket was made in the pod, not here");
    }

    #[tokio::test]
    async fn socket_threads_do_not_grow_with_pods_and_go_home_when_idle() {
        let namespaces: Vec<Arc<Netns>> = (0..8).map(|_| new_netns()).collect();
        let mut pods = Vec::new();
        for netns in &namespaces {
            let pod = PodNetns::enter(netns.clone()).await.unwrap();
            pod.run(|| Ok(())).await.unwrap();
            pods.push(pod);
        }
        assert_eq!(socket_thread_netns().len(), SOCKET_THREADS, "a fixed few threads, whatever the pods");
        let pod_ids: HashSet<(u64, u64)> = namespaces.iter().map(|n| n.id()).collect();
        testbed::wait::eventually_async("the idle socket threads have left every pod's namespace", || {
            socket_thread_netns().iter().all(|id| !pod_ids.contains(id)).then_some(())
        })
        .await;
    }

    #[tokio::test]
    async fn a_job_that_panics_loses_its_result_not_the_thread() {
        let pod = PodNetns::enter(new_netns()).await.unwrap();
        let error = pod.run(|| -> io::Result<()> { panic!("job failed") }).await.unwrap_err();
        assert!(error.to_string().contains("dropped the request"), "{error}");
        assert_eq!(pod.run(|| Ok(7)).await.unwrap(), 7, "the thread still runs jobs");
    }
}

//! Error paths and lifecycle of the real `hbone-proxy` between ambient pods A and B on one node (the real node
//! agent, pods created through the fake CNI runtime): identity and protocol refusals, half-close through both
//! proxies, and the graceful drain on SIGTERM. The proxy runs with a mesh CA the test created, so the test can
//! also speak HBONE to B's 15008 itself, as another mesh proxy would.

use std::io::{self, ErrorKind, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpStream};
use std::ops::{Deref, DerefMut};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use hbone::{
    Baggage, ConnectError, ConnectRequest, Dialer, H2Stream, Identity, MeshCa, MeshTls, Pool, PoolConfig, WorkloadCert,
};
use http::StatusCode;
use http_body_util::Empty;
use hyper_util::rt::{TokioExecutor, TokioIo};
use istio_contract::ports;
use istio_contract::proxy::PROXY_MARK;
use netns::Netns;
use nix::sys::socket::{connect, setsockopt, socket, sockopt, AddressFamily, SockFlag, SockType, SockaddrStorage};
use testbed::wait::eventually;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

mod support;
use support::{listening, unready, APP_PORT, B_SA, NS, TD};

/// Bound on every async part of a test.
const TEST_TIMEOUT: Duration = Duration::from_secs(60);

/// The shared [`support::Scene`] with the proxy's mesh CA made by the test (in `cacerts`), so the test can mint
/// certificates of its own.
struct Scene {
    base: support::Scene,
    ca: MeshCa,
}

impl Deref for Scene {
    type Target = support::Scene;

    fn deref(&self) -> &support::Scene {
        &self.base
    }
}

impl DerefMut for Scene {
    fn deref_mut(&mut self) -> &mut support::Scene {
        &mut self.base
    }
}

impl Scene {
    /// The proxy lists B with service account `b_listed_sa` ([`support::Scene::new`]); open connections get
    /// `termination_deadline` (a Go duration) on SIGTERM.
    fn new(b_listed_sa: &str, termination_deadline: &str) -> Self {
        let dir = tempfile::tempdir().expect("scratch dir");
        let cacerts = dir.path().join("cacerts");
        let ca = MeshCa::load_or_create(&cacerts, TD).expect("test mesh CA");
        let env = [
            ("CA_DIR", cacerts.to_str().expect("UTF-8 scratch path")),
            ("CONNECTION_TERMINATION_DEADLINE", termination_deadline),
            // A's connections to B go over HBONE, as from another node: these tests are about its errors.
            support::HBONE_ON_ONE_NODE,
        ];
        Scene { base: support::Scene::new(dir, b_listed_sa, &env), ca }
    }

    /// B's app as an echo server for any number of connections; counts the connections it accepted.
    fn b_echo(&self) -> Arc<AtomicUsize> {
        support::traffic::echo_app(self.b_listener())
    }

    /// B's identity as the mesh knows it.
    fn b_identity(&self) -> Identity {
        Identity::new(TD, NS, B_SA).expect("B's identity")
    }

    /// A certificate for a tester workload minted by the proxy's own CA, i.e. a valid mesh client.
    fn mesh_client_cert(&self) -> Arc<WorkloadCert> {
        Arc::new(self.ca.mint(&Identity::new(TD, NS, "tester").expect("identity")).expect("mint"))
    }

    /// An HBONE client of the test's own that dials from A's netns with the proxy mark, as A's proxy would.
    fn client(&self) -> Pool {
        let tls = MeshTls::new(TD, self.ca.roots()).expect("mesh TLS");
        Pool::with_dialer(tls, PoolConfig::default(), marked_dialer(self.a.netns.path()))
    }

    /// CONNECT to `authority` over B's 15008 as `src`.
    fn request(&self, src: &Arc<WorkloadCert>, authority: SocketAddr) -> ConnectRequest {
        ConnectRequest {
            src: src.clone(),
            src_addr: SocketAddr::from((self.a.ip, 40000)),
            dst: SocketAddr::from((self.b.ip, ports::HBONE)),
            dst_identity: self.b_identity(),
            authority,
            baggage: Baggage::namespace(NS),
            extra_headers: Default::default(),
        }
    }

    fn b_app(&self) -> SocketAddr {
        SocketAddr::from((self.b.ip, APP_PORT))
    }
}

/// Opens the TCP connection in `netns` with the proxy mark (so the in-pod rules do not capture it).
fn marked_dialer(netns: PathBuf) -> Dialer {
    Arc::new(move |dst| {
        let netns = netns.clone();
        Box::pin(async move {
            let stream = tokio::task::spawn_blocking(move || connect_marked(&netns, dst)).await??;
            stream.set_nonblocking(true)?;
            tokio::net::TcpStream::from_std(stream)
        })
    })
}

fn connect_marked(netns: &Path, dst: SocketAddr) -> io::Result<TcpStream> {
    let ns = Netns::open(netns).map_err(|e| io::Error::other(e.to_string()))?;
    ns.run(|| -> io::Result<TcpStream> {
        let family = if dst.is_ipv4() { AddressFamily::Inet } else { AddressFamily::Inet6 };
        let fd = socket(family, SockType::Stream, SockFlag::SOCK_CLOEXEC, None)?;
        setsockopt(&fd, sockopt::Mark, &PROXY_MARK)?;
        connect(fd.as_raw_fd(), &SockaddrStorage::from(dst))?;
        Ok(TcpStream::from(fd))
    })
    .map_err(|e| io::Error::other(e.to_string()))?
}

/// Runs `test` on a fresh runtime, bounded by [`TEST_TIMEOUT`].
fn block_on<T>(test: impl std::future::Future<Output = T>) -> T {
    let runtime = tokio::runtime::Runtime::new().expect("tokio runtime");
    runtime.block_on(async { tokio::time::timeout(TEST_TIMEOUT, test).await.expect("test timed out") })
}

/// Writes `msg` on the tunnel and reads the echo back.
async fn echo_through(stream: &mut H2Stream, msg: &[u8]) {
    stream.write_all(msg).await.expect("write through the tunnel");
    let mut got = vec![0; msg.len()];
    stream.read_exact(&mut got).await.expect("read the echo");
    assert_eq!(got, msg, "the echo came back through the tunnel");
}

/// Writes `msg` on A's app socket and reads the echo back.
fn echo_plain(stream: &mut TcpStream, msg: &[u8]) {
    stream.write_all(msg).expect("A writes");
    let mut got = vec![0; msg.len()];
    stream.read_exact(&mut got).expect("A reads the echo");
    assert_eq!(got, msg, "B's echo reached A");
}

/// The CONNECT status B's proxy answers, or a panic if it answered 200.
fn refusal(result: Result<H2Stream, ConnectError>) -> StatusCode {
    match result {
        Err(ConnectError::Status { status, .. }) => status,
        other => panic!("expected a refusal status, got {other:?}"),
    }
}

#[test]
fn a_refuses_b_when_b_does_not_prove_the_listed_identity() {
    let scene = Scene::new("other", "5s");
    let listener = scene.b_listener();
    listener.set_nonblocking(true).expect("nonblocking listener");

    let mut stream = scene.a_connects_to_b();
    let _ = stream.write_all(b"hello");
    let mut buf = [0; 16];
    match stream.read(&mut buf) {
        Ok(0) => {}
        Err(e) if e.kind() == ErrorKind::ConnectionReset => {}
        other => panic!("A's app should see its connection closed, got {other:?}"),
    }
    let refused = "server certificate is not spiffe://cluster.local/ns/shop/sa/other";
    let line = eventually("the outbound access log records the identity error", || {
        let log = scene.proxy.log();
        log.lines().find(|l| l.contains("direction=\"outbound\"") && l.contains(refused)).map(str::to_owned)
    });
    assert!(line.contains("dst.identity=spiffe://cluster.local/ns/shop/sa/other"), "{line}");
    assert!(matches!(listener.accept(), Err(e) if e.kind() == ErrorKind::WouldBlock), "B's app got a connection");

    // The same pods work once the directory names B's real identity: the refusal was about identity only.
    scene.list_b_as(B_SA);
    let mut stream = scene.a_connects_to_b();
    stream.write_all(b"hello").expect("A writes");
    let (mut server, peer) = eventually("B's app accepts A's connection", || listener.accept().ok());
    assert_eq!(peer.ip(), IpAddr::from(scene.a.ip), "B's app sees A's IP");
    server.set_nonblocking(false).expect("blocking socket");
    server.set_read_timeout(Some(Duration::from_secs(30))).expect("read timeout");
    let mut got = [0; 5];
    server.read_exact(&mut got).expect("B reads");
    assert_eq!(&got, b"hello");
}

#[test]
fn b_rejects_client_certificates_outside_its_trust_domain() {
    let scene = Scene::new(B_SA, "5s");
    let accepted = scene.b_echo();
    let other_dir = tempfile::tempdir().expect("scratch dir");
    let other_ca = MeshCa::load_or_create(other_dir.path(), TD).expect("another CA");
    block_on(async {
        let pool = scene.client();
        let mut tunnel = pool.connect(&scene.request(&scene.mesh_client_cert(), scene.b_app())).await.expect("control");
        echo_through(&mut tunnel, b"a mesh client gets through").await;

        // Distinct identities, so the pool cannot hand out the control's connection.
        let foreign_td = Identity::new("evil.example", NS, "foreign-td").expect("identity");
        let cases = [
            ("a certificate of another trust domain from the mesh CA", scene.ca.mint(&foreign_td).expect("mint")),
            ("a certificate from another CA", other_ca.mint(&Identity::new(TD, NS, "other-ca").unwrap()).unwrap()),
        ];
        for (what, cert) in cases {
            let result = scene.client().connect(&scene.request(&Arc::new(cert), scene.b_app())).await;
            assert!(result.is_err(), "{what} was accepted");
        }
    });
    let wrong_td = "client certificate has no spiffe:// URI SAN in trust domain cluster.local";
    eventually("B's proxy logs both rejected handshakes", || {
        let log = scene.proxy.log();
        let failed = log.lines().filter(|l| l.contains("inbound HBONE handshake failed")).count();
        (failed >= 2 && log.contains(wrong_td)).then_some(())
    });
    assert_eq!(accepted.load(Ordering::SeqCst), 1, "only the mesh client reached B's app");
}

#[test]
fn b_answers_protocol_errors_with_400_and_503() {
    let scene = Scene::new(B_SA, "5s");
    let accepted = scene.b_echo();
    let cert = scene.mesh_client_cert();
    block_on(async {
        let pool = scene.client();
        let mut tunnel = pool.connect(&scene.request(&cert, scene.b_app())).await.expect("control");
        echo_through(&mut tunnel, b"a proper CONNECT gets through").await;

        let elsewhere = SocketAddr::from((scene.a.ip, APP_PORT));
        let status = refusal(pool.connect(&scene.request(&cert, elsewhere)).await);
        assert_eq!(status, StatusCode::BAD_REQUEST, ":authority IP other than the dialled IP");
        for port in [ports::OUTBOUND, ports::INBOUND_PLAINTEXT, ports::HBONE] {
            let status = refusal(pool.connect(&scene.request(&cert, SocketAddr::from((scene.b.ip, port)))).await);
            assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "CONNECT to B:{port}");
        }

        // A plain GET on a valid mTLS HTTP/2 connection.
        let dst = SocketAddr::from((scene.b.ip, ports::HBONE));
        let tcp = (marked_dialer(scene.a.netns.path()))(dst).await.expect("dial B:15008");
        let tls = MeshTls::new(TD, scene.ca.roots()).expect("mesh TLS");
        let stream = tls.connect(tcp, &cert, &scene.b_identity()).await.expect("mTLS with B");
        let (mut send, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .expect("HTTP/2 handshake");
        tokio::spawn(conn);
        let get = http::Request::get(format!("http://{}/", scene.b_app())).body(Empty::<Bytes>::new()).unwrap();
        let response = send.send_request(get).await.expect("an answer to GET");
        assert_eq!(response.status(), StatusCode::BAD_REQUEST, "plain GET");
    });
    assert_eq!(accepted.load(Ordering::SeqCst), 1, "only the proper CONNECT reached B's app");
    assert!(scene.proxy.log().contains("refused HBONE request"), "refusals are logged");
}

#[test]
fn half_close_passes_through_both_proxies() {
    let scene = Scene::new(B_SA, "5s");
    let listener = scene.b_listener();
    // B's app answers only after A's side reached EOF: the answer is what it got, reversed.
    let server = std::thread::spawn(move || {
        let (mut stream, peer) = listener.accept().expect("accept");
        let mut got = Vec::new();
        stream.read_to_end(&mut got).expect("B reads to EOF");
        got.reverse();
        stream.write_all(&got).expect("B answers after EOF");
        (peer, got.len())
    });
    let data: Vec<u8> = (0..256 * 1024u32).map(|i| (i * 7 % 251) as u8).collect();
    let mut stream = scene.a_connects_to_b();
    stream.write_all(&data).expect("A sends");
    stream.shutdown(Shutdown::Write).expect("A shuts down its write side");
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).expect("A reads the answer after its half-close");
    let (peer, b_got) = server.join().expect("B's app");
    assert_eq!(b_got, data.len(), "B got all of A's bytes, then EOF");
    let mut expected = data;
    expected.reverse();
    assert!(answer == expected, "A read B's full answer ({} of {} bytes)", answer.len(), expected.len());
    assert_eq!(peer.ip(), IpAddr::from(scene.a.ip));
    let log = scene.proxy.log();
    assert!(log.contains("direction=\"inbound\" protocol=\"HBONE\""), "carried over HBONE");
}

#[test]
fn sigterm_lets_open_streams_finish_and_sends_goaway() {
    let deadline = Duration::from_secs(8);
    let mut scene = Scene::new(B_SA, "8s");
    scene.b_echo();
    let mut app = scene.a_connects_to_b();
    echo_plain(&mut app, b"before");
    let runtime = tokio::runtime::Runtime::new().expect("tokio runtime");
    let pool = scene.client();
    let cert = scene.mesh_client_cert();
    let mut tunnel = runtime.block_on(async {
        let mut tunnel = pool.connect(&scene.request(&cert, scene.b_app())).await.expect("test tunnel");
        echo_through(&mut tunnel, b"before").await;
        tunnel
    });
    assert_eq!(pool.connection_count(), 1);

    let node = scene.cluster.node.netns().path();
    assert!(!unready(&node, ports::READINESS), "the proxy is ready before SIGTERM");
    let sent = scene.proxy.terminate();
    eventually("the proxy starts draining: no longer ready", || unready(&node, ports::READINESS).then_some(()));
    eventually("the proxy stops accepting on B's 15008", || (!listening(&scene.b.netns, ports::HBONE)).then_some(()));
    eventually("B's proxy sent GOAWAY on the test's HBONE connection", || (pool.connection_count() == 0).then_some(()));

    // Both open streams still flow, then finish.
    echo_plain(&mut app, b"while draining");
    app.shutdown(Shutdown::Write).expect("A's app is done");
    assert_eq!(app.read(&mut [0; 8]).expect("A reads EOF"), 0, "B's echo finished");
    runtime.block_on(async {
        echo_through(&mut tunnel, b"while draining").await;
        tunnel.shutdown().await.expect("end the test stream");
        assert_eq!(tunnel.read(&mut [0; 8]).await.expect("EOF"), 0);
    });
    drop(tunnel);

    let status = scene.proxy.exit_within(sent, deadline).expect("the proxy exits once its streams finished");
    assert!(status.success(), "{status}");
    assert!(sent.elapsed() < deadline, "exited when drained, not at the deadline");
    assert!(scene.proxy.log().contains("all connections finished"), "drained cleanly");
}

#[test]
fn sigterm_cuts_a_stream_still_open_at_the_deadline() {
    let deadline = Duration::from_secs(2);
    let mut scene = Scene::new(B_SA, "2s");
    scene.b_echo();
    let mut app = scene.a_connects_to_b();
    echo_plain(&mut app, b"before");

    let node = scene.cluster.node.netns().path();
    assert!(!unready(&node, ports::READINESS), "the proxy is ready before SIGTERM");
    let sent = scene.proxy.terminate();
    eventually("the proxy starts draining: no longer ready", || unready(&node, ports::READINESS).then_some(()));
    echo_plain(&mut app, b"while draining");
    // The app keeps its stream open; the proxy cuts it at the deadline.
    match app.read(&mut [0; 8]) {
        Ok(0) => {}
        Err(e) if e.kind() == ErrorKind::ConnectionReset => {}
        other => panic!("the open stream should be cut, got {other:?}"),
    }
    let cut = sent.elapsed();
    assert!(cut >= deadline, "cut after {cut:?}, before the {deadline:?} deadline");
    let margin = Duration::from_secs(3);
    assert!(cut < deadline + margin, "cut only after {cut:?}");
    let status = scene.proxy.exit_within(sent, deadline + margin).expect("the proxy exits by the deadline");
    assert!(status.success(), "{status}");
    // Two timers expire together at the deadline: the proxy-wide one, or the HBONE server's own drain deadline
    // when it cuts the connection first (the outbound side then just sees its peer go). Either logs the cut.
    let log = scene.proxy.log();
    assert!(
        log.contains("still open at the termination deadline") || log.contains("did not drain before the deadline"),
        "the cut is logged"
    );
}

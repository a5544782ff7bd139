//! HBONE end to end on loopback: a real mTLS HTTP/2 CONNECT server in front of real TCP apps, dialled through
//! the pool, plus raw TLS/HTTP/2 clients where the test needs to misbehave on purpose.

use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use hbone::{
    Account, Baggage, ConnectError, ConnectHandler, ConnectRequest, Identity, InboundRequest, InboundTls, MemoryBudget,
    MeshCa, MeshTls, Pool, PoolConfig, ServeOptions, ServerCerts, TlsError, Transfer, WorkloadCert,
};
use http::StatusCode;
use istio_contract::ports;
use ring::digest::{digest, SHA256};
use ring::rand::{SecureRandom, SystemRandom};
use testbed::wait::eventually_async;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};

const TD: &str = "cluster.local";
const TEST_TIMEOUT: Duration = Duration::from_secs(60);

/// Each test gets its own loopback IP, so certificates by IP and authority checks never collide.
fn next_ip() -> IpAddr {
    static NEXT: AtomicU8 = AtomicU8::new(10);
    IpAddr::V4(Ipv4Addr::new(127, 0, 0, NEXT.fetch_add(2, Ordering::Relaxed)))
}

fn id(sa: &str) -> Identity {
    Identity::new(TD, "ns1", sa).unwrap()
}

async fn within<T>(f: impl Future<Output = T>) -> T {
    tokio::time::timeout(TEST_TIMEOUT, f).await.expect("test timed out")
}

struct Mesh {
    _dir: tempfile::TempDir,
    ca: MeshCa,
    tls: MeshTls,
}

fn new_mesh() -> Mesh {
    let dir = tempfile::tempdir().unwrap();
    let ca = MeshCa::load_or_create(dir.path(), TD).unwrap();
    let tls = MeshTls::new(TD, ca.roots()).unwrap();
    Mesh { _dir: dir, ca, tls }
}

/// Connects inbound tunnels to the requested target with plain TCP and reports finished transfers.
struct TcpHandler {
    done: mpsc::UnboundedSender<(InboundRequest, Transfer)>,
}

impl ConnectHandler for TcpHandler {
    type Target = TcpStream;

    async fn connect(&self, req: &InboundRequest) -> Result<TcpStream, StatusCode> {
        TcpStream::connect(req.authority).await.map_err(|_| StatusCode::SERVICE_UNAVAILABLE)
    }

    fn finished(&self, req: &InboundRequest, transfer: Transfer) {
        let _ = self.done.send((req.clone(), transfer));
    }
}

/// An HBONE server on `ip` (ephemeral port), serving the certificate of `identity`.
struct Server {
    addr: SocketAddr,
    certs: ServerCerts,
    accepted: Arc<AtomicUsize>,
    handshake_errors: mpsc::UnboundedReceiver<TlsError>,
    finished: mpsc::UnboundedReceiver<(InboundRequest, Transfer)>,
    served: mpsc::UnboundedReceiver<Result<hbone::Ended, hbone::ServeError>>,
    shutdown: watch::Sender<bool>,
}

async fn start_server(mesh: &Mesh, ip: IpAddr, identity: &Identity, options: ServeOptions) -> Server {
    start_server_budgeted(mesh, ip, identity, options, None).await
}

/// [`start_server`], its connections charged to `memory` (a destination pod's account in its node's budget).
async fn start_server_budgeted(
    mesh: &Mesh,
    ip: IpAddr,
    identity: &Identity,
    options: ServeOptions,
    memory: Option<Account>,
) -> Server {
    let certs = ServerCerts::new();
    certs.set(ip, &mesh.ca.mint(identity).unwrap()).unwrap();
    let listener = TcpListener::bind((ip, 0)).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let inbound = InboundTls::new(mesh.tls.clone(), certs.clone());
    let accepted = Arc::new(AtomicUsize::new(0));
    let (err_tx, handshake_errors) = mpsc::unbounded_channel();
    let (done_tx, finished) = mpsc::unbounded_channel();
    let (served_tx, served) = mpsc::unbounded_channel();
    let (shutdown, shutdown_rx) = watch::channel(false);
    let handler = Arc::new(TcpHandler { done: done_tx });
    let count = accepted.clone();
    tokio::spawn(async move {
        loop {
            let (tcp, _) = listener.accept().await.unwrap();
            count.fetch_add(1, Ordering::SeqCst);
            let (inbound, handler, err_tx, served_tx) =
                (inbound.clone(), handler.clone(), err_tx.clone(), served_tx.clone());
            let mut shutdown_rx = shutdown_rx.clone();
            let memory = memory.clone();
            tokio::spawn(async move {
                match inbound.accept(tcp).await {
                    Ok(conn) => {
                        let stop = async move {
                            let _ = shutdown_rx.wait_for(|stop| *stop).await;
                        };
                        let served = hbone::serve_budgeted(conn, handler, options, memory.clone(), stop).await;
                        let _ = served_tx.send(served);
                    }
                    Err(e) => {
                        let _ = err_tx.send(e);
                    }
                }
            });
        }
    });
    Server { addr, certs, accepted, handshake_errors, finished, served, shutdown }
}

/// An app on `ip` that echoes everything and closes its write side at EOF.
async fn echo_app(ip: IpAddr) -> SocketAddr {
    let listener = TcpListener::bind((ip, 0)).await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (mut tcp, _) = listener.accept().await.unwrap();
            tokio::spawn(async move {
                let (mut r, mut w) = tcp.split();
                tokio::io::copy(&mut r, &mut w).await.unwrap();
                w.shutdown().await.unwrap();
            });
        }
    });
    addr
}

/// An app on `ip` that reads to EOF, then answers with the byte count and SHA-256 of what it read.
async fn digest_app(ip: IpAddr) -> SocketAddr {
    let listener = TcpListener::bind((ip, 0)).await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let (mut tcp, _) = listener.accept().await.unwrap();
        let mut data = Vec::new();
        tcp.read_to_end(&mut data).await.unwrap();
        tcp.write_all(summary(&data).as_bytes()).await.unwrap();
        tcp.shutdown().await.unwrap();
    });
    addr
}

fn summary(data: &[u8]) -> String {
    format!("{} bytes sha256 {:?}", data.len(), digest(&SHA256, data).as_ref())
}

fn random_bytes(len: usize) -> Vec<u8> {
    let mut data = vec![0u8; len];
    SystemRandom::new().fill(&mut data).unwrap();
    data
}

fn request(src: &Arc<WorkloadCert>, server: &Server, dst_identity: &Identity, authority: SocketAddr) -> ConnectRequest {
    ConnectRequest {
        src: src.clone(),
        src_addr: "10.1.2.3:40000".parse().unwrap(),
        dst: server.addr,
        dst_identity: dst_identity.clone(),
        authority,
        baggage: Baggage {
            namespace: "ns1".into(),
            workload: Some(("deployment".into(), "client".into())),
            ..Default::default()
        },
        extra_headers: Default::default(),
    }
}

/// What most tests start from: a mesh, an HBONE server on a fresh loopback IP and a client certificate for
/// `client`; requests from it always ask for the identity `server`.
struct Scene {
    mesh: Mesh,
    ip: IpAddr,
    server: Server,
    client: Arc<WorkloadCert>,
}

impl Scene {
    /// A scene whose server presents `server_sa`'s certificate and serves with `options`.
    async fn start(server_sa: &str, options: ServeOptions) -> Self {
        let mesh = new_mesh();
        let ip = next_ip();
        let server = start_server(&mesh, ip, &id(server_sa), options).await;
        let client = Arc::new(mesh.ca.mint(&id("client")).unwrap());
        Scene { mesh, ip, server, client }
    }

    /// The usual scene: the server is `server` with default serve options.
    async fn new() -> Self {
        Self::start("server", ServeOptions::default()).await
    }

    /// A pool of this mesh with `config`.
    fn pool(&self, config: PoolConfig) -> Pool {
        Pool::new(self.mesh.tls.clone(), config)
    }

    /// A request from `client` through the server to `authority`.
    fn request(&self, authority: SocketAddr) -> ConnectRequest {
        request(&self.client, &self.server, &id("server"), authority)
    }

    /// A fresh pool with `config`, and three streams opened on it one after another to a new echo app.
    async fn three_streams(&self, config: PoolConfig) -> (Pool, ConnectRequest, [hbone::H2Stream; 3]) {
        let app = echo_app(self.ip).await;
        let pool = self.pool(config);
        let req = self.request(app);
        let open =
            [pool.connect(&req).await.unwrap(), pool.connect(&req).await.unwrap(), pool.connect(&req).await.unwrap()];
        (pool, req, open)
    }
}

/// A raw TLS handshake with `config` to `addr`, for clients the mesh config would never build.
async fn raw_tls(
    config: rustls::ClientConfig,
    addr: SocketAddr,
) -> std::io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let name = rustls::pki_types::ServerName::IpAddress(addr.ip().into());
    tokio_rustls::TlsConnector::from(Arc::new(config)).connect(name, tcp).await
}

/// Sends `data` through `stream`, shuts down the write side, and returns everything read back.
async fn exchange(stream: hbone::H2Stream, data: Vec<u8>) -> Vec<u8> {
    let (mut r, mut w) = tokio::io::split(stream);
    let writer = tokio::spawn(async move {
        w.write_all(&data).await.unwrap();
        w.shutdown().await.unwrap();
        w
    });
    let mut back = Vec::new();
    r.read_to_end(&mut back).await.unwrap();
    writer.await.unwrap();
    back
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_round_trip_carries_8_mib_each_way() {
    within(async {
        let mut scene = Scene::new().await;
        let app = echo_app(scene.ip).await;
        let pool = scene.pool(PoolConfig::default());

        let stream = pool.connect(&scene.request(app)).await.unwrap();
        let data = random_bytes(8 * 1024 * 1024);
        let back = exchange(stream, data.clone()).await;
        assert_eq!(summary(&back), summary(&data));

        let (req, transfer) = scene.server.finished.recv().await.unwrap();
        assert_eq!((transfer.to_target, transfer.from_target), (8 << 20, 8 << 20));
        assert!(transfer.error.is_none(), "{:?}", transfer.error);
        assert_eq!(req.peer_identity, id("client"));
        assert_eq!(req.authority, app);
        assert_eq!(req.local.ip(), scene.ip);
        assert_eq!(req.headers["forwarded"], "for=\"10.1.2.3:40000\"");
        assert_eq!(req.headers["baggage"], "k8s.namespace.name=ns1,k8s.deployment.name=client");
        let traceparent = req.headers["traceparent"].to_str().unwrap();
        assert!(traceparent.starts_with("00-") && traceparent.len() == 55, "{traceparent}");
    })
    .await
}

#[tokio::test]
async fn half_close_client_shuts_write_and_still_reads_the_answer() {
    within(async {
        let scene = Scene::new().await;
        let app = digest_app(scene.ip).await;
        let pool = scene.pool(PoolConfig::default());

        let mut stream = pool.connect(&scene.request(app)).await.unwrap();
        let data = random_bytes(1024 * 1024 + 17);
        stream.write_all(&data).await.unwrap();
        stream.shutdown().await.unwrap();
        // The app only answers after it saw EOF, and the answer arrives after our write side closed.
        let mut answer = String::new();
        stream.read_to_string(&mut answer).await.unwrap();
        assert_eq!(answer, summary(&data));
    })
    .await
}

#[tokio::test]
async fn server_rejects_client_from_another_trust_domain_or_ca() {
    within(async {
        let mut scene = Scene::new().await;
        let app = echo_app(scene.ip).await;
        let pool = scene.pool(PoolConfig::default());
        let server = &mut scene.server;

        let foreign = Arc::new(scene.mesh.ca.mint(&Identity::new("other.domain", "ns1", "client").unwrap()).unwrap());
        let result = pool.connect(&request(&foreign, server, &id("server"), app)).await;
        assert!(result.is_err(), "a foreign trust domain got a tunnel");
        let err = server.handshake_errors.recv().await.unwrap().to_string();
        assert!(err.contains("trust domain cluster.local"), "{err}");

        // A client of another mesh CA (that trusts our server's roots, so only the server decides).
        let stranger = Arc::new(new_mesh().ca.mint(&id("client")).unwrap());
        assert!(pool.connect(&request(&stranger, server, &id("server"), app)).await.is_err());
        let err = server.handshake_errors.recv().await.unwrap().to_string();
        assert!(err.contains("certificate rejected"), "{err}");
        assert!(server.finished.try_recv().is_err(), "no tunnel was opened");
    })
    .await
}

#[tokio::test]
async fn client_refuses_server_with_the_wrong_identity() {
    within(async {
        let scene = Scene::start("impostor", ServeOptions::default()).await;
        let app = echo_app(scene.ip).await;
        let pool = scene.pool(PoolConfig::default());

        let err = pool.connect(&scene.request(app)).await.unwrap_err();
        assert!(matches!(err, ConnectError::Tls(_)), "{err}");
        let text = err.to_string();
        assert!(text.contains("is not spiffe://cluster.local/ns/ns1/sa/server"), "{text}");
        assert!(text.contains("spiffe://cluster.local/ns/ns1/sa/impostor"), "{text}");
    })
    .await
}

async fn connect_status(authority: impl FnOnce(IpAddr, SocketAddr) -> SocketAddr) -> StatusCode {
    let mut scene = Scene::new().await;
    let app = echo_app(scene.ip).await;
    let pool = scene.pool(PoolConfig::default());
    let target = authority(scene.ip, app);
    match pool.connect(&scene.request(target)).await {
        Err(ConnectError::Status { status, .. }) => {
            assert!(scene.server.finished.try_recv().is_err(), "a refused request reached the handler's splice");
            status
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[tokio::test]
async fn authority_ip_other_than_the_dialled_ip_gets_400() {
    let status = within(connect_status(|ip, app| {
        let IpAddr::V4(v4) = ip else { unreachable!() };
        let other = Ipv4Addr::from(u32::from(v4) + 1);
        SocketAddr::new(other.into(), app.port())
    }))
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn connect_to_proxy_ports_gets_503() {
    for port in [ports::OUTBOUND, ports::INBOUND_PLAINTEXT, ports::HBONE] {
        let status = within(connect_status(|ip, _| SocketAddr::new(ip, port))).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "port {port}");
    }
}

#[tokio::test]
async fn app_connect_failure_gets_503() {
    let status = within(connect_status(|ip, _| SocketAddr::new(ip, 1))).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
}

#[tokio::test]
async fn plain_get_gets_400_and_alpn_is_h2() {
    within(async {
        let scene = Scene::new().await;
        let app = echo_app(scene.ip).await;

        let tcp = TcpStream::connect(scene.server.addr).await.unwrap();
        let tls = scene.mesh.tls.connect(tcp, &scene.client, &id("server")).await.unwrap();
        assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
        assert_eq!(tls.get_ref().1.protocol_version(), Some(rustls::ProtocolVersion::TLSv1_3));
        let (send, connection) = h2::client::handshake(tls).await.unwrap();
        tokio::spawn(connection);
        let mut send = send.ready().await.unwrap();
        let get = http::Request::get(format!("http://{app}/")).body(()).unwrap();
        let (response, _) = send.send_request(get, true).unwrap();
        assert_eq!(response.await.unwrap().status(), StatusCode::BAD_REQUEST);
    })
    .await
}

#[tokio::test]
async fn client_without_h2_alpn_is_rejected() {
    within(async {
        let mut scene = Scene::new().await;
        let mut config = (*scene.mesh.tls.client_config(&scene.client, &id("server")).unwrap()).clone();
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        let result = raw_tls(config, scene.server.addr).await;
        assert!(result.is_err(), "handshake without h2 succeeded");
        let err = scene.server.handshake_errors.recv().await.unwrap().to_string();
        assert!(err.contains("protocol"), "{err}");
    })
    .await
}

#[tokio::test]
async fn tls12_client_is_rejected() {
    within(async {
        let mut scene = Scene::new().await;
        let client = &scene.client;
        let mut roots = rustls::RootCertStore::empty();
        roots.add(scene.mesh.ca.roots()[0].clone()).unwrap();
        let mut config =
            rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_protocol_versions(&[&rustls::version::TLS12])
                .unwrap()
                .with_root_certificates(roots)
                .with_client_auth_cert(client.chain().to_vec(), client.private_key())
                .unwrap();
        config.alpn_protocols = vec![b"h2".to_vec()];
        let err = raw_tls(config, scene.server.addr).await.unwrap_err().to_string();
        assert!(err.to_lowercase().contains("version"), "{err}");
        let server_err = scene.server.handshake_errors.recv().await.unwrap().to_string();
        assert!(server_err.contains("Tls12NotOffered"), "{server_err}");
    })
    .await
}

#[tokio::test]
async fn pool_reuses_one_connection_and_coalesces_concurrent_first_connects() {
    within(async {
        let scene = Scene::new().await;
        let app = echo_app(scene.ip).await;

        let pool = scene.pool(PoolConfig::default());
        for i in 0..3u8 {
            let stream = pool.connect(&scene.request(app)).await.unwrap();
            assert_eq!(exchange(stream, vec![i; 1000]).await, vec![i; 1000]);
        }
        assert_eq!(scene.server.accepted.load(Ordering::SeqCst), 1, "sequential streams share one connection");

        let fresh = scene.pool(PoolConfig::default());
        let other_client = Arc::new(scene.mesh.ca.mint(&id("other-client")).unwrap());
        let streams = (0..10u8).map(|i| {
            let pool = fresh.clone();
            let req = request(&other_client, &scene.server, &id("server"), app);
            tokio::spawn(async move {
                let stream = pool.connect(&req).await.unwrap();
                exchange(stream, vec![i; 5000]).await == vec![i; 5000]
            })
        });
        let results: Vec<_> = futures_join(streams).await;
        assert!(results.iter().all(|ok| *ok), "{results:?}");
        assert_eq!(scene.server.accepted.load(Ordering::SeqCst), 2, "10 concurrent first connects, one handshake");
        assert_eq!(fresh.connection_count(), 1);
    })
    .await
}

#[tokio::test]
async fn pool_respects_the_stream_cap_and_closes_idle_connections() {
    within(async {
        let scene = Scene::new().await;
        let (pool, _, open) = scene
            .three_streams(PoolConfig {
                max_streams_per_connection: 2,
                idle_timeout: Duration::from_millis(200),
                ..Default::default()
            })
            .await;
        assert_eq!(scene.server.accepted.load(Ordering::SeqCst), 2, "the third stream needed a second connection");
        assert_eq!(pool.connection_count(), 2);
        drop(open);
        eventually_async("the pool has no connections", || (pool.connection_count() == 0).then_some(())).await;
    })
    .await
}

#[tokio::test]
async fn after_a_burst_one_idle_connection_per_destination_is_kept_and_the_others_closed() {
    within(async {
        let scene = Scene::new().await;
        // The pool's idle timeout is an hour: only the surplus rule can close a connection in this test.
        let (pool, req, burst) = scene
            .three_streams(PoolConfig {
                max_streams_per_connection: 1,
                idle_timeout: Duration::from_secs(3600),
                ..Default::default()
            })
            .await;
        assert_eq!(pool.connection_count(), 3, "one stream per connection: the burst dialled three");
        drop(burst);
        eventually_async("the surplus idle connections are closed", || (pool.connection_count() == 1).then_some(()))
            .await;
        // The one kept is reused: a new stream dials nothing.
        let mut again = pool.connect(&req).await.unwrap();
        assert_eq!(scene.server.accepted.load(Ordering::SeqCst), 3, "the kept connection was reused");
        let mut buf = [0u8; 5];
        again.write_all(b"reuse").await.unwrap();
        again.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"reuse");
        assert_eq!(pool.connection_count(), 1);
    })
    .await
}

#[tokio::test]
async fn rotated_certificate_serves_new_connections_while_old_stream_flows() {
    within(async {
        let scene = Scene::new().await;
        let app = echo_app(scene.ip).await;
        let pool = scene.pool(PoolConfig::default());

        let mut old = pool.connect(&scene.request(app)).await.unwrap();
        let mut buf = [0u8; 5];
        old.write_all(b"first").await.unwrap();
        old.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"first");

        let rotated = scene.mesh.ca.mint(&id("server")).unwrap();
        scene.server.certs.set(scene.ip, &rotated).unwrap();

        let tcp = TcpStream::connect(scene.server.addr).await.unwrap();
        let tls = scene.mesh.tls.connect(tcp, &scene.client, &id("server")).await.unwrap();
        let presented = &tls.get_ref().1.peer_certificates().unwrap()[0];
        assert_eq!(presented, &rotated.chain()[0], "a new handshake presents the rotated certificate");

        old.write_all(b"after").await.unwrap();
        old.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"after", "the stream opened before rotation keeps flowing");
        old.shutdown().await.unwrap();
        assert_eq!(old.read(&mut buf).await.unwrap(), 0);
    })
    .await
}

/// A scene whose server drains for `deadline`, told to shut down while `pool` has a stream open to an echo app.
async fn shutdown_with_open_stream(deadline: Duration) -> (Scene, Pool, hbone::H2Stream) {
    let options = ServeOptions { drain_deadline: deadline, ..Default::default() };
    let scene = Scene::start("server", options).await;
    let app = echo_app(scene.ip).await;
    let pool = scene.pool(PoolConfig::default());
    let open = pool.connect(&scene.request(app)).await.unwrap();
    scene.server.shutdown.send(true).unwrap();
    (scene, pool, open)
}

#[tokio::test]
async fn graceful_shutdown_sends_goaway_and_drains_open_streams() {
    within(async {
        let (mut scene, pool, mut open) = shutdown_with_open_stream(Duration::from_secs(20)).await;
        // After GOAWAY the pool no longer gets streams on that connection: it dials a new one.
        eventually_async("the pool has no connections", || (pool.connection_count() == 0).then_some(())).await;

        let mut buf = [0u8; 5];
        open.write_all(b"drain").await.unwrap();
        open.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"drain", "the open stream still flows while draining");
        open.shutdown().await.unwrap();
        assert_eq!(open.read(&mut buf).await.unwrap(), 0);
        drop(open);
        let served = scene.server.served.recv().await.unwrap().expect("drained before the deadline");
        assert_eq!(served, hbone::Ended::Drained);
    })
    .await
}

#[tokio::test]
async fn drain_deadline_cuts_streams_that_do_not_finish() {
    within(async {
        let (mut scene, _pool, mut open) = shutdown_with_open_stream(Duration::from_millis(300)).await;
        let served = scene.server.served.recv().await.unwrap();
        assert!(matches!(served, Err(hbone::ServeError::DrainDeadline(_))), "{served:?}");
        let mut buf = [0u8; 1];
        assert!(open.read(&mut buf).await.map(|n| n == 0).unwrap_or(true), "the cut stream ends");
    })
    .await
}

#[tokio::test]
async fn one_acceptor_presents_the_certificate_of_the_dialled_ip() {
    within(async {
        let mesh = new_mesh();
        let (ip_a, ip_b, ip_none) = (next_ip(), next_ip(), next_ip());
        let certs = ServerCerts::new();
        certs.set(ip_a, &mesh.ca.mint(&id("a")).unwrap()).unwrap();
        certs.set(ip_b, &mesh.ca.mint(&id("b")).unwrap()).unwrap();
        let inbound = InboundTls::new(mesh.tls.clone(), certs);
        let client = mesh.ca.mint(&id("client")).unwrap();
        for (ip, expected) in [(ip_a, Some("a")), (ip_b, Some("b")), (ip_none, None)] {
            let listener = TcpListener::bind((ip, 0)).await.unwrap();
            let addr = listener.local_addr().unwrap();
            let inbound = inbound.clone();
            let server = tokio::spawn(async move { inbound.accept(listener.accept().await.unwrap().0).await });
            // The client accepts only the expected identity, so success shows which certificate was presented.
            let dialled = TcpStream::connect(addr).await.unwrap();
            let result = mesh.tls.connect(dialled, &client, &id(expected.unwrap_or("a"))).await;
            let accepted = server.await.unwrap();
            match expected {
                Some(_) => {
                    result.unwrap();
                    let accepted = accepted.unwrap();
                    assert_eq!(accepted.peer_identity, id("client"));
                    assert_eq!(accepted.local, addr);
                }
                None => assert!(result.is_err() && accepted.is_err(), "no certificate for {ip}"),
            }
        }
    })
    .await
}

/// One bulk HBONE DATA frame as h2 writes it: the 9-byte frame header, then `hbone::copy`'s largest read (256 KiB).
const BULK_FRAME: [usize; 2] = [9, 256 * 1024];

#[tokio::test]
async fn both_ends_take_a_whole_bulk_frame_in_one_vectored_write() {
    within(async {
        let mesh = new_mesh();
        let ip = next_ip();
        let certs = ServerCerts::new();
        certs.set(ip, &mesh.ca.mint(&id("server")).unwrap()).unwrap();
        let inbound = InboundTls::new(mesh.tls.clone(), certs);
        let client = mesh.ca.mint(&id("client")).unwrap();
        let listener = TcpListener::bind((ip, 0)).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move { inbound.accept(listener.accept().await.unwrap().0).await });
        let dialled = TcpStream::connect(addr).await.unwrap();
        let mut client_tls = mesh.tls.connect(dialled, &client, &id("server")).await.unwrap();
        let mut server_tls = server.await.unwrap().unwrap().stream;
        let (header, payload) = (vec![0u8; BULK_FRAME[0]], vec![7u8; BULK_FRAME[1]]);
        let frame = [std::io::IoSlice::new(&header), std::io::IoSlice::new(&payload)];
        let whole = BULK_FRAME.iter().sum::<usize>();
        // With rustls's default 64 KiB send queue each call took a quarter of the frame (one more writev each).
        assert_eq!(client_tls.write_vectored(&frame).await.unwrap(), whole, "client side");
        assert_eq!(server_tls.write_vectored(&frame).await.unwrap(), whole, "server side");
    })
    .await
}

/// A TCP relay on `ip` to `target` that stops forwarding (but keeps both sockets open) once frozen.
async fn freezing_relay(ip: IpAddr, target: SocketAddr) -> (SocketAddr, watch::Sender<bool>) {
    let listener = TcpListener::bind((ip, 0)).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (freeze, mut frozen) = watch::channel(false);
    tokio::spawn(async move {
        let (mut inbound, _) = listener.accept().await.unwrap();
        let mut outbound = TcpStream::connect(target).await.unwrap();
        let frozen = async move { frozen.wait_for(|f| *f).await.is_ok() };
        if tokio::select! {
            _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => false,
            is_frozen = frozen => is_frozen,
        } {
            // Hold both sockets open without moving a byte.
            std::future::pending::<()>().await;
        }
    });
    (addr, freeze)
}

#[tokio::test]
async fn keepalive_drops_a_connection_whose_peer_stops_answering_pings() {
    within(async {
        let scene = Scene::new().await;
        let app = echo_app(scene.ip).await;
        let relay_ip = next_ip();
        let (relay, freeze) = freezing_relay(relay_ip, scene.server.addr).await;
        let pool = scene.pool(PoolConfig {
            keepalive: hbone::Keepalive { interval: Duration::from_millis(100), timeout: Duration::from_millis(300) },
            ..Default::default()
        });
        let mut req = scene.request(app);
        req.dst = relay;
        let mut stream = pool.connect(&req).await.unwrap();
        let mut buf = [0u8; 4];
        stream.write_all(b"ping").await.unwrap();
        stream.read_exact(&mut buf).await.unwrap();
        assert_eq!(pool.connection_count(), 1);

        freeze.send(true).unwrap();
        eventually_async("the pool has no connections", || (pool.connection_count() == 0).then_some(())).await;
        assert!(stream.read(&mut buf).await.is_err(), "the stream of a dropped connection fails");
    })
    .await
}

async fn futures_join<T: Send + 'static>(handles: impl Iterator<Item = tokio::task::JoinHandle<T>>) -> Vec<T> {
    let mut out = Vec::new();
    for handle in handles.collect::<Vec<_>>() {
        out.push(handle.await.unwrap());
    }
    out
}

/// TLS and an HTTP/2 handshake to the scene's server as its client, with h2's own client (no HBONE pool), so a
/// test can send what the pool never would.
async fn raw_h2(
    scene: &Scene,
) -> (h2::client::SendRequest<bytes::Bytes>, tokio::task::JoinHandle<Result<(), h2::Error>>) {
    let tcp = TcpStream::connect(scene.server.addr).await.unwrap();
    let tls = scene.mesh.tls.connect(tcp, &scene.client, &id("server")).await.unwrap();
    let (send, connection) = h2::client::handshake(tls).await.unwrap();
    (send, tokio::spawn(connection))
}

fn connect_request(authority: SocketAddr) -> http::Request<()> {
    http::Request::builder().method(http::Method::CONNECT).uri(authority.to_string()).body(()).unwrap()
}

/// On the single-threaded test runtime nothing runs between these sends, so all of them leave before the
/// server's SETTINGS are read: h2 assumes no stream limit until then, and the server alone enforces its own.
fn burst(
    send: &h2::client::SendRequest<bytes::Bytes>,
    requests: impl Iterator<Item = http::Request<()>>,
) -> Vec<(h2::client::ResponseFuture, h2::SendStream<bytes::Bytes>)> {
    requests.map(|request| send.clone().send_request(request, false).unwrap()).collect()
}

#[tokio::test]
async fn server_serves_at_most_100_streams_at_once_and_refuses_the_rest() {
    within(async {
        let scene = Scene::new().await;
        let app = echo_app(scene.ip).await;
        let (send, _connection) = raw_h2(&scene).await;
        let sent = burst(&send, (0..150).map(|_| connect_request(app)));
        let (mut ok, mut refused, mut held) = (0, 0, Vec::new());
        for (response, body) in sent {
            match response.await {
                Ok(response) => {
                    assert_eq!(response.status(), StatusCode::OK);
                    ok += 1;
                    // Kept open, so every accepted stream still counts against the limit.
                    held.push((response, body));
                }
                Err(e) => {
                    assert_eq!(e.reason(), Some(h2::Reason::REFUSED_STREAM), "{e}");
                    refused += 1;
                }
            }
        }
        assert_eq!((ok, refused), (100, 50), "served at once and refused");
        assert_eq!(send.current_max_send_streams(), hbone::settings::MAX_CONCURRENT_STREAMS as usize);
    })
    .await
}

#[tokio::test]
async fn a_header_list_over_16_kib_is_refused_and_never_reaches_the_app() {
    within(async {
        let scene = Scene::new().await;
        let app = echo_app(scene.ip).await;
        let (send, _connection) = raw_h2(&scene).await;
        // One stream first: once it is answered the server's SETTINGS are known, so h2 sends the big header list
        // in frames of the server's 1 MiB maximum (in 16 KiB frames it would trip h2's CONTINUATION flood guard).
        let (first, _first_body) = burst(&send, std::iter::once(connect_request(app))).remove(0);
        assert_eq!(first.await.unwrap().status(), StatusCode::OK);
        let mut big = connect_request(app);
        big.headers_mut().insert("x-big", http::HeaderValue::from_str(&"a".repeat(1024 * 1024)).unwrap());
        let (response, _body) = send.clone().ready().await.unwrap().send_request(big, false).unwrap();
        // 431 for the stream, or GOAWAY for the connection; never the 200 that follows connecting to the app.
        match response.await {
            Ok(response) => assert_eq!(response.status(), StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE),
            Err(e) => assert!(e.is_go_away() || e.is_reset(), "{e}"),
        }
    })
    .await
}

/// A stream whose writes wait until a moment has passed: an HTTP/2 server on it sends its SETTINGS late.
struct LateWrites<T> {
    inner: T,
    delay: std::pin::Pin<Box<tokio::time::Sleep>>,
}

impl<T: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for LateWrites<T> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for LateWrites<T> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::task::ready!(self.delay.as_mut().poll(cx));
        std::pin::Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::ready!(self.delay.as_mut().poll(cx));
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// An mTLS HTTP/2 server that allows `max_streams` concurrent streams, sends its SETTINGS 200 ms late, answers
/// every CONNECT with 200 and holds the stream until the client ends it. Yields the server address and the most
/// streams any one connection had open at once.
async fn strict_slow_server(mesh: &Mesh, ip: IpAddr, max_streams: u32) -> (SocketAddr, Arc<AtomicUsize>) {
    let certs = ServerCerts::new();
    certs.set(ip, &mesh.ca.mint(&id("server")).unwrap()).unwrap();
    let inbound = InboundTls::new(mesh.tls.clone(), certs);
    let listener = TcpListener::bind((ip, 0)).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let peak = Arc::new(AtomicUsize::new(0));
    let most = peak.clone();
    tokio::spawn(async move {
        loop {
            let accepted = inbound.accept(listener.accept().await.unwrap().0).await.unwrap();
            let late =
                LateWrites { inner: accepted.stream, delay: Box::pin(tokio::time::sleep(Duration::from_millis(200))) };
            let most = most.clone();
            tokio::spawn(async move {
                let mut conn = h2::server::Builder::new()
                    .max_concurrent_streams(max_streams)
                    .handshake::<_, bytes::Bytes>(late)
                    .await
                    .unwrap();
                let open = Arc::new(AtomicUsize::new(0));
                while let Some(Ok((request, mut respond))) = conn.accept().await {
                    let now = open.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    let send = respond.send_response(http::Response::new(()), false).unwrap();
                    let open = open.clone();
                    tokio::spawn(async move {
                        let mut body = request.into_body();
                        while let Some(Ok(_)) = body.data().await {}
                        drop(send);
                        open.fetch_sub(1, Ordering::SeqCst);
                    });
                }
            });
        }
    });
    (addr, peak)
}

#[tokio::test]
async fn pool_never_has_more_streams_on_a_connection_than_the_server_allows() {
    within(async {
        let mesh = new_mesh();
        let ip = next_ip();
        let (addr, peak) = strict_slow_server(&mesh, ip, 2).await;
        // The pool would take 10 streams per connection; the server allows 2, and says so late.
        let pool = Pool::new(
            mesh.tls.clone(),
            PoolConfig {
                max_streams_per_connection: 10,
                connect_timeout: Duration::from_secs(5),
                ..Default::default()
            },
        );
        let client = Arc::new(mesh.ca.mint(&id("client")).unwrap());
        let req = ConnectRequest {
            src: client,
            src_addr: "10.1.2.3:40000".parse().unwrap(),
            dst: addr,
            dst_identity: id("server"),
            authority: SocketAddr::new(ip, 1),
            baggage: Baggage::default(),
            extra_headers: Default::default(),
        };
        let opens = (0..6).map(|_| {
            let (pool, req) = (pool.clone(), req.clone());
            tokio::spawn(async move { pool.connect(&req).await })
        });
        let streams: Vec<_> = futures_join(opens).await;
        let failed: Vec<String> = streams.iter().filter_map(|s| s.as_ref().err().map(|e| e.to_string())).collect();
        assert!(failed.is_empty(), "{} of 6 streams failed: {failed:?}", failed.len());
        assert_eq!(pool.connection_count(), 3, "two streams on each of three connections");
        assert_eq!(peak.load(Ordering::SeqCst), 2, "most streams open at once on one connection");
    })
    .await
}

#[tokio::test]
async fn connections_without_streams_are_closed_after_the_idle_timeout() {
    within(async {
        let idle = Duration::from_millis(300);
        let mut scene = Scene::start("server", ServeOptions { idle_timeout: idle, ..Default::default() }).await;
        let app = echo_app(scene.ip).await;

        // Never used: closed with GOAWAY once idle.
        let started = tokio::time::Instant::now();
        let (_send, connection) = raw_h2(&scene).await;
        connection.await.unwrap().expect("the server closes the idle connection gracefully");
        assert!(started.elapsed() >= idle, "closed after {:?}", started.elapsed());
        assert_eq!(scene.server.served.recv().await.unwrap().unwrap(), hbone::Ended::IdleTimeout);

        // Used, then idle: the timer starts when the last stream ends.
        let pool = scene.pool(PoolConfig::default());
        let stream = pool.connect(&scene.request(app)).await.unwrap();
        assert_eq!(exchange(stream, b"once".to_vec()).await, b"once");
        eventually_async("the idle connection left the pool", || (pool.connection_count() == 0).then_some(())).await;
        assert_eq!(scene.server.served.recv().await.unwrap().unwrap(), hbone::Ended::IdleTimeout);

        // TLS but never an HTTP/2 preface: cut when the idle timeout passes.
        let tcp = TcpStream::connect(scene.server.addr).await.unwrap();
        let mut tls = scene.mesh.tls.connect(tcp, &scene.client, &id("server")).await.unwrap();
        let mut rest = Vec::new();
        let _ = tls.read_to_end(&mut rest).await;
        let served = scene.server.served.recv().await.unwrap();
        assert!(matches!(served, Err(hbone::ServeError::HandshakeTimeout(_))), "{served:?}");
    })
    .await
}

#[tokio::test]
async fn client_offering_no_alpn_is_refused_with_an_alert() {
    within(async {
        let mut scene = Scene::new().await;
        let mut config = (*scene.mesh.tls.client_config(&scene.client, &id("server")).unwrap()).clone();
        config.alpn_protocols = Vec::new();
        let err = raw_tls(config, scene.server.addr).await.unwrap_err().to_string();
        assert!(err.contains("NoApplicationProtocol"), "{err}");
        let server_err = scene.server.handshake_errors.recv().await.unwrap();
        assert!(matches!(server_err, TlsError::NoAlpn { .. }), "{server_err}");
    })
    .await
}

#[tokio::test]
async fn refused_connections_get_goaway_refused_stream() {
    within(async {
        let mesh = new_mesh();
        let ip = next_ip();
        let certs = ServerCerts::new();
        certs.set(ip, &mesh.ca.mint(&id("server")).unwrap()).unwrap();
        let listener = TcpListener::bind((ip, 0)).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let inbound = InboundTls::new(mesh.tls.clone(), certs);
        let limiter = hbone::ConnectionLimiter::new(hbone::ConnectionCaps { total: 10, per_identity: 1 });
        tokio::spawn(async move {
            let mut permits = Vec::new();
            loop {
                let accepted = inbound.accept(listener.accept().await.unwrap().0).await.unwrap();
                match limiter.try_acquire(&accepted.peer_identity) {
                    Ok(permit) => permits.push((permit, accepted)),
                    Err(over) => hbone::refuse(accepted, &over.to_string()).await,
                }
            }
        });
        let client = mesh.ca.mint(&id("client")).unwrap();
        let first = mesh.tls.connect(TcpStream::connect(addr).await.unwrap(), &client, &id("server")).await.unwrap();
        let second = mesh.tls.connect(TcpStream::connect(addr).await.unwrap(), &client, &id("server")).await.unwrap();
        let (send, connection) = h2::client::handshake(second).await.unwrap();
        let connection = tokio::spawn(connection);
        let authority = SocketAddr::new(ip, 1);
        let result = send.ready().await.and_then(|mut send| send.send_request(connect_request(authority), true));
        let err = match result {
            Ok((response, _)) => response.await.unwrap_err(),
            Err(e) => e,
        };
        assert_eq!(err.reason(), Some(h2::Reason::REFUSED_STREAM), "{err}");
        assert!(err.is_go_away() && err.is_remote(), "{err}");
        let _ = connection.await;
        drop(first);
    })
    .await
}

/// An app on `ip` that accepts connections and never reads; dropping the returned sender closes them all.
async fn non_reading_app(ip: IpAddr) -> (SocketAddr, watch::Sender<()>) {
    let listener = TcpListener::bind((ip, 0)).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (close, mut closed) = watch::channel(());
    tokio::spawn(async move {
        let mut held = Vec::new();
        loop {
            tokio::select! {
                accepted = listener.accept() => held.push(accepted.unwrap().0),
                _ = closed.changed() => return,
            }
        }
    });
    (addr, close)
}

/// A destination pod whose app never reads fills only its own share of the server's budget (the server stops
/// reading those connections), the client pod pushing into it only its own share of the client's; another pod's
/// tunnel through the same two budgets keeps carrying bytes, and once the app closes, everything is given back.
#[tokio::test]
async fn a_target_that_never_reads_fills_only_its_pods_share_and_everything_is_given_back() {
    const SHARE: usize = 1 << 20;
    within(async {
        let mesh = new_mesh();
        let (server_node, client_node) = (MemoryBudget::new(8 * SHARE, SHARE), MemoryBudget::new(8 * SHARE, SHARE));
        let (ip_b, ip_d) = (next_ip(), next_ip());
        let b =
            start_server_budgeted(&mesh, ip_b, &id("b"), ServeOptions::default(), Some(server_node.account())).await;
        let d =
            start_server_budgeted(&mesh, ip_d, &id("d"), ServeOptions::default(), Some(server_node.account())).await;
        let (hold, close) = non_reading_app(ip_b).await;
        let echo = echo_app(ip_d).await;
        let pool = |memory| Pool::new(mesh.tls.clone(), PoolConfig { memory: Some(memory), ..PoolConfig::default() });
        let (pusher_pool, other_pool) = (pool(client_node.account()), pool(client_node.account()));
        let (a, c) = (Arc::new(mesh.ca.mint(&id("a")).unwrap()), Arc::new(mesh.ca.mint(&id("c")).unwrap()));

        let mut tunnels = Vec::new();
        for _ in 0..4 {
            tunnels.push(pusher_pool.connect(&request(&a, &b, &id("b"), hold)).await.unwrap());
        }
        let pushed = Arc::new(AtomicUsize::new(0));
        let pushers: Vec<_> = tunnels
            .into_iter()
            .map(|mut tunnel| {
                let pushed = pushed.clone();
                tokio::spawn(async move {
                    let chunk = vec![0x5a_u8; 64 * 1024];
                    while tunnel.write_all(&chunk).await.is_ok() {
                        pushed.fetch_add(chunk.len(), Ordering::Relaxed);
                    }
                })
            })
            .collect();
        eventually_async("the non-reading pod's share on the server is full", || {
            (server_node.held() >= SHARE / 2).then_some(())
        })
        .await;
        // Another client pod to another destination pod, meanwhile: every byte comes back.
        let data = random_bytes(4 << 20);
        let mut other = other_pool.connect(&request(&c, &d, &id("d"), echo)).await.unwrap();
        let (mut r, mut w) = tokio::io::split(&mut other);
        let (_, back) = tokio::join!(
            async {
                w.write_all(&data).await.unwrap();
                w.shutdown().await.unwrap();
            },
            async {
                let mut back = Vec::new();
                r.read_to_end(&mut back).await.unwrap();
                back
            }
        );
        assert!(back == data, "the other pod's echo came back whole ({} of {} bytes)", back.len(), data.len());
        // A read or an HTTP/2 frame past the share at most.
        let slack = 2 << 20;
        assert!(server_node.held() <= SHARE + slack, "the server holds {} bytes", server_node.held());
        assert!(client_node.held() <= SHARE + slack, "the client holds {} bytes", client_node.held());
        assert!(pushed.load(Ordering::Relaxed) < 64 << 20, "the pusher was held back");

        drop(close);
        for pusher in pushers {
            pusher.await.unwrap();
        }
        eventually_async("both budgets are given back", || {
            (server_node.held() == 0 && client_node.held() == 0).then_some(())
        })
        .await;
    })
    .await;
}

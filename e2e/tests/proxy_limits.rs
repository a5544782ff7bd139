//! The limits of the HBONE server on 15008 (issue #14), against the real `hbone-proxy` on a node with ambient pods
//! A and B. A mesh client of the test's own (a valid workload certificate from the scene's CA, dialling from A's
//! netns like A's proxy would) does what a hostile peer would:
//!
//! - 1,000 streams on one connection: B's app never sees more than the advertised 100 at once;
//! - a 1 MiB header list: refused (GOAWAY), the app never sees it;
//! - 500 idle mTLS connections: closed after `HBONE_SERVER_IDLE_TIMEOUT`, with or without an HTTP/2 preface;
//! - a TLS client offering no ALPN: refused in the handshake;
//! - connections over `HBONE_MAX_CONNECTIONS_PER_IDENTITY` and `HBONE_MAX_CONNECTIONS`: refused (GOAWAY
//!   REFUSED_STREAM) until a place is free.
//!
//! Each refusal is counted in `hbone_connections_refused_total` or `hbone_connections_terminated_total`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use hbone::Identity;
use istio_contract::ports;
use testbed::wait::{eventually, eventually_async};

mod support;
use support::mesh_client::{connect_request, dial_marked, h2_client, tls, MeshClient, Tls};
use support::{metric, open_fds, APP_PORT, NS, TD};

/// The proxy's advertised `SETTINGS_MAX_CONCURRENT_STREAMS` (ztunnel's).
const MAX_STREAMS: usize = 100;

/// The shared scene with a mesh CA the test made (`CA_DIR`), so its own clients get valid workload certificates.
struct Scene {
    base: support::Scene,
    client: MeshClient,
}

impl Scene {
    fn new(env: &[(&str, &str)]) -> Self {
        let base = support::Scene::with_test_ca("b-sa", env);
        Scene { client: MeshClient::new(&base.cacerts(), TD), base }
    }

    fn b_identity(&self) -> Identity {
        Identity::new(TD, NS, "b-sa").expect("B's identity")
    }

    fn b_app(&self) -> SocketAddr {
        SocketAddr::from((self.base.b.ip, APP_PORT))
    }

    /// The mesh client config of service account `sa` dialling B.
    fn config(&self, sa: &str) -> Arc<rustls::ClientConfig> {
        let cert = self.client.cert(&Identity::new(TD, NS, sa).expect("identity"));
        Arc::new(self.client.config(&cert, &self.b_identity()))
    }

    /// `n` TCP connections from A's netns (with the proxy mark) to B's HBONE port.
    fn dial_b(&self, n: usize) -> Vec<std::net::TcpStream> {
        dial_marked(&self.base.a.netns.path(), SocketAddr::from((self.base.b.ip, ports::HBONE)), n)
            .expect("A reaches B's HBONE port")
    }

    /// mTLS as `sa` to B's HBONE port.
    async fn tls_as(&self, sa: &str) -> std::io::Result<Tls> {
        let tcp = self.dial_b(1).remove(0);
        tls(self.config(sa), tcp).await
    }

    /// A metric of the proxy's (0 when it has no such line yet).
    fn metric(&self, line_prefix: &str) -> f64 {
        metric(&self.base.cluster.node.netns().path(), line_prefix).unwrap_or(0.0)
    }
}

/// An echo app that counts the connections it holds now, at most at once, and in all.
#[derive(Clone, Default)]
struct Counting {
    now: Arc<AtomicUsize>,
    peak: Arc<AtomicUsize>,
    accepted: Arc<AtomicUsize>,
}

impl Counting {
    fn start(listener: TcpListener) -> Self {
        let app = Counting::default();
        let counts = app.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { return };
                counts.accepted.fetch_add(1, Ordering::SeqCst);
                let now = counts.now.fetch_add(1, Ordering::SeqCst) + 1;
                counts.peak.fetch_max(now, Ordering::SeqCst);
                let counts = counts.clone();
                std::thread::spawn(move || {
                    let mut buf = [0u8; 4096];
                    while let Ok(n) = stream.read(&mut buf) {
                        if n == 0 || stream.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                    let _ = stream.shutdown(std::net::Shutdown::Write);
                    counts.now.fetch_sub(1, Ordering::SeqCst);
                });
            }
        });
        app
    }

    fn now(&self) -> usize {
        self.now.load(Ordering::SeqCst)
    }

    fn peak(&self) -> usize {
        self.peak.load(Ordering::SeqCst)
    }

    fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }
}

/// Runs `test` on a single-threaded runtime: between two awaits nothing else runs, in particular not the h2
/// connection tasks, so a burst of sends leaves together, before any frame of the server is read.
fn single_threaded<T>(test: impl std::future::Future<Output = T>) -> T {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio runtime");
    runtime.block_on(async { tokio::time::timeout(Duration::from_secs(240), test).await.expect("test timed out") })
}

/// One CONNECT through `send` to `authority`: sends `payload`, ends the stream and reads the echo to its end.
async fn echo_round(send: h2::client::SendRequest<Bytes>, authority: SocketAddr, payload: Bytes) -> Result<(), String> {
    let mut send = send.ready().await.map_err(|e| format!("ready: {e}"))?;
    let (response, mut body) =
        send.send_request(connect_request(authority), false).map_err(|e| format!("send: {e}"))?;
    let response = response.await.map_err(|e| format!("response: {e}"))?;
    if response.status() != http::StatusCode::OK {
        return Err(format!("status {}", response.status()));
    }
    body.send_data(payload.clone(), true).map_err(|e| format!("data: {e}"))?;
    let mut recv = response.into_body();
    let mut echoed = Vec::new();
    while let Some(chunk) = recv.data().await {
        let chunk = chunk.map_err(|e| format!("echo: {e}"))?;
        let _ = recv.flow_control().release_capacity(chunk.len());
        echoed.extend_from_slice(&chunk);
    }
    (echoed == payload).then_some(()).ok_or_else(|| format!("echoed {echoed:?}, sent {payload:?}"))
}

#[test]
fn one_connection_is_served_at_most_the_advertised_100_streams_at_once() {
    let scene = Scene::new(&[]);
    let app = Counting::start(scene.base.b_listener());
    let b_app = scene.b_app();
    single_threaded(async {
        let tls = scene.tls_as("tester").await.expect("mTLS to B");
        let (send, connection) = h2_client(tls).await.expect("HTTP/2 handshake");
        // 1,000 CONNECTs at once, before the proxy's SETTINGS are read: h2 assumes no limit until then, so all of
        // them go out, and the proxy alone enforces its limit.
        let sent: Vec<_> = (0..1000)
            .map(|_| send.clone().send_request(connect_request(b_app), false).expect("send a CONNECT"))
            .collect();
        let (mut held, mut refused) = (Vec::new(), 0);
        for (response, body) in sent {
            match response.await {
                Ok(response) => {
                    assert_eq!(response.status(), http::StatusCode::OK);
                    // Kept open: each counts against the limit until dropped.
                    held.push((response, body));
                }
                Err(e) if e.reason() == Some(h2::Reason::REFUSED_STREAM) => refused += 1,
                Err(e) => panic!("a stream failed other than by REFUSED_STREAM: {e}"),
            }
        }
        assert_eq!(send.current_max_send_streams(), MAX_STREAMS, "the proxy's SETTINGS_MAX_CONCURRENT_STREAMS");
        assert_eq!((held.len(), refused), (MAX_STREAMS, 1000 - MAX_STREAMS), "(served, refused)");
        eventually_async("B's app holds the 100 tunnels", || (app.now() == MAX_STREAMS).then_some(())).await;
        assert_eq!(app.peak(), MAX_STREAMS, "B's app never held more than 100 tunnels of the connection");
        drop(held);
        eventually_async("B's app holds no tunnel", || (app.now() == 0).then_some(())).await;

        // A client that keeps to the limit it now knows gets all of 1,000 more streams served on the same
        // connection, never more than 100 at once.
        let rounds: Vec<_> = (0..1000)
            .map(|i| tokio::spawn(echo_round(send.clone(), b_app, Bytes::from(format!("stream {i}")))))
            .collect();
        for round in rounds {
            round.await.expect("echo task").expect("an echo round trip within the limit");
        }
        assert_eq!(app.accepted(), 2 * MAX_STREAMS + 1000 - MAX_STREAMS, "every served stream reached B's app");
        assert_eq!(app.peak(), MAX_STREAMS, "B's app never held more than 100 tunnels of the connection");
        assert!(!connection.is_finished(), "the connection survived the refusals");
    });
}

#[test]
fn a_1_mib_header_list_is_refused_and_never_reaches_the_app() {
    let scene = Scene::new(&[]);
    let app = Counting::start(scene.base.b_listener());
    let b_app = scene.b_app();
    single_threaded(async {
        let tls = scene.tls_as("tester").await.expect("mTLS to B");
        let (send, connection) = h2_client(tls).await.expect("HTTP/2 handshake");
        // One ordinary stream first; once it is answered the proxy's SETTINGS are known, so h2 sends the big
        // header list in frames of the proxy's 1 MiB maximum, as a client that means it would.
        echo_round(send.clone(), b_app, Bytes::from_static(b"before")).await.expect("an ordinary CONNECT");
        let mut big = connect_request(b_app);
        big.headers_mut().insert("x-big", http::HeaderValue::from_str(&"a".repeat(1024 * 1024)).expect("value"));
        let mut ready = send.clone().ready().await.expect("ready");
        let (response, _body) = ready.send_request(big, false).expect("send the big CONNECT");
        let err = response.await.expect_err("a 1 MiB header list was answered");
        assert_eq!(err.reason(), Some(h2::Reason::ENHANCE_YOUR_CALM), "{err}");
        assert!(err.is_go_away() && err.is_remote(), "the proxy ended the connection with GOAWAY: {err}");
        let _ = connection.await;
    });
    assert_eq!(app.accepted(), 1, "only the ordinary CONNECT reached B's app");
    let counted = r#"hbone_connections_terminated_total{reason="enhance_your_calm"}"#;
    eventually("the GOAWAY is counted", || (scene.metric(counted) == 1.0).then_some(()));
    // The proxy goes on serving B.
    single_threaded(async {
        let (send, _connection) = h2_client(scene.tls_as("tester").await.expect("mTLS")).await.expect("HTTP/2");
        echo_round(send, b_app, Bytes::from_static(b"after")).await.expect("a CONNECT after the refusal");
    });
}

#[test]
fn idle_mtls_connections_are_closed_after_the_idle_timeout() {
    const IDLE: Duration = Duration::from_secs(2);
    const WITH_HTTP2: usize = 450;
    const TLS_ONLY: usize = 50;
    let scene = Scene::new(&[("HBONE_SERVER_IDLE_TIMEOUT", "2s")]);
    let pid = scene.base.proxy.pid();
    let baseline = open_fds(pid);
    let config = scene.config("tester");
    let sockets = scene.dial_b(WITH_HTTP2 + TLS_ONLY);
    let runtime = tokio::runtime::Runtime::new().expect("tokio runtime");
    runtime.block_on(async {
        // Each connection: mTLS, then (for most) the HTTP/2 handshake; then nothing. Yields when the proxy's timer
        // can have started at the earliest (before the client's last handshake step, which the proxy waits for)
        // and when the connection ended, which only the proxy makes happen.
        let handshakes = Arc::new(tokio::sync::Semaphore::new(50));
        let connections: Vec<_> = sockets
            .into_iter()
            .enumerate()
            .map(|(i, tcp)| {
                let (config, handshakes) = (config.clone(), handshakes.clone());
                tokio::spawn(async move {
                    let permit = handshakes.acquire_owned().await.expect("semaphore");
                    let before_tls = Instant::now();
                    let mut tls = tls(config, tcp).await.expect("mTLS to B");
                    if i < WITH_HTTP2 {
                        let ready = Instant::now();
                        let (_send, connection) = h2_client(tls).await.expect("HTTP/2 handshake");
                        drop(permit);
                        // Closed after GOAWAY; h2 may still report the peer's close as a broken pipe.
                        let _ended = connection.await.expect("connection task");
                        (ready, Instant::now())
                    } else {
                        let ready = before_tls;
                        drop(permit);
                        let mut rest = Vec::new();
                        let _ = tokio::io::AsyncReadExt::read_to_end(&mut tls, &mut rest).await;
                        (ready, Instant::now())
                    }
                })
            })
            .collect();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        for (i, connection) in connections.into_iter().enumerate() {
            let (ready, closed) = tokio::time::timeout_at(deadline, connection)
                .await
                .unwrap_or_else(|_| panic!("connection {i} still open 60 s on (idle timeout {IDLE:?})"))
                .expect("connection task");
            assert!(closed - ready >= IDLE, "connection {i} was closed after {:?}", closed - ready);
        }
    });
    let counted = |reason: &str| scene.metric(&format!(r#"hbone_connections_terminated_total{{reason="{reason}"}}"#));
    eventually("the closes are counted", || (counted("idle_timeout") == WITH_HTTP2 as f64).then_some(()));
    assert_eq!(counted("handshake_timeout"), TLS_ONLY as f64, "connections without an HTTP/2 preface");
    eventually("the proxy let go of the connections' descriptors", || (open_fds(pid) <= baseline + 50).then_some(()));
}

#[test]
fn a_tls_client_offering_no_alpn_is_refused() {
    let scene = Scene::new(&[]);
    let app = Counting::start(scene.base.b_listener());
    let b_app = scene.b_app();
    single_threaded(async {
        let mut config = (*scene.config("tester")).clone();
        config.alpn_protocols = Vec::new();
        let tcp = scene.dial_b(1).remove(0);
        let err = tls(Arc::new(config), tcp).await.expect_err("a handshake without ALPN succeeded");
        assert!(err.to_string().contains("NoApplicationProtocol"), "refused with an alert: {err}");
        // The same client offering h2 gets through: the refusal is about ALPN.
        let (send, _connection) = h2_client(scene.tls_as("tester").await.expect("mTLS")).await.expect("HTTP/2");
        echo_round(send, b_app, Bytes::from_static(b"h2")).await.expect("a CONNECT with ALPN h2");
    });
    assert_eq!(app.accepted(), 1, "only the client offering h2 reached B's app");
    let counted = r#"hbone_connections_refused_total{reason="no_alpn"}"#;
    eventually("the refusal is counted", || (scene.metric(counted) == 1.0).then_some(()));
}

/// A connection of service account `sa` to B with one CONNECT answered 200, kept open (so the proxy counts it);
/// or the error that refused it.
async fn hold(scene: &Scene, sa: &str) -> Result<Held, h2::Error> {
    let (send, connection) = h2_client(scene.tls_as(sa).await.expect("mTLS to B")).await?;
    let mut ready = send.clone().ready().await?;
    let (response, body) = ready.send_request(connect_request(scene.b_app()), false)?;
    let response = response.await?;
    assert_eq!(response.status(), http::StatusCode::OK);
    Ok(Held { _send: send, _body: body, connection })
}

/// An open HBONE connection with one tunnel; dropping it closes the connection.
struct Held {
    _send: h2::client::SendRequest<Bytes>,
    _body: h2::SendStream<Bytes>,
    connection: tokio::task::JoinHandle<Result<(), h2::Error>>,
}

impl Drop for Held {
    fn drop(&mut self) {
        self.connection.abort();
    }
}

#[test]
fn connections_over_the_per_identity_and_node_caps_are_refused() {
    let scene = Scene::new(&[("HBONE_MAX_CONNECTIONS", "5"), ("HBONE_MAX_CONNECTIONS_PER_IDENTITY", "3")]);
    let _app = Counting::start(scene.base.b_listener());
    let refused = |reason: &str| scene.metric(&format!(r#"hbone_connections_refused_total{{reason="{reason}"}}"#));
    let over = |result: Result<_, h2::Error>, what: &str| {
        let Err(err) = result else { panic!("{what} was served") };
        assert_eq!(err.reason(), Some(h2::Reason::REFUSED_STREAM), "{what}: {err}");
        assert!(err.is_go_away() && err.is_remote(), "{what}: refused with GOAWAY: {err}");
    };
    single_threaded(async {
        let mut x = Vec::new();
        for _ in 0..3 {
            x.push(hold(&scene, "x").await.expect("x's connections up to its cap"));
        }
        over(hold(&scene, "x").await, "x's fourth connection");
        let _y = [hold(&scene, "y").await.expect("y's first"), hold(&scene, "y").await.expect("y's second")];
        over(hold(&scene, "z").await, "z's connection over the node's 5");
        assert_eq!(refused("max_connections_per_identity"), 1.0);
        assert_eq!(refused("max_connections"), 1.0);

        // A place freed is a place taken.
        drop(x.pop());
        let deadline = tokio::time::Instant::now() + testbed::wait::DEADLINE;
        let _z = loop {
            match hold(&scene, "z").await {
                Ok(held) => break held,
                Err(e) => assert!(tokio::time::Instant::now() < deadline, "z still refused after x closed one: {e}"),
            }
        };
    });
    let lines = scene.base.proxy.log().matches("inbound HBONE limit enforced").count();
    assert!((2..=3).contains(&lines), "{lines} log lines for the refusals: at most one per reason and interval");
}

//! The probe server as the kubelet and Prometheus see it, and the HTTP server under it (connection cap, header
//! timeout, unix sockets): real sockets on 127.0.0.1 or in a temp dir, raw HTTP/1.1.

use std::future::Future;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use daemon::drain::{Drain, DrainMode, DrainTrigger};
use daemon::http::{self, reply, TEXT};
use daemon::listener;
use daemon::probes::{self, Blocker, Paths, ProbeState};
use hyper::StatusCode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream, UnixStream};
use tokio::task::JoinHandle;

const DEADLINE: Duration = Duration::from_secs(10);

async fn within<F: Future>(what: &str, fut: F) -> F::Output {
    tokio::time::timeout(DEADLINE, fut).await.unwrap_or_else(|_| panic!("{what} did not happen within {DEADLINE:?}"))
}

struct Server {
    addr: SocketAddr,
    state: ProbeState,
    /// Registered before serving, as the shared main does.
    startup: Blocker,
    trigger: DrainTrigger,
    task: JoinHandle<()>,
}

async fn start() -> Server {
    start_at(Paths::DAEMON).await
}

async fn start_at(paths: Paths) -> Server {
    let listener = listener::bind_tcp(localhost_any()).await.expect("binding 127.0.0.1:0");
    let addr = listener.local_addr().unwrap();
    let state = ProbeState::new(Arc::new(Mutex::new(Registry::default())));
    let startup = state.blocker("startup", "starting");
    let (trigger, watcher) = Drain::new();
    let task = tokio::spawn(probes::serve(listener, state.clone(), paths, watcher));
    Server { addr, state, startup, trigger, task }
}

fn localhost_any() -> SocketAddr {
    SocketAddr::from((Ipv4Addr::LOCALHOST, 0))
}

#[derive(Debug)]
struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Reply {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(key, _)| key.eq_ignore_ascii_case(name)).map(|(_, value)| value.as_str())
    }
}

/// Sends one request on `stream` and reads exactly one response (framed by Content-Length).
async fn exchange<S: AsyncRead + AsyncWrite + Unpin>(stream: &mut S, method: &str, path: &str, close: bool) -> Reply {
    let connection = if close { "Connection: close\r\n" } else { "" };
    let request = format!("{method} {path} HTTP/1.1\r\nHost: probe\r\n{connection}\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();

    let mut raw = Vec::new();
    let head_end = loop {
        if let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
            break end;
        }
        let mut chunk = [0; 4096];
        let n = within("response head", stream.read(&mut chunk)).await.unwrap();
        assert!(n > 0, "connection closed mid-response: {raw:?}");
        raw.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8(raw[..head_end].to_vec()).unwrap();
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap();
    let status = status_line.split(' ').nth(1).unwrap().parse().unwrap();
    let headers: Vec<(String, String)> = lines
        .map(|line| {
            let (key, value) = line.split_once(':').unwrap();
            (key.trim().to_owned(), value.trim().to_owned())
        })
        .collect();
    let length: usize = headers
        .iter()
        .find(|(key, _)| key.eq_ignore_ascii_case("content-length"))
        .map(|(_, value)| value.parse().unwrap())
        .unwrap_or_else(|| panic!("no Content-Length in {head}"));
    let mut body = raw[head_end + 4..].to_vec();
    while body.len() < length {
        let mut chunk = [0; 4096];
        let n = within("response body", stream.read(&mut chunk)).await.unwrap();
        assert!(n > 0, "connection closed mid-body");
        body.extend_from_slice(&chunk[..n]);
    }
    Reply { status, headers, body: String::from_utf8(body).unwrap() }
}

async fn get(addr: SocketAddr, method: &str, path: &str) -> Reply {
    let mut stream = within("connect", TcpStream::connect(addr)).await.unwrap();
    exchange(&mut stream, method, path, true).await
}

#[tokio::test]
async fn healthz_answers_ok_whatever_readiness() {
    let server = start().await;
    let reply = get(server.addr, "GET", "/healthz").await;
    assert_eq!((reply.status, reply.body.as_str()), (200, "ok\n"));
    server.state.blocker("repair", "broken");
    let reply = get(server.addr, "GET", "/healthz").await;
    assert_eq!((reply.status, reply.body.as_str()), (200, "ok\n"));
}

#[tokio::test]
async fn readyz_follows_the_blocker_and_shows_its_reason() {
    let server = start().await;
    let reply = get(server.addr, "GET", "/readyz").await;
    assert_eq!((reply.status, reply.body.as_str()), (503, "startup: starting\n"));

    server.startup.clear();
    let reply = get(server.addr, "GET", "/readyz?verbose").await;
    assert_eq!((reply.status, reply.body.as_str()), (200, "ready\n"));

    server.startup.block("CNI config /etc/cni/net.d missing");
    let reply = get(server.addr, "GET", "/readyz").await;
    assert_eq!(reply.status, 503);
    assert_eq!(reply.body, "startup: CNI config /etc/cni/net.d missing\n");
    assert_eq!(reply.header("content-type"), Some("text/plain; charset=utf-8"));
}

#[tokio::test]
async fn readyz_lists_every_blocker_and_is_ready_only_when_all_clear() {
    let server = start().await;
    let config = server.state.blocker("cni-config", "waiting for a primary CNI config");
    let watch = server.state.blocker("pod-watch", "listing this node's pods");
    server.startup.clear();
    let reply = get(server.addr, "GET", "/readyz").await;
    assert_eq!(reply.status, 503);
    assert_eq!(reply.body, "cni-config: waiting for a primary CNI config\npod-watch: listing this node's pods\n");

    config.clear();
    let reply = get(server.addr, "GET", "/readyz").await;
    assert_eq!((reply.status, reply.body.as_str()), (503, "pod-watch: listing this node's pods\n"));

    watch.clear();
    let reply = get(server.addr, "GET", "/readyz").await;
    assert_eq!((reply.status, reply.body.as_str()), (200, "ready\n"));
}

#[tokio::test]
async fn other_paths_serve_the_same_answers() {
    let paths = Paths { live: None, ready: "/healthz/ready", metrics: "/stats" };
    let server = start_at(paths).await;
    let reply = get(server.addr, "GET", "/healthz/ready").await;
    assert_eq!((reply.status, reply.body.as_str()), (503, "startup: starting\n"));
    server.startup.clear();
    assert_eq!(get(server.addr, "GET", "/healthz/ready").await.status, 200);
    assert!(get(server.addr, "GET", "/stats").await.body.ends_with("# EOF\n"));
    for path in ["/healthz", "/readyz", "/metrics"] {
        assert_eq!(get(server.addr, "GET", path).await.status, 404, "{path}");
    }
}

#[tokio::test]
async fn metrics_shows_registered_counters_in_openmetrics_text() {
    let server = start().await;
    let repairs = Counter::<u64>::default();
    server.state.registry().lock().unwrap().register("istio_cni_repairs", "Pods repaired", repairs.clone());
    repairs.inc_by(3);

    let reply = get(server.addr, "GET", "/metrics").await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.header("content-type"), Some("application/openmetrics-text; version=1.0.0; charset=utf-8"));
    assert!(reply.body.contains("# TYPE istio_cni_repairs counter\n"), "{}", reply.body);
    assert!(reply.body.contains("\nistio_cni_repairs_total 3\n"), "{}", reply.body);
    assert!(reply.body.ends_with("# EOF\n"), "{}", reply.body);
}

#[tokio::test]
async fn metrics_append_a_second_process_and_survive_its_absence() {
    // The node agent (scraped) and install-cni beside it, each with its own registry and a family both export.
    let (agent, install) = (start().await, start().await);
    for (server, installs) in [(&agent, None), (&install, Some(2))] {
        let mut registry = server.state.registry().lock().unwrap();
        let build = Counter::<u64>::default();
        registry.register("istio_build", "Build", build.clone());
        if let Some(n) = installs {
            let counter = Counter::<u64>::default();
            registry.register("istio_cni_installs", "Installs", counter.clone());
            counter.inc_by(n);
            build.inc_by(7);
        }
    }
    assert!(agent.state.append_metrics_from(install.addr));

    let reply = get(agent.addr, "GET", "/metrics").await;
    assert_eq!(reply.status, 200);
    assert!(reply.body.contains("\nistio_cni_installs_total 2\n"), "install-cni's family is served:\n{}", reply.body);
    assert!(reply.body.contains("\nistio_build_total 0\n"), "{}", reply.body);
    assert!(!reply.body.contains("istio_build_total 7"), "a family both export is the agent's alone:\n{}", reply.body);
    assert_eq!(reply.body.matches("# TYPE istio_build counter").count(), 1, "{}", reply.body);
    assert!(reply.body.ends_with("\n# EOF\n") && reply.body.matches("# EOF").count() == 1, "{}", reply.body);

    // install-cni gone: the agent's own metrics are still served, whole.
    install.trigger.start(DrainMode::Immediate);
    within("install-cni's server to stop", install.task).await.unwrap();
    let reply = get(agent.addr, "GET", "/metrics").await;
    assert_eq!(reply.status, 200);
    assert!(!reply.body.contains("istio_cni_installs"), "{}", reply.body);
    assert!(reply.body.contains("\nistio_build_total 0\n") && reply.body.ends_with("# EOF\n"), "{}", reply.body);
}

/// A scrape of `agent` whose appended source is `source`, a raw peer: what the source received, and the reply.
async fn scrape_against(agent: &Server, source: TcpListener, answer: Option<String>) -> (String, Reply) {
    assert!(agent.state.append_metrics_from(source.local_addr().unwrap()));
    let scrape = tokio::spawn(get(agent.addr, "GET", "/metrics"));
    let (mut held, _) = within("the agent to connect to the source", source.accept()).await.unwrap();
    let mut request = vec![0; 1024];
    let n = within("the agent's request", held.read(&mut request)).await.unwrap();
    if let Some(answer) = answer {
        held.write_all(answer.as_bytes()).await.unwrap();
    }
    let reply = within("the scrape", scrape).await.unwrap();
    // Whatever the source did, the agent's side of the connection is closed once the scrape is answered.
    let mut rest = Vec::new();
    within("the agent to close the source's connection", held.read_to_end(&mut rest)).await.unwrap();
    (String::from_utf8_lossy(&request[..n]).into_owned(), reply)
}

#[tokio::test]
async fn a_source_that_never_answers_costs_its_metrics_and_holds_nothing_open() {
    let agent = start().await;
    let source = TcpListener::bind(localhost_any()).await.unwrap();
    let (request, reply) = scrape_against(&agent, source, None).await;
    assert!(request.starts_with("GET /metrics HTTP/1.1\r\n"), "{request}");
    assert_eq!(reply.status, 200);
    assert!(reply.body.ends_with("# EOF\n") && reply.body.matches("# EOF").count() == 1, "{}", reply.body);
}

#[tokio::test]
async fn a_malformed_source_is_left_out_whole() {
    let agent = start().await;
    let source = TcpListener::bind(localhost_any()).await.unwrap();
    // A good family, then a sample whose label value never closes: served, it would void the whole scrape.
    let body = "# TYPE good gauge\ngood 1\n# TYPE bad gauge\nbad{x=\"1} 1\n# EOF\n";
    let answer = format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}", body.len());
    let (_, reply) = scrape_against(&agent, source, Some(answer)).await;
    assert_eq!(reply.status, 200);
    assert!(!reply.body.contains("good") && !reply.body.contains("bad"), "{}", reply.body);
    assert!(reply.body.ends_with("# EOF\n"), "{}", reply.body);
}

#[tokio::test]
async fn concurrent_scrapes_fetch_from_the_source_one_at_a_time() {
    let agent = start().await;
    let source = TcpListener::bind(localhost_any()).await.unwrap();
    assert!(agent.state.append_metrics_from(source.local_addr().unwrap()));
    // The source holds every connection until it has two open at once, then answers them all: scrapes that
    // fetched side by side would each hold a connection (and a body of up to 4 MiB) and get its metrics.
    let most_open = Arc::new(AtomicUsize::new(0));
    let peer = tokio::spawn({
        let most_open = most_open.clone();
        async move {
            let body = "# TYPE theirs gauge\ntheirs 1\n# EOF\n";
            let answer = format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}", body.len());
            let mut held: Vec<TcpStream> = Vec::new();
            loop {
                let (mut conn, _) = source.accept().await.unwrap();
                let mut request = Vec::new();
                while !request.ends_with(b"\r\n\r\n") {
                    let mut chunk = [0; 1024];
                    let n = within("the agent's request", conn.read(&mut chunk)).await.unwrap();
                    assert!(n > 0, "the agent closed before its request ended");
                    request.extend_from_slice(&chunk[..n]);
                }
                // Connections the agent closed (its fetch timed out) are no longer open.
                held.retain(
                    |c| matches!(c.try_read(&mut [0; 1]), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
                );
                held.push(conn);
                most_open.fetch_max(held.len(), Ordering::SeqCst);
                if held.len() >= 2 {
                    for c in &mut held {
                        c.write_all(answer.as_bytes()).await.unwrap();
                    }
                }
            }
        }
    });
    let scrapes: Vec<_> = (0..8).map(|_| tokio::spawn(get(agent.addr, "GET", "/metrics"))).collect();
    for scrape in scrapes {
        let reply = within("a scrape", scrape).await.unwrap();
        assert_eq!(reply.status, 200);
        assert!(reply.body.ends_with("# EOF\n") && reply.body.matches("# EOF").count() == 1, "{}", reply.body);
    }
    peer.abort();
    assert_eq!(most_open.load(Ordering::SeqCst), 1, "the source had more than one fetch open at once");
}

#[tokio::test]
async fn unknown_paths_are_404_and_other_methods_405() {
    let server = start().await;
    for path in ["/", "/healthzz", "/metrics/x"] {
        assert_eq!(get(server.addr, "GET", path).await.status, 404, "{path}");
    }
    let reply = get(server.addr, "POST", "/readyz").await;
    assert_eq!(reply.status, 405);
    assert_eq!(reply.header("allow"), Some("GET"));
}

#[tokio::test]
async fn graceful_drain_stops_accepting_and_closes_idle_connections() {
    let server = start().await;
    // A keep-alive connection that has been served and is now idle.
    let mut idle = within("connect", TcpStream::connect(server.addr)).await.unwrap();
    assert_eq!(exchange(&mut idle, "GET", "/healthz", false).await.status, 200);

    server.trigger.start(DrainMode::Graceful);
    within("serve returning", server.task).await.unwrap();
    let mut rest = Vec::new();
    let n = within("idle connection closed", idle.read_to_end(&mut rest)).await;
    assert_eq!(n.unwrap(), 0, "unexpected bytes after drain: {rest:?}");
    within("drain complete", server.trigger.drained()).await;
    let refused = TcpStream::connect(server.addr).await;
    assert!(refused.is_err(), "listener still accepting after drain");
}

/// Registers enough series that `/metrics` is far larger than the loopback socket buffers, so a
/// client that stops reading leaves the response in flight on the server.
fn register_large_metrics(state: &ProbeState) {
    let family = Family::<Vec<(String, String)>, Counter>::default();
    let padding = "x".repeat(10_000);
    for i in 0..1_000 {
        family.get_or_create(&vec![("pod".to_owned(), format!("{i}-{padding}"))]).inc();
    }
    state.registry().lock().unwrap().register("big", "Padding", family);
}

/// Connects with a small, fixed receive buffer (no autotuning), so a large response cannot fit in it.
async fn connect_slow_reader(addr: SocketAddr) -> TcpStream {
    let socket = TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(64 * 1024).unwrap();
    within("connect", socket.connect(addr)).await.unwrap()
}

/// Requests `/metrics` and reads only the response head; returns the announced body length.
async fn start_metrics_download(stream: &mut TcpStream) -> usize {
    stream.write_all(b"GET /metrics HTTP/1.1\r\nHost: probe\r\n\r\n").await.unwrap();
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let mut byte = [0];
        let n = within("response head", stream.read(&mut byte)).await.unwrap();
        assert_eq!(n, 1, "closed before the response head");
        head.push(byte[0]);
    }
    let head = String::from_utf8(head).unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    head.lines()
        .find_map(|line| line.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().parse().unwrap()))
        .unwrap_or_else(|| panic!("no Content-Length in {head}"))
}

async fn read_rest(stream: &mut TcpStream) -> usize {
    let mut rest = Vec::new();
    // A reset after an immediate drain is as good as EOF: the response was cut either way.
    let _ = within("connection closed", stream.read_to_end(&mut rest)).await;
    rest.len()
}

#[tokio::test]
async fn graceful_drain_finishes_the_response_in_flight() {
    let server = start().await;
    register_large_metrics(&server.state);
    let mut slow = connect_slow_reader(server.addr).await;
    let length = start_metrics_download(&mut slow).await;

    server.trigger.start(DrainMode::Graceful);
    within("serve returning", server.task).await.unwrap();
    let mut drained = Box::pin(server.trigger.drained());
    let finished_early = tokio::select! {
        biased;
        _ = &mut drained => true,
        _ = std::future::ready(()) => false,
    };
    assert!(!finished_early, "drained while a response was still being sent");
    assert_eq!(read_rest(&mut slow).await, length, "response cut short");
    within("drain complete", drained).await;
}

#[tokio::test]
async fn immediate_drain_cuts_the_response_in_flight() {
    let server = start().await;
    register_large_metrics(&server.state);
    let mut slow = connect_slow_reader(server.addr).await;
    let length = start_metrics_download(&mut slow).await;

    server.trigger.start(DrainMode::Immediate);
    // The client is not reading, so this completes only if the connection is dropped.
    within("drain complete", server.trigger.drained()).await;
    within("serve returning", server.task).await.unwrap();
    let got = read_rest(&mut slow).await;
    assert!(got < length, "whole body ({length} bytes) delivered after an immediate drain");
}

#[tokio::test]
async fn drain_closes_a_half_sent_request_without_answering() {
    let server = start().await;
    let mut open = within("connect", TcpStream::connect(server.addr)).await.unwrap();
    assert_eq!(exchange(&mut open, "GET", "/readyz", false).await.status, 503);
    open.write_all(b"GET /healthz HTTP/1.1\r\nHost: pro").await.unwrap();

    server.trigger.start(DrainMode::Graceful);
    within("drain complete", server.trigger.drained()).await;
    within("serve returning", server.task).await.unwrap();
    assert_eq!(read_rest(&mut open).await, 0, "answered after the drain");
}

#[tokio::test]
async fn bind_error_names_the_address() {
    let first = listener::bind_tcp(localhost_any()).await.unwrap();
    let addr = first.local_addr().unwrap();
    let error = listener::bind_tcp(addr).await.expect_err("second bind of the same port");
    assert!(error.to_string().contains(&addr.to_string()), "{error}");
}

/// Serves `200 hello` to every request on `listener` with `server`, until the returned trigger drains it.
async fn serve_hello<L: listener::Listen>(server: http::Server, listener: L) -> (DrainTrigger, JoinHandle<()>) {
    let (trigger, watcher) = Drain::new();
    let task =
        tokio::spawn(server.serve(listener, watcher, |_request| async { reply(StatusCode::OK, TEXT, "hello\n") }));
    (trigger, task)
}

/// Reads until the peer closes; a reset counts as closed.
async fn closed(stream: &mut TcpStream) -> Vec<u8> {
    let mut rest = Vec::new();
    let _ = within("connection closed", stream.read_to_end(&mut rest)).await;
    rest
}

#[tokio::test]
async fn connections_over_the_cap_are_closed_at_once() {
    let listener = listener::bind_tcp(localhost_any()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (trigger, task) = serve_hello(http::Server::new("capped").max_connections(1), listener).await;
    let mut first = TcpStream::connect(addr).await.unwrap();
    assert_eq!(exchange(&mut first, "GET", "/", false).await.status, 200);

    // The first connection (keep-alive) holds the only slot: the second is closed without an answer.
    let mut second = TcpStream::connect(addr).await.unwrap();
    second.write_all(b"GET / HTTP/1.1\r\nHost: capped\r\n\r\n").await.unwrap();
    assert_eq!(closed(&mut second).await, b"", "answered over the cap");
    assert_eq!(exchange(&mut first, "GET", "/", false).await.status, 200, "the first connection still served");

    // Once it goes, its slot frees up (when its task has ended).
    drop(first);
    let served = async {
        loop {
            let mut next = TcpStream::connect(addr).await.unwrap();
            if next.write_all(b"GET / HTTP/1.1\r\nHost: capped\r\nConnection: close\r\n\r\n").await.is_ok() {
                let answer = closed(&mut next).await;
                if answer.starts_with(b"HTTP/1.1 200") {
                    break;
                }
            }
            tokio::task::yield_now().await;
        }
    };
    within("a connection served after the first closed", served).await;
    trigger.start(DrainMode::Graceful);
    within("serve returning", task).await.unwrap();
}

#[tokio::test]
async fn a_client_that_never_finishes_its_headers_is_disconnected() {
    let listener = listener::bind_tcp(localhost_any()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = http::Server::new("slow").header_read_timeout(Duration::from_millis(200));
    let (trigger, _task) = serve_hello(server, listener).await;
    let mut slow = TcpStream::connect(addr).await.unwrap();
    slow.write_all(b"GET / HTTP/1.1\r\nHost: sl").await.unwrap();
    let answer = closed(&mut slow).await;
    assert!(!answer.starts_with(b"HTTP/1.1 200"), "answered a request never finished");
    // Nothing is left holding the drain.
    trigger.start(DrainMode::Graceful);
    within("drain complete", trigger.drained()).await;
}

#[tokio::test]
async fn serves_a_unix_socket_replacing_a_stale_one() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("events.sock");
    std::fs::write(&path, b"stale").unwrap();
    let listener = listener::bind_unix(&path, 0o666).unwrap();
    assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o666);
    let (trigger, task) = serve_hello(http::Server::new("unix"), listener).await;
    let mut stream = within("connect", UnixStream::connect(&path)).await.unwrap();
    let reply = exchange(&mut stream, "POST", "/cmdadd", true).await;
    assert_eq!((reply.status, reply.body.as_str()), (200, "hello\n"));
    trigger.start(DrainMode::Graceful);
    within("serve returning", task).await.unwrap();
    within("drain complete", trigger.drained()).await;
}

#[tokio::test]
async fn unix_bind_error_names_the_path() {
    let error = listener::bind_unix(std::path::Path::new("/nonexistent/dir/x.sock"), 0o600).unwrap_err();
    assert!(error.to_string().contains("/nonexistent/dir/x.sock"), "{error}");
}

/// Answers every request with the peer credentials the server attached to it, or `none`.
async fn serve_peer<L: listener::Listen>(listener: L) -> (DrainTrigger, JoinHandle<()>) {
    let (trigger, watcher) = Drain::new();
    let task = tokio::spawn(http::Server::new("peer").serve(listener, watcher, |request| async move {
        let peer = request.extensions().get::<listener::PeerCredentials>().copied();
        let body = peer.map_or("none".to_owned(), |p| format!("uid={} gid={} pid={:?}", p.uid, p.gid, p.pid));
        reply(StatusCode::OK, TEXT, body)
    }));
    (trigger, task)
}

#[tokio::test]
async fn every_request_on_a_unix_socket_carries_the_peers_credentials_and_tcp_requests_none() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("peer.sock");
    let (trigger, task) = serve_peer(listener::bind_unix(&path, 0o600).unwrap()).await;
    let mut stream = within("connect", UnixStream::connect(&path)).await.unwrap();
    let me = format!(
        "uid={} gid={} pid={:?}",
        nix::unistd::geteuid(),
        nix::unistd::getegid(),
        Some(std::process::id() as i32)
    );
    // Every request of a kept-alive connection carries it, not only the first.
    for _ in 0..2 {
        let answer = exchange(&mut stream, "GET", "/", false).await;
        assert_eq!((answer.status, answer.body.as_str()), (200, me.as_str()));
    }
    trigger.start(DrainMode::Immediate);
    within("serve returning", task).await.unwrap();

    let tcp = listener::bind_tcp(localhost_any()).await.unwrap();
    let addr = tcp.local_addr().unwrap();
    let (trigger, task) = serve_peer(tcp).await;
    let mut stream = TcpStream::connect(addr).await.unwrap();
    assert_eq!(exchange(&mut stream, "GET", "/", true).await.body, "none", "a TCP peer has no credentials");
    trigger.start(DrainMode::Immediate);
    within("serve returning", task).await.unwrap();
}

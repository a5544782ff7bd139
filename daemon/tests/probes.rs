//! The probe server as the kubelet and Prometheus see it: real TCP on 127.0.0.1, raw HTTP/1.1.

use std::future::Future;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use daemon::drain::{Drain, DrainMode, DrainTrigger};
use daemon::probes::{self, ProbeState};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio::task::JoinHandle;

const DEADLINE: Duration = Duration::from_secs(10);

async fn within<F: Future>(what: &str, fut: F) -> F::Output {
    tokio::time::timeout(DEADLINE, fut).await.unwrap_or_else(|_| panic!("{what} did not happen within {DEADLINE:?}"))
}

struct Server {
    addr: SocketAddr,
    state: ProbeState,
    trigger: DrainTrigger,
    task: JoinHandle<()>,
}

async fn start() -> Server {
    let listener = probes::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, 0))).await.expect("binding 127.0.0.1:0");
    let addr = listener.local_addr().unwrap();
    let state = ProbeState::new(Arc::new(Mutex::new(Registry::default())));
    let (trigger, watcher) = Drain::new();
    let task = tokio::spawn(probes::serve(listener, state.clone(), watcher));
    Server { addr, state, trigger, task }
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
async fn exchange(stream: &mut TcpStream, method: &str, path: &str, close: bool) -> Reply {
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
    server.state.set_not_ready("broken");
    let reply = get(server.addr, "GET", "/healthz").await;
    assert_eq!((reply.status, reply.body.as_str()), (200, "ok\n"));
}

#[tokio::test]
async fn readyz_follows_state_and_shows_the_reason() {
    let server = start().await;
    let reply = get(server.addr, "GET", "/readyz").await;
    assert_eq!((reply.status, reply.body.as_str()), (503, "starting\n"));

    server.state.set_ready();
    let reply = get(server.addr, "GET", "/readyz?verbose").await;
    assert_eq!((reply.status, reply.body.as_str()), (200, "ready\n"));

    server.state.set_not_ready("CNI config /etc/cni/net.d missing");
    let reply = get(server.addr, "GET", "/readyz").await;
    assert_eq!(reply.status, 503);
    assert_eq!(reply.body, "CNI config /etc/cni/net.d missing\n");
    assert_eq!(reply.header("content-type"), Some("text/plain; charset=utf-8"));
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
    let first = probes::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, 0))).await.unwrap();
    let addr = first.local_addr().unwrap();
    let error = probes::bind(addr).await.expect_err("second bind of the same port");
    assert!(error.to_string().contains(&addr.to_string()), "{error}");
}

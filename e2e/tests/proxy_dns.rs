//! DNS through the in-pod forwarder: the real node agent (nftables in-pod rules, which capture port 53) and the
//! real `hbone-proxy` with `DNS_UPSTREAMS` pointing at a tiny DNS server this test runs on the node's bridge
//! address. An ambient pod asks a resolver address nobody serves (10.96.0.10) and gets the server's answer,
//! over UDP and over TCP; with the server gone it gets SERVFAIL; with the proxy gone it gets nothing. And a pod
//! flooding the forwarder (issue #14's acceptance: 20,000 queries in 2 s to an upstream that never answers it)
//! neither grows the proxy's memory unboundedly nor keeps another pod from resolving.

use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::AsRawFd as _;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::json;
use testbed::mesh::RuleBackend;
use testbed::node_agent::{ambient_conflist, ambient_pod, namespace, NodeAgent};
use testbed::wait::eventually;
use testbed::{Cluster, NetnsGuard, Pod};

mod support;
use support::{metric, Proxy};

const NS: &str = "shop";
/// A cluster DNS address no one serves: only the in-pod capture can answer queries sent there.
const CLUSTER_DNS: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 96, 0, 10)), 53);
/// The address in the test server's A record.
const ANSWER_IP: [u8; 4] = [192, 0, 2, 53];
/// Long enough for a SERVFAIL after the forwarder's 5 s query timeout.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(8);

/// A DNS query with `id` for `svc.example. A IN`, recursion desired.
fn query(id: u16) -> Vec<u8> {
    let mut q = id.to_be_bytes().to_vec();
    q.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0]);
    q.extend_from_slice(b"\x03svc\x07example\x00\x00\x01\x00\x01");
    q
}

/// The test server's answer to `query`: same id, QR and AA set, RD copied, the question echoed and one A
/// record (pointing at the question's name) with [`ANSWER_IP`].
fn fixed_answer(query: &[u8]) -> Vec<u8> {
    let mut end = 12;
    while query[end] != 0 {
        end += 1 + usize::from(query[end]);
    }
    let question = &query[12..end + 5];
    let mut a = query[..2].to_vec();
    a.extend_from_slice(&[0x84 | (query[2] & 0x01), 0x00, 0, 1, 0, 1, 0, 0, 0, 0]);
    a.extend_from_slice(question);
    a.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1, 0, 0, 0, 60, 0, 4]);
    a.extend_from_slice(&ANSWER_IP);
    a
}

/// The RCODE of a response, after checking it answers query `id`.
fn rcode(answer: &[u8], id: u16) -> u8 {
    assert!(answer.len() >= 12, "a DNS header: {answer:?}");
    assert_eq!(u16::from_be_bytes([answer[0], answer[1]]), id, "the answer carries the query's id");
    assert_ne!(answer[2] & 0x80, 0, "QR is set");
    answer[3] & 0x0f
}

fn assert_fixed_answer(answer: &[u8], id: u16) {
    assert_eq!(rcode(answer, id), 0, "NOERROR");
    assert_eq!(answer[6..8], [0, 1], "one answer record");
    assert!(answer.ends_with(&ANSWER_IP), "the test server's A record: {answer:?}");
}

/// How the test server saw a query arrive.
type Seen = Arc<Mutex<Vec<(&'static str, SocketAddr)>>>;

/// A DNS server on `ip:53`, UDP and TCP, in the node netns, answering every query with [`fixed_answer`] (but
/// UDP queries from the address it ignores, if any).
struct DnsServer {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    seen: Seen,
    ignored: Arc<AtomicUsize>,
}

impl DnsServer {
    fn start(node: &NetnsGuard, ip: Ipv4Addr) -> Self {
        Self::start_ignoring(node, ip, None)
    }

    /// Like [`DnsServer::start`], never answering (only counting) UDP queries from `ignore`: an upstream that is
    /// unresponsive to that pod and works for every other.
    fn start_ignoring(node: &NetnsGuard, ip: Ipv4Addr, ignore: Option<IpAddr>) -> Self {
        let ns = node.open().expect("open node netns");
        let (udp, tcp) = ns
            .run(|| -> io::Result<(UdpSocket, TcpListener)> {
                Ok((UdpSocket::bind((ip, 53))?, TcpListener::bind((ip, 53))?))
            })
            .expect("enter node netns")
            .expect("bind the test DNS server");
        udp.set_read_timeout(Some(Duration::from_millis(20))).expect("udp timeout");
        tcp.set_nonblocking(true).expect("nonblocking listener");
        let (stop, seen, ignored) = (Arc::new(AtomicBool::new(false)), Seen::default(), Arc::new(AtomicUsize::new(0)));
        let (udp_stop, udp_seen, udp_ignored) = (stop.clone(), seen.clone(), Arc::clone(&ignored));
        let udp_thread = std::thread::spawn(move || {
            let mut buf = [0; 512];
            while !udp_stop.load(Ordering::SeqCst) {
                match udp.recv_from(&mut buf) {
                    Ok((_, peer)) if Some(peer.ip()) == ignore => {
                        udp_ignored.fetch_add(1, Ordering::SeqCst);
                    }
                    Ok((n, peer)) => {
                        udp_seen.lock().unwrap().push(("udp", peer));
                        udp.send_to(&fixed_answer(&buf[..n]), peer).expect("send udp answer");
                    }
                    Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {}
                    Err(e) => panic!("test DNS server: udp receive: {e}"),
                }
            }
        });
        let (tcp_stop, tcp_seen) = (stop.clone(), seen.clone());
        let tcp_thread = std::thread::spawn(move || {
            while !tcp_stop.load(Ordering::SeqCst) {
                match tcp.accept() {
                    Ok((mut stream, peer)) => {
                        tcp_seen.lock().unwrap().push(("tcp", peer));
                        stream.set_nonblocking(false).expect("blocking stream");
                        stream.set_read_timeout(Some(CLIENT_TIMEOUT)).expect("read timeout");
                        while let Some(q) = read_frame(&mut stream) {
                            write_frame(&mut stream, &fixed_answer(&q));
                        }
                    }
                    // Nobody is connecting: wait until someone does, at most 10ms, so the thread notices `stop`.
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        let mut ready = libc::pollfd { fd: tcp.as_raw_fd(), events: libc::POLLIN, revents: 0 };
                        // SAFETY: one valid pollfd for the listener this thread owns.
                        let polled = unsafe { libc::poll(&mut ready, 1, 10) };
                        assert!(polled >= 0, "poll the test DNS server's listener: {}", io::Error::last_os_error());
                    }
                    Err(e) => panic!("test DNS server: accept: {e}"),
                }
            }
        });
        DnsServer { stop, threads: vec![udp_thread, tcp_thread], seen, ignored }
    }

    /// How many UDP queries from the ignored address arrived.
    fn ignored(&self) -> usize {
        self.ignored.load(Ordering::SeqCst)
    }

    /// Closes both sockets: the node then refuses port 53.
    fn stop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for thread in self.threads.drain(..) {
            thread.join().expect("test DNS server thread");
        }
    }

    fn seen(&self) -> Vec<(&'static str, SocketAddr)> {
        self.seen.lock().unwrap().clone()
    }
}

impl Drop for DnsServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// One length-prefixed DNS message; `None` at end of stream.
fn read_frame(stream: &mut TcpStream) -> Option<Vec<u8>> {
    let mut len = [0; 2];
    stream.read_exact(&mut len).ok()?;
    let mut message = vec![0; usize::from(u16::from_be_bytes(len))];
    stream.read_exact(&mut message).expect("a whole DNS message");
    Some(message)
}

fn write_frame(stream: &mut TcpStream, message: &[u8]) {
    let mut frame = u16::try_from(message.len()).expect("short message").to_be_bytes().to_vec();
    frame.extend_from_slice(message);
    stream.write_all(&frame).expect("write DNS message");
}

/// Sends `query` over UDP from inside `pod` to [`CLUSTER_DNS`] and returns the answer. The socket is
/// connected, so only a datagram from 10.96.0.10:53 counts as the answer.
fn ask_udp(pod: &Pod, query: &[u8]) -> io::Result<Vec<u8>> {
    let ns = pod.netns.open().expect("open pod netns");
    ns.run(|| {
        let socket = UdpSocket::bind("0.0.0.0:0")?;
        socket.connect(CLUSTER_DNS)?;
        socket.set_read_timeout(Some(CLIENT_TIMEOUT))?;
        socket.send(query)?;
        let mut buf = [0; 512];
        let n = socket.recv(&mut buf)?;
        Ok(buf[..n].to_vec())
    })
    .expect("enter pod netns")
}

/// Opens a TCP connection from inside `pod` to [`CLUSTER_DNS`].
fn connect_tcp(pod: &Pod) -> io::Result<TcpStream> {
    let ns = pod.netns.open().expect("open pod netns");
    let stream = ns.run(|| TcpStream::connect_timeout(&CLUSTER_DNS, CLIENT_TIMEOUT)).expect("enter pod netns")?;
    stream.set_read_timeout(Some(CLIENT_TIMEOUT))?;
    Ok(stream)
}

/// Sends all `ids`' queries at once on one TCP connection from `pod` and returns the answers by query id.
fn ask_tcp(pod: &Pod, ids: &[u16]) -> Vec<(u16, Vec<u8>)> {
    let mut stream = connect_tcp(pod).expect("TCP connect to 10.96.0.10:53 from the pod");
    for id in ids {
        write_frame(&mut stream, &query(*id));
    }
    let mut answers: Vec<(u16, Vec<u8>)> = ids
        .iter()
        .map(|_| {
            let answer = read_frame(&mut stream).expect("an answer on the connection");
            (u16::from_be_bytes([answer[0], answer[1]]), answer)
        })
        .collect();
    answers.sort_by_key(|(id, _)| *id);
    answers
}

/// A node with the agent and the real proxy, whose DNS forwarder's one upstream is `gateway:53` (the node side
/// of the pods' bridge, where the tests start their DNS server once the first pod exists).
struct DnsNode {
    // Fields drop in this order: the proxy before its state dir, the agent and the node.
    proxy: Proxy,
    _dir: tempfile::TempDir,
    _agent: NodeAgent,
    cluster: Cluster,
    gateway: Ipv4Addr,
}

impl DnsNode {
    fn start() -> Self {
        let cluster = Cluster::with_backend(RuleBackend::Nftables);
        cluster.api.upsert(namespace(NS, json!({}))).expect("store namespace");
        let agent = NodeAgent::start(&cluster, &[]);
        let dir = tempfile::tempdir().expect("scratch dir");
        let gateway = cluster.node.gateway();
        let upstream = format!("{gateway}:53");
        let proxy = Proxy::start(
            &cluster,
            &agent,
            dir.path(),
            &dir.path().join("workloads.yaml"),
            &[("DNS_UPSTREAMS", upstream.as_str())],
        );
        DnsNode { cluster, _agent: agent, _dir: dir, proxy, gateway }
    }
}

/// Creates ambient pod `name` through the runtime; ADD returns once the proxy serves it.
fn ambient_member(cluster: &Cluster, name: &str) -> Pod {
    cluster.create(&ambient_pod(NS, name));
    cluster.add_with(ambient_conflist(cluster), name, NS).expect("CNI ADD")
}

#[test]
fn an_ambient_pods_dns_is_answered_through_the_forwarder() {
    // Bound in this order so they drop as the node was built, in reverse: the proxy first, the node last.
    let DnsNode { cluster, _agent, _dir, mut proxy, gateway } = DnsNode::start();
    // ADD returns only after the proxy acked the pod, i.e. its listeners (15053 included) are up.
    let pod = ambient_member(&cluster, "a");
    // The bridge (and so the gateway address) exists once the first pod is attached.
    let mut server = DnsServer::start(cluster.node.netns(), gateway);

    let answer = ask_udp(&pod, &query(0x1001)).expect("a UDP answer from 10.96.0.10:53");
    assert_fixed_answer(&answer, 0x1001);
    let answer = ask_udp(&pod, &query(0x1002)).expect("a second UDP answer");
    assert_fixed_answer(&answer, 0x1002);
    let answers = ask_tcp(&pod, &[0x2001, 0x2002]);
    for (id, answer) in &answers {
        assert_fixed_answer(answer, *id);
    }
    assert_eq!(answers.iter().map(|(id, _)| *id).collect::<Vec<_>>(), [0x2001, 0x2002], "both pipelined queries");
    // The queries reached the upstream from the pod's own address (upstream sockets live in the pod netns),
    // UDP as UDP and TCP as TCP.
    let seen = server.seen();
    let from_pod = |transport| seen.iter().filter(|(t, peer)| *t == transport && peer.ip() == pod.ip).count();
    assert_eq!(from_pod("udp"), 2, "both UDP queries from the pod's IP: {seen:?}");
    let udp_ports: Vec<u16> = seen.iter().filter(|(t, _)| *t == "udp").map(|(_, peer)| peer.port()).collect();
    assert_eq!(udp_ports[0], udp_ports[1], "the pod's upstream UDP socket is reused, not made per query: {seen:?}");
    assert_eq!(from_pod("tcp"), 1, "one upstream TCP connection carried both pipelined queries: {seen:?}");

    // Upstream gone: the forwarder answers SERVFAIL instead of leaving the client waiting.
    server.stop();
    let answer = ask_udp(&pod, &query(0x3001)).expect("a UDP answer with the upstream down");
    assert_eq!(rcode(&answer, 0x3001), 2, "SERVFAIL over UDP");
    let answers = ask_tcp(&pod, &[0x4001]);
    assert_eq!(rcode(&answers[0].1, 0x4001), 2, "SERVFAIL over TCP");

    // Forwarder gone: the captured queries find nothing on 15053, so the answers above came through it.
    proxy.stop();
    assert!(ask_udp(&pod, &query(0x5001)).is_err(), "no UDP answer without the proxy");
    assert!(connect_tcp(&pod).is_err(), "no TCP DNS without the proxy");
}

/// The issue's flood: this many queries...
const FLOOD_QUERIES: u16 = 20_000;
/// ...spread evenly over this long.
const FLOOD_SPAN: Duration = Duration::from_secs(2);
/// How much the proxy's resident memory may grow under the flood (issue #14's acceptance).
const RSS_GROWTH_LIMIT_KIB: u64 = 50 * 1024;
/// Client TCP connections the flooding pod opens at once: more than the forwarder's per-pod cap (32).
const FLOOD_TCP_CONNECTIONS: usize = 40;

/// A `/proc/<pid>/status` field in KiB (`VmRSS`, `VmHWM`).
fn status_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("read /proc/<pid>/status");
    let value = status.lines().find_map(|line| line.strip_prefix(field)?.strip_prefix(':'));
    let value = value.and_then(|v| v.trim().strip_suffix("kB")?.trim().parse().ok());
    value.unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
}

/// Sends [`FLOOD_QUERIES`] queries from inside `pod` to [`CLUSTER_DNS`] over [`FLOOD_SPAN`], from 16 sockets (as
/// many client ports), never reading an answer. Returns how long the sending took.
fn flood(pod: &Pod) -> Duration {
    let ns = pod.netns.open().expect("open pod netns");
    ns.run(|| {
        let sockets: Vec<UdpSocket> = (0..16)
            .map(|_| {
                let socket = UdpSocket::bind("0.0.0.0:0").expect("bind a flood socket");
                socket.connect(CLUSTER_DNS).expect("connect a flood socket");
                socket
            })
            .collect();
        let batches: u16 = 100;
        let start = Instant::now();
        for batch in 0..batches {
            // Pacing, not waiting for anything: batch k leaves k/100 of the way through the span.
            let due = start + FLOOD_SPAN * u32::from(batch) / u32::from(batches);
            std::thread::sleep(due.saturating_duration_since(Instant::now()));
            for n in batch * (FLOOD_QUERIES / batches)..(batch + 1) * (FLOOD_QUERIES / batches) {
                sockets[usize::from(n) % sockets.len()].send(&query(n)).expect("send a flood query");
            }
        }
        start.elapsed()
    })
    .expect("enter pod netns")
}

#[test]
fn a_pods_dns_flood_keeps_the_proxys_memory_bounded_and_other_pods_resolving() {
    let DnsNode { cluster, _agent, _dir, proxy, gateway } = DnsNode::start();
    let (flooder, neighbour) = (ambient_member(&cluster, "flooder"), ambient_member(&cluster, "neighbour"));
    // One upstream for the whole node (DNS_UPSTREAMS), unresponsive to the flooder and working for the neighbour.
    let server = DnsServer::start_ignoring(cluster.node.netns(), gateway, Some(flooder.ip.into()));
    assert_fixed_answer(&ask_udp(&neighbour, &query(1)).expect("the neighbour resolves before the flood"), 1);

    let pid = proxy.pid();
    // Reset the peak resident set size, so VmHWM afterwards is the peak under the flood.
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").expect("reset the proxy's VmHWM");
    let baseline = status_kib(pid, "VmRSS");

    let (took, answered_during_flood) = std::thread::scope(|scope| {
        let flooding = scope.spawn(|| flood(&flooder));
        // While the flood runs, the neighbour keeps asking the same upstream, one query after the other.
        let mut answered = 0;
        let mut id = 0x100;
        while !flooding.is_finished() {
            id += 1;
            let answer = ask_udp(&neighbour, &query(id))
                .unwrap_or_else(|e| panic!("the neighbour's query {id} during the flood got no answer: {e}"));
            assert_fixed_answer(&answer, id);
            answered += 1;
        }
        (flooding.join().expect("flood thread"), answered)
    });
    let peak = status_kib(pid, "VmHWM");
    assert!(
        peak.saturating_sub(baseline) < RSS_GROWTH_LIMIT_KIB,
        "the proxy's RSS grew from {baseline} KiB to a peak of {peak} KiB under the flood (limit: +{RSS_GROWTH_LIMIT_KIB} KiB)"
    );
    assert!(answered_during_flood > 0, "the neighbour asked during the flood");
    eprintln!(
        "flood of {FLOOD_QUERIES} queries took {took:?}; neighbour answered {answered_during_flood} times meanwhile; \
         RSS {baseline} KiB, peak {peak} KiB"
    );

    // The flooder's queries beyond its in-flight bound were dropped and counted, and never reached the upstream.
    let node = cluster.node.netns().path();
    let dropped =
        metric(&node, r#"istio_dns_requests_dropped_total{request_protocol="udp",reason="in_flight_limit"} "#)
            .expect("dropped queries are counted");
    assert!(dropped > 0.0, "the flood was cut at the pod's in-flight bound");
    assert!(
        server.ignored() < usize::from(FLOOD_QUERIES) / 10,
        "most of the flood never left the proxy: the upstream got {} of the flooder's queries",
        server.ignored()
    );
    // The admitted ones give their slots back at the query timeout (SERVFAIL): nothing stays in flight.
    eventually("the flooder's queries have left the forwarder", || {
        (metric(&node, "istio_dns_requests_in_flight ")? == 0.0).then_some(())
    });
    let peak = status_kib(pid, "VmHWM");
    assert!(
        peak.saturating_sub(baseline) < RSS_GROWTH_LIMIT_KIB,
        "the proxy's RSS grew from {baseline} KiB to a peak of {peak} KiB by the time the flood was over"
    );

    // TCP: the flooder holds more connections than its pod may; the extra ones are refused, the neighbour's
    // (another pod, its own cap) are served, over the same upstream.
    let held: Vec<TcpStream> = (0..FLOOD_TCP_CONNECTIONS).filter_map(|_| connect_tcp(&flooder).ok()).collect();
    let refused = r#"istio_dns_requests_dropped_total{request_protocol="tcp",reason="tcp_connection_limit"} "#;
    eventually("the flooder's connections over its cap are refused", || {
        (metric(&node, refused)? >= (FLOOD_TCP_CONNECTIONS - 32) as f64).then_some(())
    });
    let answers = ask_tcp(&neighbour, &[0x7001, 0x7002]);
    for (id, answer) in &answers {
        assert_fixed_answer(answer, *id);
    }
    drop(held);
    // Drops are logged once per pod, reason and interval, not once per query (there were thousands).
    let drop_lines = proxy.log().matches("dns query dropped").count();
    assert!((1..=4).contains(&drop_lines), "{drop_lines} 'dns query dropped' log lines");
    assert_fixed_answer(&ask_udp(&neighbour, &query(0x7003)).expect("the neighbour resolves after the flood"), 0x7003);
}

//! Same-node acceptance: the real node agent and the real `hbone-proxy` in the node netns, ambient pods A and
//! B created through the fake CNI runtime. A's app exchanges 1 GiB each way with B's app (hashes match, the
//! metrics count exactly those bytes); the bytes cross the pods' veths only on port 15008, as TLS (seen with
//! tcpdump), and B's app sees A's IP as its peer. Dual-stack pods do the same over IPv6. The proxy runs with its
//! same-node fast path off ([`support::HBONE_ON_ONE_NODE`]): these tests are about HBONE between two pods of one node
//! (`proxy_fast_path.rs` tests the fast path).

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv6Addr, Shutdown, SocketAddr};
use std::path::Path;
use std::time::{Duration, Instant};

use istio_contract::ports;
use serde_json::json;
use testbed::node_agent::{ambient_pod, uid};
use testbed::wait::eventually;
use testbed::NetnsGuard;

mod support;
use support::capture::{host_veth, payload_bytes, Capture, Packet};
use support::traffic::{Payload, MARKER};
use support::{
    await_kubernetes_listing, config_dump, conflist_for, connect_from, dumped_pod, ipv6_of, listen_at, listen_on,
    listening, metric, pod_ips, record_pod_ips, Proxy, Scene, Stack, APP_PORT, HBONE_ON_ONE_NODE, NS, TD,
};

/// Bytes each way in the acceptance transfer.
const PAYLOAD: u64 = 1024 * 1024 * 1024;
/// Bytes each way in the captured transfer: enough for many full-size segments, small enough to keep the files
/// small.
const CAPTURED: u64 = 8 * 1024 * 1024;
/// The TCP ports the proxy listens on in every pod.
const POD_PORTS: [u16; 3] = [ports::OUTBOUND, ports::INBOUND_PLAINTEXT, ports::HBONE];
/// Byte counters on the pod's non-loopback traffic, by port, before NAT on the way in and after it on the way out.
fn install_counters(ns: &NetnsGuard) {
    let (hbone, app) = (ports::HBONE, APP_PORT);
    let rules = format!(
        r#"
table inet hbonetest {{
    chain pre {{
        type filter hook prerouting priority -300; policy accept;
        iifname != "lo" tcp dport {hbone} counter comment "in_dport_hbone"
        iifname != "lo" tcp dport {app} counter comment "in_dport_app"
    }}
    chain post {{
        type filter hook postrouting priority 300; policy accept;
        oifname != "lo" tcp dport {hbone} counter comment "out_dport_hbone"
        oifname != "lo" tcp sport {hbone} counter comment "out_sport_hbone"
        oifname != "lo" tcp dport {app} counter comment "out_dport_app"
        oifname != "lo" tcp sport {app} counter comment "out_sport_app"
    }}
}}
"#
    );
    let file = tempfile::NamedTempFile::new().expect("rules file");
    std::fs::write(file.path(), rules).expect("write rules");
    ns.exec_ok(&["nft", "-f", &file.path().display().to_string()]);
}

/// The byte count of the counter commented `name`.
fn counter(ns: &NetnsGuard, name: &str) -> u64 {
    let text = ns.exec_ok(&["nft", "list", "table", "inet", "hbonetest"]);
    let line = text.lines().find(|l| l.contains(&format!("\"{name}\""))).unwrap_or_else(|| panic!("{name} in {text}"));
    let bytes = line.split_whitespace().skip_while(|w| *w != "bytes").nth(1).expect("bytes value");
    bytes.parse().expect("byte count")
}

/// A byte counter of the proxy's HBONE traffic: its name, and whether as the client's side (`reporter="source"`).
type ByteCounter = (&'static str, bool);

/// The proxy's HBONE byte counters, both directions as the client's side and as the server's, with their current
/// values (0 before the first connection) in the node netns `netns`.
fn hbone_byte_counters(netns: &Path) -> Vec<(ByteCounter, f64)> {
    [false, true]
        .iter()
        .flat_map(|outbound| ["istio_tcp_received_bytes_total", "istio_tcp_sent_bytes_total"].map(|n| (n, *outbound)))
        .map(|counter| (counter, hbone_bytes(netns, counter)))
        .collect()
}

/// The value of `counter`, summed over its series (every pair of workloads).
fn hbone_bytes(netns: &Path, (name, outbound): ByteCounter) -> f64 {
    support::metrics::sum(netns, name, &support::metrics::hbone(outbound))
}

/// Waits until every counter of `before` grew by exactly `len`: B's HBONE inbound and A's HBONE outbound counted
/// the transfer each way.
fn assert_hbone_counted(netns: &Path, before: &[(ByteCounter, f64)], len: u64) {
    for (counter, before) in before {
        let want = before + len as f64;
        eventually(&format!("{counter:?} grew by {len}"), || (hbone_bytes(netns, *counter) == want).then_some(()));
    }
}

/// Tcpdump on the host-side veths of A and B, writing `A.pcap` and `B.pcap` into `dir`.
fn capture_veths(scene: &Scene, dir: &Path) -> Vec<(&'static str, Capture)> {
    let node = scene.cluster.node.netns();
    [("A", &scene.a), ("B", &scene.b)]
        .into_iter()
        .map(|(name, pod)| (name, Capture::start(node, &host_veth(&pod.result), &dir.join(format!("{name}.pcap")))))
        .collect()
}

/// Stops `capture` of `name`'s veth (written to `dir`) once it holds both `len`-byte marked payloads on 15008,
/// and asserts the veth carried no plaintext marker, no TCP payload outside 15008, and TLS on both sides of
/// 15008; returns the packets.
fn assert_only_tls_on_15008(name: &str, capture: Capture, dir: &Path, len: u64) -> Vec<Packet> {
    let both_payloads = format!("both payloads on {name}'s veth");
    let packets = capture.stop_when(&both_payloads, |p| payload_bytes(p, ports::HBONE) > 2 * len);
    let raw = std::fs::read(dir.join(format!("{name}.pcap"))).expect("read capture");
    assert!(
        !raw.windows(MARKER.len()).any(|w| w == MARKER),
        "{name}'s veth carried the plaintext marker: payload crossed in the clear"
    );
    let with_payload: Vec<&Packet> = packets.iter().filter(|p| !p.payload.is_empty()).collect();
    let off_port: Vec<(u16, u16)> = with_payload
        .iter()
        .filter(|p| p.sport != ports::HBONE && p.dport != ports::HBONE)
        .map(|p| (p.sport, p.dport))
        .collect();
    assert!(off_port.is_empty(), "{name}'s veth: TCP payload outside port 15008: {off_port:?}");
    let first_to = with_payload.iter().find(|p| p.dport == ports::HBONE).expect("payload towards 15008");
    let first_from = with_payload.iter().find(|p| p.sport == ports::HBONE).expect("payload from 15008");
    for (side, packet) in [("client", first_to), ("server", first_from)] {
        assert_eq!(
            packet.payload[..2],
            [0x16, 0x03],
            "{name}'s veth: the {side} side of 15008 starts with a TLS handshake record"
        );
    }
    packets
}

/// A's app connects to B:8080 and both send `len` bytes (`marked` stamps [`MARKER`] into both payloads); returns
/// B's view of the peer after checking lengths and hashes on both ends.
fn transfer(scene: &Scene, len: u64, marked: bool) -> SocketAddr {
    let (mut a_data, mut b_data) = (Payload::new(1, len), Payload::new(2, len));
    if marked {
        (a_data, b_data) = (a_data.marked(), b_data.marked());
    }
    support::traffic::transfer(scene.b_listener(), || scene.a_connects_to_b(), a_data, b_data)
}

/// A node with both pods listed under their own service accounts, and the proxy's default environment but for the
/// same-node fast path, which is off: these tests are about HBONE between two pods of one node.
fn scene() -> Scene {
    Scene::new(tempfile::tempdir().expect("scratch dir"), "b-sa", &[HBONE_ON_ONE_NODE])
}

#[test]
fn pods_on_one_node_exchange_a_gib_each_way_over_hbone_with_the_clients_ip_preserved() {
    let scene = scene();
    let (cluster, proxy, a, b) = (&scene.cluster, &scene.proxy, &scene.a, &scene.b);
    install_counters(&a.netns);
    install_counters(&b.netns);
    let netns = cluster.node.netns().path();
    let before = hbone_byte_counters(&netns);

    let peer = transfer(&scene, PAYLOAD, false);
    assert_eq!(peer.ip(), IpAddr::from(a.ip), "B's app sees A's IP as the peer (transparent source)");

    // On the wire: A → B only as HBONE (15008), nothing on the app port outside the pods.
    assert!(counter(&a.netns, "out_dport_hbone") > PAYLOAD, "A sent the payload to B:15008");
    assert!(counter(&b.netns, "in_dport_hbone") > PAYLOAD, "B received the payload on 15008");
    assert!(counter(&b.netns, "out_sport_hbone") > PAYLOAD, "B answered from 15008");
    for (pod, name) in [(a, "out_dport_app"), (a, "out_sport_app"), (b, "in_dport_app"), (b, "out_sport_app")] {
        assert_eq!(counter(&pod.netns, name), 0, "{name} must stay 0: no plaintext app traffic on the veth");
    }
    // The proxy counted exactly the transfer, each way, on B's HBONE inbound and A's HBONE outbound.
    assert_hbone_counted(&netns, &before, PAYLOAD);
    assert!(proxy.log().contains("direction=\"inbound\" protocol=\"HBONE\""), "access log of the tunnel");
}

#[test]
fn on_the_pods_veths_the_payload_crosses_only_as_tls_on_15008() {
    let scene = scene();
    let files = tempfile::tempdir().expect("capture dir");
    let captures = capture_veths(&scene, files.path());
    transfer(&scene, CAPTURED, true);
    for (name, capture) in captures {
        assert_only_tls_on_15008(name, capture, files.path(), CAPTURED);
    }
}

#[test]
fn dual_stack_pods_exchange_mibs_over_ipv6_as_hbone_with_the_clients_ipv6_preserved() {
    let scene = Scene::with_stack(Stack::Dual, tempfile::tempdir().expect("scratch dir"), "b-sa", &[HBONE_ON_ONE_NODE]);
    let (a6, b6) = (ipv6_of(&scene.a), ipv6_of(&scene.b));
    let netns = scene.cluster.node.netns().path();
    // The proxy took both pods with their IPv6 addresses and listens on IPv6 in both.
    let dump = config_dump(&scene);
    for (pod, name, v6) in [(&scene.a, "a", a6), (&scene.b, "b", b6)] {
        let ips = dumped_pod(&dump, name)["ips"].clone();
        assert!(ips.as_array().is_some_and(|ips| ips.contains(&v6.to_string().into())), "{name}'s {v6} in {ips}");
        let v6_listener = pod.netns.exec_ok(&["ss", "-Hltn6", &format!("sport = :{}", ports::HBONE)]);
        assert!(
            v6_listener.contains(&format!("[::]:{}", ports::HBONE)),
            "{name} has an IPv6 HBONE listener: {v6_listener:?}"
        );
    }
    let before = hbone_byte_counters(&netns);
    let files = tempfile::tempdir().expect("capture dir");
    let captures = capture_veths(&scene, files.path());

    let app = listen_at(&scene.b, SocketAddr::from((Ipv6Addr::UNSPECIFIED, APP_PORT)));
    let (a_data, b_data) = (Payload::new(3, CAPTURED).marked(), Payload::new(4, CAPTURED).marked());
    let b_app = SocketAddr::from((b6, APP_PORT));
    let peer = support::traffic::transfer(app, || connect_from(&scene.a, b_app), a_data, b_data);
    assert_eq!(peer.ip(), IpAddr::from(a6), "B's app sees A's IPv6 address as the peer");

    assert_hbone_counted(&netns, &before, CAPTURED);
    for (name, capture) in captures {
        let packets = assert_only_tls_on_15008(name, capture, files.path(), CAPTURED);
        let tunnel: Vec<(IpAddr, IpAddr)> = packets
            .iter()
            .filter(|p| !p.payload.is_empty())
            .map(|p| if p.dport == ports::HBONE { (p.src, p.dst) } else { (p.dst, p.src) })
            .filter(|ends| *ends != (IpAddr::from(a6), IpAddr::from(b6)))
            .collect();
        assert!(tunnel.is_empty(), "{name}'s veth: 15008 payload not between A's and B's IPv6: {tunnel:?}");
    }
}

#[test]
fn deleting_a_pod_closes_its_listeners_within_a_second() {
    let mut scene = scene();
    let b_uid = uid(&scene.cluster, NS, "b");
    for port in POD_PORTS {
        assert!(listening(&scene.b.netns, port), "B has a listener on {port} before the delete");
    }
    let runs_b = |dump: &serde_json::Value| {
        dump["pods"].as_array().is_some_and(|pods| pods.iter().any(|pod| pod["uid"] == b_uid.as_str()))
    };
    assert!(runs_b(&config_dump(&scene)), "/config_dump lists B before the delete");
    scene.cluster.delete_pod(NS, "b", Some(&mut scene.b));
    eventually("the proxy stops B's proxy: /config_dump no longer lists it", || {
        (!runs_b(&config_dump(&scene))).then_some(())
    });
    let closed = testbed::wait::within(Instant::now(), Duration::from_secs(1), || {
        (!POD_PORTS.iter().any(|port| listening(&scene.b.netns, *port))).then_some(())
    });
    assert!(closed.is_some(), "B's listeners still open 1 s after DelWorkload");
    assert!(listening(&scene.a.netns, ports::HBONE), "A's proxy is untouched");
}

/// A's app sends `hello` to `dst` and reads the echo; returns the access log line of A's outbound connection.
fn a_says_hello_to(scene: &Scene, dst: SocketAddr) -> String {
    let before = scene.proxy.log().len();
    let mut stream = connect_from(&scene.a, dst);
    stream.write_all(b"hello").expect("A writes");
    stream.shutdown(Shutdown::Write).expect("A half-closes");
    let mut back = Vec::new();
    stream.read_to_end(&mut back).expect("A reads the echo");
    assert_eq!(back, b"hello", "the echo came back");
    let addr = format!("dst.addr={dst} ");
    eventually("A's outbound connection is in the access log", || {
        let log = scene.proxy.log();
        let new = log.get(before..)?.lines().find(|l| l.contains("direction=\"outbound\"") && l.contains(&addr));
        new.map(str::to_owned)
    })
}

#[test]
fn a_pod_is_reached_over_hbone_as_its_pod_objects_service_account_once_the_api_has_its_addresses() {
    let scene = scene();
    // C as the runtime has just created it: the kubelet has not recorded its addresses in the Pod object yet.
    let mut pod = ambient_pod(NS, "c");
    pod["spec"]["serviceAccountName"] = json!("c-sa");
    scene.cluster.create(&pod);
    let c = scene.cluster.add_with(conflist_for(&scene.cluster, Stack::V4), "c", NS).expect("CNI ADD");
    let _app = support::traffic::echo_app(listen_on(&c, APP_PORT));
    let dst = SocketAddr::from((c.ip, APP_PORT));

    let unlisted = a_says_hello_to(&scene, dst);
    assert!(unlisted.contains("protocol=\"TCP\""), "a pod the API has no address for is not in the mesh: {unlisted}");

    record_pod_ips(&scene.cluster, "c", &c);
    await_kubernetes_listing(&scene.proxy, [&scene.a, &scene.b, &c].into_iter().map(|p| pod_ips(p).len()).sum());
    let listed = a_says_hello_to(&scene, dst);
    let identity = hbone::Identity::new(TD, NS, "c-sa").expect("C's identity");
    assert!(listed.contains("protocol=\"HBONE\""), "C is reached over HBONE once listed: {listed}");
    assert!(listed.contains(&format!("dst.identity={identity} ")), "C's identity is its Pod object's: {listed}");
}

#[test]
fn a_restarted_proxy_gets_the_pods_back_from_the_snapshot() {
    let mut scene = scene();
    scene.proxy.stop();
    eventually("the old proxy's listeners are gone", || (!listening(&scene.b.netns, ports::HBONE)).then_some(()));
    let app = scene.b_listener();
    scene.proxy =
        Proxy::start(&scene.cluster, &scene.agent, scene.dir.path(), &scene.workloads(), &[HBONE_ON_ONE_NODE]);
    let ready = Instant::now();
    let small = (Payload::new(5, 1024), Payload::new(6, 1024));
    support::traffic::transfer(app, || scene.a_connects_to_b(), small.0, small.1);
    let took = ready.elapsed();
    assert!(took < Duration::from_secs(1), "a new connection worked only {took:?} after the proxy was ready");
    for pod in [&scene.a, &scene.b] {
        assert!(listening(&pod.netns, ports::HBONE), "listeners are back by the time the new proxy is ready");
    }
    let peer = transfer(&scene, 1024 * 1024, false);
    assert_eq!(peer.ip(), IpAddr::from(scene.a.ip), "B's app sees A's IP after the restart");
    // The exchanges went through the new proxy over HBONE: it dialled the tunnel.
    let dialled = metric(&scene.cluster.node.netns().path(), "hbone_connect_duration_seconds_count ");
    assert!(dialled.is_some_and(|n| n >= 1.0), "the new proxy dialled no HBONE connection: {dialled:?}");
}

//! Same-node acceptance: the real node agent and the real `hbone-proxy` in the node netns, ambient pods A and
//! B created through the fake CNI runtime. A's app exchanges 16 MiB each way with B's app; the bytes cross
//! the pods' veths only on port 15008 and B's app sees A's IP as its peer.

use std::io::{Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::thread::JoinHandle;
use std::time::Duration;

use ring::digest::{Context, Digest, SHA256};
use tests::node_agent::uid;
use tests::wait::eventually;
use tests::NetnsGuard;

mod support;
use support::{http_get, listening, Proxy, Scene, NS};

const PAYLOAD: usize = 16 * 1024 * 1024;
/// Where the proxy serves `/metrics` (Istio's port), inside the node netns.
const METRICS_PORT: u16 = 15020;

/// `len` deterministic pseudo-random bytes, different per seed.
fn payload(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len / 8)
        .flat_map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x.to_le_bytes()
        })
        .collect()
}

fn sha(bytes: &[u8]) -> Digest {
    ring::digest::digest(&SHA256, bytes)
}

/// Sends `data` (then shuts down the write side) while reading to EOF; returns the hash of what was read.
fn exchange(stream: TcpStream, data: Vec<u8>) -> Digest {
    let expected = data.len();
    let mut writer = stream.try_clone().expect("clone socket");
    let sender = std::thread::spawn(move || {
        writer.write_all(&data).expect("send payload");
        writer.shutdown(Shutdown::Write).expect("shut down write side");
    });
    let mut reader = stream;
    reader.set_read_timeout(Some(Duration::from_secs(60))).expect("read timeout");
    let mut hash = Context::new(&SHA256);
    let mut buf = vec![0; 256 * 1024];
    let mut total = 0;
    loop {
        let n = reader.read(&mut buf).expect("read payload");
        if n == 0 {
            break;
        }
        hash.update(&buf[..n]);
        total += n;
    }
    sender.join().expect("sender thread");
    assert_eq!(total, expected, "bytes received (both sides send the same amount)");
    hash.finish()
}

/// B's app on `listener`: serves one connection; yields (peer, hash of what it got).
fn server_app(listener: TcpListener, data: Vec<u8>) -> JoinHandle<(SocketAddr, Digest)> {
    std::thread::spawn(move || {
        let (stream, peer) = listener.accept().expect("accept");
        (peer, exchange(stream, data))
    })
}

/// Byte counters on the pod's non-loopback traffic, by port, before NAT on the way in and after it on the way out.
fn install_counters(ns: &NetnsGuard) {
    let rules = r#"
table inet hbonetest {
    chain pre {
        type filter hook prerouting priority -300; policy accept;
        iifname != "lo" tcp dport 15008 counter comment "in_dport_15008"
        iifname != "lo" tcp dport 8080 counter comment "in_dport_8080"
    }
    chain post {
        type filter hook postrouting priority 300; policy accept;
        oifname != "lo" tcp dport 15008 counter comment "out_dport_15008"
        oifname != "lo" tcp sport 15008 counter comment "out_sport_15008"
        oifname != "lo" tcp dport 8080 counter comment "out_dport_8080"
        oifname != "lo" tcp sport 8080 counter comment "out_sport_8080"
    }
}
"#;
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

fn metric(netns: &Path, line_prefix: &str) -> Option<f64> {
    let (_, body) = http_get(netns, METRICS_PORT, "/metrics")?;
    body.lines().find_map(|l| l.strip_prefix(line_prefix)?.trim().parse().ok())
}

/// A's app connects to B:8080 and both send `len` bytes; returns B's view of the peer after checking hashes.
fn transfer(scene: &Scene, len: usize) -> SocketAddr {
    let (a_data, b_data) = (payload(1, len), payload(2, len));
    let (a_sent, b_sent) = (sha(&a_data), sha(&b_data));
    let server = server_app(scene.b_listener(), b_data);
    let a_got = exchange(scene.a_connects_to_b(), a_data);
    let (peer, b_got) = server.join().expect("server app");
    assert_eq!(a_got.as_ref(), b_sent.as_ref(), "A received exactly what B sent");
    assert_eq!(b_got.as_ref(), a_sent.as_ref(), "B received exactly what A sent");
    peer
}

/// A node with both pods listed under their own service accounts, and the proxy's default environment.
fn scene() -> Scene {
    Scene::new(tempfile::tempdir().expect("scratch dir"), "b-sa", &[])
}

#[test]
fn pods_on_one_node_talk_over_hbone_with_the_clients_ip_preserved() {
    let scene = scene();
    let (cluster, proxy, a, b) = (&scene.cluster, &scene.proxy, &scene.a, &scene.b);
    install_counters(&a.netns);
    install_counters(&b.netns);

    let peer = transfer(&scene, PAYLOAD);
    assert_eq!(peer.ip(), IpAddr::from(a.ip), "B's app sees A's IP as the peer (transparent source)");

    // On the wire: A → B only as HBONE (15008), nothing on the app port outside the pods.
    let payload = PAYLOAD as u64;
    assert!(counter(&a.netns, "out_dport_15008") > payload, "A sent the payload to B:15008");
    assert!(counter(&b.netns, "in_dport_15008") > payload, "B received the payload on 15008");
    assert!(counter(&b.netns, "out_sport_15008") > payload, "B answered from 15008");
    for (pod, name) in [(a, "out_dport_8080"), (a, "out_sport_8080"), (b, "in_dport_8080"), (b, "out_sport_8080")] {
        assert_eq!(counter(&pod.netns, name), 0, "{name} must stay 0: no plaintext app traffic on the veth");
    }
    // The proxy carried exactly the transfer on B's HBONE inbound and A's HBONE outbound.
    let netns = cluster.node.netns().path();
    for direction in ["inbound", "outbound"] {
        for name in ["istio_tcp_received_bytes_total", "istio_tcp_sent_bytes_total"] {
            let prefix = format!("{name}{{direction=\"{direction}\",protocol=\"HBONE\"}}");
            eventually(&format!("{prefix} = {PAYLOAD}"), || (metric(&netns, &prefix)? == PAYLOAD as f64).then_some(()));
        }
    }
    assert!(proxy.log().contains("direction=\"inbound\" protocol=\"HBONE\""), "access log of the tunnel");
}

#[test]
fn deleting_a_pod_closes_its_listeners_within_a_second() {
    let scene = scene();
    let b_uid = uid(&scene.cluster, NS, "b");
    for port in [15001, 15006, 15008] {
        assert!(listening(&scene.b.netns, port), "B has a listener on {port} before the delete");
    }
    scene.cluster.api.delete("Pod", Some(NS), "b").expect("pod was stored");
    let stopped = format!("pod proxy stopped uid=\"{b_uid}\"");
    eventually("the proxy stops B's proxy", || scene.proxy.log().contains(&stopped).then_some(()));
    let since = std::time::Instant::now();
    while [15001, 15006, 15008].iter().any(|port| listening(&scene.b.netns, *port)) {
        assert!(since.elapsed() < Duration::from_secs(1), "B's listeners still open 1 s after DelWorkload");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(listening(&scene.a.netns, 15008), "A's proxy is untouched");
}

#[test]
fn a_restarted_proxy_gets_the_pods_back_from_the_snapshot() {
    let mut scene = scene();
    scene.proxy.stop();
    eventually("the old proxy's listeners are gone", || (!listening(&scene.b.netns, 15008)).then_some(()));
    scene.proxy = Proxy::start(&scene.cluster, &scene.agent, scene.dir.path(), &scene.workloads(), &[]);
    for pod in [&scene.a, &scene.b] {
        assert!(listening(&pod.netns, 15008), "listeners are back by the time the new proxy is ready");
    }
    let peer = transfer(&scene, 1024 * 1024);
    assert_eq!(peer.ip(), IpAddr::from(scene.a.ip), "B's app sees A's IP after the restart");
    // The access log line is written when B's side of the tunnel stream ends, which may be after A's app saw EOF.
    eventually("the new proxy logged the inbound HBONE connection", || {
        scene.proxy.log().contains("direction=\"inbound\" protocol=\"HBONE\"").then_some(())
    });
}

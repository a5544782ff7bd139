//! Across-node acceptance: two node netns, each with its own real node agent, fake API server and real
//! `hbone-proxy` (sharing one mesh CA, as the nodes of one mesh do), linked by a veth with a route to each
//! other's pod subnet. Ambient pod A on node 1 exchanges 1 GiB each way with ambient pod B on node 2: hashes match
//! on both ends, B's app sees A's IP, both proxies count exactly the transferred bytes, and on the link between the
//! nodes the payload crosses only on port 15008 as TLS.

use std::net::{IpAddr, SocketAddr};

use istio_contract::ports;
use testbed::Pod;

mod support;
use support::capture::{payload_bytes, Capture};
use support::traffic::{Payload, MARKER};
use support::two_nodes::{NodeSide, TwoNodes, LINK};
use support::{ambient_member, connect_from, listen_on, workload, write_workloads, APP_PORT};

/// Bytes each way in the large transfer, as in the same-node acceptance test.
const PAYLOAD: u64 = 1024 * 1024 * 1024;
/// Bytes each way in the captured transfer.
const CAPTURED: u64 = 8 * 1024 * 1024;
/// Both byte counters of A's outbound (node 1, `reporter="source"`) and B's inbound (node 2,
/// `reporter="destination"`) HBONE connections.
fn byte_metrics(one: &NodeSide, two: &NodeSide) -> Vec<f64> {
    let names = ["istio_tcp_received_bytes_total", "istio_tcp_sent_bytes_total"];
    let mut values = Vec::new();
    for (side, outbound) in [(one, true), (two, false)] {
        for name in names {
            let netns = side.cluster.node.netns().path();
            values.push(support::metrics::sum(&netns, name, &support::metrics::hbone(outbound)));
        }
    }
    values
}

#[test]
fn pods_on_two_nodes_talk_over_hbone_with_the_clients_ip_preserved() {
    let nodes = TwoNodes::start(&[]);
    let (one, two) = (&nodes.one, &nodes.two);
    let a: Pod = ambient_member(&one.cluster, "a", "a-sa");
    let b: Pod = ambient_member(&two.cluster, "b", "b-sa");
    // Each test node has an API server of its own, so neither proxy's Kubernetes source sees the other node's
    // pod: both proxies are told of both pods through their local workloads files.
    let listing = || {
        vec![
            workload(&one.cluster, "a", "a-sa", a.ip.into(), "node-1"),
            workload(&two.cluster, "b", "b-sa", b.ip.into(), "node-2"),
        ]
    };
    for side in [one, two] {
        write_workloads(&side.proxy, &side.dir.path().join("workloads.yaml"), listing());
    }
    let b_app = SocketAddr::from((b.ip, APP_PORT));

    // A first, captured exchange: on the link between the nodes only 15008 carries payload, and as TLS.
    let files = tempfile::tempdir().expect("capture dir");
    let file = files.path().join("link.pcap");
    let capture = Capture::start(one.cluster.node.netns(), LINK[0].0, &file);
    let (a_data, b_data) = (Payload::new(1, CAPTURED).marked(), Payload::new(2, CAPTURED).marked());
    let peer = support::traffic::transfer(listen_on(&b, APP_PORT), || connect_from(&a, b_app), a_data, b_data);
    assert_eq!(peer.ip(), IpAddr::from(a.ip), "B's app on node 2 sees A's IP as the peer");
    let packets =
        capture.stop_when("both payloads on the node link", |p| payload_bytes(p, ports::HBONE) > 2 * CAPTURED);
    let raw = std::fs::read(&file).expect("read capture");
    assert!(!raw.windows(MARKER.len()).any(|w| w == MARKER), "the plaintext marker crossed the node link");
    let with_payload: Vec<_> = packets.iter().filter(|p| !p.payload.is_empty()).collect();
    let off_port: Vec<_> = with_payload.iter().filter(|p| p.sport != ports::HBONE && p.dport != ports::HBONE).collect();
    assert!(off_port.is_empty(), "TCP payload outside port 15008 on the node link: {off_port:?}");
    let hello = with_payload.iter().find(|p| p.dport == ports::HBONE).expect("payload towards 15008");
    assert_eq!(hello.payload[..2], [0x16, 0x03], "the HBONE connection starts with a TLS handshake record");

    // The large exchange, counted exactly by both proxies.
    let before = byte_metrics(one, two);
    let (a_data, b_data) = (Payload::new(3, PAYLOAD), Payload::new(4, PAYLOAD));
    let peer = support::traffic::transfer(listen_on(&b, APP_PORT), || connect_from(&a, b_app), a_data, b_data);
    assert_eq!(peer.ip(), IpAddr::from(a.ip), "B's app on node 2 sees A's IP as the peer");
    let want: Vec<f64> = before.iter().map(|v| v + PAYLOAD as f64).collect();
    testbed::wait::eventually("both proxies counted exactly the transfer each way", || {
        (byte_metrics(one, two) == want).then_some(())
    });
    assert!(two.proxy.log().contains("direction=\"inbound\" protocol=\"HBONE\""), "node 2 logged the tunnel");
}

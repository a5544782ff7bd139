//! The same-node fast path of the real `hbone-proxy` (real node agent, pods through the fake CNI runtime): when both
//! pods are enrolled in the node's proxy, A's connection to B is connected inside B's netns directly, so not one
//! packet between A's and B's addresses crosses the node's bridge (an nftables counter on it), while B's app still
//! sees A's IP, both sides' traffic series say `connection_security_policy="same_node"` with the enrolled
//! identities, and half-close passes through. What HBONE refuses is still refused: plaintext into B under
//! `MTLS_MODE=STRICT`, a `requireMtls` destination outside the mesh, a B that is not the identity the directory
//! lists. With `SAME_NODE_FAST_PATH=false` the same connection crosses the bridge as HBONE on 15008.

use std::io::{Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr};
use std::sync::atomic::Ordering;

use istio_contract::ports;
use istio_contract::telemetry::{
    label, REPORTER_DESTINATION, REPORTER_SOURCE, SECURITY_POLICY_SAME_NODE, TCP_RECEIVED_BYTES, TCP_SENT_BYTES,
};
use serde_json::json;
use testbed::node::BRIDGE;
use testbed::node_agent::uid;
use testbed::wait::eventually;
use testbed::NetnsGuard;

mod support;
use support::metrics::{scrape, sum};
use support::traffic::{echo_app, transfer, Payload};
use support::{
    listen_on, plain_member, say_hello, workload, write_workloads, Scene, APP_PORT, B_SA, HBONE_ON_ONE_NODE, NS, TD,
};

/// Bytes each way in the transfers: many pipes' worth.
const PAYLOAD: u64 = 8 * 1024 * 1024;
const HELLO: &[u8] = b"hello through the mesh";

fn scene(b_listed_sa: &str, env: &[(&str, &str)]) -> Scene {
    Scene::new(tempfile::tempdir().expect("scratch dir"), b_listed_sa, env)
}

/// Packet counters on the node's bridge, in the node netns: every frame the bridge forwards between A's and B's
/// addresses (either way): those to or from port 15008 counted as `hbone`, the others as `between`.
fn count_on_bridge(scene: &Scene) {
    let (a, b, hbone) = (scene.a.ip, scene.b.ip, ports::HBONE);
    let rules = format!(
        r#"
table bridge fastpathtest {{
    chain forward {{
        type filter hook forward priority 0; policy accept;
        ip saddr {a} ip daddr {b} tcp dport {hbone} counter accept comment "hbone"
        ip saddr {b} ip daddr {a} tcp sport {hbone} counter accept comment "hbone"
        ip saddr {a} ip daddr {b} counter comment "between"
        ip saddr {b} ip daddr {a} counter comment "between"
    }}
}}
"#
    );
    let file = tempfile::NamedTempFile::new().expect("rules file");
    std::fs::write(file.path(), rules).expect("write rules");
    scene.cluster.node.netns().exec_ok(&["nft", "-f", &file.path().display().to_string()]);
}

/// The packets the bridge counters commented `name` saw, summed.
fn bridged(node: &NetnsGuard, name: &str) -> u64 {
    let text = node.exec_ok(&["nft", "list", "table", "bridge", "fastpathtest"]);
    let counted: Vec<u64> = text
        .lines()
        .filter(|l| l.contains(&format!("comment \"{name}\"")))
        .map(|l| l.split_whitespace().skip_while(|w| *w != "packets").nth(1).expect("packets").parse().expect("count"))
        .collect();
    assert!(!counted.is_empty(), "no counter {name} on {BRIDGE}: {text}");
    counted.iter().sum()
}

/// A's app connects to B:8080 and both send [`PAYLOAD`] bytes; returns B's view of the peer after checking lengths
/// and hashes on both ends.
fn a_and_b_exchange(scene: &Scene) -> SocketAddr {
    let (a_data, b_data) = (Payload::new(1, PAYLOAD), Payload::new(2, PAYLOAD));
    transfer(scene.b_listener(), || scene.a_connects_to_b(), a_data, b_data)
}

/// The `istio_tcp_*` byte counter `name` of the fast path as `reporter` reports it, between A (`a-sa`) and B.
fn fast_path_bytes(scene: &Scene, name: &str, reporter: &str) -> f64 {
    let (a, b) = (format!("spiffe://{TD}/ns/{NS}/sa/a-sa"), format!("spiffe://{TD}/ns/{NS}/sa/{B_SA}"));
    let matchers = [
        (label::REPORTER, reporter),
        (label::CONNECTION_SECURITY_POLICY, SECURITY_POLICY_SAME_NODE),
        (label::SOURCE_PRINCIPAL, a.as_str()),
        (label::DESTINATION_PRINCIPAL, b.as_str()),
        (label::SOURCE_WORKLOAD, "a"),
        (label::DESTINATION_WORKLOAD, "b"),
    ];
    sum(&scene.cluster.node.netns().path(), &format!("{name}_total"), &matchers)
}

#[test]
fn pods_on_one_node_exchange_bytes_over_the_fast_path_with_nothing_on_the_bridge_and_the_clients_ip_preserved() {
    let scene = scene(B_SA, &[]);
    count_on_bridge(&scene);

    let peer = a_and_b_exchange(&scene);
    assert_eq!(peer.ip(), IpAddr::from(scene.a.ip), "B's app sees A's IP as the peer");

    let node = scene.cluster.node.netns();
    assert_eq!(bridged(node, "between"), 0, "no packet between A and B crossed {BRIDGE}, on 15008 or directly");
    assert_eq!(bridged(node, "hbone"), 0);
    // Both sides report the connection, as over HBONE, each with what its app sent and got.
    for reporter in [REPORTER_SOURCE, REPORTER_DESTINATION] {
        for name in [TCP_RECEIVED_BYTES, TCP_SENT_BYTES] {
            eventually(&format!("{name} of the fast path as the {reporter} reports it"), || {
                (fast_path_bytes(&scene, name, reporter) == PAYLOAD as f64).then_some(())
            });
        }
    }
    let every_series = scrape(&node.path());
    let tls = every_series.iter().filter(|s| s.matches(&[(label::CONNECTION_SECURITY_POLICY, "mutual_tls")]));
    assert_eq!(tls.count(), 0, "nothing was reported as mutual TLS: no HBONE connection was made");
    let log = scene.proxy.log();
    for direction in ["outbound", "inbound"] {
        let line = format!("direction=\"{direction}\" protocol=\"SAME_NODE\"");
        assert!(log.contains(&line), "the access log has the {direction} side of the fast path:\n{log}");
    }
}

#[test]
fn with_the_fast_path_switched_off_the_same_pods_talk_hbone_on_15008_across_the_bridge() {
    let scene = scene(B_SA, &[HBONE_ON_ONE_NODE]);
    count_on_bridge(&scene);

    let peer = a_and_b_exchange(&scene);
    assert_eq!(peer.ip(), IpAddr::from(scene.a.ip));

    let node = scene.cluster.node.netns();
    let hbone = bridged(node, "hbone");
    assert!(hbone > 0, "A and B talked over {BRIDGE} on 15008");
    assert_eq!(bridged(node, "between"), 0, "and only on 15008: the hbone rules count those packets first");
    assert!(scene.proxy.log().contains("direction=\"inbound\" protocol=\"HBONE\""), "carried over HBONE");
    for reporter in [REPORTER_SOURCE, REPORTER_DESTINATION] {
        assert_eq!(fast_path_bytes(&scene, TCP_RECEIVED_BYTES, reporter), 0.0, "no fast-path series");
    }
}

#[test]
fn half_close_passes_through_the_fast_path() {
    let scene = scene(B_SA, &[]);
    let listener = scene.b_listener();
    // B's app answers only after A's side reached EOF: the answer is what it got, reversed.
    let server = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().expect("accept");
        let mut got = Vec::new();
        stream.read_to_end(&mut got).expect("B reads to EOF");
        got.reverse();
        stream.write_all(&got).expect("B answers after EOF");
    });
    let data: Vec<u8> = (0..1024 * 1024u32).map(|i| (i * 7 % 251) as u8).collect();
    let mut stream = scene.a_connects_to_b();
    stream.write_all(&data).expect("A sends");
    stream.shutdown(Shutdown::Write).expect("A shuts down its write side");
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).expect("A reads the answer after its half-close");
    server.join().expect("B's app");
    let mut expected = data;
    expected.reverse();
    assert!(answer == expected, "A read B's full answer ({} of {} bytes)", answer.len(), expected.len());
    assert!(scene.proxy.log().contains("protocol=\"SAME_NODE\""), "carried over the fast path");
}

/// As over HBONE: `STRICT` refuses plaintext into B from a pod outside the mesh, and lets A in, which the
/// enrollment proves.
#[test]
fn strict_mtls_mode_still_refuses_plaintext_inbound_and_lets_the_fast_path_in() {
    let scene = scene(B_SA, &[("MTLS_MODE", "STRICT")]);
    count_on_bridge(&scene);
    let outsider = plain_member(&scene.cluster, "n");
    let accepted = echo_app(scene.b_listener());

    let refused = say_hello(&outsider, &scene.b, HELLO);
    assert!(refused.as_ref().map_or(true, Vec::is_empty), "plaintext got through in STRICT mode: {refused:?}");
    assert_eq!(accepted.load(Ordering::SeqCst), 0, "B's app never saw the plaintext connection");
    let logged = "plaintext refused: MTLS_MODE=STRICT";
    eventually("the access log tells", || scene.proxy.log().contains(logged).then_some(()));

    assert_eq!(say_hello(&scene.a, &scene.b, HELLO).expect("A over the fast path"), HELLO, "mesh traffic still flows");
    assert_eq!(accepted.load(Ordering::SeqCst), 1);
    let node = scene.cluster.node.netns();
    assert_eq!(bridged(node, "hbone") + bridged(node, "between"), 0, "it took the fast path: nothing on the bridge");
}

/// As over HBONE: a destination that requires mTLS but is not in the mesh is refused, never reached in plaintext.
#[test]
fn a_destination_that_requires_mtls_but_is_not_in_the_mesh_is_still_refused() {
    let scene = scene(B_SA, &[]);
    let outsider = plain_member(&scene.cluster, "c");
    let accepted = echo_app(listen_on(&outsider, APP_PORT));
    let c = json!({
        "uid": uid(&scene.cluster, NS, "c"), "name": "c", "namespace": NS, "workloadIps": [outsider.ip],
        "protocol": "TCP", "requireMtls": true, "node": "node-1",
    });
    let listing = vec![
        workload(&scene.cluster, "a", "a-sa", scene.a.ip.into(), "node-1"),
        workload(&scene.cluster, "b", B_SA, scene.b.ip.into(), "node-1"),
        c,
    ];
    write_workloads(&scene.proxy, &scene.workloads(), listing);

    let refused = say_hello(&scene.a, &outsider, HELLO);
    assert!(refused.as_ref().map_or(true, Vec::is_empty), "reached in plaintext despite requireMtls: {refused:?}");
    assert_eq!(accepted.load(Ordering::SeqCst), 0, "C's app never saw the refused connection");
    eventually("the access log tells", || scene.proxy.log().contains("requires mTLS").then_some(()));
    let _b_app = echo_app(scene.b_listener());
    assert_eq!(say_hello(&scene.a, &scene.b, HELLO).expect("A to B"), HELLO, "A still reaches B");
    eventually("over the fast path", || scene.proxy.log().contains("protocol=\"SAME_NODE\"").then_some(()));
}

/// As over HBONE, where B's certificate would not prove the listed identity: a B enrolled as another identity than
/// the directory lists at its address is not reached.
#[test]
fn a_pod_enrolled_as_another_identity_than_listed_is_not_reached() {
    let scene = scene("other", &[]);
    let accepted = echo_app(scene.b_listener());
    let refused = say_hello(&scene.a, &scene.b, HELLO);
    assert!(refused.as_ref().map_or(true, Vec::is_empty), "A reached a B that is not the listed identity: {refused:?}");
    assert_eq!(accepted.load(Ordering::SeqCst), 0, "B's app never saw the connection");
    assert!(!scene.proxy.log().contains("protocol=\"SAME_NODE\""), "no connection took the fast path");

    scene.list_b_as(B_SA);
    assert_eq!(say_hello(&scene.a, &scene.b, HELLO).expect("A to B listed as itself"), HELLO);
    assert_eq!(accepted.load(Ordering::SeqCst), 1);
    eventually("over the fast path", || scene.proxy.log().contains("protocol=\"SAME_NODE\"").then_some(()));
}

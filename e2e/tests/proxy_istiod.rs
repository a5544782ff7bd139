//! The real `hbone-proxy` with `CONTROL_PLANE=istiod` on two linked test nodes, against an in-process fake istiod
//! (`testbed::fake_istiod`: Delta xDS and the CA, served from node one's netns at 192.0.2.1, which both proxies
//! reach over the link). Workloads and policies come only from the fake's xDS, certificates only from its CA
//! (impersonated requests for the pods of each proxy's node):
//! - pods on the two nodes talk over HBONE mTLS with the CA's certificates, and a DENY policy pushed over xDS stops
//!   new connections until an ALLOW replaces it;
//! - with istiod away, new connections keep working on the last state, and once it is back the proxies drop what
//!   it removed meanwhile and a policy pushed after the reconnect is enforced;
//! - a pod whose certificate the CA refuses is not served: its CNI ADD fails with istiod's refusal.

use std::net::IpAddr;
use std::time::{Duration, Instant};

use istio_contract::telemetry::{label, REPORTER_DESTINATION, SECURITY_POLICY_MUTUAL_TLS};
use serde_json::Value;
use testbed::fake_istiod::{exact, pod_uid, pod_workload, FakeControlPlane, TRUST_DOMAIN};
use testbed::wait::{eventually, eventually_or, within_every};
use testbed::{Cluster, Pod};
use xds::wire::security::{Action, Authorization, Group, Match, Rules, Scope};
use xds::wire::ResourceType;

mod support;
use support::traffic::echo_app;
use support::two_nodes::{NodeSide, TwoNodes, LINK};
use support::{ambient_member, listen_on, say_hello, APP_PORT, NS};

const HELLO: &[u8] = b"hello across nodes through istiod's mesh";
/// The node names the proxies are given (`NODE_NAME`) and their pods are placed on.
const NODES: [&str; 2] = ["node-1", "node-2"];
/// The refused-connection counter, as istiod's policies refuse.
const REFUSED: &str = "istio_tcp_connections_refused_total";
const BY_POLICY: [(&str, &str); 2] = [("direction", "inbound"), ("reason", "authorization_policy")];

/// The two nodes (proxies in istiod mode) and the fake istiod. Field order is drop order: the proxies go first.
struct Mesh {
    nodes: TwoNodes,
    istiod: FakeControlPlane,
}

impl Mesh {
    /// Both nodes linked, the fake istiod serving in node one's netns, each proxy registered with it as the node
    /// proxy of its node; returns once both proxies are ready (which needs istiod's first answers).
    fn start() -> Mesh {
        let mut istiod = None;
        let nodes = TwoNodes::start_linked(|one, _| {
            let mut fake = FakeControlPlane::start_in(one.node.netns(), link_ip(0));
            let env =
                [fake.add_node(NODES[0], "ztunnel-1", link_ip(0)), fake.add_node(NODES[1], "ztunnel-2", link_ip(1))];
            istiod = Some(fake);
            env
        });
        Mesh { nodes, istiod: istiod.expect("the fake istiod started") }
    }

    /// Ambient pod `name` (service account `sa`) on node `node` (0 or 1): placed on that node for the CA, created
    /// through the CNI runtime, then listed by istiod as an HBONE workload.
    fn pod(&self, node: usize, name: &str, sa: &str) -> Pod {
        self.istiod.place_pod(NS, name, sa, NODES[node]);
        let pod = ambient_member(&self.side(node).cluster, name, sa);
        self.istiod.set_workload(pod_workload(NS, name, sa, pod.ip.into(), NODES[node]));
        pod
    }

    fn side(&self, node: usize) -> &NodeSide {
        [&self.nodes.one, &self.nodes.two][node]
    }

    /// Waits until both proxies list exactly `names` as istiod's workloads.
    fn await_listed(&self, names: &[&str]) {
        for node in 0..2 {
            let proxy = &self.side(node).proxy;
            eventually_or(
                &format!("node {}'s proxy lists {names:?} from istiod", node + 1),
                || {
                    let listed = proxy.listed_workloads("istiod")?;
                    let mut got: Vec<&str> = listed.iter().filter_map(|w| w["name"].as_str()).collect();
                    got.sort_unstable();
                    let mut want = names.to_vec();
                    want.sort_unstable();
                    (got == want).then_some(())
                },
                || format!("{:?}", proxy.config_dump()),
            );
        }
    }

    /// Waits until both proxies have applied (ACKed) istiod's current resource set.
    fn await_synced(&self) {
        let version = self.istiod.version();
        assert!(
            self.istiod.wait_synced(version, 2, Duration::from_secs(10)),
            "both proxies ACKed istiod's latest push"
        );
    }

    /// Connections node `node`'s proxy refused by policy.
    fn refused(&self, node: usize) -> f64 {
        support::metrics::sum(&self.side(node).cluster.node.netns().path(), REFUSED, &BY_POLICY)
    }
}

fn link_ip(node: usize) -> IpAddr {
    LINK[node].1.parse().expect("link address")
}

fn spiffe(sa: &str) -> String {
    format!("spiffe://{TRUST_DOMAIN}/ns/{NS}/sa/{sa}")
}

/// Whether a new connection from `from` to `to`'s echo app gets its bytes echoed.
fn echoed(from: &Pod, to: &Pod) -> bool {
    say_hello(from, to, HELLO).is_ok_and(|back| back == HELLO)
}

/// A DENY policy for the workloads of namespace [`NS`] that matches connections from service account `sa`.
fn deny_from(name: &str, sa: &str) -> Authorization {
    let from = Match { principals: vec![exact(&format!("{TRUST_DOMAIN}/ns/{NS}/sa/{sa}"))], ..Default::default() };
    policy(name, Action::Deny, from)
}

/// An ALLOW policy for the workloads of namespace [`NS`] that matches connections from service account `sa`.
fn allow_from(name: &str, sa: &str) -> Authorization {
    let from = Match { principals: vec![exact(&format!("{TRUST_DOMAIN}/ns/{NS}/sa/{sa}"))], ..Default::default() };
    policy(name, Action::Allow, from)
}

fn policy(name: &str, action: Action, m: Match) -> Authorization {
    Authorization {
        name: name.into(),
        namespace: NS.into(),
        scope: Scope::Namespace as i32,
        action: action as i32,
        groups: vec![Group { rules: vec![Rules { matches: vec![m] }] }],
        ..Default::default()
    }
}

/// The certificate states a proxy's `/config_dump` lists, by identity.
fn certificate_state(dump: &Value, identity: &str) -> Option<(String, String)> {
    let certs = dump["certificates"].as_array()?;
    let cert = certs.iter().find(|c| c["identity"] == identity)?;
    Some((cert["state"].as_str()?.to_owned(), cert["issuer"].as_str().unwrap_or_default().to_owned()))
}

/// The connections `cluster`'s proxy opened as the destination over `mutual_tls` from `source` (`source_principal`).
fn mutual_tls_from(cluster: &Cluster, source: &str) -> f64 {
    let matchers = [
        (label::REPORTER, REPORTER_DESTINATION),
        (label::CONNECTION_SECURITY_POLICY, SECURITY_POLICY_MUTUAL_TLS),
        (label::SOURCE_PRINCIPAL, source),
    ];
    support::metrics::sum(&cluster.node.netns().path(), "istio_tcp_connections_opened_total", &matchers)
}

/// Pods on two nodes, everything from istiod: the bytes cross HBONE mTLS with the CA's certificates (B's proxy sees
/// A's certificate identity), and a DENY pushed over xDS stops new connections until an ALLOW replaces it.
#[test]
fn pods_on_two_nodes_talk_over_mtls_with_istiods_certificates_and_obey_its_policies() {
    let mesh = Mesh::start();
    let a = mesh.pod(0, "a", "a-sa");
    let b = mesh.pod(1, "b", "b-sa");
    mesh.await_listed(&["a", "b"]);
    let echoes = echo_app(listen_on(&b, APP_PORT));

    // Certificates: each proxy holds its pod's, issued by the fake CA on an impersonated request.
    for (node, sa) in [(0, "a-sa"), (1, "b-sa")] {
        let proxy = &mesh.side(node).proxy;
        let (state, issuer) = eventually("the pod's certificate is available", || {
            certificate_state(&proxy.config_dump()?, &spiffe(sa)).filter(|(s, _)| s == "Available")
        });
        assert_eq!(state, "Available");
        assert!(issuer.contains("fake istiod"), "issued by the fake CA, not a local one: {issuer}");
        let dump = proxy.config_dump().expect("config dump");
        assert_eq!(dump["control_plane"], "istiod", "{dump}");
    }
    let requests = mesh.istiod.ca().requests();
    for sa in ["a-sa", "b-sa"] {
        assert!(
            requests.iter().any(|r| r.impersonated.as_deref() == Some(spiffe(sa).as_str())
                && r.outcome.as_deref() == Ok(spiffe(sa).as_str())),
            "the CA signed an impersonated request for {sa}: {requests:?}"
        );
    }

    // Across the nodes over mTLS: B's proxy accepted A's connection as A's certificate identity.
    let before = mutual_tls_from(&mesh.nodes.two.cluster, &spiffe("a-sa"));
    assert_eq!(say_hello(&a, &b, HELLO).expect("A talks to B"), HELLO, "B's app echoed A's bytes");
    eventually("B's proxy counted an mTLS connection from A's identity", || {
        (mutual_tls_from(&mesh.nodes.two.cluster, &spiffe("a-sa")) > before).then_some(())
    });

    // A DENY of A's identity, pushed over xDS: new connections are refused at B's proxy.
    let refused = mesh.refused(1);
    mesh.istiod.set_policy(deny_from("deny-a", "a-sa"));
    mesh.await_synced();
    assert!(!echoed(&a, &b), "once B's proxy has the DENY, A's new connection is refused");
    assert!(mesh.refused(1) > refused, "B's proxy counted the refusal as authorization_policy");
    let dump = mesh.nodes.two.proxy.config_dump().expect("config dump");
    assert!(dump["policies"].to_string().contains("deny-a"), "B's proxy lists the policy: {}", dump["policies"]);
    let accepted = echoes.load(std::sync::atomic::Ordering::SeqCst);
    assert!(!echoed(&a, &b), "still refused");
    assert_eq!(echoes.load(std::sync::atomic::Ordering::SeqCst), accepted, "no refused connection reached B's app");

    // ALLOW again: the DENY removed and an ALLOW of A's identity pushed, A reaches B again.
    mesh.istiod.remove(ResourceType::Authorization, &format!("{NS}/deny-a"));
    mesh.istiod.set_policy(allow_from("allow-a", "a-sa"));
    mesh.await_synced();
    assert!(echoed(&a, &b), "A reaches B again");
}

/// istiod away: the proxies keep the last workloads, policies and certificates, so new connections between the pods
/// keep working while it is gone; once it is back, the proxies reconnect, drop the workload istiod removed meanwhile,
/// and a policy pushed then is enforced.
#[test]
fn with_istiod_away_connections_keep_working_and_a_policy_pushed_after_its_return_is_enforced() {
    let mut mesh = Mesh::start();
    let a = mesh.pod(0, "a", "a-sa");
    let b = mesh.pod(1, "b", "b-sa");
    // A workload of a third node, which istiod forgets while the proxies cannot hear it.
    mesh.istiod.set_workload(pod_workload(NS, "gone", "gone-sa", "10.99.0.1".parse().expect("IP"), "node-3"));
    mesh.await_listed(&["a", "b", "gone"]);
    let _echoes = echo_app(listen_on(&b, APP_PORT));
    eventually("A reaches B", || echoed(&a, &b).then_some(()));
    let (accepted, open) = mesh.istiod.streams();
    assert_eq!(open, 2, "both proxies hold a stream to istiod");

    mesh.istiod.stop();
    mesh.istiod.remove(ResourceType::Address, &pod_uid(NS, "gone"));
    // An observation window, not a wait: every few seconds over a minute, a new connection from A to B.
    let away = Instant::now();
    let mut samples = 0;
    let two = &mesh.nodes.two.cluster;
    let failed = within_every(away, Duration::from_secs(60), Duration::from_secs(5), || {
        samples += 1;
        let before = mutual_tls_from(two, &spiffe("a-sa"));
        if !echoed(&a, &b) {
            return Some(format!("a new connection failed {:?} after istiod left", away.elapsed()));
        }
        // Over mTLS as A, not in plaintext: B's proxy counts it from A's certificate identity.
        let counted = testbed::wait::within(Instant::now(), Duration::from_secs(5), || {
            (mutual_tls_from(two, &spiffe("a-sa")) > before).then_some(())
        });
        counted.is_none().then(|| format!("a connection {:?} after istiod left was not mTLS from A", away.elapsed()))
    });
    assert_eq!(failed, None, "with istiod away");
    assert!(samples >= 10, "sampled {samples} times over the minute");
    assert_eq!(mesh.istiod.streams().1, 0, "no stream to istiod is open while it is away");
    for node in 0..2 {
        let log = mesh.side(node).proxy.log();
        assert!(log.contains("xDS connection failed"), "node {}'s proxy tried istiod and failed meanwhile", node + 1);
    }
    for node in 0..2 {
        let dump = mesh.side(node).proxy.config_dump().expect("config dump");
        let listed = mesh.side(node).proxy.listed_workloads("istiod").expect("workloads");
        assert_eq!(listed.len(), 3, "node {} still lists what istiod last said: {dump}", node + 1);
        let sa = ["a-sa", "b-sa"][node];
        let state = certificate_state(&dump, &spiffe(sa)).map(|(state, _)| state);
        assert_eq!(state.as_deref(), Some("Available"), "node {} keeps its pod's certificate: {dump}", node + 1);
    }

    mesh.istiod.start();
    eventually("both proxies reconnected to istiod and have its state", || {
        let (now_accepted, open) = mesh.istiod.streams();
        let synced = mesh.istiod.synced_streams(mesh.istiod.version());
        (now_accepted >= accepted + 2 && open == 2 && synced == 2).then_some(())
    });
    // The removal made while they were away reached them (from what they said they held on reconnecting).
    mesh.await_listed(&["a", "b"]);
    let refused = mesh.refused(1);
    mesh.istiod.set_policy(deny_from("deny-a", "a-sa"));
    mesh.await_synced();
    assert!(!echoed(&a, &b), "once B's proxy has the DENY pushed after the reconnect, A's new connection is refused");
    assert!(mesh.refused(1) > refused, "B's proxy counted the refusal as authorization_policy");
}

/// A pod the CA will not certify for its node's proxy (istiod sees no such pod on that node) is not served: its proxy
/// does not start, the node agent rolls the enrollment back (so the proxy keeps no pending pod and no certificate
/// for it), and the CNI ADD fails with istiod's refusal, so the runtime does not run the pod outside the mesh. Once
/// istiod knows the pod on the node, the runtime's next ADD enrolls it.
#[test]
fn a_pod_whose_certificate_istiod_refuses_is_not_served_and_its_cni_add_fails() {
    let mesh = Mesh::start();
    let one = &mesh.nodes.one;
    // Not placed on node 1 for the CA.
    let mut object = testbed::node_agent::ambient_pod(NS, "c");
    object["spec"]["serviceAccountName"] = "c-sa".into();
    one.cluster.create(&object);
    let conflist = || support::conflist_for(&one.cluster, support::Stack::V4);
    let error = one.cluster.add_with(conflist(), "c", NS).expect_err("the ADD of a pod istiod will not certify fails");
    let error = error.to_string();
    assert!(
        error.contains(mesh_ca::testing::IMPERSONATION_FAILURE) && error.contains(&spiffe("c-sa")),
        "the ADD fails naming istiod's refusal of c's identity: {error}"
    );
    let recorded = mesh.istiod.ca().requests();
    let asked = recorded.iter().find(|r| r.impersonated.as_deref() == Some(spiffe("c-sa").as_str()));
    let asked = asked.unwrap_or_else(|| panic!("the proxy asked the CA for c's certificate: {recorded:?}"));
    assert!(
        matches!(&asked.outcome, Err((_, m)) if m == mesh_ca::testing::IMPERSONATION_FAILURE),
        "the CA refused it as istiod does: {asked:?}"
    );
    let dump = one.proxy.config_dump().expect("config dump");
    assert_eq!(dump["pods"], serde_json::json!([]), "no proxy runs for c: {dump}");
    assert_eq!(dump["pending"], serde_json::json!([]), "the rolled-back pod is not kept pending: {dump}");
    assert!(certificate_state(&dump, &spiffe("c-sa")).is_none(), "no certificate held for c: {dump}");

    // istiod learns the pod runs on node 1: the runtime's next ADD enrolls it, with istiod's certificate.
    mesh.istiod.place_pod(NS, "c", "c-sa", NODES[0]);
    let c = one.cluster.add_with(conflist(), "c", NS).expect("the retried ADD enrolls c");
    let dump = one.proxy.config_dump().expect("config dump");
    assert_eq!(dump["pods"][0]["name"], "c", "c's proxy runs: {dump}");
    let state = certificate_state(&dump, &spiffe("c-sa")).map(|(state, _)| state);
    assert_eq!(state.as_deref(), Some("Available"), "c holds istiod's certificate: {dump}");
    assert!(support::listening(&c.netns, istio_contract::ports::HBONE), "c's HBONE listener is up");
}

//! Mesh policy in the real `hbone-proxy` (real node agent, pods through the fake CNI runtime): `MTLS_MODE=STRICT`
//! refuses plaintext inbound connections captured on 15006 (`PERMISSIVE`, the default, forwards them), and a
//! destination the local workloads file marks `requireMtls: true` but which does not speak HBONE is refused
//! instead of being reached in plaintext. `STRICT` does not cover the kubelet's connections, which the host
//! probe SNAT sends around the proxy, as in Istio.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::Ordering;
use std::time::Duration;

use istio_contract::ports;
use serde_json::json;

use testbed::kubelet::KUBELET_UID;
use testbed::mesh::plain_pod;
use testbed::node_agent::{ambient_conflist, uid};
use testbed::wait::eventually;
use testbed::{Cluster, NetnsGuard, Pod};

mod support;
use support::traffic::echo_app;
use support::{listen_on, listening, workload, write_workloads, Proxy, Scene, APP_PORT, HBONE_ON_ONE_NODE, NS};

const HELLO: &[u8] = b"hello through the mesh";

/// A scene with the proxy's `env`, and its same-node fast path off: A reaches B over HBONE, as from another node
/// (`proxy_fast_path.rs` runs these policies over the fast path).
fn scene(env: &[(&str, &str)]) -> Scene {
    let env: Vec<(&str, &str)> = [HBONE_ON_ONE_NODE].into_iter().chain(env.iter().copied()).collect();
    Scene::new(tempfile::tempdir().expect("scratch dir"), "b-sa", &env)
}

/// A pod outside the mesh (not labelled for ambient) on the scene's node.
fn plain_member(cluster: &Cluster, name: &str) -> Pod {
    cluster.create(&plain_pod(NS, name));
    cluster.add_with(ambient_conflist(cluster), name, NS).expect("CNI ADD")
}

/// An app in `from` sends [`HELLO`] to `to`:8080, shuts down its write side and reads to the end: what came back.
fn say_hello(from: &Pod, to: &Pod) -> io::Result<Vec<u8>> {
    let dst = SocketAddr::from((to.ip, APP_PORT));
    let ns = from.netns.open().expect("open pod netns");
    let stream = ns.run(|| TcpStream::connect_timeout(&dst, Duration::from_secs(10))).expect("enter pod netns")?;
    hello_over(stream)
}

/// Sends [`HELLO`] on `stream`, half-closes it, and returns what came back.
fn hello_over(mut stream: TcpStream) -> io::Result<Vec<u8>> {
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    stream.write_all(HELLO)?;
    stream.shutdown(Shutdown::Write)?;
    let mut back = Vec::new();
    stream.read_to_end(&mut back)?;
    Ok(back)
}

/// A process in the node's netns (`host`) whose sockets are owned by `uid` (root when `None`) sends [`HELLO`] to
/// `to`:8080 in plaintext, as `say_hello` does: what came back.
fn host_says_hello(host: &NetnsGuard, to: &Pod, uid: Option<u32>) -> io::Result<Vec<u8>> {
    let dst = SocketAddr::from((to.ip, APP_PORT));
    let ns = host.open().expect("open node netns");
    // A socket belongs to the fsuid of the thread creating it; `run`'s thread is thrown away afterwards.
    let stream = ns
        .run(|| {
            if let Some(uid) = uid {
                nix::unistd::setfsuid(nix::unistd::Uid::from_raw(uid));
            }
            TcpStream::connect_timeout(&dst, Duration::from_secs(10))
        })
        .expect("enter node netns")?;
    hello_over(stream)
}

/// `STRICT` covers what the in-pod capture hands the proxy, and only that. The kubelet's connections are SNATed on
/// the host to the probe address, which the in-pod rules let through uncaptured: they reach B's app in plaintext
/// and the proxy never sees them. Another host process (nftables mode: not the kubelet's uid) is captured and
/// refused like any plaintext peer.
#[test]
fn strict_mtls_mode_does_not_cover_the_kubelets_plaintext_which_bypasses_the_proxy_through_the_probe_snat() {
    let scene = scene(&[("MTLS_MODE", "STRICT")]);
    let accepted = echo_app(scene.b_listener());
    let host = scene.cluster.node.netns();

    let kubelet = host_says_hello(host, &scene.b, Some(KUBELET_UID)).expect("the kubelet's plaintext connection");
    assert_eq!(kubelet, HELLO, "the kubelet's plaintext reached B's app and came back");
    assert_eq!(accepted.load(Ordering::SeqCst), 1);

    let other = host_says_hello(host, &scene.b, None);
    assert!(other.as_ref().map_or(true, Vec::is_empty), "plaintext of another host uid got through: {other:?}");
    assert_eq!(accepted.load(Ordering::SeqCst), 1, "B's app never saw it");
    let logged = "plaintext refused: MTLS_MODE=STRICT";
    eventually("the access log tells", || scene.proxy.log().contains(logged).then_some(()));
}

#[test]
fn strict_mtls_mode_refuses_plaintext_inbound_and_permissive_forwards_it() {
    let mut scene = scene(&[("MTLS_MODE", "STRICT")]);
    let outsider = plain_member(&scene.cluster, "n");
    let accepted = echo_app(scene.b_listener());

    let refused = say_hello(&outsider, &scene.b);
    assert!(refused.as_ref().map_or(true, Vec::is_empty), "plaintext got through in STRICT mode: {refused:?}");
    assert_eq!(accepted.load(Ordering::SeqCst), 0, "B's app never saw the plaintext connection");
    let logged = "plaintext refused: MTLS_MODE=STRICT";
    eventually("the access log tells", || scene.proxy.log().contains(logged).then_some(()));
    assert_eq!(say_hello(&scene.a, &scene.b).expect("A over HBONE"), HELLO, "mesh traffic still flows");
    assert_eq!(accepted.load(Ordering::SeqCst), 1);

    scene.proxy.stop();
    eventually("the old proxy's listeners are gone", || {
        (!listening(&scene.b.netns, ports::INBOUND_PLAINTEXT)).then_some(())
    });
    scene.proxy =
        Proxy::start(&scene.cluster, &scene.agent, scene.dir.path(), &scene.workloads(), &[HBONE_ON_ONE_NODE]);
    assert_eq!(say_hello(&outsider, &scene.b).expect("plaintext in PERMISSIVE mode"), HELLO);
    assert_eq!(accepted.load(Ordering::SeqCst), 2, "PERMISSIVE (the default) forwards plaintext to the app");
}

#[test]
fn a_destination_that_requires_mtls_but_is_not_in_the_mesh_is_refused_not_reached_in_plaintext() {
    let scene = scene(&[]);
    let outsider = plain_member(&scene.cluster, "c");
    let accepted = echo_app(listen_on(&outsider, APP_PORT));
    // `requireMtls` for a destination outside the mesh is not in any Pod object: only the local workloads file
    // (ztunnel's local config) says it, next to A and B, which the Kubernetes source lists as well.
    let listing = |require_mtls: bool| {
        let c = json!({
            "uid": uid(&scene.cluster, NS, "c"), "name": "c", "namespace": NS, "workloadIps": [outsider.ip],
            "protocol": "TCP", "requireMtls": require_mtls, "node": "node-1",
        });
        vec![
            workload(&scene.cluster, "a", "a-sa", scene.a.ip.into(), "node-1"),
            workload(&scene.cluster, "b", "b-sa", scene.b.ip.into(), "node-1"),
            c,
        ]
    };
    write_workloads(&scene.proxy, &scene.workloads(), listing(false));
    assert_eq!(
        say_hello(&scene.a, &outsider).expect("passthrough"),
        HELLO,
        "a plain TCP destination is passed through"
    );
    assert_eq!(accepted.load(Ordering::SeqCst), 1);

    write_workloads(&scene.proxy, &scene.workloads(), listing(true));
    let refused = say_hello(&scene.a, &outsider);
    assert!(refused.as_ref().map_or(true, Vec::is_empty), "reached in plaintext despite requireMtls: {refused:?}");
    assert_eq!(accepted.load(Ordering::SeqCst), 1, "C's app never saw the refused connection");
    eventually("the access log tells", || scene.proxy.log().contains("requires mTLS").then_some(()));
}

//! A local single-node demo: a node netns with a bridge, the fake API server holding two pods, and the real
//! runtime chain (bridge + host-local + istio-cni). It shows the rules our plugin programs and where real
//! connections land. Everything lives in namespaces it creates and removes on exit. Run as root.

use std::net::{SocketAddr, SocketAddrV4};

use tests::mesh::{plain_pod, sidecar_pod, INBOUND_PORT, OUTBOUND_PORT};
use tests::Cluster;

fn main() {
    let cluster = Cluster::new();
    println!("node: netns {} with bridge cni0, pod subnet {}", cluster.node.netns().name(), cluster.node.subnet());
    println!("fake Kubernetes API: {}", cluster.api.url());

    let web = cluster.run(&sidecar_pod("shop", "web"));
    let db = cluster.run(&plain_pod("shop", "db"));
    println!("\npod shop/web (injected sidecar): {}  netns {}", web.ip, web.netns.name());
    println!("pod shop/db  (no sidecar):       {}  netns {}", db.ip, db.netns.name());
    println!("\nADD result for shop/web (prevResult passed through):\n{:#}", web.result);
    println!("\nrules istio-cni programmed in shop/web:\n{}", web.netns.exec_ok(&["iptables-nft-save", "-t", "nat"]));
    println!(
        "rules in shop/db: {}",
        if db.netns.exec_ok(&["iptables-nft-save"]).contains("ISTIO") { "ISTIO chains (unexpected!)" } else { "none" }
    );

    let proxy_out = web.netns.listen_tcp(OUTBOUND_PORT);
    web.netns.connect_tcp(SocketAddr::new(db.ip.into(), 8080), Some(1000)).expect("app connects out");
    let got = proxy_out.accepted();
    println!(
        "\napp (uid 1000) in web -> {}:8080 landed on {} (SO_ORIGINAL_DST {:?})",
        db.ip, got.local, got.original_dst
    );
    assert_eq!(got.original_dst, Some(SocketAddrV4::new(db.ip, 8080)));

    let proxy_in = web.netns.listen_tcp(INBOUND_PORT);
    db.netns.connect_tcp(SocketAddr::new(web.ip.into(), 8080), None).expect("db connects in");
    let got = proxy_in.accepted();
    println!("db -> web {}:8080 landed on {} (SO_ORIGINAL_DST {:?})", web.ip, got.local, got.original_dst);
    assert_eq!(got.local.port(), INBOUND_PORT);

    println!("\ndemo OK: cleaning up namespaces");
}

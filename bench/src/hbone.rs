//! Scenarios 3 and 4, HBONE throughput and latency, pod to pod through the proxy (client pod's outbound on
//! 15001 → HBONE over mTLS to the server pod's 15008 → the app), against direct TCP between two pods of the same
//! node (or the same two nodes) without enrollment. Istio's ztunnel is not measured: it cannot be fetched or built on this machine.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use hbone::MeshCa;
use istio_contract::ports;
use istio_contract::telemetry::{self, label};
use serde_json::json;
use tempfile::TempDir;
use testbed::mesh::RuleBackend;
use testbed::node_agent::uid;
use testbed::NetworkConfigList;

use crate::apps::{self, Mode, Server, ECHO_PORT, SINK_PORT};
use crate::attach::{timed_add, Attached};
use crate::report::Section;
use crate::scene::{AmbientNode, NS};
use crate::stats::Counts;
use crate::stats::{gbps, ratio, us, Summary};

/// What profiling the throughput run showed (kept with the table so the figure can be explained).
const PROFILE_NOTE: &str = "\nWhere the time goes (`perf record` of hbone-proxy during a same-node transfer): the \
proxy keeps about 1.6 of the 2 cores busy, the apps the rest, so the path is CPU-bound here. User-space copies \
(memmove) take 14% of its samples, AES-GCM 11% (encrypt and decrypt), kernel socket copies 10%, netfilter and \
conntrack most of the rest. Direct TCP pays one socket copy per byte; HBONE pays three socket hops, two TLS passes \
and the HTTP/2 framing copies. A larger HTTP/2 send buffer (4 MiB instead of h2's 400 KiB) made it slower (2.2 Gb/s) \
and was dropped.\n";

/// The trust domain of every benchmark workload.
const TRUST_DOMAIN: &str = "cluster.local";
/// MiB per throughput run, split over the streams, unless `BENCH_TRANSFER_MIB` says otherwise.
const TRANSFER_MIB: u64 = 512;

/// Bytes per throughput run.
fn transfer_bytes() -> u64 {
    let mib = std::env::var("BENCH_TRANSFER_MIB").ok().and_then(|v| v.parse().ok()).unwrap_or(TRANSFER_MIB);
    mib.max(1) << 20
}
/// Size of a latency request and of its response.
const MESSAGE: usize = 1024;
/// The benchmark issue's target: a single HBONE stream at least this share of direct.
const TARGET_SHARE: f64 = 0.5;

/// Where the server pods run relative to the client pods.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Placement {
    SameNode,
    AcrossNodes,
}

impl Placement {
    fn label(self) -> &'static str {
        match self {
            Placement::SameNode => "same node",
            Placement::AcrossNodes => "across nodes",
        }
    }
}

/// The link between two node netns: its name on each side and the node addresses (only inside our netns).
const LINK: [(&str, &str); 2] = [("nb-peer1", "192.0.2.1"), ("nb-peer2", "192.0.2.2")];

/// Two enrolled pods (through the proxies) and two plain pods (direct), with a sink and an echo app on each
/// server pod; across nodes the clients run on node 1 and the servers on node 2. Field order is drop order.
struct Pods {
    _apps: Vec<Server>,
    mesh_client: Attached,
    mesh_server: Attached,
    plain_client: Attached,
    plain_server: Attached,
    nodes: Vec<AmbientNode>,
    _ca: TempDir,
}

impl Pods {
    fn start(placement: Placement) -> Pods {
        let ca = tempfile::Builder::new().prefix("bench-ca-").tempdir().expect("CA dir");
        MeshCa::load_or_create(ca.path(), TRUST_DOMAIN).expect("the mesh CA the nodes share");
        let count = if placement == Placement::SameNode { 1 } else { 2 };
        let nodes: Vec<AmbientNode> =
            (0..count).map(|_| AmbientNode::start_with_ca(RuleBackend::Nftables, None, Some(ca.path()))).collect();
        if count == 2 {
            link(&nodes[0], &nodes[1]);
        }
        let (client_node, server_node) = (&nodes[0], &nodes[count - 1]);
        let (mesh_client, _) = client_node.add_pod("client");
        let (mesh_server, _) = server_node.add_pod("server");
        let plain = |node: &AmbientNode, name: &str| {
            let mut conflist = node.cluster.node.conflist(vec![]);
            // A default route through the bridge, as the ambient pods have, so the other node is reachable.
            conflist["plugins"][0]["ipam"]["routes"] = json!([{ "dst": "0.0.0.0/0" }]);
            let list = NetworkConfigList::from_value(conflist).expect("plain conflist");
            timed_add(&node.cluster.node, &list, NS, name)
        };
        let plain_client = plain(client_node, "plain-client");
        let plain_server = plain(server_node, "plain-server");
        if count == 2 {
            // Node 1's proxy learns the remote server from its local workloads file.
            let ip = mesh_server.ip();
            let listing = json!({ "workloads": [{
                "uid": uid(&server_node.cluster, NS, "server"), "name": "server", "namespace": NS,
                "serviceAccount": "server", "trustDomain": TRUST_DOMAIN, "workloadIps": [ip],
                "protocol": "HBONE", "node": "node-2",
            }]});
            let path = client_node.proxy_dir.path().join("workloads.yaml");
            std::fs::write(path, serde_json::to_string(&listing).expect("render workloads")).expect("write workloads");
        }
        let mut apps = Vec::new();
        for server in [&mesh_server, &plain_server] {
            apps.push(Server::start(&server.netns, SINK_PORT, Mode::Sink));
            apps.push(Server::start(&server.netns, ECHO_PORT, Mode::Echo));
        }
        let pods = Pods { _apps: apps, mesh_client, mesh_server, plain_client, plain_server, nodes, _ca: ca };
        pods.wait_for_hbone();
        pods
    }

    /// Outbound HBONE connections the client's proxy has opened so far.
    fn hbone_opened(&self) -> f64 {
        let netns = self.nodes[0].cluster.node.netns().path();
        let (_, body) = testbed::http::get(&netns, ports::STATS, "/metrics").expect("proxy metrics");
        let name = format!("{}_total{{", telemetry::TCP_CONNECTIONS_OPENED);
        let reporter = format!("{}=\"{}\"", label::REPORTER, telemetry::REPORTER_SOURCE);
        let mtls = format!("{}=\"{}\"", label::CONNECTION_SECURITY_POLICY, telemetry::SECURITY_POLICY_MUTUAL_TLS);
        body.lines()
            .filter(|l| l.starts_with(&name) && l.contains(&reporter) && l.contains(&mtls))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    /// Waits until a connection from the client pod to the server pod goes over HBONE, i.e. the client's proxy
    /// lists the server (until then it would be passthrough and the figures meaningless).
    fn wait_for_hbone(&self) {
        let start = Instant::now();
        loop {
            let before = self.hbone_opened();
            apps::first_byte(&self.mesh_client.netns, self.mesh_addr(SINK_PORT));
            if self.hbone_opened() > before {
                return;
            }
            assert!(start.elapsed() < Duration::from_secs(20), "the proxy never sent client → server over HBONE");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn mesh_addr(&self, port: u16) -> SocketAddr {
        SocketAddr::from((self.mesh_server.ip(), port))
    }

    fn plain_addr(&self, port: u16) -> SocketAddr {
        SocketAddr::from((self.plain_server.ip(), port))
    }
}

/// Connects two node netns with a veth and routes each node's pod subnet through it.
fn link(one: &AmbientNode, two: &AmbientNode) {
    let (ns1, ns2) = (one.cluster.node.netns(), two.cluster.node.netns());
    ns1.exec_ok(&["ip", "link", "add", LINK[0].0, "type", "veth", "peer", "name", LINK[1].0, "netns", ns2.name()]);
    for ((ns, (dev, addr)), (other, via)) in [ns1, ns2].into_iter().zip(LINK).zip([(two, LINK[1].1), (one, LINK[0].1)])
    {
        ns.exec_ok(&["ip", "addr", "add", &format!("{addr}/30"), "dev", dev]);
        ns.exec_ok(&["ip", "link", "set", dev, "up"]);
        ns.exec_ok(&["sysctl", "-qw", "net.ipv4.ip_forward=1"]);
        ns.exec_ok(&["ip", "route", "add", &other.cluster.node.subnet(), "via", via]);
    }
}

/// Scenario 3: Gb/s with 1 and 8 streams, HBONE vs direct, interleaved run by run.
pub fn throughput(counts: Counts) -> Section {
    let mut body = String::new();
    let _ = writeln!(
        body,
        "Timed: {} MiB per run, split evenly over the streams, from the first connect until every sink app \
         acknowledged the end of its stream. Native nftables rules; across nodes, the two node netns are linked \
         by a veth. Warm-up {} runs, then {} timed runs per row, HBONE and direct interleaved. Istio's ztunnel is not measured (it cannot be fetched or built \
         here).\n",
        transfer_bytes() >> 20,
        counts.warmup,
        counts.iterations
    );
    let _ = writeln!(
        body,
        "| placement | streams | path | median Gb/s | p10 Gb/s | HBONE / direct (medians) |\n|---|---|---|---:|---:|---:|"
    );
    let mut verdict = String::new();
    for placement in [Placement::SameNode, Placement::AcrossNodes] {
        println!("hbone-throughput: {}", placement.label());
        let pods = Pods::start(placement);
        throughput_rows(&pods, placement, counts, &mut body, &mut verdict);
    }
    body.push('\n');
    body.push_str(&verdict);
    body.push_str(PROFILE_NOTE);
    Section { name: "hbone-throughput", title: "HBONE throughput".into(), body }
}

fn throughput_rows(pods: &Pods, placement: Placement, counts: Counts, body: &mut String, verdict: &mut String) {
    let place = placement.label();
    for streams in [1usize, 8] {
        let per_stream = transfer_bytes() / streams as u64;
        let (mut mesh, mut direct) = (Vec::new(), Vec::new());
        for round in 0..counts.warmup + counts.iterations {
            let m = apps::transfer(&pods.mesh_client.netns, pods.mesh_addr(SINK_PORT), streams, per_stream);
            let d = apps::transfer(&pods.plain_client.netns, pods.plain_addr(SINK_PORT), streams, per_stream);
            if round >= counts.warmup {
                mesh.push(m);
                direct.push(d);
            }
        }
        // Slowest time is the lowest rate: p90 of durations gives p10 of throughput.
        let (m, d) = (Summary::of(&mesh), Summary::of(&direct));
        let rate = |t: Duration| gbps(per_stream * streams as u64, t);
        let share = ratio(d.median, m.median);
        let _ =
            writeln!(body, "| {place} | {streams} | HBONE | {:.2} | {:.2} | {share:.2} |", rate(m.median), rate(m.p90));
        let _ = writeln!(body, "| {place} | {streams} | direct | {:.2} | {:.2} | 1.00 |", rate(d.median), rate(d.p90));
        if streams == 1 {
            let met = if share >= TARGET_SHARE { "met" } else { "NOT met" };
            let _ = writeln!(
                verdict,
                "- Single stream, {place}: HBONE carries {:.0}% of direct (target ≥{:.0}%: {met}).",
                share * 100.0,
                TARGET_SHARE * 100.0
            );
        }
    }
}

/// Scenario 4: 1 KB request/response on an established connection, and a new connection's first byte.
pub fn latency(counts: Counts) -> Section {
    let pods = Pods::start(Placement::SameNode);
    let mut mesh_conn = apps::connect(&pods.mesh_client.netns, pods.mesh_addr(ECHO_PORT));
    let mut plain_conn = apps::connect(&pods.plain_client.netns, pods.plain_addr(ECHO_PORT));
    apps::round_trips(&mut mesh_conn, MESSAGE, counts.warmup);
    apps::round_trips(&mut plain_conn, MESSAGE, counts.warmup);
    let (mut mesh, mut direct) = (Vec::new(), Vec::new());
    // Interleave in blocks so both paths see the same machine noise.
    for _ in 0..counts.iterations.div_ceil(100) {
        mesh.extend(apps::round_trips(&mut mesh_conn, MESSAGE, 100));
        direct.extend(apps::round_trips(&mut plain_conn, MESSAGE, 100));
    }
    let (m, d) = (Summary::of(&mesh), Summary::of(&direct));

    // New connections: through the pool (the client pod already has an HBONE connection to the server's
    // proxy) versus direct; then fresh HBONE connections, one per new client pod (a new identity is a new pool
    // key, so the proxy must dial and handshake).
    let setups = counts.iterations.min(200);
    let (mut pooled, mut plain_setup) = (Vec::new(), Vec::new());
    for _ in 0..setups {
        pooled.push(apps::first_byte(&pods.mesh_client.netns, pods.mesh_addr(SINK_PORT)));
        plain_setup.push(apps::first_byte(&pods.plain_client.netns, pods.plain_addr(SINK_PORT)));
    }
    let fresh_count = (counts.iterations / 100).clamp(5, 20);
    let mut fresh = Vec::new();
    for i in 0..fresh_count {
        let name = format!("fresh{i}");
        let (pod, _) = pods.nodes[0].add_pod(&name);
        fresh.push(apps::first_byte(&pod.netns, pods.mesh_addr(SINK_PORT)));
        pods.nodes[0].remove_pod(&name, pod);
    }

    let mut body = String::new();
    let _ = writeln!(
        body,
        "Request/response: {MESSAGE} bytes each way on one established connection; warm-up {} round trips, then \
         {} per path, in alternating blocks of 100. Connection setup: from the start of `connect` until the server \
         app's first byte arrived; {setups} per path through the pool, and {fresh_count} fresh HBONE connections \
         (each from a newly enrolled client pod, so the proxy dials and completes a TLS handshake). Same node, \
         native nftables rules.\n",
        counts.warmup,
        mesh.len()
    );
    let _ = writeln!(body, "| figure | median µs | p90 µs | p99 µs | added vs direct (median) µs |");
    let _ = writeln!(body, "|---|---:|---:|---:|---:|");
    let added = |a: &Summary, b: &Summary| us(a.median.saturating_sub(b.median));
    let ps = Summary::of(&plain_setup);
    let rows = [
        ("1 KB round trip, HBONE", m, added(&m, &d)),
        ("1 KB round trip, direct", d, "–".into()),
        ("first byte, new connection through the pool", Summary::of(&pooled), added(&Summary::of(&pooled), &ps)),
        ("first byte, fresh HBONE connection (TLS handshake)", Summary::of(&fresh), added(&Summary::of(&fresh), &ps)),
        ("first byte, direct", ps, "–".into()),
    ];
    for (figure, sum, add) in rows {
        let _ = writeln!(body, "| {figure} | {} | {add} |", sum.us_cells());
    }
    let _ = writeln!(body, "\n1 KB round trip, added latency at p99: {} µs.", us(m.p99.saturating_sub(d.p99)));
    Section { name: "hbone-latency", title: "HBONE latency".into(), body }
}

//! The pods of scenarios 3 and 4 (HBONE throughput in [`crate::throughput`], latency here), pod to pod through the
//! proxy (client pod's outbound on 15001 → HBONE over mTLS to the server pod's 15008 → the app, or the same-node
//! fast path), against direct TCP between two pods of the same node (or the same two nodes) without enrollment.
//! Istio's ztunnel is not measured: it cannot be fetched or built on this machine.

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
use crate::stats::{us, Summary};

/// The trust domain of every benchmark workload.
const TRUST_DOMAIN: &str = "cluster.local";
/// Size of a latency request and of its response.
const MESSAGE: usize = 1024;
/// What the client's proxy does with a connection between the client and server pod, and where they run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Case {
    /// Both pods on one node, the proxy's default: the same-node fast path.
    SameNodeFastPath,
    /// Both pods on one node whose proxy has `SAME_NODE_FAST_PATH=false`: HBONE through the one proxy.
    SameNodeHbone,
    /// Client pod on node 1, server pod on node 2, each node with its own proxy: HBONE between them.
    AcrossNodes,
}

impl Case {
    /// The row label.
    pub fn label(self) -> &'static str {
        match self {
            Case::SameNodeFastPath => "same node, fast path",
            Case::SameNodeHbone => "same node, HBONE",
            Case::AcrossNodes => "across nodes, HBONE",
        }
    }

    /// The `connection_security_policy` of the client's connections to the server.
    fn security_policy(self) -> &'static str {
        match self {
            Case::SameNodeFastPath => telemetry::SECURITY_POLICY_SAME_NODE,
            Case::SameNodeHbone | Case::AcrossNodes => telemetry::SECURITY_POLICY_MUTUAL_TLS,
        }
    }

    /// The proxies' extra environment.
    fn proxy_env(self) -> &'static [(&'static str, &'static str)] {
        match self {
            Case::SameNodeHbone => &[("SAME_NODE_FAST_PATH", "false")],
            Case::SameNodeFastPath | Case::AcrossNodes => &[],
        }
    }
}

/// The link between two node netns: its name on each side and the node addresses (only inside our netns).
const LINK: [(&str, &str); 2] = [("nb-peer1", "192.0.2.1"), ("nb-peer2", "192.0.2.2")];

/// Two enrolled pods (through the proxies) and two plain pods (direct), with a sink and an echo app on each
/// server pod; across nodes the clients run on node 1 and the servers on node 2. Field order is drop order.
pub struct Pods {
    _apps: Vec<Server>,
    /// The enrolled client pod.
    pub mesh_client: Attached,
    /// The enrolled server pod.
    pub mesh_server: Attached,
    /// The plain client pod (direct TCP).
    pub plain_client: Attached,
    /// The plain server pod.
    pub plain_server: Attached,
    /// The nodes: the client's first.
    pub nodes: Vec<AmbientNode>,
    case: Case,
    _ca: TempDir,
}

impl Pods {
    /// Starts the nodes and pods of `case`, and waits until the client's proxy carries client → server the way
    /// `case` says.
    pub fn start(case: Case) -> Pods {
        Self::start_with_env(case, &[])
    }

    /// Like [`Pods::start`], with `env` added to every proxy's environment (a setting a scenario compares).
    pub fn start_with_env(case: Case, env: &[(&str, &str)]) -> Pods {
        let ca = tempfile::Builder::new().prefix("bench-ca-").tempdir().expect("CA dir");
        MeshCa::load_or_create(ca.path(), TRUST_DOMAIN).expect("the mesh CA the nodes share");
        let count = if case == Case::AcrossNodes { 2 } else { 1 };
        let nodes: Vec<AmbientNode> = (0..count)
            .map(|_| {
                let env: Vec<(&str, &str)> = case.proxy_env().iter().chain(env).copied().collect();
                AmbientNode::start_with_proxy_env(RuleBackend::Nftables, None, Some(ca.path()), &env)
            })
            .collect();
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
        let pods = Pods { _apps: apps, mesh_client, mesh_server, plain_client, plain_server, nodes, case, _ca: ca };
        pods.wait_for_path();
        pods
    }

    /// Outbound connections the client's proxy has opened so far the way this case carries them.
    fn opened(&self) -> f64 {
        let netns = self.nodes[0].cluster.node.netns().path();
        let (_, body) = testbed::http::get(&netns, ports::STATS, "/metrics").expect("proxy metrics");
        let name = format!("{}_total{{", telemetry::TCP_CONNECTIONS_OPENED);
        let reporter = format!("{}=\"{}\"", label::REPORTER, telemetry::REPORTER_SOURCE);
        let mtls = format!("{}=\"{}\"", label::CONNECTION_SECURITY_POLICY, self.case.security_policy());
        body.lines()
            .filter(|l| l.starts_with(&name) && l.contains(&reporter) && l.contains(&mtls))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    /// Waits until a connection from the client pod to the server pod goes over HBONE (or the fast path), i.e.
    /// the client's proxy lists the server (until then it would be passthrough and the figures meaningless).
    fn wait_for_path(&self) {
        let start = Instant::now();
        loop {
            let before = self.opened();
            apps::first_byte(&self.mesh_client.netns, self.mesh_addr(SINK_PORT));
            if self.opened() > before {
                return;
            }
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "the proxy never carried client → server: {:?}",
                self.case
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The enrolled server pod's `port`.
    pub fn mesh_addr(&self, port: u16) -> SocketAddr {
        SocketAddr::from((self.mesh_server.ip(), port))
    }

    /// The plain server pod's `port`.
    pub fn plain_addr(&self, port: u16) -> SocketAddr {
        SocketAddr::from((self.plain_server.ip(), port))
    }

    /// CPU time (user + system) the proxies of this case have used so far, all nodes together.
    pub fn proxy_cpu(&self) -> Duration {
        self.nodes.iter().map(|n| process_cpu(n.proxy.pid())).sum()
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

/// User + system CPU time of process `pid`, all its threads (`/proc/PID/stat` fields 14 and 15, in clock ticks).
fn process_cpu(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("read the proxy's /proc stat");
    // The command name (field 2) may hold spaces; the fields after it start with the state (field 3).
    let rest = &stat[stat.rfind(')').expect("stat has a command name") + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = fields[11].parse::<u64>().expect("utime") + fields[12].parse::<u64>().expect("stime");
    let per_second = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK).ok().flatten().unwrap_or(100) as u64;
    Duration::from_secs_f64(ticks as f64 / per_second as f64)
}

/// Whether #19's throughput changes cost latency (its target: the added p50 not worse), kept with the table.
const LATENCY_NOTES: &str = "\nThe throughput changes of #19 (heap thresholds, a 320 KiB TLS send queue) against the \
build before them (81ee305), builds without LTO, ten runs of this scenario each, alternated: added p50 medians \
177 µs before and 181 µs after, each run between 138 and 219 µs. No difference outside the run-to-run spread.\n";

/// Scenario 4: 1 KB request/response on an established connection, and a new connection's first byte. Measured
/// over HBONE on one node (`SAME_NODE_FAST_PATH=false`), as before the fast path, so the figures stay comparable.
pub fn latency(counts: Counts) -> Section {
    let pods = Pods::start(Case::SameNodeHbone);
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
         HBONE (the node's proxy runs with `SAME_NODE_FAST_PATH=false`), native nftables rules.\n",
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
    body.push_str(LATENCY_NOTES);
    Section { name: "hbone-latency", title: "HBONE latency".into(), body }
}

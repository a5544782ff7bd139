//! Two test nodes, each with its own real node agent, fake API server and real `hbone-proxy` (sharing one mesh
//! CA, as the nodes of one mesh do), linked by a veth with a route to each other's pod subnet.

use hbone::MeshCa;
use serde_json::json;
use testbed::mesh::RuleBackend;
use testbed::node_agent::{namespace, NodeAgent};
use testbed::Cluster;

use super::{Proxy, NS, TD};

/// The link between the nodes: its name on each node and the node addresses on it (only inside our netns).
pub const LINK: [(&str, &str); 2] = [("hb-peer1", "192.0.2.1"), ("hb-peer2", "192.0.2.2")];

/// One node: its cluster (netns, bridge, fake API), agent and proxy.
pub struct NodeSide {
    // Dropped first, while its log file in `dir` still exists.
    pub proxy: Proxy,
    pub cluster: Cluster,
    _agent: NodeAgent,
    pub dir: tempfile::TempDir,
}

impl NodeSide {
    /// A node whose proxy takes its mesh CA from `ca_dir`, with `env` added to the proxy's environment.
    pub fn start(ca_dir: &str, env: &[(&str, &str)]) -> Self {
        let mut env = env.to_vec();
        env.push(("CA_DIR", ca_dir));
        Self::start_on(new_cluster(), &env)
    }

    /// Starts the agent and the proxy (with `env`) on `cluster`.
    pub fn start_on(cluster: Cluster, env: &[(&str, &str)]) -> Self {
        let dir = tempfile::tempdir().expect("node scratch dir");
        let agent = NodeAgent::start(&cluster, &[]);
        let proxy = Proxy::start(&cluster, &agent, dir.path(), &dir.path().join("workloads.yaml"), env);
        NodeSide { proxy, cluster, _agent: agent, dir }
    }
}

/// A test node's cluster (netns, bridge, fake API) with the scene's namespace stored.
fn new_cluster() -> Cluster {
    let cluster = Cluster::with_backend(RuleBackend::Nftables);
    cluster.api.upsert(namespace(NS, json!({}))).expect("store namespace");
    cluster
}

/// Two linked nodes sharing the mesh CA in `ca`, each proxy with `env` added. Field order is drop order: the
/// nodes, then the CA.
pub struct TwoNodes {
    pub one: NodeSide,
    pub two: NodeSide,
    _ca: tempfile::TempDir,
}

impl TwoNodes {
    /// Starts both nodes and links them.
    pub fn start(env: &[(&str, &str)]) -> Self {
        let ca = tempfile::tempdir().expect("CA dir");
        MeshCa::load_or_create(ca.path(), TD).expect("the mesh CA both nodes share");
        let ca_dir = ca.path().to_str().expect("UTF-8 path");
        let (one, two) = (NodeSide::start(ca_dir, env), NodeSide::start(ca_dir, env));
        link(&one.cluster, &two.cluster);
        TwoNodes { one, two, _ca: ca }
    }
}

impl TwoNodes {
    /// Two linked nodes whose proxies' environments `env` gives once both nodes exist and are linked, before any
    /// agent or proxy starts (so it can start a server in one node that both proxies reach over the link).
    pub fn start_linked(env: impl FnOnce(&Cluster, &Cluster) -> [Vec<(String, String)>; 2]) -> Self {
        let (first, second) = (new_cluster(), new_cluster());
        link(&first, &second);
        let [env_one, env_two] = env(&first, &second);
        let one = NodeSide::start_on(first, &pairs(&env_one));
        let two = NodeSide::start_on(second, &pairs(&env_two));
        TwoNodes { one, two, _ca: tempfile::tempdir().expect("CA dir (unused)") }
    }
}

/// `env` as the `(name, value)` pairs a proxy takes.
fn pairs(env: &[(String, String)]) -> Vec<(&str, &str)> {
    env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect()
}

/// Connects the two node netns with a veth and routes each node's pod subnet through it.
pub fn link(one: &Cluster, two: &Cluster) {
    let (ns1, ns2) = (one.node.netns(), two.node.netns());
    ns1.exec_ok(&["ip", "link", "add", LINK[0].0, "type", "veth", "peer", "name", LINK[1].0, "netns", ns2.name()]);
    for ((ns, (dev, addr)), other) in [ns1, ns2].into_iter().zip(LINK).zip([two, one]) {
        ns.exec_ok(&["ip", "addr", "add", &format!("{addr}/30"), "dev", dev]);
        ns.exec_ok(&["ip", "link", "set", dev, "up"]);
        ns.exec_ok(&["sysctl", "-qw", "net.ipv4.ip_forward=1"]);
        let via = if addr == LINK[0].1 { LINK[1].1 } else { LINK[0].1 };
        ns.exec_ok(&["ip", "route", "add", &other.node.subnet(), "via", via]);
    }
}

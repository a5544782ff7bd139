//! Differential conformance of the ambient node agent against Istio's own (#29, "Istio's own binaries side by
//! side").
//!
//! Istio's agent (its `install-cni` with ambient on, built by `scripts/istio-ref/build.sh`, run by
//! [`testbed::istio_agent::IstioAgent`]) and ours each run on a node of their own (a netns with its bridge, a fake
//! API server holding the same namespaces and pods), with the same settings (Istio's defaults: DNS capture and IPv6
//! on, the default enablement selectors, `kube-system` excluded), on iptables (the flavour each detects), on
//! native nftables, and on iptables with DNS capture and IPv6 off. Each side's plugin is its own: Istio's node gets the conflist Istio's installer wrote
//! (its `istio-cni` entry, run as Istio's binary), ours the same entry run as our plugin. A [`ZdsPeer`] stands in
//! for the node proxy on each agent's ZDS socket and records what it gets. The same pods (an ambient namespace's,
//! a pod-level label, DNS capture off, probe ports, inbound capture bypassed, an opt-out by label, a sidecar pod in
//! the ambient namespace, a pod of a namespace not in ambient, an ambient pod of an excluded namespace) then go through CNI ADD on both nodes, in the same
//! order, as the kubelet would report their addresses after, and these must be equal:
//!
//! - each pod's in-pod rules (`nft list ruleset`, `iptables-save` of both families in the nft and legacy flavours,
//!   the policy routing rules and table 100), normalized only for chain order, comments and counters;
//! - the host probe rule and probe set in the node netns (`nft list ruleset`, `iptables-save`, `ipset list`; pod
//!   IPs and UIDs replaced by the pod's name, as the nodes' subnets and the API servers' UIDs differ), and its
//!   effect: a connection from the node (as the kubelet's uid) to an enrolled pod arrives from 169.254.7.127, one to
//!   a pod not enrolled from the node's bridge address;
//! - the ZDS requests in order (kind, pod, workload name, namespace and service account, the one fd being the pod's
//!   netns): the ADDs; a restarted proxy's snapshot (compared as a set, then `SnapshotSent`); `Del` when a pod opts
//!   out by label and when a pod is deleted;
//! - the pod annotation `ambient.istio.io/redirection`, after each ADD and after the opt-out; the rules and the probe
//!   set after the opt-out and the deletion;
//! - and every request Istio's agent and plugin made of the fake API server succeeded.
//!
//! A second test shows Istio's agent driving our real `hbone-proxy`: the proxy connects to Istio's agent's ZDS
//! socket, acks the pod Istio's agent sends (Istio annotates only after the ack), runs the pod's listeners in the
//! netns it got, and lists the pod.
//!
//! The differences we keep on purpose are named in [`Intended`] and listed in docs/node-agent.md ("Where we differ
//! from Istio, and why"); nothing else may differ.
//!
//! Without Istio's binaries the tests print `SKIPPED: ...` and pass, unless `ISTIO_REF_REQUIRED=1`.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};

use istio_contract::names;
use serde_json::{json, Value};
use testbed::hbone_proxy::{Proxy, KUBERNETES_SOURCE};
use testbed::istio_agent::{istio_built, IstioAgent};
use testbed::kubelet::KUBELET_UID;
use testbed::mesh::{plain_pod, sidecar_pod};
use testbed::node_agent::{namespace, netns_id, redirection, NodeAgent, Received, RequestKind, ZdsPeer};
use testbed::rule_dump::{normalize_iptables_save, normalize_nft_ruleset};
use testbed::wait::eventually;
use testbed::{Cluster, NetnsGuard, Pod};

/// The ambient namespace (labelled `istio.io/dataplane-mode=ambient`).
const MESH: &str = "mesh";
/// A namespace without the label: its pods opt in by their own.
const SHOP: &str = "shop";
/// A namespace both agents and plugins exclude (`EXCLUDE_NAMESPACES`, Istio's chart default).
const EXCLUDED: &str = "kube-system";
/// The probe SNAT source (Istio's default `HOST_PROBE_SNAT_IP`).
const PROBE_SOURCE: &str = "169.254.7.127";
/// The port the probed pod's readiness probe names.
const PROBE_PORT: u16 = 8080;

/// Whether Istio's binaries are built; `false` (after printing why) when they are not and not required.
fn istio() -> bool {
    if istio_built() {
        return true;
    }
    let why = "Istio's binaries not built; run scripts/istio-ref/build.sh";
    assert!(std::env::var("ISTIO_REF_REQUIRED").as_deref() != Ok("1"), "ISTIO_REF_REQUIRED=1: {why}");
    eprintln!("SKIPPED: {why}");
    false
}

/// The differences kept on purpose between Istio's agent and ours (docs/node-agent.md, "Where we differ from
/// Istio, and why"). Each is applied to both sides' observations before they are compared, so that only it is
/// forgiven.
#[derive(Debug, Clone, Copy)]
enum Intended {
    /// Each side's iptables detection leaves empty tables (built-in chains, no rules) behind in the netns it
    /// probes: Istio's plugin and agent a `nat` table in every flavour and family they probed (they add and delete
    /// a rule there; docs/plugin.md, the same exception as `istio_differential.rs`), our agent a legacy `mangle`
    /// table in the node netns (`iptables-legacy-save -t mangle` loads it when it looks for kube's hint chains).
    /// Empty tables are dropped from both dumps.
    DetectionProbeTables,
    /// A pod without `spec.serviceAccountName` (a real API server's ServiceAccount admission always sets it; only
    /// a server without that admission plugin stores such a pod) is sent to the proxy with service account
    /// `default`, the account Kubernetes runs it as; Istio sends the empty name, from which a proxy derives an
    /// identity with an empty service account. Istio's `sa ""` is read as `sa "default"`.
    DefaultServiceAccount,
    /// With native nftables, our netlink rules hold the same matches as Istio's `nft` rules, some in another order
    /// (`ip daddr != 127.0.0.1 oifname "lo"` for `oifname "lo" ip daddr != 127.0.0.1`): the same packets match
    /// (docs/plugin.md, "Native nftables spelling"). Each nft rule is compared as its words in sorted order; rules
    /// keep their place in their chain.
    NftMatchOrder,
}

impl Intended {
    /// Every intended difference, applied in this order.
    const ALL: [Intended; 3] =
        [Intended::DetectionProbeTables, Intended::DefaultServiceAccount, Intended::NftMatchOrder];

    /// Forgives this difference in a pod netns dump.
    fn apply(self, dump: &mut BTreeMap<String, String>) {
        match self {
            Intended::DetectionProbeTables => {
                for (section, text) in dump.iter_mut() {
                    *text = if section == "nft" { without_empty_nft_tables(text) } else { without_empty_tables(text) };
                }
            }
            Intended::DefaultServiceAccount => {}
            Intended::NftMatchOrder => {
                if let Some(nft) = dump.get_mut("nft") {
                    *nft = nft.lines().map(words_sorted).collect::<Vec<_>>().join("\n");
                }
            }
        }
    }

    /// Forgives this difference in the ZDS requests Istio's agent sent (as [`Side::zds`] describes them).
    fn apply_zds(self, istio: Vec<String>) -> Vec<String> {
        match self {
            Intended::DetectionProbeTables | Intended::NftMatchOrder => istio,
            Intended::DefaultServiceAccount => {
                istio.into_iter().map(|r| r.replace(" sa \"\")", " sa \"default\")")).collect()
            }
        }
    }

    /// Both dumps with every intended difference forgiven.
    fn forgive_rules(
        mut istio: BTreeMap<String, String>,
        mut ours: BTreeMap<String, String>,
    ) -> (BTreeMap<String, String>, BTreeMap<String, String>) {
        for intended in Intended::ALL {
            intended.apply(&mut istio);
            intended.apply(&mut ours);
        }
        (istio, ours)
    }

    /// Istio's ZDS requests with every intended difference forgiven.
    fn forgive_zds(istio: Vec<String>) -> Vec<String> {
        Intended::ALL.iter().fold(istio, |zds, intended| intended.apply_zds(zds))
    }
}

/// An nft rule line (two tabs deep) with its words sorted; other lines as they are.
fn words_sorted(line: &str) -> String {
    if !line.starts_with("\t\t") {
        return line.to_owned();
    }
    let mut words: Vec<&str> = line.split_whitespace().collect();
    words.sort_unstable();
    format!("\t\t{}", words.join(" "))
}

/// Normalized `nft list ruleset` text ([`normalize_nft`]) without the chains that hold no rule (a base chain with
/// policy accept and no rule lets every packet pass, as no chain at all), and then without empty tables.
fn without_empty_nft_tables(text: &str) -> String {
    let mut out: Vec<&str> = Vec::new();
    let mut chain: Vec<&str> = Vec::new();
    for line in text.lines() {
        if line.starts_with("\tchain ") {
            chain = vec![line];
        } else if !chain.is_empty() {
            chain.push(line);
            if line == "\t}" {
                if chain[1..chain.len() - 1].iter().any(|l| !l.trim_start().starts_with("type ")) {
                    out.append(&mut chain);
                }
                chain.clear();
            }
        } else {
            out.push(line);
        }
    }
    // Tables left with nothing: a header line followed by its closing line.
    let mut kept: Vec<&str> = Vec::new();
    for line in out {
        if line == "}" && kept.last().is_some_and(|l| l.starts_with("table ")) {
            kept.pop();
        } else {
            kept.push(line);
        }
    }
    kept.join("\n")
}

/// Normalized `iptables-save` text without the tables that hold no rule.
fn without_empty_tables(text: &str) -> String {
    let mut out: Vec<&str> = Vec::new();
    let mut table: Vec<&str> = Vec::new();
    for line in text.lines() {
        if line.starts_with('*') {
            table = vec![line];
        } else if line == "COMMIT" && !table.is_empty() {
            table.push(line);
            if table.iter().any(|l| !l.starts_with('*') && !l.starts_with(':') && *l != "COMMIT") {
                out.append(&mut table);
            }
            table.clear();
        } else if table.is_empty() {
            out.push(line);
        } else {
            table.push(line);
        }
    }
    out.join("\n")
}

/// One test pod: its object and what it exercises.
struct Case {
    pod: Value,
    what: &'static str,
}

/// `pod` running as service account `app`.
fn with_sa(mut pod: Value) -> Value {
    pod["spec"]["serviceAccountName"] = json!("app");
    pod
}

/// `pod` with its own `istio.io/dataplane-mode` label.
fn labelled(mut pod: Value, mode: &str) -> Value {
    pod["metadata"]["labels"][names::DATAPLANE_MODE_LABEL] = json!(mode);
    pod
}

/// `pod` with annotation `key`.
fn annotated(mut pod: Value, key: &str, value: &str) -> Value {
    pod["metadata"]["annotations"][key] = json!(value);
    pod
}

/// The pods both agents get, in order.
fn cases() -> Vec<Case> {
    let mut probed = with_sa(plain_pod(MESH, "probed"));
    probed["spec"]["containers"][0]["ports"] = json!([{ "containerPort": PROBE_PORT }]);
    probed["spec"]["containers"][0]["readinessProbe"] = json!({ "httpGet": { "path": "/ready", "port": PROBE_PORT } });
    probed["spec"]["containers"][0]["livenessProbe"] = json!({ "tcpSocket": { "port": PROBE_PORT } });
    vec![
        Case { pod: with_sa(plain_pod(MESH, "web")), what: "a plain pod in an ambient namespace" },
        Case { pod: labelled(with_sa(plain_pod(SHOP, "api")), "ambient"), what: "a pod-level ambient label" },
        Case {
            pod: annotated(labelled(plain_pod(SHOP, "nodns"), "ambient"), names::AMBIENT_DNS_CAPTURE, "false"),
            what: "DNS capture off by annotation (and no service account)",
        },
        Case { pod: probed, what: "a pod with probe ports" },
        Case {
            pod: annotated(
                labelled(with_sa(plain_pod(SHOP, "noinbound")), "ambient"),
                names::AMBIENT_BYPASS_INBOUND_CAPTURE,
                "true",
            ),
            what: "inbound capture bypassed by annotation",
        },
        Case { pod: labelled(with_sa(plain_pod(MESH, "batch")), "none"), what: "opted out by label" },
        Case { pod: with_sa(sidecar_pod(MESH, "legacy")), what: "a sidecar pod in an ambient namespace" },
        Case { pod: with_sa(plain_pod(SHOP, "plain")), what: "a plain pod in a namespace not in ambient" },
        Case {
            pod: labelled(with_sa(plain_pod(EXCLUDED, "dns")), "ambient"),
            what: "an ambient pod of an excluded namespace (also labelled ambient)",
        },
    ]
}

/// The agent on one side.
enum Agent {
    Istio(IstioAgent),
    Ours(NodeAgent),
}

/// One node with one agent, its recorder and its conflist, and the pods added so far.
struct Side {
    name: &'static str,
    /// What both agents and plugins run with.
    variant: Variant,
    // Dropped first: the pods (DEL), the recorder, then the agent, then the cluster.
    pods: BTreeMap<String, Pod>,
    /// `namespace/name` of every pod added, by UID (kept after the pod is deleted).
    uids: BTreeMap<String, String>,
    /// The test proxy on the agent's ZDS socket (replaced when the test restarts it).
    peer: Option<ZdsPeer>,
    agent: Agent,
    conflist: Value,
    c: Cluster,
    _zds: tempfile::TempDir,
}

/// What both agents and plugins run with beyond Istio's defaults.
#[derive(Debug, Clone, Copy)]
struct Variant {
    /// Native nftables (`NATIVE_NFTABLES`) rather than iptables.
    nft: bool,
    /// DNS capture and IPv6 (`AMBIENT_DNS_CAPTURE`, `AMBIENT_IPV6`; Istio's defaults: on).
    dns_and_ipv6: bool,
}

/// The settings both agents run with, by their env names (the same for both: ours reads Istio's names).
fn settings(v: Variant) -> Vec<(&'static str, &'static str)> {
    let flag = |on: bool| if on { "true" } else { "false" };
    vec![
        ("AMBIENT_DNS_CAPTURE", flag(v.dns_and_ipv6)),
        ("AMBIENT_IPV6", flag(v.dns_and_ipv6)),
        ("NATIVE_NFTABLES", flag(v.nft)),
    ]
}

fn cluster() -> Cluster {
    let mut c = Cluster::new();
    // No backend override: both plugins and agents detect the iptables flavour themselves.
    c.plugin_overrides = json!({});
    c.api.upsert(namespace(MESH, json!({ names::DATAPLANE_MODE_LABEL: "ambient" }))).expect("store namespace");
    c.api.upsert(namespace(SHOP, json!({}))).expect("store namespace");
    c.api.upsert(namespace(EXCLUDED, json!({ names::DATAPLANE_MODE_LABEL: "ambient" }))).expect("store namespace");
    c
}

impl Side {
    fn istio(variant: Variant) -> Self {
        let c = cluster();
        let zds = tempfile::Builder::new().prefix("istio-zds-").tempdir().expect("ZDS dir");
        let agent = IstioAgent::start(&c, zds.path(), &settings(variant));
        let peer = ZdsPeer::connect_at(agent.zds_socket());
        let conflist = agent.conflist();
        let (pods, uids, peer) = (BTreeMap::new(), BTreeMap::new(), Some(peer));
        Side { name: "istio", variant, pods, uids, peer, agent: Agent::Istio(agent), conflist, c, _zds: zds }
    }

    /// Ours, with `istio`'s conflist but our plugin (the entry Istio's installer wrote, `type` ours, our run dir).
    fn ours(istio: &Side) -> Self {
        let variant = istio.variant;
        let c = cluster();
        let zds = tempfile::Builder::new().prefix("our-zds-").tempdir().expect("ZDS dir");
        let agent = NodeAgent::start(&c, &settings(variant));
        let peer = ZdsPeer::connect(&agent);
        let mut entry = istio.conflist["plugins"][1].clone();
        entry["type"] = json!("istio-cni");
        entry["cni_agent_run_dir"] = json!(c.run_dir());
        let mut conflist = c.node.conflist(vec![entry]);
        conflist["plugins"][0]["ipam"]["routes"] = istio.conflist["plugins"][0]["ipam"]["routes"].clone();
        let (pods, uids, peer) = (BTreeMap::new(), BTreeMap::new(), Some(peer));
        Side { name: "ours", variant, pods, uids, peer, agent: Agent::Ours(agent), conflist, c, _zds: zds }
    }

    fn zds_socket(&self) -> std::path::PathBuf {
        match &self.agent {
            Agent::Istio(a) => a.zds_socket().to_path_buf(),
            Agent::Ours(a) => a.zds_socket(),
        }
    }

    fn peer(&self) -> &ZdsPeer {
        self.peer.as_ref().expect("a test proxy is connected")
    }

    /// The test proxy restarts: its connection closes, then a new one connects and gets the agent's snapshot.
    fn restart_peer(&mut self) {
        drop(self.peer.take());
        if let Agent::Istio(agent) = &self.agent {
            // Istio's agent would send the next deletion to the closed connection too (and, failing, send it
            // again): a real proxy's restart takes longer than Istio's keepalive check.
            eventually("Istio's agent noticed the closed proxy connection", || {
                (agent.proxy_connections() == Some(0)).then_some(())
            });
        }
        self.peer = Some(ZdsPeer::connect_at(&self.zds_socket()));
    }
}

fn key(pod: &Value) -> (String, String) {
    let meta = &pod["metadata"];
    (meta["namespace"].as_str().unwrap().to_owned(), meta["name"].as_str().unwrap().to_owned())
}

impl Side {
    /// Stores `pod` and adds it through this node's runtime; the ADD's error, if any.
    fn add(&mut self, pod: &Value) -> Result<(), String> {
        self.c.create(pod);
        let (ns, name) = key(pod);
        let uid = self.c.api.get("Pod", Some(&ns), &name).expect("stored pod")["metadata"]["uid"].clone();
        self.uids.insert(uid.as_str().expect("uid").to_owned(), format!("{ns}/{name}"));
        let added = self.c.add_with(self.conflist.clone(), &name, &ns).map_err(|e| e.to_string())?;
        // The kubelet then reports the sandbox's address (Istio's agent removes a pod's probe set entry by it).
        let mut stored = self.c.api.get("Pod", Some(&ns), &name).expect("stored pod");
        let ip = added.ip.to_string();
        stored["status"] = json!({ "phase": "Running", "podIP": ip, "podIPs": [{ "ip": ip }] });
        self.c.api.upsert(stored).expect("store the pod's status");
        self.pods.insert(format!("{ns}/{name}"), added);
        Ok(())
    }

    fn pod(&self, id: &str) -> &Pod {
        self.pods.get(id).unwrap_or_else(|| panic!("{}: no pod {id}", self.name))
    }

    /// `namespace/name` of every pod of this side by UID, and by IP.
    fn names(&self) -> (BTreeMap<String, String>, BTreeMap<String, String>) {
        let ips = self.pods.iter().map(|(id, pod)| (pod.ip.to_string(), id.clone())).collect();
        (self.uids.clone(), ips)
    }

    /// `text` with this side's pod UIDs and IPs replaced by `<ns/name>`, its subnet by `<subnet>` and its gateway
    /// by `<gateway>`.
    fn named(&self, text: &str) -> String {
        let (uids, ips) = self.names();
        let mut text = text.to_owned();
        for (uid, id) in &uids {
            text = text.replace(uid, &format!("<uid {id}>"));
        }
        // Longest first, so 10.1.2.10 is not rewritten through 10.1.2.1.
        let mut ips: Vec<_> = ips.into_iter().collect();
        ips.sort_by_key(|(ip, _)| std::cmp::Reverse(ip.len()));
        for (ip, id) in ips {
            text = text.replace(&ip, &format!("<ip {id}>"));
        }
        text.replace(&self.c.node.subnet(), "<subnet>").replace(&self.c.node.gateway().to_string(), "<gateway>")
    }

    /// Every request the recorder got, with pods by name: `Add ns/name (workload name, namespace, service
    /// account) netns=<whether the one fd is the pod's netns>`, `Keep ns/name`, `Del ns/name`, `SnapshotSent`.
    fn zds(&self, peer: &ZdsPeer) -> Vec<String> {
        let (uids, _) = self.names();
        peer.received().iter().map(|r| self.describe(r, &uids)).collect()
    }

    fn describe(&self, r: &Received, uids: &BTreeMap<String, String>) -> String {
        let pod = uids.get(&r.uid).cloned().unwrap_or_else(|| format!("<unknown uid {}>", r.uid));
        match r.kind {
            RequestKind::Add => {
                let info = r.info.as_ref().map_or("no workload info".to_owned(), |i| {
                    format!("workload {}/{} sa {:?}", i.namespace, i.name, i.service_account)
                });
                let netns = self.pods.get(&pod).map(|p| netns_id(&p.netns));
                let fd = if netns.is_some_and(|id| r.fds == vec![id]) {
                    "fd=pod netns".to_owned()
                } else {
                    format!("fds={:?}", r.fds)
                };
                format!("Add {pod} ({info}) {fd}")
            }
            RequestKind::Keep => format!("Keep {pod}"),
            RequestKind::Del => format!("Del {pod}"),
            RequestKind::SnapshotSent => "SnapshotSent".to_owned(),
            RequestKind::Empty => "<empty request>".to_owned(),
        }
    }

    fn annotation(&self, id: &str) -> Option<String> {
        let (ns, name) = id.split_once('/').unwrap();
        redirection(&self.c, ns, name)
    }
}

/// Everything an agent or plugin may change in a pod netns, by section: `iptables-save` of both families in both
/// flavours, the policy routing rules and the ambient routing table (100) of both families.
fn pod_dump(ns: &NetnsGuard) -> BTreeMap<String, String> {
    const SCRIPT: &str = "echo '## nft'; nft list ruleset; for t in iptables-nft-save ip6tables-nft-save iptables-legacy-save ip6tables-legacy-save; \
        do echo \"## $t\"; $t; done; echo '## ip rule'; ip rule show; echo '## ip -6 rule'; ip -6 rule show; \
        echo '## route 100'; ip -d route show table 100 2>&1; echo '## route6 100'; ip -d -6 route show table 100 2>&1; \
        true";
    sections(ns, SCRIPT)
}

/// What the agents program in the node netns: the `iptables-save` of both families in both flavours and the
/// ipsets.
fn node_dump(ns: &NetnsGuard) -> BTreeMap<String, String> {
    const SCRIPT: &str = "echo '## nft'; nft list ruleset; for t in iptables-nft-save ip6tables-nft-save iptables-legacy-save ip6tables-legacy-save; \
        do echo \"## $t\"; $t; done; echo '## ipset'; ipset list";
    sections(ns, SCRIPT)
}

fn sections(ns: &NetnsGuard, script: &str) -> BTreeMap<String, String> {
    let out = ns.exec(&["sh", "-c", script]);
    assert!(out.status.success(), "dump in {}: {}", ns.name(), String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    text.split("## ")
        .filter(|p| !p.is_empty())
        .map(|part| {
            let (name, body) = part.split_once('\n').unwrap_or((part, ""));
            let body = match name {
                "ipset" => normalize_ipset(body),
                "nft" => normalize_nft_ruleset(body),
                _ => normalize_iptables_save(body),
            };
            (name.to_owned(), body)
        })
        .collect()
}

/// `ipset list` without what differs from run to run (memory size, the hash's random `initval`), members sorted.
fn normalize_ipset(dump: &str) -> String {
    let mut out = Vec::new();
    let mut members = Vec::new();
    for line in dump.lines().map(str::trim_end) {
        if line.starts_with("Size in memory:") {
            continue;
        }
        if line.starts_with("Name:") {
            members.sort();
            out.append(&mut members);
        }
        let line = match line.split_once(" initval ") {
            Some((head, tail)) => {
                format!("{head}{}", tail.split_once(' ').map_or(String::new(), |(_, t)| format!(" {t}")))
            }
            None => line.to_owned(),
        };
        let is_member = line.chars().next().is_some_and(|c| c.is_ascii_hexdigit()) && !line.contains(':')
            || line.contains(" comment ");
        if is_member {
            members.push(line);
        } else {
            out.push(line);
        }
    }
    members.sort();
    out.append(&mut members);
    out.join("\n")
}

/// Compares `istio`'s and `ours`'s sections, panicking with both when they differ.
#[track_caller]
fn assert_same(what: &str, istio: &BTreeMap<String, String>, ours: &BTreeMap<String, String>) {
    let mut diffs = Vec::new();
    for section in istio.keys().chain(ours.keys()).collect::<std::collections::BTreeSet<_>>() {
        let (i, o) = (istio.get(section), ours.get(section));
        if i != o {
            diffs.push(format!(
                "--- {section}, Istio's:\n{}\n--- {section}, ours:\n{}",
                i.map_or("(none)", String::as_str),
                o.map_or("(none)", String::as_str)
            ));
        }
    }
    assert!(diffs.is_empty(), "{what} differ:\n{}", diffs.join("\n"));
}

/// Where a connection from the node netns to `pod`'s port `port`, made as the kubelet's uid (the nftables host
/// rules match it; the iptables rule any local socket), arrives from (a listener in the pod netns accepts it).
fn source_of_node_connection(side: &Side, pod: &Pod, port: u16) -> IpAddr {
    let probe = pod.netns.listen_tcp(port);
    let node = side.c.node.netns();
    node.connect_tcp(SocketAddr::from((pod.ip, port)), Some(KUBELET_UID))
        .unwrap_or_else(|e| panic!("{}: connect from the node to {}:{port}: {e}", side.name, pod.ip));
    probe.accepted().peer.ip()
}

#[test]
fn istio_agent_and_ours_enroll_the_same_pods_the_same_way() {
    if istio() {
        differential(Variant { nft: false, dns_and_ipv6: true });
    }
}

#[test]
fn istio_agent_and_ours_enroll_the_same_pods_the_same_way_with_native_nftables() {
    if istio() {
        differential(Variant { nft: true, dns_and_ipv6: true });
    }
}

#[test]
fn istio_agent_and_ours_enroll_the_same_pods_the_same_way_without_dns_capture_and_ipv6() {
    if istio() {
        differential(Variant { nft: false, dns_and_ipv6: false });
    }
}

/// The comparison (module doc), with both agents and plugins on iptables (the flavour each detects) or on native
/// nftables, with DNS capture and IPv6 or without.
fn differential(variant: Variant) {
    let mut istio = Side::istio(variant);
    let mut ours = Side::ours(&istio);
    let cases = cases();

    // ADD of each pod on both nodes, in the same order; the outcome, the rules in its netns and its annotation
    // right after ADD returned.
    for case in &cases {
        let (ns, name) = key(&case.pod);
        let id = format!("{ns}/{name}");
        eprintln!("--- {id}: {}", case.what);
        let (i, o) = (istio.add(&case.pod), ours.add(&case.pod));
        assert_eq!(i.is_ok(), o.is_ok(), "{id}: ADD through Istio's: {i:?}; through ours: {o:?}");
        if i.is_err() {
            continue;
        }
        let (ri, ro) = Intended::forgive_rules(pod_dump(&istio.pod(&id).netns), pod_dump(&ours.pod(&id).netns));
        assert_same(&format!("{id} ({}): the in-pod rules", case.what), &ri, &ro);
        assert_eq!(istio.annotation(&id), ours.annotation(&id), "{id} ({}): the redirection annotation", case.what);
    }
    let enrolled = ["mesh/web", "shop/api", "shop/nodns", "mesh/probed", "shop/noinbound"];
    for id in enrolled {
        assert_eq!(istio.annotation(id).as_deref(), Some("enabled"), "Istio's agent annotated {id}");
    }
    for id in ["mesh/batch", "mesh/legacy", "shop/plain", "kube-system/dns"] {
        assert_eq!(istio.annotation(id), None, "Istio's agent left {id} alone");
    }

    // The ZDS requests so far, in order.
    let (zi, zo) = (Intended::forgive_zds(istio.zds(istio.peer())), ours.zds(ours.peer()));
    eprintln!("ZDS (Istio's agent):\n  {}", zi.join("\n  "));
    assert_eq!(zi, zo, "the ZDS requests after the ADDs (left: Istio's agent, right: ours)");

    // The host probe rule and set in the node netns, then its effect.
    let (hi, ho) = (node_dump(istio.c.node.netns()), node_dump(ours.c.node.netns()));
    let named = |side: &Side, dump: BTreeMap<String, String>| -> BTreeMap<String, String> {
        dump.into_iter().map(|(k, v)| (k, side.named(&v))).collect()
    };
    let (hi, ho) = Intended::forgive_rules(named(&istio, hi), named(&ours, ho));
    assert_same("the node netns (host probe rule and set)", &hi, &ho);
    for side in [&istio, &ours] {
        let probed = source_of_node_connection(side, side.pod("mesh/probed"), PROBE_PORT);
        assert_eq!(probed.to_string(), PROBE_SOURCE, "{}: a node connection to an enrolled pod is SNATed", side.name);
        let plain = source_of_node_connection(side, side.pod("shop/plain"), PROBE_PORT);
        assert_eq!(plain, IpAddr::V4(side.c.node.gateway()), "{}: a node connection to a pod not enrolled", side.name);
    }

    // The proxy restarts: the new connection gets the snapshot, the enrolled pods then SnapshotSent.
    istio.restart_peer();
    ours.restart_peer();
    let (si, so) = (Intended::forgive_zds(istio.zds(istio.peer())), ours.zds(ours.peer()));
    eprintln!("ZDS snapshot (Istio's agent):\n  {}", si.join("\n  "));
    assert_eq!(sorted_snapshot(si), sorted_snapshot(so), "the snapshot of a new connection");
    let snapshot_len = istio.peer().received().len();

    // shop/api opts out by label: its rules go, the proxy gets Del, the annotation goes.
    for side in [&istio, &ours] {
        let mut pod = side.c.api.get("Pod", Some(SHOP), "api").expect("stored pod");
        pod["metadata"]["labels"][names::DATAPLANE_MODE_LABEL] = json!("none");
        side.c.api.upsert(pod).expect("relabel shop/api");
    }
    for side in [&istio, &ours] {
        eventually(&format!("{}: shop/api loses its annotation after opting out", side.name), || {
            side.annotation("shop/api").is_none().then_some(())
        });
    }
    let (ri, ro) =
        Intended::forgive_rules(pod_dump(&istio.pod("shop/api").netns), pod_dump(&ours.pod("shop/api").netns));
    assert_same("shop/api's rules after it opted out", &ri, &ro);

    // mesh/web is deleted, as the kubelet deletes it.
    for side in [&mut istio, &mut ours] {
        let mut pod = side.pods.remove("mesh/web").expect("mesh/web");
        let uid =
            side.c.api.get("Pod", Some(MESH), "web").and_then(|p| p["metadata"]["uid"].as_str().map(String::from));
        side.c.delete_pod(MESH, "web", Some(&mut pod));
        let uid = uid.expect("uid of mesh/web");
        eventually(&format!("{}: the proxy gets Del for mesh/web", side.name), || {
            side.peer().received().iter().any(|r| r.kind == RequestKind::Del && r.uid == uid).then_some(())
        });
        // Named still, for the comparison below.
        side.pods.insert("mesh/web".into(), pod);
    }
    let (zi, zo) = (Intended::forgive_zds(istio.zds(istio.peer())), ours.zds(ours.peer()));
    let (zi, zo) = (&zi[snapshot_len.min(zi.len())..], &zo[snapshot_len.min(zo.len())..]);
    eprintln!("ZDS (Istio's agent) after the snapshot:\n  {}", zi.join("\n  "));
    assert_eq!(zi, zo, "the ZDS requests after the opt-out and the deletion (left: Istio's agent, right: ours)");
    let (hi, ho) = (node_dump(istio.c.node.netns()), node_dump(ours.c.node.netns()));
    let (hi, ho) = Intended::forgive_rules(named(&istio, hi), named(&ours, ho));
    assert_same("the node netns after the opt-out and the deletion", &hi, &ho);

    // The fake API server answered every request of Istio's agent and plugin as a real one would: nothing failed
    // (a watch's errors, such as 410 after compaction, come inside the stream and are the client's to handle) but
    // the unenroll patch of the deleted pod, 404 as on a real server (Istio's agent takes it as done).
    let deleted_pod_unenroll = |r: &fake_apiserver::RequestRecord| {
        r.status == 404 && r.method == "PATCH" && r.path == format!("/api/v1/namespaces/{MESH}/pods/web/status")
    };
    let requests = istio.c.api.cluster().requests();
    let asked: std::collections::BTreeSet<String> =
        requests.iter().map(|r| format!("{} {} {} ({})", r.verb, r.path, r.query, r.user)).collect();
    eprintln!("requests to Istio's node's API server:\n  {}", asked.into_iter().collect::<Vec<_>>().join("\n  "));
    let failed: Vec<_> = requests.into_iter().filter(|r| r.status >= 400 && !deleted_pod_unenroll(r)).collect();
    assert!(failed.is_empty(), "requests of Istio's agent or plugin failed: {failed:#?}");
}

/// A snapshot's pods in name order (the agents send them in the order of their caches), `SnapshotSent` last.
fn sorted_snapshot(mut requests: Vec<String>) -> Vec<String> {
    let last = requests.pop();
    requests.sort();
    requests.extend(last);
    requests
}

#[test]
fn istio_agent_drives_our_hbone_proxy() {
    if !istio() {
        return;
    }
    let c = cluster();
    let zds = tempfile::Builder::new().prefix("istio-zds-").tempdir().expect("ZDS dir");
    let agent = IstioAgent::start(&c, zds.path(), &[]);
    let dir = tempfile::tempdir().expect("proxy dir");
    let proxy = Proxy::start_on(&c, agent.zds_socket(), dir.path(), &dir.path().join("workloads.yaml"), &[], None);
    let pod = with_sa(plain_pod(MESH, "web"));
    c.create(&pod);
    let web = c.add_with(agent.conflist(), "web", MESH).unwrap_or_else(|e| panic!("ADD through Istio's: {e}"));
    let mut stored = c.api.get("Pod", Some(MESH), "web").expect("stored pod");
    let uid = stored["metadata"]["uid"].as_str().expect("uid").to_owned();
    // The kubelet reports the sandbox's address; the proxy's Kubernetes source lists the pod by it.
    stored["status"] =
        json!({ "phase": "Running", "podIP": web.ip.to_string(), "podIPs": [{ "ip": web.ip.to_string() }] });
    c.api.upsert(stored).expect("store the pod's status");
    // Istio's agent annotates only after the proxy acked the pod's Add.
    assert_eq!(redirection(&c, MESH, "web").as_deref(), Some("enabled"), "log:\n{}", agent.log());
    let dump = eventually("our proxy runs the pod Istio's agent sent", || {
        let dump = proxy.config_dump()?;
        dump["pods"].as_array()?.iter().any(|p| p["uid"] == uid.as_str()).then_some(dump)
    });
    eprintln!("proxy pods: {}", dump["pods"]);
    // The proxy took the pod's netns from Istio's agent's fd: its listeners are in the pod.
    let listening = web.netns.exec_ok(&["ss", "-ltnH"]);
    for port in [15001, 15006, 15008] {
        assert!(listening.contains(&format!(":{port} ")), "no proxy listener on {port} in the pod:\n{listening}");
    }
    let listed = eventually("our proxy lists the enrolled pod from the API", || {
        let listed = proxy.listed_workloads(KUBERNETES_SOURCE)?;
        listed.into_iter().find(|w| w["uid"] == uid.as_str() || w["name"] == "web")
    });
    eprintln!("listed: {listed}");
    assert!(agent.log().contains("sending pod add to ztunnel"), "log:\n{}", agent.log());
    drop(web);
    // Istio's agent stops cleanly on SIGTERM, as the kubelet stops it.
    let mut agent = agent;
    let status = agent.stop();
    assert!(status.success(), "Istio's agent exited with {status}; log:\n{}", agent.log());
}

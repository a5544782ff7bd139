//! Scenario 7, fleet: what a fleet of nodes costs the API server. Several simulated nodes (each its own netns,
//! bridge, CNI runtime, real `node-agent` with its own `NODE_NAME`, real `hbone-proxy`) share one fake API server
//! (testbed's [`Fleet`]: one store, a front end on each node's loopback, the server counting what it sends to
//! each client). The scenario enrolls pods on every node through the real CNI ADD, stores a population of other
//! nodes' pods as their agents would have left them, restarts one node's agent and proxy, leaves the fleet idle,
//! deletes the enrolled pods, and reports per phase what each component asked for and received (requests by verb
//! and resource, objects, watch events, bytes) and what it holds in memory, then the model for 5,000 nodes × 100
//! pods built from those figures (docs/fleet.md explains it).
//!
//! Guarantees: every figure is read from the server's own counters ([`fake_apiserver::TrafficRecord`]) or from
//! `/proc/<pid>/status`, after a condition (a watched state every component reached) rather than after a fixed
//! time (the idle window ends once the server has sent every open watch a bookmark); the report says which pods
//! were enrolled for real and which were only stored.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use fake_apiserver::{TrafficRecord, User};
use istio_contract::{names, ports};
use serde_json::json;
use tempfile::TempDir;
use testbed::chart;
use testbed::fleet::{Fleet, FleetNode};
use testbed::hbone_proxy::Proxy;
use testbed::mesh::RuleBackend;
use testbed::node_agent::{ambient_conflist, ambient_pod, namespace, redirection, NodeAgent};
use testbed::Pod;

use crate::load::{self, Load};
use crate::process_figures::{cpu_time, rss_kib};
use crate::report::Section;
use crate::stats::Counts;

/// Namespace of every pod of the fleet.
const NS: &str = "fleet";
/// Simulated nodes running a real agent and proxy.
const NODES: usize = 4;
/// Stored pods of other nodes per enrolled pod on a simulated node (25 pods per node: 2,000 stored pods; the
/// proxy applies each event in time that grows with the pods it holds, so 5,000 take minutes on 2 cores).
const REMOTE_PER_POD: usize = 20;
/// Pods per "other node" in the stored population (so they spread over nodes as in the model).
const REMOTE_PODS_PER_NODE: usize = 100;
/// The server's bookmark interval: a minute, as the real server's. The idle window lasts until every open watch
/// has been sent one, so it spans about one interval.
const BOOKMARKS: Duration = Duration::from_secs(60);
/// The bookmark interval of a `--quick` run (which only checks that the scenario still runs).
const QUICK_BOOKMARKS: Duration = Duration::from_secs(1);
/// How long any fleet-wide convergence may take before the run is declared broken.
const LIMIT: Duration = Duration::from_secs(300);
/// Log level of the agents and proxies.
const QUIET: &str = "warn";

/// The model's fleet.
const MODEL_NODES: f64 = 5000.0;
const MODEL_PODS_PER_NODE: f64 = 100.0;
/// kube-rs's watcher asks every watch to end after this long (`timeoutSeconds=290`), then watches again.
const WATCH_SECONDS: f64 = 290.0;
/// The size of one pod object as a real API server sends it (JSON with managedFields and a full status), for
/// the byte rows of the model; the fake's pods are smaller and their measured size is reported beside it.
const REAL_POD_BYTES: f64 = 6.0 * 1024.0;

/// One simulated node. Field order is drop order: proxy, agent, then the node.
struct SimNode {
    name: String,
    proxy: Proxy,
    agent: NodeAgent,
    proxy_dir: TempDir,
    node: FleetNode,
}

impl SimNode {
    fn start(fleet: &Fleet, name: &str) -> SimNode {
        let node = fleet.join(name, RuleBackend::Nftables);
        let agent = NodeAgent::start(&node.cluster, &[("LOG_LEVEL", QUIET), ("NODE_NAME", name)]);
        let proxy_dir = tempfile::Builder::new().prefix("fleet-proxy-").tempdir().expect("proxy dir");
        let proxy = start_proxy(&node, &agent, &proxy_dir);
        SimNode { name: name.to_owned(), proxy, agent, proxy_dir, node }
    }

    fn restart_proxy(&mut self) {
        self.proxy.stop();
        self.proxy = start_proxy(&self.node, &self.agent, &self.proxy_dir);
    }

    /// SIGKILLs the agent and starts a new one on the same ZDS socket (which the proxy stays connected to).
    fn restart_agent(&mut self) -> NodeAgent {
        self.agent.kill();
        let socket = self.agent.zds_socket().display().to_string();
        let env = [("LOG_LEVEL", QUIET), ("NODE_NAME", self.name.as_str()), ("ZTUNNEL_UDS_ADDRESS", &socket)];
        let agent = NodeAgent::start(&self.node.cluster, &env);
        std::mem::replace(&mut self.agent, agent)
    }

    fn rss(&self) -> (u64, u64) {
        (rss_kib(self.agent.pid()), rss_kib(self.proxy.pid()))
    }

    /// How many pods the proxy runs (its `workload_manager_active_proxy_count`).
    fn proxy_active(&self) -> Option<usize> {
        let netns = self.node.cluster.node.netns().path();
        let (_, body) = testbed::http::get(&netns, ports::STATS, "/metrics").ok()?;
        body.lines().find_map(|l| l.strip_prefix("workload_manager_active_proxy_count ")?.trim().parse().ok())
    }
}

fn start_proxy(node: &FleetNode, agent: &NodeAgent, dir: &TempDir) -> Proxy {
    Proxy::start(&node.cluster, agent, dir.path(), &dir.path().join("workloads.yaml"), &[("LOG_LEVEL", QUIET)])
}

/// Polls `probe` every 10 ms until it holds, or panics naming `what` after [`LIMIT`].
fn until(what: &str, probe: impl FnMut() -> Option<()>) {
    until_every(what, Duration::from_millis(10), probe);
}

/// [`until`], polling every `interval`: for probes that read every proxy's `/config_dump` (thousands of
/// workloads each), which polled every 10 ms would starve the proxies they wait for.
fn until_every(what: &str, interval: Duration, probe: impl FnMut() -> Option<()>) {
    let since = Instant::now();
    if testbed::wait::within_every(since, LIMIT, interval, probe).is_none() {
        panic!("fleet: {what}: not within {LIMIT:?}");
    }
}

/// How often the probes that read `/config_dump` poll.
const DUMP_POLL: Duration = Duration::from_millis(500);

/// Waits until the server has sent every proxy's pod watch `events` events since the counters were cleared
/// (cheap: the server's own counters), then until every proxy's directory lists `listed` pods; returns how many
/// times it read each proxy's `/config_dump`.
fn until_listed(fleet: &Fleet, nodes: &[SimNode], events: u64, listed: usize) -> usize {
    until("the server sent every proxy its pod events", || {
        let sent = fleet.api.traffic();
        nodes
            .iter()
            .all(|n| {
                sent.iter()
                    .filter(|r| r.front_end == n.name && Component::of(r) == Component::Proxy && r.resource == "pods")
                    .map(|r| r.objects)
                    .sum::<u64>()
                    >= events
            })
            .then_some(())
    });
    let mut last = Vec::new();
    let mut polls = 0;
    until_every("every proxy lists the pods", DUMP_POLL, || {
        polls += 1;
        let state: Vec<_> = nodes.iter().map(|n| n.proxy.kubernetes_addresses()).collect();
        if state != last {
            println!("fleet: pods listed per proxy: {state:?}");
            last = state;
        }
        last.iter().all(|n| *n == Some(listed)).then_some(())
    });
    polls
}

/// Mean CPU seconds one `/config_dump` costs each proxy as it is now (over a few reads).
fn dump_cpu(nodes: &[SimNode]) -> f64 {
    const READS: usize = 5;
    let before: Vec<f64> = nodes.iter().map(|n| cpu_time(n.proxy.pid()).as_secs_f64()).collect();
    for _ in 0..READS {
        for n in nodes {
            let _ = n.proxy.kubernetes_addresses();
        }
    }
    let used: f64 = nodes.iter().zip(&before).map(|(n, b)| cpu_time(n.proxy.pid()).as_secs_f64() - b).sum();
    used / (READS * nodes.len()) as f64
}

/// The components the server tells apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Component {
    Agent,
    Plugin,
    Proxy,
    Other,
}

impl Component {
    fn of(record: &TrafficRecord) -> Component {
        let cni = User::service_account(chart::NAMESPACE, chart::CNI_SERVICE_ACCOUNT).name;
        let proxy = User::service_account(chart::NAMESPACE, chart::PROXY_SERVICE_ACCOUNT).name;
        if record.user == proxy {
            Component::Proxy
        } else if record.user == cni && record.front_end.ends_with("/plugin") {
            Component::Plugin
        } else if record.user == cni {
            Component::Agent
        } else {
            Component::Other
        }
    }

    fn name(self) -> &'static str {
        match self {
            Component::Agent => "node-agent",
            Component::Plugin => "istio-cni (plugin)",
            Component::Proxy => "hbone-proxy",
            Component::Other => "other",
        }
    }
}

/// Traffic summed per component, verb and resource (over every node).
#[derive(Debug, Default, Clone)]
struct Tally(BTreeMap<(Component, String, String), TrafficRecord>);

impl Tally {
    fn of(records: &[TrafficRecord]) -> Tally {
        let mut tally = Tally::default();
        for r in records {
            let entry = tally.0.entry((Component::of(r), r.verb.clone(), r.resource.clone())).or_default();
            entry.requests += r.requests;
            entry.bytes += r.bytes;
            entry.objects += r.objects;
            entry.bookmarks += r.bookmarks;
        }
        tally
    }

    /// The sum over `component`'s rows that `keep` selects.
    fn sum(&self, component: Component, keep: impl Fn(&str, &str) -> bool) -> TrafficRecord {
        let mut total = TrafficRecord::default();
        for ((c, verb, resource), r) in &self.0 {
            if *c == component && keep(verb, resource) {
                total.requests += r.requests;
                total.bytes += r.bytes;
                total.objects += r.objects;
                total.bookmarks += r.bookmarks;
            }
        }
        total
    }

    fn component(&self, component: Component) -> TrafficRecord {
        self.sum(component, |_, _| true)
    }

    fn watch_events(&self, component: Component) -> TrafficRecord {
        self.sum(component, |verb, _| verb == "watch")
    }

    /// A markdown table: one row per component, verb and resource, each figure divided by `per` (`unit` names it).
    fn table(&self, per: f64, unit: &str) -> String {
        let mut s = format!(
            "| component | verb | resource | requests {unit} | objects/events {unit} | bookmarks {unit} | bytes {unit} |\n\
             |---|---|---|---:|---:|---:|---:|\n"
        );
        if self.0.is_empty() {
            s.push_str("| (none) | | | 0 | 0 | 0 | 0 |\n");
        }
        for ((c, verb, resource), r) in &self.0 {
            let _ = writeln!(
                s,
                "| {} | {verb} | {resource} | {} | {} | {} | {} |",
                c.name(),
                num(r.requests as f64 / per),
                num(r.objects as f64 / per),
                num(r.bookmarks as f64 / per),
                num(r.bytes as f64 / per)
            );
        }
        s
    }
}

/// A figure with as many decimals as it needs to be read.
fn num(v: f64) -> String {
    if v == 0.0 {
        "0".to_owned()
    } else if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else if v.abs() >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

/// A rate or size in human units.
fn si(v: f64, unit: &str) -> String {
    let (scaled, prefix) = match v.abs() {
        x if x >= 1e9 => (v / 1e9, "G"),
        x if x >= 1e6 => (v / 1e6, "M"),
        x if x >= 1e3 => (v / 1e3, "k"),
        _ => (v, ""),
    };
    format!("{} {prefix}{unit}", num(scaled))
}

/// Takes the server's counters since the last call and clears them.
fn take(fleet: &Fleet) -> (Vec<TrafficRecord>, Tally) {
    let records = fleet.api.traffic();
    fleet.api.clear_traffic();
    let tally = Tally::of(&records);
    (records, tally)
}

/// A pod of another node as its agent and kubelet would have left it: scheduled there, running with an IP,
/// enrolled in ambient.
fn remote_pod(i: usize) -> serde_json::Value {
    let name = format!("remote-{i}");
    let mut pod = ambient_pod(NS, &name);
    pod["spec"]["nodeName"] = json!(format!("other-node-{}", i / REMOTE_PODS_PER_NODE));
    pod["spec"]["serviceAccountName"] = json!(format!("sa-{}", i % 20));
    pod["metadata"]["annotations"] = json!({ names::AMBIENT_REDIRECTION: names::AMBIENT_REDIRECTION_ENABLED });
    // 10.240.0.0/12: no simulated node's pod range (10.1xx.n.0/24).
    let ip = format!("10.{}.{}.{}", 240 + (i >> 16), (i >> 8) & 0xff, i & 0xff);
    pod["status"] = json!({ "phase": "Running", "podIP": ip, "podIPs": [{ "ip": ip }] });
    pod
}

/// Average RSS (KiB) of the agents and of the proxies.
fn rss(nodes: &[SimNode]) -> (f64, f64) {
    let all: Vec<(u64, u64)> = nodes.iter().map(SimNode::rss).collect();
    let n = all.len() as f64;
    (all.iter().map(|r| r.0 as f64).sum::<f64>() / n, all.iter().map(|r| r.1 as f64).sum::<f64>() / n)
}

/// Runs the scenario and returns its report section (`counts.iterations` pods enrolled on each node; `quick`
/// has the server send bookmarks every second, which shortens the idle window, and leaves out the real
/// kube-apiserver's pod sizes).
pub fn run(counts: Counts, quick: bool) -> Section {
    let bookmarks = if quick { QUICK_BOOKMARKS } else { BOOKMARKS };
    let per_node = counts.iterations;
    let enrolled = NODES * per_node;
    let remote = enrolled * REMOTE_PER_POD;
    let load_start = Load::sample();
    let fleet = Fleet::start_with_bookmarks(bookmarks);
    fleet.api.upsert(namespace(NS, json!({}))).expect("store namespace");

    println!("fleet: starting {NODES} nodes (agent + proxy each)");
    let mut nodes: Vec<SimNode> = (1..=NODES).map(|k| SimNode::start(&fleet, &format!("node-{k}"))).collect();
    let (boot, _) = take(&fleet);
    let rss_empty = rss(&nodes);

    println!("fleet: enrolling {per_node} pods on each node through CNI ADD");
    let mut pods: Vec<(usize, String, Pod)> = Vec::with_capacity(enrolled);
    for i in 0..per_node {
        for (k, node) in nodes.iter().enumerate() {
            let cluster = &node.node.cluster;
            let name = format!("{}-pod-{i}", node.name);
            let mut pod = ambient_pod(NS, &name);
            pod["spec"]["nodeName"] = json!(node.name);
            pod["spec"]["serviceAccountName"] = json!(format!("sa-{}", i % 20));
            cluster.create(&pod);
            let added = cluster.add_with(ambient_conflist(cluster), &name, NS).expect("CNI ADD");
            until("the agent annotated the pod", || {
                (redirection(cluster, NS, &name).as_deref() == Some("enabled")).then_some(())
            });
            // The kubelet reports the pod running with its IP, as it does after the sandbox is up.
            let mut object = cluster.api.get("Pod", Some(NS), &name).expect("pod stored");
            let ip = added.ip.to_string();
            object["status"] = json!({ "phase": "Running", "podIP": ip, "podIPs": [{ "ip": ip }] });
            cluster.api.upsert(object).expect("report the pod running");
            pods.push((k, name, added));
        }
    }
    until_every("every proxy runs its node's pods and lists every enrolled pod", DUMP_POLL, || {
        nodes
            .iter()
            .all(|n| n.proxy_active() == Some(per_node) && n.proxy.kubernetes_addresses() == Some(enrolled))
            .then_some(())
    });
    let (_, create_tally) = take(&fleet);
    let rss_own = rss(&nodes);

    println!("fleet: storing {remote} pods of other nodes");
    let cpu_before: Vec<f64> = nodes.iter().map(|n| cpu_time(n.proxy.pid()).as_secs_f64()).collect();
    let stored = Instant::now();
    for i in 0..remote {
        fleet.api.upsert(remote_pod(i)).expect("store a pod of another node");
    }
    let polls = until_listed(&fleet, &nodes, remote as u64, enrolled + remote);
    let applied = stored.elapsed();
    let cpu: Vec<f64> =
        nodes.iter().zip(&cpu_before).map(|(n, before)| cpu_time(n.proxy.pid()).as_secs_f64() - before).collect();
    // Less what the waiting's own `/config_dump` reads cost (each at most what one costs now, with every pod).
    let dump = dump_cpu(&nodes);
    let proxy_cpu = (cpu.iter().sum::<f64>() / cpu.len() as f64 - polls as f64 * dump).max(0.0);
    let (remote_records, remote_tally) = take(&fleet);
    let rss_remote = rss(&nodes);

    println!("fleet: idle until every open watch has been sent a bookmark (one every {bookmarks:?})");
    let idle_start = Instant::now();
    let watches = || fleet.api.open_watches("pods") + fleet.api.open_watches("namespaces");
    let bookmarked = || fleet.api.traffic().iter().map(|r| r.bookmarks).sum::<u64>() as usize;
    let idle_end = testbed::wait::within_every(idle_start, 2 * bookmarks + LIMIT, Duration::from_millis(100), || {
        (bookmarked() >= watches()).then_some(())
    });
    assert!(idle_end.is_some(), "the {} open watches were not all sent a bookmark", watches());
    let idle_seconds = idle_start.elapsed().as_secs_f64();
    let (_, idle_tally) = take(&fleet);

    println!("fleet: deleting the {enrolled} enrolled pods (graceful DELETE, CNI DEL, final DELETE)");
    for (k, name, mut pod) in pods {
        nodes[k].node.cluster.delete_pod(NS, &name, Some(&mut pod));
    }
    let mut last = Vec::new();
    until_every("every proxy dropped the deleted pods", DUMP_POLL, || {
        let state: Vec<_> = nodes.iter().map(|n| (n.proxy_active(), n.proxy.kubernetes_addresses())).collect();
        if state != last {
            println!("fleet: (pods running, pods listed) per proxy: {state:?}");
            last = state;
        }
        last.iter().all(|s| *s == (Some(0), Some(remote))).then_some(())
    });
    let (_, delete_tally) = take(&fleet);
    println!("fleet: restarting node-1's proxy, then its agent");
    nodes[0].restart_proxy();
    until_every("the restarted proxy lists every pod", DUMP_POLL, || {
        (nodes[0].proxy.kubernetes_addresses() == Some(remote)).then_some(())
    });
    let (_, proxy_restart) = take(&fleet);
    // Ready means its caches synced: its pod list is done.
    let old_agent = nodes[0].restart_agent();
    let (_, agent_restart) = take(&fleet);
    drop(old_agent);
    let selectors = watch_selectors(&fleet);

    let figures = Figures {
        per_node,
        enrolled,
        remote,
        boot: Tally::of(&boot),
        create: create_tally,
        delete: delete_tally,
        remote_tally,
        remote_records,
        proxy_restart,
        agent_restart,
        idle: idle_tally,
        idle_seconds,
        rss_empty,
        rss_own,
        rss_remote,
        proxy_cpu,
        applied,
    };
    let mut body = figures.report(&selectors);
    println!("fleet: tearing down");
    drop(nodes);
    drop(fleet);
    body.push('\n');
    if !quick {
        // A real kube-apiserver takes tens of seconds to start: not for the quick run's two-minute budget.
        body.push_str(&real_sizes());
    }
    body.push_str(&load::note(&load_start, &Load::sample()));
    Section { name: "fleet", title: format!("Fleet: {NODES} nodes × {per_node} pods on one API server"), body }
}

/// One pod's objects through the lifecycle the bench plays (stored by the scheduler, annotated by the agent,
/// Running with an IP from the kubelet, then deleted gracefully), as the server answers each step: the size of
/// the object a watcher is sent at each step. `call(method, path, body)` answers `(status, body)`.
fn lifecycle_sizes(mut call: impl FnMut(&str, &str, &str) -> (u16, String)) -> Vec<usize> {
    let path = format!("/api/v1/namespaces/{NS}/pods");
    let mut pod = ambient_pod(NS, "sized");
    pod["spec"]["nodeName"] = json!("node-1");
    let mut sizes = Vec::new();
    let mut step = |method: &str, path: &str, body: &serde_json::Value| {
        let (status, answer) = call(method, path, &body.to_string());
        assert!((200..300).contains(&status), "{method} {path}: {status} {answer}");
        sizes.push(answer.len());
        serde_json::from_str::<serde_json::Value>(&answer).expect("a JSON object")
    };
    let mut stored = step("POST", &path, &pod);
    stored["metadata"]["annotations"] = json!({ names::AMBIENT_REDIRECTION: names::AMBIENT_REDIRECTION_ENABLED });
    let mut stored = step("PUT", &format!("{path}/sized/status"), &stored);
    stored["status"]["phase"] = json!("Running");
    stored["status"]["podIP"] = json!("10.239.0.1");
    stored["status"]["podIPs"] = json!([{ "ip": "10.239.0.1" }]);
    step("PUT", &format!("{path}/sized/status"), &stored);
    step("DELETE", &format!("{path}/sized"), &json!({}));
    sizes
}

/// The same pod's lifecycle on the fake and on a real kube-apiserver 1.34 (with its default admission plugins
/// and `managedFields`), when its binaries are built: how much larger a real server's pod objects are.
fn real_sizes() -> String {
    let Some(real) = testbed::real_apiserver::RealApiServer::start() else {
        return "A real kube-apiserver was not available (`scripts/real-node/build.sh` not run): the pod sizes of \
                a real server were not measured.\n"
            .to_owned();
    };
    let admin = Some(testbed::real_apiserver::ADMIN_TOKEN);
    let call = |method: &str, path: &str, body: &str| real.request(method, path, admin, body).expect("real apiserver");
    let namespace_object = namespace(NS, json!({})).to_string();
    assert!((200..300).contains(&call("POST", "/api/v1/namespaces", &namespace_object).0), "namespace created");
    let account = json!({ "apiVersion": "v1", "kind": "ServiceAccount", "metadata": { "name": "default" } });
    let _ = call("POST", &format!("/api/v1/namespaces/{NS}/serviceaccounts"), &account.to_string());
    let real_sizes = lifecycle_sizes(call);
    let fake = fake_apiserver::FakeApiServer::start().expect("a fake API server");
    fake.upsert(namespace(NS, json!({}))).expect("store namespace");
    let url = fake.url();
    let fake_sizes = lifecycle_sizes(|method, path, body| {
        let (status, answer) = fake_request(&url, method, path, body);
        (status, answer)
    });
    let list = |sizes: &[usize]| sizes.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(" / ");
    let (r, f) = (real_sizes.iter().sum::<usize>() as f64, fake_sizes.iter().sum::<usize>() as f64);
    format!(
        "Pod object sizes, one pod through the bench's lifecycle (created with `spec.nodeName`, annotated, Running \
         with an IP, deleted), each step's answer in bytes: fake {}; a real kube-apiserver 1.34 \
         (`testbed::real_apiserver`: default admission plugins, `managedFields`) {}: the real server's objects are \
         {:.1}× the fake's for the same pod. A kubelet-run pod is larger still (conditions, container statuses, \
         more managers).\n",
        list(&fake_sizes),
        list(&real_sizes),
        r / f.max(1.0)
    )
}

/// One plain-http request to the lenient fake at `url`: `(status, body)`.
fn fake_request(url: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let addr = url.trim_start_matches("http://");
    let mut stream = std::net::TcpStream::connect(addr).expect("connect to the fake");
    let head = format!(
        "{method} {path} HTTP/1.0\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).and_then(|()| stream.write_all(body.as_bytes())).expect("send to the fake");
    let mut raw = String::new();
    stream.read_to_string(&mut raw).expect("read the fake's answer");
    let (head, body) = raw.split_once("\r\n\r\n").expect("a header end");
    let status = head.split(' ').nth(1).and_then(|s| s.parse().ok()).expect("a status");
    (status, body.to_owned())
}

/// The field selector and timeout of every pod list and watch, per component (from the request log).
fn watch_selectors(fleet: &Fleet) -> Vec<String> {
    let cni = User::service_account(chart::NAMESPACE, chart::CNI_SERVICE_ACCOUNT).name;
    let proxy = User::service_account(chart::NAMESPACE, chart::PROXY_SERVICE_ACCOUNT).name;
    let mut seen = BTreeMap::<(String, String, String, String), usize>::new();
    for r in fleet.api.requests() {
        if !r.path.ends_with("/pods") || !(r.verb == "list" || r.verb == "watch") {
            continue;
        }
        let who = if r.user == proxy {
            "hbone-proxy"
        } else if r.user == cni {
            "node-agent"
        } else {
            continue;
        };
        let field = r.param("fieldSelector").unwrap_or_else(|| "(none)".to_owned());
        // Node names differ per agent: one row for all of them.
        let field =
            field.split_once("spec.nodeName=").map_or(field.clone(), |(a, _)| format!("{a}spec.nodeName=<its node>"));
        let timeout = r.param("timeoutSeconds").unwrap_or_else(|| "(none)".to_owned());
        *seen.entry((who.to_owned(), r.verb.clone(), field, timeout)).or_default() += 1;
    }
    seen.into_iter()
        .map(|((who, verb, field, timeout), n)| format!("| {who} | {verb} | `{field}` | {timeout} | {n} |"))
        .collect()
}

/// Everything the run measured.
struct Figures {
    per_node: usize,
    enrolled: usize,
    remote: usize,
    boot: Tally,
    create: Tally,
    delete: Tally,
    remote_tally: Tally,
    remote_records: Vec<TrafficRecord>,
    proxy_restart: Tally,
    agent_restart: Tally,
    idle: Tally,
    idle_seconds: f64,
    /// (agent, proxy) average RSS in KiB.
    rss_empty: (f64, f64),
    rss_own: (f64, f64),
    rss_remote: (f64, f64),
    /// Mean CPU seconds a proxy used while the other nodes' pods arrived one event each, less the bench's
    /// `/config_dump` reads (each counted at its cost with every pod listed, so this errs low).
    proxy_cpu: f64,
    /// From the first stored pod until every proxy listed them all.
    applied: Duration,
}

impl Figures {
    fn report(&self, selectors: &[String]) -> String {
        let (nodes, per_node, enrolled, remote) = (NODES as f64, self.per_node, self.enrolled as f64, self.remote);
        let mut s = String::new();
        let _ = writeln!(
            s,
            "{NODES} simulated nodes (each its own netns, bridge and pod range, a real `node-agent` with its own \
             `NODE_NAME` and a real `hbone-proxy`) on one fake API server (strict: https, tokens, the chart's RBAC, \
             the real server's field selectors and watch timing; testbed's `Fleet`, a front end on each node's \
             loopback). **Real:** {per_node} ambient pods per node ({enrolled} in all) created through the real \
             CNI ADD (bridge + host-local + istio-cni), enrolled by their node's agent (annotation patched) and \
             adopted by their node's proxy; the bench plays the scheduler and kubelet on the server directly \
             (Pod stored with `spec.nodeName`, then `status.podIP` once ADD returned; deletion as \
             `Cluster::delete_pod`: graceful DELETE, CNI DEL, final DELETE), so none of that is counted as a \
             component's traffic. **Simulated:** {remote} pods of {} other nodes, stored as their agents and \
             kubelets would have left them (`spec.nodeName`, Running with a `podIP`, \
             `ambient.istio.io/redirection: enabled`), with no agent or proxy behind them. Every figure is what \
             the server counted per client (`fake_apiserver::TrafficRecord`: requests answered, objects sent as \
             list items or watch ADDED/MODIFIED/DELETED events, response body bytes without TLS or headers), \
             summed over the {NODES} nodes and divided as each table says; the plugin is told apart from the \
             agent (both run as `istio-cni`) by the front end its kubeconfig names. RSS from `/proc/<pid>/status`, \
             the mean over the nodes.\n",
            remote.div_ceil(REMOTE_PODS_PER_NODE)
        );

        let _ = writeln!(s, "### Pod list and watch requests, from the request log\n");
        let _ = writeln!(s, "| component | verb | fieldSelector | timeoutSeconds | requests |\n|---|---|---|---|---:|");
        for row in selectors {
            let _ = writeln!(s, "{row}");
        }
        let agent_unscoped = selectors.iter().any(|r| r.starts_with("| node-agent |") && !r.contains("spec.nodeName"));
        let agent_remote = self.remote_tally.sum(Component::Agent, |_, res| res == "pods");
        let _ = writeln!(
            s,
            "\nThe agent's pod list and watch are {} by `spec.nodeName`; while the {remote} other nodes' pods were \
             stored its agents were sent {} pod objects ({} bytes) in all.\n",
            if agent_unscoped { "NOT all scoped" } else { "all scoped" },
            agent_remote.objects,
            agent_remote.bytes
        );

        let _ = writeln!(s, "### Start: {NODES} nodes, per node\n");
        s.push_str(&self.boot.table(nodes, "per node"));
        let _ = writeln!(s, "\n### Enrolling a pod (ADD, annotation, status): per pod created, fleet-wide\n");
        s.push_str(&self.create.table(enrolled, "per pod"));
        let _ =
            writeln!(s, "\n### Deleting a pod (graceful DELETE, CNI DEL, final DELETE): per pod deleted, fleet-wide\n");
        s.push_str(&self.delete.table(enrolled, "per pod"));
        let _ = writeln!(s, "\n### Other nodes' pods: per stored pod, fleet-wide\n");
        s.push_str(&self.remote_tally.table(remote as f64, "per pod"));
        let per_proxy = per_front_end(&self.remote_records, Component::Proxy);
        let _ = writeln!(
            s,
            "\nEach proxy was sent {per_proxy}. Until every proxy listed them all: {:.1} s; each proxy used {:.1} s \
             of CPU meanwhile, less the bench's own `/config_dump` reads ({:.2} ms per event, while it held {} to \
             {} pods).\n",
            self.applied.as_secs_f64(),
            self.proxy_cpu,
            self.proxy_cpu * 1e3 / remote as f64,
            self.enrolled,
            self.enrolled + remote
        );
        let _ =
            writeln!(s, "### Restarts on node-1, after the deletions, with the {remote} other nodes' pods stored\n");
        let _ = writeln!(s, "hbone-proxy killed and started again, until it lists every pod:\n");
        s.push_str(&self.proxy_restart.table(1.0, "per restart"));
        let _ = writeln!(s, "\nnode-agent SIGKILLed and started again, until ready (its caches synced):\n");
        s.push_str(&self.agent_restart.table(1.0, "per restart"));
        let _ = writeln!(s, "\n### Idle: {:.0} s with nothing changing, per node per hour\n", self.idle_seconds);
        s.push_str(&self.idle.table(nodes * self.idle_seconds / 3600.0, "per node-hour"));

        let kib = |v: f64| format!("{v:.0} KiB");
        let per = |a: f64, b: f64, n: f64| format!("{:.0} B", (b - a) * 1024.0 / n);
        let _ = writeln!(s, "\n### Memory (mean over the {NODES} nodes)\n");
        let _ = writeln!(s, "| state | node-agent RSS | hbone-proxy RSS |\n|---|---:|---:|");
        let _ = writeln!(s, "| started, no pods | {} | {} |", kib(self.rss_empty.0), kib(self.rss_empty.1));
        let _ = writeln!(
            s,
            "| {per_node} own pods ({enrolled} in the cluster) | {} | {} |",
            kib(self.rss_own.0),
            kib(self.rss_own.1)
        );
        let _ =
            writeln!(s, "| and {remote} other nodes' pods | {} | {} |", kib(self.rss_remote.0), kib(self.rss_remote.1));
        let _ = writeln!(
            s,
            "| per own pod | {} | {} |",
            per(self.rss_empty.0, self.rss_own.0, per_node as f64),
            per(self.rss_empty.1, self.rss_own.1, per_node as f64)
        );
        let _ = writeln!(
            s,
            "| per other node's pod | {} | {} |",
            per(self.rss_own.0, self.rss_remote.0, remote as f64),
            per(self.rss_own.1, self.rss_remote.1, remote as f64)
        );
        s.push('\n');
        s.push_str(&self.model());
        s
    }

    /// The model for [`MODEL_NODES`] × [`MODEL_PODS_PER_NODE`] from this run's figures (docs/fleet.md).
    fn model(&self) -> String {
        let (n, p) = (MODEL_NODES, MODEL_PODS_PER_NODE);
        let pods = n * p;
        let enrolled = self.enrolled as f64;
        let nodes = NODES as f64;
        // Per pod lifecycle (created and deleted), fleet-wide in the run.
        let lifecycle = |c: Component| {
            let (a, b) = (self.create.component(c), self.delete.component(c));
            (a.requests + b.requests) as f64 / enrolled
        };
        let watch_events = |c: Component| {
            let (a, b) = (self.create.watch_events(c), self.delete.watch_events(c));
            (a.objects + b.objects) as f64 / enrolled
        };
        let watch_bytes = |c: Component| {
            let (a, b) = (self.create.watch_events(c), self.delete.watch_events(c));
            (a.bytes + b.bytes) as f64 / (a.objects + b.objects).max(1) as f64
        };
        let non_watch = |c: Component| {
            let t = |tally: &Tally| tally.sum(c, |verb, _| verb != "watch").requests;
            (t(&self.create) + t(&self.delete)) as f64 / enrolled
        };
        // Every proxy receives every pod's events: per proxy per pod lifecycle.
        let proxy_events_per_pod = watch_events(Component::Proxy) / nodes;
        let agent_events_per_pod = watch_events(Component::Agent);
        let event_bytes = watch_bytes(Component::Proxy);
        let agent_requests_per_pod = non_watch(Component::Agent);
        let plugin_requests_per_pod = lifecycle(Component::Plugin);
        let agent_watches = self.boot.sum(Component::Agent, |verb, _| verb == "watch").requests as f64 / nodes;
        let proxy_watches = self.boot.sum(Component::Proxy, |verb, _| verb == "watch").requests as f64 / nodes;
        let proxy_bytes_per_remote_pod = (self.rss_remote.1 - self.rss_own.1) * 1024.0 / self.remote as f64;
        let agent_bytes_per_own_pod = (self.rss_own.0 - self.rss_empty.0) * 1024.0 / self.per_node as f64;
        // CPU per event: each pod event changes that pod's directory entry alone, so it does not depend on the
        // pods held. The clock counts 10 ms ticks per proxy: below that, the figure is the bound.
        let tick = 0.01 / nodes;
        let cpu_per_event = self.proxy_cpu.max(tick) / self.remote as f64;
        let cpu_bound = if self.proxy_cpu < tick { " at most (below the clock's 10 ms ticks)" } else { "" };
        let relist_bytes_per_pod = {
            let list = self.proxy_restart.sum(Component::Proxy, |verb, res| verb == "list" && res == "pods");
            list.bytes as f64 / list.objects.max(1) as f64
        };

        let mut s = String::new();
        let _ = writeln!(
            s,
            "### Model: {n:.0} nodes × {p:.0} pods ({pods:.0} pods)\n\n\
             From the figures above (docs/fleet.md derives each formula). N = {n:.0} nodes, p = {p:.0} pods per \
             node, P = N·p = {pods:.0}; c = pods created (and as many deleted) per second, cluster-wide: \
             **steady** c = P / 86,400 = {:.1}/s (every pod replaced once a day), **rollout** c = 100/s. A pod \
             object is {event_bytes:.0} B here, {REAL_POD_BYTES:.0} B (assumed, a real pod with managedFields and \
             status) on a real server; byte rows give both.\n",
            pods / 86_400.0
        );
        let _ = writeln!(
            s,
            "Measured inputs: each proxy receives e_x = {} watch events per pod lifecycle (any node's pod), each \
             agent e_a = {} (its own node's pods only); the agent makes r_a = {} non-watch requests and the \
             plugin r_c = {} per own pod; each agent keeps w_a = {} watches open, each proxy w_x = {}; a proxy \
             holds m_x = {proxy_bytes_per_remote_pod:.0} B per pod of the cluster, an agent m_a = \
             {agent_bytes_per_own_pod:.0} B per own pod; a proxy's relist costs {relist_bytes_per_pod:.0} B per \
             pod here; a proxy spends k = {:.2} µs of CPU per pod event{cpu_bound} (each event changes that \
             pod's directory entry alone, whatever the pods held).\n",
            num(proxy_events_per_pod),
            num(agent_events_per_pod),
            num(agent_requests_per_pod),
            num(plugin_requests_per_pod),
            num(agent_watches),
            num(proxy_watches),
            cpu_per_event * 1e6,
        );
        let _ = writeln!(
            s,
            "| component | figure | formula | steady | rollout | grows with |\n|---|---|---|---:|---:|---|"
        );
        let steady = pods / 86_400.0;
        let rollout = 100.0;
        let mut row = |component: &str, figure: &str, formula: &str, f: &dyn Fn(f64) -> String, grows: &str| {
            let _ = writeln!(s, "| {component} | {figure} | {formula} | {} | {} | {grows} |", f(steady), f(rollout));
        };
        let agent_req = |c: f64| si(c * agent_requests_per_pod + n * agent_watches / WATCH_SECONDS, "req/s");
        row("node-agents (all)", "requests/s", "c·r_a + N·w_a/290", &agent_req, "own pods (c), nodes (N)");
        let plugin_req = |c: f64| si(c * plugin_requests_per_pod, "req/s");
        row("istio-cni plugins (all)", "requests/s", "c·r_c", &plugin_req, "own pods");
        let agent_ev = |c: f64| si(c * agent_events_per_pod, "events/s");
        row("node-agents (all)", "watch events/s", "c·e_a", &agent_ev, "own pods");
        let agent_b = |c: f64| {
            format!(
                "{} ({})",
                si(c * agent_events_per_pod * event_bytes, "B/s"),
                si(c * agent_events_per_pod * REAL_POD_BYTES, "B/s")
            )
        };
        row("node-agents (all)", "watch bytes/s (fake pods; real pods)", "c·e_a·S", &agent_b, "own pods");
        let proxy_req = |_: f64| si(n * proxy_watches / WATCH_SECONDS, "req/s");
        row("hbone-proxies (all)", "requests/s", "N·w_x/290", &proxy_req, "nodes");
        let proxy_ev = |c: f64| si(c * proxy_events_per_pod * n, "events/s");
        row("hbone-proxies (all)", "watch events/s", "c·e_x·N", &proxy_ev, "**whole cluster × nodes**");
        let proxy_b = |c: f64| {
            format!(
                "{} ({})",
                si(c * proxy_events_per_pod * n * event_bytes, "B/s"),
                si(c * proxy_events_per_pod * n * REAL_POD_BYTES, "B/s")
            )
        };
        row(
            "hbone-proxies (all)",
            "watch bytes/s (fake pods; real pods)",
            "c·e_x·N·S",
            &proxy_b,
            "**whole cluster × nodes**",
        );
        let proxy_mem = |_: f64| si(pods * proxy_bytes_per_remote_pod, "B");
        row("hbone-proxy (each)", "memory for the cluster's pods", "P·m_x", &proxy_mem, "**whole cluster**");
        let proxy_cpu = |c: f64| format!("{:.3} cores", c * proxy_events_per_pod * cpu_per_event);
        row(
            "hbone-proxy (each)",
            "CPU applying the cluster's pod events",
            "c·e_x·k",
            &proxy_cpu,
            "**whole cluster** (its churn)",
        );
        let agent_mem = |_: f64| si(p * agent_bytes_per_own_pod, "B");
        row("node-agent (each)", "memory for its pods", "p·m_a", &agent_mem, "own pods");
        let relist = |_: f64| format!("{} ({})", si(pods * relist_bytes_per_pod, "B"), si(pods * REAL_POD_BYTES, "B"));
        row("hbone-proxy (each)", "one restart's relist (fake; real)", "P·S", &relist, "**whole cluster**");
        let rollout_relist =
            |_: f64| format!("{} ({})", si(n * pods * relist_bytes_per_pod, "B"), si(n * pods * REAL_POD_BYTES, "B"));
        row(
            "hbone-proxies (all)",
            "a proxy DaemonSet rollout, all relists (fake; real)",
            "N·P·S",
            &rollout_relist,
            "**whole cluster × nodes**",
        );
        s
    }
}

/// What each front end's `component` was sent, as "min–max objects (bytes)" over the nodes.
fn per_front_end(records: &[TrafficRecord], component: Component) -> String {
    let mut per = BTreeMap::<&str, (u64, u64)>::new();
    for r in records.iter().filter(|r| Component::of(r) == component) {
        let e = per.entry(&r.front_end).or_default();
        e.0 += r.objects;
        e.1 += r.bytes;
    }
    let objects = per.values().map(|v| v.0);
    let (lo, hi) = (objects.clone().min().unwrap_or(0), objects.max().unwrap_or(0));
    let bytes = per.values().map(|v| v.1);
    let (blo, bhi) = (bytes.clone().min().unwrap_or(0), bytes.max().unwrap_or(0));
    format!("{lo}–{hi} objects, {blo}–{bhi} bytes ({} front ends)", per.len())
}

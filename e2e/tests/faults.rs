//! Fault injection on the node side, with explicit expectations: the API server refusing, erroring or slow; the
//! node agent SIGKILLed while pods enroll; a netns that is gone by the time the agent programs it; the conf dir on
//! a full disk; a repair (pod delete) the API refuses. Each test asserts what would break if data were lost, a pod
//! bypassed the mesh, or a file were corrupted. Real binaries, real netns, the fake API server's injected faults.
//!
//! Covered elsewhere: the plugin failing closed (code 11) with the API down (`plugin_sidecar.rs::
//! add_fails_closed_with_code_11_when_the_api_server_is_down`), a ZDS client sending garbage to the agent
//! (`ambient_lifecycle.rs::misbehaving_proxies_are_dropped_with_a_logged_error_and_the_agent_keeps_serving`), the
//! proxy killed under load and garbage from the agent's side (`e2e/tests/proxy_faults.rs`).

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::Ipv4Addr;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use fake_apiserver::{Fault, RequestRecord};
use istio_contract::{names, ports};
use serde_json::{json, Value};
use testbed::chart;
use testbed::install_cni::Installer;
use testbed::mesh::RuleBackend;
use testbed::node_agent::{
    ambient_conflist, ambient_node, ambient_pod, crash_looping_pod, namespace, netns_id, redirection, uid, NodeAgent,
    RequestKind, ZdsPeer, CONNMARK_RULE, VALIDATION_CONTAINER,
};
use testbed::pod_process::PodProcess;
use testbed::runtime::RuntimeError;
use testbed::wait::{eventually, eventually_or, within};
use testbed::{Cluster, NetnsGuard, Pod};

/// Namespace whose pods opt in by their own label.
const NS: &str = "shop";
/// How long the agent may take to catch up after the API returns: the watch back-off's 30 s cap, a relist, slack.
const CATCH_UP: Duration = Duration::from_secs(60);
fn setup() -> (Cluster, NodeAgent) {
    ambient_node(RuleBackend::Nftables, NS, &[])
}

/// CNI ADD of the stored pod `name` with the ambient conflist.
fn add(cluster: &Cluster, name: &str) -> Result<Pod, RuntimeError> {
    cluster.add_with(ambient_conflist(cluster), name, NS)
}

/// Stores `pod` and creates it through the runtime (ADD must succeed).
#[track_caller]
fn run(cluster: &Cluster, pod: &Value) -> Pod {
    cluster.create(pod);
    let name = pod["metadata"]["name"].as_str().unwrap();
    add(cluster, name).unwrap_or_else(|e| panic!("CNI ADD of {NS}/{name} failed: {e}"))
}

/// The in-pod nftables tables and policy routing rules of `ns`.
fn inpod_rules(ns: &NetnsGuard) -> String {
    ns.exec_ok(&["sh", "-c", "nft list ruleset; ip rule show"])
}

fn has_inpod_rules(ns: &NetnsGuard) -> bool {
    let rules = inpod_rules(ns);
    rules.contains("istio-ambient") && rules.contains(CONNMARK_RULE)
}

fn pod_status(ip: Ipv4Addr) -> Value {
    json!({ "phase": "Running", "podIP": ip.to_string(), "podIPs": [{ "ip": ip.to_string() }] })
}

/// Records the pod's IP in its status, as the kubelet does once the sandbox is up.
fn set_pod_ip(cluster: &Cluster, name: &str, ip: Ipv4Addr) {
    let mut pod = cluster.api.get("Pod", Some(NS), name).unwrap_or_else(|| panic!("no pod {NS}/{name}"));
    pod["status"] = pod_status(ip);
    cluster.api.upsert(pod).expect("store pod status");
}

static UIDS: AtomicUsize = AtomicUsize::new(0);

/// A pod that was already running when its Pod object appeared: a netns holding `ip`, a process in a cgroup
/// naming a fresh UID. The agent's watcher finds it through `/proc`.
struct RunningPod {
    name: String,
    uid: String,
    netns: NetnsGuard,
    _process: PodProcess,
}

impl RunningPod {
    fn start(name: &str, ip: Ipv4Addr) -> Self {
        let netns = NetnsGuard::new("fpod");
        netns.exec_ok(&["ip", "addr", "add", &format!("{ip}/32"), "dev", "lo"]);
        let n = UIDS.fetch_add(1, Ordering::Relaxed);
        let uid = format!("{:08x}-0000-4000-9000-{n:012x}", std::process::id());
        let process = PodProcess::start(&netns, &uid);
        Self { name: name.to_owned(), uid, netns, _process: process }
    }

    /// The Pod object: ambient label, this UID and IP.
    fn object(&self, ip: Ipv4Addr) -> Value {
        let mut pod = ambient_pod(NS, &self.name);
        pod["metadata"]["uid"] = json!(self.uid);
        pod["status"] = pod_status(ip);
        pod
    }
}

/// A free address in the node's pod subnet, above the range host-local hands out in these tests.
fn spare_ip(cluster: &Cluster, n: u8) -> Ipv4Addr {
    let base = cluster.node.gateway().octets();
    Ipv4Addr::new(base[0], base[1], base[2], 200 + n)
}

/// The TCP connections opened to the API server from the node's netns (where the agent runs), counted by an
/// nftables rule on their SYNs: what an API server that closes every connection at accept sees of a client.
struct ApiConnections<'a>(&'a NetnsGuard);

impl<'a> ApiConnections<'a> {
    const TABLE: &'static str = "e2e-api-connections";

    fn count(c: &'a Cluster) -> Self {
        let ns = c.node.netns();
        ns.exec_ok(&["nft", "add", "table", "inet", Self::TABLE]);
        ns.exec_ok(&["nft", "add", "chain", "inet", Self::TABLE, "out", "{ type filter hook output priority 0; }"]);
        let port = c.api.addr().port().to_string();
        let rule = ["tcp", "dport", &port, "tcp", "flags", "&", "(syn|ack)", "==", "syn", "counter"];
        ns.exec_ok(&[&["nft", "add", "rule", "inet", Self::TABLE, "out"][..], &rule[..]].concat());
        Self(ns)
    }

    /// Connections opened so far.
    fn opened(&self) -> usize {
        let chain = self.0.exec_ok(&["nft", "list", "chain", "inet", Self::TABLE, "out"]);
        let packets = chain.split_once("counter packets ").and_then(|(_, rest)| rest.split_whitespace().next());
        packets.and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("no counter in {chain}"))
    }
}

/// How many of the agent's watch attempts (a LIST or a WATCH) failed at the API server under `fault`, as the
/// server saw them: requests answered with the injected status; when it refuses connections, the requests it
/// read on connections already open and dropped unanswered (status 0), plus the new connections, which it
/// closes right after accept, before any request is read.
fn failed_attempts(c: &Cluster, connections: &ApiConnections, fault: &Fault) -> usize {
    let answered = |status: u16| {
        let failed = |r: &RequestRecord| r.status == status && (r.verb == "list" || r.verb == "watch");
        c.api.requests().iter().filter(|r| failed(r)).count()
    };
    match fault {
        Fault::Status(code) => answered(*code),
        Fault::Refuse => answered(0) + connections.opened(),
        Fault::Delay(_) => unreachable!("a slow API fails nothing"),
    }
}

#[test]
fn the_agent_rides_out_an_api_server_that_refuses_errors_or_is_slow_and_catches_up_when_it_returns() {
    let (c, agent) = setup();
    let peer = ZdsPeer::connect(&agent);
    let before = run(&c, &ambient_pod(NS, "before"));
    let before_uid = uid(&c, NS, "before");

    let connections = ApiConnections::count(&c);
    let faults = [("refused", Fault::Refuse), ("500", Fault::Status(500)), ("403", Fault::Status(403))];
    let mut running = Vec::new();
    for (n, (what, fault)) in faults.into_iter().enumerate() {
        let failed_so_far = || failed_attempts(&c, &connections, &fault);
        let failed_before = failed_so_far();
        // The API goes away: its open watches end and every new request meets the fault.
        let down = Instant::now();
        c.api.set_fault(Some(fault.clone()));
        c.api.drop_watches();
        // The first outage lasts a few failed rounds of the agent's watches, to see the agent back off.
        let rounds = if n == 0 { 6 } else { 1 };
        let failed = eventually_or(
            &format!("the API sees {rounds} failed attempts of the agent's watches against the {what} API"),
            || Some(failed_so_far().saturating_sub(failed_before)).filter(|f| *f >= rounds),
            || format!("{:#?}\n{}", c.api.requests(), agent.log()),
        );
        let rate = failed as f64 / down.elapsed().as_secs_f64();
        assert!(
            rounds == 1 || rate < 10.0,
            "API {what}: {failed} failed watches in {:?}: the agent hammers the API instead of backing off",
            down.elapsed()
        );
        // A pod enrolled through the plugin cannot start while the API is away: ADD fails closed.
        c.create(&ambient_pod(NS, &format!("during-{n}")));
        match add(&c, &format!("during-{n}")) {
            Err(RuntimeError::Plugin(e)) => assert_eq!(e.code, Some(11), "API {what}: {e:?}"),
            Err(other) => panic!("API {what}: expected the plugin's error, got {other}"),
            Ok(pod) => panic!("API {what}: ADD succeeded without the API; pod got {}", pod.ip),
        }
        // A running pod labelled meanwhile: the agent cannot see it yet.
        let pod = RunningPod::start(&format!("running-{n}"), spare_ip(&c, n as u8));
        c.create(&pod.object(spare_ip(&c, n as u8)));
        assert_eq!(agent.probes(), (Some(200), Some(200)), "API {what}: the agent keeps serving its probes");
        assert!(has_inpod_rules(&before.netns), "API {what}: an enrolled pod lost its rules");

        c.api.set_fault(None);
        // The watches retry with kube's back-off (0.8 s doubling to 30 s, as client-go's reflector): after a long
        // outage the next try may be up to 30 s away, and a compacted history then costs a relist.
        let add = within(Instant::now(), CATCH_UP, || peer.received_for(RequestKind::Add, &pod.uid).pop())
            .unwrap_or_else(|| {
                panic!("API {what}: the running pod was not enrolled within {CATCH_UP:?} of recovery\n{}", agent.log())
            });
        assert_eq!(add.fds, vec![netns_id(&pod.netns)], "API {what}: the Add carries the running pod's netns");
        eventually(&format!("API {what}: the running pod is annotated"), || {
            (redirection(&c, NS, &pod.name).as_deref() == Some("enabled")).then_some(())
        });
        assert!(has_inpod_rules(&pod.netns), "API {what}: the running pod has no rules");
        running.push(pod);
    }
    assert!(peer.received_for(RequestKind::Del, &before_uid).is_empty(), "an outage removed a pod: {:?}", {
        peer.received()
    });

    // A slow API: every request takes 300 ms; ADD still completes with the pod fully enrolled.
    c.api.set_fault(Some(Fault::Delay(Duration::from_millis(300))));
    let slow = run(&c, &ambient_pod(NS, "slow"));
    c.api.set_fault(None);
    let adds = peer.received_for(RequestKind::Add, &uid(&c, NS, "slow"));
    assert_eq!(adds.iter().map(|a| a.fds.clone()).collect::<Vec<_>>(), vec![vec![netns_id(&slow.netns)]]);
    assert_eq!(redirection(&c, NS, "slow").as_deref(), Some("enabled"));
    assert!(has_inpod_rules(&slow.netns));
}

#[test]
fn a_repair_the_api_refuses_is_counted_and_retried_on_the_pods_next_update() {
    let (c, agent) = ambient_node(RuleBackend::Nftables, NS, &[("REPAIR_DELETE_PODS", "true")]);
    // Ready means the agent has listed; its watches open just after. Only open watches keep streaming under the
    // fault, so wait for them.
    eventually_or(
        "the agent's pod and namespace watches are open",
        || (c.api.open_watches("pods") == 1 && c.api.open_watches("namespaces") == 1).then_some(()),
        || agent.log(),
    );
    // Open watches keep streaming; every new request, the repair's DELETE included, gets a 500.
    c.api.set_fault(Some(Fault::Status(500)));
    c.api.upsert(crash_looping_pod(NS, "broken", "node-1", VALIDATION_CONTAINER, 126, true)).expect("store pod");
    let broken = format!("/api/v1/namespaces/{NS}/pods/broken");
    let events = format!("/api/v1/namespaces/{NS}/events");
    let answered = |method: &str, path: &str| -> Vec<u16> {
        let requests = c.api.requests();
        requests.iter().filter(|r| r.method == method && r.path == path).map(|r| r.status).collect()
    };
    eventually_or(
        "the API answers the repair's delete with the 500",
        || answered("DELETE", &broken).contains(&500).then_some(()),
        || format!("{:#?}\n{}", c.api.requests(), agent.log()),
    );
    // Its Event (DeleteBrokenPod) got the 500 too, and the repair goes on.
    eventually_or(
        "the API answers the repair's Event with the 500",
        || answered("POST", &events).contains(&500).then_some(()),
        || format!("{:#?}\n{}", c.api.requests(), agent.log()),
    );
    c.api.set_fault(None);
    assert!(c.api.get("Pod", Some(NS), "broken").is_some());
    assert_eq!(agent.probes(), (Some(200), Some(200)), "the agent keeps running");
    let deleted = "istio_cni_repair_pods_repaired_total{type=\"delete\",result=\"success\"}";
    let failed = "istio_cni_repair_pods_repaired_total{type=\"delete\",result=\"fail\"}";
    assert_eq!(agent.metric(deleted), None, "a failed delete is not counted as done");
    eventually("the failed delete is counted as Istio counts it", || (agent.metric(failed) == Some(1)).then_some(()));

    // The kubelet records the next failed attempt: that update brings the retry.
    let mut pod = c.api.get("Pod", Some(NS), "broken").expect("broken pod stored");
    pod["status"]["initContainerStatuses"][0]["restartCount"] = json!(3);
    c.api.upsert(pod).expect("store status update");
    // The API server deletes gracefully: the pod is terminating (its kubelet stops it, then deletes it for good).
    eventually_or(
        "the retried delete succeeds (the pod is terminating)",
        || {
            let pod = c.api.get("Pod", Some(NS), "broken")?;
            pod["metadata"]["deletionTimestamp"].is_string().then_some(())
        },
        || agent.log(),
    );
    eventually("the delete is counted once", || (agent.metric(deleted) == Some(1)).then_some(()));
    assert_eq!(agent.metric(failed), Some(1), "{}", agent.metrics());
    // Two attempts in all: the refused one and its one retry, which the API granted to the agent.
    let agents = fake_apiserver::User::service_account(chart::NAMESPACE, chart::CNI_SERVICE_ACCOUNT).name;
    let deletes = eventually("the retried delete is answered", || {
        let requests = c.api.requests();
        let deletes: Vec<_> = requests.into_iter().filter(|r| r.method == "DELETE" && r.path == broken).collect();
        deletes.iter().all(|r| r.status != 0).then_some(deletes)
    });
    let answers: Vec<(u16, &str)> = deletes.iter().map(|r| (r.status, r.user.as_str())).collect();
    assert!(
        matches!(answers[..], [(500, _), (ok, user)] if (200..300).contains(&ok) && user == agents),
        "the delete's attempts at the API: {answers:?}"
    );
    eventually("the retry's Event is written", || (answered("POST", &events).len() == 2).then_some(()));
}

#[test]
fn sigkill_while_20_pods_enroll_leaves_every_pod_fully_enrolled_after_the_restart() {
    const PODS: usize = 20;
    let (c, mut agent) = setup();
    let peer = ZdsPeer::connect(&agent);
    let names: Vec<String> = (0..PODS).map(|i| format!("pod-{i}")).collect();
    for name in &names {
        c.create(&ambient_pod(NS, name));
    }

    // All ADDs run at once; the agent is killed as soon as a few pods made it to the proxy.
    let (results, completed_at_kill) = std::thread::scope(|s| {
        let adds: Vec<_> = names.iter().map(|name| s.spawn(|| add(&c, name))).collect();
        eventually("a few pods reached the proxy", || (peer.received().len() >= 4).then_some(()));
        let completed = peer.received().iter().filter(|r| r.kind == RequestKind::Add).count();
        agent.kill();
        let results: Vec<Result<Pod, RuntimeError>> = adds.into_iter().map(|h| h.join().expect("ADD thread")).collect();
        (results, completed)
    });
    let (mut pods, failed): (BTreeMap<String, Pod>, Vec<String>) =
        names.iter().zip(results).fold((BTreeMap::new(), Vec::new()), |(mut ok, mut failed), (name, result)| {
            match result {
                Ok(pod) => drop(ok.insert(name.clone(), pod)),
                Err(_) => failed.push(name.clone()),
            }
            (ok, failed)
        });
    eprintln!("at the kill: {completed_at_kill} Adds acked; ADD ok: {}, failed: {}", pods.len(), failed.len());
    assert!(completed_at_kill < PODS, "the kill came after every pod was enrolled");
    assert!(!failed.is_empty(), "no ADD was in flight when the agent was killed");

    // The pods that started get their containers (what the restarted agent finds through /proc).
    let processes: Vec<PodProcess> = pods
        .iter()
        .map(|(name, pod)| {
            set_pod_ip(&c, name, pod.ip);
            PodProcess::start(&pod.netns, &uid(&c, NS, name))
        })
        .collect();
    let agent = NodeAgent::start(&c, &[]);
    let fresh = ZdsPeer::connect(&agent);
    // The kubelet retries the sandboxes whose ADD failed.
    let mut retried = Vec::new();
    for name in &failed {
        let pod = add(&c, name).unwrap_or_else(|e| panic!("retried ADD of {name} failed: {e}\n{}", agent.log()));
        set_pod_ip(&c, name, pod.ip);
        retried.push(PodProcess::start(&pod.netns, &uid(&c, NS, name)));
        pods.insert(name.clone(), pod);
    }

    for (name, pod) in &pods {
        let id = uid(&c, NS, name);
        let adds = fresh.received_for(RequestKind::Add, &id);
        assert_eq!(
            adds.last().map(|a| a.fds.clone()),
            Some(vec![netns_id(&pod.netns)]),
            "{name}: the proxy's last Add carries the pod's live netns: {:?}",
            fresh.received()
        );
        assert_eq!(redirection(&c, NS, name).as_deref(), Some("enabled"), "{name}: annotation");
        assert!(has_inpod_rules(&pod.netns), "{name}: no in-pod rules:\n{}", inpod_rules(&pod.netns));
    }
    let keeps: Vec<_> = fresh.received().into_iter().filter(|r| r.kind == RequestKind::Keep).collect();
    assert!(
        keeps.iter().all(|k| failed.iter().any(|name| uid(&c, NS, name) == k.uid)),
        "only pods whose sandbox died with the kill may be kept without a netns: {keeps:?}"
    );
    drop((processes, retried));
}

/// Sends `request` on a fresh connection to the agent's plugin event socket; returns the status and body.
fn plugin_event(socket: &Path, request: &[u8]) -> (u16, String) {
    let mut stream = UnixStream::connect(socket).expect("connect to pluginevent.sock");
    stream.set_read_timeout(Some(Duration::from_secs(10))).expect("read timeout");
    stream.write_all(request).expect("send request");
    let mut raw = Vec::new();
    let _ = stream.read_to_end(&mut raw);
    let raw = String::from_utf8_lossy(&raw).into_owned();
    let status = raw.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or_else(|| panic!("no status in {raw:?}"));
    let body = raw.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default();
    (status, body)
}

/// `POST /cmdadd` with the event the plugin would send for pod `name` in netns `netns`.
fn cmdadd(socket: &Path, name: &str, netns: &Path) -> (u16, String) {
    let body = json!({
        "Netns": netns, "PodName": name, "PodNamespace": NS,
        "IPs": [{ "address": "10.250.0.9/24", "gateway": "10.250.0.1" }],
    })
    .to_string();
    let request = format!(
        "POST /cmdadd HTTP/1.1\r\nHost: cni\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    );
    plugin_event(socket, request.as_bytes())
}

#[test]
fn a_pod_whose_netns_vanished_before_programming_fails_cleanly_and_its_retry_enrolls_it() {
    let (c, agent) = setup();
    let peer = ZdsPeer::connect(&agent);
    let socket = c.run_dir().join("pluginevent.sock");
    c.create(&ambient_pod(NS, "web"));

    // A netns deleted right after the runtime handed it over, a path that never was, and the netns of a
    // process that already exited.
    let gone = NetnsGuard::new("gone").path();
    assert!(!gone.exists(), "the guard removed the netns");
    let exited = {
        let mut child = Command::new("true").spawn().expect("spawn true");
        let path = PathBuf::from(format!("/proc/{}/ns/net", child.id()));
        child.wait().expect("reap true");
        path
    };
    for netns in [gone, PathBuf::from("/var/run/netns/never-existed"), exited] {
        let (status, body) = cmdadd(&socket, "web", &netns);
        assert_eq!(status, 500, "{}: {body}", netns.display());
        assert!(body.contains("netns"), "{}: the answer names the netns: {body}", netns.display());
    }
    assert!(peer.received_for(RequestKind::Add, &uid(&c, NS, "web")).is_empty(), "{:?}", peer.received());
    assert_eq!(redirection(&c, NS, "web"), None, "no annotation (not even pending) for a pod never enrolled");
    assert_eq!(agent.probes(), (Some(200), Some(200)), "the agent stays healthy");
    assert!(agent.metrics().contains("istio_cni_plugin_requests_total{response_code=\"500\"} 3"));

    // The kubelet's retry with a fresh sandbox goes through as if nothing had happened.
    let web = add(&c, "web").unwrap_or_else(|e| panic!("retried ADD failed: {e}\n{}", agent.log()));
    let adds = peer.received_for(RequestKind::Add, &uid(&c, NS, "web"));
    assert_eq!(adds.iter().map(|a| a.fds.clone()).collect::<Vec<_>>(), vec![vec![netns_id(&web.netns)]]);
    assert_eq!(redirection(&c, NS, "web").as_deref(), Some("enabled"));
    assert!(has_inpod_rules(&web.netns));
}

#[test]
fn an_enrolled_pod_whose_netns_is_gone_at_restart_is_kept_then_re_enrolled_or_removed_cleanly() {
    let c = Cluster::with_backend(RuleBackend::Nftables);
    c.api.upsert(namespace(NS, json!({}))).expect("store namespace");
    // Two pods the previous agent enrolled, whose sandboxes died while no agent ran: no process, no netns.
    let mut ids = Vec::new();
    for (n, name) in ["web", "db"].into_iter().enumerate() {
        let mut pod = ambient_pod(NS, name);
        pod["metadata"]["annotations"] = json!({ names::AMBIENT_REDIRECTION: "enabled" });
        pod["status"] = pod_status(spare_ip(&c, n as u8));
        c.create(&pod);
        ids.push(uid(&c, NS, name));
    }
    let agent = NodeAgent::start(&c, &[("AMBIENT_RECONCILE_POD_RULES_ON_STARTUP", "true")]);
    let peer = ZdsPeer::connect(&agent);
    for (name, id) in ["web", "db"].iter().zip(&ids) {
        let keeps = peer.received_for(RequestKind::Keep, id);
        assert_eq!(keeps.len(), 1, "{name}: the proxy is told to keep what it has: {:?}", peer.received());
        assert!(peer.received_for(RequestKind::Add, id).is_empty(), "{name}: an Add without a netns");
    }
    assert_eq!(agent.probes(), (Some(200), Some(200)), "the agent is healthy and ready");
    // explain says why: the restore's /proc search found no netns.
    let path = format!("/debug/pods/{NS}/db");
    let (status, body) = testbed::http::get(&c.node.netns().path(), ports::CNI_ADMIN, &path).expect("admin port");
    assert_eq!(status, 200, "{body}");
    let r: Value = serde_json::from_str(&body).expect("the report is JSON");
    assert_eq!(r["timeline"]["source"], "restore", "{r:#}");
    let search = &r["timeline"]["phases"][0];
    assert_eq!(search["phase"], "netns", "{r:#}");
    let error = search["error"].as_str().unwrap_or_default();
    assert!(error.contains("netns not found through /proc") && error.contains("(Keep)"), "{r:#}");

    // web's sandbox is recreated: fully enrolled again. db is deleted: the proxy is told, nothing is left.
    let web = add(&c, "web").unwrap_or_else(|e| panic!("ADD of the recreated sandbox failed: {e}\n{}", agent.log()));
    let adds = peer.received_for(RequestKind::Add, &ids[0]);
    assert_eq!(adds.iter().map(|a| a.fds.clone()).collect::<Vec<_>>(), vec![vec![netns_id(&web.netns)]]);
    assert!(has_inpod_rules(&web.netns));
    assert_eq!(redirection(&c, NS, "web").as_deref(), Some("enabled"));
    c.delete_pod(NS, "db", None);
    eventually("the proxy is told db is gone", || {
        (!peer.received_for(RequestKind::Del, &ids[1]).is_empty()).then_some(())
    });
    let metric = eventually("enrolled pods gauge drops to 1", || {
        agent
            .metrics()
            .lines()
            .find(|l| l.starts_with("nodeagent_enrolled_pods "))
            .filter(|l| l.ends_with(" 1"))
            .map(String::from)
    });
    assert!(metric.ends_with(" 1"), "{metric}");
    assert_eq!(agent.probes(), (Some(200), Some(200)));
}

/// A tmpfs of `size` mounted over `dir`; lazily unmounted on drop, also when the test panics.
struct TmpfsGuard(PathBuf);

impl TmpfsGuard {
    fn mount(dir: &Path, size: &str) -> Self {
        let status = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size},mode=0755"), "tmpfs"])
            .arg(dir)
            .status()
            .expect("run mount");
        assert!(status.success(), "mount tmpfs on {}: {status}", dir.display());
        Self(dir.to_path_buf())
    }
}

impl Drop for TmpfsGuard {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// Fills the filesystem holding `dir` to the last byte with `dir/.filler`.
fn fill(dir: &Path) -> PathBuf {
    let path = dir.join(".filler");
    let mut file = std::fs::File::create(&path).expect("create filler");
    let chunk = [0u8; 512];
    loop {
        match file.write(&chunk) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => break,
            Err(e) => panic!("filling {}: {e}", dir.display()),
        }
    }
    // The last partial page.
    while file.write(&[0u8]).is_ok_and(|n| n == 1) {}
    path
}

fn plugin_types(path: &Path) -> Result<Vec<String>, String> {
    let bytes = std::fs::read(path).map_err(|e| e.to_string())?;
    let list: Value =
        serde_json::from_slice(&bytes).map_err(|e| format!("{e}: {:?}", String::from_utf8_lossy(&bytes)))?;
    let plugins = list["plugins"].as_array().ok_or_else(|| format!("no plugins in {list}"))?;
    Ok(plugins.iter().map(|p| p["type"].as_str().unwrap_or_default().to_owned()).collect())
}

#[test]
fn on_a_full_conf_dir_the_primary_conflist_stays_intact_and_install_cni_is_not_ready_until_space_returns() {
    let cluster = Cluster::new();
    let installer = Installer::new(&cluster);
    let _tmpfs = TmpfsGuard::mount(&installer.net_d, "64k");
    let primary = installer.net_d.join("10-bridge.conflist");
    let bridge_only = format!("{}\n", serde_json::to_string_pretty(&cluster.node.conflist(vec![])).unwrap());
    std::fs::write(&primary, &bridge_only).expect("write the primary");
    let run = installer.start();
    run.wait_readyz(200);
    assert_eq!(plugin_types(&primary), Ok(vec!["bridge".to_owned(), names::PLUGIN_TYPE.to_owned()]));

    // The disk fills up; then another writer rewrites the primary in place without our entry (truncating a
    // file frees its pages, so its shorter write fits).
    let filler = fill(&installer.net_d);
    std::fs::write(&primary, &bridge_only).expect("the rival's in-place rewrite fits");
    let reason = run.wait_readyz(503);
    assert!(reason.contains("No space left on device"), "/readyz names the cause: {reason}");
    run.until("the log names ENOSPC", || run.log().contains("No space left on device").then_some(()));
    assert_eq!(
        std::fs::read_to_string(&primary).expect("read the primary"),
        bridge_only,
        "the failed re-insert touched the primary"
    );
    let left: Vec<_> = std::fs::read_dir(&installer.net_d)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != ".filler" && n != "10-bridge.conflist")
        .collect();
    assert!(left.is_empty(), "the failed write left files behind: {left:?}");
    assert!(run.get(ports::CNI_READINESS, "/healthz").is_ok_and(|(s, _)| s == 200), "alive while not ready");

    std::fs::remove_file(&filler).expect("free the space");
    run.wait_readyz(200);
    assert_eq!(plugin_types(&primary), Ok(vec!["bridge".to_owned(), names::PLUGIN_TYPE.to_owned()]), "{}", run.log());
}

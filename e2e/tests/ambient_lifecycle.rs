//! Acceptance for the ambient node agent over time: pods that were already running when their namespace was
//! labelled (found through `/proc`, not the CNI path), restarts of the agent and of the node proxy, several
//! proxy connections, and misbehaving proxies. The real `node-agent` runs in the node netns against the fake API
//! server; running pods are real processes in real pod netns and kubelet-style cgroups. Also the repair
//! controller: sidecar pods crash-looping on `istio-validation` are repaired in place (their netns gets the
//! plugin's sidecar rules), deleted or labelled; other pods are left alone.

use std::collections::BTreeSet;
use std::fs::File;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use istio_contract::{names, ports};
use serde_json::{json, Value};
use testbed::chart;
use testbed::mesh::{annotate, plain_pod, sidecar_pod, RuleBackend};
use testbed::node_agent::{
    ambient_conflist, ambient_node, ambient_pod, namespace, netns_id, redirection, uid, NodeAgent, RequestKind,
    ZdsPeer, BROKEN_POD_LABEL, CONNMARK_RULE, VALIDATION_CONTAINER,
};
use testbed::pod_process::PodProcess;
use testbed::wait::{eventually, eventually_or};
use testbed::{Cluster, NetnsGuard, Pod};
use zds::messages::ZdsHello;
use zds::transport::SeqpacketConn;
use zds::ZdsError;

/// Namespace whose pods opt in by their own label.
const NS: &str = "shop";
/// The agent's count of `/proc` scans for running pods' netns.
const PROC_SCANS: &str = "nodeagent_proc_scans_total";
/// A cluster on native nftables with the `shop` namespace stored, and the agent running on its node.
fn setup() -> (Cluster, NodeAgent) {
    ambient_node(RuleBackend::Nftables, NS, &[])
}

/// Stores `pod` and creates it through the runtime with the ambient conflist (ADD must succeed).
#[track_caller]
fn run(cluster: &Cluster, pod: &Value) -> Pod {
    cluster.create(pod);
    let (ns, name) = (pod["metadata"]["namespace"].as_str().unwrap(), pod["metadata"]["name"].as_str().unwrap());
    cluster
        .node
        .try_add_pod_with(ambient_conflist(cluster), name, ns)
        .unwrap_or_else(|e| panic!("CNI ADD of {ns}/{name} failed: {e}"))
}

/// Records `ips` as the pod's `status.podIPs` (phase Running), as the kubelet does once the sandbox is up.
fn set_pod_ips(cluster: &Cluster, ns: &str, name: &str, ips: &[Ipv4Addr]) {
    let mut pod = cluster.api.get("Pod", Some(ns), name).unwrap_or_else(|| panic!("no pod {ns}/{name}"));
    pod["status"] = pod_status(ips);
    cluster.api.upsert(pod).expect("store pod status");
}

fn pod_status(ips: &[Ipv4Addr]) -> Value {
    let list: Vec<Value> = ips.iter().map(|ip| json!({ "ip": ip.to_string() })).collect();
    json!({ "phase": "Running", "podIP": ips[0].to_string(), "podIPs": list })
}

/// The in-pod nftables tables and policy routing rules of `ns`, as one comparable text.
fn inpod_rules(ns: &NetnsGuard) -> String {
    ns.exec_ok(&["sh", "-c", "nft list ruleset; ip rule show; ip -6 rule show"])
}

fn has_inpod_rules(rules: &str) -> bool {
    rules.contains("istio-ambient") && rules.contains(CONNMARK_RULE)
}

fn has_no_inpod_rules(rules: &str) -> bool {
    !rules.contains("istio") && !rules.contains("0x111")
}

#[test]
fn labelling_a_namespace_enrolls_its_running_pods_through_proc_and_unlabelling_removes_them() {
    let (c, agent) = setup();
    c.api.upsert(namespace("lab", json!({}))).expect("store namespace");
    let peer = ZdsPeer::connect(&agent);

    // Pods created while the namespace is not in ambient: the plugin lets them through unenrolled.
    let names = ["api", "worker"];
    let pods: Vec<Pod> = names.iter().map(|name| run(&c, &plain_pod("lab", name))).collect();
    let ids: Vec<String> = names.iter().map(|name| uid(&c, "lab", name)).collect();
    let processes: Vec<PodProcess> = pods.iter().zip(&ids).map(|(pod, id)| PodProcess::start(&pod.netns, id)).collect();
    for (name, pod) in names.iter().zip(&pods) {
        set_pod_ips(&c, "lab", name, &[pod.ip]);
    }
    for (id, pod) in ids.iter().zip(&pods) {
        assert!(peer.received_for(RequestKind::Add, id).is_empty(), "not enrolled yet: {:?}", peer.received());
        assert!(has_no_inpod_rules(&inpod_rules(&pod.netns)));
    }

    let scans = agent.metric(PROC_SCANS);
    c.api.upsert(namespace("lab", json!({ names::DATAPLANE_MODE_LABEL: "ambient" }))).expect("label namespace");
    for ((name, id), pod) in names.iter().zip(&ids).zip(&pods) {
        let add = eventually(&format!("the proxy receives AddWorkload for lab/{name}"), || {
            peer.received_for(RequestKind::Add, id).pop()
        });
        assert_eq!(add.fds, vec![netns_id(&pod.netns)], "lab/{name}: the fd is the running pod's netns");
        eventually(&format!("lab/{name} is annotated enabled"), || {
            (redirection(&c, "lab", name).as_deref() == Some("enabled")).then_some(())
        });
        let rules = inpod_rules(&pod.netns);
        assert!(has_inpod_rules(&rules), "lab/{name} has no in-pod rules:\n{rules}");
    }
    // Operators see the /proc discoveries in the enrollment histogram's `netns` phase.
    let metrics = agent.metrics();
    let discovered = metrics.lines().find_map(|l| {
        l.strip_prefix("nodeagent_enrollment_duration_seconds_count{phase=\"netns\"} ")?.trim().parse::<f64>().ok()
    });
    assert!(discovered >= Some(names.len() as f64), "netns phase counts the /proc discoveries:\n{metrics}");
    // One /proc scan found both pods' netns: a scan per pod reads every process of the node once per pod.
    assert_eq!(scans, Some(0), "nothing was scanned before the label:\n{metrics}");
    assert_eq!(agent.metric(PROC_SCANS), Some(1), "one /proc scan for the whole namespace:\n{metrics}");

    c.api.upsert(namespace("lab", json!({}))).expect("unlabel namespace");
    for ((name, id), pod) in names.iter().zip(&ids).zip(&pods) {
        eventually(&format!("the proxy receives DelWorkload for lab/{name}"), || {
            (!peer.received_for(RequestKind::Del, id).is_empty()).then_some(())
        });
        eventually(&format!("lab/{name} loses its annotation"), || {
            redirection(&c, "lab", name).is_none().then_some(())
        });
        let rules = inpod_rules(&pod.netns);
        assert!(has_no_inpod_rules(&rules), "lab/{name} kept in-pod rules:\n{rules}");
    }
    drop(processes);
}

/// A running ambient pod that never went through CNI: a netns holding its IP, its process, its Pod object.
struct RunningPod {
    name: String,
    uid: String,
    netns: NetnsGuard,
    _process: PodProcess,
}

static UIDS: AtomicUsize = AtomicUsize::new(0);

impl RunningPod {
    /// Starts the pod (netns with `ip` on lo, process in a cgroup naming a fresh UID), then stores its Pod object
    /// with that UID, the ambient label and `status.podIPs`, so the agent can enroll it at once.
    fn start(cluster: &Cluster, name: &str, ip: Ipv4Addr) -> Self {
        let netns = NetnsGuard::new("lpod");
        netns.exec_ok(&["ip", "addr", "add", &format!("{ip}/32"), "dev", "lo"]);
        let n = UIDS.fetch_add(1, Ordering::Relaxed);
        let uid = format!("{:08x}-0000-4000-8000-{n:012x}", std::process::id());
        let process = PodProcess::start(&netns, &uid);
        let mut pod = ambient_pod(NS, name);
        pod["metadata"]["uid"] = json!(uid);
        pod["status"] = pod_status(&[ip]);
        cluster.create(&pod);
        Self { name: name.to_owned(), uid, netns, _process: process }
    }
}

/// Sets the flag when dropped, so a sampling thread stops even when the test panics.
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// The kernel's change events in one pod netns (`nft monitor`, `ip monitor rule`), recorded while it lives.
/// Unlike sampling, it sees every committed nftables transaction, so a moment without rules cannot slip through.
struct RuleMonitor {
    children: Vec<Child>,
    dir: tempfile::TempDir,
}

impl RuleMonitor {
    /// Starts both monitors in `ns` and returns once each has reported a marker change made there.
    fn start(ns: &NetnsGuard) -> Self {
        let dir = tempfile::tempdir().expect("monitor dir");
        let spawn = |argv: &[&str], file: &str| {
            let out = File::create(dir.path().join(file)).expect("monitor output file");
            let mut cmd = Command::new("ip");
            cmd.args(["netns", "exec", ns.name()]).args(argv).stdin(Stdio::null()).stdout(out).stderr(Stdio::null());
            cmd.spawn().expect("spawn monitor")
        };
        let children = vec![spawn(&["nft", "monitor"], "nft"), spawn(&["ip", "monitor", "rule"], "rule")];
        let monitor = Self { children, dir };
        eventually("both monitors report a marker change", || {
            ns.exec_ok(&["nft", "add", "table", "inet", "monitor-marker"]);
            ns.exec_ok(&["nft", "delete", "table", "inet", "monitor-marker"]);
            ns.exec_ok(&["ip", "rule", "add", "pref", "1000", "lookup", "1000"]);
            ns.exec_ok(&["ip", "rule", "del", "pref", "1000"]);
            (monitor.output("nft").contains("monitor-marker") && monitor.output("rule").contains("1000:")).then_some(())
        });
        monitor
    }

    fn output(&self, file: &str) -> String {
        std::fs::read_to_string(self.dir.path().join(file)).unwrap_or_default()
    }

    /// Stops recording and lists every committed state in which the in-pod tables differed from `tables`, and
    /// every deletion of the connmark rule; also returns how many in-pod tables were (re)created meanwhile.
    fn finish(mut self, tables: &BTreeSet<String>) -> (Vec<String>, usize) {
        self.stop();
        let mut current = tables.clone();
        let (mut gaps, mut created) = (Vec::new(), 0);
        for line in self.output("nft").lines() {
            let table = |rest: &str| rest.split_whitespace().take(2).collect::<Vec<_>>().join(" ");
            if let Some(rest) = line.strip_prefix("add table ").filter(|r| r.contains("istio-ambient")) {
                current.insert(table(rest));
                created += 1;
            } else if let Some(rest) = line.strip_prefix("delete table ").filter(|r| r.contains("istio-ambient")) {
                current.remove(&table(rest));
            } else if line.starts_with("# new generation") && &current != tables {
                gaps.push(format!("{line}: in-pod tables {current:?}"));
            }
        }
        let rules = self.output("rule");
        gaps.extend(rules.lines().filter(|l| l.starts_with("Deleted") && l.contains("0x111")).map(String::from));
        (gaps, created)
    }

    fn stop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for RuleMonitor {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The in-pod nftables tables of `ns`, as `<family> <name>`.
fn inpod_tables(ns: &NetnsGuard) -> BTreeSet<String> {
    let tables = ns.exec_ok(&["nft", "list", "tables"]);
    tables
        .lines()
        .filter_map(|l| l.strip_prefix("table "))
        .filter(|t| t.contains("istio-ambient"))
        .map(String::from)
        .collect()
}

#[test]
fn after_an_agent_restart_the_proxy_gets_all_50_pods_and_no_pod_loses_its_rules() {
    const PODS: usize = 50;
    const VIA_CNI: usize = 4;
    let (c, mut agent) = setup();
    let peer = ZdsPeer::connect(&agent);

    // A few pods enrolled by the plugin's ADD (their container processes start afterwards, as on a node) ...
    let started = Instant::now();
    let mut cni = Vec::new();
    for i in 0..VIA_CNI {
        let name = format!("cni-{i}");
        let pod = run(&c, &ambient_pod(NS, &name));
        let id = uid(&c, NS, &name);
        set_pod_ips(&c, NS, &name, &[pod.ip]);
        let process = PodProcess::start(&pod.netns, &id);
        cni.push((name, id, pod, process));
    }
    // ... and the rest already running when they are stored, enrolled by the agent's watcher through /proc.
    let base = c.node.gateway().octets();
    let running: Vec<RunningPod> = (VIA_CNI..PODS)
        .map(|i| RunningPod::start(&c, &format!("run-{i}"), Ipv4Addr::new(base[0], base[1], base[2], 100 + i as u8)))
        .collect();
    let mut expected: Vec<(String, String, (u64, u64))> =
        cni.iter().map(|(name, id, pod, _)| (name.clone(), id.clone(), netns_id(&pod.netns))).collect();
    expected.extend(running.iter().map(|p| (p.name.clone(), p.uid.clone(), netns_id(&p.netns))));
    eventually("all 50 pods are enrolled and annotated", || {
        expected
            .iter()
            .all(|(name, id, _)| {
                !peer.received_for(RequestKind::Add, id).is_empty()
                    && redirection(&c, NS, name).as_deref() == Some("enabled")
            })
            .then_some(())
    });
    eprintln!("50 pods enrolled in {:?}", started.elapsed());

    // Watch a few pods' rules from another thread for the whole restart: they must never differ.
    let sampled: Vec<(&str, &NetnsGuard)> = vec![
        (&cni[0].0, &cni[0].2.netns),
        (&cni[VIA_CNI - 1].0, &cni[VIA_CNI - 1].2.netns),
        (&running[0].name, &running[0].netns),
        (&running[running.len() - 1].name, &running[running.len() - 1].netns),
    ];
    let before: Vec<String> = sampled.iter().map(|(_, ns)| inpod_rules(ns)).collect();
    for ((name, _), rules) in sampled.iter().zip(&before) {
        assert!(has_inpod_rules(rules), "{name} has no in-pod rules:\n{rules}");
    }
    let tables: Vec<BTreeSet<String>> = sampled.iter().map(|(_, ns)| inpod_tables(ns)).collect();
    let monitors: Vec<RuleMonitor> = sampled.iter().map(|(_, ns)| RuleMonitor::start(ns)).collect();
    // Another pod's tables were lost while the agent was away (drift): the restarted agent reinstalls them.
    let drifted = &running[1];
    let drifted_before = inpod_rules(&drifted.netns);
    drifted.netns.exec_ok(&["nft", "flush", "ruleset"]);
    assert!(!inpod_rules(&drifted.netns).contains("istio-ambient"), "the drifted pod's tables are gone");
    let stop = AtomicBool::new(false);
    let restarted = Instant::now();
    let ((rounds, changed), new_agent, fresh) = std::thread::scope(|s| {
        let sampler = s.spawn(|| {
            let (mut rounds, mut changed) = (0, Vec::new());
            while !stop.load(Ordering::Relaxed) {
                for ((name, ns), before) in sampled.iter().zip(&before) {
                    let now = inpod_rules(ns);
                    if &now != before {
                        changed.push(format!("{name} after {:?}:\n{now}", restarted.elapsed()));
                    }
                }
                rounds += 1;
            }
            (rounds, changed)
        });
        let _stop = StopOnDrop(&stop);
        let status = agent.terminate();
        assert!(status.success(), "node-agent exits cleanly on SIGTERM: {status}\n{}", agent.log());
        let new_agent = NodeAgent::start(&c, &[("AMBIENT_RECONCILE_POD_RULES_ON_STARTUP", "true")]);
        let fresh = ZdsPeer::connect(&new_agent);
        drop(_stop);
        (sampler.join().expect("sampler thread"), new_agent, fresh)
    });
    eprintln!("restart and snapshot took {:?}; {rounds} sampling rounds", restarted.elapsed());
    for (((name, _), monitor), tables) in sampled.iter().zip(monitors).zip(&tables) {
        let (gaps, created) = monitor.finish(tables);
        assert!(gaps.is_empty(), "{name} was without its rules during the restart:\n{}", gaps.join("\n"));
        assert!(created > 0, "{name}: the restarted agent reprogrammed the rules (in place, atomically)");
    }
    assert!(changed.is_empty(), "in-pod rules changed during the restart:\n{}", changed.join("\n"));
    assert!(rounds >= 2, "the rules were sampled during the restart ({rounds} rounds)");
    assert_eq!(inpod_rules(&drifted.netns), drifted_before, "{}: missing rules reinstalled at startup", drifted.name);

    let received = fresh.received();
    let (last, snapshot) = received.split_last().expect("the new peer received requests");
    assert_eq!(last.kind, RequestKind::SnapshotSent, "the snapshot ends with SnapshotSent: {received:?}");
    assert!(snapshot.iter().all(|r| r.kind == RequestKind::Add), "only Adds (no Keep): {snapshot:?}");
    let got: BTreeSet<(String, Vec<(u64, u64)>)> = snapshot.iter().map(|r| (r.uid.clone(), r.fds.clone())).collect();
    let want: BTreeSet<(String, Vec<(u64, u64)>)> =
        expected.iter().map(|(_, id, ns)| (id.clone(), vec![*ns])).collect();
    assert_eq!(snapshot.len(), PODS, "one Add per pod: {snapshot:?}");
    assert_eq!(got, want, "every pod's Add carries exactly its own netns");
    drop((new_agent, running, cni));
}

#[test]
fn a_reconnecting_proxy_gets_the_snapshot_again_and_then_live_adds() {
    let (c, agent) = setup();
    let peer = ZdsPeer::connect(&agent);
    let pods: Vec<(String, Pod)> = ["web", "db"]
        .iter()
        .map(|n| {
            let pod = run(&c, &ambient_pod(NS, n));
            (uid(&c, NS, n), pod)
        })
        .collect();
    drop(peer);

    let fresh = ZdsPeer::connect(&agent);
    let received = fresh.received();
    assert_eq!(received.len(), 3, "two Adds and SnapshotSent: {received:?}");
    assert_eq!(received[2].kind, RequestKind::SnapshotSent);
    for (id, pod) in &pods {
        let adds = fresh.received_for(RequestKind::Add, id);
        assert_eq!(adds.len(), 1, "{id}: {received:?}");
        assert_eq!(adds[0].fds, vec![netns_id(&pod.netns)], "{id}: the snapshot carries the pod's netns");
    }

    // The reconnected proxy serves new pods: ADD succeeds only once it acked.
    let late = run(&c, &ambient_pod(NS, "late"));
    let adds = fresh.received_for(RequestKind::Add, &uid(&c, NS, "late"));
    assert_eq!(adds.len(), 1, "{:?}", fresh.received());
    assert_eq!(adds[0].fds, vec![netns_id(&late.netns)]);
}

#[test]
fn adds_go_to_the_newest_proxy_connection_and_dels_to_all() {
    let (c, agent) = setup();
    let draining = ZdsPeer::connect(&agent);
    let newest = ZdsPeer::connect(&agent);

    let mut web = run(&c, &ambient_pod(NS, "web"));
    let id = uid(&c, NS, "web");
    let adds = newest.received_for(RequestKind::Add, &id);
    assert_eq!(adds.len(), 1, "the newest connection got the Add: {:?}", newest.received());
    assert_eq!(adds[0].fds, vec![netns_id(&web.netns)]);
    assert!(draining.received_for(RequestKind::Add, &id).is_empty(), "{:?}", draining.received());

    c.delete_pod(NS, "web", Some(&mut web));
    for (which, peer) in [("newest", &newest), ("draining", &draining)] {
        eventually(&format!("the {which} connection receives DelWorkload"), || {
            (peer.received_for(RequestKind::Del, &id).len() == 1).then_some(())
        });
    }
}

/// How long a misbehaving peer may wait for the agent to hang up: the agent's 5 s I/O deadline plus slack.
const HANG_UP: Duration = Duration::from_secs(15);

/// Reads until the agent closes the connection (requests sent before it noticed are skipped).
async fn expect_dropped(conn: &SeqpacketConn, what: &str) {
    let deadline = tokio::time::Instant::now() + HANG_UP;
    loop {
        match tokio::time::timeout_at(deadline, conn.recv()).await {
            Err(_) => panic!("{what}: the agent did not drop the connection within {HANG_UP:?}"),
            Ok(Err(ZdsError::PeerClosed)) => return,
            Ok(Err(e)) => panic!("{what}: expected end of stream, got {e}"),
            Ok(Ok(_)) => {}
        }
    }
}

/// A raw connection that said hello and received the snapshot's first request, an Add with the pod's netns.
async fn past_hello(agent_socket: &Path, netns: (u64, u64)) -> SeqpacketConn {
    let conn = SeqpacketConn::connect(agent_socket).await.expect("connect to the agent's ZDS socket");
    conn.send_msg(&ZdsHello::v1(), None).await.expect("send hello");
    let (_, fds) = conn.recv().await.expect("the snapshot's first request");
    let ids: Vec<(u64, u64)> =
        fds.iter().map(|fd| nix::sys::stat::fstat(fd).map(|st| (st.st_dev, st.st_ino)).expect("fstat")).collect();
    assert_eq!(ids, vec![netns], "the first request is the enrolled pod's Add");
    conn
}

#[test]
fn misbehaving_proxies_are_dropped_with_a_logged_error_and_the_agent_keeps_serving() {
    let (c, agent) = setup();
    let first = ZdsPeer::connect(&agent);
    let web = run(&c, &ambient_pod(NS, "web"));
    drop(first);
    let (socket, web_ns) = (agent.zds_socket(), netns_id(&web.netns));
    let rt = tokio::runtime::Runtime::new().expect("tokio runtime");

    // A proxy that takes the first snapshot entry and never acks: dropped at the agent's ack deadline. It runs
    // alongside the rest, and connects first, so that it is not the newest connection.
    let (holding_tx, holding_rx) = std::sync::mpsc::channel();
    let stuck_socket = socket.clone();
    let stuck = rt.spawn(async move {
        let conn = past_hello(&stuck_socket, web_ns).await;
        let holding = Instant::now();
        holding_tx.send(()).expect("test is waiting");
        expect_dropped(&conn, "a proxy that never acks").await;
        holding.elapsed()
    });
    holding_rx.recv_timeout(HANG_UP).expect("the stuck proxy received its first Add");

    let first_messages: [(&str, &[u8]); 3] = [
        ("garbage instead of the hello", &[0xff; 8]),
        ("a truncated hello", &[0x08]),
        ("an empty ack instead of the hello", &[0x0a, 0x00]),
    ];
    let answers: [(&str, &[u8]); 2] =
        [("a truncated ack", &[0x0a, 0x05, 0x01]), ("a hello instead of the ack", &[0x08, 0x01])];
    rt.block_on(async {
        for (what, bytes) in first_messages {
            let conn = SeqpacketConn::connect(&socket).await.expect("connect to the agent's ZDS socket");
            conn.send(bytes, None).await.expect("send");
            expect_dropped(&conn, what).await;
        }
        for (what, bytes) in answers {
            let conn = past_hello(&socket, web_ns).await;
            conn.send(bytes, None).await.expect("send");
            expect_dropped(&conn, what).await;
        }
    });

    // A well-behaved proxy still gets the snapshot, then live Adds.
    let good = ZdsPeer::connect(&agent);
    let adds = good.received_for(RequestKind::Add, &uid(&c, NS, "web"));
    assert_eq!(adds.iter().map(|a| a.fds.clone()).collect::<Vec<_>>(), vec![vec![web_ns]], "{:?}", good.received());
    let late = run(&c, &ambient_pod(NS, "late"));
    let adds = good.received_for(RequestKind::Add, &uid(&c, NS, "late"));
    assert_eq!(adds.iter().map(|a| a.fds.clone()).collect::<Vec<_>>(), vec![vec![netns_id(&late.netns)]]);

    let held = rt.block_on(stuck).expect("stuck proxy task");
    assert!(held >= Duration::from_secs(4), "dropped at the ack deadline, not before: {held:?}");
    eventually("the agent logged an error for each dropped connection", || {
        (agent.log().matches("dropping ZDS connection").count() >= 6).then_some(())
    });
}

/// A sidecar pod of `NS` (see [`testbed::node_agent::crash_looping_pod`]).
fn crash_looping_pod(name: &str, node: &str, init: &str, exit_code: i32, annotated: bool) -> Value {
    testbed::node_agent::crash_looping_pod(NS, name, node, init, exit_code, annotated)
}

/// A sidecar pod on this node whose validation init container succeeded and whose app runs.
fn healthy_sidecar_pod(name: &str) -> Value {
    let mut pod = crash_looping_pod(name, "node-1", VALIDATION_CONTAINER, 126, true);
    pod["status"] = json!({
        "phase": "Running",
        "initContainerStatuses": [{
            "name": VALIDATION_CONTAINER, "ready": true, "restartCount": 0, "image": "proxyv2", "imageID": "",
            "state": { "terminated": { "exitCode": 0, "reason": "Completed" } },
        }],
    });
    pod
}

const REPAIRED_DELETE: &str = "istio_cni_repair_pods_repaired_total{type=\"delete\",result=\"success\"}";
const REPAIRED_LABEL: &str = "istio_cni_repair_pods_repaired_total{type=\"label\",result=\"success\"}";
const REPAIRED_IN_PLACE: &str = "istio_cni_repair_pods_repaired_total{type=\"repair\",result=\"success\"}";
const SKIPPED_IN_PLACE: &str = "istio_cni_repair_pods_repaired_total{type=\"repair\",result=\"skip\"}";
const FAILED_IN_PLACE: &str = "istio_cni_repair_pods_repaired_total{type=\"repair\",result=\"fail\"}";

/// GET `path` from the fake API server as its admin, over its https with its CA, as `kubectl get --raw` would.
fn api_get(c: &Cluster, path: &str) -> Value {
    use rustls::pki_types::pem::PemObject as _;
    use rustls::pki_types::{CertificateDer, ServerName};
    use std::io::{Read as _, Write as _};

    let addr = c.api.addr();
    let mut roots = rustls::RootCertStore::empty();
    let ca = c.api.ca_pem().expect("the test cluster serves https");
    roots.add(CertificateDer::from_pem_slice(ca.as_bytes()).expect("CA PEM")).expect("CA cert");
    let config = rustls::ClientConfig::builder_with_provider(rustls::crypto::ring::default_provider().into())
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    let conn = rustls::ClientConnection::new(config.into(), ServerName::IpAddress(addr.ip().into())).expect("TLS");
    // The API server listens on the node netns's loopback.
    let node = c.node.netns().open().expect("open node netns");
    let tcp = node.run(|| std::net::TcpStream::connect(addr)).expect("enter node netns").expect("connect to the API");
    let mut tls = rustls::StreamOwned::new(conn, tcp);
    let token = c.api.cluster().kubeconfig_token();
    // HTTP/1.0: the body ends with the connection, never chunked.
    write!(tls, "GET {path} HTTP/1.0\r\nHost: {addr}\r\nAuthorization: Bearer {token}\r\n\r\n").expect("request");
    let mut raw = Vec::new();
    if let Err(e) = tls.read_to_end(&mut raw) {
        assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof, "reading the answer: {e}");
    }
    let raw = String::from_utf8_lossy(&raw);
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or_else(|| panic!("no HTTP answer: {raw}"));
    assert!(head.starts_with("HTTP/1.0 200") || head.starts_with("HTTP/1.1 200"), "{head}\n{body}");
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"))
}

/// The Kubernetes Events about pod `NS/name`, as `kubectl get events --field-selector involvedObject.name=<name>`
/// lists them.
fn pod_events(c: &Cluster, name: &str) -> Vec<Value> {
    let list = api_get(c, &format!("/api/v1/namespaces/{NS}/events?fieldSelector=involvedObject.name%3D{name}"));
    list["items"].as_array().cloned().unwrap_or_default()
}

/// Checks the one Event the repair controller wrote about `pod` (stored, with its uid): Istio's reason, type and
/// message, from Istio's component, about the pod itself.
#[track_caller]
fn assert_repair_event(c: &Cluster, pod: &Value, reason: &str, message: &str) {
    let name = pod["metadata"]["name"].as_str().unwrap();
    let events =
        eventually("the repair controller's event is written", || Some(pod_events(c, name)).filter(|e| !e.is_empty()));
    assert_eq!(events.len(), 1, "{events:#?}");
    let event = &events[0];
    assert_eq!(event["reason"], reason, "{event:#}");
    assert_eq!(event["type"], "Warning", "{event:#}");
    assert_eq!(event["message"], message, "{event:#}");
    assert_eq!(event["source"]["component"], "cni-repair", "{event:#}");
    let object = &event["involvedObject"];
    assert_eq!(object["kind"], "Pod", "{event:#}");
    assert_eq!(object["apiVersion"], "v1", "{event:#}");
    assert_eq!(object["namespace"], NS, "{event:#}");
    assert_eq!(object["name"], name, "{event:#}");
    assert_eq!(object["uid"], pod["metadata"]["uid"], "{event:#}");
}

#[test]
fn delete_mode_deletes_a_broken_sidecar_pod_on_this_node_and_leaves_every_other_pod_alone() {
    // A sidecar-only install: ambient off, the agent runs for the repair controller alone.
    let (c, agent) =
        ambient_node(RuleBackend::Nftables, NS, &[("AMBIENT_ENABLED", "false"), ("REPAIR_DELETE_PODS", "true")]);
    // Stored first: the controller handles the pods in watch order, so these are judged before the broken one.
    let alone = [
        crash_looping_pod("other-node", "node-2", VALIDATION_CONTAINER, 126, true),
        crash_looping_pod("exit-1", "node-1", VALIDATION_CONTAINER, 1, true),
        crash_looping_pod("no-sidecar", "node-1", VALIDATION_CONTAINER, 126, false),
        crash_looping_pod("other-init", "node-1", "istio-init", 126, true),
        healthy_sidecar_pod("healthy"),
    ];
    for pod in &alone {
        c.api.upsert(pod.clone()).expect("store pod");
    }
    let broken =
        c.api.upsert(crash_looping_pod("broken", "node-1", VALIDATION_CONTAINER, 126, true)).expect("store pod");

    // The API server deletes gracefully: the pod is terminating (its kubelet stops it, then deletes it for good).
    let terminating =
        |name: &str| c.api.get("Pod", Some(NS), name).is_some_and(|p| p["metadata"]["deletionTimestamp"].is_string());
    eventually_or("the broken pod is deleted (terminating)", || terminating("broken").then_some(()), || agent.log());
    // The agent acted on one pod only: the broken one's DELETE is its only write to a pod.
    let pods = format!("/api/v1/namespaces/{NS}/pods/");
    let writes: Vec<String> = (c.api.requests().into_iter())
        .filter(|r| r.path.starts_with(&pods) && r.method != "GET")
        .map(|r| format!("{} {}", r.method, r.path))
        .collect();
    assert_eq!(writes, [format!("DELETE {pods}broken")], "the agent's writes to pods");
    let log = agent.log();
    for pod in &alone {
        let name = pod["metadata"]["name"].as_str().unwrap();
        assert!(c.api.get("Pod", Some(NS), name).is_some() && !terminating(name), "{name} was deleted; log:\n{log}");
    }
    eventually("the delete is counted", || (agent.metric(REPAIRED_DELETE) == Some(1)).then_some(()));
    assert_eq!(agent.metric(REPAIRED_LABEL), None, "{}", agent.metrics());
    assert_repair_event(&c, &broken, "DeleteBrokenPod", "pod detected as broken, deleted");
    for pod in &alone {
        let name = pod["metadata"]["name"].as_str().unwrap();
        assert_eq!(pod_events(&c, name), Vec::<Value>::new(), "an event about {name}");
    }
}

#[test]
fn label_mode_labels_a_broken_pod_once_and_keeps_it() {
    let (c, agent) = ambient_node(RuleBackend::Nftables, NS, &[("REPAIR_LABEL_PODS", "true")]);
    c.api.upsert(crash_looping_pod("stuck", "node-1", VALIDATION_CONTAINER, 126, true)).expect("store pod");

    let labelled = |name: &str| {
        c.api
            .get("Pod", Some(NS), name)
            .and_then(|p| p["metadata"]["labels"][BROKEN_POD_LABEL].as_str().map(String::from))
    };
    let value = eventually_or("the broken pod is labelled", || labelled("stuck"), || agent.log());
    assert_eq!(value, "true");
    eventually("the label is counted", || (agent.metric(REPAIRED_LABEL) == Some(1)).then_some(()));
    // The label is the agent's one PATCH of the pod, as its own service account.
    let agents = fake_apiserver::User::service_account(chart::NAMESPACE, chart::CNI_SERVICE_ACCOUNT).name;
    let patches = |name: &str| -> Vec<(u16, String)> {
        let path = format!("/api/v1/namespaces/{NS}/pods/{name}");
        let requests = c.api.requests();
        requests.into_iter().filter(|r| r.method == "PATCH" && r.path == path).map(|r| (r.status, r.user)).collect()
    };
    assert_eq!(patches("stuck"), [(200, agents.clone())]);
    let stuck = c.api.get("Pod", Some(NS), "stuck").expect("labelled pod still stored");
    assert_repair_event(&c, &stuck, "LabelBrokenPod", "pod detected as broken, labeled");

    // The kubelet records the next failed attempt; the pod keeps its label and must not be labelled again. A
    // second broken pod stored afterwards is handled after that update, so its label proves the update was seen.
    let mut pod = c.api.get("Pod", Some(NS), "stuck").expect("labelled pod still stored");
    pod["status"]["initContainerStatuses"][0]["restartCount"] = json!(3);
    c.api.upsert(pod).expect("store status update");
    c.api.upsert(crash_looping_pod("stuck-2", "node-1", VALIDATION_CONTAINER, 126, true)).expect("store pod");
    eventually_or("the second broken pod is labelled", || labelled("stuck-2"), || agent.log());
    eventually("the second label is counted", || (agent.metric(REPAIRED_LABEL) == Some(2)).then_some(()));

    assert_eq!(patches("stuck"), [(200, agents.clone())], "the labelled pod was patched again");
    assert_eq!(patches("stuck-2"), [(200, agents)]);
    assert!(c.api.get("Pod", Some(NS), "stuck").is_some() && c.api.get("Pod", Some(NS), "stuck-2").is_some());
    assert_eq!(agent.metric(REPAIRED_DELETE), None);
    // Labelled once: still one event.
    assert_repair_event(&c, &stuck, "LabelBrokenPod", "pod detected as broken, labeled");
}

#[test]
fn enrollment_and_the_repair_controller_share_one_watch_of_the_nodes_pods() {
    // Ambient on and repair on: two consumers of this node's pods.
    let (c, agent) = ambient_node(RuleBackend::Nftables, NS, &[("REPAIR_LABEL_PODS", "true")]);
    let labelled = |name: &str| {
        c.api
            .get("Pod", Some(NS), name)
            .and_then(|p| p["metadata"]["labels"][BROKEN_POD_LABEL].as_str().map(String::from))
    };
    // Both consumers' watches must be open: the repair controller may have listed the first broken pod, but it
    // gets the second one, stored after the first is labelled, from its open watch; enrollment (synced before
    // ready) gets all four events (two adds, two labels) from its open watch.
    c.api.upsert(crash_looping_pod("stuck", "node-1", VALIDATION_CONTAINER, 126, true)).expect("store pod");
    eventually_or("the first broken pod is labelled", || labelled("stuck"), || agent.log());
    c.api.upsert(crash_looping_pod("stuck-2", "node-1", VALIDATION_CONTAINER, 126, true)).expect("store pod");
    eventually_or("the second broken pod is labelled", || labelled("stuck-2"), || agent.log());
    let updates = "nodeagent_reconcile_events_total{type=\"update\"}";
    eventually_or(
        "enrollment sees the four pod events",
        || agent.metric(updates).filter(|n| *n >= 4),
        || agent.metrics(),
    );

    // The server ends every watch within seconds and the agent then re-watches from where it was: one stream at a
    // time (the agent may be between two), and only ever the one list.
    let log = agent.log();
    for (kind, what) in [("pods", "enrollment and repair share one pod watch"), ("namespaces", "one namespace watch")] {
        eventually_or(what, || (c.api.open_watches(kind) == 1).then_some(()), || log.clone());
    }
    let node_pods: Vec<_> = c.api.requests().into_iter().filter(|r| r.path == "/api/v1/pods").collect();
    let watches = node_pods.iter().filter(|r| r.is_watch()).count();
    assert_eq!(node_pods.len() - watches, 1, "one list of this node's pods: {node_pods:#?}");
    assert!(watches >= 1, "the node's pods are watched: {node_pods:#?}");
}

#[test]
fn with_repair_disabled_a_broken_pod_is_left_alone() {
    let c = Cluster::with_backend(RuleBackend::Nftables);
    c.api.upsert(namespace(NS, json!({}))).expect("store namespace");
    c.api.upsert(crash_looping_pod("broken", "node-1", VALIDATION_CONTAINER, 126, true)).expect("store pod");
    let overrides = [("REPAIR_ENABLED", "false"), ("REPAIR_DELETE_PODS", "true"), ("REPAIR_LABEL_PODS", "true")];
    // Ready means the pod watch has listed the broken pod; a later update of it is observed too.
    let agent = NodeAgent::start(&c, &overrides);
    let updates = "nodeagent_reconcile_events_total{type=\"update\"}";
    assert_eq!(agent.metric(updates), Some(1), "{}", agent.metrics());
    let mut pod = c.api.get("Pod", Some(NS), "broken").expect("broken pod stored");
    pod["status"]["initContainerStatuses"][0]["restartCount"] = json!(3);
    c.api.upsert(pod).expect("store status update");
    eventually_or("the agent sees the update", || (agent.metric(updates) == Some(2)).then_some(()), || agent.log());

    let pod = c.api.get("Pod", Some(NS), "broken").expect("the broken pod must not be deleted");
    assert!(pod["metadata"]["labels"][BROKEN_POD_LABEL].is_null(), "labelled: {pod}");
    let log = agent.log();
    assert!(log.contains("repair controller idle") && !log.contains("broken pod:"), "{log}");
    assert_eq!(agent.metric(REPAIRED_DELETE).or(agent.metric(REPAIRED_LABEL)), None);
}

/// `pod` (a sidecar pod object) as the kubelet reports it when the race hit: UID `uid`, sandbox up with `ip`, and
/// `istio-validation` crash-looping with 126 because the netns has no redirect rules.
fn broken_sidecar_pod(mut pod: Value, uid: &str, ip: Ipv4Addr) -> Value {
    let crash = crash_looping_pod("any", "node-1", VALIDATION_CONTAINER, 126, true);
    pod["metadata"]["uid"] = json!(uid);
    pod["spec"]["initContainers"] = crash["spec"]["initContainers"].clone();
    pod["status"] = crash["status"].clone();
    pod["status"]["podIP"] = json!(ip.to_string());
    pod["status"]["podIPs"] = json!([{ "ip": ip.to_string() }]);
    pod
}

/// A pod UID unique to this test process.
fn fresh_uid() -> String {
    let n = UIDS.fetch_add(1, Ordering::Relaxed);
    format!("{:08x}-0000-4000-8000-{n:012x}", std::process::id())
}

/// A sidecar pod attached by the runtime while istio-cni was not chained yet (the conflist has only the bridge),
/// with its "container" running, and its Pod object stored as broken.
fn start_unchained_sidecar_pod(c: &Cluster, pod: Value) -> (Pod, PodProcess) {
    let (ns, name) = (pod["metadata"]["namespace"].as_str().unwrap(), pod["metadata"]["name"].as_str().unwrap());
    let attached = c
        .node
        .try_add_pod_with(c.node.conflist(vec![]), name, ns)
        .unwrap_or_else(|e| panic!("CNI ADD of {ns}/{name} failed: {e}"));
    let uid = fresh_uid();
    let process = PodProcess::start(&attached.netns, &uid);
    c.create(&broken_sidecar_pod(pod, &uid, attached.ip));
    (attached, process)
}

#[test]
fn repair_pods_programs_the_sidecar_rules_into_a_broken_pods_netns_and_skips_pods_the_plugin_would_skip() {
    let c = Cluster::with_backend(RuleBackend::Nftables);
    c.api.upsert(namespace(NS, json!({}))).expect("store namespace");
    let db = c.node.add_pod("db", NS, vec![]);
    let (web, _web_process) = start_unchained_sidecar_pod(&c, sidecar_pod(NS, "web"));
    let opted_out = annotate(sidecar_pod(NS, "opted-out"), "sidecar.istio.io/inject", "false");
    let (opted_out, _opted_out_process) = start_unchained_sidecar_pod(&c, opted_out);

    // Broken as the race leaves it: the app's outbound connection reaches the destination itself, no proxy.
    let direct = db.netns.listen_tcp(8080);
    web.netns.connect_tcp(SocketAddr::new(db.ip.into(), 8080), Some(1000)).expect("app connects");
    assert_eq!(direct.accepted().local, SocketAddr::new(db.ip.into(), 8080), "not redirected before the repair");
    assert!(!RuleBackend::dump_all(&web.netns).to_lowercase().contains("istio"), "rules before the repair");

    let agent = NodeAgent::start(&c, &[("AMBIENT_ENABLED", "false"), ("REPAIR_REPAIR_PODS", "true")]);
    eventually_or(
        "the in-place repair is counted",
        || (agent.metric(REPAIRED_IN_PLACE) == Some(1)).then_some(()),
        || agent.log(),
    );
    let proxy = web.netns.listen_tcp(ports::OUTBOUND);
    web.netns.connect_tcp(SocketAddr::new(db.ip.into(), 8080), Some(1000)).expect("app connects");
    let got = proxy.accepted();
    assert_eq!(got.local.port(), ports::OUTBOUND);
    assert_eq!(got.original_dst, Some(SocketAddrV4::new(db.ip, 8080)));
    assert!(web.netns.exec_ok(&["nft", "list", "tables"]).contains("istio-proxy-nat"));

    // The opted-out pod is judged as the plugin judges it: skipped, no rules; the log says why.
    eventually_or(
        "the opted-out pod's skip is counted",
        || (agent.metric(SKIPPED_IN_PLACE) == Some(1)).then_some(()),
        || agent.log(),
    );
    let log = agent.log();
    assert!(log.contains("InjectionDisabled"), "{log}");
    assert!(!RuleBackend::dump_all(&opted_out.netns).to_lowercase().contains("istio"), "opted-out pod got rules");
    // Repaired in place: neither deleted nor labelled, counted once.
    for name in ["web", "opted-out"] {
        let pod = c.api.get("Pod", Some(NS), name).unwrap_or_else(|| panic!("{name} was deleted; log:\n{log}"));
        assert!(pod["metadata"]["labels"][BROKEN_POD_LABEL].is_null(), "{name} labelled: {pod}");
    }
    assert_eq!(agent.metric(REPAIRED_IN_PLACE), Some(1), "{}", agent.metrics());
    assert_eq!(agent.metric(SKIPPED_IN_PLACE), Some(1), "the opted-out pod: {}", agent.metrics());
    assert_eq!(agent.metric(REPAIRED_DELETE).or(agent.metric(REPAIRED_LABEL)), None, "{}", agent.metrics());
}

#[test]
fn a_failed_in_place_repair_falls_back_to_labelling() {
    // Ambient on too: the agent's one backend serves both. No process of this pod runs: its netns cannot be found.
    let (c, agent) =
        ambient_node(RuleBackend::Nftables, NS, &[("REPAIR_REPAIR_PODS", "true"), ("REPAIR_LABEL_PODS", "true")]);
    c.create(&broken_sidecar_pod(sidecar_pod(NS, "gone"), &fresh_uid(), Ipv4Addr::new(10, 254, 0, 9)));

    let labelled = || {
        c.api
            .get("Pod", Some(NS), "gone")
            .and_then(|p| p["metadata"]["labels"][BROKEN_POD_LABEL].as_str().map(String::from))
    };
    eventually_or("the pod is labelled after the repair failed", labelled, || agent.log());
    eventually("the label is counted", || (agent.metric(REPAIRED_LABEL) == Some(1)).then_some(()));
    let log = agent.log();
    let failure = log.lines().find(|l| l.contains("repairing broken pod failed")).unwrap_or_else(|| panic!("{log}"));
    assert!(
        failure.contains("shop/gone") && failure.contains("repair") && failure.contains("netns not found"),
        "{failure}"
    );
    assert!(log.contains(&format!("Repairing broken pod: {NS}/gone")), "{log}");
    assert_eq!(agent.metric(REPAIRED_IN_PLACE), None, "{}", agent.metrics());
    assert_eq!(agent.metric(FAILED_IN_PLACE), Some(1), "{}", agent.metrics());
}

//! Acceptance for a pod deleted while it is being enrolled: whatever the stage its enrollment is at, nothing of
//! it is left behind. The real `node-agent` (a debug build, whose test hook pauses every enrollment at one stage)
//! and the real `hbone-proxy` run in the node netns; the pod goes through the real plugin's ADD and is deleted
//! through the fake API server while its enrollment is paused. Afterwards the proxy's `/config_dump` does not
//! list it, a proxy connecting afresh does not get it in its snapshot, the node's host probe set holds no entry
//! of it, and the ADD failed saying the pod was deleted.
#![cfg(debug_assertions)] // the agent's pause hook exists in debug builds only, which these tests exec

mod support;

use istio_contract::ports;
use serde_json::{json, Value};
use testbed::mesh::RuleBackend;
use testbed::node_agent::{
    ambient_conflist, ambient_pod, namespace, uid, EnrollmentPause, NodeAgent, RequestKind, ZdsPeer,
};
use testbed::runtime::RuntimeError;
use testbed::wait::{eventually, eventually_or};
use testbed::{Cluster, Pod};

use support::{http_get, Proxy, NS};

const DELETES: &str = "nodeagent_reconcile_events_total{type=\"delete\"}";
const ENROLLED: &str = "nodeagent_enrolled_pods";

/// What the pod holds in the node when its enrollment is paused at a stage, before it is deleted: shows that the
/// pause is where it claims, and that an absence afterwards is a removal.
struct Row {
    stage: &'static str,
    /// The proxy has the pod (it acked the Add).
    in_proxy: bool,
    /// The host probe set has the pod's entry.
    in_probe_set: bool,
}

/// One row per stage of the agent, in order: before the rules, before the proxy's Add, before the probe entry,
/// before the annotation, after it.
const ROWS: [Row; 5] = {
    let [rules, proxy, probe, annotate, enrolled] = EnrollmentPause::STAGES;
    [
        Row { stage: rules, in_proxy: false, in_probe_set: false },
        Row { stage: proxy, in_proxy: false, in_probe_set: false },
        Row { stage: probe, in_proxy: true, in_probe_set: false },
        Row { stage: annotate, in_proxy: true, in_probe_set: true },
        Row { stage: enrolled, in_proxy: true, in_probe_set: true },
    ]
};

/// The node with the agent (pausing at `pause`'s stage) and the real proxy.
struct Node {
    // Field order is drop order: pods first (their CNI DEL needs the node), the proxy while its log dir exists.
    _steady: Pod,
    proxy: Proxy,
    agent: NodeAgent,
    cluster: Cluster,
    pause: EnrollmentPause,
    _dir: tempfile::TempDir,
}

impl Node {
    fn start(stage: &'static str) -> Self {
        let cluster = Cluster::with_backend(RuleBackend::Nftables);
        cluster.api.upsert(namespace(NS, json!({}))).expect("store namespace");
        let pause = EnrollmentPause::at(stage);
        let env = pause.env();
        let overrides: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let agent = NodeAgent::start(&cluster, &overrides);
        let dir = tempfile::tempdir().expect("proxy dir");
        let proxy = Proxy::start(&cluster, &agent, dir.path(), &dir.path().join("workloads.yaml"), &[]);
        // A pod enrolled undisturbed (resumed at once): the checks below can see a workload and a probe entry.
        let steady = std::thread::scope(|s| {
            let add = s.spawn(|| add(&cluster, "steady"));
            let id = stored_uid(&cluster, "steady");
            pause.wait_paused(&id);
            pause.resume(&id);
            add.join().expect("ADD thread").unwrap_or_else(|e| panic!("ADD of the steady pod: {e}"))
        });
        Node { _steady: steady, proxy, agent, cluster, pause, _dir: dir }
    }

    /// The proxy's `/config_dump`.
    fn config_dump(&self) -> Value {
        let (status, body) =
            http_get(&self.cluster.node.netns().path(), ports::ADMIN, "/config_dump").expect("GET /config_dump");
        assert_eq!(status, 200, "/config_dump answers: {body}");
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("/config_dump is not JSON ({e}): {body}"))
    }

    /// Whether the proxy runs pod `id`, or holds it pending.
    fn in_proxy(&self, id: &str) -> bool {
        let dump = self.config_dump();
        ["pods", "pending"]
            .iter()
            .any(|list| dump[list].as_array().expect("pod list in /config_dump").iter().any(|p| p["uid"] == id))
    }

    /// Whether the node's ruleset names pod `id`: the host probe set's entries carry their pod's UID as comment,
    /// and nothing else there names a pod UID.
    fn in_probe_set(&self, id: &str) -> bool {
        self.cluster.node.netns().exec_ok(&["nft", "list", "ruleset"]).contains(id)
    }

    /// The context of a failed check: both logs.
    fn logs(&self) -> String {
        format!("node-agent log:\n{}\nhbone-proxy log:\n{}", self.agent.log(), self.proxy.log())
    }
}

/// Stores ambient pod `name` and runs the plugin's ADD for it, as the runtime does.
fn add(cluster: &Cluster, name: &str) -> Result<Pod, RuntimeError> {
    cluster.create(&ambient_pod(NS, name));
    cluster.add_with(ambient_conflist(cluster), name, NS)
}

/// The UID of pod `name` once the ADD's thread stored it.
fn stored_uid(cluster: &Cluster, name: &str) -> String {
    eventually(&format!("pod {name} is stored"), || {
        cluster.api.get("Pod", Some(NS), name).map(|_| uid(cluster, NS, name))
    })
}

/// Deletes a pod while its enrollment is paused at `row.stage`, then lets the enrollment go on.
fn deleted_at(row: &Row) {
    let node = Node::start(row.stage);
    let steady = uid(&node.cluster, NS, "steady");
    assert!(node.in_proxy(&steady) && node.in_probe_set(&steady), "the steady pod is enrolled\n{}", node.logs());

    let (result, doomed) = std::thread::scope(|s| {
        let add = s.spawn(|| add(&node.cluster, "doomed"));
        let id = stored_uid(&node.cluster, "doomed");
        node.pause.wait_paused(&id);
        assert_eq!(node.in_proxy(&id), row.in_proxy, "paused at {}: in the proxy?\n{}", row.stage, node.logs());
        let in_set = node.in_probe_set(&id);
        assert_eq!(in_set, row.in_probe_set, "paused at {}: in the probe set?\n{}", row.stage, node.logs());

        node.cluster.delete_pod(NS, "doomed", None);
        eventually_or("the agent saw the deletion", || node.agent.metric(DELETES).filter(|n| *n == 1), || node.logs());
        node.pause.resume(&id);
        (add.join().expect("ADD thread"), id)
    });

    // Nothing of it is left as soon as the ADD returned: not in the proxy, not in the probe set, not in the cache.
    assert!(
        !node.in_proxy(&doomed),
        "deleted at {}: still in /config_dump {}\n{}",
        row.stage,
        node.config_dump(),
        node.logs()
    );
    assert!(!node.in_probe_set(&doomed), "deleted at {}: probe set entry left\n{}", row.stage, node.logs());
    assert_eq!(node.agent.metric(ENROLLED), Some(1), "deleted at {}: only the steady pod enrolled", row.stage);
    // The ADD failed, and says why.
    match result {
        Err(RuntimeError::Plugin(e)) => {
            let msg = format!("{} {}", e.msg, e.details);
            assert!(msg.contains("was deleted") && msg.contains(&doomed), "the ADD names the deletion: {msg}");
        }
        Err(other) => panic!("the ADD failed otherwise than by the plugin's error: {other}\n{}", node.logs()),
        Ok(pod) => panic!("the ADD of a deleted pod succeeded ({})\n{}", pod.ip, node.logs()),
    }
    // A proxy connecting now gets the steady pod in its snapshot, and not the deleted one.
    let fresh = ZdsPeer::connect(&node.agent);
    let snapshot: Vec<String> = fresh
        .received()
        .into_iter()
        .filter(|r| matches!(r.kind, RequestKind::Add | RequestKind::Keep))
        .map(|r| r.uid)
        .collect();
    assert_eq!(snapshot, vec![steady.clone()], "deleted at {}: the snapshot\n{}", row.stage, node.logs());
    assert!(node.in_proxy(&steady) && node.in_probe_set(&steady), "the steady pod stays\n{}", node.logs());
}

#[test]
fn a_pod_deleted_at_any_stage_of_its_enrollment_leaves_nothing_in_the_proxy_or_the_probe_set() {
    for row in &ROWS {
        eprintln!("--- deleted at stage {}", row.stage);
        deleted_at(row);
    }
}

//! The node agent after its pod watch relists (issue #16): a pod deleted while the watch was down produces no
//! DELETED event, only its absence from the fresh list. The agent must notice that absence and remove the pod —
//! ZDS Del, cache entry, host probe entry and the netns handle — or the pod's namespace is never freed. Two ways
//! to make the agent relist, as a real API server does: history compacted while the watch was down (410 on the
//! resumed watch), and the API server restarted on a store that lacks the pod (a resourceVersion it never issued
//! gets 410). A pod still in the list stays enrolled.

mod support;

use std::time::{Duration, Instant};

use fake_apiserver::{FakeApiServer, User};
use istio_contract::ports;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde_json::{json, Value};
use testbed::chart;
use testbed::mesh::{api_config, chart_rbac, RuleBackend, HISTORY_AGE, WATCH_TIMEOUT};
use testbed::node_agent::{ambient_conflist, ambient_node, ambient_pod, uid, NodeAgent, RequestKind, ZdsPeer};
use testbed::wait::{eventually, within};
use testbed::{Cluster, Pod};

use support::{ambient_member, await_kubernetes_listing, listening, Scene, B_SA};

const NS: &str = "shop";
const ENROLLED: &str = "nodeagent_enrolled_pods";
/// What the agent and the proxy list and watch: pods (the agent's: of this node), and namespaces.
const PODS: &str = "/api/v1/pods";
const NAMESPACES: &str = "/api/v1/namespaces";

/// Stores an ambient pod and runs its ADD through the runtime; returns it with its UID once the proxy has it.
fn enrolled(c: &Cluster, peer: &ZdsPeer, name: &str) -> (Pod, String) {
    c.create(&ambient_pod(NS, name));
    let pod = c.add_with(ambient_conflist(c), name, NS).unwrap_or_else(|e| panic!("ADD {name}: {e}"));
    let id = uid(c, NS, name);
    assert!(!peer.received_for(RequestKind::Add, &id).is_empty(), "ADD returned before the proxy had {name}");
    (pod, id)
}

/// The agent has removed `gone` (Del sent, handle closed) and kept `kept` (enrolled, no Del).
fn assert_removed_and_kept(agent: &NodeAgent, peer: &ZdsPeer, gone: (&Pod, &str), kept: (&Pod, &str)) {
    eventually("the proxy receives DelWorkload for the pod deleted while the watch was down", || {
        (!peer.received_for(RequestKind::Del, gone.1).is_empty()).then_some(())
    });
    eventually("the agent closes the deleted pod's netns handle", || {
        (agent.netns_handles(&gone.0.netns) == 0).then_some(())
    });
    eventually("the agent counts one enrolled pod", || (agent.metric(ENROLLED) == Some(1)).then_some(()));
    assert!(peer.received_for(RequestKind::Del, kept.1).is_empty(), "the listed pod was removed too");
    assert!(agent.netns_handles(&kept.0.netns) > 0, "the agent no longer holds the listed pod's netns");
}

#[test]
fn a_pod_deleted_while_the_watch_was_down_and_history_was_compacted_is_removed_after_the_relist() {
    let (c, agent) = ambient_node(RuleBackend::Nftables, NS, &[]);
    let peer = ZdsPeer::connect(&agent);
    let (mut gone, gone_id) = enrolled(&c, &peer, "gone");
    let (kept, kept_id) = enrolled(&c, &peer, "kept");
    assert!(agent.netns_handles(&gone.netns) > 0, "an enrolled pod's netns is held by the agent");

    // The agent stopped (a long GC pause, a node under pressure): its watch ends and the pod is deleted while no
    // watch is open, then the history is compacted. Resumed, its watch gets 410 and it relists.
    let pid = Pid::from_raw(agent.pid() as i32);
    kill(pid, Signal::SIGSTOP).expect("SIGSTOP the agent");
    let resumed = scopeguard(pid);
    c.api.drop_watches();
    c.delete_pod(NS, "gone", Some(&mut gone));
    c.api.compact();
    drop(resumed);

    assert_removed_and_kept(&agent, &peer, (&gone, &gone_id), (&kept, &kept_id));
}

#[test]
fn a_pod_missing_from_a_restarted_api_servers_store_is_removed_after_the_relist() {
    let (mut c, agent) = ambient_node(RuleBackend::Nftables, NS, &[]);
    let peer = ZdsPeer::connect(&agent);
    let (gone, gone_id) = enrolled(&c, &peer, "gone");
    let (kept, kept_id) = enrolled(&c, &peer, "kept");

    // The API server comes back from a backup taken before `gone` existed: same address, a store with the
    // namespace and `kept` only, and resourceVersions it never issued are too old for it.
    let restored: Vec<Value> = [("Namespace", None, NS), ("Pod", Some(NS), "kept")]
        .into_iter()
        .map(|(kind, ns, name)| c.api.get(kind, ns, name).unwrap_or_else(|| panic!("{kind} {name} stored")))
        .collect();
    let addr = c.api.addr();
    drop(std::mem::replace(&mut c.api, FakeApiServer::start().expect("stand-in server")));
    let node = c.node.netns().open().expect("open node netns");
    let listener = node.run(|| std::net::TcpListener::bind(addr)).expect("enter node netns").expect("rebind");
    // Same CA, token key and RBAC: the agent's credentials still work, only the store is older (and the test
    // cluster's server answers resourceVersions it never issued with 410).
    let config = api_config(&c.api_state_dir());
    let objects = chart_rbac(&[]).into_iter().chain(restored);
    c.api = FakeApiServer::builder().config(config).listener(listener).objects(objects).start().expect("restart");

    assert_removed_and_kept(&agent, &peer, (&gone, &gone_id), (&kept, &kept_id));
}

/// The test cluster's server ends every watch after 5 to 10 s and compacts history older than 15 s, as a real
/// one does over longer times. The node agent and the node proxy resume each watch where the last one ended, kept
/// fresh by the bookmarks they ask for while nothing they watch changes: each lists once, relists never, and
/// misses no change. A watcher that did not ask for bookmarks would resume from a compacted resourceVersion after
/// the quiet spell and relist.
#[test]
fn the_agent_and_the_proxy_resume_their_watches_across_server_timeouts_and_compaction_without_relisting() {
    let mut scene = Scene::new(tempfile::tempdir().expect("scratch dir"), B_SA, &[]);
    let account = |name| User::service_account(chart::NAMESPACE, name).name;
    let (agent, proxy) = (account(chart::CNI_SERVICE_ACCOUNT), account(chart::PROXY_SERVICE_ACCOUNT));
    // Each list-and-watch the two keep: the agent's of this node's pods and of namespaces, the proxy's of pods.
    let streams = [(agent.as_str(), PODS), (agent.as_str(), NAMESPACES), (proxy.as_str(), PODS)];
    let count = |watch: bool| {
        let requests = scene.cluster.api.requests();
        streams.map(|(user, path)| {
            requests.iter().filter(|r| r.user == user && r.path == path && r.is_watch() == watch).count()
        })
    };
    let resumed_since = |before: [usize; 3], limit: Duration| {
        within(Instant::now(), limit, || count(true).iter().zip(&before).all(|(now, then)| now > then).then_some(()))
            .unwrap_or_else(|| panic!("the watches {streams:?} did not all resume: {:?} since {before:?}", count(true)))
    };

    // Elsewhere in the cluster something changes that none of these watches sees (a ConfigMap); then it is quiet
    // for them for as long as the server takes to end every watch five times (four whole watches: at least 20 s).
    let settings = |generation: &str| {
        let map = json!({
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": { "name": "settings", "namespace": "elsewhere" },
            "data": { "generation": generation },
        });
        scene.cluster.api.upsert(map).expect("store the ConfigMap");
    };
    settings("1");
    assert!(HISTORY_AGE < WATCH_TIMEOUT * 4, "the quiet spell outlasts the history");
    for _ in 0..5 {
        resumed_since(count(true), WATCH_TIMEOUT * 6);
    }
    // The next change compacts all history from before the quiet spell away, the unseen change included: a
    // watcher resuming from the last event it saw would be too old now. Every watch ends once more and resumes.
    settings("2");
    resumed_since(count(true), WATCH_TIMEOUT * 6);

    // Neither missed a change: a new pod C and B's deletion reach the agent (which enrolls C and removes B from
    // the proxy) and the proxy's directory.
    let _c = ambient_member(&scene.cluster, "c", "c-sa");
    await_kubernetes_listing(&scene.proxy, 3);
    scene.cluster.delete_pod(NS, "b", Some(&mut scene.b));
    await_kubernetes_listing(&scene.proxy, 2);
    eventually("the agent counts A and C enrolled", || (scene.agent.metric(ENROLLED) == Some(2)).then_some(()));
    eventually("the proxy closed B's listeners", || (!listening(&scene.b.netns, ports::HBONE)).then_some(()));
    assert_eq!(count(false), [1; 3], "lists of {streams:?}: {:#?}", scene.cluster.api.requests());
}

/// Sends SIGCONT to `pid` when dropped, so a failing test never leaves the agent stopped.
fn scopeguard(pid: Pid) -> impl Drop {
    struct Cont(Pid);
    impl Drop for Cont {
        fn drop(&mut self) {
            let _ = kill(self.0, Signal::SIGCONT);
        }
    }
    Cont(pid)
}

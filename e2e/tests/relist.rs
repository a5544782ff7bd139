//! The node agent after its pod watch relists (issue #16): a pod deleted while the watch was down produces no
//! DELETED event, only its absence from the fresh list. The agent must notice that absence and remove the pod —
//! ZDS Del, cache entry, host probe entry and the netns handle — or the pod's namespace is never freed. Two ways
//! to make the agent relist, as a real API server does: history compacted while the watch was down (410 on the
//! resumed watch), and the API server restarted on a store that lacks the pod (a resourceVersion it never issued
//! gets 410). A pod still in the list stays enrolled.

use fake_apiserver::{Config, FakeApiServer, WatchConfig};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde_json::Value;
use testbed::mesh::{api_config, chart_rbac, RuleBackend};
use testbed::node_agent::{ambient_conflist, ambient_node, ambient_pod, uid, NodeAgent, RequestKind, ZdsPeer};
use testbed::wait::eventually;
use testbed::{Cluster, Pod};

const NS: &str = "shop";
const ENROLLED: &str = "nodeagent_enrolled_pods";

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
    let (gone, gone_id) = enrolled(&c, &peer, "gone");
    let (kept, kept_id) = enrolled(&c, &peer, "kept");
    assert!(agent.netns_handles(&gone.netns) > 0, "an enrolled pod's netns is held by the agent");

    // The agent stopped (a long GC pause, a node under pressure): its watch ends and the pod is deleted while no
    // watch is open, then the history is compacted. Resumed, its watch gets 410 and it relists.
    let pid = Pid::from_raw(agent.pid() as i32);
    kill(pid, Signal::SIGSTOP).expect("SIGSTOP the agent");
    let resumed = scopeguard(pid);
    c.api.drop_watches();
    c.api.delete("Pod", Some(NS), "gone").expect("pod stored");
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
    // Same CA, token key and RBAC: the agent's credentials still work, only the store is older.
    let config = Config {
        watch: WatchConfig { expire_unissued: true, ..WatchConfig::default() },
        ..api_config(&c.api_state_dir())
    };
    let objects = chart_rbac(&[]).into_iter().chain(restored);
    c.api = FakeApiServer::builder().config(config).listener(listener).objects(objects).start().expect("restart");

    assert_removed_and_kept(&agent, &peer, (&gone, &gone_id), (&kept, &kept_id));
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

//! A plugin ADD that fails leaves no enrollment behind (found by the soak test, issue #16). The failed ADD makes the
//! runtime tear the sandbox down, so a pod the agent kept would hold its netns, and the proxy run it, until the pod
//! is deleted: the agent undoes what it did when the enrollment fails after the proxy's Add (here: the annotation
//! gets 500), and when it ends after the plugin may have stopped waiting for the answer (here: the annotation
//! takes longer than the plugin waits).

use std::time::Duration;

use fake_apiserver::Fault;
use testbed::mesh::RuleBackend;
use testbed::node_agent::{
    ambient_conflist, ambient_node, ambient_pod, redirection, uid, NodeAgent, RequestKind, ZdsPeer,
};
use testbed::wait::eventually;
use testbed::Cluster;

const NS: &str = "shop";
const ENROLLED: &str = "nodeagent_enrolled_pods";
const UPDATES: &str = "nodeagent_reconcile_events_total{type=\"update\"}";

/// How many namespace descriptors the agent holds (nsfs: the device of `/proc/self/ns/net`).
fn netns_fds(agent: &NodeAgent) -> usize {
    use std::os::unix::fs::MetadataExt as _;
    let nsfs = std::fs::metadata("/proc/self/ns/net").expect("stat own netns").dev();
    let dir = format!("/proc/{}/fd", agent.pid());
    let fds = std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{dir}: {e}")).flatten();
    fds.filter(|fd| std::fs::metadata(fd.path()).is_ok_and(|m| m.dev() == nsfs)).count()
}

/// Stores ambient pod `name` and waits until the agent's pod watch has delivered it (the plugin's pod setup answers
/// from that watch, without an API request).
fn stored(c: &Cluster, agent: &NodeAgent, name: &str) -> String {
    let before = agent.metric(UPDATES).unwrap_or(0);
    c.create(&ambient_pod(NS, name));
    eventually("the agent's watch delivered the pod", || (agent.metric(UPDATES).unwrap_or(0) > before).then_some(()));
    uid(c, NS, name)
}

/// After the failed ADD of pod `id`: the proxy got the Add and then the Del, the agent counts nothing enrolled and
/// holds no handle beyond what it held before (`held`), and the pod is not annotated.
#[track_caller]
fn assert_nothing_left(c: &Cluster, agent: &NodeAgent, peer: &ZdsPeer, id: &str, name: &str, held: usize) {
    assert!(!peer.received_for(RequestKind::Add, id).is_empty(), "the enrollment reached the proxy's Add");
    eventually("the proxy receives DelWorkload for the pod whose ADD failed", || {
        (!peer.received_for(RequestKind::Del, id).is_empty()).then_some(())
    });
    eventually("the agent counts no enrolled pod", || (agent.metric(ENROLLED) == Some(0)).then_some(()));
    eventually("the agent holds no handle of the pod's netns", || (netns_fds(agent) == held).then_some(()));
    eventually("the pod is not annotated", || redirection(c, NS, name).is_none().then_some(()));
}

#[test]
fn an_add_whose_annotation_fails_leaves_no_enrollment() {
    let (c, agent) = ambient_node(RuleBackend::Nftables, NS, &[]);
    let peer = ZdsPeer::connect(&agent);
    let id = stored(&c, &agent, "web");
    let held = netns_fds(&agent);

    c.api.set_fault(Some(Fault::Status(500)));
    let added = c.add_with(ambient_conflist(&c), "web", NS);
    c.api.set_fault(None);
    let error = added.expect_err("ADD fails when the pod cannot be annotated");
    assert!(error.to_string().contains("annotate"), "the ADD failed at the annotation: {error}");
    assert_nothing_left(&c, &agent, &peer, &id, "web", held);
}

#[test]
fn an_enrollment_that_outlasts_the_plugins_wait_is_undone() {
    let (c, agent) = ambient_node(RuleBackend::Nftables, NS, &[]);
    let peer = ZdsPeer::connect(&agent);
    let id = stored(&c, &agent, "web");
    let held = netns_fds(&agent);

    // Every API request is answered a little later than the plugin waits for the agent: the agent abandons the
    // annotation at its answer deadline, rolls the enrollment back and tells the plugin why, before the plugin
    // gives up (so the ADD's error names the cause, not a timeout), and takes back the annotation that may still
    // land.
    let slow = cni::plugin_event::PLUGIN_WAIT + Duration::from_secs(1);
    c.api.set_fault(Some(Fault::Delay(slow)));
    let added = c.add_with(ambient_conflist(&c), "web", NS);
    let error = added.expect_err("ADD fails when the enrollment cannot end in time");
    assert!(error.to_string().contains("answer deadline"), "the agent said why, in time: {error}");
    c.api.set_fault(None);
    assert_nothing_left(&c, &agent, &peer, &id, "web", held);
}

//! A running pod the agent enrolls from its watch whose annotation fails is annotated once the API answers again
//! (found by the soak test, issue #16). The pod stays enrolled (it runs, and the proxy serves it), so nothing but a
//! retry of the annotation would ever write `ambient.istio.io/redirection: enabled`, by which the proxies of every
//! node find the pod as an HBONE destination.

use std::net::Ipv4Addr;

use fake_apiserver::Fault;
use istio_contract::names;
use serde_json::json;
use testbed::mesh::{plain_pod, RuleBackend};
use testbed::node_agent::{
    ambient_conflist, namespace, redirection, uid, EnrollmentPause, NodeAgent, RequestKind, ZdsPeer,
};
use testbed::pod_process::PodProcess;
use testbed::wait::eventually;
use testbed::Cluster;

const NS: &str = "shop";

/// Records `ip` as pod `name`'s address (phase Running), as the kubelet does once the sandbox is up.
fn set_running(c: &Cluster, name: &str, ip: Ipv4Addr) {
    let mut pod = c.api.get("Pod", Some(NS), name).unwrap_or_else(|| panic!("no pod {name}"));
    pod["status"] = json!({ "phase": "Running", "podIP": ip.to_string(), "podIPs": [{ "ip": ip.to_string() }] });
    c.api.upsert(pod).expect("store pod status");
}

#[test]
fn a_pod_enrolled_from_the_watch_whose_annotation_failed_is_annotated_when_the_api_answers_again() {
    let c = Cluster::with_backend(RuleBackend::Nftables);
    c.api.upsert(namespace(NS, json!({}))).expect("store namespace");
    let pause = EnrollmentPause::at("annotate");
    let env = pause.env();
    let overrides: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let agent = NodeAgent::start(&c, &overrides);
    let peer = ZdsPeer::connect(&agent);

    // A pod outside the mesh runs; then the user labels it into ambient, and the agent enrolls it from its watch.
    c.create(&plain_pod(NS, "web"));
    let pod = c.add_with(ambient_conflist(&c), "web", NS).expect("ADD");
    let id = uid(&c, NS, "web");
    let _process = PodProcess::start(&pod.netns, &id);
    set_running(&c, "web", pod.ip);
    let mut labelled = c.api.get("Pod", Some(NS), "web").expect("pod stored");
    labelled["metadata"]["labels"] = json!({ names::DATAPLANE_MODE_LABEL: "ambient" });
    c.api.upsert(labelled).expect("label the pod");

    // The API fails just when the agent annotates the enrolled pod.
    pause.wait_paused(&id);
    assert!(!peer.received_for(RequestKind::Add, &id).is_empty(), "the proxy has the pod before the annotation");
    c.api.set_fault(Some(Fault::Status(500)));
    pause.resume(&id);
    let status_path = format!("/api/v1/namespaces/{NS}/pods/web/status");
    eventually("the agent's annotation got 500", || {
        c.api.requests().iter().any(|r| r.method == "PATCH" && r.path == status_path && r.status == 500).then_some(())
    });
    c.api.set_fault(None);

    eventually("the pod is annotated enabled once the API answers again", || {
        (redirection(&c, NS, "web").as_deref() == Some(names::AMBIENT_REDIRECTION_ENABLED)).then_some(())
    });
    assert_eq!(agent.metric("nodeagent_enrolled_pods"), Some(1), "the pod stayed enrolled");
    assert_eq!(peer.received_for(RequestKind::Add, &id).len(), 1, "the proxy got the pod once");
}

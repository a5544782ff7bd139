//! The objects and readings the ambient tests share: an ambient pod, a namespace, a crash-looping sidecar pod, a
//! cluster with the agent running (`ambient_node`), the ambient conflist, and what the fake API says of a pod (its
//! redirection annotation, its UID) or a netns of its id. Names come from `istio-contract`, never spelled here.

use istio_contract::names;
use serde_json::{json, Value};

use crate::mesh::{plain_pod, Cluster};
use crate::NetnsGuard;

/// A Pod object without a sidecar, labelled into ambient.
pub fn ambient_pod(namespace: &str, name: &str) -> Value {
    let mut pod = plain_pod(namespace, name);
    pod["metadata"]["labels"] = json!({ names::DATAPLANE_MODE_LABEL: "ambient" });
    pod
}

/// A Namespace object with `labels`; the plugin looks the namespace up when the pod's own labels do not decide.
pub fn namespace(name: &str, labels: Value) -> Value {
    json!({ "apiVersion": "v1", "kind": "Namespace", "metadata": { "name": name, "labels": labels } })
}

/// The label the repair controller puts on broken pods in label mode (Istio's default key).
pub use istio_contract::names::BROKEN_POD_LABEL;
/// The init container Istio injects into sidecar pods to check redirection; it exits 126 when rules are missing.
pub use istio_contract::names::VALIDATION_CONTAINER;

/// A sidecar-injected pod (annotated `sidecar.istio.io/status` unless `annotated` is false) on `node` whose init
/// container `init` is crash-looping: last terminated with `exit_code`, now waiting. With `istio-validation` and
/// 126 it is what the repair controller calls broken.
pub fn crash_looping_pod(
    namespace: &str,
    name: &str,
    node: &str,
    init: &str,
    exit_code: i32,
    annotated: bool,
) -> Value {
    let mut pod = plain_pod(namespace, name);
    pod["spec"]["nodeName"] = json!(node);
    pod["spec"]["initContainers"] = json!([{ "name": init, "image": "proxyv2" }]);
    if annotated {
        pod["metadata"]["annotations"] =
            json!({ names::SIDECAR_STATUS_ANNOTATION: format!("{{\"initContainers\":[\"{VALIDATION_CONTAINER}\"]}}") });
    }
    pod["status"] = json!({
        "phase": "Pending",
        "initContainerStatuses": [{
            "name": init, "ready": false, "restartCount": 2, "image": "proxyv2", "imageID": "",
            "state": { "waiting": { "reason": "CrashLoopBackOff" } },
            "lastState": { "terminated": { "exitCode": exit_code, "reason": "Error" } },
        }],
    });
    pod
}

/// The connmark policy routing rule the in-pod rules give every enrolled pod.
pub const CONNMARK_RULE: &str = "fwmark 0x111/0xfff lookup 100";

/// `cluster`'s conflist with the istio-cni entry's `ambient_enabled` set, as Istio's chart renders it for ambient.
/// Pods also get a default route through the bridge, as on a real node: the replies to host probes, whose
/// source is the off-subnet 169.254.7.127, need it.
pub fn ambient_conflist(cluster: &Cluster) -> Value {
    let mut entry = cluster.istio_cni();
    entry["ambient_enabled"] = json!(true);
    let mut list = cluster.node.conflist(vec![entry]);
    list["plugins"][0]["ipam"]["routes"] = json!([{ "dst": "0.0.0.0/0" }]);
    list
}

/// The `ambient.istio.io/redirection` annotation of pod `namespace/name` in the fake API.
pub fn redirection(cluster: &Cluster, namespace: &str, name: &str) -> Option<String> {
    let pod = cluster.api.get("Pod", Some(namespace), name)?;
    pod["metadata"]["annotations"][names::AMBIENT_REDIRECTION].as_str().map(String::from)
}

/// The UID the fake API gave pod `namespace/name`.
pub fn uid(cluster: &Cluster, namespace: &str, name: &str) -> String {
    let pod = cluster.api.get("Pod", Some(namespace), name).unwrap_or_else(|| panic!("no pod {namespace}/{name}"));
    pod["metadata"]["uid"].as_str().expect("pod has a uid").to_owned()
}

/// The pod netns of a test pod, as a handle (for comparing ids).
pub fn netns_id(ns: &NetnsGuard) -> (u64, u64) {
    ns.open().expect("open pod netns").id()
}

//! The facts about a pod that Istio's sidecar decision depends on, extracted once from the API object, so the
//! plugin (at ADD) and the node agent (repairing a pod) decide from the same data.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Container, Pod};
use serde::{Deserialize, Serialize};

use crate::names::PROXY_CONTAINER;

/// The `istio-proxy` container's settings that shape the redirect rules.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProxyContainer {
    /// Literal env values (`valueFrom` entries are ignored, as Istio does).
    pub env: BTreeMap<String, String>,
    /// Container args, e.g. `["proxy", "sidecar", …]`.
    pub args: Vec<String>,
    /// securityContext.runAsUser.
    pub run_as_user: Option<i64>,
    /// securityContext.runAsGroup.
    pub run_as_group: Option<i64>,
}

/// A pod as the sidecar decision sees it. Serializable because the node agent sends it to the plugin from its
/// watch of the node's pods (the pod setup request in `cni::plugin_event`), sparing the plugin a GET per pod.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodInfo {
    /// Pod labels.
    pub labels: BTreeMap<String, String>,
    /// Pod annotations.
    pub annotations: BTreeMap<String, String>,
    /// Names of the init containers.
    pub init_containers: Vec<String>,
    /// The sidecar, found among the containers or (native sidecars) the init containers.
    pub proxy: Option<ProxyContainer>,
    /// Whether the pod shares the host network namespace.
    pub host_network: bool,
}

impl ProxyContainer {
    fn from_container(c: &Container) -> Self {
        let env = c.env.iter().flatten().filter_map(|e| Some((e.name.clone(), e.value.clone()?))).collect();
        let sc = c.security_context.as_ref();
        Self {
            env,
            args: c.args.clone().unwrap_or_default(),
            run_as_user: sc.and_then(|s| s.run_as_user),
            run_as_group: sc.and_then(|s| s.run_as_group),
        }
    }
}

impl From<&Pod> for PodInfo {
    fn from(pod: &Pod) -> Self {
        let spec = pod.spec.as_ref();
        let containers = spec.map(|s| s.containers.as_slice()).unwrap_or_default();
        let inits = spec.and_then(|s| s.init_containers.as_deref()).unwrap_or_default();
        let proxy =
            containers.iter().chain(inits).find(|c| c.name == PROXY_CONTAINER).map(ProxyContainer::from_container);
        Self {
            labels: pod.metadata.labels.clone().unwrap_or_default(),
            annotations: pod.metadata.annotations.clone().unwrap_or_default(),
            init_containers: inits.iter().map(|c| c.name.clone()).collect(),
            proxy,
            host_network: spec.and_then(|s| s.host_network).unwrap_or(false),
        }
    }
}

/// The pod fields the Kubernetes API server can select pods by (`fieldSelector`). Istio's
/// `REPAIR_FIELD_SELECTORS` may name only these, and the fake API server refuses any other, as the real one does.
pub const SELECTABLE_FIELDS: &[&str] = &[
    "metadata.name",
    "metadata.namespace",
    "spec.nodeName",
    "spec.restartPolicy",
    "spec.schedulerName",
    "spec.serviceAccountName",
    "spec.hostNetwork",
    "status.phase",
    "status.podIP",
    "status.nominatedNodeName",
];

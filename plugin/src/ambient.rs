//! The plugin's own ambient decision, when the node agent could not settle the pod (see [`crate::agent`]): decide
//! from the enablement selectors whether a pod found in the API belongs to the ambient mesh.

use std::collections::BTreeMap;

use cni::{CniError, ErrorCode};
use istio_contract::enablement::{decide_without_namespace, PodFacts, Selectors};
use k8s_openapi::api::core::v1::Pod;

use crate::config::PluginConf;
use crate::k8s::ApiServer;

/// Whether `pod` is to be enrolled in ambient. The namespace lookup is the detection step: with
/// `enable_ambient_detection_retry` it gets the pod lookup's retry budget, otherwise one attempt. Either way an
/// API error fails ADD (code 11) instead of falling through to the sidecar path as Istio does: falling through
/// would start a pod that may belong to the mesh with no redirection at all.
pub fn is_ambient(conf: &PluginConf, api: &ApiServer, pod: &Pod) -> Result<bool, CniError> {
    let selectors = Selectors::from_json(conf.enablement_selectors.as_ref())
        .map_err(|e| CniError::new(ErrorCode::InvalidConfig, e.to_string()))?;
    let empty = BTreeMap::new();
    let facts = PodFacts::of(pod, &empty);
    let excluded: Vec<String> = conf.excluded_namespaces().map(String::from).collect();
    if let Some(answer) = decide_without_namespace(&selectors, &facts, &excluded) {
        return Ok(answer);
    }
    let namespace = facts.namespace;
    let attempts = if conf.enable_ambient_detection_retry { api.attempts() } else { 1 };
    let ns = api
        .namespace(namespace, attempts)
        .map_err(|e| CniError::new(ErrorCode::TryAgainLater, format!("ambient detection: {e}")))?;
    Ok(selectors.matches(facts.labels, ns.metadata.labels.as_ref().unwrap_or(&empty)))
}

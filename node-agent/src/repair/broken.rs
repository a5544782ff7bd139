//! What makes a pod "broken" for the repair controller: a sidecar pod on this node whose validation init
//! container exited with the code (and message) it uses when traffic redirection is missing.

use k8s_openapi::api::core::v1::{ContainerStateTerminated, Pod};

use super::selectors::PodSelection;
use crate::config::Config;

/// The tests a pod must pass to be repaired, from the `REPAIR_*` settings.
#[derive(Debug, Clone)]
pub struct Criteria {
    /// `spec.nodeName` of the pods this agent may repair.
    pub node: String,
    /// The annotation that marks sidecar-injected pods.
    pub sidecar_annotation: String,
    /// The validation init container's name.
    pub init_container: String,
    /// Its exit code when redirection is missing.
    pub exit_code: i32,
    /// When non-empty, the termination message must contain it.
    pub termination_msg: String,
    /// `REPAIR_LABEL_SELECTORS` and `REPAIR_FIELD_SELECTORS`: only pods they match are touched.
    pub selection: PodSelection,
}

impl Criteria {
    /// The criteria the agent's configuration asks for.
    pub fn from_config(config: &Config) -> Self {
        let repair = &config.repair;
        Self {
            node: config.node_name.clone(),
            sidecar_annotation: repair.sidecar_annotation.clone(),
            init_container: repair.init_container_name.clone(),
            exit_code: repair.init_exit_code,
            termination_msg: repair.init_termination_msg.clone(),
            // Checked at startup (`Config::validate`).
            selection: repair.pod_selection().unwrap_or_default(),
        }
    }

    /// Whether `pod` is on this node, injected, and its validation init container is failing the way it does
    /// when redirection is missing: terminated so now, or waiting to restart after terminating so. A container
    /// that has since run again (running, or terminated otherwise) is not broken, whatever its last state says:
    /// a repaired pod must not be deleted by an agent that restarts later.
    pub fn broken(&self, pod: &Pod) -> bool {
        let on_node = pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(self.node.as_str());
        let injected =
            pod.metadata.annotations.as_ref().is_some_and(|a| a.contains_key(self.sidecar_annotation.as_str()));
        let statuses = pod.status.as_ref().and_then(|s| s.init_container_statuses.as_deref()).unwrap_or_default();
        let failed = statuses.iter().filter(|s| s.name == self.init_container).any(|s| {
            let Some(state) = s.state.as_ref() else { return false };
            match (&state.terminated, &state.waiting) {
                (Some(now), _) => self.is_redirect_failure(now),
                (None, Some(_)) => s
                    .last_state
                    .as_ref()
                    .and_then(|last| last.terminated.as_ref())
                    .is_some_and(|t| self.is_redirect_failure(t)),
                (None, None) => false,
            }
        });
        on_node && injected && failed && self.selection.matches(pod)
    }

    fn is_redirect_failure(&self, terminated: &ContainerStateTerminated) -> bool {
        terminated.exit_code == self.exit_code
            && (self.termination_msg.is_empty()
                || terminated.message.as_deref().unwrap_or_default().contains(self.termination_msg.as_str()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use istio_contract::names::{SIDECAR_STATUS_ANNOTATION, VALIDATION_CONTAINER, VALIDATION_EXIT_CODE};
    use serde_json::{json, Value};

    fn criteria(msg: &str) -> Criteria {
        Criteria {
            node: "node-1".into(),
            sidecar_annotation: SIDECAR_STATUS_ANNOTATION.into(),
            init_container: VALIDATION_CONTAINER.into(),
            exit_code: VALIDATION_EXIT_CODE,
            termination_msg: msg.into(),
            selection: PodSelection::default(),
        }
    }

    /// A pod whose `init` container terminated with `code`: now (`state`), or last time (`lastState`) while it
    /// now waits to restart.
    fn pod(node: &str, annotated: bool, init: &str, state: &str, code: i32, message: &str) -> Pod {
        let mut status = json!({ "name": init, "ready": false, "restartCount": 1, "image": "i", "imageID": "" });
        status[state] = json!({ "terminated": { "exitCode": code, "message": message } });
        if state == "lastState" {
            status["state"] = json!({ "waiting": { "reason": "CrashLoopBackOff" } });
        }
        let annotations: Value = if annotated { json!({ SIDECAR_STATUS_ANNOTATION: "{}" }) } else { json!({}) };
        serde_json::from_value(json!({
            "metadata": { "name": "p", "namespace": "ns", "annotations": annotations },
            "spec": { "nodeName": node, "containers": [{ "name": "app" }] },
            "status": { "initContainerStatuses": [status] },
        }))
        .unwrap()
    }

    #[test]
    fn a_validation_failure_now_or_last_time_on_this_node_is_broken() {
        let c = criteria("");
        assert!(c.broken(&pod("node-1", true, "istio-validation", "lastState", 126, "")));
        assert!(c.broken(&pod("node-1", true, "istio-validation", "state", 126, "")));
    }

    #[test]
    fn other_nodes_codes_containers_and_uninjected_pods_are_not() {
        let c = criteria("");
        assert!(!c.broken(&pod("node-2", true, "istio-validation", "lastState", 126, "")));
        assert!(!c.broken(&pod("node-1", false, "istio-validation", "lastState", 126, "")));
        assert!(!c.broken(&pod("node-1", true, "istio-init", "lastState", 126, "")));
        assert!(!c.broken(&pod("node-1", true, "istio-validation", "lastState", 1, "")));
    }

    #[test]
    fn a_validation_container_that_ran_again_is_not_broken_whatever_its_last_state() {
        let c = criteria("");
        for now in [json!({ "terminated": { "exitCode": 0 } }), json!({ "running": {} })] {
            let mut recovered = pod("node-1", true, "istio-validation", "lastState", 126, "");
            let status = &mut recovered.status.as_mut().unwrap().init_container_statuses.as_mut().unwrap()[0];
            status.state = Some(serde_json::from_value(now.clone()).unwrap());
            assert!(!c.broken(&recovered), "{now}");
        }
    }

    #[test]
    fn a_configured_termination_message_must_be_contained() {
        let c = criteria("iptables");
        assert!(c.broken(&pod("node-1", true, "istio-validation", "state", 126, "no iptables rules found")));
        assert!(!c.broken(&pod("node-1", true, "istio-validation", "state", 126, "something else")));
    }
}

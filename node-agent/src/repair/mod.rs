//! Istio's race repair controller. A sidecar pod that started before the plugin was chained on its node has no
//! redirect rules, and its `istio-validation` init container keeps exiting with 126. This follows the pods on
//! this node (through the agent's one watch of them, [`crate::node_pods`]) and repairs each such broken pod once: in place (`REPAIR_REPAIR_PODS`: its netns gets the rules the
//! plugin would have programmed), or by deleting (`REPAIR_DELETE_PODS`) or labelling (`REPAIR_LABEL_PODS`) it.

mod broken;
pub mod events;
pub mod in_place;
pub mod selectors;

use std::collections::HashSet;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, Patch, PatchParams, Preconditions};
use kube::runtime::watcher::Event;
use kube::{Api, Client};
use redirect::backend::Backend;
use serde_json::json;

use crate::config::{Config, RepairConfig};
use crate::metrics::{Metrics, RepairType};
use crate::node_pods::{NodePods, PodEvents};
use crate::pod::PodUid;
use broken::Criteria;
use events::{Recorder, REASON_DELETE, REASON_LABEL};
use in_place::InPlace;

/// What the controller does with a broken pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
    Repair,
    Label,
    Delete,
}

impl Action {
    /// The selected modes in Istio's precedence (repair, then delete, then label): the first is tried, and when
    /// in-place repair fails the second, if any, is the fallback. Empty: nothing to do.
    fn select(repair: &RepairConfig) -> Vec<Action> {
        if !repair.enabled {
            return Vec::new();
        }
        let fallback = if repair.delete_pods {
            Some(Action::Delete)
        } else if repair.label_pods {
            Some(Action::Label)
        } else {
            None
        };
        repair.repair_pods.then_some(Action::Repair).into_iter().chain(fallback).collect()
    }

    fn name(self) -> &'static str {
        match self {
            Action::Repair => "repair",
            Action::Label => "label",
            Action::Delete => "delete",
        }
    }
}

/// Whether the settings ask for in-place repair, which needs a rule backend (the agent selects one for it even
/// when ambient is off).
pub fn repairs_in_place(repair: &RepairConfig) -> bool {
    repair.enabled && repair.repair_pods
}

/// The controller's task: it follows the pods on this node (subscribed to `pods`, the agent's one watch of them)
/// and repairs the broken ones until the watch ends. `None`, without subscribing, when the settings select no
/// action. `backend` programs in-place repairs (see [`repairs_in_place`]). Failures are logged and retried on the
/// pod's next update.
pub fn start(
    client: Client,
    config: &Config,
    metrics: Metrics,
    backend: Option<Backend>,
    pods: &mut NodePods,
) -> Option<impl std::future::Future<Output = ()>> {
    let repair = &config.repair;
    let actions = Action::select(repair);
    let Some(first) = actions.first() else {
        tracing::info!(enabled = repair.enabled, "repair controller idle: no repair mode selected");
        return None;
    };
    let in_place = match (first, backend) {
        (Action::Repair, Some(backend)) => Some(InPlace::new(backend, config)),
        (Action::Repair, None) => {
            tracing::error!("in-place repair selected but no rule backend: repair controller idle");
            return None;
        }
        _ => None,
    };
    let names: Vec<&str> = actions.iter().map(|a| a.name()).collect();
    tracing::info!(actions = ?names, init_container = %repair.init_container_name, "repair controller on");
    let controller = Controller {
        events: Recorder::new(client.clone(), config.node_name.clone()),
        api: client,
        criteria: Criteria::from_config(config),
        actions,
        in_place,
        label: (repair.broken_pod_label_key.clone(), repair.broken_pod_label_value.clone()),
        done: HashSet::new(),
        listed: HashSet::new(),
    };
    Some(controller.follow(pods.subscribe(), metrics))
}

/// What one action did with a broken pod.
enum Outcome {
    /// Done: counted with `result="success"`.
    Acted,
    /// Nothing (left) to do: already labelled, gone, or a pod the plugin would not redirect; counted with
    /// `result="skip"`.
    Nothing,
}

struct Controller {
    api: Client,
    /// Writes Istio's Events about deleted and labelled pods.
    events: Recorder,
    criteria: Criteria,
    /// The selected actions, tried in order until one does not fail.
    actions: Vec<Action>,
    /// Set when the first action is in-place repair.
    in_place: Option<InPlace>,
    label: (String, String),
    /// UIDs of pods already acted on: one action per broken pod, forgotten when the pod goes away.
    done: HashSet<PodUid>,
    /// UIDs seen during a (re)list, to forget pods deleted while the watch was down.
    listed: HashSet<PodUid>,
}

impl Controller {
    /// Handles the pod events in watch order until the watch ends (its errors are logged where it runs).
    async fn follow(mut self, mut pods: PodEvents, metrics: Metrics) {
        while let Some(event) = pods.next().await {
            match &*event {
                Event::Init => self.listed.clear(),
                Event::InitApply(pod) => {
                    self.listed.insert(PodUid::of(pod));
                    self.seen(pod, &metrics).await;
                }
                Event::InitDone => {
                    let listed = std::mem::take(&mut self.listed);
                    self.done.retain(|id| listed.contains(id));
                }
                Event::Apply(pod) => self.seen(pod, &metrics).await,
                Event::Delete(pod) => {
                    self.done.remove(&PodUid::of(pod));
                }
            }
        }
    }

    fn labelled(&self, pod: &Pod) -> bool {
        let (key, value) = &self.label;
        pod.metadata.labels.as_ref().and_then(|l| l.get(key)) == Some(value)
    }

    /// Acts on `pod` if it is broken and not handled yet: the first action, then the fallback if it failed.
    async fn seen(&mut self, pod: &Pod, metrics: &Metrics) {
        let id = PodUid::of(pod);
        if self.done.contains(&id) || pod.metadata.deletion_timestamp.is_some() || !self.criteria.broken(pod) {
            return;
        }
        let (ns, name) = (crate::pod::namespace(pod), crate::pod::name(pod));
        for action in self.actions.clone() {
            let result = self.act(action, pod, ns, name).await;
            let counted = match &result {
                Ok(Outcome::Acted) => "success",
                Ok(Outcome::Nothing) => "skip",
                Err(_) => "fail",
            };
            let labels = RepairType { r#type: action.name().into(), result: counted.into() };
            metrics.pods_repaired.get_or_create(&labels).inc();
            match result {
                Ok(outcome) => {
                    if !(action == Action::Label && matches!(outcome, Outcome::Nothing)) {
                        self.done.insert(id);
                    }
                    return;
                }
                Err(e) => tracing::warn!(
                    pod = %format!("{ns}/{name}"),
                    action = action.name(),
                    error = %e,
                    "repairing broken pod failed"
                ),
            }
        }
        tracing::warn!(pod = %format!("{ns}/{name}"), "broken pod not repaired; retried on its next update");
    }

    /// Does `action` on `pod`. A delete or a label, done or failed, is told in a Kubernetes Event, as Istio does
    /// (an in-place repair writes none, as in Istio).
    async fn act(&self, action: Action, pod: &Pod, ns: &str, name: &str) -> Result<Outcome, String> {
        let api = Api::<Pod>::namespaced(self.api.clone(), ns);
        let result = match action {
            Action::Repair => {
                let Some(in_place) = &self.in_place else { return Err("no rule backend".into()) };
                if let Some(reason) = in_place.skip_reason(pod) {
                    tracing::info!(pod = %format!("{ns}/{name}"), %reason, "broken pod left without rules");
                    return Ok(Outcome::Nothing);
                }
                tracing::info!("Repairing broken pod: {ns}/{name}");
                return in_place.repair(pod).await.map(|()| Outcome::Acted).map_err(|e| e.to_string());
            }
            Action::Delete => {
                tracing::info!("Deleting broken pod: {ns}/{name}");
                // The UID precondition keeps a recreated pod of the same name (a StatefulSet's) safe.
                let preconditions = Preconditions { uid: Some(PodUid::of(pod).into()), resource_version: None };
                let params = DeleteParams { preconditions: Some(preconditions), ..DeleteParams::default() };
                api.delete(name, &params).await.map(|_| ())
            }
            Action::Label => {
                if self.labelled(pod) {
                    return Ok(Outcome::Nothing);
                }
                tracing::info!("Labelling broken pod: {ns}/{name}");
                let (key, value) = &self.label;
                let patch = json!({ "metadata": { "labels": { key: value } } });
                api.patch(
                    name,
                    &PatchParams { field_manager: Some(crate::enroll::FIELD_MANAGER.into()), ..PatchParams::default() },
                    &Patch::Merge(&patch),
                )
                .await
                .map(|_| ())
            }
        };
        let (reason, done, failed) = match action {
            Action::Delete => (REASON_DELETE, "deleted", "delete"),
            _ => (REASON_LABEL, "labeled", "label"),
        };
        match result {
            Ok(()) => {
                self.events.warn(pod, reason, format!("pod detected as broken, {done}"));
                Ok(Outcome::Acted)
            }
            // Gone already, or replaced by a pod of the same name: nothing left to repair.
            Err(kube::Error::Api(status)) if status.code == 404 || status.code == 409 => {
                tracing::info!(pod = %format!("{ns}/{name}"), code = status.code, "broken pod already gone");
                Ok(Outcome::Nothing)
            }
            Err(e) => {
                self.events.warn(pod, reason, format!("pod detected as broken, but failed to {failed}: {e}"));
                Err(e.to_string())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser as _;

    fn actions(flags: &[&str]) -> Vec<Action> {
        let mut args = vec!["node-agent", "--node-name", "n"];
        args.extend(flags);
        Action::select(&Config::try_parse_from(args).unwrap().repair)
    }

    #[test]
    fn repair_comes_first_then_delete_then_label_as_in_istio() {
        let all = ["--repair-repair-pods", "true", "--repair-delete-pods", "true", "--repair-label-pods", "true"];
        assert_eq!(actions(&all), [Action::Repair, Action::Delete]);
        assert_eq!(actions(&all[..2]), [Action::Repair]);
        assert_eq!(
            actions(&["--repair-repair-pods", "true", "--repair-label-pods", "true"]),
            [Action::Repair, Action::Label]
        );
        assert_eq!(actions(&all[2..]), [Action::Delete]);
        assert_eq!(actions(&all[4..]), [Action::Label]);
        assert_eq!(actions(&[]), []);
        assert_eq!(actions(&["--repair-enabled", "false", "--repair-repair-pods", "true"]), []);
    }
}

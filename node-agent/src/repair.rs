//! Istio's race repair controller. A sidecar pod that started before the plugin was chained on its node has no
//! redirect rules, and its `istio-validation` init container keeps exiting with 126. This watches the pods on
//! this node and labels (`REPAIR_LABEL_PODS`) or deletes (`REPAIR_DELETE_PODS`) each such broken pod once.
//! Istio's in-place repair (`REPAIR_REPAIR_PODS`) is not implemented.

mod broken;

use std::collections::HashSet;

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, Patch, PatchParams, Preconditions};
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt as _;
use kube::{Api, Client};
use serde_json::json;

use crate::config::{Config, RepairConfig};
use crate::metrics::{Metrics, RepairType};
use broken::Criteria;

/// What the controller does with a broken pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
    Label,
    Delete,
}

impl Action {
    /// Istio's precedence (repair, then delete, then label); in-place repair falls back to labelling when
    /// `REPAIR_LABEL_PODS` is set and to nothing otherwise. `None`: nothing to do.
    fn select(repair: &RepairConfig) -> Option<Action> {
        if !repair.enabled {
            None
        } else if repair.repair_pods {
            repair.label_pods.then_some(Action::Label)
        } else if repair.delete_pods {
            Some(Action::Delete)
        } else if repair.label_pods {
            Some(Action::Label)
        } else {
            None
        }
    }

    fn name(self) -> &'static str {
        match self {
            Action::Label => "label",
            Action::Delete => "delete",
        }
    }
}

/// The controller's task: it watches the pods on this node and repairs the broken ones until the watch ends.
/// `None` when the settings select no action. Failed API calls are logged and retried on the pod's next update.
pub fn start(client: Client, config: &Config, metrics: Metrics) -> Option<impl std::future::Future<Output = ()>> {
    let repair = &config.repair;
    if repair.enabled && repair.repair_pods {
        tracing::warn!(
            fallback = if repair.label_pods { "label" } else { "none" },
            "REPAIR_REPAIR_PODS: this implementation does not repair pods in place; broken pods are only labelled \
             when REPAIR_LABEL_PODS is set, otherwise left alone"
        );
    }
    let Some(action) = Action::select(repair) else {
        tracing::info!(enabled = repair.enabled, "repair controller idle: no repair mode selected");
        return None;
    };
    tracing::info!(action = action.name(), init_container = %repair.init_container_name, "repair controller on");
    let controller = Controller {
        api: client,
        criteria: Criteria::from_config(config),
        action,
        label: (repair.broken_pod_label_key.clone(), repair.broken_pod_label_value.clone()),
        done: HashSet::new(),
        listed: HashSet::new(),
    };
    Some(controller.watch(config.node_name.clone(), metrics))
}

struct Controller {
    api: Client,
    criteria: Criteria,
    action: Action,
    label: (String, String),
    /// UIDs of pods already acted on: one action per broken pod, forgotten when the pod goes away.
    done: HashSet<String>,
    /// UIDs seen during a (re)list, to forget pods deleted while the watch was down.
    listed: HashSet<String>,
}

fn uid(pod: &Pod) -> String {
    pod.metadata.uid.clone().unwrap_or_default()
}

impl Controller {
    async fn watch(mut self, node: String, metrics: Metrics) {
        let pods = watcher::watcher(
            Api::<Pod>::all(self.api.clone()),
            watcher::Config::default().fields(&format!("spec.nodeName={node}")),
        )
        .default_backoff();
        let mut pods = std::pin::pin!(pods);
        while let Some(event) = pods.next().await {
            match event {
                Ok(Event::Init) => self.listed.clear(),
                Ok(Event::InitApply(pod)) => {
                    self.listed.insert(uid(&pod));
                    self.seen(&pod, &metrics).await;
                }
                Ok(Event::InitDone) => {
                    let listed = std::mem::take(&mut self.listed);
                    self.done.retain(|id| listed.contains(id));
                }
                Ok(Event::Apply(pod)) => self.seen(&pod, &metrics).await,
                Ok(Event::Delete(pod)) => {
                    self.done.remove(&uid(&pod));
                }
                Err(e) => tracing::warn!(error = %e, "repair watch error (the watcher retries)"),
            }
        }
    }

    fn labelled(&self, pod: &Pod) -> bool {
        let (key, value) = &self.label;
        pod.metadata.labels.as_ref().and_then(|l| l.get(key)) == Some(value)
    }

    /// Acts on `pod` if it is broken and not handled yet.
    async fn seen(&mut self, pod: &Pod, metrics: &Metrics) {
        let id = uid(pod);
        if self.done.contains(&id) || pod.metadata.deletion_timestamp.is_some() || !self.criteria.broken(pod) {
            return;
        }
        if self.action == Action::Label && self.labelled(pod) {
            return;
        }
        let (ns, name) = (pod.metadata.namespace.as_deref().unwrap_or_default(), pod.metadata.name.as_deref());
        let name = name.unwrap_or_default();
        let api = Api::<Pod>::namespaced(self.api.clone(), ns);
        let result = match self.action {
            Action::Delete => {
                tracing::info!("Deleting broken pod: {ns}/{name}");
                // The UID precondition keeps a recreated pod of the same name (a StatefulSet's) safe.
                let preconditions = Preconditions { uid: Some(id.clone()), resource_version: None };
                let params = DeleteParams { preconditions: Some(preconditions), ..DeleteParams::default() };
                api.delete(name, &params).await.map(|_| ())
            }
            Action::Label => {
                tracing::info!("Labelling broken pod: {ns}/{name}");
                let (key, value) = &self.label;
                let patch = json!({ "metadata": { "labels": { key: value } } });
                api.patch(name, &PatchParams::default(), &Patch::Merge(&patch)).await.map(|_| ())
            }
        };
        match result {
            Ok(()) => {
                self.done.insert(id);
                metrics.pods_repaired.get_or_create(&RepairType { r#type: self.action.name().into() }).inc();
            }
            // Gone already, or replaced by a pod of the same name: nothing left to repair.
            Err(kube::Error::Api(status)) if status.code == 404 || status.code == 409 => {
                tracing::info!(pod = %format!("{ns}/{name}"), code = status.code, "broken pod already gone");
                self.done.insert(id);
            }
            Err(e) => tracing::warn!(
                pod = %format!("{ns}/{name}"),
                action = self.action.name(),
                error = %e,
                "repairing broken pod failed; retried on its next update"
            ),
        }
    }
}

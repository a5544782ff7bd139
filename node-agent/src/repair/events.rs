//! The Kubernetes Events the repair controller writes about the pods it acts on, as Istio's does: core/v1 Events
//! from the component `cni-repair`, type `Warning`, with Istio's reasons (`DeleteBrokenPod`, `LabelBrokenPod`)
//! and messages. Writing one is best effort: a failure is logged and never fails the repair.

use k8s_openapi::api::core::v1::{Event, EventSource, ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::PostParams;
use kube::{Api, Client};

/// The event source component, Istio's.
pub const COMPONENT: &str = "cni-repair";
/// Istio's reason for a broken pod deleted (or not) by `REPAIR_DELETE_PODS`.
pub const REASON_DELETE: &str = "DeleteBrokenPod";
/// Istio's reason for a broken pod labelled (or not) by `REPAIR_LABEL_PODS`.
pub const REASON_LABEL: &str = "LabelBrokenPod";
/// The type of every repair event, Istio's.
pub const TYPE_WARNING: &str = "Warning";

/// Writes Events about pods for one node's repair controller.
#[derive(Clone)]
pub struct Recorder {
    client: Client,
    /// This node, as the events' `source.host` and `reportingInstance`.
    node: String,
}

impl Recorder {
    /// A recorder writing through `client` for the agent on `node`.
    pub fn new(client: Client, node: String) -> Self {
        Self { client, node }
    }

    /// Writes a `Warning` Event with `reason` and `message` about `pod`, in the background: the controller never
    /// waits for it, and a failure is only logged.
    pub fn warn(&self, pod: &Pod, reason: &'static str, message: String) {
        let event = self.event(pod, reason, message);
        let (client, ns) = (self.client.clone(), crate::pod::namespace(pod).to_string());
        let name = crate::pod::name(pod).to_string();
        tokio::spawn(async move {
            match Api::<Event>::namespaced(client, &ns).create(&PostParams::default(), &event).await {
                Ok(_) => tracing::debug!(pod = %format!("{ns}/{name}"), reason, "event written"),
                Err(e) => tracing::warn!(pod = %format!("{ns}/{name}"), reason, error = %e, "cannot write event"),
            }
        });
    }

    fn event(&self, pod: &Pod, reason: &str, message: String) -> Event {
        let now = Timestamp::now();
        let name = crate::pod::name(pod).to_string();
        Event {
            metadata: ObjectMeta {
                // As client-go's recorder names them: the object's name and the time in hex nanoseconds.
                name: Some(format!("{name}.{:x}", now.as_nanosecond())),
                namespace: pod.metadata.namespace.clone(),
                ..ObjectMeta::default()
            },
            involved_object: ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Pod".into()),
                namespace: pod.metadata.namespace.clone(),
                name: Some(name),
                uid: pod.metadata.uid.clone(),
                resource_version: pod.metadata.resource_version.clone(),
                ..ObjectReference::default()
            },
            reason: Some(reason.into()),
            message: Some(message),
            type_: Some(TYPE_WARNING.into()),
            source: Some(EventSource { component: Some(COMPONENT.into()), host: Some(self.node.clone()) }),
            reporting_component: Some(COMPONENT.into()),
            reporting_instance: Some(self.node.clone()),
            first_timestamp: Some(Time(now)),
            last_timestamp: Some(Time(now)),
            // No eventTime: a core/v1 Event of the legacy recorder's kind, as client-go's (and so Istio's) writes.
            count: Some(1),
            ..Event::default()
        }
    }
}

//! The plugin's pod source: the pods on this node and the namespaces, as the agent's watches last saw them, so a
//! pod's ADD needs no API request. A pod the watch has not delivered yet (the kubelet and the agent learn of it at
//! about the same time) is waited for, up to [`WAIT`]; after that the caller falls back to the API.
//!
//! Freshness: the store holds the newest version of each pod the watch has delivered, so an answer is at least as
//! fresh as anything the agent has seen. When the runtime names the pod's UID, only that pod answers: a pod
//! recreated under the same name is waited for, not mistaken for its predecessor.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::runtime::reflector::{ObjectRef, Store};

use crate::metrics::{LookupSource, Metrics};
use crate::node_pods::PodStore;

/// How long a lookup waits for the watch to deliver a pod it does not hold yet.
pub const WAIT: Duration = Duration::from_millis(200);

/// Looks pods (and their namespaces' labels) up in the agent's watch-fed stores.
#[derive(Debug, Clone)]
pub struct PodLookup {
    pods: PodStore,
    namespaces: Option<Store<Namespace>>,
    metrics: Metrics,
}

impl PodLookup {
    /// Lookups in `pods`, and in `namespaces` when the agent watches them (ambient).
    pub fn new(pods: PodStore, namespaces: Option<Store<Namespace>>, metrics: Metrics) -> Self {
        Self { pods, namespaces, metrics }
    }

    /// Pod `namespace/name` (with UID `uid`, when given) from the store, waiting up to [`WAIT`] for the watch to
    /// deliver it. `None` when it did not arrive in time: the caller asks the API. Counted in
    /// `istio_cni_plugin_pod_lookups_total{source}`: `agent` for an answer from the store, `api` for a miss.
    pub async fn pod(&self, namespace: &str, name: &str, uid: Option<&str>) -> Option<Arc<Pod>> {
        let key = ObjectRef::new(name).within(namespace);
        let mut applied = self.pods.applied.clone();
        let found = tokio::time::timeout(WAIT, async {
            loop {
                // Mark the current version seen before reading the store, so an event applied after the read
                // wakes the wait below.
                applied.borrow_and_update();
                if let Some(pod) =
                    self.pods.store.get(&key).filter(|p| uid.is_none_or(|u| p.metadata.uid.as_deref() == Some(u)))
                {
                    return Some(pod);
                }
                if applied.changed().await.is_err() {
                    return None;
                }
            }
        })
        .await
        .ok()
        .flatten();
        let source = if found.is_some() { LookupSource::Agent } else { LookupSource::Api };
        self.metrics.pod_lookups(source);
        found
    }

    /// The labels of namespace `name` as the namespace watch last saw them; `None` when the agent does not watch
    /// namespaces or has not seen this one.
    pub fn namespace_labels(&self, name: &str) -> Option<BTreeMap<String, String>> {
        let ns = self.namespaces.as_ref()?.get(&ObjectRef::new(name))?;
        Some(ns.metadata.labels.clone().unwrap_or_default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::runtime::reflector::{self, store::Writer};
    use kube::runtime::watcher::Event;
    use prometheus_client::registry::Registry;
    use serde_json::json;
    use tokio::sync::watch;

    fn pod(name: &str, uid: &str) -> Pod {
        serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": { "name": name, "namespace": "shop", "uid": uid },
            "spec": { "nodeName": "node-1", "containers": [{ "name": "app" }] },
        }))
        .unwrap()
    }

    /// A lookup over a store the test writes, as the watch would.
    fn lookup() -> (PodLookup, Writer<Pod>, watch::Sender<u64>, Metrics) {
        let (store, writer) = reflector::store();
        let (applied, rx) = watch::channel(0);
        let metrics = Metrics::register(&mut Registry::default());
        (PodLookup::new(PodStore { store, applied: rx }, None, metrics.clone()), writer, applied, metrics)
    }

    fn apply(writer: &mut Writer<Pod>, applied: &watch::Sender<u64>, pod: Pod) {
        writer.apply_watcher_event(&Event::Apply(pod));
        applied.send_modify(|n| *n += 1);
    }

    fn lookups(metrics: &Metrics, source: &'static str) -> u64 {
        metrics.pod_lookups.get_or_create(&crate::metrics::Source { source }).get()
    }

    /// Lets the spawned lookups run until they wait (the test runtime has one thread).
    async fn let_lookups_wait() {
        for _ in 0..3 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn a_pod_the_watch_delivers_during_the_wait_is_answered_from_the_store() {
        let (lookup, mut writer, applied, metrics) = lookup();
        let asked = tokio::spawn(async move { lookup.pod("shop", "web", Some("u1")).await });
        let_lookups_wait().await;
        assert!(!asked.is_finished(), "the lookup waits for the pod");
        apply(&mut writer, &applied, pod("web", "u1"));
        let found = asked.await.unwrap().expect("the pod, once delivered");
        assert_eq!(found.metadata.uid.as_deref(), Some("u1"));
        assert_eq!((lookups(&metrics, "agent"), lookups(&metrics, "api")), (1, 0));
    }

    #[tokio::test]
    async fn a_pod_the_watch_has_not_delivered_within_the_wait_is_a_miss() {
        let (lookup, _writer, _applied, metrics) = lookup();
        let started = std::time::Instant::now();
        assert!(lookup.pod("shop", "web", None).await.is_none());
        let waited = started.elapsed();
        assert!(waited >= WAIT && waited < WAIT * 10, "the wait is bounded, and waited out: {waited:?}");
        assert_eq!((lookups(&metrics, "agent"), lookups(&metrics, "api")), (0, 1));
    }

    #[tokio::test]
    async fn a_predecessor_under_the_same_name_is_not_the_pod_the_runtime_named() {
        let (lookup, mut writer, applied, _metrics) = lookup();
        apply(&mut writer, &applied, pod("web", "old"));
        let asked = tokio::spawn(async move { lookup.pod("shop", "web", Some("new")).await });
        let_lookups_wait().await;
        assert!(!asked.is_finished(), "the old pod does not answer for the new one");
        apply(&mut writer, &applied, pod("web", "new"));
        assert_eq!(asked.await.unwrap().unwrap().metadata.uid.as_deref(), Some("new"));

        let (lookup, mut writer, applied, _metrics) = self::lookup();
        apply(&mut writer, &applied, pod("web", "old"));
        assert!(lookup.pod("shop", "web", Some("new")).await.is_none(), "only the old pod: a miss");
        assert!(lookup.pod("shop", "web", None).await.is_some(), "no UID named: the pod of that name");
    }
}

//! This node's pods, watched once. Enrollment and the repair controller both follow the pods on this node
//! (field selector `spec.nodeName`); rather than each opening its own identical watch, one `kube::runtime`
//! watcher feeds a reflector [`Store`] (for lookups) and hands every event, in watch order, to each consumer.

use std::pin::pin;
use std::sync::Arc;

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::reflector::{self, store::Writer, Store};
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt as _;
use kube::{Api, Client, ResourceExt as _};
use tokio::sync::{mpsc, watch};

/// One event of the shared watch, as every consumer receives it (shared, not copied per consumer).
pub type PodEvent = Arc<Event<Pod>>;

/// A consumer's end of the shared watch: every event, in watch order, from the initial list on, and the shared
/// store. Unbounded, so a slow consumer (a `/proc` scan, an in-place repair) never holds the others back, as
/// with separate watches.
#[derive(Debug)]
pub struct PodEvents {
    rx: mpsc::UnboundedReceiver<PodEvent>,
    store: Store<Pod>,
}

impl PodEvents {
    /// The reflector's store: every pod on this node as of the newest event the watch has applied, which may be
    /// ahead of the events this consumer has handled so far. During a relist it keeps the previous list until
    /// the new one is complete. Empty until the first list completes.
    pub fn store(&self) -> Store<Pod> {
        self.store.clone()
    }

    /// The next event; `None` once the watch has ended.
    pub async fn next(&mut self) -> Option<PodEvent> {
        self.rx.recv().await
    }

    /// The events as a stream, to merge with other sources.
    pub fn into_stream(mut self) -> impl futures::Stream<Item = PodEvent> {
        futures::stream::poll_fn(move |cx| self.rx.poll_recv(cx))
    }
}

/// The store of this node's pods, for lookups that wait for a pod the watch has not delivered yet: the store and a
/// counter bumped after every event the store has applied.
#[derive(Debug, Clone)]
pub struct PodStore {
    /// Every pod on this node as of the newest event applied.
    pub store: Store<Pod>,
    /// Changes after each applied event (its value counts them).
    pub applied: watch::Receiver<u64>,
}

/// The watch of this node's pods, before it runs: consumers [`subscribe`](NodePods::subscribe) first, so none
/// misses the initial list, then [`run`](NodePods::run) drives it.
#[derive(Debug)]
pub struct NodePods {
    api: Api<Pod>,
    node: String,
    store: Store<Pod>,
    writer: Writer<Pod>,
    consumers: Vec<mpsc::UnboundedSender<PodEvent>>,
    applied: watch::Sender<u64>,
    /// Whether anything looks pods up in the store (see [`NodePods::lookups`]).
    looked_up: bool,
}

impl NodePods {
    /// The pods of node `node`, through `client`; nothing is requested until [`NodePods::run`].
    pub fn new(client: Client, node: &str) -> Self {
        let (store, writer) = reflector::store();
        let (applied, _) = watch::channel(0);
        let node = node.to_string();
        Self { api: Api::all(client), node, store, writer, consumers: Vec::new(), applied, looked_up: false }
    }

    /// The store for lookups (the plugin's pod setup): the pods are watched even when no consumer subscribes.
    pub fn lookups(&mut self) -> PodStore {
        self.looked_up = true;
        PodStore { store: self.store.clone(), applied: self.applied.subscribe() }
    }

    /// A new consumer, which receives every event of the watch.
    pub fn subscribe(&mut self) -> PodEvents {
        let (tx, rx) = mpsc::unbounded_channel();
        self.consumers.push(tx);
        PodEvents { rx, store: self.store.clone() }
    }

    /// Watches until every consumer is gone (never, in the agent). Without consumers or lookups no watch is opened
    /// at all. Watch errors are logged here once, and the watcher retries with back-off.
    pub async fn run(self) {
        let mut consumers = self.consumers;
        let looked_up = self.looked_up;
        if consumers.is_empty() && !looked_up {
            tracing::debug!("nothing consumes this node's pods: not watching them");
            return;
        }
        let config = watcher::Config::default().fields(&format!("spec.nodeName={}", self.node));
        // Without a backoff a failing watch is retried at once, in a loop: an API outage would pin a core and
        // flood the log and the API server. kube's default: 0.8 s doubling to 30 s, reset by the next event.
        // The store keeps every pod of the node for as long as it runs: not its `managedFields`, which nothing
        // here reads and which on a real cluster are often the largest part of a pod object (several KiB per
        // field manager, each controller and `kubectl apply` adding its own).
        let events = watcher::watcher(self.api, config)
            .default_backoff()
            .modify(|pod| pod.managed_fields_mut().clear())
            .reflect(self.writer);
        let mut events = pin!(events);
        while let Some(event) = events.next().await {
            match event {
                Ok(event) => {
                    // The reflector has applied the event to the store by now.
                    self.applied.send_modify(|n| *n += 1);
                    let event = Arc::new(event);
                    consumers.retain(|tx| tx.send(event.clone()).is_ok());
                    if consumers.is_empty() && !looked_up {
                        return;
                    }
                }
                Err(e) => tracing::warn!(error = %e, "pod watch error (the watcher retries)"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fake_apiserver::FakeApiServer;
    use kube::config::{KubeConfigOptions, Kubeconfig};
    use kube::runtime::reflector::ObjectRef;
    use serde_json::json;
    use std::time::Duration;

    const DEADLINE: Duration = Duration::from_secs(20);

    async fn client(server: &FakeApiServer) -> Client {
        let kubeconfig = Kubeconfig::from_yaml(&server.kubeconfig_yaml()).unwrap();
        let config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await.unwrap();
        Client::try_from(config).unwrap()
    }

    fn pod(name: &str, node: &str) -> serde_json::Value {
        json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": { "name": name, "namespace": "ns" },
            "spec": { "nodeName": node, "containers": [{ "name": "app" }] },
        })
    }

    fn describe(event: &Event<Pod>) -> String {
        let name = |p: &Pod| p.metadata.name.clone().unwrap_or_default();
        match event {
            Event::Init => "init".into(),
            Event::InitApply(p) => format!("init-apply {}", name(p)),
            Event::InitDone => "init-done".into(),
            Event::Apply(p) => format!("apply {}", name(p)),
            Event::Delete(p) => format!("delete {}", name(p)),
        }
    }

    async fn expect(events: &mut PodEvents, want: &[&str]) {
        for want in want {
            let event = tokio::time::timeout(DEADLINE, events.next()).await.expect("an event in time");
            assert_eq!(describe(&event.expect("the watch goes on")), *want);
        }
    }

    #[tokio::test]
    async fn every_consumer_gets_every_event_of_one_watch_and_the_store_follows() {
        let server = FakeApiServer::start().unwrap();
        server.upsert(pod("here", "node-1")).unwrap();
        server.upsert(pod("elsewhere", "node-2")).unwrap();
        let mut pods = NodePods::new(client(&server).await, "node-1");
        let (mut first, mut second) = (pods.subscribe(), pods.subscribe());
        let store = first.store();
        tokio::spawn(pods.run());

        for events in [&mut first, &mut second] {
            expect(events, &["init", "init-apply here", "init-done"]).await;
        }
        server.upsert(pod("new", "node-1")).unwrap();
        server.delete("Pod", Some("ns"), "here").unwrap();
        for events in [&mut first, &mut second] {
            expect(events, &["apply new", "delete here"]).await;
        }
        assert_eq!(server.open_watches("pods"), 1, "one watch for both consumers");
        let names: Vec<_> = store.state().iter().filter_map(|p| p.metadata.name.clone()).collect();
        assert_eq!(names, ["new"]);
        assert!(store.get(&ObjectRef::new("new").within("ns")).is_some());
    }

    #[tokio::test]
    async fn the_store_keeps_each_pod_without_its_managed_fields() {
        let server = FakeApiServer::start().unwrap();
        let mut object = pod("here", "node-1");
        object["metadata"]["annotations"] = json!({ "kept": "yes" });
        object["metadata"]["managedFields"] = json!([{
            "manager": "kubectl-client-side-apply", "operation": "Update", "apiVersion": "v1",
            "fieldsType": "FieldsV1", "fieldsV1": { "f:metadata": { "f:annotations": { ".": {}, "f:kept": {} } } },
        }]);
        server.upsert(object).unwrap();
        assert!(server.get("Pod", Some("ns"), "here").unwrap()["metadata"]["managedFields"].is_array());
        let mut pods = NodePods::new(client(&server).await, "node-1");
        let mut events = pods.subscribe();
        let store = events.store();
        tokio::spawn(pods.run());
        expect(&mut events, &["init", "init-apply here", "init-done"]).await;
        let stored = store.get(&ObjectRef::new("here").within("ns")).expect("the pod is in the store");
        assert!(stored.metadata.managed_fields.as_ref().is_none_or(Vec::is_empty), "{:?}", stored.metadata);
        assert_eq!(stored.annotations().get("kept").map(String::as_str), Some("yes"), "the rest is kept");
    }

    #[tokio::test]
    async fn without_consumers_nothing_is_watched() {
        let server = FakeApiServer::start().unwrap();
        let pods = NodePods::new(client(&server).await, "node-1");
        tokio::time::timeout(DEADLINE, pods.run()).await.expect("run returns at once");
        assert!(server.requests().is_empty(), "{:?}", server.requests());
    }
}

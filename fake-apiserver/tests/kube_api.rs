//! Request/response API calls through the real kube client: CRUD, subresources, selectors, faults.

mod support;

use fake_apiserver::{FakeApiServer, Fault};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::ResourceExt;
use serde_json::json;
use std::time::{Duration, Instant};
use support::{client, pod, pod_json};

fn api_error(result: Result<impl std::fmt::Debug, kube::Error>) -> (u16, String) {
    match result {
        Err(kube::Error::Api(status)) => (status.code, status.reason.clone()),
        other => panic!("expected an API error, got {other:?}"),
    }
}

/// How long a faulted request may take before the test fails instead of waiting on client retries.
const ANSWER_DEADLINE: Duration = Duration::from_secs(10);

/// Awaits `call`, failing the test if it does not finish within [`ANSWER_DEADLINE`].
async fn answered<T>(call: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(ANSWER_DEADLINE, call).await.expect("the request finishes without long client retries")
}

fn names(list: &kube::core::ObjectList<Pod>) -> Vec<String> {
    list.items.iter().map(|p| p.name_any()).collect()
}

#[tokio::test]
async fn pod_crud_round_trip() {
    let server = FakeApiServer::start().unwrap();
    let pods: Api<Pod> = Api::namespaced(client(&server).await, "default");
    let pp = PostParams::default();

    let created = pods.create(&pp, &pod("default", "web", "n1", json!({"app": "web"}))).await.unwrap();
    let rv1 = created.resource_version().unwrap();
    assert!(created.uid().is_some_and(|u| !u.is_empty()));
    assert!(created.creation_timestamp().is_some());
    assert_eq!(created.namespace().as_deref(), Some("default"));
    assert_eq!(pods.get("web").await.unwrap().resource_version(), Some(rv1.clone()));

    let duplicate = pods.create(&pp, &pod("default", "web", "n1", json!({}))).await;
    assert_eq!(api_error(duplicate), (409, "AlreadyExists".into()));

    let mut update = created.clone();
    update.labels_mut().insert("tier".into(), "front".into());
    let replaced = pods.replace("web", &pp, &update).await.unwrap();
    assert_ne!(replaced.resource_version(), Some(rv1));
    assert_eq!(replaced.labels().get("tier").map(String::as_str), Some("front"));
    // `update` still carries the old resourceVersion.
    assert_eq!(api_error(pods.replace("web", &pp, &update).await), (409, "Conflict".into()));

    let patch = Patch::Merge(json!({"metadata": {"labels": {"tier": null, "patched": "yes"}}}));
    let patched = pods.patch("web", &PatchParams::default(), &patch).await.unwrap();
    let labels: Vec<_> = patched.labels().iter().map(|(k, v)| format!("{k}={v}")).collect();
    assert_eq!(labels, ["app=web", "patched=yes"]);

    let status = Patch::Merge(json!({"status": {"phase": "Running", "podIP": "10.1.2.3"}}));
    let with_status = pods.patch_status("web", &PatchParams::default(), &status).await.unwrap();
    assert_eq!(with_status.status.as_ref().and_then(|s| s.phase.as_deref()), Some("Running"));
    assert_eq!(pods.get_status("web").await.unwrap().status.and_then(|s| s.pod_ip), Some("10.1.2.3".into()));
    // Writing the main resource cannot change status (it is a subresource on a real apiserver).
    let mut overwrite = with_status.clone();
    overwrite.status.as_mut().unwrap().phase = Some("Failed".into());
    overwrite.labels_mut().insert("x".into(), "y".into());
    let after = pods.replace("web", &pp, &overwrite).await.unwrap();
    assert_eq!(after.status.and_then(|s| s.phase), Some("Running".into()));

    let deleted = pods.delete("web", &DeleteParams::default()).await.unwrap();
    assert_eq!(deleted.left().map(|p| p.name_any()).as_deref(), Some("web"));
    assert_eq!(api_error(pods.get("web").await), (404, "NotFound".into()));
    assert_eq!(api_error(pods.delete("web", &DeleteParams::default()).await), (404, "NotFound".into()));
    assert!(server.get("Pod", Some("default"), "web").is_none());
}

#[tokio::test]
async fn list_filters_by_field_and_label_selectors() {
    let server = FakeApiServer::start().unwrap();
    server.upsert(pod_json("ns1", "a", "n1", json!({"app": "x"}))).unwrap();
    server.upsert(pod_json("ns1", "b", "n2", json!({"app": "y"}))).unwrap();
    server.upsert(pod_json("ns2", "c", "n1", json!({"app": "x", "canary": "true"}))).unwrap();
    let client = client(&server).await;
    let all: Api<Pod> = Api::all(client.clone());
    let ns1: Api<Pod> = Api::namespaced(client, "ns1");

    let on_n1 = all.list(&ListParams::default().fields("spec.nodeName=n1")).await.unwrap();
    assert_eq!(names(&on_n1), ["a", "c"]);
    assert!(on_n1.metadata.resource_version.is_some_and(|rv| !rv.is_empty()));
    let ns1_on_n1 = ns1.list(&ListParams::default().fields("spec.nodeName=n1")).await.unwrap();
    assert_eq!(names(&ns1_on_n1), ["a"]);
    let not_n1 = all.list(&ListParams::default().fields("spec.nodeName!=n1")).await.unwrap();
    assert_eq!(names(&not_n1), ["b"]);
    let by_name = all.list(&ListParams::default().fields("metadata.name=c,metadata.namespace=ns2")).await.unwrap();
    assert_eq!(names(&by_name), ["c"]);

    for (selector, expected) in [
        ("app in (y)", vec!["b"]),
        ("app!=x", vec!["b"]),
        ("app=x,!canary", vec!["a"]),
        ("canary", vec!["c"]),
        ("app notin (x,y)", vec![]),
    ] {
        let list = all.list(&ListParams::default().labels(selector)).await.unwrap();
        assert_eq!(names(&list), expected, "labelSelector {selector}");
    }
    let bad = all.list(&ListParams::default().labels("app in x")).await;
    assert_eq!(api_error(bad), (400, "BadRequest".into()));

    let first = all.list(&ListParams::default().limit(2)).await.unwrap();
    assert_eq!(names(&first), ["a", "b"]);
    let token = first.metadata.continue_.clone().expect("a continue token");
    let rest = all.list(&ListParams::default().limit(2).continue_token(&token)).await.unwrap();
    assert_eq!(names(&rest), ["c"]);
    assert!(rest.metadata.continue_.is_none_or(|c| c.is_empty()));
}

#[tokio::test]
async fn cluster_scoped_kinds_and_daemonsets() {
    let server = FakeApiServer::start().unwrap();
    let client = client(&server).await;
    let pp = PostParams::default();

    let namespaces: Api<Namespace> = Api::all(client.clone());
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": "istio-system"}})).unwrap();
    namespaces.create(&pp, &ns).await.unwrap();
    assert_eq!(namespaces.get("istio-system").await.unwrap().namespace(), None);

    let nodes: Api<Node> = Api::all(client.clone());
    server
        .upsert(json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1", "labels": {"zone": "a"}}}))
        .unwrap();
    let node_status = Patch::Merge(json!({"status": {"addresses": [{"type": "InternalIP", "address": "10.0.0.1"}]}}));
    nodes.patch_status("n1", &PatchParams::default(), &node_status).await.unwrap();
    let listed = nodes.list(&ListParams::default().labels("zone=a")).await.unwrap();
    assert_eq!(listed.items.len(), 1);
    assert_eq!(listed.items[0].status.as_ref().and_then(|s| s.addresses.as_ref()).map(Vec::len), Some(1));

    let daemonsets: Api<DaemonSet> = Api::namespaced(client.clone(), "istio-system");
    let ds: DaemonSet = serde_json::from_value(json!({
        "metadata": {"name": "istio-cni-node"},
        "spec": {
            "selector": {"matchLabels": {"k8s-app": "istio-cni-node"}},
            "template": {"metadata": {"labels": {"k8s-app": "istio-cni-node"}},
                         "spec": {"containers": [{"name": "install-cni", "image": "istio/install-cni"}]}}
        }
    }))
    .unwrap();
    let created = daemonsets.create(&pp, &ds).await.unwrap();
    assert_eq!(created.metadata.generation, Some(1));
    let spec_change = Patch::Merge(json!({"spec": {"minReadySeconds": 5}}));
    let changed = daemonsets.patch("istio-cni-node", &PatchParams::default(), &spec_change).await.unwrap();
    assert_eq!(changed.metadata.generation, Some(2));
    let all_ds: Api<DaemonSet> = Api::all(client);
    assert_eq!(all_ds.list(&ListParams::default()).await.unwrap().items.len(), 1);

    let apply = Patch::Apply(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "applied"}}));
    namespaces.patch("applied", &PatchParams::apply("test"), &apply).await.unwrap();
    assert!(server.get("Namespace", None, "applied").is_some(), "server-side apply creates");
}

#[tokio::test]
async fn request_log_and_faults() {
    let server = FakeApiServer::start().unwrap();
    server.upsert(pod_json("default", "p", "n1", json!({}))).unwrap();
    let pods: Api<Pod> = Api::namespaced(client(&server).await, "default");

    pods.get("p").await.unwrap();
    pods.list(&ListParams::default().labels("a=b")).await.unwrap();
    let log = server.requests();
    assert_eq!(log.len(), 2);
    assert_eq!((log[0].method.as_str(), log[0].path.as_str()), ("GET", "/api/v1/namespaces/default/pods/p"));
    assert_eq!(log[1].param("labelSelector").as_deref(), Some("a=b"));
    assert!(!log[1].is_watch());

    // 500 rather than 503: kube retries 429/503/504 up to 15 times with exponential backoff (minutes in
    // total), so a retryable code here would stall the test instead of failing it.
    server.set_fault(Some(Fault::Status(500)));
    assert_eq!(api_error(answered(pods.get("p")).await), (500, "InternalError".into()));

    // The server closes a kept-alive connection when the request arrives and a new one right after accept;
    // the first request normally rides the pooled connection, which leaves the second a new one.
    server.set_fault(Some(Fault::Refuse));
    for attempt in ["first request", "second request"] {
        match answered(pods.get("p")).await {
            Err(kube::Error::Service(_)) => {}
            other => panic!("{attempt}: a refused connection must fail in transport, got {other:?}"),
        }
    }

    let delay = Duration::from_millis(300);
    server.set_fault(Some(Fault::Delay(delay)));
    let early = tokio::time::timeout(delay / 3, pods.get("p")).await;
    assert!(early.is_err(), "a client that gives up before the delay gets no answer: {early:?}");
    let started = Instant::now();
    answered(pods.get("p")).await.unwrap();
    let took = started.elapsed();
    assert!(took >= delay && took < delay + ANSWER_DEADLINE / 2, "the delay fault holds the request {took:?}");

    server.set_fault(None);
    server.clear_requests();
    pods.get("p").await.unwrap();
    assert_eq!(server.requests().len(), 1);
}

//! Graceful deletion through the real kube client: deletionTimestamp and grace periods, MODIFIED then DELETED,
//! finalizers holding an object, grace 0; and the lenient default's instant deletion.

mod support;

use fake_apiserver::{Config, FakeApiServer};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, Patch, PatchParams, WatchEvent, WatchParams};
use kube::ResourceExt;
use serde_json::json;
use support::{api_error, client, pod_json};

fn graceful() -> FakeApiServer {
    FakeApiServer::builder().config(Config { graceful_deletion: true, ..Config::default() }).start().unwrap()
}

/// The watch events of `pods` from `rv` on, as `(type, name, terminating)`, until `stop` says so.
async fn events_until(
    pods: &Api<Pod>,
    rv: &str,
    stop: impl Fn(&[(String, String, bool)]) -> bool,
) -> Vec<(String, String, bool)> {
    let mut stream = pods.watch(&WatchParams::default(), rv).await.unwrap().boxed();
    let mut seen = Vec::new();
    while !stop(&seen) {
        let event = tokio::time::timeout(testbed::wait::DEADLINE, stream.next())
            .await
            .expect("the next event arrives before the deadline")
            .expect("the watch stays open")
            .expect("no watch error");
        let (kind, pod) = match event {
            WatchEvent::Added(p) => ("ADDED", p),
            WatchEvent::Modified(p) => ("MODIFIED", p),
            WatchEvent::Deleted(p) => ("DELETED", p),
            // kube asks for bookmarks by default and the server sends one now and then: not a change of the pod.
            WatchEvent::Bookmark(_) => continue,
            other => panic!("unexpected {other:?}"),
        };
        seen.push((kind.to_string(), pod.name_any(), pod.metadata.deletion_timestamp.is_some()));
    }
    seen
}

fn current_rv(server: &FakeApiServer, name: &str) -> String {
    server.get("Pod", Some("default"), name).unwrap()["metadata"]["resourceVersion"].as_str().unwrap().to_string()
}

#[tokio::test]
async fn a_pod_terminates_for_its_grace_period_then_goes() {
    let server = graceful();
    let mut spec = pod_json("default", "web", "n1", json!({}));
    spec["spec"]["terminationGracePeriodSeconds"] = json!(600);
    server.upsert(spec).unwrap();
    let rv = current_rv(&server, "web");
    let pods: Api<Pod> = Api::namespaced(client(&server).await, "default");

    let terminating =
        pods.delete("web", &DeleteParams::default()).await.unwrap().left().expect("the pod, not a Status");
    assert!(terminating.metadata.deletion_timestamp.is_some());
    assert_eq!(terminating.metadata.deletion_grace_period_seconds, Some(600), "the pod's own grace period");
    let still = pods.get("web").await.unwrap();
    assert_eq!(still.metadata.deletion_grace_period_seconds, Some(600), "still there while it terminates");

    // A shorter grace period shortens it (as `kubectl delete --grace-period=1` does).
    pods.delete("web", &DeleteParams { grace_period_seconds: Some(1), ..DeleteParams::default() }).await.unwrap();
    let events = events_until(&pods, &rv, |seen| seen.iter().any(|(t, _, _)| t == "DELETED")).await;
    // The end of the grace period is the kubelet's grace-0 DELETE: written (MODIFIED), then gone (DELETED).
    let expected = [("MODIFIED", true), ("MODIFIED", true), ("MODIFIED", true), ("DELETED", true)];
    let got: Vec<(&str, bool)> = events.iter().map(|(t, _, term)| (t.as_str(), *term)).collect();
    assert_eq!(got, expected, "{events:?}");
    assert_eq!(api_error(pods.get("web").await).0, 404);
}

#[tokio::test]
async fn grace_zero_deletes_at_once_and_finalizers_hold() {
    let server = graceful();
    server.upsert(pod_json("default", "now", "n1", json!({}))).unwrap();
    let mut held = pod_json("default", "held", "n1", json!({}));
    held["metadata"]["finalizers"] = json!(["example.com/cleanup"]);
    server.upsert(held).unwrap();
    let rv = current_rv(&server, "held");
    let pods: Api<Pod> = Api::namespaced(client(&server).await, "default");

    pods.delete("now", &DeleteParams { grace_period_seconds: Some(0), ..DeleteParams::default() }).await.unwrap();
    assert_eq!(api_error(pods.get("now").await).0, 404, "grace 0 without finalizers deletes at once");

    let at_once = DeleteParams { grace_period_seconds: Some(0), ..DeleteParams::default() };
    let pending = pods.delete("held", &at_once).await.unwrap().left().expect("the pod");
    assert!(pending.metadata.deletion_timestamp.is_some());
    assert_eq!(pods.get("held").await.unwrap().finalizers(), ["example.com/cleanup"], "its finalizer holds it");
    let add = Patch::Merge(json!({"metadata": {"finalizers": ["example.com/cleanup", "late"]}}));
    assert_eq!(api_error(pods.patch("held", &PatchParams::default(), &add).await).0, 422, "no new finalizers");

    // The controller removes its finalizer (a JSON patch, as controllers do): the update deletes the pod.
    let remove =
        Patch::Json::<()>(serde_json::from_value(json!([{"op": "remove", "path": "/metadata/finalizers"}])).unwrap());
    pods.patch("held", &PatchParams::default(), &remove).await.unwrap();
    assert_eq!(api_error(pods.get("held").await).0, 404);
    let events = events_until(&pods, &rv, |seen| seen.iter().any(|(t, n, _)| t == "DELETED" && n == "held")).await;
    let held_events: Vec<&str> = events.iter().filter(|(_, n, _)| n == "held").map(|(t, _, _)| t.as_str()).collect();
    assert_eq!(held_events, ["MODIFIED", "DELETED"]);
}

#[tokio::test]
async fn the_test_control_deletes_gracefully_on_request_and_instantly_by_default() {
    let server = FakeApiServer::start().unwrap();
    let mut p = pod_json("default", "a", "n1", json!({}));
    p["metadata"]["finalizers"] = json!(["f"]);
    server.upsert(p.clone()).unwrap();
    let pods: Api<Pod> = Api::namespaced(client(&server).await, "default");
    pods.delete("a", &DeleteParams::default()).await.unwrap();
    assert!(server.get("Pod", Some("default"), "a").is_none(), "lenient: DELETE is instant, finalizers or not");

    // delete_gracefully works on any server, as a kubelet-facing test needs.
    let mut q = pod_json("default", "b", "n1", json!({}));
    q["spec"]["terminationGracePeriodSeconds"] = json!(1);
    server.upsert(q).unwrap();
    let rv = current_rv(&server, "b");
    let terminating = server.delete_gracefully("Pod", Some("default"), "b", None).unwrap();
    assert_eq!(terminating["metadata"]["deletionGracePeriodSeconds"], 1);
    let events = events_until(&pods, &rv, |seen| seen.len() == 3).await;
    assert_eq!(events.iter().map(|(t, _, _)| t.as_str()).collect::<Vec<_>>(), ["MODIFIED", "MODIFIED", "DELETED"]);
}

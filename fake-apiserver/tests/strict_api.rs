//! Request-level strictness through the real kube client and raw HTTP: throttling with Retry-After, the real
//! patch semantics, field selectors per kind, and paged lists as one consistent snapshot.

mod support;

use fake_apiserver::{Config, FakeApiServer, Throttle};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::ResourceExt;
use serde_json::json;
use support::{api_error, client, client_with_token, pod_json, raw};

#[tokio::test]
async fn throttled_requests_get_429_with_retry_after() {
    let server = FakeApiServer::start().unwrap();
    server.upsert(pod_json("default", "p", "n1", json!({}))).unwrap();

    // kube retries 429 after the server's Retry-After: the call succeeds on the third attempt.
    server.set_throttle(Some(Throttle::Next { count: 2, retry_after_seconds: 1 }));
    let pods: Api<Pod> = Api::namespaced(client(&server).await, "default");
    pods.get("p").await.unwrap();
    let statuses: Vec<u16> = server.requests().iter().map(|r| r.status).collect();
    assert_eq!(statuses, [429, 429, 200]);

    // What the client sees on the wire.
    let no_retry = client_with_token(&server, "fake-token").await;
    server.set_throttle(Some(Throttle::Next { count: 1, retry_after_seconds: 7 }));
    let (status, headers, body) = raw(&no_retry, "GET", "/api/v1/namespaces/default/pods/p", "", "").await;
    assert_eq!(status, 429);
    assert_eq!(headers.get("retry-after").and_then(|v| v.to_str().ok()), Some("7"));
    assert_eq!(
        (body["reason"].as_str(), body["details"]["retryAfterSeconds"].as_u64()),
        (Some("TooManyRequests"), Some(7))
    );
    assert_eq!(raw(&no_retry, "GET", "/api/v1/namespaces/default/pods/p", "", "").await.0, 200, "only the next N");

    // A fraction, set and cleared over the test endpoint.
    let (status, _, _) = raw(&no_retry, "PUT", "/fake/throttle", "application/json", r#"{"fraction": 1.0}"#).await;
    assert_eq!(status, 200);
    for _ in 0..3 {
        assert_eq!(raw(&no_retry, "GET", "/api/v1/pods", "", "").await.0, 429);
    }
    assert_eq!(raw(&no_retry, "DELETE", "/fake/throttle", "", "").await.0, 200);
    assert_eq!(raw(&no_retry, "GET", "/api/v1/pods", "", "").await.0, 200);
}

#[tokio::test]
async fn patches_have_their_real_semantics() {
    let server = FakeApiServer::start().unwrap();
    let mut p = pod_json("default", "p", "n1", json!({"a": "1"}));
    p["spec"]["containers"] = json!([{"name": "app", "image": "app:1"}, {"name": "istio-proxy", "image": "proxy:1"}]);
    server.upsert(p).unwrap();
    let client = client(&server).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let images = |p: &Pod| -> Vec<String> {
        p.spec
            .as_ref()
            .unwrap()
            .containers
            .iter()
            .map(|c| format!("{}={}", c.name, c.image.clone().unwrap_or_default()))
            .collect()
    };

    // Strategic merge: containers merge by name (a merge patch would have replaced the list).
    let smp = Patch::Strategic(json!({"spec": {"containers": [{"name": "app", "image": "app:2"}]}}));
    let merged = pods.patch("p", &PatchParams::default(), &smp).await.unwrap();
    assert_eq!(images(&merged), ["app=app:2", "istio-proxy=proxy:1"]);
    let delete = Patch::Strategic(json!({"spec": {"containers": [{"name": "istio-proxy", "$patch": "delete"}]}}));
    // The directive applies, and the result removes a container, which a pod update may not (422, as the real
    // server; the directive itself is unit-tested in the patch module).
    assert_eq!(api_error(pods.patch("p", &PatchParams::default(), &delete).await).0, 422);

    // Merge patch: RFC 7386, lists replaced; for a pod that changes its spec beyond images, which the real
    // server refuses (422), as the fake now does.
    let mp = Patch::Merge(json!({"spec": {"containers": [{"name": "only", "image": "x"}]}}));
    let (code, reason, message) = api_error(pods.patch("p", &PatchParams::default(), &mp).await);
    assert_eq!((code, reason.as_str()), (422, "Invalid"));
    assert!(message.starts_with("Pod \"p\" is invalid: spec: Forbidden: pod updates may not change"), "{message}");
    let mp = Patch::Merge(json!({"spec": {"containers": [{"name": "app", "image": "x"},
                                                         {"name": "istio-proxy", "image": "proxy:1"}]}}));
    assert_eq!(images(&pods.patch("p", &PatchParams::default(), &mp).await.unwrap()), ["app=x", "istio-proxy=proxy:1"]);

    // JSON patch: RFC 6902, including a failing test operation (422).
    let ops = |v| Patch::Json::<()>(serde_json::from_value(v).unwrap());
    let add = ops(json!([{"op": "add", "path": "/metadata/labels/b", "value": "2"},
                         {"op": "replace", "path": "/spec/containers/0/image", "value": "y"}]));
    let patched = pods.patch("p", &PatchParams::default(), &add).await.unwrap();
    assert_eq!(patched.labels().get("b").map(String::as_str), Some("2"));
    assert_eq!(images(&patched), ["app=y", "istio-proxy=proxy:1"]);
    let failing = ops(json!([{"op": "test", "path": "/metadata/labels/a", "value": "nope"}]));
    assert_eq!(api_error(pods.patch("p", &PatchParams::default(), &failing).await).0, 422);

    // What the fake does not implement, it refuses as the real server would.
    let weird = Patch::Strategic(json!({"spec": {"$unknownDirective": 1}}));
    assert_eq!(api_error(pods.patch("p", &PatchParams::default(), &weird).await).0, 422);
    let path = "/api/v1/namespaces/default/pods/p";
    let (status, _, body) = raw(&client, "PATCH", path, "application/json", r#"{"metadata": {}}"#).await;
    assert_eq!((status, body["reason"].as_str()), (415, Some("UnsupportedMediaType")));
}

#[tokio::test]
async fn field_selectors_are_the_real_servers_when_strict() {
    let strict =
        FakeApiServer::builder().config(Config { strict_field_selectors: true, ..Config::default() }).start().unwrap();
    let lenient = FakeApiServer::start().unwrap();
    for server in [&strict, &lenient] {
        let mut p = pod_json("default", "p", "n1", json!({}));
        p["status"] = json!({"phase": "Running", "podIP": "10.0.0.5"});
        server.upsert(p).unwrap();
        server.upsert(json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}})).unwrap();
    }
    let pods: Api<Pod> = Api::all(client(&strict).await);
    let supported = "spec.nodeName=n1,status.phase=Running,status.podIP=10.0.0.5,spec.hostNetwork=false";
    assert_eq!(pods.list(&ListParams::default().fields(supported)).await.unwrap().items.len(), 1);
    let (code, reason, message) = api_error(pods.list(&ListParams::default().fields("spec.containers=x")).await);
    assert_eq!(
        (code, reason.as_str(), message.as_str()),
        (400, "BadRequest", "field label not supported: spec.containers")
    );
    let nodes: Api<Node> = Api::all(client(&strict).await);
    assert_eq!(nodes.list(&ListParams::default().fields("spec.unschedulable=false")).await.unwrap().items.len(), 1);
    assert_eq!(api_error(nodes.list(&ListParams::default().fields("spec.nodeName=n1")).await).0, 400);

    let lenient_pods: Api<Pod> = Api::all(client(&lenient).await);
    let anything = ListParams::default().fields("spec.containers=x");
    assert!(lenient_pods.list(&anything).await.unwrap().items.is_empty(), "the default accepts any path");
}

#[tokio::test]
async fn paged_lists_are_one_snapshot_until_compacted() {
    let server = FakeApiServer::start().unwrap();
    for name in ["a", "b", "c", "d"] {
        server.upsert(pod_json("default", name, "n1", json!({}))).unwrap();
    }
    let pods: Api<Pod> = Api::all(client(&server).await);
    let first = pods.list(&ListParams::default().limit(2)).await.unwrap();
    let names = |l: &kube::core::ObjectList<Pod>| l.items.iter().map(|p| p.name_any()).collect::<Vec<_>>();
    assert_eq!(names(&first), ["a", "b"]);
    assert_eq!(first.metadata.remaining_item_count, Some(2));
    let token = first.metadata.continue_.clone().unwrap();

    // Changes after the first page do not show in later pages: they are read at the first page's version.
    server.delete("Pod", Some("default"), "c");
    server.upsert(pod_json("default", "bb", "n1", json!({}))).unwrap();
    server.upsert(pod_json("default", "d", "n1", json!({"changed": "yes"}))).unwrap();
    let rest = pods.list(&ListParams::default().limit(5).continue_token(&token)).await.unwrap();
    assert_eq!(names(&rest), ["c", "d"]);
    assert!(rest.items[1].labels().is_empty(), "d as it was");
    assert_eq!(rest.metadata.resource_version, first.metadata.resource_version, "the pinned version");
    assert_eq!(names(&pods.list(&ListParams::default()).await.unwrap()), ["a", "b", "bb", "d"]);

    server.compact();
    let (code, reason, _) = api_error(pods.list(&ListParams::default().limit(2).continue_token(&token)).await);
    assert_eq!((code, reason.as_str()), (410, "Expired"));
    assert_eq!(api_error(pods.list(&ListParams::default().continue_token("bogus")).await).0, 400);
}

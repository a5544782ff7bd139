//! The strict fake held to the real kube-apiserver: each scenario runs as one function against a fake with
//! [`Config::strict`] and against a real kube-apiserver + etcd ([`testbed::real_apiserver`]), and both must
//! give the same answers, after normalizing only what differs by nature (uids, timestamps, resourceVersion
//! values). Each scenario's answers are also pinned here as the real server gave them (kube-apiserver
//! v1.34.4), so the fake is checked even where the real binaries are not built (the real half then prints
//! `SKIPPED: ...`; `REAL_NODE_REQUIRED=1` makes that a failure).

mod support;

use fake_apiserver::{Config, FakeApiServer, User};
use futures::StreamExt;
use http_body_util::BodyExt;
use kube::Client;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;
use support::{client_from_kubeconfig, client_from_kubeconfig_with, raw};
use testbed::real_apiserver::{self, RealApiServer};

/// One server under test, with clients for the admin, an unprivileged user and no credentials at all.
struct Target {
    name: &'static str,
    admin: Client,
    user: Client,
    anonymous: Client,
    invalid: Client,
    fake: Option<FakeApiServer>,
    real: Option<RealApiServer>,
}

impl Target {
    async fn from_kubeconfigs(name: &'static str, admin: &str, user: &str, invalid: &str) -> Target {
        let no_retry = |c: &mut kube::Config| c.default_retry = false;
        let anonymous = client_from_kubeconfig_with(admin, |c| {
            c.default_retry = false;
            c.auth_info = Default::default();
        })
        .await;
        Target {
            name,
            admin: client_from_kubeconfig(admin).await,
            user: client_from_kubeconfig_with(user, no_retry).await,
            anonymous,
            invalid: client_from_kubeconfig_with(invalid, no_retry).await,
            fake: None,
            real: None,
        }
    }

    async fn fake() -> Target {
        let server = FakeApiServer::builder().config(Config::strict()).start().unwrap();
        let alice = server.cluster().token_for(&User::new(real_apiserver::USER_NAME, &real_apiserver::USER_GROUPS));
        let mut t = Target::from_kubeconfigs(
            "fake",
            &server.kubeconfig_yaml(),
            &server.kubeconfig_with_token(&alice),
            &server.kubeconfig_with_token("not-a-token"),
        )
        .await;
        t.fake = Some(server);
        t
    }

    async fn real() -> Option<Target> {
        let server = RealApiServer::start()?;
        let mut t = Target::from_kubeconfigs(
            "real",
            &server.kubeconfig_yaml(),
            &server.kubeconfig_with_token(real_apiserver::USER_TOKEN),
            &server.kubeconfig_with_token("not-a-token"),
        )
        .await;
        t.real = Some(server);
        Some(t)
    }

    /// Compacts the history: the fake's, or etcd's at its current revision.
    fn compact(&self) {
        if let Some(f) = &self.fake {
            f.compact();
        }
        if let Some(r) = &self.real {
            r.compact();
        }
    }

    /// `method path` as the admin: `(status, body)`.
    async fn admin(&self, method: &str, path: &str, content_type: &str, body: Value) -> (u16, Value) {
        call(&self.admin, method, path, content_type, body).await
    }

    /// Like [`Target::admin`], failing the test unless the answer is a success.
    async fn ok(&self, method: &str, path: &str, content_type: &str, body: Value) -> Value {
        let (status, answer) = self.admin(method, path, content_type, body).await;
        assert!((200..300).contains(&status), "{}: {method} {path} answered {status}: {answer}", self.name);
        answer
    }

    /// A namespace with its `default` ServiceAccount (no controller creates it on the real server here).
    async fn namespace(&self, ns: &str) {
        self.ok(
            "POST",
            "/api/v1/namespaces",
            JSON,
            json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}),
        )
        .await;
        let sa = json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}});
        self.ok("POST", &format!("/api/v1/namespaces/{ns}/serviceaccounts"), JSON, sa).await;
    }

    async fn create_pod(&self, ns: &str, name: &str, node: &str, extra_meta: Value) -> Value {
        let mut pod = json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"nodeName": node, "automountServiceAccountToken": false,
                     "containers": [{"name": "app", "image": "busybox"}]}
        });
        if let Value::Object(m) = extra_meta {
            for (k, v) in m {
                pod["metadata"][k] = v;
            }
        }
        self.ok("POST", &format!("/api/v1/namespaces/{ns}/pods"), JSON, pod).await
    }
}

const JSON: &str = "application/json";
const MERGE: &str = "application/merge-patch+json";
const SMP: &str = "application/strategic-merge-patch+json";

async fn call(client: &Client, method: &str, path: &str, content_type: &str, body: Value) -> (u16, Value) {
    let text = if body.is_null() { String::new() } else { body.to_string() };
    let (status, _, answer) = raw(client, method, path, content_type, &text).await;
    (status, answer)
}

/// Both targets: the fake first, then the real server when its binaries are built.
async fn targets() -> Vec<Target> {
    let mut all = vec![Target::fake().await];
    if let Some(real) = Target::real().await {
        all.push(real);
    }
    all
}

/// What the real server answered in scenario `name`, kept in `tests/real_conformance/<name>.json`.
macro_rules! pinned {
    ($name:literal) => {
        serde_json::from_str::<Value>(include_str!(concat!("real_conformance/", $name, ".json")))
            .expect("the pinned answers parse")
    };
}

/// Runs `scenario` on every target and checks that each gives `expected` (what the real server answered).
async fn conform<F, Fut>(expected: Value, scenario: F)
where
    F: Fn(Arc<Target>) -> Fut,
    Fut: std::future::Future<Output = Value>,
{
    let mut answers = Vec::new();
    for target in targets().await {
        let name = target.name;
        // The scenario may hold only some fields of its target: this keeps the servers up until it is done.
        let target = Arc::new(target);
        answers.push((name, scenario(target.clone()).await));
    }
    if let Ok(dir) = std::env::var("CONFORM_DUMP") {
        let test = std::thread::current().name().unwrap_or("scenario").replace("::", "-");
        for (name, got) in &answers {
            let text = serde_json::to_string_pretty(got).unwrap();
            std::fs::write(format!("{dir}/{test}.{name}.json"), text).unwrap();
        }
    }
    let differ: Vec<String> = answers
        .iter()
        .filter(|(_, got)| *got != expected)
        .map(|(name, got)| format!("--- the {name} server answered:\n{}", serde_json::to_string_pretty(got).unwrap()))
        .collect();
    assert!(
        differ.is_empty(),
        "answers differ from the real server's (pinned):\n{}\n--- pinned:\n{}",
        differ.join("\n"),
        serde_json::to_string_pretty(&expected).unwrap()
    );
}

/// `text` with every run of 3 or more digits replaced by `N` (resourceVersions inside messages).
fn digits(text: &str) -> String {
    let mut out = String::new();
    let mut run = String::new();
    for c in text.chars().chain(std::iter::once('\0')) {
        if c.is_ascii_digit() {
            run.push(c);
            continue;
        }
        out.push_str(if run.len() >= 3 { "N" } else { &run });
        run.clear();
        if c != '\0' {
            out.push(c);
        }
    }
    out
}

/// `value` with what differs by nature replaced by placeholders: uids, timestamps, resourceVersions.
fn normalize(value: &Value) -> Value {
    match value {
        Value::Object(map) => Value::Object(
            map.iter()
                .filter(|(k, _)| k.as_str() != "managedFields")
                .map(|(k, v)| {
                    let v = match k.as_str() {
                        "uid" | "resourceVersion" | "creationTimestamp" | "deletionTimestamp" if v.is_string() => {
                            json!(format!("<{k}>"))
                        }
                        "message" if v.is_string() => json!(digits(v.as_str().unwrap_or_default())),
                        _ => normalize(v),
                    };
                    (k.clone(), v)
                })
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(normalize).collect()),
        other => other.clone(),
    }
}

/// `value` with every `message` cut to its first line: the real server appends a diff of the pod specs to
/// the message of a refused pod update, in Go's syntax, which the fake does not reproduce.
fn first_lines(value: &Value) -> Value {
    match value {
        Value::Object(map) => Value::Object(
            map.iter()
                .map(|(k, v)| match (k.as_str(), v.as_str()) {
                    ("message", Some(m)) => (k.clone(), json!(m.lines().next().unwrap_or_default())),
                    _ => (k.clone(), first_lines(v)),
                })
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(first_lines).collect()),
        other => other.clone(),
    }
}

/// The lines of a watch on `path` until the server ends it or `max` events arrived (the deadline fails).
async fn watch(client: &Client, path: &str, max: usize) -> Vec<Value> {
    let request = http::Request::builder().uri(path).body(kube::client::Body::empty()).unwrap();
    let response = client.send(request).await.expect("the watch is answered");
    assert_eq!(response.status().as_u16(), 200, "watch {path}");
    let mut body = response.into_body().into_data_stream();
    let mut buffer = Vec::new();
    let mut events = Vec::new();
    let read = async {
        while events.len() < max {
            let Some(chunk) = body.next().await else { break };
            buffer.extend_from_slice(&chunk.expect("the stream reads"));
            while let Some(end) = buffer.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = buffer.drain(..=end).collect();
                let e = serde_json::from_slice::<Value>(&line).expect("a JSON event");
                if std::env::var_os("CONFORM_DUMP").is_some() {
                    eprintln!("{path}: {e}");
                }
                events.push(e);
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(20), read).await.expect("the watch ends or delivers in time");
    events
}

/// An event as `TYPE name` plus the parts of the object a scenario looks at.
fn event(e: &Value) -> Value {
    let o = &e["object"];
    json!({
        "type": e["type"],
        "name": o["metadata"]["name"],
        "labels": o["metadata"]["labels"],
        "terminating": o["metadata"].get("deletionTimestamp").is_some(),
        "grace": o["metadata"]["deletionGracePeriodSeconds"],
        "finalizers": o["metadata"]["finalizers"],
    })
}

fn rv(obj: &Value) -> String {
    obj["metadata"]["resourceVersion"].as_str().expect("a resourceVersion").to_string()
}

#[tokio::test]
async fn watches_resume_from_a_resource_version_and_bookmark_on_request() {
    conform(pinned!("watches_resume_from_a_resource_version_and_bookmark_on_request"), |t| async move {
        let ns = "conf-watch";
        t.namespace(ns).await;
        let a = t.create_pod(ns, "a", "n1", json!({})).await;
        let from = rv(&a);
        t.create_pod(ns, "b", "n1", json!({})).await;
        t.ok("PATCH", &format!("/api/v1/namespaces/{ns}/pods/a"), MERGE, json!({"metadata": {"labels": {"x": "1"}}}))
            .await;
        t.ok("DELETE", &format!("/api/v1/namespaces/{ns}/pods/b?gracePeriodSeconds=0"), JSON, Value::Null).await;
        let pods = format!("/api/v1/namespaces/{ns}/pods");
        let resumed = watch(&t.admin, &format!("{pods}?watch=true&resourceVersion={from}"), 3).await;
        let now = t.ok("GET", &pods, JSON, Value::Null).await;
        let now = rv(&now);
        let bookmarks = watch(
            &t.admin,
            &format!("{pods}?watch=true&resourceVersion={from}&allowWatchBookmarks=true&timeoutSeconds=5"),
            10,
        )
        .await;
        let plain = watch(&t.admin, &format!("{pods}?watch=true&resourceVersion={now}&timeoutSeconds=3"), 10).await;
        json!({
            "resumed": resumed.iter().map(event).collect::<Vec<_>>(),
            "bookmarks": bookmarks.iter().map(event).collect::<Vec<_>>(),
            "plain": plain,
        })
    })
    .await;
}

#[tokio::test]
async fn old_resource_versions_get_410() {
    conform(pinned!("old_resource_versions_get_410"), |t| async move {
        let ns = "conf-gone";
        t.namespace(ns).await;
        let cms = format!("/api/v1/namespaces/{ns}/configmaps");
        let c = t.ok("POST", &cms, JSON, json!({"metadata": {"name": "c"}, "data": {"k": "1"}})).await;
        for k in ["2", "3"] {
            t.ok("PUT", &format!("{cms}/c"), JSON, json!({"metadata": {"name": "c"}, "data": {"k": k}})).await;
        }
        let current = rv(&t.ok("GET", &cms, JSON, Value::Null).await);
        t.compact();
        let compacted = watch(&t.admin, &format!("{cms}?watch=true&resourceVersion={}", rv(&c)), 5).await;
        t.ok("POST", &cms, JSON, json!({"metadata": {"name": "d"}})).await;
        let still = watch(&t.admin, &format!("{cms}?watch=true&resourceVersion={current}"), 1).await;
        json!({
            // The message names the layer that answered: etcd here ("The resourceVersion for the provided watch
            // is too old."), the watch cache in the fake ("too old resource version: X (Y)").
            "compacted": compacted.iter().map(|e| {
                let mut e = normalize(e);
                let m = e["object"]["message"].as_str().unwrap_or_default().to_lowercase();
                e["object"]["message"] = json!(m.contains("too old"));
                e
            }).collect::<Vec<_>>(),
            "current": still.iter().map(|e| json!([e["type"], e["object"]["metadata"]["name"]])).collect::<Vec<_>>(),
        })
    })
    .await;
}

#[tokio::test]
async fn pod_deletion_is_graceful() {
    conform(pinned!("pod_deletion_is_graceful"), |t| async move {
        let ns = "conf-delete";
        t.namespace(ns).await;
        let pods = format!("/api/v1/namespaces/{ns}/pods");
        let web = t.create_pod(ns, "web", "n1", json!({})).await;
        t.create_pod(ns, "held", "n1", json!({"finalizers": ["example.com/hold"]})).await;
        t.create_pod(ns, "unscheduled", "", json!({})).await;
        let meta = |o: &Value| {
            json!({"kind": o["kind"], "name": o["metadata"]["name"],
                   "terminating": o["metadata"].get("deletionTimestamp").is_some(),
                   "grace": o["metadata"]["deletionGracePeriodSeconds"], "finalizers": o["metadata"]["finalizers"]})
        };
        let mut seen = Vec::new();
        let (code, first) = t.admin("DELETE", &format!("{pods}/web"), JSON, Value::Null).await;
        seen.push(json!([code, meta(&first)]));
        let (code, still) = t.admin("GET", &format!("{pods}/web"), JSON, Value::Null).await;
        seen.push(json!([code, meta(&still)]));
        let (code, again) = t.admin("DELETE", &format!("{pods}/web"), JSON, json!({"gracePeriodSeconds": 0})).await;
        seen.push(json!([code, meta(&again)]));
        let (code, gone) = t.admin("GET", &format!("{pods}/web"), JSON, Value::Null).await;
        seen.push(json!([code, normalize(&gone)]));
        let (code, held) = t.admin("DELETE", &format!("{pods}/held?gracePeriodSeconds=0"), JSON, Value::Null).await;
        seen.push(json!([code, meta(&held)]));
        let release = json!({"metadata": {"finalizers": null}});
        let (code, released) = t.admin("PATCH", &format!("{pods}/held"), MERGE, release).await;
        seen.push(json!([code, meta(&released)]));
        let (code, unscheduled) = t.admin("DELETE", &format!("{pods}/unscheduled"), JSON, Value::Null).await;
        seen.push(json!([code, meta(&unscheduled)]));
        let events = watch(&t.admin, &format!("{pods}?watch=true&resourceVersion={}", rv(&web)), 7).await;
        json!({"answers": seen, "events": events.iter().map(event).collect::<Vec<_>>()})
    })
    .await;
}

#[tokio::test]
async fn field_selectors_are_the_real_servers() {
    conform(pinned!("field_selectors_are_the_real_servers"), |t| async move {
        let ns = "conf-fields";
        t.namespace(ns).await;
        for (name, node) in [("p1", "n1"), ("p2", "n2"), ("p3", "n1")] {
            t.create_pod(ns, name, node, json!({})).await;
        }
        let pods = format!("/api/v1/namespaces/{ns}/pods");
        t.ok("PATCH", &format!("{pods}/p3/status"), MERGE, json!({"status": {"phase": "Running"}})).await;
        let mut seen = serde_json::Map::new();
        for selector in [
            "spec.nodeName=n1",
            "spec.nodeName!=n1",
            "metadata.name=p2",
            "status.phase=Running",
            "status.phase!=Running",
            "spec.nodeName=n1,status.phase=Running",
            "spec.nodeName==n2",
            "spec.containers=x",
            "metadata.labels=x",
        ] {
            let (code, list) = t.admin("GET", &format!("{pods}?fieldSelector={selector}"), JSON, Value::Null).await;
            let answer = match list["items"].as_array() {
                Some(items) => json!(items.iter().map(|p| p["metadata"]["name"].clone()).collect::<Vec<_>>()),
                None => normalize(&list),
            };
            seen.insert(selector.to_string(), json!([code, answer]));
        }
        let (code, watch_bad) =
            t.admin("GET", "/api/v1/pods?watch=true&fieldSelector=spec.containers=x", JSON, Value::Null).await;
        seen.insert("watch spec.containers=x".to_string(), json!([code, watch_bad]));
        Value::Object(seen)
    })
    .await;
}

#[tokio::test]
async fn rbac_denials_are_403_statuses() {
    conform(pinned!("rbac_denials_are_403_statuses"), |t| async move {
        let ns = "conf-rbac";
        t.namespace(ns).await;
        t.create_pod(ns, "p", "n1", json!({})).await;
        let pods = format!("/api/v1/namespaces/{ns}/pods");
        let mut seen = Vec::new();
        for (method, path, body) in [
            ("GET", format!("{pods}/p"), Value::Null),
            ("GET", pods.clone(), Value::Null),
            ("GET", "/api/v1/pods?watch=true".to_string(), Value::Null),
            ("GET", "/api/v1/nodes/n1".to_string(), Value::Null),
            ("PATCH", format!("{pods}/p/status"), json!({"status": {"phase": "Running"}})),
            ("DELETE", format!("{pods}/p"), Value::Null),
            ("POST", format!("/api/v1/namespaces/{ns}/configmaps"), json!({"metadata": {"name": "c"}})),
            ("GET", "/apis/apps/v1/namespaces/x/daemonsets".to_string(), Value::Null),
            ("GET", "/metrics".to_string(), Value::Null),
            ("GET", "/version".to_string(), Value::Null),
        ] {
            let ct = if method == "PATCH" { MERGE } else { JSON };
            let (code, answer) = call(&t.user, method, &path, ct, body).await;
            let answer = if code == 200 { json!("ok") } else { answer };
            seen.push(json!([method, path, code, answer]));
        }
        // A Role bound to the user grants at once (the real server: once its informer saw the binding).
        let rbac = format!("/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}");
        let role = json!({"metadata": {"name": "reader"},
                          "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}]});
        t.ok("POST", &format!("{rbac}/roles"), JSON, role).await;
        let binding = json!({"metadata": {"name": "reader"},
                             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "reader"},
                             "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User",
                                           "name": real_apiserver::USER_NAME}]});
        t.ok("POST", &format!("{rbac}/rolebindings"), JSON, binding).await;
        testbed::wait::eventually_awaiting("the binding grants", || async {
            (call(&t.user, "GET", &format!("{pods}/p"), JSON, Value::Null).await.0 == 200).then_some(())
        })
        .await;
        let (code, list) = call(&t.user, "GET", &pods, JSON, Value::Null).await;
        seen.push(json!(["GET", pods, code, list]));
        json!(seen)
    })
    .await;
}

#[tokio::test]
async fn patches_have_the_real_semantics() {
    conform(pinned!("patches_have_the_real_semantics"), |t| async move {
        let ns = "conf-patch";
        t.namespace(ns).await;
        t.create_pod(ns, "p", "n1", json!({"annotations": {"keep": "1"}})).await;
        let pod = format!("/api/v1/namespaces/{ns}/pods/p");
        let mut seen = Vec::new();
        for (ct, patch) in [
            (SMP, json!({"metadata": {"annotations": {"a": "1", "b": "2"}}})),
            (SMP, json!({"metadata": {"annotations": {"a": null, "c": "3"}}})),
            (MERGE, json!({"metadata": {"annotations": {"b": null, "d": "4"}}})),
            (SMP, json!({"spec": {"containers": [{"name": "app", "image": "busybox:2"}]}})),
        ] {
            let (code, o) = t.admin("PATCH", &pod, ct, patch).await;
            let images: Vec<Value> = o["spec"]["containers"]
                .as_array()
                .map(|c| c.iter().map(|c| json!([c["name"], c["image"]])).collect())
                .unwrap_or_default();
            seen.push(json!([code, o["metadata"]["annotations"], images]));
        }
        let (code, unknown) = t.admin("PATCH", &pod, JSON, json!({"metadata": {}})).await;
        seen.push(json!([code, unknown]));
        let (code, replaced) =
            t.admin("PATCH", &pod, MERGE, json!({"spec": {"containers": [{"name": "x", "image": "x"}]}})).await;
        seen.push(json!([code, first_lines(&replaced)]));

        let ds = json!({
            "apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": "ds"},
            "spec": {"selector": {"matchLabels": {"app": "ds"}},
                     "template": {"metadata": {"labels": {"app": "ds"}},
                                  "spec": {"containers": [{"name": "app", "image": "app:1"},
                                                          {"name": "side", "image": "side:1"}]}}}
        });
        let dss = format!("/apis/apps/v1/namespaces/{ns}/daemonsets");
        t.ok("POST", &dss, JSON, ds).await;
        let containers = |o: &Value| -> Vec<Value> {
            o["spec"]["template"]["spec"]["containers"]
                .as_array()
                .map(|c| c.iter().map(|c| json!([c["name"], c["image"]])).collect())
                .unwrap_or_default()
        };
        let containers_patch = |list: Value| json!({"spec": {"template": {"spec": {"containers": list}}}});
        let smp = containers_patch(json!([{"name": "app", "image": "app:2"}]));
        let (code, merged) = t.admin("PATCH", &format!("{dss}/ds"), SMP, smp).await;
        seen.push(json!([code, containers(&merged), merged["metadata"]["generation"]]));
        let mp = containers_patch(json!([{"name": "only", "image": "only:1"}]));
        let (code, replaced) = t.admin("PATCH", &format!("{dss}/ds"), MERGE, mp).await;
        seen.push(json!([code, containers(&replaced), replaced["metadata"]["generation"]]));
        json!(seen)
    })
    .await;
}

#[tokio::test]
async fn unauthenticated_and_forbidden_bodies() {
    conform(pinned!("unauthenticated_and_forbidden_bodies"), |t| async move {
        let mut seen = Vec::new();
        for (who, client) in [("invalid", &t.invalid), ("anonymous", &t.anonymous), ("user", &t.user)] {
            for path in ["/api/v1/pods", "/api/v1/namespaces/default/pods/x", "/version", "/api/v1", "/healthz"] {
                let (code, body) = call(client, "GET", path, JSON, Value::Null).await;
                let body = if code == 200 { json!("ok") } else { body };
                seen.push(json!([who, path, code, body]));
            }
        }
        json!(seen)
    })
    .await;
}

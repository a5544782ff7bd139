//! Helpers shared by the integration tests: kube clients for a fake server, and test objects.

use fake_apiserver::FakeApiServer;
use k8s_openapi::api::core::v1::Pod;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};
use serde_json::{json, Value};

/// A kube client configured exactly as a user would: from the kubeconfig the server hands out.
pub async fn client_from_kubeconfig(yaml: &str) -> Client {
    let kubeconfig = Kubeconfig::from_yaml(yaml).expect("the kubeconfig parses");
    let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .expect("kube accepts the kubeconfig");
    Client::try_from(config).expect("kube builds a client")
}

#[allow(dead_code)] // not every test binary uses every helper
pub async fn client(server: &FakeApiServer) -> Client {
    client_from_kubeconfig(&server.kubeconfig_yaml()).await
}

/// A pod as JSON, for `FakeApiServer::upsert`.
#[allow(dead_code)]
pub fn pod_json(ns: &str, name: &str, node: &str, labels: Value) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {"nodeName": node, "containers": [{"name": "app", "image": "busybox"}]}
    })
}

/// The same pod as a typed `Pod`, for kube calls.
#[allow(dead_code)]
pub fn pod(ns: &str, name: &str, node: &str, labels: Value) -> Pod {
    serde_json::from_value(pod_json(ns, name, node, labels)).expect("test pod is a valid Pod")
}

/// A kube client from `yaml` whose config `adjust` changed first (e.g. `default_retry = false`, to see 429s).
#[allow(dead_code)]
pub async fn client_from_kubeconfig_with(yaml: &str, adjust: impl FnOnce(&mut Config)) -> Client {
    let kubeconfig = Kubeconfig::from_yaml(yaml).expect("the kubeconfig parses");
    let mut config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .expect("kube accepts the kubeconfig");
    adjust(&mut config);
    Client::try_from(config).expect("kube builds a client")
}

/// A kube client of `server` that authenticates with `token` and does not retry (so tests see every answer).
#[allow(dead_code)]
pub async fn client_with_token(server: &FakeApiServer, token: &str) -> Client {
    client_from_kubeconfig_with(&server.kubeconfig_with_token(token), |c| c.default_retry = false).await
}

/// One raw request through `client` (its TLS and token), for what the typed API hides: status codes, headers,
/// content types. Returns the status, the headers and the body as JSON (`Null` when it is not JSON).
#[allow(dead_code)]
pub async fn raw(
    client: &Client,
    method: &str,
    path: &str,
    content_type: &str,
    body: &str,
) -> (u16, http::HeaderMap, Value) {
    let request = http::Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", content_type)
        .body(kube::client::Body::from(body.as_bytes().to_vec()))
        .expect("a valid request");
    let response = client.send(request).await.expect("the server answers");
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let bytes = response.into_body().collect_bytes().await.expect("the body arrives");
    (status, headers, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
}

/// The `kube::Error::Api` status of a failed call: `(code, reason, message)`.
#[allow(dead_code)]
pub fn api_error<T: std::fmt::Debug>(result: Result<T, kube::Error>) -> (u16, String, String) {
    match result {
        Err(kube::Error::Api(status)) => (status.code, status.reason.clone(), status.message.clone()),
        other => panic!("expected an API error, got {other:?}"),
    }
}

/// A non-retrying kube client from kubeconfig `yaml` with its token replaced by `token`.
#[allow(dead_code)]
pub async fn client_with_token_yaml(yaml: &str, token: &str) -> Client {
    let mut value: serde_yaml::Value = serde_yaml::from_str(yaml).expect("the kubeconfig parses");
    value["users"][0]["user"]["token"] = serde_yaml::Value::from(token);
    let yaml = serde_yaml::to_string(&value).expect("the kubeconfig serialises");
    client_from_kubeconfig_with(&yaml, |c| c.default_retry = false).await
}

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

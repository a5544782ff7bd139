//! The kubeconfig that points clients (kube, kubectl, the CNI plugin) at a fake server.

use serde_json::json;

/// A kubeconfig with one cluster at `url`, a dummy token user and a current context named `fake`.
pub fn kubeconfig_yaml(url: &str) -> String {
    let config = json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "fake", "cluster": {"server": url}}],
        "users": [{"name": "fake", "user": {"token": "fake-token"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": "default"}}],
        "current-context": "fake",
        "preferences": {},
    });
    serde_yaml::to_string(&config).unwrap_or_default()
}

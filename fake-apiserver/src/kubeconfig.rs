//! The kubeconfig that points clients (kube, kubectl, the CNI plugin) at a fake server.

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use serde_json::json;

/// A kubeconfig with one cluster at `url`, a dummy token user and a current context named `fake`: what a
/// lenient (plain http, no authentication) server hands out.
pub fn kubeconfig_yaml(url: &str) -> String {
    kubeconfig_yaml_with(url, None, "fake-token")
}

/// A kubeconfig with one cluster at `url`, trusting `ca_pem` (as `certificate-authority-data`) when given,
/// and a user authenticating with bearer `token`; the current context is named `fake`.
pub fn kubeconfig_yaml_with(url: &str, ca_pem: Option<&str>, token: &str) -> String {
    let mut cluster = json!({"server": url});
    if let Some(pem) = ca_pem {
        cluster["certificate-authority-data"] = json!(STANDARD.encode(pem));
    }
    let config = json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "fake", "cluster": cluster}],
        "users": [{"name": "fake", "user": {"token": token}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": "default"}}],
        "current-context": "fake",
        "preferences": {},
    });
    serde_yaml::to_string(&config).unwrap_or_default()
}

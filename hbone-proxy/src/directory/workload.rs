//! What a workload is, as ztunnel's local config describes it, and the parser of that YAML file.
//!
//! Kept free of the proxy's runtime (no watcher, no tokio): it builds without the `runtime` feature, as the fuzz
//! targets use it.

use std::net::IpAddr;

use serde::{Deserialize, Serialize};

/// How a workload accepts traffic (ztunnel's `protocol`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, Default)]
#[serde(rename_all = "UPPERCASE")]
pub enum Protocol {
    /// Mutual TLS HTTP/2 CONNECT on Istio's HBONE port.
    Hbone,
    /// Plain TCP: not in the mesh.
    #[default]
    Tcp,
}

/// One workload as ztunnel's local config describes it; serialized under the same names, as ztunnel's
/// `/config_dump` lists its workloads.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Workload {
    /// Unique id of the workload.
    #[serde(default)]
    pub uid: String,
    /// Pod name.
    #[serde(default)]
    pub name: String,
    /// Kubernetes namespace.
    pub namespace: String,
    /// Service account; Kubernetes' `default` when absent.
    #[serde(default = "default_service_account")]
    pub service_account: String,
    /// Trust domain; the proxy's own when absent (the [`Directory`](super::Directory) fills it in).
    #[serde(default)]
    pub trust_domain: String,
    /// The workload's addresses.
    #[serde(default)]
    pub workload_ips: Vec<IpAddr>,
    /// How it accepts traffic.
    #[serde(default)]
    pub protocol: Protocol,
    /// The node it runs on.
    #[serde(default)]
    pub node: String,
    /// The workload it belongs to (a Deployment's name, say), as Istio derives it from the pod; shown in the
    /// `*_workload` labels of the traffic metrics.
    #[serde(default)]
    pub workload_name: String,
    /// Its canonical service (the `*_canonical_service` and `*_app` metric labels).
    #[serde(default)]
    pub canonical_name: String,
    /// Its canonical revision (the `*_canonical_revision` and `*_version` metric labels).
    #[serde(default)]
    pub canonical_revision: String,
    /// The cluster it runs in; the proxy's own (`CLUSTER_ID`) when absent.
    #[serde(default)]
    pub cluster_id: String,
    /// Our key, not ztunnel's: a destination that is not HBONE but must never be reached in plaintext. Outbound
    /// connections to it are refused rather than passed through.
    #[serde(default)]
    pub require_mtls: bool,
}

fn default_service_account() -> String {
    "default".to_owned()
}

/// The subset of ztunnel's local config the proxy reads; other keys (services, policies) are ignored.
#[derive(Debug, Default, Deserialize)]
struct LocalConfig {
    #[serde(default)]
    workloads: Vec<Workload>,
}

/// Parses the local workloads file's text; an empty (or all-blank) file holds no workloads.
pub fn parse_local_config(text: &str) -> Result<Vec<Workload>, serde_yaml::Error> {
    if text.trim().is_empty() {
        return Ok(Vec::new());
    }
    Ok(serde_yaml::from_str::<LocalConfig>(text)?.workloads)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ztunnels_naming_keys_are_read_and_default_to_empty() {
        let text = "workloads:\n- namespace: shop\n  workloadName: web\n  canonicalName: store\n  canonicalRevision: v3\n  clusterId: east\n- namespace: shop\n";
        let listed = parse_local_config(text).unwrap();
        let names = |w: &Workload| {
            [&w.workload_name, &w.canonical_name, &w.canonical_revision, &w.cluster_id].map(|s| s.to_owned())
        };
        assert_eq!(names(&listed[0]), ["web", "store", "v3", "east"]);
        assert_eq!(names(&listed[1]), ["", "", "", ""], "unknown unless listed");
    }
}

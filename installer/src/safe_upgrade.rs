//! Safe upgrade: while our DaemonSet still targets this node, a terminating agent leaves the plugin installed,
//! so pods created during the rollout wait for the new agent instead of starting outside the mesh.

use std::collections::BTreeMap;

use istio_contract::names::CNI_DAEMONSET;
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::Node;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client};

use crate::kubeconfig::{self, KubeconfigError, KubeconfigSettings};

/// Why install-cni could not make its API client.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The in-cluster settings or service-account files are unusable.
    #[error(transparent)]
    Settings(#[from] KubeconfigError),
    /// The kubeconfig (`KUBECONFIG`, or the one rendered from the service account) was refused.
    #[error("kubeconfig: {0}")]
    Kubeconfig(#[from] kube::config::KubeconfigError),
    /// The client could not be built.
    #[error("API client: {0}")]
    Client(#[from] kube::Error),
}

/// install-cni's own API client. With `KUBECONFIG` set (development), that file; otherwise the in-cluster
/// credentials of `settings`: `KUBERNETES_SERVICE_HOST`/`PORT`, the token and CA in `SERVICE_ACCOUNT_DIR`
/// (or `KUBE_CA_FILE`), i.e. exactly what the plugin's kubeconfig carries, so install-cni talks to the API
/// server as the plugin will. (kube's own in-cluster config reads only the fixed default service-account path.)
pub async fn client(settings: &KubeconfigSettings) -> Result<Client, ClientError> {
    if std::env::var_os("KUBECONFIG").is_some() {
        return Ok(Client::try_default().await?);
    }
    let rendered = kubeconfig::render(settings)?;
    let text = String::from_utf8_lossy(rendered.as_bytes());
    let config =
        kube::Config::from_custom_kubeconfig(Kubeconfig::from_yaml(&text)?, &KubeConfigOptions::default()).await?;
    Ok(Client::try_from(config)?)
}

/// What the API says about our DaemonSet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The DaemonSet still exists, is not being deleted and targets this node: an upgrade, keep everything.
    KeepInstalled,
    /// Uninstall (or moved off this node): clean up. Carries the reason.
    CleanUp(String),
}

/// Asks the API server (through [`client`]) whether this is an upgrade or an uninstall.
///
/// A 401 or 403 is an uninstall too: `helm uninstall` deletes the DaemonSet and, in the same breath, the chart's
/// RBAC and service account, so by the time our pod gets SIGTERM its credentials may no longer be accepted. An
/// upgrade updates RBAC in place and never takes it away. Keeping the plugin chained then would leave every later
/// pod on the node failing its ADD (the plugin's own credentials are gone too): found on a real API server, where
/// the uninstall left the node unable to start pods. Any other error (unreachable, timeout, 5xx) keeps the install.
pub async fn verdict(client: Client, namespace: &str, node_name: &str) -> Result<Verdict, kube::Error> {
    let ds = match Api::<DaemonSet>::namespaced(client.clone(), namespace).get_opt(CNI_DAEMONSET).await {
        Ok(ds) => ds,
        Err(kube::Error::Api(status)) if status.code == 401 || status.code == 403 => {
            return Ok(Verdict::CleanUp(format!(
                "our credentials are refused (HTTP {}: {}): the release's RBAC or service account is gone",
                status.code, status.message
            )));
        }
        Err(e) => return Err(e),
    };
    let Some(ds) = ds else {
        return Ok(Verdict::CleanUp(format!("DaemonSet {namespace}/{CNI_DAEMONSET} is gone")));
    };
    if ds.metadata.deletion_timestamp.is_some() {
        return Ok(Verdict::CleanUp(format!("DaemonSet {namespace}/{CNI_DAEMONSET} is being deleted")));
    }
    let selector = ds.spec.and_then(|s| s.template.spec).and_then(|s| s.node_selector).unwrap_or_default();
    if selector.is_empty() {
        return Ok(Verdict::KeepInstalled);
    }
    let node = Api::<Node>::all(client).get(node_name).await?;
    Ok(targets(&selector, &node.metadata.labels.unwrap_or_default()))
}

fn targets(selector: &BTreeMap<String, String>, labels: &BTreeMap<String, String>) -> Verdict {
    match selector.iter().find(|(k, v)| labels.get(*k) != Some(v)) {
        None => Verdict::KeepInstalled,
        Some((k, v)) => Verdict::CleanUp(format!("DaemonSet no longer targets this node (nodeSelector {k}={v})")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_selector_decides_whether_the_node_is_still_targeted() {
        let sel: BTreeMap<_, _> = [("pool".to_string(), "mesh".to_string())].into();
        let mut labels = BTreeMap::new();
        assert!(matches!(targets(&sel, &labels), Verdict::CleanUp(r) if r.contains("pool=mesh")));
        labels.insert("pool".to_string(), "mesh".to_string());
        assert_eq!(targets(&sel, &labels), Verdict::KeepInstalled);
    }
}

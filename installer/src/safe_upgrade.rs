//! Safe upgrade: while our DaemonSet still targets this node, a terminating agent leaves the plugin installed,
//! so pods created during the rollout wait for the new agent instead of starting outside the mesh.

use std::collections::BTreeMap;

use istio_contract::names::CNI_DAEMONSET;
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::Node;
use kube::{Api, Client};

/// What the API says about our DaemonSet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The DaemonSet still exists, is not being deleted and targets this node: an upgrade, keep everything.
    KeepInstalled,
    /// Uninstall (or moved off this node): clean up. Carries the reason.
    CleanUp(String),
}

/// Asks the API server (in-cluster config, or `KUBECONFIG`) whether this is an upgrade or an uninstall.
pub async fn verdict(namespace: &str, node_name: &str) -> Result<Verdict, kube::Error> {
    let client = Client::try_default().await?;
    let Some(ds) = Api::<DaemonSet>::namespaced(client.clone(), namespace).get_opt(CNI_DAEMONSET).await? else {
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

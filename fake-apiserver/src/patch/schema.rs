//! The strategic-merge metadata of the served kinds: which lists merge, and by which key
//! (`patchStrategy:"merge"` and `patchMergeKey` in the Go types). Lists not named here are replaced whole.

/// How a strategic merge patch treats one list field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ListStrategy {
    /// The patch's list replaces the original (no patch strategy).
    Replace,
    /// Objects merge element by element, matched on this key.
    MergeByKey(&'static str),
    /// A list of scalars merges as a set union (e.g. `metadata.finalizers`).
    MergePrimitives,
}

use ListStrategy::{MergeByKey, MergePrimitives, Replace};

fn object_meta(path: &[&str]) -> ListStrategy {
    match path {
        ["finalizers"] => MergePrimitives,
        ["ownerReferences"] => MergeByKey("uid"),
        _ => Replace,
    }
}

fn container(path: &[&str]) -> ListStrategy {
    match path {
        ["ports"] => MergeByKey("containerPort"),
        ["env"] => MergeByKey("name"),
        ["volumeMounts"] => MergeByKey("mountPath"),
        ["volumeDevices"] => MergeByKey("devicePath"),
        _ => Replace,
    }
}

fn pod_spec(path: &[&str]) -> ListStrategy {
    match path {
        ["containers" | "initContainers" | "ephemeralContainers"] => MergeByKey("name"),
        ["containers" | "initContainers" | "ephemeralContainers", rest @ ..] => container(rest),
        ["volumes" | "imagePullSecrets" | "resourceClaims"] => MergeByKey("name"),
        ["hostAliases"] => MergeByKey("ip"),
        ["topologySpreadConstraints"] => MergeByKey("topologyKey"),
        _ => Replace,
    }
}

/// The strategy for the list at `path` (map keys from the object's root; list elements add no segment) in
/// an object of `kind`.
pub(crate) fn list_strategy(kind: &str, path: &[&str]) -> ListStrategy {
    match (kind, path) {
        (_, ["metadata", rest @ ..]) => object_meta(rest),
        (_, ["status", "conditions"]) => MergeByKey("type"),
        ("Pod", ["spec", rest @ ..]) => pod_spec(rest),
        ("Pod", ["status", "podIPs" | "hostIPs"]) => MergeByKey("ip"),
        ("DaemonSet", ["spec", "template", "metadata", rest @ ..]) => object_meta(rest),
        ("DaemonSet", ["spec", "template", "spec", rest @ ..]) => pod_spec(rest),
        ("Node", ["spec", "podCIDRs"]) => MergePrimitives,
        ("Node", ["status", "addresses"]) => MergeByKey("type"),
        ("ServiceAccount", ["secrets"]) => MergeByKey("name"),
        _ => Replace,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn knows_the_keys_of_pods_and_daemonsets() {
        assert_eq!(list_strategy("Pod", &["spec", "containers"]), MergeByKey("name"));
        assert_eq!(list_strategy("Pod", &["spec", "containers", "env"]), MergeByKey("name"));
        assert_eq!(list_strategy("Pod", &["spec", "initContainers", "ports"]), MergeByKey("containerPort"));
        assert_eq!(list_strategy("DaemonSet", &["spec", "template", "spec", "volumes"]), MergeByKey("name"));
        assert_eq!(list_strategy("Pod", &["metadata", "finalizers"]), MergePrimitives);
        assert_eq!(list_strategy("Node", &["status", "conditions"]), MergeByKey("type"));
        assert_eq!(list_strategy("Pod", &["spec", "tolerations"]), Replace);
        assert_eq!(list_strategy("Pod", &["spec", "containers", "args"]), Replace);
    }
}

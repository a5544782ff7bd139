//! `CNI_ARGS`: the runtime's `K=V;K=V` list, where Kubernetes runtimes pass the pod identity.

use std::collections::BTreeMap;

/// Parsed `CNI_ARGS`. Order does not matter; unknown and repeated keys are tolerated (the last wins).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CniArgs {
    /// Every key/value pair, including unknown ones.
    pub all: BTreeMap<String, String>,
}

impl CniArgs {
    /// Parses `K=V;K=V`. Empty items and items without `=` are skipped, as libcni's callers do.
    pub fn parse(raw: &str) -> Self {
        let all = raw
            .split(';')
            .filter_map(|item| item.split_once('='))
            .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
            .filter(|(k, _)| !k.is_empty())
            .collect();
        Self { all }
    }

    fn get(&self, key: &str) -> Option<&str> {
        self.all.get(key).map(String::as_str).filter(|v| !v.is_empty())
    }

    /// `K8S_POD_NAME`.
    pub fn pod_name(&self) -> Option<&str> {
        self.get("K8S_POD_NAME")
    }

    /// `K8S_POD_NAMESPACE`.
    pub fn pod_namespace(&self) -> Option<&str> {
        self.get("K8S_POD_NAMESPACE")
    }

    /// `K8S_POD_UID`.
    pub fn pod_uid(&self) -> Option<&str> {
        self.get("K8S_POD_UID")
    }

    /// `K8S_POD_INFRA_CONTAINER_ID`.
    pub fn infra_container_id(&self) -> Option<&str> {
        self.get("K8S_POD_INFRA_CONTAINER_ID")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_kubernetes_keys_in_any_order() {
        let a = CniArgs::parse(
            "IgnoreUnknown=1;K8S_POD_UID=u-1;K8S_POD_NAMESPACE=shop;FOO=bar;K8S_POD_NAME=web;K8S_POD_INFRA_CONTAINER_ID=abc",
        );
        assert_eq!(a.pod_name(), Some("web"));
        assert_eq!(a.pod_namespace(), Some("shop"));
        assert_eq!(a.pod_uid(), Some("u-1"));
        assert_eq!(a.infra_container_id(), Some("abc"));
        assert_eq!(a.all.get("FOO").map(String::as_str), Some("bar"));
    }

    #[test]
    fn tolerates_duplicates_junk_and_empty() {
        let a = CniArgs::parse(";;K8S_POD_NAME=a;junk;K8S_POD_NAME=b;=x;");
        assert_eq!(a.pod_name(), Some("b"));
        assert_eq!(CniArgs::parse("").pod_name(), None);
        assert_eq!(CniArgs::parse("K8S_POD_NAME=").pod_name(), None);
    }
}

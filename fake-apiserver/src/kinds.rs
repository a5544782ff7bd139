//! The fixed table of resource kinds the fake serves, and the discovery documents describing them.

use serde_json::{json, Value};

/// One served resource type: everything routing, storage and discovery need to know about it.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct ResourceKind {
    /// `kind` of a single object, e.g. `Pod`.
    pub kind: &'static str,
    /// `kind` of a list response, e.g. `PodList`.
    pub list_kind: &'static str,
    /// URL path segment, e.g. `pods`.
    pub plural: &'static str,
    /// Lower-case singular name used in discovery.
    pub singular: &'static str,
    /// API group; empty for the legacy core group.
    pub group: &'static str,
    /// The `apiVersion` objects of this kind carry (`v1`, `apps/v1`).
    pub api_version: &'static str,
    /// Whether objects live inside a namespace.
    pub namespaced: bool,
    /// Whether the apiserver maintains `metadata.generation` for this kind.
    pub has_generation: bool,
    /// Short names advertised in discovery.
    pub short_names: &'static [&'static str],
}

/// Every kind the fake serves.
pub(crate) static KINDS: [ResourceKind; 4] = [
    ResourceKind {
        kind: "Pod",
        list_kind: "PodList",
        plural: "pods",
        singular: "pod",
        group: "",
        api_version: "v1",
        namespaced: true,
        has_generation: false,
        short_names: &["po"],
    },
    ResourceKind {
        kind: "Namespace",
        list_kind: "NamespaceList",
        plural: "namespaces",
        singular: "namespace",
        group: "",
        api_version: "v1",
        namespaced: false,
        has_generation: false,
        short_names: &["ns"],
    },
    ResourceKind {
        kind: "Node",
        list_kind: "NodeList",
        plural: "nodes",
        singular: "node",
        group: "",
        api_version: "v1",
        namespaced: false,
        has_generation: false,
        short_names: &["no"],
    },
    ResourceKind {
        kind: "DaemonSet",
        list_kind: "DaemonSetList",
        plural: "daemonsets",
        singular: "daemonset",
        group: "apps",
        api_version: "apps/v1",
        namespaced: true,
        has_generation: true,
        short_names: &["ds"],
    },
];

/// Finds a kind by its `kind` name or plural, case-insensitively (for test controls and seed files).
pub(crate) fn by_name(name: &str) -> Option<&'static ResourceKind> {
    KINDS.iter().find(|k| k.kind.eq_ignore_ascii_case(name) || k.plural.eq_ignore_ascii_case(name))
}

/// Finds the kind served at `plural` within `group`.
pub(crate) fn by_path(group: &str, plural: &str) -> Option<&'static ResourceKind> {
    KINDS.iter().find(|k| k.group == group && k.plural == plural)
}

/// `GET /version`.
pub(crate) fn version() -> Value {
    json!({
        "major": "1",
        "minor": "33",
        "gitVersion": "v1.33.0-fake",
        "gitCommit": "0000000000000000000000000000000000000000",
        "gitTreeState": "clean",
        "buildDate": "2025-01-01T00:00:00Z",
        "goVersion": "go1.24.0",
        "compiler": "gc",
        "platform": "linux/amd64"
    })
}

/// `GET /api`.
pub(crate) fn core_versions() -> Value {
    json!({
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": []
    })
}

/// `GET /apis`.
pub(crate) fn group_list() -> Value {
    let version = json!({"groupVersion": "apps/v1", "version": "v1"});
    json!({
        "kind": "APIGroupList",
        "apiVersion": "v1",
        "groups": [{"name": "apps", "versions": [version.clone()], "preferredVersion": version}]
    })
}

/// `GET /api/v1` or `GET /apis/apps/v1`: the resources of one group, including `status` subresources.
pub(crate) fn resource_list(group: &str) -> Value {
    let verbs = json!(["create", "delete", "get", "list", "patch", "update", "watch"]);
    let mut resources = Vec::new();
    for k in KINDS.iter().filter(|k| k.group == group) {
        resources.push(json!({
            "name": k.plural,
            "singularName": k.singular,
            "namespaced": k.namespaced,
            "kind": k.kind,
            "verbs": verbs,
            "shortNames": k.short_names,
        }));
        resources.push(json!({
            "name": format!("{}/status", k.plural),
            "singularName": "",
            "namespaced": k.namespaced,
            "kind": k.kind,
            "verbs": ["get", "patch", "update"],
        }));
    }
    let group_version = if group.is_empty() { "v1" } else { "apps/v1" };
    json!({
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": group_version,
        "resources": resources
    })
}

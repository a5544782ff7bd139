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
    /// Whether the kind has a `status` subresource.
    pub has_status: bool,
    /// The fields a `fieldSelector` may name for this kind on a real apiserver.
    pub selectable_fields: &'static [&'static str],
}

/// What every kind without its own field set supports.
const META_FIELDS: &[&str] = &["metadata.name", "metadata.namespace"];

/// The RBAC API group.
pub(crate) const RBAC_GROUP: &str = "rbac.authorization.k8s.io";

/// Every kind the fake serves.
pub(crate) static KINDS: [ResourceKind; 11] = [
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
        has_status: true,
        selectable_fields: istio_contract::pod::SELECTABLE_FIELDS,
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
        has_status: true,
        selectable_fields: &["metadata.name", "status.phase"],
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
        has_status: true,
        selectable_fields: &["metadata.name", "spec.unschedulable"],
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
        has_status: true,
        selectable_fields: META_FIELDS,
    },
    ResourceKind {
        kind: "ServiceAccount",
        list_kind: "ServiceAccountList",
        plural: "serviceaccounts",
        singular: "serviceaccount",
        group: "",
        api_version: "v1",
        namespaced: true,
        has_generation: false,
        short_names: &["sa"],
        has_status: false,
        selectable_fields: META_FIELDS,
    },
    ResourceKind {
        kind: "ConfigMap",
        list_kind: "ConfigMapList",
        plural: "configmaps",
        singular: "configmap",
        group: "",
        api_version: "v1",
        namespaced: true,
        has_generation: false,
        short_names: &["cm"],
        has_status: false,
        selectable_fields: META_FIELDS,
    },
    ResourceKind {
        kind: "Event",
        list_kind: "EventList",
        plural: "events",
        singular: "event",
        group: "",
        api_version: "v1",
        namespaced: true,
        has_generation: false,
        short_names: &["ev"],
        has_status: false,
        selectable_fields: &[
            "metadata.name",
            "metadata.namespace",
            "involvedObject.kind",
            "involvedObject.namespace",
            "involvedObject.name",
            "involvedObject.uid",
            "involvedObject.apiVersion",
            "involvedObject.resourceVersion",
            "involvedObject.fieldPath",
            "reason",
            "reportingComponent",
            "type",
        ],
    },
    ResourceKind {
        kind: "ClusterRole",
        list_kind: "ClusterRoleList",
        plural: "clusterroles",
        singular: "clusterrole",
        group: RBAC_GROUP,
        api_version: "rbac.authorization.k8s.io/v1",
        namespaced: false,
        has_generation: false,
        short_names: &[],
        has_status: false,
        selectable_fields: META_FIELDS,
    },
    ResourceKind {
        kind: "ClusterRoleBinding",
        list_kind: "ClusterRoleBindingList",
        plural: "clusterrolebindings",
        singular: "clusterrolebinding",
        group: RBAC_GROUP,
        api_version: "rbac.authorization.k8s.io/v1",
        namespaced: false,
        has_generation: false,
        short_names: &[],
        has_status: false,
        selectable_fields: META_FIELDS,
    },
    ResourceKind {
        kind: "Role",
        list_kind: "RoleList",
        plural: "roles",
        singular: "role",
        group: RBAC_GROUP,
        api_version: "rbac.authorization.k8s.io/v1",
        namespaced: true,
        has_generation: false,
        short_names: &[],
        has_status: false,
        selectable_fields: META_FIELDS,
    },
    ResourceKind {
        kind: "RoleBinding",
        list_kind: "RoleBindingList",
        plural: "rolebindings",
        singular: "rolebinding",
        group: RBAC_GROUP,
        api_version: "rbac.authorization.k8s.io/v1",
        namespaced: true,
        has_generation: false,
        short_names: &[],
        has_status: false,
        selectable_fields: META_FIELDS,
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

/// The named API groups served (the core group is not among them), in discovery order.
pub(crate) fn groups() -> Vec<&'static str> {
    let mut groups: Vec<&'static str> = Vec::new();
    for k in KINDS.iter().filter(|k| !k.group.is_empty()) {
        if !groups.contains(&k.group) {
            groups.push(k.group);
        }
    }
    groups
}

/// `GET /apis`.
pub(crate) fn group_list() -> Value {
    let groups: Vec<Value> = groups()
        .into_iter()
        .map(|g| {
            let version = json!({"groupVersion": format!("{g}/v1"), "version": "v1"});
            json!({"name": g, "versions": [version.clone()], "preferredVersion": version})
        })
        .collect();
    json!({
        "kind": "APIGroupList",
        "apiVersion": "v1",
        "groups": groups
    })
}

/// `GET /api/v1` or `GET /apis/<group>/v1`: the resources of one group, including `status` subresources.
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
        if k.has_status {
            resources.push(json!({
                "name": format!("{}/status", k.plural),
                "singularName": "",
                "namespaced": k.namespaced,
                "kind": k.kind,
                "verbs": ["get", "patch", "update"],
            }));
        }
    }
    let group_version = if group.is_empty() { "v1".to_string() } else { format!("{group}/v1") };
    json!({
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": group_version,
        "resources": resources
    })
}

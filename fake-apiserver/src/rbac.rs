//! RBAC: what a request asks to do (kube-apiserver's `RequestInfo`) and whether the stored roles and bindings
//! allow the request's user to do it.
//!
//! Rules are read from the store on every request, so a test can change RBAC while clients run. Supported:
//! ClusterRoles and Roles, bound by ClusterRoleBindings (cluster-wide) and RoleBindings (in their namespace),
//! to Users, Groups and ServiceAccounts; rules on verbs, apiGroups, resources (`*`, `pods`, `pods/status`,
//! `*/status`), resourceNames and nonResourceURLs. Not supported: aggregated ClusterRoles. As the bootstrap
//! policy does, every authenticated user may read discovery (`/api`, `/apis`, `/version`, ...) and anyone
//! `/version` and the health paths; `system:masters` may do anything.

use crate::auth::{User, MASTERS_GROUP};
use crate::kinds;
use crate::query::Query;
use crate::status::ApiError;
use crate::store::Store;
use hyper::Method;
use serde_json::Value;

/// What a request asks to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RequestInfo {
    /// An API resource request (`/api/v1/...`, `/apis/<group>/<version>/...` with a resource).
    Resource {
        verb: &'static str,
        group: String,
        resource: String,
        subresource: String,
        namespace: String,
        name: String,
    },
    /// Any other path (discovery, `/version`, health).
    NonResource { verb: String, path: String },
}

/// Namespace subresources: `/api/v1/namespaces/<ns>/status` is the namespace's status, not a resource.
const NAMESPACE_SUBRESOURCES: [&str; 2] = ["status", "finalize"];

impl RequestInfo {
    /// Parses a request the way kube-apiserver's `RequestInfoFactory` does.
    pub fn parse(method: &Method, path: &str, query: &Query) -> RequestInfo {
        let non_resource = || RequestInfo::NonResource { verb: method.as_str().to_lowercase(), path: path.to_string() };
        let parts: Vec<&str> = path.trim_matches('/').split('/').filter(|p| !p.is_empty()).collect();
        let (group, mut rest) = match parts.as_slice() {
            ["api", _version, rest @ ..] if !rest.is_empty() => ("", rest),
            ["apis", group, _version, rest @ ..] if !rest.is_empty() => (*group, rest),
            _ => return non_resource(),
        };
        let mut namespace = "";
        if rest[0] == "namespaces" && rest.len() > 1 {
            namespace = rest[1];
            if rest.len() > 2 && !NAMESPACE_SUBRESOURCES.contains(&rest[2]) {
                rest = &rest[2..];
            }
        }
        let resource = rest[0];
        let name = rest.get(1).copied().unwrap_or_default();
        let subresource = rest.get(2).copied().unwrap_or_default();
        let verb = match *method {
            Method::GET | Method::HEAD if name.is_empty() => {
                if query.flag("watch") {
                    "watch"
                } else {
                    "list"
                }
            }
            Method::GET | Method::HEAD => "get",
            Method::POST => "create",
            Method::PUT => "update",
            Method::PATCH => "patch",
            Method::DELETE if name.is_empty() => "deletecollection",
            Method::DELETE => "delete",
            _ => return non_resource(),
        };
        RequestInfo::Resource {
            verb,
            group: group.to_string(),
            resource: resource.to_string(),
            subresource: subresource.to_string(),
            namespace: namespace.to_string(),
            name: name.to_string(),
        }
    }

    /// `resource[/subresource]`, with `.group` when not core (`pods/status`, `daemonsets.apps`), or the path
    /// of a non-resource request.
    pub fn resource(&self) -> String {
        match self {
            RequestInfo::Resource { group, resource, subresource, .. } => {
                let mut name = resource.clone();
                if !group.is_empty() {
                    name = format!("{name}.{group}");
                }
                if !subresource.is_empty() {
                    name = format!("{name}/{subresource}");
                }
                name
            }
            RequestInfo::NonResource { path, .. } => path.clone(),
        }
    }

    /// The RBAC verb (`get`, `list`, `watch`, `create`, ...; the lower-case method for non-resource paths).
    pub fn verb(&self) -> &str {
        match self {
            RequestInfo::Resource { verb, .. } => verb,
            RequestInfo::NonResource { verb, .. } => verb,
        }
    }
}

fn strings(v: &Value, field: &str) -> Vec<String> {
    v.get(field)
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).map(str::to_string).collect())
        .unwrap_or_default()
}

fn has(list: &[String], want: &str) -> bool {
    list.iter().any(|x| x == "*" || x == want)
}

/// kube-apiserver's `ResourceMatches`: `*`, the exact `resource[/subresource]`, or `*/subresource`.
fn resource_matches(rule: &[String], resource: &str, subresource: &str) -> bool {
    let combined = if subresource.is_empty() { resource.to_string() } else { format!("{resource}/{subresource}") };
    rule.iter()
        .any(|r| r == "*" || *r == combined || (!subresource.is_empty() && r.strip_prefix("*/") == Some(subresource)))
}

fn rule_allows(rule: &Value, info: &RequestInfo) -> bool {
    let verbs = strings(rule, "verbs");
    match info {
        RequestInfo::Resource { verb, group, resource, subresource, name, .. } => {
            let names = strings(rule, "resourceNames");
            has(&verbs, verb)
                && has(&strings(rule, "apiGroups"), group)
                && resource_matches(&strings(rule, "resources"), resource, subresource)
                && (names.is_empty() || names.iter().any(|n| n == name))
        }
        RequestInfo::NonResource { verb, path } => {
            has(&verbs, verb)
                && strings(rule, "nonResourceURLs").iter().any(|u| {
                    u == "*" || u == path || u.strip_suffix('*').is_some_and(|prefix| path.starts_with(prefix))
                })
        }
    }
}

fn subject_matches(subject: &Value, binding_ns: &str, user: &User) -> bool {
    let field = |f: &str| subject.get(f).and_then(Value::as_str).unwrap_or_default();
    match field("kind") {
        "User" => field("name") == user.name,
        "Group" => user.in_group(field("name")),
        "ServiceAccount" => {
            let ns = Some(field("namespace")).filter(|n| !n.is_empty()).unwrap_or(binding_ns);
            user.name == format!("system:serviceaccount:{ns}:{}", field("name"))
        }
        _ => false,
    }
}

/// Whether any rule of a role bound to `user` by a binding in `bindings` allows `info`.
fn bound_rules_allow<'a>(
    store: &Store,
    bindings: impl Iterator<Item = &'a std::sync::Arc<Value>>,
    user: &User,
    info: &RequestInfo,
) -> bool {
    let cluster_role = kinds::by_name("ClusterRole").expect("ClusterRole is served");
    let role = kinds::by_name("Role").expect("Role is served");
    bindings.into_iter().any(|binding| {
        let binding_ns = binding.pointer("/metadata/namespace").and_then(Value::as_str).unwrap_or_default();
        let subjects = binding.get("subjects").and_then(Value::as_array).map(Vec::as_slice).unwrap_or_default();
        if !subjects.iter().any(|s| subject_matches(s, binding_ns, user)) {
            return false;
        }
        let role_ref = |f: &str| binding.pointer(&format!("/roleRef/{f}")).and_then(Value::as_str).unwrap_or_default();
        let found = match role_ref("kind") {
            "ClusterRole" => store.get(cluster_role, "", role_ref("name")),
            "Role" if !binding_ns.is_empty() => store.get(role, binding_ns, role_ref("name")),
            _ => None,
        };
        found
            .and_then(|r| r.get("rules").and_then(Value::as_array).cloned())
            .is_some_and(|rules| rules.iter().any(|rule| rule_allows(rule, info)))
    })
}

/// Paths the bootstrap policy opens to every authenticated user (`system:discovery`, `system:basic-user`).
fn discovery(path: &str) -> bool {
    let p = path.trim_end_matches('/');
    matches!(p, "/api" | "/apis" | "/version" | "/healthz" | "/livez" | "/readyz" | "/openapi/v2")
        || p.starts_with("/api/")
        || p.starts_with("/apis/")
        || p.starts_with("/openapi/")
}

/// Paths the bootstrap policy opens to everyone, authenticated or not (`system:public-info-viewer`).
fn public(path: &str) -> bool {
    matches!(path.trim_end_matches('/'), "/version" | "/healthz" | "/livez" | "/readyz")
}

/// `Ok` when `user` may do `info`, else the 403 the real server answers.
pub(crate) fn authorize(store: &Store, user: &User, info: &RequestInfo) -> Result<(), ApiError> {
    if user.in_group(MASTERS_GROUP) {
        return Ok(());
    }
    if let RequestInfo::NonResource { verb, path } = info {
        let reads = verb == "get" || verb == "head";
        if reads && (public(path) || (user.in_group("system:authenticated") && discovery(path))) {
            return Ok(());
        }
    }
    let crb = kinds::by_name("ClusterRoleBinding").expect("ClusterRoleBinding is served");
    if bound_rules_allow(store, store.list(crb, None), user, info) {
        return Ok(());
    }
    if let RequestInfo::Resource { namespace, .. } = info {
        let rb = kinds::by_name("RoleBinding").expect("RoleBinding is served");
        if !namespace.is_empty() && bound_rules_allow(store, store.list(rb, Some(namespace)), user, info) {
            return Ok(());
        }
    }
    Err(forbidden(user, info))
}

fn forbidden(user: &User, info: &RequestInfo) -> ApiError {
    match info {
        RequestInfo::Resource { verb, group, resource, subresource, namespace, name } => {
            // The real server names the resource with its group: `daemonsets.apps "x" is forbidden`.
            let qualified = if group.is_empty() { resource.clone() } else { format!("{resource}.{group}") };
            let what = if name.is_empty() { qualified } else { format!("{qualified} \"{name}\"") };
            let full = if subresource.is_empty() { resource.clone() } else { format!("{resource}/{subresource}") };
            let scope = if namespace.is_empty() {
                "at the cluster scope".to_string()
            } else {
                format!("in the namespace \"{namespace}\"")
            };
            ApiError::forbidden(
                format!(
                    "{what} is forbidden: User \"{}\" cannot {verb} resource \"{full}\" in API group \"{group}\" {scope}",
                    user.name
                ),
                Some(crate::status::details_of(name, group, resource)),
            )
        }
        RequestInfo::NonResource { verb, path } => {
            let details = Some(serde_json::json!({}));
            ApiError::forbidden(format!("forbidden: User \"{}\" cannot {verb} path \"{path}\"", user.name), details)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn info(method: Method, path: &str, query: &str) -> RequestInfo {
        RequestInfo::parse(&method, path, &Query::parse(query))
    }

    fn res(verb: &'static str, group: &str, resource: &str, sub: &str, ns: &str, name: &str) -> RequestInfo {
        RequestInfo::Resource {
            verb,
            group: group.into(),
            resource: resource.into(),
            subresource: sub.into(),
            namespace: ns.into(),
            name: name.into(),
        }
    }

    #[test]
    fn parses_like_the_request_info_factory() {
        assert_eq!(info(Method::GET, "/api/v1/namespaces/a/pods", ""), res("list", "", "pods", "", "a", ""));
        assert_eq!(info(Method::GET, "/api/v1/pods", "watch=true"), res("watch", "", "pods", "", "", ""));
        assert_eq!(
            info(Method::PATCH, "/api/v1/namespaces/a/pods/p/status", ""),
            res("patch", "", "pods", "status", "a", "p")
        );
        assert_eq!(info(Method::GET, "/api/v1/namespaces/a", ""), res("get", "", "namespaces", "", "a", "a"));
        assert_eq!(
            info(Method::PUT, "/api/v1/namespaces/a/status", ""),
            res("update", "", "namespaces", "status", "a", "a")
        );
        assert_eq!(
            info(Method::DELETE, "/apis/apps/v1/namespaces/s/daemonsets/d", ""),
            res("delete", "apps", "daemonsets", "", "s", "d")
        );
        assert_eq!(info(Method::DELETE, "/api/v1/nodes", ""), res("deletecollection", "", "nodes", "", "", ""));
        assert_eq!(
            info(Method::GET, "/api/v1", ""),
            RequestInfo::NonResource { verb: "get".into(), path: "/api/v1".into() }
        );
        assert_eq!(info(Method::GET, "/version", "").verb(), "get");
    }

    #[test]
    fn rules_match_verbs_groups_resources_subresources_and_names() {
        let rule = json!({"apiGroups": [""], "resources": ["pods", "pods/status"], "verbs": ["get", "patch"]});
        assert!(rule_allows(&rule, &res("get", "", "pods", "", "a", "p")));
        assert!(rule_allows(&rule, &res("patch", "", "pods", "status", "a", "p")));
        assert!(!rule_allows(&rule, &res("list", "", "pods", "", "a", "")));
        assert!(!rule_allows(&rule, &res("get", "apps", "pods", "", "a", "p")));
        assert!(!rule_allows(&rule, &res("get", "", "pods", "log", "a", "p")));
        let star = json!({"apiGroups": ["*"], "resources": ["*/status"], "verbs": ["*"]});
        assert!(rule_allows(&star, &res("update", "apps", "daemonsets", "status", "s", "d")));
        assert!(!rule_allows(&star, &res("update", "apps", "daemonsets", "", "s", "d")));
        let named = json!({"apiGroups": ["apps"], "resources": ["daemonsets"], "resourceNames": ["istio-cni-node"],
                           "verbs": ["get", "list"]});
        assert!(rule_allows(&named, &res("get", "apps", "daemonsets", "", "s", "istio-cni-node")));
        assert!(!rule_allows(&named, &res("get", "apps", "daemonsets", "", "s", "other")));
        assert!(!rule_allows(&named, &res("list", "apps", "daemonsets", "", "s", "")), "names never match a list");
        let urls = json!({"nonResourceURLs": ["/metrics", "/debug/*"], "verbs": ["get"]});
        assert!(rule_allows(&urls, &RequestInfo::NonResource { verb: "get".into(), path: "/debug/x".into() }));
        assert!(!rule_allows(&urls, &RequestInfo::NonResource { verb: "get".into(), path: "/other".into() }));
    }

    #[test]
    fn forbidden_messages_match_the_real_server() {
        let sa = User::service_account("istio-system", "istio-cni");
        let e = forbidden(&sa, &res("get", "", "pods", "", "default", "p"));
        assert_eq!((e.code, e.reason), (403, "Forbidden"));
        assert_eq!(
            e.message,
            "pods \"p\" is forbidden: User \"system:serviceaccount:istio-system:istio-cni\" cannot get resource \
             \"pods\" in API group \"\" in the namespace \"default\""
        );
        let e = forbidden(&sa, &res("list", "apps", "daemonsets", "", "", ""));
        assert!(e.message.ends_with("cannot list resource \"daemonsets\" in API group \"apps\" at the cluster scope"));
    }
}

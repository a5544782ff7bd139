//! Maps Kubernetes REST paths and verbs onto store operations, lists and watches.

mod continuation;

use crate::cluster::Cluster;
use crate::ids;
use crate::kinds::{self, ResourceKind};
use crate::patch::PatchType;
use crate::query::Query;
use crate::selectors::{FieldSelector, Filter, LabelSelector};
use crate::status::ApiError;
use crate::store::{DeleteOptions, Part};
use crate::watch::{self, Body, WatchSpec};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Response, StatusCode};
use serde_json::{json, Value};
use std::time::Duration;

/// What a request path addresses.
#[derive(Debug, PartialEq)]
enum Target {
    Version,
    /// `/healthz`, `/livez`, `/readyz`: `ok`, as a healthy real server answers.
    Health,
    CoreVersions,
    Groups,
    Resources(&'static str),
    Collection {
        kind: &'static ResourceKind,
        namespace: Option<String>,
    },
    Object {
        kind: &'static ResourceKind,
        namespace: Option<String>,
        name: String,
        part: Part,
    },
}

fn route(path: &str) -> Option<Target> {
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let served = |group: &str| kinds::groups().into_iter().find(|g| *g == group);
    let (group, rest): (&'static str, &[&str]) = match segs.as_slice() {
        ["version"] => return Some(Target::Version),
        ["healthz" | "livez" | "readyz"] => return Some(Target::Health),
        ["api"] => return Some(Target::CoreVersions),
        ["apis"] => return Some(Target::Groups),
        ["api", "v1"] => return Some(Target::Resources("")),
        ["apis", group, "v1"] => return served(group).map(Target::Resources),
        ["api", "v1", rest @ ..] => ("", rest),
        ["apis", group, "v1", rest @ ..] => (served(group)?, rest),
        _ => return None,
    };
    let object = |kind: &'static ResourceKind, namespace: Option<&str>, name: &str, sub: Option<&str>| {
        let part = match sub {
            None => Part::Main,
            Some("status") if kind.has_status => Part::Status,
            Some(_) => return None,
        };
        Some(Target::Object { kind, namespace: namespace.map(str::to_string), name: name.to_string(), part })
    };
    if let ["namespaces", ns, plural, tail @ ..] = rest {
        if let Some(kind) = kinds::by_path(group, plural).filter(|k| k.namespaced) {
            return match tail {
                [] => Some(Target::Collection { kind, namespace: Some(ns.to_string()) }),
                [name] => object(kind, Some(ns), name, None),
                [name, sub] => object(kind, Some(ns), name, Some(sub)),
                _ => None,
            };
        }
    }
    let (plural, tail) = rest.split_first()?;
    let kind = kinds::by_path(group, plural)?;
    match tail {
        [] => Some(Target::Collection { kind, namespace: None }),
        [name] if !kind.namespaced => object(kind, None, name, None),
        [name, sub] if !kind.namespaced => object(kind, None, name, Some(sub)),
        _ => None,
    }
}

pub(crate) fn json_response(code: u16, body: &Value) -> Response<Body> {
    Response::builder()
        .status(StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())).boxed_unsync())
        .unwrap_or_else(|_| Response::new(Full::new(Bytes::new()).boxed_unsync()))
}

pub(crate) fn error_response(e: &ApiError) -> Response<Body> {
    json_response(e.code, &e.to_status())
}

fn filter(
    cluster: &Cluster,
    kind: &ResourceKind,
    query: &Query,
    namespace: Option<String>,
) -> Result<Filter, ApiError> {
    let fields = FieldSelector::parse(query.get("fieldSelector").unwrap_or_default()).map_err(ApiError::bad_request)?;
    if cluster.config().strict_field_selectors {
        fields.check_supported(kind).map_err(ApiError::bad_request)?;
    }
    Ok(Filter {
        namespace,
        labels: LabelSelector::parse(query.get("labelSelector").unwrap_or_default()).map_err(ApiError::bad_request)?,
        fields,
    })
}

/// `(namespace, name)`: where an object sits in list order.
fn position(o: &Value) -> (String, String) {
    let m = &o["metadata"];
    (m["namespace"].as_str().unwrap_or_default().to_string(), m["name"].as_str().unwrap_or_default().to_string())
}

/// A list, or one page of it: later pages come from the snapshot at the first page's resourceVersion, which the
/// continue token carries (410 once the history no longer reaches back to it).
fn list(cluster: &Cluster, kind: &'static ResourceKind, query: &Query, filter: &Filter) -> Result<Value, ApiError> {
    let limit: usize = match query.get("limit") {
        None | Some("") => 0,
        Some(l) => l.parse().map_err(|_| ApiError::bad_request(format!("invalid limit {l:?}")))?,
    };
    let token = query.get("continue").filter(|c| !c.is_empty()).map(continuation::decode).transpose()?;
    let (mut items, rv) = cluster.with_store(|s| {
        let ns = filter.namespace.as_deref();
        let (objects, rv) = match &token {
            Some(t) => (s.snapshot(kind, ns, t.rv)?, t.rv),
            None => (s.list(kind, ns).cloned().collect(), s.resource_version()),
        };
        let items: Vec<Value> = objects
            .iter()
            .filter(|o| filter.matches(o))
            .filter(|o| token.as_ref().is_none_or(|t| position(o) > t.after))
            .map(|o| (**o).clone())
            .collect();
        Ok::<_, ApiError>((items, rv))
    })?;
    let mut metadata = json!({"resourceVersion": rv.to_string()});
    if limit > 0 && items.len() > limit {
        let remaining = items.len() - limit;
        items.truncate(limit);
        let after = position(&items[limit - 1]);
        metadata["continue"] = json!(continuation::encode(&continuation::Token { rv, after }));
        if filter.labels == LabelSelector::default() && filter.fields == FieldSelector::default() {
            metadata["remainingItemCount"] = json!(remaining);
        }
    }
    Ok(json!({
        "kind": kind.list_kind,
        "apiVersion": kind.api_version,
        "metadata": metadata,
        "items": items,
    }))
}

fn parse_body(content_type: &str, body: &[u8]) -> Result<Value, ApiError> {
    if content_type.contains("yaml") {
        serde_yaml::from_slice(body).map_err(|e| ApiError::bad_request(format!("invalid YAML body: {e}")))
    } else {
        serde_json::from_slice(body).map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))
    }
}

/// The parts of a request the handlers need.
pub(crate) struct Call<'a> {
    pub method: &'a Method,
    pub path: &'a str,
    pub query: Query,
    pub content_type: &'a str,
    pub body: Bytes,
}

/// Handles one API request; errors come back as `Status` responses.
pub(crate) fn handle(cluster: &Cluster, call: Call<'_>) -> Response<Body> {
    match dispatch(cluster, call) {
        Ok(response) => response,
        Err(e) => error_response(&e),
    }
}

fn dispatch(cluster: &Cluster, call: Call<'_>) -> Result<Response<Body>, ApiError> {
    let target = route(call.path).ok_or_else(|| ApiError::no_route(call.path))?;
    let ok = |v: Value| Ok(json_response(200, &v));
    let method = call.method;
    match target {
        Target::Health if method == Method::GET => Ok(Response::builder()
            .status(200)
            .header("content-type", "text/plain; charset=utf-8")
            .body(Full::new(Bytes::from_static(b"ok")).boxed_unsync())
            .unwrap_or_else(|_| Response::new(Full::new(Bytes::new()).boxed_unsync()))),
        Target::Health => Err(ApiError::method_not_allowed(method.as_str())),
        Target::Version | Target::CoreVersions | Target::Groups | Target::Resources(_) if method != Method::GET => {
            Err(ApiError::method_not_allowed(method.as_str()))
        }
        Target::Version => ok(kinds::version()),
        Target::CoreVersions => ok(kinds::core_versions()),
        Target::Groups => ok(kinds::group_list()),
        Target::Resources(group) => ok(kinds::resource_list(group)),
        Target::Collection { kind, namespace } => match *method {
            Method::GET => {
                let filter = filter(cluster, kind, &call.query, namespace)?;
                if call.query.flag("watch") {
                    return watch(cluster, kind, &call.query, filter);
                }
                ok(list(cluster, kind, &call.query, &filter)?)
            }
            Method::POST if kind.namespaced == namespace.is_some() => {
                let obj = parse_body(call.content_type, &call.body)?;
                let created = cluster.with_store(|s| s.create(kind, namespace.as_deref(), obj))?;
                Ok(json_response(201, &created))
            }
            _ => Err(ApiError::method_not_allowed(method.as_str())),
        },
        Target::Object { kind, namespace, name, part } => {
            let ns = namespace.as_deref().unwrap_or_default();
            match *method {
                Method::GET => cluster
                    .with_store(|s| s.get(kind, ns, &name))
                    .map(|o| json_response(200, &o))
                    .ok_or_else(|| ApiError::not_found(kind, &name)),
                Method::PUT => {
                    let obj = parse_body(call.content_type, &call.body)?;
                    ok(cluster.with_store(|s| s.replace(kind, ns, &name, obj, part))?)
                }
                Method::PATCH => {
                    let ty = PatchType::from_content_type(call.content_type)?;
                    ok(cluster.with_store(|s| s.patch(kind, ns, &name, ty, &call.body, part))?)
                }
                Method::DELETE if part == Part::Main => {
                    let body =
                        if call.body.is_empty() { Value::Null } else { parse_body(call.content_type, &call.body)? };
                    let mut options = DeleteOptions::from_body(&body);
                    if let Some(g) = call.query.get("gracePeriodSeconds").filter(|g| !g.is_empty()) {
                        let g = g
                            .parse()
                            .map_err(|_| ApiError::bad_request(format!("invalid gracePeriodSeconds {g:?}")))?;
                        options.grace_period_seconds = Some(g);
                    }
                    let graceful = cluster.config().graceful_deletion;
                    ok(cluster.with_store(|s| s.delete(kind, ns, &name, &options, graceful))?)
                }
                _ => Err(ApiError::method_not_allowed(method.as_str())),
            }
        }
    }
}

fn watch(
    cluster: &Cluster,
    kind: &'static ResourceKind,
    query: &Query,
    filter: Filter,
) -> Result<Response<Body>, ApiError> {
    let config = &cluster.config().watch;
    let asked = match query.get("timeoutSeconds") {
        None | Some("") | Some("0") => None,
        Some(t) => Some(Duration::from_secs(
            t.parse().map_err(|_| ApiError::bad_request(format!("invalid timeoutSeconds {t:?}")))?,
        )),
    };
    // The server's own timeout caps the client's (kube clients always ask for 290s).
    let server_side = config.min_timeout.map(|t| t.mul_f64(1.0 + ids::unit_random()));
    let timeout = match (asked, server_side) {
        (Some(a), Some(s)) => Some(a.min(s)),
        (a, s) => a.or(s),
    };
    let spec = WatchSpec {
        kind,
        filter,
        resource_version: watch::parse_rv(query.get("resourceVersion"))?,
        send_initial_events: query.flag("sendInitialEvents"),
        bookmarks: query.flag("allowWatchBookmarks"),
        bookmark_interval: config.bookmark_interval,
        timeout,
    };
    let body = watch::watch_body(cluster.clone(), spec);
    Response::builder()
        .status(200)
        .header("content-type", "application/json")
        .header("transfer-encoding", "chunked")
        .body(body)
        .map_err(|e| ApiError::bad_request(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_paths() {
        let pod = kinds::by_name("Pod").unwrap();
        let ns = kinds::by_name("Namespace").unwrap();
        assert_eq!(
            route("/api/v1/namespaces/a/pods"),
            Some(Target::Collection { kind: pod, namespace: Some("a".into()) })
        );
        assert_eq!(
            route("/api/v1/namespaces/a/pods/p/status"),
            Some(Target::Object { kind: pod, namespace: Some("a".into()), name: "p".into(), part: Part::Status })
        );
        assert_eq!(route("/api/v1/pods"), Some(Target::Collection { kind: pod, namespace: None }));
        assert_eq!(
            route("/api/v1/namespaces/a"),
            Some(Target::Object { kind: ns, namespace: None, name: "a".into(), part: Part::Main })
        );
        assert_eq!(
            route("/api/v1/namespaces/a/status"),
            Some(Target::Object { kind: ns, namespace: None, name: "a".into(), part: Part::Status })
        );
        assert!(matches!(route("/apis/apps/v1/daemonsets"), Some(Target::Collection { namespace: None, .. })));
        assert_eq!(route("/api/v1/pods/p"), None);
        assert_eq!(route("/api/v1/namespaces/a/nodes"), None);
        assert_eq!(route("/api/v1/namespaces/a/pods/p/log"), None);
        assert_eq!(route("/apis/batch/v1/jobs"), None);
        assert_eq!(route("/api/v1/namespaces/a/configmaps/c/status"), None, "no status subresource");
        let crb = kinds::by_name("ClusterRoleBinding").unwrap();
        assert_eq!(
            route("/apis/rbac.authorization.k8s.io/v1/clusterrolebindings/b"),
            Some(Target::Object { kind: crb, namespace: None, name: "b".into(), part: Part::Main })
        );
        assert_eq!(route("/apis/rbac.authorization.k8s.io/v1"), Some(Target::Resources(kinds::RBAC_GROUP)));
    }
}

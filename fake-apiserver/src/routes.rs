//! Maps Kubernetes REST paths and verbs onto store operations, lists and watches.

use crate::cluster::Cluster;
use crate::kinds::{self, ResourceKind};
use crate::query::Query;
use crate::selectors::{FieldSelector, Filter, LabelSelector};
use crate::status::ApiError;
use crate::store::Part;
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
    CoreVersions,
    Groups,
    Resources(&'static str),
    Collection { kind: &'static ResourceKind, namespace: Option<String> },
    Object { kind: &'static ResourceKind, namespace: Option<String>, name: String, part: Part },
}

fn route(path: &str) -> Option<Target> {
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, rest): (&'static str, &[&str]) = match segs.as_slice() {
        ["version"] => return Some(Target::Version),
        ["api"] => return Some(Target::CoreVersions),
        ["apis"] => return Some(Target::Groups),
        ["api", "v1"] => return Some(Target::Resources("")),
        ["apis", "apps", "v1"] => return Some(Target::Resources("apps")),
        ["api", "v1", rest @ ..] => ("", rest),
        ["apis", "apps", "v1", rest @ ..] => ("apps", rest),
        _ => return None,
    };
    let object = |kind, namespace: Option<&str>, name: &str, sub: Option<&str>| {
        let part = match sub {
            None => Part::Main,
            Some("status") => Part::Status,
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

fn filter(query: &Query, namespace: Option<String>) -> Result<Filter, ApiError> {
    Ok(Filter {
        namespace,
        labels: LabelSelector::parse(query.get("labelSelector").unwrap_or_default()).map_err(ApiError::bad_request)?,
        fields: FieldSelector::parse(query.get("fieldSelector").unwrap_or_default()).map_err(ApiError::bad_request)?,
    })
}

fn list(cluster: &Cluster, kind: &'static ResourceKind, query: &Query, filter: &Filter) -> Result<Value, ApiError> {
    let limit: usize = match query.get("limit") {
        None | Some("") => 0,
        Some(l) => l.parse().map_err(|_| ApiError::bad_request(format!("invalid limit {l:?}")))?,
    };
    let after = query
        .get("continue")
        .filter(|c| !c.is_empty())
        .map(|c| c.split_once('/').ok_or_else(|| ApiError::bad_request("invalid continue token")))
        .transpose()?;
    let position = |o: &Value| {
        let m = &o["metadata"];
        (m["namespace"].as_str().unwrap_or_default().to_string(), m["name"].as_str().unwrap_or_default().to_string())
    };
    let (mut items, rv) = cluster.with_store(|s| {
        let items: Vec<Value> = s
            .list(kind, filter.namespace.as_deref())
            .filter(|o| filter.matches(o))
            .filter(|o| after.is_none_or(|(ns, name)| position(o) > (ns.to_string(), name.to_string())))
            .map(|o| (**o).clone())
            .collect();
        (items, s.resource_version())
    });
    let mut metadata = json!({"resourceVersion": rv.to_string()});
    if limit > 0 && items.len() > limit {
        items.truncate(limit);
        let (ns, name) = position(&items[limit - 1]);
        metadata["continue"] = json!(format!("{ns}/{name}"));
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
        Target::Version | Target::CoreVersions | Target::Groups | Target::Resources(_) if method != Method::GET => {
            Err(ApiError::method_not_allowed(method.as_str()))
        }
        Target::Version => ok(kinds::version()),
        Target::CoreVersions => ok(kinds::core_versions()),
        Target::Groups => ok(kinds::group_list()),
        Target::Resources(group) => ok(kinds::resource_list(group)),
        Target::Collection { kind, namespace } => match *method {
            Method::GET => {
                let filter = filter(&call.query, namespace)?;
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
                    let ct = call.content_type.split(';').next().unwrap_or_default().trim();
                    let create_missing = match ct {
                        "application/merge-patch+json" | "application/strategic-merge-patch+json" => false,
                        "application/apply-patch+yaml" => true,
                        other => return Err(ApiError::unsupported_media_type(other)),
                    };
                    let patch = parse_body(ct, &call.body)?;
                    ok(cluster.with_store(|s| s.patch(kind, ns, &name, &patch, part, create_missing))?)
                }
                Method::DELETE if part == Part::Main => {
                    let options =
                        if call.body.is_empty() { Value::Null } else { parse_body(call.content_type, &call.body)? };
                    let pre = options.get("preconditions");
                    ok(cluster.with_store(|s| s.delete(kind, ns, &name, pre))?)
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
    let timeout = match query.get("timeoutSeconds") {
        None | Some("") => None,
        Some(t) => Some(Duration::from_secs(
            t.parse().map_err(|_| ApiError::bad_request(format!("invalid timeoutSeconds {t:?}")))?,
        )),
    };
    let spec = WatchSpec {
        kind,
        filter,
        resource_version: watch::parse_rv(query.get("resourceVersion"))?,
        send_initial_events: query.flag("sendInitialEvents"),
        bookmarks: query.flag("allowWatchBookmarks"),
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
    }
}

//! Label and field selectors, parsed from the `labelSelector` / `fieldSelector` query parameters.

use crate::kinds::ResourceKind;
use serde_json::Value;

/// One requirement of a label selector; all requirements of a selector must hold (comma = AND).
#[derive(Debug, Clone, PartialEq)]
enum LabelReq {
    Eq(String, String),
    NotEq(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    NotExists(String),
    Gt(String, i64),
    Lt(String, i64),
}

/// A parsed `labelSelector`; the empty selector matches everything.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct LabelSelector(Vec<LabelReq>);

/// Splits on commas that are not inside parentheses.
fn split_top_level(s: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let mut depth = 0usize;
    let mut start = 0;
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&s[start..]);
    parts
}

fn valid_key(key: &str) -> bool {
    !key.is_empty() && key.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'))
}

fn parse_set(key: &str, rest: &str, expr: &str) -> Result<Vec<String>, String> {
    let inner = rest
        .trim()
        .strip_prefix('(')
        .and_then(|r| r.strip_suffix(')'))
        .ok_or_else(|| format!("unable to parse requirement: {expr:?}: expected (values) after {key}"))?;
    Ok(inner.split(',').map(|v| v.trim().to_string()).filter(|v| !v.is_empty()).collect())
}

fn parse_label_req(expr: &str) -> Result<LabelReq, String> {
    let e = expr.trim();
    if let Some(key) = e.strip_prefix('!') {
        let key = key.trim();
        return valid_key(key)
            .then(|| LabelReq::NotExists(key.to_string()))
            .ok_or_else(|| format!("invalid label key in {expr:?}"));
    }
    for (op, ctor) in
        [("!=", LabelReq::NotEq as fn(String, String) -> LabelReq), ("==", LabelReq::Eq), ("=", LabelReq::Eq)]
    {
        if let Some((k, v)) = e.split_once(op) {
            let k = k.trim();
            if !valid_key(k) {
                return Err(format!("invalid label key in {expr:?}"));
            }
            return Ok(ctor(k.to_string(), v.trim().to_string()));
        }
    }
    for op in ['>', '<'] {
        if let Some((k, v)) = e.split_once(op) {
            let k = k.trim();
            let n: i64 = v.trim().parse().map_err(|_| format!("invalid integer value in {expr:?}"))?;
            if !valid_key(k) {
                return Err(format!("invalid label key in {expr:?}"));
            }
            return Ok(if op == '>' { LabelReq::Gt(k.to_string(), n) } else { LabelReq::Lt(k.to_string(), n) });
        }
    }
    let mut words = e.splitn(2, char::is_whitespace);
    let key = words.next().unwrap_or_default();
    let rest = words.next().unwrap_or_default().trim_start();
    if !valid_key(key) {
        return Err(format!("invalid label key in {expr:?}"));
    }
    if rest.is_empty() {
        return Ok(LabelReq::Exists(key.to_string()));
    }
    if let Some(r) = rest.strip_prefix("notin") {
        return Ok(LabelReq::NotIn(key.to_string(), parse_set(key, r, expr)?));
    }
    if let Some(r) = rest.strip_prefix("in") {
        return Ok(LabelReq::In(key.to_string(), parse_set(key, r, expr)?));
    }
    Err(format!("unable to parse requirement: {expr:?}"))
}

impl LabelSelector {
    /// Parses the Kubernetes label selector syntax (equality, set-based, existence, `>`/`<`).
    pub fn parse(s: &str) -> Result<LabelSelector, String> {
        if s.trim().is_empty() {
            return Ok(LabelSelector::default());
        }
        split_top_level(s).into_iter().map(parse_label_req).collect::<Result<_, _>>().map(LabelSelector)
    }

    /// Whether `obj`'s `metadata.labels` satisfy every requirement.
    pub fn matches(&self, obj: &Value) -> bool {
        let labels = obj.pointer("/metadata/labels");
        let get = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
        self.0.iter().all(|req| match req {
            LabelReq::Eq(k, v) => get(k) == Some(v.as_str()),
            LabelReq::NotEq(k, v) => get(k) != Some(v.as_str()),
            LabelReq::In(k, vs) => get(k).is_some_and(|x| vs.iter().any(|v| v == x)),
            LabelReq::NotIn(k, vs) => !get(k).is_some_and(|x| vs.iter().any(|v| v == x)),
            LabelReq::Exists(k) => get(k).is_some(),
            LabelReq::NotExists(k) => get(k).is_none(),
            LabelReq::Gt(k, n) => get(k).and_then(|x| x.parse::<i64>().ok()).is_some_and(|x| x > *n),
            LabelReq::Lt(k, n) => get(k).and_then(|x| x.parse::<i64>().ok()).is_some_and(|x| x < *n),
        })
    }
}

/// A parsed `fieldSelector`: `path=value`, `path==value`, `path!=value` terms joined by commas.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct FieldSelector(Vec<(String, bool, String)>);

/// The string value of a dotted field path as the apiserver's field sets expose it ("" when unset; booleans
/// the real server always sets read "false" when unset, and a pod's `status.podIP` falls back to `podIPs`).
fn field_value(obj: &Value, path: &str) -> String {
    match path {
        "spec.hostNetwork" | "spec.unschedulable" if obj.pointer(&format!("/{}", path.replace('.', "/"))).is_none() => {
            return "false".to_string()
        }
        "status.podIP" if obj.pointer("/status/podIP").is_none() => {
            return obj.pointer("/status/podIPs/0/ip").and_then(Value::as_str).unwrap_or_default().to_string()
        }
        _ => {}
    }
    let mut cur = obj;
    for part in path.split('.') {
        match cur.get(part) {
            Some(next) => cur = next,
            None => return String::new(),
        }
    }
    match cur {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

impl FieldSelector {
    /// Parses a field selector; any dotted path (e.g. `spec.nodeName`, `status.phase`) is accepted.
    pub fn parse(s: &str) -> Result<FieldSelector, String> {
        if s.trim().is_empty() {
            return Ok(FieldSelector::default());
        }
        s.split(',')
            .map(|term| {
                let (path, eq, value) = if let Some((p, v)) = term.split_once("!=") {
                    (p, false, v)
                } else if let Some((p, v)) = term.split_once("==") {
                    (p, true, v)
                } else if let Some((p, v)) = term.split_once('=') {
                    (p, true, v)
                } else {
                    return Err(format!("invalid field selector term {term:?}: expected = or !="));
                };
                let path = path.trim();
                if path.is_empty() {
                    return Err(format!("invalid field selector term {term:?}: empty field"));
                }
                Ok((path.to_string(), eq, value.trim().to_string()))
            })
            .collect::<Result<_, _>>()
            .map(FieldSelector)
    }

    /// Refuses fields the real server cannot select on for `kind`, with its error message.
    pub fn check_supported(&self, kind: &ResourceKind) -> Result<(), String> {
        match self.0.iter().find(|(path, _, _)| !kind.selectable_fields.contains(&path.as_str())) {
            Some((path, _, _)) => Err(format!("field label not supported: {path}")),
            None => Ok(()),
        }
    }

    /// Whether every term holds for `obj`.
    pub fn matches(&self, obj: &Value) -> bool {
        self.0.iter().all(|(path, eq, value)| (field_value(obj, path) == *value) == *eq)
    }
}

/// What a list or watch selects: an optional namespace plus label and field selectors.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Filter {
    pub namespace: Option<String>,
    pub labels: LabelSelector,
    pub fields: FieldSelector,
}

impl Filter {
    /// Whether `obj` is in this filter's namespace (if any) and satisfies both selectors.
    pub fn matches(&self, obj: &Value) -> bool {
        let in_namespace = self
            .namespace
            .as_deref()
            .is_none_or(|ns| obj.pointer("/metadata/namespace").and_then(Value::as_str) == Some(ns));
        in_namespace && self.labels.matches(obj) && self.fields.matches(obj)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(labels: Value) -> Value {
        json!({"metadata": {"name": "p", "namespace": "ns", "labels": labels},
               "spec": {"nodeName": "n1", "hostNetwork": true}, "status": {"phase": "Running"}})
    }

    #[test]
    fn label_equality_set_and_existence() {
        let p = pod(json!({"app": "web", "tier": "front", "n": "7"}));
        let yes = [
            "app=web",
            "app==web",
            "app!=db",
            "app in (db, web)",
            "tier notin (back)",
            "app",
            "!missing",
            "app=web,tier=front",
            "n>5",
            "n<8",
            "missing!=x",
            "missing notin (x)",
        ];
        for s in yes {
            assert!(LabelSelector::parse(s).unwrap().matches(&p), "{s} should match");
        }
        let no = ["app=db", "app in (db)", "app notin (web,db)", "missing", "!app", "app=web,tier=back", "n>7"];
        for s in no {
            assert!(!LabelSelector::parse(s).unwrap().matches(&p), "{s} should not match");
        }
        assert!(LabelSelector::parse("a in x").is_err());
        assert!(LabelSelector::parse("=x").is_err());
    }

    #[test]
    fn field_selectors() {
        let p = pod(json!({}));
        for s in ["spec.nodeName=n1", "metadata.name==p", "status.phase!=Pending", "spec.hostNetwork=true"] {
            assert!(FieldSelector::parse(s).unwrap().matches(&p), "{s}");
        }
        for s in ["spec.nodeName=n2", "metadata.namespace=other", "spec.missing=x"] {
            assert!(!FieldSelector::parse(s).unwrap().matches(&p), "{s}");
        }
        assert!(FieldSelector::parse("spec.missing=").unwrap().matches(&p));
        assert!(FieldSelector::parse("nonsense").is_err());
        let plain = json!({"metadata": {"name": "q"}, "status": {"podIPs": [{"ip": "10.0.0.9"}]}});
        for s in ["spec.hostNetwork=false", "status.podIP=10.0.0.9"] {
            assert!(FieldSelector::parse(s).unwrap().matches(&plain), "{s}");
        }
    }

    #[test]
    fn only_the_real_servers_fields_are_supported() {
        let pods = crate::kinds::by_name("Pod").unwrap();
        let nodes = crate::kinds::by_name("Node").unwrap();
        let ds = crate::kinds::by_name("DaemonSet").unwrap();
        let ok = |k, s| FieldSelector::parse(s).unwrap().check_supported(k);
        assert_eq!(ok(pods, "spec.nodeName=n1,status.phase!=Failed,spec.hostNetwork=true"), Ok(()));
        assert_eq!(ok(pods, "spec.containers=x"), Err("field label not supported: spec.containers".into()));
        assert_eq!(ok(nodes, "spec.unschedulable=false,metadata.name=n"), Ok(()));
        assert!(ok(nodes, "metadata.namespace=x").is_err());
        assert_eq!(ok(ds, "metadata.namespace=x,metadata.name=y"), Ok(()));
        assert!(ok(ds, "spec.selector=x").is_err());
    }
}

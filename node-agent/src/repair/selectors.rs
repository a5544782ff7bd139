//! `REPAIR_LABEL_SELECTORS` and `REPAIR_FIELD_SELECTORS`: Istio's repair controller lists only the pods these
//! Kubernetes selectors match. Ours follows the agent's one watch of this node's pods, so it applies the same
//! selectors to each pod it sees, with the API server's syntax and meaning.

use std::collections::BTreeMap;

use istio_contract::pod::SELECTABLE_FIELDS;
use k8s_openapi::api::core::v1::Pod;

/// A selector setting that does not parse; the message names the setting and the offending part.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SelectorError {
    /// A label selector requirement is malformed.
    #[error("REPAIR_LABEL_SELECTORS: invalid requirement {0:?}")]
    Label(String),
    /// A field selector requirement is malformed or names a field pods cannot be selected by.
    #[error("REPAIR_FIELD_SELECTORS: invalid requirement {0:?} (fields: {fields})", fields = SELECTABLE_FIELDS.join(", "))]
    Field(String),
}

/// One label requirement, in the API server's selector syntax.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Label {
    /// `key` (`Exists`) or `!key` (`DoesNotExist`, when `present` is false).
    Exists { key: String, present: bool },
    /// `key in (a,b)` (`In`) or `key notin (a,b)` (`NotIn`, when `inside` is false); `key=a` is `In` with one value,
    /// `key!=a` is `NotIn` with one value.
    In { key: String, values: Vec<String>, inside: bool },
}

/// One field requirement: `field=value` (or `==`), or `field!=value` when `equal` is false.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Field {
    path: String,
    value: String,
    equal: bool,
}

/// Which pods the repair controller may touch: all (the default) or those both selectors match.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodSelection {
    labels: Vec<Label>,
    fields: Vec<Field>,
}

impl PodSelection {
    /// Parses the two settings (empty: no restriction).
    pub fn parse(label_selectors: &str, field_selectors: &str) -> Result<Self, SelectorError> {
        let labels = split_outside_parens(label_selectors).iter().map(|r| parse_label(r)).collect::<Result<_, _>>()?;
        let fields = split_outside_parens(field_selectors).iter().map(|r| parse_field(r)).collect::<Result<_, _>>()?;
        Ok(Self { labels, fields })
    }

    /// Whether `pod` is one the selectors let the repair controller touch.
    pub fn matches(&self, pod: &Pod) -> bool {
        let empty = BTreeMap::new();
        let labels = pod.metadata.labels.as_ref().unwrap_or(&empty);
        self.labels.iter().all(|req| match req {
            Label::Exists { key, present } => labels.contains_key(key) == *present,
            Label::In { key, values, inside } => match labels.get(key) {
                Some(value) => values.contains(value) == *inside,
                // `NotIn` (and `!=`) match pods without the label, as in Kubernetes.
                None => !*inside,
            },
        }) && self.fields.iter().all(|f| (field_value(pod, &f.path) == f.value) == f.equal)
    }
}

/// Splits on commas outside `(...)`, dropping empty parts.
fn split_outside_parens(text: &str) -> Vec<String> {
    let (mut parts, mut current, mut depth) = (Vec::new(), String::new(), 0usize);
    for c in text.chars() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                parts.push(std::mem::take(&mut current));
                continue;
            }
            _ => {}
        }
        current.push(c);
    }
    parts.push(current);
    parts.into_iter().map(|p| p.trim().to_owned()).filter(|p| !p.is_empty()).collect()
}

fn valid_key(key: &str) -> bool {
    !key.is_empty() && key.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'))
}

fn valid_value(value: &str) -> bool {
    value.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

fn parse_label(req: &str) -> Result<Label, SelectorError> {
    let invalid = || SelectorError::Label(req.to_owned());
    let single = |key: &str, value: &str, inside: bool| {
        let (key, value) = (key.trim(), value.trim());
        (valid_key(key) && valid_value(value))
            .then(|| Label::In { key: key.to_owned(), values: vec![value.to_owned()], inside })
            .ok_or_else(invalid)
    };
    if let Some((key, value)) = req.split_once("!=") {
        return single(key, value, false);
    }
    if let Some((key, value)) = req.split_once("==").or_else(|| req.split_once('=')) {
        return single(key, value, true);
    }
    if let Some(open) = req.find('(') {
        let list = req[open..].strip_prefix('(').and_then(|l| l.strip_suffix(')')).ok_or_else(invalid)?;
        let mut words = req[..open].split_whitespace();
        let (Some(key), Some(op), None) = (words.next(), words.next(), words.next()) else { return Err(invalid()) };
        let inside = match op {
            "in" => true,
            "notin" => false,
            _ => return Err(invalid()),
        };
        let values: Vec<String> = list.split(',').map(|v| v.trim().to_owned()).collect();
        if !valid_key(key) || values.iter().any(|v| v.is_empty() || !valid_value(v)) {
            return Err(invalid());
        }
        return Ok(Label::In { key: key.to_owned(), values, inside });
    }
    let (key, present) = match req.strip_prefix('!') {
        Some(key) => (key.trim(), false),
        None => (req, true),
    };
    valid_key(key).then(|| Label::Exists { key: key.to_owned(), present }).ok_or_else(invalid)
}

fn parse_field(req: &str) -> Result<Field, SelectorError> {
    let (path, value, equal) = if let Some((p, v)) = req.split_once("!=") {
        (p, v, false)
    } else if let Some((p, v)) = req.split_once("==").or_else(|| req.split_once('=')) {
        (p, v, true)
    } else {
        return Err(SelectorError::Field(req.to_owned()));
    };
    let path = path.trim();
    if !SELECTABLE_FIELDS.contains(&path) {
        return Err(SelectorError::Field(req.to_owned()));
    }
    Ok(Field { path: path.to_owned(), value: value.trim().to_owned(), equal })
}

/// The value a field selector compares (empty when unset, as the API server does).
fn field_value(pod: &Pod, path: &str) -> String {
    let spec = pod.spec.as_ref();
    let status = pod.status.as_ref();
    let text = |v: Option<&String>| v.cloned().unwrap_or_default();
    match path {
        "metadata.name" => text(pod.metadata.name.as_ref()),
        "metadata.namespace" => text(pod.metadata.namespace.as_ref()),
        "spec.nodeName" => text(spec.and_then(|s| s.node_name.as_ref())),
        "spec.restartPolicy" => text(spec.and_then(|s| s.restart_policy.as_ref())),
        "spec.schedulerName" => text(spec.and_then(|s| s.scheduler_name.as_ref())),
        "spec.serviceAccountName" => text(spec.and_then(|s| s.service_account_name.as_ref())),
        "spec.hostNetwork" => spec.and_then(|s| s.host_network).unwrap_or(false).to_string(),
        "status.phase" => text(status.and_then(|s| s.phase.as_ref())),
        "status.podIP" => text(status.and_then(|s| s.pod_ip.as_ref())),
        "status.nominatedNodeName" => text(status.and_then(|s| s.nominated_node_name.as_ref())),
        _ => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(labels: serde_json::Value, namespace: &str) -> Pod {
        serde_json::from_value(json!({
            "metadata": { "name": "p", "namespace": namespace, "labels": labels },
            "spec": { "nodeName": "node-1", "containers": [{ "name": "app" }] },
            "status": { "phase": "Pending" },
        }))
        .unwrap()
    }

    fn sel(labels: &str, fields: &str) -> PodSelection {
        PodSelection::parse(labels, fields).unwrap()
    }

    #[test]
    fn empty_selectors_match_every_pod() {
        assert!(sel("", "").matches(&pod(json!({}), "ns")));
        assert!(sel(" , ", "").matches(&pod(json!({}), "ns")));
    }

    #[test]
    fn label_selectors_have_the_api_servers_meaning() {
        let app = pod(json!({ "app": "web", "tier": "front" }), "ns");
        let bare = pod(json!({}), "ns");
        for (selector, on_app, on_bare) in [
            ("app=web", true, false),
            ("app==web", true, false),
            ("app!=web", false, true),
            ("app", true, false),
            ("!app", false, true),
            ("app in (web, api)", true, false),
            ("app notin (web,api)", false, true),
            ("app=web,tier in (front)", true, false),
            ("app=web,tier=back", false, false),
        ] {
            let s = sel(selector, "");
            assert_eq!((s.matches(&app), s.matches(&bare)), (on_app, on_bare), "{selector}");
        }
    }

    #[test]
    fn field_selectors_compare_pod_fields() {
        let p = pod(json!({}), "team-a");
        assert!(sel("", "metadata.namespace=team-a").matches(&p));
        assert!(!sel("", "metadata.namespace!=team-a").matches(&p));
        assert!(sel("", "metadata.namespace==team-a,spec.nodeName=node-1,status.phase=Pending").matches(&p));
        assert!(!sel("", "metadata.namespace=team-b").matches(&p));
        assert!(sel("", "spec.hostNetwork=false").matches(&p));
    }

    #[test]
    fn malformed_selectors_name_the_setting() {
        for bad in ["app in web", "app in (web", "a b", "app=(x)", "=x", "app foo (x)"] {
            let error = PodSelection::parse(bad, "").unwrap_err().to_string();
            assert!(error.starts_with("REPAIR_LABEL_SELECTORS"), "{bad}: {error}");
        }
        for bad in ["metadata.labels=x", "spec.nodeName", "x=y"] {
            let error = PodSelection::parse("", bad).unwrap_err().to_string();
            assert!(error.starts_with("REPAIR_FIELD_SELECTORS"), "{bad}: {error}");
        }
    }
}

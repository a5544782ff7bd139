//! Who is in the ambient mesh: Istio's enablement selectors (pod and namespace label selectors), evaluated the
//! same way by the plugin at pod creation and by the node agent for running pods, plus the pods that are never
//! enrolled whatever their labels say.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, LabelSelectorRequirement};
use serde::{Deserialize, Serialize};

use crate::names::{DATAPLANE_MODE_LABEL, SIDECAR_STATUS_ANNOTATION};

/// A bad selector configuration.
#[derive(Debug, thiserror::Error)]
pub enum SelectorError {
    /// The YAML/JSON could not be parsed as a list of selectors.
    #[error("enablement selectors: {0}")]
    Parse(String),
    /// An operator other than In, NotIn, Exists, DoesNotExist.
    #[error("enablement selectors: unknown operator {0:?}")]
    Operator(String),
}

/// One entry: the pod matches when both selectors match (a missing or empty selector matches everything; parsing
/// reads an empty one, `{}` as Istio writes it into the netconf, as missing).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EnablementSelector {
    /// Selector over the pod's labels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_selector: Option<LabelSelector>,
    /// Selector over the pod's namespace's labels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace_selector: Option<LabelSelector>,
}

/// The configured selectors; a pod is enabled when any of them matches.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Selectors(pub Vec<EnablementSelector>);

impl Default for Selectors {
    /// Istio's default: the pod label `istio.io/dataplane-mode=ambient`, or the namespace label unless the pod
    /// label says `none`.
    fn default() -> Self {
        let ambient = || BTreeMap::from([(DATAPLANE_MODE_LABEL.to_owned(), "ambient".to_owned())]);
        Selectors(vec![
            EnablementSelector {
                pod_selector: Some(LabelSelector { match_labels: Some(ambient()), ..LabelSelector::default() }),
                namespace_selector: None,
            },
            EnablementSelector {
                pod_selector: Some(LabelSelector {
                    match_expressions: Some(vec![LabelSelectorRequirement {
                        key: DATAPLANE_MODE_LABEL.to_owned(),
                        operator: "NotIn".to_owned(),
                        values: Some(vec!["none".to_owned()]),
                    }]),
                    ..LabelSelector::default()
                }),
                namespace_selector: Some(LabelSelector { match_labels: Some(ambient()), ..LabelSelector::default() }),
            },
        ])
    }
}

/// Labels of a pod or namespace.
pub type Labels = BTreeMap<String, String>;

impl Selectors {
    /// Parses YAML or JSON (JSON is YAML) as `AMBIENT_ENABLEMENT_SELECTOR` and the netconf carry it; operators are
    /// checked up front so a typo fails at startup, not silently at match time.
    pub fn parse(text: &str) -> Result<Selectors, SelectorError> {
        let s: Selectors = serde_yaml::from_str(text).map_err(|e| SelectorError::Parse(e.to_string()))?;
        s.validate()?;
        Ok(s.without_empty())
    }

    /// From the netconf's already-decoded JSON value (`null` or absent means the defaults).
    pub fn from_json(value: Option<&serde_json::Value>) -> Result<Selectors, SelectorError> {
        match value {
            None | Some(serde_json::Value::Null) => Ok(Selectors::default()),
            Some(v) => {
                let s: Selectors =
                    serde_json::from_value(v.clone()).map_err(|e| SelectorError::Parse(e.to_string()))?;
                s.validate()?;
                Ok(s.without_empty())
            }
        }
    }

    /// The selectors as JSON, the form the plugin's netconf carries (`enablement_selectors`).
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).unwrap_or_else(|_| unreachable!("label selectors always serialize"))
    }

    /// The selectors as YAML, the form `AMBIENT_ENABLEMENT_SELECTOR` takes in Istio's chart.
    pub fn to_yaml(&self) -> String {
        serde_yaml::to_string(self).unwrap_or_else(|_| unreachable!("label selectors always serialize"))
    }

    /// Empty selectors (no labels, no expressions: they match everything) as missing ones, which mean the same, so
    /// `decide_without_namespace` need not fetch a namespace for `namespaceSelector: {}`.
    fn without_empty(mut self) -> Self {
        let empty = |s: &LabelSelector| {
            s.match_labels.as_ref().is_none_or(|l| l.is_empty())
                && s.match_expressions.as_ref().is_none_or(|e| e.is_empty())
        };
        for entry in &mut self.0 {
            for selector in [&mut entry.pod_selector, &mut entry.namespace_selector] {
                if selector.as_ref().is_some_and(empty) {
                    *selector = None;
                }
            }
        }
        self
    }

    fn validate(&self) -> Result<(), SelectorError> {
        let exprs = self.0.iter().flat_map(|e| [&e.pod_selector, &e.namespace_selector]).flatten();
        for req in exprs.flat_map(|s| s.match_expressions.iter().flatten()) {
            if !matches!(req.operator.as_str(), "In" | "NotIn" | "Exists" | "DoesNotExist") {
                return Err(SelectorError::Operator(req.operator.clone()));
            }
        }
        Ok(())
    }

    /// `Some(answer)` when the pod labels alone decide (an entry without a namespace selector matches, or no entry
    /// looks at namespaces at all), so callers can skip fetching the namespace; `None` when its labels are needed.
    pub fn decide_without_namespace(&self, pod_labels: &Labels) -> Option<bool> {
        let pod_matches =
            |e: &EnablementSelector| e.pod_selector.as_ref().is_none_or(|s| selector_matches(s, pod_labels));
        if self.0.iter().any(|e| e.namespace_selector.is_none() && pod_matches(e)) {
            return Some(true);
        }
        if self.0.iter().all(|e| e.namespace_selector.is_none() || !pod_matches(e)) {
            return Some(false);
        }
        None
    }

    /// Whether a pod with `pod_labels` in a namespace with `namespace_labels` is selected.
    pub fn matches(&self, pod_labels: &Labels, namespace_labels: &Labels) -> bool {
        self.matching(pod_labels, namespace_labels).is_some()
    }

    /// The first entry that selects a pod with `pod_labels` in a namespace with `namespace_labels`, if any:
    /// what `node-agent explain` names as the reason a pod is in ambient.
    pub fn matching(&self, pod_labels: &Labels, namespace_labels: &Labels) -> Option<(usize, &EnablementSelector)> {
        self.0.iter().enumerate().find(|(_, e)| {
            e.pod_selector.as_ref().is_none_or(|s| selector_matches(s, pod_labels))
                && e.namespace_selector.as_ref().is_none_or(|s| selector_matches(s, namespace_labels))
        })
    }
}

fn selector_matches(selector: &LabelSelector, labels: &Labels) -> bool {
    selector.match_labels.iter().flatten().all(|(k, v)| labels.get(k) == Some(v))
        && selector.match_expressions.iter().flatten().all(|r| requirement_matches(r, labels))
}

fn requirement_matches(req: &LabelSelectorRequirement, labels: &Labels) -> bool {
    let value = labels.get(&req.key);
    let values = req.values.as_deref().unwrap_or_default();
    match req.operator.as_str() {
        "In" => value.is_some_and(|v| values.contains(v)),
        "NotIn" => value.is_none_or(|v| !values.contains(v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        _ => false,
    }
}

/// What the enrollment decision needs to know about a pod besides its labels.
#[derive(Debug, Clone)]
pub struct PodFacts<'a> {
    /// Pod namespace.
    pub namespace: &'a str,
    /// Pod labels.
    pub labels: &'a Labels,
    /// Pod annotations.
    pub annotations: &'a Labels,
    /// `spec.hostNetwork`.
    pub host_network: bool,
}

impl<'a> PodFacts<'a> {
    /// The facts of the API object `pod`; its missing label or annotation maps read as `empty`.
    pub fn of(pod: &'a Pod, empty: &'a Labels) -> Self {
        PodFacts {
            namespace: pod.metadata.namespace.as_deref().unwrap_or_default(),
            labels: pod.metadata.labels.as_ref().unwrap_or(empty),
            annotations: pod.metadata.annotations.as_ref().unwrap_or(empty),
            host_network: pod.spec.as_ref().and_then(|s| s.host_network).unwrap_or(false),
        }
    }
}

/// The decision when it needs no namespace: `Some(false)` for a [`never_enrolled`] pod, `Some(answer)` when the
/// pod's own labels decide; `None` when the namespace's labels are needed ([`Selectors::matches`] then decides).
/// The plugin (a namespace GET) and the node agent (its namespace watch) both start here, so neither looks a
/// namespace up for a pod that does not need it.
pub fn decide_without_namespace(selectors: &Selectors, pod: &PodFacts<'_>, excluded: &[String]) -> Option<bool> {
    if never_enrolled(pod, excluded) {
        return Some(false);
    }
    selectors.decide_without_namespace(pod.labels)
}

/// Why a pod is never enrolled whatever its labels say (see [`never_enrolled`]); `node-agent explain` reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exclusion {
    /// `spec.hostNetwork`: the pod has no netns of its own.
    HostNetwork,
    /// The `sidecar.istio.io/status` annotation: its sidecar already captures its traffic.
    Sidecar,
    /// Its namespace is one of the excluded namespaces (`EXCLUDE_NAMESPACES`).
    ExcludedNamespace,
}

/// Which rule of [`never_enrolled`] keeps `pod` out, if any, checked in that order.
pub fn exclusion(pod: &PodFacts<'_>, excluded_namespaces: &[String]) -> Option<Exclusion> {
    if pod.host_network {
        Some(Exclusion::HostNetwork)
    } else if pod.annotations.contains_key(SIDECAR_STATUS_ANNOTATION) {
        Some(Exclusion::Sidecar)
    } else if excluded_namespaces.iter().any(|n| n == pod.namespace) {
        Some(Exclusion::ExcludedNamespace)
    } else {
        None
    }
}

/// Pods that are never enrolled whatever their labels say: host-network pods (they have no netns of their own),
/// sidecar pods (their sidecar already captures traffic) and pods in excluded namespaces.
pub fn never_enrolled(pod: &PodFacts<'_>, excluded_namespaces: &[String]) -> bool {
    exclusion(pod, excluded_namespaces).is_some()
}

/// The whole rule: [`never_enrolled`] pods stay out; everything else follows the selectors.
pub fn should_enroll(
    selectors: &Selectors,
    pod: &PodFacts<'_>,
    namespace_labels: &Labels,
    excluded: &[String],
) -> bool {
    !never_enrolled(pod, excluded) && selectors.matches(pod.labels, namespace_labels)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> Labels {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn istio_defaults() {
        let s = Selectors::default();
        let ambient = labels(&[(DATAPLANE_MODE_LABEL, "ambient")]);
        let none = labels(&[(DATAPLANE_MODE_LABEL, "none")]);
        let empty = Labels::new();
        assert!(s.matches(&ambient, &empty), "pod label alone");
        assert!(s.matches(&empty, &ambient), "namespace label alone");
        assert!(!s.matches(&none, &ambient), "pod opts out with none");
        assert!(!s.matches(&empty, &empty));
    }

    /// Istio writes `{}` for a selector not given (Go marshals its struct); it means the same as a missing one.
    #[test]
    fn an_empty_selector_is_a_missing_one() {
        let istio = serde_json::json!([{ "podSelector": { "matchLabels": { "a": "b" } }, "namespaceSelector": {} }]);
        let s = Selectors::from_json(Some(&istio)).unwrap();
        assert_eq!(s.0[0].namespace_selector, None);
        assert_eq!(s.decide_without_namespace(&labels(&[("a", "b")])), Some(true));
        let s = Selectors::parse("- podSelector: {}\n  namespaceSelector: {matchLabels: {}}\n").unwrap();
        assert_eq!(s.0[0], EnablementSelector::default());
    }

    #[test]
    fn never_enrolled_whatever_the_labels() {
        let s = Selectors::default();
        let ambient = labels(&[(DATAPLANE_MODE_LABEL, "ambient")]);
        let sidecar = labels(&[(SIDECAR_STATUS_ANNOTATION, "{}")]);
        let empty = Labels::new();
        let pod =
            |host_network, annotations| PodFacts { namespace: "shop", labels: &ambient, annotations, host_network };
        assert!(should_enroll(&s, &pod(false, &empty), &empty, &[]));
        assert!(!should_enroll(&s, &pod(true, &empty), &empty, &[]));
        assert!(!should_enroll(&s, &pod(false, &sidecar), &empty, &[]));
        assert!(!should_enroll(&s, &pod(false, &empty), &empty, &["shop".into()]));
    }

    #[test]
    fn the_reason_is_the_first_rule_that_decides() {
        let s = Selectors::default();
        let ambient = labels(&[(DATAPLANE_MODE_LABEL, "ambient")]);
        let sidecar = labels(&[(SIDECAR_STATUS_ANNOTATION, "{}")]);
        let empty = Labels::new();
        let pod = |host_network, annotations| PodFacts { namespace: "shop", labels: &empty, annotations, host_network };
        assert_eq!(exclusion(&pod(true, &sidecar), &["shop".into()]), Some(Exclusion::HostNetwork));
        assert_eq!(exclusion(&pod(false, &sidecar), &["shop".into()]), Some(Exclusion::Sidecar));
        assert_eq!(exclusion(&pod(false, &empty), &["shop".into()]), Some(Exclusion::ExcludedNamespace));
        assert_eq!(exclusion(&pod(false, &empty), &[]), None);
        assert_eq!(s.matching(&ambient, &empty).map(|(i, _)| i), Some(0), "the pod label entry");
        assert_eq!(s.matching(&empty, &ambient).map(|(i, _)| i), Some(1), "the namespace label entry");
        assert!(s.matching(&empty, &empty).is_none());
    }

    #[test]
    fn custom_selectors_with_every_operator() {
        let s = Selectors::parse(
            r#"[{"podSelector": {"matchExpressions": [
                 {"key": "team", "operator": "In", "values": ["a", "b"]},
                 {"key": "legacy", "operator": "DoesNotExist"}]},
                "namespaceSelector": {"matchExpressions": [{"key": "mesh", "operator": "Exists"}]}}]"#,
        )
        .unwrap();
        let ns = labels(&[("mesh", "")]);
        assert!(s.matches(&labels(&[("team", "a")]), &ns));
        assert!(!s.matches(&labels(&[("team", "c")]), &ns));
        assert!(!s.matches(&labels(&[("team", "a"), ("legacy", "1")]), &ns));
        assert!(!s.matches(&labels(&[("team", "a")]), &Labels::new()));
        assert!(matches!(
            Selectors::parse(r#"[{"podSelector": {"matchExpressions": [{"key": "a", "operator": "Maybe"}]}}]"#),
            Err(SelectorError::Operator(_))
        ));
        assert!(Selectors::parse("not: [a list").is_err());
    }

    #[test]
    fn the_namespace_is_only_needed_when_it_can_change_the_answer() {
        let s = Selectors::default();
        assert_eq!(s.decide_without_namespace(&labels(&[(DATAPLANE_MODE_LABEL, "ambient")])), Some(true));
        assert_eq!(s.decide_without_namespace(&labels(&[(DATAPLANE_MODE_LABEL, "none")])), Some(false));
        assert_eq!(s.decide_without_namespace(&Labels::new()), None);
        let pods_only = Selectors::parse(r#"[{"podSelector": {"matchLabels": {"a": "b"}}}]"#).unwrap();
        assert_eq!(pods_only.decide_without_namespace(&Labels::new()), Some(false));
    }

    #[test]
    fn the_defaults_render_as_istio_spells_them_and_read_back() {
        let json = Selectors::default().to_json();
        assert_eq!(
            json,
            serde_json::json!([
                {"podSelector": {"matchLabels": {"istio.io/dataplane-mode": "ambient"}}},
                {"podSelector": {"matchExpressions": [
                    {"key": "istio.io/dataplane-mode", "operator": "NotIn", "values": ["none"]}]},
                 "namespaceSelector": {"matchLabels": {"istio.io/dataplane-mode": "ambient"}}}
            ])
        );
        assert_eq!(Selectors::parse(&Selectors::default().to_yaml()).unwrap(), Selectors::default());
        assert_eq!(Selectors::from_json(Some(&json)).unwrap(), Selectors::default());
    }

    #[test]
    fn the_setting_parses_as_yaml_or_json_the_same() {
        let yaml = Selectors::default().to_yaml();
        let json = Selectors::default().to_json().to_string();
        assert_eq!(Selectors::parse(&yaml).unwrap(), Selectors::parse(&json).unwrap());
        assert!(matches!(Selectors::parse("[{podSelector: ]"), Err(SelectorError::Parse(_))));
    }

    #[test]
    fn netconf_json_defaults_when_absent() {
        assert_eq!(Selectors::from_json(None).unwrap(), Selectors::default());
        let v = serde_json::json!([{"podSelector": {"matchLabels": {"x": "y"}}}]);
        assert!(Selectors::from_json(Some(&v)).unwrap().matches(&labels(&[("x", "y")]), &Labels::new()));
    }
}

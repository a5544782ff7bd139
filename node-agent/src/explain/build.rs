//! Builds the explain report of one pod from what the agent holds: the pod and namespace watches, its settings,
//! the enrolled pods' cache and their timelines, and what it reads on demand (the pod's sockets, the host probe
//! set, the in-pod rules), each read on a blocking thread and bounded by [`READ_TIMEOUT`].

use std::collections::BTreeMap;
use std::future::Future;
use std::os::fd::AsFd as _;
use std::sync::Arc;
use std::time::Duration;

use istio_contract::enablement::{exclusion, EnablementSelector, Exclusion, Labels, PodFacts, Selectors};
use istio_contract::names::{DATAPLANE_MODE_LABEL, SIDECAR_STATUS_ANNOTATION};
use istio_contract::pod::PodInfo;
use istio_contract::sidecar::{self, Decision, Skip};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::runtime::reflector::{ObjectRef, Store};
use redirect::backend::Backend;
use redirect::inspect::RuleReport;

use super::listeners;
use super::report::{DriftCheck, HostProbe, Mode, Netns, ProbeSelfTest, ProxyState, Report, Rules, Sidecar, Summary};
use crate::ambient_state::AmbientState;
use crate::config::Config;
use crate::drift::{self, Drift, LastCheck};
use crate::pod::{ips as pod_ips, is_terminating, key, terminal_phase, PodUid};

/// The verdict of an enrolled ambient pod.
const IN_MESH_AMBIENT: &str = "in mesh (ambient)";

/// The longest one on-demand read (sockets, probe set, rules, a `/proc` scan) may take.
pub const READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Answers explain's questions; shared by the admin server's requests.
pub struct Explainer {
    node: String,
    ambient_enabled: bool,
    excluded: Vec<String>,
    selectors: Selectors,
    /// What the `/proc` discovery of sidecar pods' netns (`HOST_PROC`) and the choice of their rules' backend
    /// (`NATIVE_NFTABLES`, `FORCE_IPTABLES_BINARY`) need.
    config: Config,
    pods: Store<Pod>,
    namespaces: Option<Store<Namespace>>,
    ambient: Option<Arc<AmbientState>>,
    /// The drift checker, whose latest check of each pod the report shows (ambient only).
    drift: Option<Drift>,
    /// The backend sidecar pods' rules are read with: the agent's, else chosen on first use as the agent would.
    sidecar_backend: tokio::sync::OnceCell<Backend>,
}

/// What decided a pod's mode, before anything is read from the node.
struct Decided {
    mode: Mode,
    reason: String,
    /// Why the pod is not in the mesh, when that is already known.
    out: Option<String>,
    sidecar: Option<Sidecar>,
}

/// `key=value, ...` of a label map.
fn labels_text(labels: &Labels) -> String {
    if labels.is_empty() {
        return "none".into();
    }
    labels.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(", ")
}

/// A label selector in kubectl's words: `a=b, c NotIn (d)`.
fn selector_text(selector: &LabelSelector) -> String {
    let labels = selector.match_labels.iter().flatten().map(|(k, v)| format!("{k}={v}"));
    let exprs = selector.match_expressions.iter().flatten().map(|r| match r.values.as_deref() {
        Some(values) if !values.is_empty() => format!("{} {} ({})", r.key, r.operator, values.join(", ")),
        _ => format!("{} {}", r.key, r.operator),
    });
    let all: Vec<String> = labels.chain(exprs).collect();
    if all.is_empty() {
        "everything".into()
    } else {
        all.join(", ")
    }
}

fn enablement_text(entry: &EnablementSelector) -> String {
    let mut parts = Vec::new();
    if let Some(s) = &entry.pod_selector {
        parts.push(format!("pod [{}]", selector_text(s)));
    }
    if let Some(s) = &entry.namespace_selector {
        parts.push(format!("namespace [{}]", selector_text(s)));
    }
    if parts.is_empty() {
        "every pod".into()
    } else {
        parts.join(" and ")
    }
}

fn skip_text(skip: &Skip) -> String {
    match skip {
        Skip::HasInitContainer => "istio-init programs the rules itself".into(),
        Skip::NoProxy => "no istio-proxy container".into(),
        Skip::EnvoyDisabled => "DISABLE_ENVOY=true on istio-proxy".into(),
        Skip::NotSidecar(kind) => format!("istio-proxy runs as {kind}, not as a sidecar"),
        Skip::InjectionDisabled => "sidecar.istio.io/inject=false".into(),
        Skip::NotInjected => format!("no {SIDECAR_STATUS_ANNOTATION} annotation"),
        Skip::InterceptionNone => "sidecar.istio.io/interceptionMode=NONE".into(),
    }
}

/// Runs blocking `read` on a blocking thread, bounded by [`READ_TIMEOUT`].
async fn blocking<T: Send + 'static>(
    what: &str,
    read: impl FnOnce() -> Result<T, String> + Send + 'static,
) -> Result<T, String> {
    bounded(what, async move { tokio::task::spawn_blocking(read).await.map_err(|e| e.to_string())? }).await
}

async fn bounded<T>(what: &str, read: impl Future<Output = Result<T, String>>) -> Result<T, String> {
    match tokio::time::timeout(READ_TIMEOUT, read).await {
        Ok(result) => result,
        Err(_) => Err(format!("{what}: no answer within {READ_TIMEOUT:?}")),
    }
}

impl Explainer {
    /// An explainer over the agent's watches (`namespaces` when ambient is on), its rule backend when it chose
    /// one, and, when ambient is on, what it holds of its ambient pods.
    pub fn new(
        config: &Config,
        selectors: Selectors,
        pods: Store<Pod>,
        namespaces: Option<Store<Namespace>>,
        ambient: Option<Arc<AmbientState>>,
        backend: Option<Backend>,
    ) -> Self {
        Self {
            sidecar_backend: tokio::sync::OnceCell::new_with(backend),
            drift: None,
            node: config.node_name.clone(),
            ambient_enabled: config.ambient_enabled && ambient.is_some(),
            excluded: config.excluded(),
            selectors,
            config: config.clone(),
            pods,
            namespaces,
            ambient,
        }
    }

    /// Asks the drift checker for a round now (`POST /debug/drift-check`); `false` when drift is not checked here.
    pub fn check_drift_now(&self) -> bool {
        self.drift.as_ref().inspect(|d| d.check_now()).is_some()
    }

    /// Shows `drift`'s latest check of each pod in its report.
    pub fn with_drift(mut self, drift: Drift) -> Self {
        self.drift = Some(drift);
        self
    }

    /// This node's name.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// One line per pod on this node, sorted by `namespace/name`: no reads from the node, only what the agent
    /// holds.
    pub fn all(&self) -> Vec<Summary> {
        let mut all: Vec<Summary> = self
            .pods
            .state()
            .iter()
            .map(|pod| {
                let decided = self.decide(pod);
                let verdict = self.verdict(pod, &decided);
                Summary { pod: key(pod), mode: decided.mode, verdict }
            })
            .collect();
        all.sort_by(|a, b| a.pod.cmp(&b.pod));
        all
    }

    /// The whole report of pod `namespace/name`; `None` when no such pod is on this node.
    pub async fn pod(&self, namespace: &str, name: &str) -> Option<Report> {
        let pod = self.pods.get(&ObjectRef::new(name).within(namespace))?;
        let decided = self.decide(&pod);
        let uid = String::from(PodUid::of(&pod));
        let mut report = Report {
            pod: key(&pod),
            uid: uid.clone(),
            verdict: self.verdict(&pod, &decided),
            mode: decided.mode,
            reason: decided.reason.clone(),
            netns: Netns { inode: None, source: "not looked up".into() },
            ips: pod_ips(&pod),
            rules: Rules::not_inspected("not inspected"),
            zds: None,
            listeners: None,
            host_probe: None,
            last_error: None,
            timeline: None,
            sidecar: decided.sidecar.clone(),
            drift: self.drift.as_ref().and_then(|d| d.last_check(&uid)).map(drift_check),
            probe_selftest: None,
        };
        match decided.mode {
            Mode::Ambient => self.ambient(&pod, &mut report).await,
            Mode::Sidecar => self.sidecar(&pod, &mut report).await,
            Mode::None => {
                report.rules = Rules::not_inspected("not in ambient: the agent programs no rules for it");
            }
        }
        Some(report)
    }

    /// The mode and what decided it, in the agent's order: finished pods, the exclusions, then the selectors.
    fn decide(&self, pod: &Pod) -> Decided {
        let none = |reason: String| Decided { mode: Mode::None, out: Some(reason.clone()), reason, sidecar: None };
        if let Some(phase) = terminal_phase(pod) {
            return none(format!("the pod has finished (phase {phase})"));
        }
        let empty = BTreeMap::new();
        let facts = PodFacts::of(pod, &empty);
        match exclusion(&facts, &self.excluded) {
            Some(Exclusion::HostNetwork) => {
                return none("spec.hostNetwork: the pod has no network namespace of its own".into());
            }
            Some(Exclusion::Sidecar) => return self.decide_sidecar(pod),
            Some(Exclusion::ExcludedNamespace) => {
                return none(format!("namespace {} is in EXCLUDE_NAMESPACES", facts.namespace));
            }
            None => {}
        }
        if !self.ambient_enabled {
            return none("ambient is disabled on this node agent (AMBIENT_ENABLED=false)".into());
        }
        let known = self.namespaces.as_ref().and_then(|s| s.get(&ObjectRef::new(facts.namespace)));
        let ns_labels = known.as_ref().and_then(|n| n.metadata.labels.clone()).unwrap_or_default();
        if let Some((i, entry)) = self.selectors.matching(facts.labels, &ns_labels) {
            let reason = format!("AMBIENT_ENABLEMENT_SELECTOR entry #{} matches: {}", i + 1, enablement_text(entry));
            return Decided { mode: Mode::Ambient, reason, out: None, sidecar: None };
        }
        if facts.labels.get(DATAPLANE_MODE_LABEL).map(String::as_str) == Some("none") {
            return none(format!("pod label {DATAPLANE_MODE_LABEL}=none opts it out"));
        }
        let unknown = if known.is_none() { " (namespace not seen by the agent's watch)" } else { "" };
        none(format!(
            "no AMBIENT_ENABLEMENT_SELECTOR entry matches: pod labels [{}], namespace {} labels [{}]{unknown}",
            labels_text(facts.labels),
            facts.namespace,
            labels_text(&ns_labels),
        ))
    }

    /// A pod with a sidecar: the plugin's decision, the same function the plugin calls.
    fn decide_sidecar(&self, pod: &Pod) -> Decided {
        let injected = format!("annotation {SIDECAR_STATUS_ANNOTATION}: an injected sidecar");
        let (redirected, decision, out) = match sidecar::decide(&PodInfo::from(pod)) {
            Decision::Redirect => (true, "redirected: the plugin programs the sidecar's redirect rules".into(), None),
            Decision::Skip(Skip::HasInitContainer) => {
                (true, format!("not by the plugin: {}", skip_text(&Skip::HasInitContainer)), None)
            }
            Decision::Skip(skip) => (false, format!("passed through: {}", skip_text(&skip)), Some(skip_text(&skip))),
        };
        let sidecar = Sidecar { redirected, decision, rule_count: None, error: None };
        Decided { mode: Mode::Sidecar, reason: injected, out, sidecar: Some(sidecar) }
    }

    /// The one-line verdict, from what the agent holds.
    fn verdict(&self, pod: &Pod, decided: &Decided) -> String {
        if let Some(out) = &decided.out {
            return format!("not in mesh: {out}");
        }
        match decided.mode {
            Mode::Sidecar => "in mesh (sidecar)".into(),
            Mode::None => "not in mesh".into(),
            Mode::Ambient => {
                let Some(ambient) = &self.ambient else { return "not in mesh: ambient is disabled".into() };
                let uid = PodUid::of(pod);
                let timeline = ambient.timelines().get(&uid);
                if let Some(t) = timeline.as_ref().filter(|t| t.failed) {
                    let error = t.last_error.as_ref().map(|e| e.message.clone()).unwrap_or_else(|| t.outcome.clone());
                    return format!("enrollment failed: {error}");
                }
                if ambient.cache().get(&uid).is_some() {
                    return IN_MESH_AMBIENT.into();
                }
                if timeline.is_some() {
                    "not in mesh: enrollment in progress".into()
                } else if is_terminating(pod) {
                    "not in mesh: terminating, and never newly enrolled".into()
                } else if pod_ips(pod).is_empty() {
                    "not in mesh: not enrolled yet (waiting for the plugin's ADD)".into()
                } else {
                    "not in mesh: not enrolled yet (its netns is still to be searched for through /proc)".into()
                }
            }
        }
    }

    /// An ambient pod: what the agent holds of it and what its netns and the host probe set say.
    async fn ambient(&self, pod: &Pod, report: &mut Report) {
        let Some(ambient) = &self.ambient else { return };
        let uid = PodUid::of(pod);
        report.timeline = ambient.timelines().get(&uid);
        report.last_error = report.timeline.as_ref().and_then(|t| t.last_error.clone());
        if report.ips.is_empty() {
            report.ips = report.timeline.as_ref().map(|t| t.ips.clone()).unwrap_or_default();
        }
        let enrolled = ambient.cache().get(&uid);
        report.zds = Some(match (&report.timeline, &enrolled) {
            (Some(t), _) => t.proxy.clone(),
            (None, Some(_)) => ProxyState::Snapshot,
            (None, None) => ProxyState::NotSent,
        });
        let Some(enrolled) = enrolled else {
            report.netns = Netns { inode: None, source: "not held: the pod is not enrolled".into() };
            report.rules = Rules::not_inspected("not enrolled");
            return;
        };
        if !enrolled.ips.is_empty() {
            report.ips = enrolled.ips.clone();
        }
        let netns = enrolled.netns.as_ref().and_then(|fd| fd.try_clone().ok());
        match &netns {
            Some(fd) => {
                let inode = nix::sys::stat::fstat(fd.as_fd()).ok().map(|s| s.st_ino);
                report.netns = Netns { inode, source: "held since enrollment".into() };
            }
            None => {
                report.netns = Netns { inode: None, source: "unknown: not found through /proc after a restart".into() };
            }
        }
        let listeners_read = async {
            let fd = netns?;
            let read = blocking("pod sockets", move || {
                let ns = netns::Netns::from_fd(fd, "enrolled pod netns").map_err(|e| e.to_string())?;
                Ok(listeners::read_in(&ns))
            });
            Some(read.await.unwrap_or_else(|e| super::report::Listeners { error: Some(e), ..Default::default() }))
        };
        // The drift check's own inspection: the in-pod rules against the plan, and the host probe entries.
        let rules_read =
            bounded("in-pod rules", async { drift::inspect_pod(ambient, pod).await.map_err(|e| e.to_string()) });
        let (listeners, inspected) = tokio::join!(listeners_read, rules_read);
        report.listeners = listeners;
        let rules = match inspected {
            Ok(inspected) => {
                report.host_probe = Some(HostProbe { in_set: inspected.in_host_probe_set, error: None });
                rules(inspected.rules)
            }
            Err(e) => {
                report.host_probe = Some(HostProbe { in_set: false, error: Some(e.clone()) });
                Rules::not_inspected(e)
            }
        };
        if report.verdict == IN_MESH_AMBIENT && (!rules.missing.is_empty() || !rules.unexpected.is_empty()) {
            report.verdict = format!(
                "{IN_MESH_AMBIENT}, but its rules drifted: {} missing, {} unexpected",
                rules.missing.len(),
                rules.unexpected.len()
            );
        }
        report.rules = rules;
        if let Some(selftest) = crate::probe_selftest::last_result() {
            if report.verdict == IN_MESH_AMBIENT && !selftest.ok() {
                report.verdict = format!("{IN_MESH_AMBIENT}, but the node's host probe self-test fails");
            }
            report.probe_selftest = Some(ProbeSelfTest {
                verdict: selftest.verdict.label().to_owned(),
                pod: selftest.pod,
                detail: selftest.detail,
                at: crate::timeline::rfc3339(selftest.at),
            });
        }
    }

    /// A sidecar pod: its netns through `/proc`, and the rules of ours it holds.
    async fn sidecar(&self, pod: &Pod, report: &mut Report) {
        report.rules = Rules::not_inspected("sidecar pod: see sidecar.rule_count");
        let ns = match bounded("netns scan", async {
            drift::find_netns(&self.config, pod).await.map_err(|e| e.to_string())
        })
        .await
        {
            Ok(ns) => ns,
            Err(e) => {
                report.netns = Netns { inode: None, source: format!("not found: {e}") };
                return;
            }
        };
        report.netns = Netns { inode: Some(ns.id().1), source: "found through /proc".into() };
        let counted = self.count_sidecar_rules(pod, ns).await;
        if let Some(sidecar) = report.sidecar.as_mut() {
            match counted {
                Ok(rules) => {
                    sidecar.rule_count = Some(rules.found.len());
                    if sidecar.redirected {
                        report.rules = rules;
                    }
                }
                Err(e) => sidecar.error = Some(e),
            }
        }
    }

    /// The rules of ours in a sidecar pod's netns, compared with what the plugin programs for it (the drift
    /// check's inspection).
    async fn count_sidecar_rules(&self, pod: &Pod, ns: netns::Netns) -> Result<Rules, String> {
        let (native, force) = (self.config.native_nftables, self.config.force_iptables_binary.clone());
        let backend = *self
            .sidecar_backend
            .get_or_try_init(|| {
                blocking("rule backend", move || Backend::select(native, force.as_deref()).map_err(|e| e.to_string()))
            })
            .await?;
        let inspected = bounded("sidecar rules", async {
            drift::inspect_sidecar(backend, ns, pod).await.map_err(|e| e.to_string())
        });
        inspected.await.map(rules)
    }
}

/// The drift checker's latest check, as explain shows it.
fn drift_check(last: LastCheck) -> DriftCheck {
    DriftCheck {
        checked_at: last.checked_at,
        drifted: last.drifted,
        missing: last.missing,
        unexpected: last.unexpected,
        last_repair: last.last_repair,
        repairs: last.repairs,
        error: last.error,
    }
}

/// The rule inspection's report, as explain shows it.
fn rules(report: RuleReport) -> Rules {
    Rules {
        backend: Some(report.backend),
        expected: report.expected,
        found: report.found,
        missing: report.missing,
        unexpected: report.unexpected,
        error: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::runtime::reflector;
    use serde_json::json;

    fn pod(name: &str, labels: serde_json::Value, annotations: serde_json::Value, host_network: bool) -> Pod {
        serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": { "name": name, "namespace": "shop", "uid": name, "labels": labels, "annotations": annotations },
            "spec": {
                "nodeName": "node-1", "hostNetwork": host_network,
                "containers": [{ "name": "app" }, { "name": "istio-proxy", "args": ["proxy", "sidecar"] }],
            },
        }))
        .unwrap()
    }

    /// An explainer deciding with Istio's default selectors and `excluded` namespaces; `shop` is labelled
    /// `namespace_labels`.
    fn explainer(excluded: &[&str], namespace_labels: serde_json::Value) -> Explainer {
        let (pods, _) = reflector::store();
        let (namespaces, mut writer) = reflector::store::<Namespace>();
        let ns = json!({ "apiVersion": "v1", "kind": "Namespace", "metadata": { "name": "shop", "labels": namespace_labels } });
        writer.apply_watcher_event(&kube::runtime::watcher::Event::Apply(serde_json::from_value(ns).unwrap()));
        Explainer {
            node: "node-1".into(),
            ambient_enabled: true,
            excluded: excluded.iter().map(|s| s.to_string()).collect(),
            selectors: Selectors::default(),
            config: <Config as clap::Parser>::parse_from(["node-agent"]),
            pods,
            namespaces: Some(namespaces),
            ambient: None,
            drift: None,
            sidecar_backend: tokio::sync::OnceCell::new(),
        }
    }

    #[test]
    fn the_mode_and_its_reason_follow_the_agents_rules_in_order() {
        let e = explainer(&[], json!({ DATAPLANE_MODE_LABEL: "ambient" }));
        let decided = e.decide(&pod("a", json!({}), json!({}), false));
        assert_eq!(decided.mode, Mode::Ambient);
        assert!(
            decided.reason.contains("entry #2")
                && decided.reason.contains("namespace [istio.io/dataplane-mode=ambient]")
        );

        let none = e.decide(&pod("b", json!({ DATAPLANE_MODE_LABEL: "none" }), json!({}), false));
        assert_eq!(
            (none.mode, none.out.as_deref()),
            (Mode::None, Some("pod label istio.io/dataplane-mode=none opts it out"))
        );

        let host = e.decide(&pod("c", json!({ DATAPLANE_MODE_LABEL: "ambient" }), json!({}), true));
        assert!(host.out.unwrap().contains("hostNetwork"));

        let sidecar = e.decide(&pod("d", json!({}), json!({ SIDECAR_STATUS_ANNOTATION: "{}" }), false));
        assert_eq!(sidecar.mode, Mode::Sidecar);
        assert!(sidecar.sidecar.unwrap().redirected, "an injected pod is redirected by the plugin");
        let off = json!({ SIDECAR_STATUS_ANNOTATION: "{}", "sidecar.istio.io/interceptionMode": "NONE" });
        let not_redirected = e.decide(&pod("e", json!({}), off, false));
        assert_eq!(
            e.verdict(&pod("e", json!({}), json!({}), false), &not_redirected),
            "not in mesh: sidecar.istio.io/interceptionMode=NONE"
        );

        let excluded = explainer(&["shop"], json!({ DATAPLANE_MODE_LABEL: "ambient" }));
        let out = excluded.decide(&pod("f", json!({ DATAPLANE_MODE_LABEL: "ambient" }), json!({}), false));
        assert_eq!(out.out.as_deref(), Some("namespace shop is in EXCLUDE_NAMESPACES"));

        let plain = explainer(&[], json!({})).decide(&pod("g", json!({ "app": "web" }), json!({}), false));
        assert!(plain.out.unwrap().contains("pod labels [app=web], namespace shop labels [none]"));
    }
}

//! The node agent's Prometheus metrics, registered once.

use prometheus_client::encoding::{EncodeLabelSet, LabelSetEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// Label of the plugin request counter.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResponseCode {
    /// HTTP status the agent answered the plugin with.
    pub response_code: String,
}

/// Label of the reconcile counter.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EventType {
    /// `add`, `update`, `delete`.
    pub r#type: String,
}

/// Label of the enrollment latency histogram.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Phase {
    /// `netns`, `rules`, `proxy_ack`, `probe`, `annotate`: [`crate::timeline::Step::name`].
    pub phase: String,
}

/// Labels of the repair counter, Istio's.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RepairType {
    /// `repair`, `label` or `delete`.
    pub r#type: String,
    /// `success`, `skip` (nothing to do: already labelled, gone, or a pod the plugin would not redirect) or
    /// `fail`.
    pub result: String,
}

/// Where the pod at a plugin request came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LookupSource {
    /// The agent's watch-fed store: no API request.
    Agent,
    /// Not in the store in time: the API (the agent's GET, or the plugin's own after a 404).
    Api,
}

/// Label of the pod lookup counter.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Source {
    /// `agent` or `api`.
    pub source: &'static str,
}

/// The empty label set, for a metric that must stay absent until it has something to say: a [`Family`] keyed by
/// it exposes its one series, without braces, only once created.
#[derive(Debug, Clone, Hash, PartialEq, Eq)]
pub struct Unlabelled;

impl EncodeLabelSet for Unlabelled {
    fn encode(&self, _encoder: &mut LabelSetEncoder) -> Result<(), std::fmt::Error> {
        Ok(())
    }
}

/// Label of the host probe self-test counter.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SelfTestRun {
    /// `ok`, `fail` or `no_pod`.
    pub result: &'static str,
}

/// Label of the drift counters: what drifted.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DriftKind {
    /// `inpod_rules` (an ambient pod's rules), `host_probe` (the host's SNAT rule or a pod's probe set entry) or
    /// `sidecar_rules` (a sidecar pod's rules).
    pub kind: &'static str,
}

/// Everything operators watch on the agent.
#[derive(Debug, Clone)]
pub struct Metrics {
    /// Plugin requests by response code.
    pub plugin_requests: Family<ResponseCode, Counter>,
    /// Pod lookups for plugin requests, by where the pod came from.
    pub pod_lookups: Family<Source, Counter>,
    /// Watch events handled, by type.
    pub reconcile_events: Family<EventType, Counter>,
    /// Proxy connections on the ZDS socket.
    pub ztunnel_connected: Gauge,
    /// Pods currently enrolled.
    pub enrolled_pods: Gauge,
    /// Enrollment latency by phase.
    pub enrollment_seconds: Family<Phase, Histogram>,
    /// Time from a plugin request's arrival to its answer: the pod lookup, the checks and the whole enrollment.
    pub plugin_request_seconds: Histogram,
    /// Broken pods the repair controller acted on, by action and result.
    pub pods_repaired: Family<RepairType, Counter>,
    /// Scans of `/proc` for running pods' netns; one per namespace label change, however many pods it enrolls.
    pub proc_scans: Counter,
    /// Whether the latest host probe self-test passed (1) or failed (0); absent while no pod was tested.
    pub probe_selftest_ok: Family<Unlabelled, Gauge>,
    /// Host probe self-tests, by result.
    pub probe_selftest_runs: Family<SelfTestRun, Counter>,
    /// Drift found by the drift check (rules or entries missing or changed), by kind.
    pub drift_detected: Family<DriftKind, Counter>,
    /// Drift the drift check repaired, by kind.
    pub drift_repaired: Family<DriftKind, Counter>,
}

impl Metrics {
    /// Registers every metric under Istio's names where Istio has them.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self {
            plugin_requests: Family::default(),
            pod_lookups: Family::default(),
            reconcile_events: Family::default(),
            ztunnel_connected: Gauge::default(),
            enrolled_pods: Gauge::default(),
            enrollment_seconds: Family::new_with_constructor(|| Histogram::new(exponential_buckets(0.0005, 2.0, 14))),
            plugin_request_seconds: Histogram::new(exponential_buckets(0.0005, 2.0, 14)),
            pods_repaired: Family::default(),
            proc_scans: Counter::default(),
            probe_selftest_ok: Family::default(),
            probe_selftest_runs: Family::default(),
            drift_detected: Family::default(),
            drift_repaired: Family::default(),
        };
        registry.register(
            "istio_cni_plugin_requests",
            "CNI plugin requests by response code",
            m.plugin_requests.clone(),
        );
        registry.register(
            "istio_cni_plugin_pod_lookups",
            "Pods looked up for plugin requests, by source: agent (its watch, no API request) or api",
            m.pod_lookups.clone(),
        );
        registry.register("nodeagent_reconcile_events", "Pod and namespace events handled", m.reconcile_events.clone());
        registry.register("ztunnel_connected", "Node proxy connections on the ZDS socket", m.ztunnel_connected.clone());
        registry.register("nodeagent_enrolled_pods", "Pods enrolled in ambient on this node", m.enrolled_pods.clone());
        registry.register(
            "nodeagent_enrollment_duration_seconds",
            "Time spent per enrollment phase (netns, rules, proxy_ack, probe, annotate)",
            m.enrollment_seconds.clone(),
        );
        registry.register(
            "nodeagent_plugin_request_duration_seconds",
            "Time from a CNI plugin request's arrival to the agent's answer (pod lookup, checks, enrollment)",
            m.plugin_request_seconds.clone(),
        );
        registry.register(
            "nodeagent_proc_scans",
            "Scans of /proc for the netns of running pods (one per namespace label change or startup)",
            m.proc_scans.clone(),
        );
        registry.register(
            "nodeagent_probe_selftest_ok",
            "1 if the latest host probe self-test saw an enrolled pod reached from the probe SNAT address, 0 if not; absent while no pod was tested",
            m.probe_selftest_ok.clone(),
        );
        registry.register(
            "nodeagent_probe_selftest_runs",
            "Host probe self-tests by result (ok, fail, no_pod)",
            m.probe_selftest_runs.clone(),
        );
        // Counters get `_total`: nodeagent_drift_detected_total and nodeagent_drift_repaired_total.
        registry.register(
            "nodeagent_drift_detected",
            "Drift found by the drift check, by kind (inpod_rules, host_probe, sidecar_rules)",
            m.drift_detected.clone(),
        );
        registry.register(
            "nodeagent_drift_repaired",
            "Drift the drift check repaired, by kind (inpod_rules, host_probe, sidecar_rules)",
            m.drift_repaired.clone(),
        );
        // The registry adds no prefix and the counter adds `_total`: exposed as istio_cni_repair_pods_repaired_total.
        registry.register(
            "istio_cni_repair_pods_repaired",
            "Broken pods handled by the repair controller, by type (repair, label, delete) and result (success, skip, fail)",
            m.pods_repaired.clone(),
        );
        m
    }

    /// Counts one pod lookup for a plugin request.
    pub fn pod_lookups(&self, source: LookupSource) {
        let source = match source {
            LookupSource::Agent => "agent",
            LookupSource::Api => "api",
        };
        self.pod_lookups.get_or_create(&Source { source }).inc();
    }

    /// Observes one enrollment step's duration; [`crate::timeline::Recorder`] is the only caller, so that the
    /// histogram and the step's timeline phase time the same span.
    pub fn phase_took(&self, phase: &str, took: std::time::Duration) {
        self.enrollment_seconds.get_or_create(&Phase { phase: phase.into() }).observe(took.as_secs_f64());
    }
}

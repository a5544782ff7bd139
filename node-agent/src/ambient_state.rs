//! What the agent holds of its ambient pods, apart from the procedure that enrolls them: the enrolled pods' cache,
//! the per-pod gate, the host probe set, the in-pod rules' backend and settings, and each pod's enrollment record
//! with the step latency histogram. Enrollment ([`crate::enroll`]) writes it; the drift check and `explain` read it
//! here, without going through enrollment.
//!
//! Guarantees: one state per agent, shared (an [`Arc`]), so every reader sees the cache, gate and records that
//! enrollment writes; the pass [`AmbientState::enrolled_pass`] hands out is the one enrollment and removal hold, so
//! a check under it never runs during either, and never touches a removed pod; the rules a reader expects of a
//! pod ([`AmbientState::inpod_config`]) are built as enrollment builds them.

use std::collections::BTreeMap;
use std::sync::Arc;

use istio_contract::names::{AMBIENT_BYPASS_INBOUND_CAPTURE, AMBIENT_DNS_CAPTURE, REROUTE_VIRTUAL_INTERFACES};
use k8s_openapi::api::core::v1::Pod;
use redirect::ambient::InpodConfig;
use redirect::backend::Backend;
use redirect::hostprobe::HostProbe;

use crate::cache::{Enrolled, PodCache};
use crate::config::Config;
use crate::metrics::Metrics;
use crate::pod::PodUid;
use crate::pod_gate::{Pass, PodGate};
use crate::timeline::{Recorder, Timelines};

/// The agent's ambient pods: see the module doc.
#[derive(Debug)]
pub struct AmbientState {
    cache: PodCache,
    gate: PodGate,
    hostprobe: Arc<HostProbe>,
    backend: Backend,
    /// The agent's in-pod rule settings, before a pod's annotations override them.
    defaults: InpodConfig,
    recorder: Recorder,
}

impl AmbientState {
    /// The state of an agent with `config`'s settings, whose enrolled pods are in `cache` (the proxy's snapshots
    /// read it too), whose rules are programmed with `backend`, and whose host probe set is `hostprobe`.
    pub fn new(config: &Config, backend: Backend, cache: PodCache, hostprobe: HostProbe, metrics: Metrics) -> Self {
        let defaults = InpodConfig {
            dns_capture: config.ambient_dns_capture,
            ingress_mode: false,
            virtual_interfaces: Vec::new(),
            enable_ipv6: config.ambient_ipv6,
            probe_snat_v4: config.host_probe_snat_ip,
            probe_snat_v6: config.host_probe_snat_ipv6,
        };
        Self {
            cache,
            gate: PodGate::default(),
            hostprobe: Arc::new(hostprobe),
            backend,
            defaults,
            recorder: Recorder::new(metrics),
        }
    }

    /// The cache of enrolled pods.
    pub fn cache(&self) -> &PodCache {
        &self.cache
    }

    /// One operation per pod at a time, and the pods deleted lately.
    pub fn gate(&self) -> &PodGate {
        &self.gate
    }

    /// The host probe set.
    pub fn hostprobe(&self) -> Arc<HostProbe> {
        self.hostprobe.clone()
    }

    /// The backend of the in-pod rules.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// The writer of the enrollment records and the step latency histogram.
    pub fn recorder(&self) -> &Recorder {
        &self.recorder
    }

    /// Each pod's latest enrollment, for `node-agent explain`.
    pub fn timelines(&self) -> &Timelines {
        self.recorder.timelines()
    }

    /// Pod `uid`'s pass and cache entry, if it is enrolled and not deleted: the drift check holds the pass while
    /// it reads and repairs the pod's rules, so it never runs during an enrollment or removal of the pod, and never
    /// touches a pod being removed (waiting here until the removal is done, then finding no entry).
    pub async fn enrolled_pass(&self, uid: &PodUid) -> Option<(Pass, Enrolled)> {
        let pass = self.gate.enter(uid).await;
        if self.gate.is_deleted(uid) {
            return None;
        }
        Some((pass, self.cache.get(uid)?))
    }

    /// The in-pod rule settings for `pod`: agent defaults overridden by the pod's annotations. Every value that
    /// reaches a rule passes the same checks as the sidecar settings (`istio_contract::validate`); an invalid one
    /// is an error naming its annotation, and the pod gets no rules.
    pub fn inpod_config(&self, pod: &Pod) -> Result<InpodConfig, istio_contract::validate::SettingsError> {
        let empty = BTreeMap::new();
        let ann = pod.metadata.annotations.as_ref().unwrap_or(&empty);
        let flag = |k: &str| ann.get(k).map(|v| v.trim().eq_ignore_ascii_case("true"));
        Ok(InpodConfig {
            dns_capture: flag(AMBIENT_DNS_CAPTURE).unwrap_or(self.defaults.dns_capture),
            ingress_mode: flag(AMBIENT_BYPASS_INBOUND_CAPTURE).unwrap_or(false),
            virtual_interfaces: istio_contract::validate::interfaces(ann, REROUTE_VIRTUAL_INTERFACES)?,
            ..self.defaults.clone()
        })
    }
}

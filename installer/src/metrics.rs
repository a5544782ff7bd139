//! install-cni's Prometheus metrics, registered once.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// Label of `istio_cni_installs_total`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct InstallResult {
    /// `success` or `failure`.
    pub result: String,
}

/// The metrics operators alert on.
#[derive(Debug, Clone, Default)]
pub struct Metrics {
    /// 1 while the install is valid.
    pub ready: Gauge,
    /// Install and repair attempts by result.
    pub installs: Family<InstallResult, Counter>,
    /// Config fights detected (another writer kept reverting us).
    pub config_fights: Counter,
}

impl Metrics {
    /// Registers every metric under Istio's names.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register(
            "istio_cni_install_ready",
            "Whether the CNI plugin install is valid (1) or not (0)",
            m.ready.clone(),
        );
        registry.register("istio_cni_installs", "Install and repair attempts by result", m.installs.clone());
        registry.register(
            "istio_cni_config_fights",
            "Times another writer kept reverting the istio-cni entry in the CNI config",
            m.config_fights.clone(),
        );
        m
    }

    /// Counts one install attempt.
    pub fn install(&self, ok: bool) {
        let result = if ok { "success" } else { "failure" }.to_string();
        self.installs.get_or_create(&InstallResult { result }).inc();
    }
}

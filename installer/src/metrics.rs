//! install-cni's Prometheus metrics, registered once.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// Label of `istio_cni_installs_total`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct InstallResult {
    /// One of Istio's values: [`Outcome::label`].
    pub result: String,
}

/// How one install attempt ended, as Istio's `istio_cni_installs_total{result}` tells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The plugin is installed: binaries, kubeconfig and CNI config (`SUCCESS`).
    Success,
    /// Copying the plugin binaries failed (`COPY_BINARIES_FAILURE`).
    CopyBinariesFailure,
    /// Reading the service account's token or CA failed (`READ_SERVICE_ACCOUNT_FAILURE`).
    ReadServiceAccountFailure,
    /// Writing the plugin's kubeconfig failed (`CREATE_KUBECONFIG_FAILURE`).
    CreateKubeconfigFailure,
    /// Writing the CNI config failed (`CREATE_CNI_CONFIG_FAILURE`).
    CreateCniConfigFailure,
}

impl Outcome {
    /// Istio's label value.
    pub fn label(self) -> &'static str {
        match self {
            Outcome::Success => "SUCCESS",
            Outcome::CopyBinariesFailure => "COPY_BINARIES_FAILURE",
            Outcome::ReadServiceAccountFailure => "READ_SERVICE_ACCOUNT_FAILURE",
            Outcome::CreateKubeconfigFailure => "CREATE_KUBECONFIG_FAILURE",
            Outcome::CreateCniConfigFailure => "CREATE_CNI_CONFIG_FAILURE",
        }
    }
}

/// The metrics operators alert on.
#[derive(Debug, Clone, Default)]
pub struct Metrics {
    /// 1 while the install is valid.
    pub ready: Gauge,
    /// Install and repair attempts by result (Istio's values, [`Outcome`]).
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
    pub fn install(&self, outcome: Outcome) {
        self.installs.get_or_create(&InstallResult { result: outcome.label().into() }).inc();
    }
}

//! The node agent's configuration: flags with matching env vars, named as Istio's chart sets them.

use std::net::{Ipv4Addr, Ipv6Addr};
use std::path::PathBuf;

use clap::{ArgAction, Parser};
use istio_contract::enablement::{SelectorError, Selectors};
use istio_contract::proxy::{PROBE_SNAT_V4, PROBE_SNAT_V6};
use istio_contract::{names, paths};

use crate::repair::selectors::{PodSelection, SelectorError as RepairSelectorError};

/// Every setting of the agent, validated once at startup.
#[derive(Debug, Clone, Parser)]
#[command(name = "node-agent", about = "Enrolls ambient pods and hands their network namespaces to the node proxy")]
pub struct Config {
    /// This node's name; only pods scheduled here are watched. Istio's `KUBERNETES_NODE_NAME` is read when unset.
    #[arg(long, env = "NODE_NAME", default_value = "")]
    pub node_name: String,
    /// Istio's name for the node setting; used when `NODE_NAME` is unset.
    #[arg(long, env = "KUBERNETES_NODE_NAME", default_value = "")]
    pub kubernetes_node_name: String,
    /// Whether ambient enrollment is on at all.
    #[arg(long, env = "AMBIENT_ENABLED", default_value_t = true, action = ArgAction::Set)]
    pub ambient_enabled: bool,
    /// Capture DNS to the proxy's 15053 by default (per pod: `ambient.istio.io/dns-capture`).
    #[arg(long, env = "AMBIENT_DNS_CAPTURE", default_value_t = true, action = ArgAction::Set)]
    pub ambient_dns_capture: bool,
    /// Program IPv6 rules too.
    #[arg(long, env = "AMBIENT_IPV6", default_value_t = true, action = ArgAction::Set)]
    pub ambient_ipv6: bool,
    /// Enablement selectors (YAML or JSON list of pod/namespace LabelSelectors); Istio's defaults when empty.
    #[arg(long, env = "AMBIENT_ENABLEMENT_SELECTOR", default_value = "", allow_hyphen_values = true)]
    pub ambient_enablement_selector: String,
    /// Re-program the rules of already enrolled pods at startup.
    #[arg(long, env = "AMBIENT_RECONCILE_POD_RULES_ON_STARTUP", default_value_t = false, action = ArgAction::Set)]
    pub ambient_reconcile_pod_rules_on_startup: bool,
    /// The ZDS socket the node proxy connects to.
    #[arg(long, env = "ZTUNNEL_UDS_ADDRESS", default_value = paths::ZDS_SOCKET)]
    pub ztunnel_uds_address: PathBuf,
    /// Namespaces that are never enrolled (comma separated).
    #[arg(long, env = "EXCLUDE_NAMESPACES", default_value = "", value_delimiter = ',')]
    pub exclude_namespaces: Vec<String>,
    /// Run dir shared with the plugin (pluginevent.sock).
    #[arg(long, env = "CNI_AGENT_RUN_DIR", default_value = paths::RUN_DIR)]
    pub cni_agent_run_dir: PathBuf,
    /// Program rules with native nftables instead of iptables.
    #[arg(long, env = "NATIVE_NFTABLES", default_value_t = false, action = ArgAction::Set)]
    pub native_nftables: bool,
    /// Force an iptables flavour (iptables-legacy, iptables-nft).
    #[arg(long, env = "FORCE_IPTABLES_BINARY")]
    pub force_iptables_binary: Option<String>,
    /// Probe/metrics ports and logging, shared by every agent binary.
    #[command(flatten)]
    pub common: daemon::common_args::CommonArgs,
    /// Where the host's /proc is mounted (netns discovery of running pods).
    #[arg(long, env = "HOST_PROC", default_value = "/proc")]
    pub host_proc: PathBuf,
    /// The node's network namespace, where kubelet probes come from and the host probe rules go. Unset: the
    /// agent's own (a hostNetwork pod). The chart runs the agent without hostNetwork and sets
    /// `/host/proc/1/ns/net`.
    #[arg(long, env = "HOST_NETNS")]
    pub host_netns: Option<PathBuf>,
    /// Source address the host's probes (kubelet) are SNATed to, so the in-pod rules let them past the proxy.
    #[arg(long, env = "HOST_PROBE_SNAT_IP", default_value_t = PROBE_SNAT_V4)]
    pub host_probe_snat_ip: Ipv4Addr,
    /// The IPv6 counterpart of `HOST_PROBE_SNAT_IP`.
    #[arg(long, env = "HOST_PROBE_SNAT_IPV6", default_value_t = PROBE_SNAT_V6)]
    pub host_probe_snat_ipv6: Ipv6Addr,
    /// How often the host probe path is tested end to end on one enrolled pod (a connect from the host netns that
    /// the pod must see from `HOST_PROBE_SNAT_IP`); a failure makes the agent unready. `0s` turns it off.
    #[arg(long, env = "PROBE_SELFTEST_INTERVAL", default_value = "60s", value_parser = daemon::common_args::parse_duration)]
    pub probe_selftest_interval: std::time::Duration,
    /// The loopback-only admin port `node-agent explain` asks (`GET /debug/pods/NAMESPACE/NAME`); 0 turns it
    /// off.
    #[arg(long, env = crate::admin_api::PORT_ENV, default_value_t = crate::admin_api::DEFAULT_PORT)]
    pub admin_port: u16,
    /// How often every enrolled ambient pod's in-pod rules, the host probe rule and entries, and running sidecar
    /// pods' rules are compared with what the agent and the plugin program, and drift repaired (jittered by up to
    /// 15 %, so agents do not all re-check at once). `0s` turns the periodic check off; an on-demand check still
    /// runs (with ambient).
    #[arg(long, env = "DRIFT_CHECK_INTERVAL", default_value = "60s", value_parser = daemon::common_args::parse_duration)]
    pub drift_check_interval: std::time::Duration,
    /// Also re-program a sidecar pod whose rules drifted (the plugin's rules, as in-place repair programs them).
    /// Off by default: sidecar drift is only reported (`nodeagent_drift_detected_total{kind="sidecar_rules"}`).
    #[arg(long, env = "DRIFT_REPAIR_SIDECAR", default_value_t = false, action = ArgAction::Set)]
    pub drift_repair_sidecar: bool,
    /// Port on 127.0.0.1 where install-cni, in the same pod, serves its metrics. The agent's `/metrics` appends
    /// them, so the one port the pod's `prometheus.io/port` names (15014) carries every istio-cni metric, as
    /// Istio's single process serves them. Unset: the agent serves its own only.
    #[arg(long, env = "INSTALL_CNI_METRICS_PORT")]
    pub install_cni_metrics_port: Option<u16>,
    /// The race repair controller (pods that started before the plugin was chained).
    #[command(flatten)]
    pub repair: RepairConfig,
}

/// Settings of the repair controller, under Istio's `REPAIR_*` names.
#[derive(Debug, Clone, clap::Args)]
pub struct RepairConfig {
    /// Whether the repair controller runs at all.
    #[arg(long = "repair-enabled", env = "REPAIR_ENABLED", default_value_t = true, action = ArgAction::Set)]
    pub enabled: bool,
    /// Label broken pods with REPAIR_BROKEN_POD_LABEL_KEY=REPAIR_BROKEN_POD_LABEL_VALUE.
    #[arg(long = "repair-label-pods", env = "REPAIR_LABEL_PODS", default_value_t = false, action = ArgAction::Set)]
    pub label_pods: bool,
    /// Delete broken pods so their controller recreates them.
    #[arg(long = "repair-delete-pods", env = "REPAIR_DELETE_PODS", default_value_t = false, action = ArgAction::Set)]
    pub delete_pods: bool,
    /// Istio's in-place repair: the broken pod's netns (found through HOST_PROC) gets the sidecar redirect rules the
    /// plugin would have programmed. Takes precedence; delete or label mode, if set, is the fallback when it fails.
    #[arg(long = "repair-repair-pods", env = "REPAIR_REPAIR_PODS", default_value_t = false, action = ArgAction::Set)]
    pub repair_pods: bool,
    /// The node whose pods are repaired; when set it must equal NODE_NAME (the agent watches that node's pods).
    #[arg(id = "repair_node_name", long = "repair-node-name", env = "REPAIR_NODE_NAME")]
    pub node_name: Option<String>,
    /// The annotation that marks a sidecar-injected pod.
    #[arg(
        long = "repair-sidecar-annotation",
        env = "REPAIR_SIDECAR_ANNOTATION",
        default_value = names::SIDECAR_STATUS_ANNOTATION
    )]
    pub sidecar_annotation: String,
    /// The init container that fails when redirection is missing.
    #[arg(long = "repair-init-container-name", env = "REPAIR_INIT_CONTAINER_NAME", default_value = names::VALIDATION_CONTAINER)]
    pub init_container_name: String,
    /// Its exit code when redirection is missing.
    #[arg(
        long = "repair-init-container-exit-code",
        env = "REPAIR_INIT_CONTAINER_EXIT_CODE",
        default_value_t = names::VALIDATION_EXIT_CODE
    )]
    pub init_exit_code: i32,
    /// When non-empty, the termination message must contain it too.
    #[arg(
        long = "repair-init-container-termination-message",
        env = "REPAIR_INIT_CONTAINER_TERMINATION_MESSAGE",
        default_value = ""
    )]
    pub init_termination_msg: String,
    /// Label key set on broken pods in label mode.
    #[arg(
        long = "repair-broken-pod-label-key",
        env = "REPAIR_BROKEN_POD_LABEL_KEY",
        default_value = names::BROKEN_POD_LABEL
    )]
    pub broken_pod_label_key: String,
    /// Label value set on broken pods in label mode.
    #[arg(long = "repair-broken-pod-label-value", env = "REPAIR_BROKEN_POD_LABEL_VALUE", default_value = "true")]
    pub broken_pod_label_value: String,
    /// Kubernetes label selector (`app=web,tier in (a,b)`); only pods it matches are repaired. Empty: all.
    #[arg(long = "repair-label-selectors", env = "REPAIR_LABEL_SELECTORS", default_value = "")]
    pub label_selectors: String,
    /// Kubernetes field selector (`metadata.namespace=team-a`); only pods it matches are repaired. Empty: all.
    #[arg(long = "repair-field-selectors", env = "REPAIR_FIELD_SELECTORS", default_value = "")]
    pub field_selectors: String,
}

impl RepairConfig {
    /// The pods `REPAIR_LABEL_SELECTORS` and `REPAIR_FIELD_SELECTORS` let the controller touch.
    pub fn pod_selection(&self) -> Result<PodSelection, RepairSelectorError> {
        PodSelection::parse(&self.label_selectors, &self.field_selectors)
    }
}

/// What the shared main needs to run the agent: its settings, checks and runtime (two workers: the agent's work
/// is mostly waiting on the API server and the plugin).
impl daemon::lifecycle::Daemon for Config {
    const NAME: &'static str = "node-agent";
    const RUNTIME: daemon::lifecycle::Runtime = daemon::lifecycle::Runtime::MultiThread { workers: Some(2) };

    fn parse() -> Self {
        let mut config = <Config as Parser>::parse();
        config.resolve_node_name();
        config
    }

    fn validate(&self) -> Result<(), String> {
        Config::validate(self)
    }

    fn common(&self) -> &daemon::common_args::CommonArgs {
        &self.common
    }
}

impl Config {
    /// Parses the selectors (Istio's defaults when unset) so a typo fails at startup.
    pub fn selectors(&self) -> Result<Selectors, SelectorError> {
        if self.ambient_enablement_selector.trim().is_empty() {
            Ok(Selectors::default())
        } else {
            Selectors::parse(&self.ambient_enablement_selector)
        }
    }

    /// Takes Istio's `KUBERNETES_NODE_NAME` when `NODE_NAME` is unset.
    pub fn resolve_node_name(&mut self) {
        if self.node_name.is_empty() {
            self.node_name = self.kubernetes_node_name.clone();
        }
    }

    /// Excluded namespaces without empty entries.
    pub fn excluded(&self) -> Vec<String> {
        self.exclude_namespaces.iter().filter(|n| !n.is_empty()).cloned().collect()
    }

    /// Checks what clap cannot; the message names the setting.
    pub fn validate(&self) -> Result<(), String> {
        if self.node_name.is_empty() {
            return Err("NODE_NAME (or KUBERNETES_NODE_NAME) must be set".into());
        }
        for (name, path) in
            [("ZTUNNEL_UDS_ADDRESS", &self.ztunnel_uds_address), ("CNI_AGENT_RUN_DIR", &self.cni_agent_run_dir)]
        {
            if !path.is_absolute() {
                return Err(format!("{name} must be an absolute path, got {}", path.display()));
            }
        }
        if let Some(node) = self.repair.node_name.as_deref().filter(|n| !n.is_empty()) {
            if node != self.node_name {
                return Err(format!("REPAIR_NODE_NAME ({node}) must equal NODE_NAME ({})", self.node_name));
            }
        }
        if let Some(port) = self.install_cni_metrics_port {
            // Our own ports serve our /metrics: appending them would fetch ourselves on every scrape.
            if port == 0 || port == self.common.monitoring_port || port == self.common.readiness_port {
                return Err(format!(
                    "INSTALL_CNI_METRICS_PORT ({port}) must be install-cni's port, not 0 or this agent's own \
                     (MONITORING_PORT {}, READINESS_PORT {})",
                    self.common.monitoring_port, self.common.readiness_port
                ));
            }
        }
        self.repair.pod_selection().map_err(|e| e.to_string())?;
        self.selectors().map(|_| ()).map_err(|e| format!("AMBIENT_ENABLEMENT_SELECTOR: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory as _;

    #[test]
    fn flags_are_consistent_and_repair_defaults_match_istio() {
        Config::command().debug_assert();
        let config = Config::try_parse_from(["node-agent", "--node-name", "n"]).unwrap();
        let r = &config.repair;
        assert!(r.enabled && !r.label_pods && !r.delete_pods && !r.repair_pods);
        assert_eq!((r.init_container_name.as_str(), r.init_exit_code), ("istio-validation", 126));
        assert_eq!(
            (r.broken_pod_label_key.as_str(), r.broken_pod_label_value.as_str()),
            ("cni.istio.io/uninitialized", "true")
        );
    }

    #[test]
    fn kubernetes_node_name_alone_sets_the_node() {
        let mut config = Config::try_parse_from(["node-agent", "--kubernetes-node-name", "istio-node"]).unwrap();
        config.resolve_node_name();
        assert_eq!(config.node_name, "istio-node");
        assert!(config.validate().is_ok());
        let config = Config::try_parse_from(["node-agent"]).unwrap();
        assert!(config.validate().unwrap_err().contains("NODE_NAME"));
    }

    #[test]
    fn host_probe_snat_defaults_are_istios_and_can_be_set() {
        let config = Config::try_parse_from(["node-agent", "--node-name", "n"]).unwrap();
        assert_eq!((config.host_probe_snat_ip, config.host_probe_snat_ipv6), (PROBE_SNAT_V4, PROBE_SNAT_V6));
        let config =
            Config::try_parse_from(["node-agent", "--node-name", "n", "--host-probe-snat-ip", "169.254.7.200"])
                .unwrap();
        assert_eq!(config.host_probe_snat_ip, Ipv4Addr::new(169, 254, 7, 200));
    }

    #[test]
    fn the_probe_selftest_runs_every_minute_unless_set() {
        let config = Config::try_parse_from(["node-agent", "--node-name", "n"]).unwrap();
        assert_eq!(config.probe_selftest_interval, std::time::Duration::from_secs(60));
        let config =
            Config::try_parse_from(["node-agent", "--node-name", "n", "--probe-selftest-interval", "2s"]).unwrap();
        assert_eq!(config.probe_selftest_interval, std::time::Duration::from_secs(2));
    }

    #[test]
    fn drift_is_checked_every_minute_and_sidecar_drift_only_reported_unless_set() {
        let config = Config::try_parse_from(["node-agent", "--node-name", "n"]).unwrap();
        assert_eq!(config.drift_check_interval, std::time::Duration::from_secs(60));
        assert!(!config.drift_repair_sidecar);
        let args = ["node-agent", "--node-name", "n", "--drift-check-interval", "2s", "--drift-repair-sidecar", "true"];
        let config = Config::try_parse_from(args).unwrap();
        assert_eq!(config.drift_check_interval, std::time::Duration::from_secs(2));
        assert!(config.drift_repair_sidecar);
    }

    #[test]
    fn enablement_selector_is_yaml_or_json() {
        let yaml = "- podSelector:\n    matchLabels:\n      mesh: ambient\n";
        let json = r#"[{"podSelector":{"matchLabels":{"mesh":"ambient"}}}]"#;
        let parsed = |text: &str| {
            let config =
                Config::try_parse_from(["node-agent", "--node-name", "n", "--ambient-enablement-selector", text])
                    .unwrap();
            config.selectors().unwrap().to_json()
        };
        assert_eq!(parsed(yaml), parsed(json));
    }

    #[test]
    fn install_cni_metrics_must_come_from_another_port() {
        let with = |args: &[&str]| {
            let mut argv = vec!["node-agent", "--node-name", "n"];
            argv.extend_from_slice(args);
            Config::try_parse_from(argv).unwrap().validate()
        };
        assert_eq!(with(&[]), Ok(()));
        assert_eq!(with(&["--install-cni-metrics-port", "15015"]), Ok(()));
        for own in ["0", "15014", "8000"] {
            let error = with(&["--install-cni-metrics-port", own]).unwrap_err();
            assert!(error.starts_with(&format!("INSTALL_CNI_METRICS_PORT ({own})")), "{error}");
        }
    }

    #[test]
    fn malformed_repair_selectors_fail_validation() {
        let config =
            Config::try_parse_from(["node-agent", "--node-name", "n", "--repair-label-selectors", "app in web"])
                .unwrap();
        assert!(config.validate().unwrap_err().contains("REPAIR_LABEL_SELECTORS"));
    }

    #[test]
    fn a_repair_node_other_than_this_node_is_refused() {
        let config = Config::try_parse_from(["node-agent", "--node-name", "n", "--repair-node-name", "m"]).unwrap();
        assert!(config.validate().unwrap_err().contains("REPAIR_NODE_NAME"));
    }
}

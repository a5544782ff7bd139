//! install-cni's configuration: flags with matching env vars, named as Istio's chart sets them.

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{ArgAction, Parser};
use istio_contract::enablement::Selectors;
use istio_contract::paths;

use crate::kubeconfig::KubeconfigSettings;

/// Every setting of the agent. Validated once in [`Config::validate`] and passed down by reference.
#[derive(Debug, Clone, Parser)]
#[command(name = "install-cni", about = "Installs istio-cni on this node and keeps it installed")]
pub struct Config {
    /// Primary CNI config file to chain into; empty means the first valid file in lexical order.
    #[arg(long, env = "CNI_CONF_NAME", default_value = "")]
    pub cni_conf_name: String,
    /// Chain into the primary config (true) or write a standalone config (false).
    #[arg(long, env = "CHAINED_CNI_PLUGIN", default_value_t = true, action = ArgAction::Set)]
    pub chained_cni_plugin: bool,
    /// The host's CNI config dir, as mounted into the container.
    #[arg(long, env = "MOUNTED_CNI_NET_DIR", default_value = "/host/etc/cni/net.d")]
    pub mounted_cni_net_dir: PathBuf,
    /// Run dir shared with the plugin and the node agent (kubeconfig, socket, logs).
    #[arg(long, env = "CNI_AGENT_RUN_DIR", default_value = paths::RUN_DIR)]
    pub cni_agent_run_dir: PathBuf,
    /// File mode of the plugin's kubeconfig, in octal.
    #[arg(long, env = "KUBECONFIG_MODE", default_value = "600", value_parser = parse_mode)]
    pub kubeconfig_mode: u32,
    /// Namespaces whose pods the plugin never touches (comma separated).
    #[arg(long, env = "EXCLUDE_NAMESPACES", default_value = "", value_delimiter = ',')]
    pub exclude_namespaces: Vec<String>,
    /// Namespace of this DaemonSet's pods.
    #[arg(long, env = "POD_NAMESPACE", default_value = "")]
    pub pod_namespace: String,
    /// Name of this pod.
    #[arg(long, env = "POD_NAME", default_value = "")]
    pub pod_name: String,
    /// The node this agent runs on (Istio's `KUBERNETES_NODE_NAME` is read when this is unset).
    #[arg(long, env = "NODE_NAME", default_value = "")]
    pub node_name: String,
    /// Istio's name for the node setting; used when `NODE_NAME` is unset.
    #[arg(long, env = "KUBERNETES_NODE_NAME", default_value = "")]
    pub kubernetes_node_name: String,
    /// Whether ambient mode is enabled (the plugin then hands ambient pods to the node agent).
    #[arg(long, env = "AMBIENT_ENABLED", default_value_t = false, action = ArgAction::Set)]
    pub ambient_enabled: bool,
    /// Ambient enablement selectors as a YAML or JSON list of pod/namespace LabelSelectors (Istio's by default: the
    /// pod label, or the namespace label unless the pod opts out); the plugin's netconf carries them as JSON.
    #[arg(
        long,
        env = "AMBIENT_ENABLEMENT_SELECTOR",
        allow_hyphen_values = true,
        default_value_t = Selectors::default().to_json(),
        value_parser = parse_selectors
    )]
    pub ambient_enablement_selector: serde_json::Value,
    /// Retry API errors during the plugin's ambient detection.
    #[arg(long, env = "ENABLE_AMBIENT_DETECTION_RETRY", default_value_t = false, action = ArgAction::Set)]
    pub enable_ambient_detection_retry: bool,
    /// Let the plugin program nftables instead of iptables.
    #[arg(long, env = "NATIVE_NFTABLES", default_value_t = false, action = ArgAction::Set)]
    pub native_nftables: bool,
    /// Make the CNI config we write readable by its group (mode 0640), as Istio's `CNI_CONF_GROUP_READ`.
    #[arg(long, env = "CNI_CONF_GROUP_READ", default_value_t = false, action = ArgAction::Set)]
    pub cni_conf_group_read: bool,
    /// Write our own higher-priority conflist instead of editing the primary (ambient + chained only).
    #[arg(long, env = "ISTIO_OWNED_CNI_CONFIG", default_value_t = false, action = ArgAction::Set)]
    pub istio_owned_cni_config: bool,
    /// File name of the Istio-owned conflist (the chart spells it ISTIO_OWNED_CNI_CONF_FILENAME).
    #[arg(long, env = "ISTIO_OWNED_CNI_CONFIG_FILENAME", default_value = "02-istio-cni.conflist")]
    pub istio_owned_cni_config_filename: String,
    /// Probe/metrics ports and logging, shared by every agent binary.
    #[command(flatten)]
    pub common: daemon::common_args::CommonArgs,
    /// Log level written into the plugin's netconf; when unset, the `cni-plugin` scope of Istio's
    /// `--log_output_level` form (`default:info,cni-plugin:debug`), else `info` (see [`Config::plugin_log_level`]).
    #[arg(long, env = "PLUGIN_LOG_LEVEL")]
    pub plugin_log_level: Option<String>,
    /// Where the image keeps the binaries to install.
    #[arg(long, env = "CNI_BIN_SOURCE_DIR", default_value = "/opt/cni/bin")]
    pub cni_bin_source_dir: PathBuf,
    /// The host's CNI bin dir, as mounted into the container.
    #[arg(long, env = "HOST_CNI_BIN_DIR", default_value = "/host/opt/cni/bin")]
    pub host_cni_bin_dir: PathBuf,
    /// A second bin dir to install into (some platforms look in two places).
    #[arg(long, env = "SECONDARY_BIN_DIR")]
    pub secondary_bin_dir: Option<PathBuf>,
    /// The projected service-account volume (token, ca.crt).
    #[arg(long, env = "SERVICE_ACCOUNT_DIR", default_value = "/var/run/secrets/kubernetes.io/serviceaccount")]
    pub service_account_dir: PathBuf,
    /// API server scheme for the plugin's kubeconfig.
    #[arg(long, env = "KUBERNETES_SERVICE_PROTOCOL", default_value = "https")]
    pub kubernetes_service_protocol: String,
    /// API server host for the plugin's kubeconfig.
    #[arg(long, env = "KUBERNETES_SERVICE_HOST", default_value = "")]
    pub kubernetes_service_host: String,
    /// API server port for the plugin's kubeconfig.
    #[arg(long, env = "KUBERNETES_SERVICE_PORT", default_value = "")]
    pub kubernetes_service_port: String,
    /// CA bundle to inline into the kubeconfig; defaults to the service account's ca.crt.
    #[arg(long, env = "KUBE_CA_FILE")]
    pub kube_ca_file: Option<PathBuf>,
    /// Write `insecure-skip-tls-verify` instead of a CA.
    #[arg(long, env = "SKIP_TLS_VERIFY", default_value_t = false, action = ArgAction::Set)]
    pub skip_tls_verify: bool,
    /// Always clean up on exit, even while our DaemonSet still exists.
    #[arg(long, env = "AMBIENT_DISABLE_SAFE_UPGRADE", default_value_t = false, action = ArgAction::Set)]
    pub ambient_disable_safe_upgrade: bool,
    /// Reverts by another writer within the window that count as a config fight.
    #[arg(long, env = "CONFIG_FIGHT_THRESHOLD", default_value_t = 5)]
    pub config_fight_threshold: usize,
    /// The config-fight window in seconds.
    #[arg(long, env = "CONFIG_FIGHT_WINDOW_SECONDS", default_value = "60", value_parser = parse_seconds)]
    pub config_fight_window: Duration,
}

fn parse_mode(s: &str) -> Result<u32, String> {
    let mode = u32::from_str_radix(s.trim_start_matches("0o"), 8).map_err(|e| format!("not an octal mode: {e}"))?;
    if mode > 0o777 {
        return Err("mode must be at most 777".into());
    }
    Ok(mode)
}

/// `AMBIENT_ENABLEMENT_SELECTOR` in YAML or JSON, checked, as the JSON the netconf carries.
fn parse_selectors(s: &str) -> Result<serde_json::Value, String> {
    if s.trim().is_empty() {
        return Ok(netconf_selectors(&Selectors::default()));
    }
    Selectors::parse(s).map(|selectors| netconf_selectors(&selectors)).map_err(|e| e.to_string())
}

/// The selectors in the shape Istio's install-cni writes them into the netconf (Go marshals its struct): every
/// entry has both `podSelector` and `namespaceSelector`, `{}` (matching everything) for one not given.
fn netconf_selectors(selectors: &Selectors) -> serde_json::Value {
    let mut json = selectors.to_json();
    for entry in json.as_array_mut().into_iter().flatten().filter_map(serde_json::Value::as_object_mut) {
        for key in ["podSelector", "namespaceSelector"] {
            entry.entry(key).or_insert_with(|| serde_json::json!({}));
        }
    }
    json
}

fn parse_seconds(s: &str) -> Result<Duration, String> {
    s.parse::<u64>().map(Duration::from_secs).map_err(|e| format!("not a number of seconds: {e}"))
}

/// What the shared main needs to run install-cni: its settings, checks and runtime (one thread: its loop is
/// sequential).
impl daemon::lifecycle::Daemon for Config {
    const NAME: &'static str = "install-cni";
    const RUNTIME: daemon::lifecycle::Runtime = daemon::lifecycle::Runtime::CurrentThread;

    fn parse() -> Self {
        Config::load().unwrap_or_else(|e| e.exit())
    }

    fn validate(&self) -> Result<(), String> {
        Config::validate(self)
    }

    fn common(&self) -> &daemon::common_args::CommonArgs {
        &self.common
    }
}

impl Config {
    /// Reads flags and env. The chart's spelling `ISTIO_OWNED_CNI_CONF_FILENAME` is honoured too, and Istio's
    /// `KUBERNETES_NODE_NAME` when `NODE_NAME` is unset.
    pub fn load() -> Result<Config, clap::Error> {
        let mut config = Config::try_parse()?;
        config.resolve_node_name();
        if std::env::var_os("ISTIO_OWNED_CNI_CONFIG_FILENAME").is_none() {
            if let Some(name) = std::env::var("ISTIO_OWNED_CNI_CONF_FILENAME").ok().filter(|n| !n.is_empty()) {
                config.istio_owned_cni_config_filename = name;
            }
        }
        config.exclude_namespaces.retain(|n| !n.is_empty());
        Ok(config)
    }

    /// The plugin's log level, as Istio's install-cni passes it down: `PLUGIN_LOG_LEVEL` when set, else the level
    /// of the `cni-plugin` scope in the log level's Istio form (`--log_output_level=default:info,cni-plugin:debug`
    /// gives `debug`; a bare level is the `default` scope's only, as in Istio), else `info`.
    pub fn plugin_log_level(&self) -> String {
        if let Some(level) = self.plugin_log_level.as_deref().map(str::trim).filter(|l| !l.is_empty()) {
            return level.to_owned();
        }
        let mut scoped = self.common.log_level.split(',').filter_map(|entry| entry.trim().split_once(':'));
        let plugin = scoped.rfind(|(scope, _)| scope.trim() == "cni-plugin");
        plugin.map_or_else(|| "info".to_owned(), |(_, level)| level.trim().to_owned())
    }

    /// Checks what clap cannot: paths must be absolute, names must be plain file names.
    pub fn validate(&self) -> Result<(), String> {
        let dirs: [(&str, Option<&Path>); 5] = [
            ("MOUNTED_CNI_NET_DIR", Some(&self.mounted_cni_net_dir)),
            ("CNI_AGENT_RUN_DIR", Some(&self.cni_agent_run_dir)),
            ("CNI_BIN_SOURCE_DIR", Some(&self.cni_bin_source_dir)),
            ("HOST_CNI_BIN_DIR", Some(&self.host_cni_bin_dir)),
            ("SECONDARY_BIN_DIR", self.secondary_bin_dir.as_deref()),
        ];
        for (name, dir) in dirs {
            if let Some(dir) = dir {
                if !dir.is_absolute() {
                    return Err(format!("{name} must be an absolute path, got {}", dir.display()));
                }
            }
        }
        if !self.service_account_dir.is_absolute() {
            return Err(format!(
                "SERVICE_ACCOUNT_DIR must be an absolute path, got {}",
                self.service_account_dir.display()
            ));
        }
        for (name, file) in [
            ("CNI_CONF_NAME", &self.cni_conf_name),
            ("ISTIO_OWNED_CNI_CONFIG_FILENAME", &self.istio_owned_cni_config_filename),
        ] {
            if file.contains('/') {
                return Err(format!("{name} must be a file name, not a path: {file}"));
            }
        }
        if !matches!(self.kubernetes_service_protocol.as_str(), "http" | "https") {
            return Err(format!(
                "KUBERNETES_SERVICE_PROTOCOL must be http or https, got {}",
                self.kubernetes_service_protocol
            ));
        }
        Ok(())
    }

    /// Bin dirs to install into: the host's, then the secondary one.
    pub fn target_bin_dirs(&self) -> Vec<PathBuf> {
        std::iter::once(self.host_cni_bin_dir.clone()).chain(self.secondary_bin_dir.clone()).collect()
    }

    /// Where the plugin's kubeconfig (and install-cni's own API client) takes its server, CA and token from.
    pub fn kubeconfig_settings(&self) -> KubeconfigSettings {
        let nonempty = |s: &str| Some(s.to_string()).filter(|s| !s.is_empty());
        KubeconfigSettings {
            protocol: nonempty(&self.kubernetes_service_protocol),
            host: nonempty(&self.kubernetes_service_host),
            port: nonempty(&self.kubernetes_service_port),
            ca_file: self.kube_ca_file.clone(),
            skip_tls_verify: self.skip_tls_verify,
            service_account_dir: self.service_account_dir.clone(),
        }
    }

    /// Takes Istio's `KUBERNETES_NODE_NAME` when `NODE_NAME` is unset.
    pub fn resolve_node_name(&mut self) {
        if self.node_name.is_empty() {
            self.node_name = self.kubernetes_node_name.clone();
        }
    }

    /// The permission bits of a CNI config file of our own (standalone, Istio-owned) when `CNI_CONF_GROUP_READ`
    /// is on; `None` means the default, 0600. A primary we chain into always keeps its own mode.
    pub fn conf_mode(&self) -> Option<u32> {
        self.cni_conf_group_read.then_some(0o640)
    }

    /// Where the plugin's kubeconfig goes.
    pub fn kubeconfig_path(&self) -> PathBuf {
        self.cni_agent_run_dir.join(paths::KUBECONFIG_FILE)
    }

    /// Istio-owned mode only applies when chained and ambient are on too, as in Istio.
    pub fn owned_file(&self) -> Option<&str> {
        (self.istio_owned_cni_config && self.chained_cni_plugin && self.ambient_enabled)
            .then_some(self.istio_owned_cni_config_filename.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Config, clap::Error> {
        Config::try_parse_from(std::iter::once("install-cni").chain(args.iter().copied()))
    }

    #[test]
    fn defaults_match_istio() {
        let c = parse(&[]).unwrap();
        assert!(c.chained_cni_plugin);
        assert_eq!(c.kubeconfig_mode, 0o600);
        assert_eq!(c.mounted_cni_net_dir, PathBuf::from("/host/etc/cni/net.d"));
        assert_eq!(c.kubeconfig_path(), PathBuf::from("/var/run/istio-cni/istio-cni-kubeconfig"));
        assert_eq!(c.common.monitoring_port, 15014);
        assert!(c.ambient_enablement_selector.as_array().is_some_and(|a| a.len() == 2));
        assert!(c.validate().is_ok());
    }

    #[test]
    fn the_plugin_log_level_follows_istios_cni_plugin_scope() {
        let level = |args: &[&str]| parse(args).unwrap().plugin_log_level();
        assert_eq!(level(&[]), "info");
        assert_eq!(level(&["--log_output_level=default:debug,cni-plugin:debug"]), "debug");
        assert_eq!(level(&["--log_output_level=cni-plugin:warn"]), "warn");
        // A bare level is Istio's `default` scope only: the plugin stays at info, as in Istio.
        assert_eq!(level(&["--log_output_level=debug"]), "info");
        assert_eq!(level(&["--log_output_level=cni-plugin:debug", "--plugin-log-level=error"]), "error");
    }

    #[test]
    fn bad_values_name_the_setting() {
        let err = parse(&["--kubeconfig-mode", "999"]).unwrap_err().to_string();
        assert!(err.contains("kubeconfig-mode"), "{err}");
        let c = parse(&["--host-cni-bin-dir", "relative/bin"]).unwrap();
        assert!(c.validate().unwrap_err().contains("HOST_CNI_BIN_DIR"));
        let c = parse(&["--cni-conf-name", "../x.conf"]).unwrap();
        assert!(c.validate().unwrap_err().contains("CNI_CONF_NAME"));
        assert!(parse(&["--chained-cni-plugin", "maybe"]).is_err());
    }

    #[test]
    fn enablement_selector_is_yaml_or_json() {
        let yaml = "- podSelector:\n    matchLabels:\n      mesh: ambient\n";
        let json = r#"[{"podSelector":{"matchLabels":{"mesh":"ambient"}}}]"#;
        let from_yaml = parse(&["--ambient-enablement-selector", yaml]).unwrap().ambient_enablement_selector;
        let from_json = parse(&["--ambient-enablement-selector", json]).unwrap().ambient_enablement_selector;
        assert_eq!(from_yaml, from_json);
        // In Istio's netconf shape: both selectors, `{}` for the one not given.
        let want = serde_json::json!([{"podSelector": {"matchLabels": {"mesh": "ambient"}}, "namespaceSelector": {}}]);
        assert_eq!(from_yaml, want);
        let err = parse(&["--ambient-enablement-selector", "{not: [a list"]).unwrap_err().to_string();
        assert!(err.contains("ambient-enablement-selector"), "{err}");
    }

    #[test]
    fn kubernetes_node_name_alone_sets_the_node() {
        let mut c = parse(&["--kubernetes-node-name", "istio-node"]).unwrap();
        c.resolve_node_name();
        assert_eq!(c.node_name, "istio-node");
        let mut c = parse(&["--node-name", "ours", "--kubernetes-node-name", "istio-node"]).unwrap();
        c.resolve_node_name();
        assert_eq!(c.node_name, "ours");
    }

    #[test]
    fn group_read_makes_the_conf_0640() {
        assert_eq!(parse(&[]).unwrap().conf_mode(), None);
        assert_eq!(parse(&["--cni-conf-group-read", "true"]).unwrap().conf_mode(), Some(0o640));
    }

    #[test]
    fn owned_mode_needs_chained_and_ambient() {
        let c = parse(&["--istio-owned-cni-config", "true"]).unwrap();
        assert_eq!(c.owned_file(), None);
        let c = parse(&["--istio-owned-cni-config", "true", "--ambient-enabled", "true"]).unwrap();
        assert_eq!(c.owned_file(), Some("02-istio-cni.conflist"));
    }
}

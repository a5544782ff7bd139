//! The plugin's network configuration, as the runtime passes it on stdin.
//!
//! Istio's current flat fields and the pre-1.24 nested `kubernetes` section are both accepted. Every setting comes
//! from here, never from the environment: podman runs DEL with a sanitized environment.

use std::path::PathBuf;
use std::time::Duration;

use cni::{CniError, ErrorCode, Version};
use istio_contract::paths;
use serde::Deserialize;
use serde_json::Value;

/// The pre-1.24 nested section.
#[derive(Debug, Default, Deserialize)]
pub struct KubernetesSection {
    /// Path of the plugin's kubeconfig.
    pub kubeconfig: Option<String>,
    /// Namespaces whose pods are never touched.
    pub exclude_namespaces: Option<Vec<String>>,
    /// Where the CNI binaries live (accepted for compatibility; unused).
    pub cni_bin_dir: Option<String>,
}

/// The plugin's netconf. Unknown keys (`capabilities`, `runtimeConfig`, `ipam`, `dns`, …) are tolerated.
#[derive(Debug, Default, Deserialize)]
pub struct PluginConf {
    /// Spec version of the request.
    #[serde(rename = "cniVersion", default)]
    pub cni_version: String,
    /// Network name.
    #[serde(default)]
    pub name: String,
    /// Result of the previous plugin in the chain.
    #[serde(rename = "prevResult")]
    pub prev_result: Option<Value>,
    /// Log level (`debug`, `info`, …).
    pub plugin_log_level: Option<String>,
    /// Pre-1.24 spelling of the log level.
    pub log_level: Option<String>,
    /// Directory holding the kubeconfig, the agent socket and our log file.
    pub cni_agent_run_dir: Option<String>,
    /// Whether ambient enrollment is active on this node.
    #[serde(default)]
    pub ambient_enabled: bool,
    /// Ambient enablement selectors (used by the ambient path).
    pub enablement_selectors: Option<Value>,
    /// Namespaces whose pods are passed through untouched.
    pub exclude_namespaces: Option<Vec<String>>,
    /// Namespace of the istio-cni DaemonSet, so the plugin never blocks its own pods.
    pub pod_namespace: Option<String>,
    /// Program rules with nftables instead of iptables.
    #[serde(default)]
    pub native_nftables: bool,
    /// Retry API errors during ambient detection.
    #[serde(default)]
    pub enable_ambient_detection_retry: bool,
    /// Pre-1.24 nested layout.
    pub kubernetes: Option<KubernetesSection>,
    /// How many times the pod lookup is tried before ADD fails closed (ours; default 30).
    pub pod_lookup_attempts: Option<u32>,
    /// Pause between pod lookup attempts in milliseconds (ours; default 1000).
    pub pod_lookup_interval_ms: Option<u64>,
    /// Which iptables binary to use, overriding detection (ours; same values as `FORCE_IPTABLES_BINARY`).
    pub force_iptables_binary: Option<String>,
    /// GC: attachments the runtime still knows about.
    #[serde(rename = "cni.dev/valid-attachments")]
    pub valid_attachments: Option<Vec<Value>>,
}

impl PluginConf {
    /// Parses stdin. Broken JSON is a decoding failure (6); wrong field types are an invalid config (7).
    pub fn parse(stdin: &[u8]) -> Result<PluginConf, CniError> {
        serde_json::from_slice(stdin).map_err(|e| {
            let code = if e.is_data() { ErrorCode::InvalidConfig } else { ErrorCode::Decoding };
            CniError::new(code, format!("invalid network config on stdin: {e}"))
        })
    }

    /// The request's spec version, if it is one we support.
    pub fn version(&self) -> Result<Version, CniError> {
        if self.cni_version.is_empty() {
            return Err(CniError::new(ErrorCode::IncompatibleVersion, "network config has no cniVersion"));
        }
        Version::supported(&self.cni_version)
    }

    /// The run directory (default `/var/run/istio-cni`).
    pub fn run_dir(&self) -> PathBuf {
        PathBuf::from(self.cni_agent_run_dir.as_deref().filter(|d| !d.is_empty()).unwrap_or(paths::RUN_DIR))
    }

    /// The kubeconfig path: the nested field if set, else `<run dir>/istio-cni-kubeconfig`.
    pub fn kubeconfig(&self) -> PathBuf {
        self.kubernetes
            .as_ref()
            .and_then(|k| k.kubeconfig.as_deref())
            .filter(|p| !p.is_empty())
            .map(PathBuf::from)
            .unwrap_or_else(|| self.run_dir().join(paths::KUBECONFIG_FILE))
    }

    /// Log level from either layout, defaulting to `info`.
    pub fn log_level(&self) -> &str {
        self.plugin_log_level.as_deref().or(self.log_level.as_deref()).unwrap_or("info")
    }

    /// Excluded namespaces from both layouts.
    pub fn excluded_namespaces(&self) -> impl Iterator<Item = &str> {
        let nested = self.kubernetes.as_ref().and_then(|k| k.exclude_namespaces.as_ref());
        self.exclude_namespaces.iter().chain(nested).flatten().map(String::as_str)
    }

    /// Pod lookup attempts and interval.
    pub fn pod_lookup(&self) -> (u32, Duration) {
        (
            self.pod_lookup_attempts.unwrap_or(30).max(1),
            Duration::from_millis(self.pod_lookup_interval_ms.unwrap_or(1000)),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flat_layout() {
        let c = PluginConf::parse(
            br#"{"cniVersion":"1.0.0","name":"k8s","type":"istio-cni","plugin_log_level":"debug",
            "cni_agent_run_dir":"/run/x","ambient_enabled":true,"exclude_namespaces":["kube-system"],
            "pod_namespace":"istio-system","native_nftables":false,"enable_ambient_detection_retry":true,
            "enablement_selectors":[{"podSelector":{"matchLabels":{"istio.io/dataplane-mode":"ambient"}}}],
            "capabilities":{"portMappings":true},
            "runtimeConfig":{"portMappings":[{"hostPort":8080,"containerPort":80,"protocol":"tcp"}]},
            "somethingNew":{"x":1}}"#,
        )
        .unwrap();
        assert_eq!(c.version().unwrap(), Version(1, 0, 0));
        assert_eq!(c.log_level(), "debug");
        assert_eq!(c.kubeconfig(), PathBuf::from("/run/x/istio-cni-kubeconfig"));
        assert!(c.ambient_enabled && c.enable_ambient_detection_retry);
        assert_eq!(c.excluded_namespaces().collect::<Vec<_>>(), ["kube-system"]);
    }

    #[test]
    fn nested_layout() {
        let c = PluginConf::parse(
            br#"{"cniVersion":"0.3.1","name":"k8s","type":"istio-cni","log_level":"warn",
            "kubernetes":{"kubeconfig":"/etc/cni/net.d/ZZZ-istio-cni-kubeconfig","cni_bin_dir":"/opt/cni/bin",
            "exclude_namespaces":["istio-system"]},
            "runtimeConfig":{"PortMappings":[{"HostPort":8080,"ContainerPort":80,"Protocol":"tcp"}]}}"#,
        )
        .unwrap();
        assert_eq!(c.log_level(), "warn");
        assert_eq!(c.kubeconfig(), PathBuf::from("/etc/cni/net.d/ZZZ-istio-cni-kubeconfig"));
        assert_eq!(c.excluded_namespaces().collect::<Vec<_>>(), ["istio-system"]);
        assert_eq!(c.run_dir(), PathBuf::from(paths::RUN_DIR));
    }

    #[test]
    fn broken_json_is_6_and_wrong_types_are_7() {
        assert_eq!(PluginConf::parse(b"{not json").unwrap_err().code, 6);
        assert_eq!(PluginConf::parse(b"").unwrap_err().code, 6);
        assert_eq!(PluginConf::parse(br#"{"cniVersion":"1.0.0","ambient_enabled":"yes"}"#).unwrap_err().code, 7);
        assert_eq!(PluginConf::parse(br#"{"cniVersion":7}"#).unwrap_err().code, 7);
    }

    #[test]
    fn missing_or_unknown_version_is_1() {
        assert_eq!(PluginConf::parse(b"{}").unwrap().version().unwrap_err().code, 1);
        assert_eq!(PluginConf::parse(br#"{"cniVersion":"9.9.9"}"#).unwrap().version().unwrap_err().code, 1);
    }
}

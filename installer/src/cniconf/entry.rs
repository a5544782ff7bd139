use serde::Serialize;
use serde_json::Value;

/// The `type` of our plugin entry: the name of the plugin binary the runtime executes, and how we
/// recognise our entry in a list.
pub const PLUGIN_TYPE: &str = "istio-cni";

/// The netconf fields the `istio-cni` plugin reads, set from the agent's config. It is rendered as
/// Istio renders its `PluginConfig`, so the files we write equal Istio's.
#[derive(Debug, Clone, PartialEq)]
pub struct PluginEntry {
    /// `plugin_log_level`: the plugin's log level.
    pub plugin_log_level: String,
    /// `cni_agent_run_dir`: where the plugin finds its kubeconfig and the agent's socket.
    pub cni_agent_run_dir: String,
    /// `ambient_enabled`: whether the plugin hands pods to the ambient node agent.
    pub ambient_enabled: bool,
    /// `enablement_selectors`: ambient enablement selectors, passed through as given (`[]` when none).
    pub enablement_selectors: Value,
    /// `exclude_namespaces`: namespaces the plugin skips (`null` when unset).
    pub exclude_namespaces: Option<Vec<String>>,
    /// `pod_namespace`: the agent's own namespace.
    pub pod_namespace: String,
    /// `native_nftables`: whether to program nftables instead of iptables.
    pub native_nftables: bool,
    /// `enable_ambient_detection_retry`: retry ambient detection for pods created before the agent.
    pub enable_ambient_detection_retry: bool,
}

/// Istio's struct field order; `ipam` and `dns` are always empty objects, like Go's non-omittable
/// empty structs.
#[derive(Serialize)]
struct Wire<'a> {
    #[serde(rename = "cniVersion")]
    cni_version: &'static str,
    name: &'static str,
    #[serde(rename = "type")]
    kind: &'static str,
    ipam: Empty,
    dns: Empty,
    plugin_log_level: &'a str,
    cni_agent_run_dir: &'a str,
    ambient_enabled: bool,
    enablement_selectors: &'a Value,
    exclude_namespaces: &'a Option<Vec<String>>,
    pod_namespace: &'a str,
    native_nftables: bool,
    enable_ambient_detection_retry: bool,
}

#[derive(Serialize)]
struct Empty {}

/// cniVersion of the standalone config (and of a `.conf` converted into a list).
pub(crate) const CNI_VERSION: &str = "0.3.1";

impl PluginEntry {
    /// The entry as a standalone netconf object, keys in Istio's struct order.
    pub(crate) fn to_json(&self) -> Value {
        let wire = Wire {
            cni_version: CNI_VERSION,
            name: PLUGIN_TYPE,
            kind: PLUGIN_TYPE,
            ipam: Empty {},
            dns: Empty {},
            plugin_log_level: &self.plugin_log_level,
            cni_agent_run_dir: &self.cni_agent_run_dir,
            ambient_enabled: self.ambient_enabled,
            enablement_selectors: &self.enablement_selectors,
            exclude_namespaces: &self.exclude_namespaces,
            pod_namespace: &self.pod_namespace,
            native_nftables: self.native_nftables,
            enable_ambient_detection_retry: self.enable_ambient_detection_retry,
        };
        serde_json::to_value(wire).expect("a struct of strings, bools and JSON values always serialises")
    }

    /// The entry as it appears inside a list: without `cniVersion`, which the list carries.
    pub(crate) fn to_list_json(&self) -> Value {
        let mut value = self.to_json();
        if let Value::Object(map) = &mut value {
            map.shift_remove("cniVersion");
        }
        value
    }
}

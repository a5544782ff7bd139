//! Where the plugin, the node agent and the node proxy find each other on a node.

/// The run directory the plugin and the node agent share (`CNI_AGENT_RUN_DIR`).
pub const RUN_DIR: &str = "/var/run/istio-cni";
/// The node agent's plugin event socket in the run directory (`POST /cmdadd`).
pub const PLUGIN_EVENT_SOCKET: &str = "pluginevent.sock";
/// The node agent's log socket in the run directory: the plugin's log lines go there.
pub const LOG_SOCKET: &str = "log.sock";
/// The ZDS socket the node agent serves and the node proxy dials (`ZTUNNEL_UDS_ADDRESS`, `INPOD_UDS`).
pub const ZDS_SOCKET: &str = "/var/run/ztunnel/ztunnel.sock";
/// The plugin's kubeconfig, written by install-cni into the run directory.
pub const KUBECONFIG_FILE: &str = "istio-cni-kubeconfig";

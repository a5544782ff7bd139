//! The annotation, label and container names Istio's injector, control plane and users put on pods, and the
//! ones this node side writes back. Users set these by hand, so the spelling is the contract.

/// Label on a pod or namespace that selects its data-plane mode (`ambient`, `none`).
pub const DATAPLANE_MODE_LABEL: &str = "istio.io/dataplane-mode";
/// The annotation the injector adds to sidecar pods: such a pod was injected, and is never enrolled in ambient.
pub const SIDECAR_STATUS_ANNOTATION: &str = "sidecar.istio.io/status";
/// Label or annotation that turns injection off for one pod.
pub const SIDECAR_INJECT: &str = "sidecar.istio.io/inject";
/// How inbound traffic reaches a sidecar: `REDIRECT`, `TPROXY` or `NONE`.
pub const INTERCEPTION_MODE: &str = "sidecar.istio.io/interceptionMode";
/// Inbound ports a sidecar captures (`*` or a list).
pub const INCLUDE_INBOUND_PORTS: &str = "traffic.sidecar.istio.io/includeInboundPorts";
/// Inbound ports a sidecar never captures.
pub const EXCLUDE_INBOUND_PORTS: &str = "traffic.sidecar.istio.io/excludeInboundPorts";
/// Outbound ports a sidecar always captures.
pub const INCLUDE_OUTBOUND_PORTS: &str = "traffic.sidecar.istio.io/includeOutboundPorts";
/// Outbound ports a sidecar never captures.
pub const EXCLUDE_OUTBOUND_PORTS: &str = "traffic.sidecar.istio.io/excludeOutboundPorts";
/// Outbound destination ranges a sidecar captures (`*` or a list).
pub const INCLUDE_OUTBOUND_IP_RANGES: &str = "traffic.sidecar.istio.io/includeOutboundIPRanges";
/// Outbound destination ranges a sidecar never captures.
pub const EXCLUDE_OUTBOUND_IP_RANGES: &str = "traffic.sidecar.istio.io/excludeOutboundIPRanges";
/// Interfaces whose traffic a sidecar never captures.
pub const EXCLUDE_INTERFACES: &str = "traffic.sidecar.istio.io/excludeInterfaces";
/// Virtual interfaces (KubeVirt and the like) whose inbound traffic is treated as outbound; sidecar and ambient.
pub const REROUTE_VIRTUAL_INTERFACES: &str = "istio.io/reroute-virtual-interfaces";
/// The older, sidecar-only spelling of [`REROUTE_VIRTUAL_INTERFACES`].
pub const KUBEVIRT_INTERFACES: &str = "traffic.sidecar.istio.io/kubevirtInterfaces";
/// Written by the node agent on an enrolled ambient pod (`enabled`); read by the control plane and proxies.
pub const AMBIENT_REDIRECTION: &str = "ambient.istio.io/redirection";
/// The value of [`AMBIENT_REDIRECTION`] on an enrolled pod.
pub const AMBIENT_REDIRECTION_ENABLED: &str = "enabled";
/// Per-pod override of ambient DNS capture (`true`/`false`).
pub const AMBIENT_DNS_CAPTURE: &str = "ambient.istio.io/dns-capture";
/// Leaves an ambient pod's inbound traffic uncaptured (`true`).
pub const AMBIENT_BYPASS_INBOUND_CAPTURE: &str = "ambient.istio.io/bypass-inbound-capture";
/// The label the repair controller puts on a broken sidecar pod (with value `true`).
pub const BROKEN_POD_LABEL: &str = "cni.istio.io/uninitialized";
/// The injected sidecar container.
pub const PROXY_CONTAINER: &str = "istio-proxy";
/// The [`PROXY_CONTAINER`] field whose uid tells the proxy's own traffic apart (unset or 0: 1337).
pub const PROXY_RUN_AS_USER: &str = "securityContext.runAsUser";
/// The [`PROXY_CONTAINER`] field whose gid tells the proxy's own traffic apart (unset or 0: 1337).
pub const PROXY_RUN_AS_GROUP: &str = "securityContext.runAsGroup";
/// The init container that programs a sidecar's rules when the CNI plugin is not used.
pub const INIT_CONTAINER: &str = "istio-init";
/// The init container that checks, with istio-cni, that the plugin programmed the rules.
pub const VALIDATION_CONTAINER: &str = "istio-validation";
/// The exit code of [`VALIDATION_CONTAINER`] when the rules are missing.
pub const VALIDATION_EXIT_CODE: i32 = 126;
/// The plugin's `type` in a conflist, and its binary's name in the CNI bin dir.
pub const PLUGIN_TYPE: &str = "istio-cni";
/// The DaemonSet that runs install-cni and the node agent.
pub const CNI_DAEMONSET: &str = "istio-cni-node";

//! Istio's node-side contract, spelled once. Everything a user or a peer (Istio's own plugin, ztunnel, the
//! injector, the chart) depends on by number or by name lives here, so the plugin, the node agent, the redirect
//! rules, the node proxy and install-cni cannot drift apart: the proxy's ports, mark and uid, the sockets the
//! plugin and the agent share, the annotation and label names, the default ambient enablement selectors,
//! Istio's sidecar decision over a pod, the checks every value passes before it may reach a rule, and ztunnel's
//! traffic metrics with the workload and canonical service names they carry.

pub mod canonical;
pub mod enablement;
pub mod names;
pub mod paths;
pub mod pod;
pub mod ports;
pub mod proxy;
pub mod sidecar;
pub mod telemetry;
pub mod validate;

//! Test support for the whole workspace: a fake CNI runtime that behaves like libcni, named network
//! namespaces that clean up after themselves, and a small vocabulary ("a node", "a pod", "connect as uid
//! 1337") so end-to-end tests read like what a user would observe.
//!
//! Everything here drives the real kernel and real binaries; it needs root.

pub mod bins;
pub mod chart;
pub mod fake_istiod;
pub mod fleet;
pub mod hbone_proxy;
pub mod hostile_load;
pub mod http;
pub mod install_cni;
pub mod istio_agent;
pub mod istio_install_cni;
pub mod kubelet;
pub mod mesh;
pub mod netns_guard;
pub mod node;
pub mod node_agent;
pub mod pod_process;
pub mod podman;
pub mod real_apiserver;
pub mod real_istiod;
pub mod real_node;
pub mod rule_dump;
pub mod runtime;
pub mod spy;
pub mod tcp;
pub mod wait;

pub use mesh::Cluster;
pub use netns_guard::NetnsGuard;
pub use node::{Node, Pod};
pub use runtime::{NetworkConfigList, PluginError, RawOutput, Runtime, RuntimeConf, RuntimeError};
pub use spy::Spy;

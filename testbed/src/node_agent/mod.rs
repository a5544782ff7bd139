//! Running the real `node-agent` binary on a test node, the way the istio-cni DaemonSet runs it on a real one:
//! inside the node netns (it reaches the fake API server at 127.0.0.1, programs the host probe SNAT there, and
//! its probe ports are private to the node), with the node's run dir shared with the plugin. A [`ZdsPeer`]
//! stands in for the node proxy: it connects to the agent's ZDS socket, records every request with its fds and
//! acks as told. Tests then look at what a user would: CNI results, rules, traffic, annotations, the log.
//!
//! One job a module: [`process`] runs the agent, [`zds_peer`] stands in for the proxy, [`fixtures`] holds the
//! objects and readings tests share, [`pause`] drives the agent's enrollment pause.

mod fixtures;
mod pause;
mod process;
mod zds_peer;

pub use fixtures::{
    ambient_conflist, ambient_pod, crash_looping_pod, namespace, netns_id, redirection, uid, BROKEN_POD_LABEL,
    CONNMARK_RULE, VALIDATION_CONTAINER,
};
pub use pause::EnrollmentPause;
pub use process::{ambient_node, NodeAgent};
pub use zds_peer::{Received, Reply, RequestKind, ZdsPeer};

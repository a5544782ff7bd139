//! Redirect rules for Istio's data plane: a typed rule model ([`model`]), the sidecar rule generator
//! ([`sidecar`]), the iptables-restore renderer ([`iptables`]) and the step that programs a pod netns ([`apply`]).

pub mod apply;
pub mod iptables;
pub mod model;
pub mod sidecar;

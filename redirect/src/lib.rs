//! Redirect rules for Istio's data plane: a typed rule model ([`model`]), the sidecar rule generator
//! ([`sidecar`]), the iptables-restore renderer ([`iptables`]), the step that programs a pod netns with iptables
//! ([`apply`]) and the native nftables backend ([`nft`]); Istio's ambient in-pod rules ([`ambient`]) and the
//! host-netns probe SNAT ([`hostprobe`]).

pub mod ambient;
pub mod apply;
pub mod backend;
pub mod hostprobe;
pub mod iptables;
pub mod model;
pub mod nft;
pub mod sidecar;

mod routing;
mod xtables;

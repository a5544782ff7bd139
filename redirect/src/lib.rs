//! Redirect rules for Istio's data plane: a typed rule model ([`model`]), the sidecar rule generator
//! ([`sidecar`]) and Istio's ambient in-pod rules ([`ambient`]); two backends that program them into a pod's
//! netns, `iptables-restore` ([`iptables`]) and native nftables over netlink ([`nft`]), both followed by the
//! plan's policy routing ([`routing`]); the choice between them ([`backend`]); the host-netns probe SNAT
//! ([`hostprobe`]); and reading back what a netns holds of our rules, for drift repair and `explain`
//! ([`inspect`]).
//!
//! Layering, lowest first (no module imports one above it): `model`; `sidecar`; `routing`; `iptables` and
//! `nft`; `ambient`; `inspect`; `backend`; `hostprobe`.

pub mod ambient;
pub mod backend;
pub mod hostprobe;
pub mod inspect;
pub mod iptables;
pub mod model;
pub mod nft;
pub mod routing;
pub mod sidecar;

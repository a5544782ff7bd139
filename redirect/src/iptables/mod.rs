//! The iptables backend: Istio's rules as `iptables-restore` payloads, fed to the node's flavour of the binaries
//! (legacy or nft) inside a pod's (or the host's) netns.
//!
//! - `render`: a [`RuleSet`](crate::model::RuleSet) as restore text ([`fn@render`], [`render_rule`]);
//! - `restore`: runs `*-restore` and `*-save` with a private xtables lock;
//! - `apply`: programs a sidecar [`Plan`](crate::sidecar::Plan) by replacing whole tables ([`fn@apply`],
//!   [`remove`], [`dump`]);
//! - `chains`: swaps only our chains in tables shared with others (ambient pods, the host probe rule);
//! - `detect`: picks the flavour as Istio does ([`detect_backend`]).

mod apply;
pub(crate) mod chains;
mod detect;
mod error;
mod flavour;
mod render;
pub(crate) mod restore;

pub(crate) use apply::OWNED_TABLES;
pub use apply::{apply, dump, remove};
pub use detect::detect_backend;
pub use error::IptablesError;
pub use flavour::IptablesBackend;
pub use render::{render, render_rule};

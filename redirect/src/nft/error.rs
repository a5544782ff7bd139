//! Errors of the native nftables backend.

use istio_contract::validate::InvalidValue;
use netns::NetnsError;

use crate::routing::RoutingError;

/// Failures of laying out, encoding or committing an nftables transaction.
#[derive(Debug, thiserror::Error)]
pub enum NftError {
    /// Entering the pod's netns failed.
    #[error(transparent)]
    Netns(#[from] NetnsError),
    /// The NETLINK_NETFILTER socket could not be opened or used.
    #[error("nfnetlink socket: {what}: {source}")]
    Socket {
        /// Operation that failed (open, bind, send, receive).
        what: &'static str,
        /// Underlying I/O error.
        source: std::io::Error,
    },
    /// The kernel lacks something the rules need (a module or expression type).
    #[error("kernel does not support {feature} (needed by {object}): {source}")]
    MissingFeature {
        /// The feature, e.g. `tproxy expression (nft_tproxy)`.
        feature: String,
        /// The object the kernel refused, e.g. `rule 3 of inet istio-proxy-mangle istio-tproxy`.
        object: String,
        /// The kernel's errno.
        source: std::io::Error,
    },
    /// The kernel refused an object of the transaction; nothing of the transaction was applied.
    #[error("kernel rejected {object}: {source}")]
    Rejected {
        /// The refused object.
        object: String,
        /// The kernel's errno.
        source: std::io::Error,
    },
    /// The kernel answered without acknowledging every message, so the outcome is unknown.
    #[error("no acknowledgement from the kernel for {object}")]
    MissingAck {
        /// First object without an answer.
        object: String,
    },
    /// A user or group name in an owner match does not resolve on this host.
    #[error("unknown {kind} {name:?} in an owner match")]
    UnknownOwner {
        /// `user` or `group`.
        kind: &'static str,
        /// The name.
        name: String,
    },
    /// A rule of the model has no nftables translation (yet).
    #[error("no nftables translation for {what} (rule in {table} {chain})")]
    Untranslatable {
        /// The match or target.
        what: String,
        /// Table of the rule.
        table: String,
        /// Chain of the rule.
        chain: String,
    },
    /// A rule holds a name outside the allowed set or over its length limit (never truncated, never sent).
    #[error("refusing to encode the rules: {0}")]
    Refused(#[from] InvalidValue),
    /// The rtnetlink step (IPv6 passthrough address, TPROXY policy routing) failed.
    #[error(transparent)]
    Routing(#[from] RoutingError),
}

impl NftError {
    /// Whether the kernel refused an object because it already exists (EEXIST), e.g. a table created by someone
    /// else between listing and committing.
    pub(crate) fn is_already_exists(&self) -> bool {
        matches!(self, NftError::Rejected { source, .. } | NftError::MissingFeature { source, .. }
            if source.raw_os_error() == Some(libc::EEXIST))
    }
}

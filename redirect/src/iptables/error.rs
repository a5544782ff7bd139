//! Errors of the iptables backend.

use std::process::ExitStatus;

use istio_contract::validate::InvalidValue;
use netns::NetnsError;

use crate::model::Family;
use crate::routing::RoutingError;

/// Failures of backend detection and of programming a netns with iptables.
#[derive(Debug, thiserror::Error)]
pub enum IptablesError {
    /// An iptables binary ran and failed; carries what the plugin needs to report.
    #[error("{binary} ({family}) failed with {status}: {stderr}")]
    Command {
        /// Binary that failed (e.g. `iptables-nft-restore`).
        binary: String,
        /// Address family it was programming.
        family: Family,
        /// Exit status.
        status: ExitStatus,
        /// Its standard error, trimmed.
        stderr: String,
    },
    /// An iptables binary could not be started or fed.
    #[error("run {binary}: {source}")]
    Spawn {
        /// Binary that could not be run.
        binary: String,
        /// Underlying I/O error.
        source: std::io::Error,
    },
    /// Entering the pod's netns failed.
    #[error(transparent)]
    Netns(#[from] NetnsError),
    /// The private xtables lock directory could not be created.
    #[error("{what}: {source}")]
    Setup {
        /// What was being set up.
        what: String,
        /// Underlying I/O error.
        source: std::io::Error,
    },
    /// `FORCE_IPTABLES_BINARY` names something we do not know.
    #[error("unsupported FORCE_IPTABLES_BINARY value {0:?} (want iptables, iptables-legacy or iptables-nft)")]
    UnknownForcedBinary(String),
    /// A rule holds a name that is not one plain word for `iptables-restore` (never rendered, never truncated).
    #[error("refusing to render the rules: {0}")]
    Refused(#[from] InvalidValue),
    /// The policy-routing step after the rules (IPv6 passthrough address, TPROXY or connmark routing) failed.
    #[error(transparent)]
    Routing(#[from] RoutingError),
}

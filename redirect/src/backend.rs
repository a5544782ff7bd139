//! The one choice every caller makes: which backend programs a pod's rules, and what else the host runs.
//!
//! Native nftables (over netlink) when asked for; otherwise iptables, legacy or nft, picked as Istio picks it.

use std::fmt;

use netns::Netns;

use crate::ambient::{self, AmbientPlan};
use crate::inspect::{self, RuleReport};
use crate::iptables::{self, IptablesBackend, IptablesError};
use crate::nft::uapi::netfilter::{NFPROTO_INET, NFPROTO_IPV4, NFPROTO_IPV6};
use crate::nft::{self, NftError};
use crate::sidecar::Plan;

/// A backend that can program a [`Plan`] into a netns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// `iptables-restore` of the given flavour.
    Iptables(IptablesBackend),
    /// Native nftables over netlink: no binary at all.
    Nftables,
}

/// Why programming failed, whichever backend ran.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// The iptables backend failed.
    #[error(transparent)]
    Iptables(#[from] IptablesError),
    /// The nftables backend failed.
    #[error(transparent)]
    Nftables(#[from] NftError),
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Backend::Iptables(IptablesBackend::Legacy) => "iptables-legacy",
            Backend::Iptables(IptablesBackend::Nft) => "iptables-nft",
            Backend::Nftables => "nftables",
        })
    }
}

impl Backend {
    /// `native_nftables` selects nftables; otherwise iptables with `force` (`FORCE_IPTABLES_BINARY`) or detection.
    pub fn select(native_nftables: bool, force: Option<&str>) -> Result<Backend, IptablesError> {
        if native_nftables {
            return Ok(Backend::Nftables);
        }
        iptables::detect_backend(force).map(Backend::Iptables)
    }

    /// Programs `plan` into `netns` atomically (per family for iptables, one transaction for nftables).
    pub fn apply(self, netns: &Netns, plan: &Plan) -> Result<(), BackendError> {
        match self {
            Backend::Iptables(b) => Ok(iptables::apply(netns, plan, b)?),
            Backend::Nftables => Ok(nft::apply(netns, plan)?),
        }
    }

    /// Programs a sidecar pod's `plan` into `netns` all or nothing: on failure the partial rules are removed, so the
    /// next attempt (the kubelet's retry of ADD, the agent's next repair) starts from a clean slate.
    pub fn program(self, netns: &Netns, plan: &Plan) -> Result<(), BackendError> {
        let applied = self.apply(netns, plan);
        if applied.is_err() {
            if let Err(cleanup) = self.remove(netns) {
                tracing::error!(error = %cleanup, backend = %self, "could not remove partial rules");
            }
        }
        applied
    }

    /// Programs the ambient in-pod `plan` into `netns` (per family for iptables, one transaction for
    /// nftables), with its connmark routing. Idempotent.
    pub fn apply_ambient(self, netns: &Netns, plan: &AmbientPlan) -> Result<(), BackendError> {
        match self {
            Backend::Iptables(b) => Ok(ambient::apply_iptables(netns, plan, b)?),
            Backend::Nftables => Ok(ambient::apply_nftables(netns, plan)?),
        }
    }

    /// Removes the ambient in-pod rules and routing this backend programs from `netns`, and nothing else.
    pub fn remove_ambient(self, netns: &Netns) -> Result<(), BackendError> {
        match self {
            Backend::Iptables(b) => Ok(ambient::remove_iptables(netns, b)?),
            Backend::Nftables => Ok(ambient::remove_nftables(netns)?),
        }
    }

    /// Reads the ambient in-pod rules in `netns` and compares them with `plan` (the rules [`Backend::apply_ambient`]
    /// programs): one `iptables-save` per family of the plan, or one nftables rule dump. Drift repair and
    /// `explain` use it; it changes nothing.
    pub fn inspect_ambient(self, netns: &Netns, plan: &AmbientPlan) -> Result<RuleReport, BackendError> {
        let mut report = match self {
            Backend::Iptables(b) => inspect::ambient_iptables(netns, plan, b)?,
            Backend::Nftables => inspect::ambient_nftables(netns, plan)?,
        };
        report.backend = self.to_string();
        Ok(report)
    }

    /// Reads a sidecar pod's rules in `netns` and compares them with `plan` (the rules [`Backend::program`]
    /// programs): every rule of the tables the sidecar owns, so anyone else's rule there shows as unexpected.
    pub fn inspect_sidecar(self, netns: &Netns, plan: &Plan) -> Result<RuleReport, BackendError> {
        let mut report = match self {
            Backend::Iptables(b) => inspect::sidecar_iptables(netns, plan, b)?,
            Backend::Nftables => inspect::sidecar_nftables(netns, plan)?,
        };
        report.backend = self.to_string();
        Ok(report)
    }

    /// Removes everything this backend programs from `netns`.
    pub fn remove(self, netns: &Netns) -> Result<(), BackendError> {
        match self {
            Backend::Iptables(b) => Ok(iptables::remove(netns, b)?),
            Backend::Nftables => Ok(nft::remove(netns)?),
        }
    }
}

/// Which packet-filter backends hold tables in the calling thread's netns (the host's, for the plugin). Two at
/// once is a known source of silent bypass: rules in one are invisible to tools of the other.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostBackends {
    /// x_tables tables of iptables-legacy (from `/proc/net/ip{,6}_tables_names`).
    pub legacy: Vec<String>,
    /// nf_tables tables that iptables-nft manages (`ip`/`ip6` `filter`, `nat`, `mangle`, `raw`, `security`).
    pub iptables_nft: Vec<String>,
    /// Other nf_tables tables (native nftables users such as kube-proxy's nftables mode).
    pub nftables: Vec<String>,
}

/// The table names iptables-nft creates.
const XTABLES_NAMES: [&str; 5] = ["filter", "nat", "mangle", "raw", "security"];

impl HostBackends {
    /// Reads the current netns: two small /proc files and one netlink dump, no exec.
    pub fn probe() -> Result<HostBackends, NftError> {
        let mut found = HostBackends::default();
        for (file, family) in [("/proc/net/ip_tables_names", "ip"), ("/proc/net/ip6_tables_names", "ip6")] {
            let names = std::fs::read_to_string(file).unwrap_or_default();
            found.legacy.extend(names.split_whitespace().map(|t| format!("{family} {t}")));
        }
        for t in nft::tables(&Netns::current()?)? {
            let family = match t.family {
                NFPROTO_IPV4 => "ip",
                NFPROTO_IPV6 => "ip6",
                NFPROTO_INET => "inet",
                _ => "other",
            };
            let name = format!("{family} {}", t.name);
            if matches!(t.family, NFPROTO_IPV4 | NFPROTO_IPV6) && XTABLES_NAMES.contains(&t.name.as_str()) {
                found.iptables_nft.push(name);
            } else {
                found.nftables.push(name);
            }
        }
        Ok(found)
    }

    /// Tables of the other kernel subsystem than `chosen` uses (x_tables for legacy, nf_tables otherwise), for a
    /// warning; empty when there is no mix. iptables-nft and native nftables share nf_tables, so `nft list
    /// ruleset` shows both and they do not hide each other.
    pub fn others(&self, chosen: Backend) -> Vec<(&'static str, &[String])> {
        let candidates: Vec<(&'static str, &[String])> = match chosen {
            Backend::Iptables(IptablesBackend::Legacy) => {
                vec![("iptables-nft", &self.iptables_nft), ("nftables", &self.nftables)]
            }
            _ => vec![("iptables-legacy", &self.legacy)],
        };
        candidates.into_iter().filter(|(_, tables)| !tables.is_empty()).collect()
    }
}

/// Logs a warning for every table of the other kernel subsystem the host holds (see [`HostBackends::others`]);
/// called by the plugin and the agent after choosing `chosen`.
pub fn warn_if_mixed(chosen: Backend) {
    match HostBackends::probe() {
        Ok(host) => {
            for (other, tables) in host.others(chosen) {
                tracing::warn!(%chosen, %other, ?tables, "the host also has rules in another packet-filter backend");
            }
        }
        Err(e) => tracing::debug!(error = %e, "cannot list the host's packet-filter tables"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn others_lists_the_other_kernel_subsystem_only() {
        let h = HostBackends { legacy: vec!["ip nat".into()], iptables_nft: vec![], nftables: vec!["inet x".into()] };
        let names = |b| h.others(b).into_iter().map(|(n, _)| n).collect::<Vec<_>>();
        assert_eq!(names(Backend::Nftables), ["iptables-legacy"]);
        assert_eq!(names(Backend::Iptables(IptablesBackend::Nft)), ["iptables-legacy"]);
        assert_eq!(names(Backend::Iptables(IptablesBackend::Legacy)), ["nftables"]);
        assert!(HostBackends::default().others(Backend::Nftables).is_empty());
    }

    #[test]
    fn native_nftables_needs_no_detection() {
        assert_eq!(Backend::select(true, Some("bogus")).unwrap(), Backend::Nftables);
        assert_eq!(
            Backend::select(false, Some("iptables-legacy")).unwrap(),
            Backend::Iptables(IptablesBackend::Legacy)
        );
        assert!(Backend::select(false, Some("bogus")).is_err());
    }
}

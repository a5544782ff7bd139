//! Host-probe SNAT: in the HOST netns, locally originated TCP to an enrolled ambient pod gets the source
//! 169.254.7.127 (v6: the v6 probe address). Pods accept that source without redirection, so kubelet probes
//! keep working once the pod's traffic goes through the node proxy.
//!
//! Enrolled pod IPs live in a set named as Istio names it (`istio-inpod-probes-v4` / `-v6`), each entry
//! commented with the pod UID: an ipset plus a nat POSTROUTING rule for iptables, a named set in the
//! `istio-ambient-nat` table for nftables. Entries are matched by IP *and* UID, so when an IP is reused by a new
//! pod, removing the old pod does not remove the new pod's entry.

mod ipset;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};

use netns::{Netns, NetnsError};

pub use ipset::IpsetError;

use crate::backend::Backend;
use crate::inspect::{self, RuleReport};
use crate::iptables::{chains, IptablesError};
use crate::model::{Family, Match, Protocol, Rule, RuleSet, Table, Target};
use crate::nft::layout::{BaseChain, Hook, NftChain};
use crate::nft::set::{self, AddrSet, Element};
use crate::nft::stmt::{AddrField, Stmt};
use crate::nft::NftError;
use istio_contract::proxy::{PROBE_SNAT_V4, PROBE_SNAT_V6};

/// Set name prefix Istio uses (`-v4` / `-v6` appended).
pub const SET_PREFIX: &str = "istio-inpod-probes";
/// The iptables nat chain jumped to from POSTROUTING.
pub const CHAIN: &str = "ISTIO_POSTRT";
/// The nftables table holding the sets and the postrouting chain.
pub const NFT_TABLE: &str = "istio-ambient-nat";
/// The nftables probe sets' comment, Istio's words.
const SET_COMMENT: &str = "UUID of the pods that are part of ambient mesh";

/// Name of the set of `family`.
pub fn set_name(family: Family) -> String {
    match family {
        Family::V4 => format!("{SET_PREFIX}-v4"),
        Family::V6 => format!("{SET_PREFIX}-v6"),
    }
}

/// Settings of the host-probe rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostProbeConfig {
    /// IPv4 SNAT source.
    pub snat_v4: Ipv4Addr,
    /// IPv6 SNAT source.
    pub snat_v6: Ipv6Addr,
    /// Also handle IPv6 pod addresses.
    pub enable_ipv6: bool,
    /// nftables only: the kubelet's uid; Istio's nftables rule matches probe sockets by owner
    /// (`meta skuid`), while its iptables rule matches any local socket (`-m owner --socket-exists`).
    pub kubelet_uid: u32,
}

impl Default for HostProbeConfig {
    /// Istio's probe addresses, IPv4 only; `kubelet_uid` is root's until the caller sets the one
    /// [`find_kubelet_uid`] finds (the node agent refuses to start in nftables mode without it).
    fn default() -> Self {
        Self { snat_v4: PROBE_SNAT_V4, snat_v6: PROBE_SNAT_V6, enable_ipv6: false, kubelet_uid: 0 }
    }
}

impl HostProbeConfig {
    fn families(&self) -> Vec<Family> {
        if self.enable_ipv6 {
            vec![Family::V4, Family::V6]
        } else {
            vec![Family::V4]
        }
    }

    fn snat(&self, family: Family) -> IpAddr {
        match family {
            Family::V4 => IpAddr::V4(self.snat_v4),
            Family::V6 => IpAddr::V6(self.snat_v6),
        }
    }
}

/// The iptables rules of `family` (Istio's hostprobe payload): `-I POSTROUTING 1 -j ISTIO_POSTRT` and the SNAT.
pub fn iptables_rules(cfg: &HostProbeConfig, family: Family) -> RuleSet {
    let snat = Rule::append(
        CHAIN,
        vec![Match::SocketExists, Match::Protocol(Protocol::Tcp), Match::DestinationInSet(set_name(family))],
        Target::Snat(cfg.snat(family)),
    );
    let jump = Rule::insert("POSTROUTING", 1, vec![], Target::Jump(CHAIN.into()));
    RuleSet::from_rules(family, vec![(Table::Nat, jump), (Table::Nat, snat)])
}

/// The nftables base chain of the host-probe rules (nat postrouting, priority 100).
pub fn nft_chain() -> NftChain {
    NftChain { name: Hook::Postrouting.name().into(), base: Some(BaseChain::istio(Table::Nat, Hook::Postrouting)) }
}

/// The nftables rules (Istio's hostprobe transaction): `meta l4proto tcp skuid UID ip daddr @SET counter snat`.
pub fn nft_rules(cfg: &HostProbeConfig) -> Vec<Vec<Stmt>> {
    cfg.families()
        .into_iter()
        .map(|family| {
            vec![
                Stmt::L4proto(Protocol::Tcp),
                Stmt::SkUid { id: crate::model::OwnerId::Id(cfg.kubelet_uid), negate: false },
                Stmt::AddrInSet { field: AddrField::Daddr, family, set: set_name(family) },
                Stmt::Counter,
                Stmt::Snat(cfg.snat(family)),
            ]
        })
        .collect()
}

/// The processes that host the kubelet, in Istio's order of preference: the process name (`/proc/<pid>/comm`)
/// and whether its command line must mention `kubelet` (MicroK8s' `kubelite` does; k3s embeds the kubelet
/// without saying so).
const KUBELET_PROCESSES: [(&str, bool); 3] = [("kubelet", true), ("kubelite", true), ("k3s", false)];

/// Why the kubelet's uid could not be found.
#[derive(Debug, thiserror::Error)]
pub enum KubeletUidError {
    /// The proc directory could not be listed.
    #[error("listing processes in {}: {source}", proc.display())]
    Proc {
        /// The proc directory (`HOST_PROC`).
        proc: PathBuf,
        /// What failed.
        source: std::io::Error,
    },
    /// No process there hosts the kubelet.
    #[error("no kubelet process in {}: looked for a process named {}", proc.display(), kubelet_processes())]
    NotFound {
        /// The proc directory (`HOST_PROC`).
        proc: PathBuf,
    },
}

/// [`KUBELET_PROCESSES`] in words, for the error.
fn kubelet_processes() -> String {
    let describe = |&(name, cmdline): &(&str, bool)| match cmdline {
        true => format!("`{name}` whose command line mentions kubelet"),
        false => format!("`{name}`"),
    };
    KUBELET_PROCESSES.iter().map(describe).collect::<Vec<_>>().join(", or ")
}

/// The kubelet's uid as Istio's nftables mode finds it: the real uid of the first process named `kubelet` or
/// `kubelite` whose command line mentions kubelet, or `k3s`, under `proc` (the host's `/proc`). The nftables
/// host probe rule matches that uid (`meta skuid`), so without it there is no rule to program.
pub fn find_kubelet_uid(proc: &Path) -> Result<u32, KubeletUidError> {
    let entries = std::fs::read_dir(proc).map_err(|source| KubeletUidError::Proc { proc: proc.into(), source })?;
    let mut pids: Vec<u32> = entries.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok()).collect();
    pids.sort_unstable();
    for (name, needs_cmdline) in KUBELET_PROCESSES {
        for pid in &pids {
            let dir = proc.join(pid.to_string());
            // A process that exits meanwhile reads as empty and is skipped.
            let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
            if comm.trim_end_matches('\n') != name {
                continue;
            }
            let cmdline = std::fs::read(dir.join("cmdline")).unwrap_or_default();
            if needs_cmdline && !String::from_utf8_lossy(&cmdline).to_lowercase().contains("kubelet") {
                continue;
            }
            let status = std::fs::read_to_string(dir.join("status")).unwrap_or_default();
            let uid = status.lines().find_map(|l| l.strip_prefix("Uid:")?.split_whitespace().next()?.parse().ok());
            if let Some(uid) = uid {
                return Ok(uid);
            }
        }
    }
    Err(KubeletUidError::NotFound { proc: proc.into() })
}

/// Failures of the host-probe rules and sets.
#[derive(Debug, thiserror::Error)]
pub enum HostProbeError {
    /// Entering the host netns failed.
    #[error(transparent)]
    Netns(#[from] NetnsError),
    /// Programming the iptables rule failed.
    #[error("host probe iptables rule: {0}")]
    Iptables(#[from] IptablesError),
    /// An ipset request failed.
    #[error("host probe set: {0}")]
    Ipset(#[from] IpsetError),
    /// An nftables request failed.
    #[error("host probe nftables: {0}")]
    Nftables(#[from] NftError),
    /// IPv6 address given while IPv6 is off.
    #[error("{0} is IPv6 but the host probe rules are IPv4-only")]
    Ipv6Disabled(IpAddr),
}

/// One entry of the probe sets: a pod IP and the UID of the pod that owns it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct ProbeEntry {
    /// Pod IP.
    pub ip: IpAddr,
    /// Pod UID (the entry comment); `None` for an entry someone added without one.
    pub pod_uid: Option<String>,
}

/// The host-probe SNAT of one host netns and backend.
#[derive(Debug)]
pub struct HostProbe {
    netns: Netns,
    backend: Backend,
    cfg: HostProbeConfig,
}

impl HostProbe {
    /// Creates the sets (keeping their entries) and (re)programs the SNAT rule in `netns`. Idempotent.
    pub fn ensure(netns: Netns, backend: Backend, cfg: HostProbeConfig) -> Result<Self, HostProbeError> {
        let probe = Self { netns, backend, cfg };
        probe.reensure()?;
        Ok(probe)
    }

    /// Programs the sets and the SNAT rule again, as [`HostProbe::ensure`] did (the sets keep their entries):
    /// repairs a rule someone flushed. Idempotent.
    pub fn reensure(&self) -> Result<(), HostProbeError> {
        let (backend, cfg) = (self.backend, &self.cfg);
        let families = cfg.families();
        self.netns.run(|| -> Result<(), HostProbeError> {
            match backend {
                Backend::Iptables(b) => {
                    for &family in &families {
                        ipset::create(&set_name(family), family)?;
                        chains::program(b, family, Some(&iptables_rules(cfg, family)), &[(Table::Nat, &[CHAIN])])?;
                    }
                }
                Backend::Nftables => {
                    let sets: Vec<AddrSet> = families
                        .iter()
                        .map(|&family| AddrSet { name: set_name(family), family, comment: Some(SET_COMMENT.into()) })
                        .collect();
                    set::ensure(NFT_TABLE, &sets, &nft_chain(), &nft_rules(cfg))?;
                }
            }
            Ok(())
        })?
    }

    /// Whether the probe set holds ip `ip`, the kind of address the sets take (IPv4, or IPv6 when enabled);
    /// other addresses are never added, so they do not count as missing.
    pub fn covers(&self, ip: IpAddr) -> bool {
        self.family_of(ip).is_ok()
    }

    /// Removes the rule and the sets from the host netns (iptables: our chain and jump, and the ipsets;
    /// nftables: the `istio-ambient-nat` table).
    pub fn delete(self) -> Result<(), HostProbeError> {
        let (backend, families) = (self.backend, self.cfg.families());
        self.netns.run(|| -> Result<(), HostProbeError> {
            match backend {
                Backend::Iptables(b) => {
                    for &family in &families {
                        chains::program(b, family, None, &[(Table::Nat, &[CHAIN])])?;
                        ipset::destroy(&set_name(family))?;
                    }
                }
                Backend::Nftables => {
                    let empty = crate::nft::layout::NftLayout { tables: Vec::new() };
                    crate::nft::replace_tables(&Netns::current()?, crate::ambient::NFT_PREFIX, &empty)?;
                }
            }
            Ok(())
        })?
    }

    fn family_of(&self, ip: IpAddr) -> Result<Family, HostProbeError> {
        match ip {
            IpAddr::V4(_) => Ok(Family::V4),
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(_) => Ok(Family::V4),
                None if self.cfg.enable_ipv6 => Ok(Family::V6),
                None => Err(HostProbeError::Ipv6Disabled(ip)),
            },
        }
    }

    /// Adds `ips` of pod `pod_uid`. An IP another pod had is taken over (its entry now names `pod_uid`).
    pub fn add(&self, pod_uid: &str, ips: &[IpAddr]) -> Result<(), HostProbeError> {
        let ips: Vec<(IpAddr, Family)> = ips
            .iter()
            .map(|ip| Ok((ip.to_canonical(), self.family_of(*ip)?)))
            .collect::<Result<_, HostProbeError>>()?;
        let backend = self.backend;
        self.netns.run(|| -> Result<(), HostProbeError> {
            for family in self.cfg.families() {
                let mine: Vec<IpAddr> = ips.iter().filter(|(_, f)| *f == family).map(|(ip, _)| *ip).collect();
                if mine.is_empty() {
                    continue;
                }
                let name = set_name(family);
                match backend {
                    Backend::Iptables(_) => {
                        for ip in &mine {
                            ipset::add(&name, *ip, pod_uid)?;
                        }
                    }
                    Backend::Nftables => {
                        let new: Vec<Element> =
                            mine.iter().map(|ip| Element { addr: *ip, comment: Some(pod_uid.to_string()) }).collect();
                        // Each address is looked up by itself (`get element`, never the whole set): then only
                        // the missing ones are created, and an address another pod had (reused) is taken over.
                        // Nothing here grows with the pods already on the node (#31), and a pod added again (the
                        // agent's restart) changes nothing: a create the kernel refuses (EEXIST) aborts the
                        // transaction, and an abort or a delete costs an RCU grace period (about 13 ms), so
                        // neither happens on the common paths.
                        let mut stale = Vec::new();
                        let mut missing = Vec::new();
                        for e in &new {
                            match set::element_of(NFT_TABLE, &name, e.addr)? {
                                None => missing.push(e.clone()),
                                Some(old) if old.comment.as_deref() != Some(pod_uid) => {
                                    stale.push(old);
                                    missing.push(e.clone());
                                }
                                Some(_) => {}
                            }
                        }
                        if stale.is_empty() {
                            match set::create(NFT_TABLE, &name, &missing) {
                                Ok(()) => continue,
                                // Another writer added one of them meanwhile: take it over below.
                                Err(e) if e.is_already_exists() => {}
                                Err(e) => return Err(e.into()),
                            }
                            stale = missing
                                .iter()
                                .filter_map(|e| set::element_of(NFT_TABLE, &name, e.addr).transpose())
                                .collect::<Result<Vec<_>, _>>()?
                                .into_iter()
                                .filter(|old| old.comment.as_deref() != Some(pod_uid))
                                .collect();
                        }
                        set::change(NFT_TABLE, &name, &stale, &missing)?;
                    }
                }
            }
            Ok(())
        })?
    }

    /// Removes the entries of `ips` that belong to pod `pod_uid`; an entry of the same IP owned by another pod
    /// (the IP was reused) stays.
    pub fn remove(&self, pod_uid: &str, ips: &[IpAddr]) -> Result<(), HostProbeError> {
        let ips: Vec<IpAddr> = ips.iter().map(|ip| ip.to_canonical()).collect();
        let theirs: Vec<ProbeEntry> = match self.backend {
            // ipset has no lookup that returns an entry's comment: the set is listed.
            Backend::Iptables(_) => self
                .entries()?
                .into_iter()
                .filter(|e| ips.contains(&e.ip) && e.pod_uid.as_deref() == Some(pod_uid))
                .collect(),
            // Each address looked up by itself: the cost does not grow with the pods on the node (#31).
            Backend::Nftables => {
                let families: Vec<(IpAddr, Family)> =
                    ips.iter().filter_map(|ip| Some((*ip, self.family_of(*ip).ok()?))).collect();
                self.netns.run(|| -> Result<Vec<ProbeEntry>, HostProbeError> {
                    let mut theirs = Vec::new();
                    for (ip, family) in families {
                        if let Some(e) = set::element_of(NFT_TABLE, &set_name(family), ip)? {
                            if e.comment.as_deref() == Some(pod_uid) {
                                theirs.push(ProbeEntry { ip, pod_uid: e.comment });
                            }
                        }
                    }
                    Ok(theirs)
                })??
            }
        };
        let backend = self.backend;
        self.netns.run(|| -> Result<(), HostProbeError> {
            for e in &theirs {
                let name = set_name(if e.ip.is_ipv4() { Family::V4 } else { Family::V6 });
                match backend {
                    Backend::Iptables(_) => ipset::del(&name, e.ip)?,
                    Backend::Nftables => {
                        let elem = Element { addr: e.ip, comment: None };
                        set::change(NFT_TABLE, &name, &[elem], &[])?
                    }
                }
            }
            Ok(())
        })?
    }

    /// Reads the SNAT rule (and, for iptables, the jump into its chain) in the host netns and compares it with
    /// what [`HostProbe::ensure`] programs, so a flushed rule can be noticed and re-ensured. The set entries are
    /// not part of it (see [`HostProbe::entries`]).
    pub fn inspect(&self) -> Result<RuleReport, HostProbeError> {
        let mut report = match self.backend {
            Backend::Iptables(b) => {
                let rules: Vec<RuleSet> =
                    self.cfg.families().into_iter().map(|f| iptables_rules(&self.cfg, f)).collect();
                let families: Vec<(Family, &RuleSet)> = rules.iter().map(|rs| (rs.family, rs)).collect();
                inspect::chains_iptables(&self.netns, b, &families, &[(Table::Nat, &[CHAIN])])?
            }
            Backend::Nftables => {
                let expected = inspect::expected_nft_chain(NFT_TABLE, &nft_chain().name, &nft_rules(&self.cfg));
                inspect::report_nft(&self.netns, expected, &[NFT_TABLE.to_string()])?
            }
        };
        report.backend = self.backend.to_string();
        Ok(report)
    }

    /// Every entry of the probe sets, sorted.
    pub fn entries(&self) -> Result<Vec<ProbeEntry>, HostProbeError> {
        let backend = self.backend;
        let mut out = self.netns.run(|| -> Result<Vec<ProbeEntry>, HostProbeError> {
            let mut out = Vec::new();
            for family in self.cfg.families() {
                let name = set_name(family);
                match backend {
                    Backend::Iptables(_) => {
                        out.extend(ipset::list(&name)?.into_iter().map(|(ip, pod_uid)| ProbeEntry { ip, pod_uid }))
                    }
                    Backend::Nftables => out.extend(
                        set::elements(NFT_TABLE, &name)?
                            .unwrap_or_default()
                            .into_iter()
                            .map(|e| ProbeEntry { ip: e.addr, pod_uid: e.comment }),
                    ),
                }
            }
            Ok(out)
        })??;
        out.sort();
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake `/proc/<pid>` with `comm`, `cmdline` (NUL-separated) and the `Uid:` line of `status`.
    fn process(proc: &Path, pid: u32, comm: &str, cmdline: &[&str], uid: u32) {
        let dir = proc.join(pid.to_string());
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("comm"), format!("{comm}\n")).unwrap();
        std::fs::write(dir.join("cmdline"), cmdline.iter().map(|a| format!("{a}\0")).collect::<String>()).unwrap();
        std::fs::write(dir.join("status"), format!("Name:\t{comm}\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n")).unwrap();
    }

    #[test]
    fn the_kubelet_kubelite_or_k3s_gives_its_uid_in_that_order() {
        let proc = tempfile::tempdir().unwrap();
        process(proc.path(), 7, "k3s", &["k3s", "agent"], 300);
        assert_eq!(find_kubelet_uid(proc.path()).unwrap(), 300);
        process(proc.path(), 9, "kubelite", &["/snap/microk8s/current/bin/kubelite", "--kubelet-args-file=x"], 200);
        assert_eq!(find_kubelet_uid(proc.path()).unwrap(), 200);
        process(proc.path(), 11, "kubelet", &["/usr/bin/kubelet", "--config=/var/lib/kubelet/config.yaml"], 100);
        assert_eq!(find_kubelet_uid(proc.path()).unwrap(), 100);
    }

    #[test]
    fn a_process_merely_named_kubelet_does_not_count_and_none_is_an_error_naming_what_and_where() {
        let proc = tempfile::tempdir().unwrap();
        process(proc.path(), 5, "kubelet", &["/usr/bin/sleep", "600"], 100);
        process(proc.path(), 6, "sleep", &["/usr/bin/kubelet"], 100);
        let err = find_kubelet_uid(proc.path()).unwrap_err();
        assert!(matches!(err, KubeletUidError::NotFound { .. }), "{err}");
        let text = err.to_string();
        for part in [proc.path().to_str().unwrap(), "`kubelet`", "`kubelite`", "`k3s`"] {
            assert!(text.contains(part), "{text} names {part}");
        }
        let missing = proc.path().join("missing");
        assert!(matches!(find_kubelet_uid(&missing), Err(KubeletUidError::Proc { .. })));
    }
}

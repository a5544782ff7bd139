//! Istio's ambient in-pod redirection: the rules the node agent programs inside an enrolled pod's netns, so the
//! node proxy (ztunnel) gets the pod's inbound and outbound TCP (and DNS), plus the connmark policy routing
//! that brings the proxy's replies back through it.
//!
//! [`build`] reproduces the rule order of Istio's generator exactly: the goldens pin it and, in iptables,
//! order is semantics.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;
use istio_contract::ports;
use istio_contract::proxy::{PROBE_SNAT_V4, PROBE_SNAT_V6, PROXY_MARK};
use netns::Netns;

use crate::iptables::{self, IptablesBackend, IptablesError};
use crate::model::{Family, Match, Protocol, RedirectSpelling, Rule, RuleSet, Table, Target};
use crate::nft::layout::NftLayout;
use crate::nft::{self, NftError};
use crate::routing::{self, FwmarkRule};

/// Istio-owned chains of the in-pod rules (in mangle, nat and raw).
pub mod chains {
    /// Prerouting chain.
    pub const PRERT: &str = "ISTIO_PRERT";
    /// Output chain.
    pub const OUTPUT: &str = "ISTIO_OUTPUT";
}

/// Mask of the marks shared with ztunnel.
pub const MARK_MASK: u32 = 0xfff;
/// Connection mark of connections ztunnel's packets created; their replies are routed to it via table 100.
pub const CONNMARK: u32 = 0x111;
/// Routing table with the `local default` route of connmarked replies.
pub const ROUTE_TABLE: u32 = 100;
/// Priority of the `fwmark 0x111/0xfff lookup 100` rule, as Istio installs it.
pub const RULE_PRIORITY: u32 = 32764;
/// Conntrack zone that keeps DNS to and from the proxy apart from the pod's own DNS flows.
pub const DNS_CT_ZONE: u16 = 1;
/// nftables table prefix of the in-pod rules (`istio-ambient-nat`, ...).
pub const NFT_PREFIX: &str = "istio-ambient";

/// Per-pod inputs of the in-pod rules (agent settings merged with the pod's annotations).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InpodConfig {
    /// Redirect DNS (UDP and TCP port 53) to ztunnel (`AMBIENT_DNS_CAPTURE`, `ambient.istio.io/dns-capture`).
    pub dns_capture: bool,
    /// Ingress mode: inbound is not captured (`ambient.istio.io/bypass-inbound-capture`).
    pub ingress_mode: bool,
    /// Interfaces whose inbound TCP is treated as outbound (`istio.io/reroute-virtual-interfaces`).
    pub virtual_interfaces: Vec<String>,
    /// Also program IPv6 (`AMBIENT_IPV6`).
    pub enable_ipv6: bool,
    /// IPv4 source of host probes; accepted without redirection.
    pub probe_snat_v4: Ipv4Addr,
    /// IPv6 source of host probes.
    pub probe_snat_v6: Ipv6Addr,
}

impl Default for InpodConfig {
    /// Istio's defaults: DNS capture on, IPv6 off, no overrides.
    fn default() -> Self {
        Self {
            dns_capture: true,
            ingress_mode: false,
            virtual_interfaces: Vec::new(),
            enable_ipv6: false,
            probe_snat_v4: PROBE_SNAT_V4,
            probe_snat_v6: PROBE_SNAT_V6,
        }
    }
}

/// Policy routing of connmarked replies: `ip rule add fwmark MARK/MASK pref PRIORITY lookup TABLE` and
/// `ip route add local default dev lo table TABLE`, per family of the plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnmarkRoutes {
    /// Firewall mark.
    pub mark: u32,
    /// Mask of the firewall mark.
    pub mask: u32,
    /// Routing table.
    pub table: u32,
    /// Rule priority.
    pub priority: u32,
}

impl Default for ConnmarkRoutes {
    fn default() -> Self {
        Self { mark: CONNMARK, mask: MARK_MASK, table: ROUTE_TABLE, priority: RULE_PRIORITY }
    }
}

impl ConnmarkRoutes {
    /// The routing rule as the routing step takes it.
    pub(crate) fn fwmark_rule(self) -> FwmarkRule {
        FwmarkRule { mark: self.mark, mask: Some(self.mask), priority: Some(self.priority), table: self.table }
    }
}

/// Everything programmed into an ambient pod: rules per family and the policy routing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AmbientPlan {
    /// IPv4 rules.
    pub v4: RuleSet,
    /// IPv6 rules, present iff IPv6 is enabled.
    pub v6: Option<RuleSet>,
    /// Connmark policy routing (for every family of the plan).
    pub routes: ConnmarkRoutes,
}

impl AmbientPlan {
    /// The families the plan programs.
    pub fn families(&self) -> Vec<Family> {
        if self.v6.is_some() {
            vec![Family::V4, Family::V6]
        } else {
            vec![Family::V4]
        }
    }
}

/// Builds the in-pod rules for `cfg` in Istio's order.
pub fn build(cfg: &InpodConfig) -> AmbientPlan {
    let v4 = family_rules(cfg, Family::V4, IpAddr::V4(cfg.probe_snat_v4), "127.0.0.1/32");
    let v6 = cfg.enable_ipv6.then(|| family_rules(cfg, Family::V6, IpAddr::V6(cfg.probe_snat_v6), "::1/128"));
    AmbientPlan { v4, v6, routes: ConnmarkRoutes::default() }
}

fn mark(value: u32, negate: bool) -> Match {
    Match::Mark { value, mask: Some(MARK_MASK), negate }
}

fn redirect(port: u16, spelling: RedirectSpelling) -> Target {
    Target::Redirect { port, spelling }
}

fn family_rules(cfg: &InpodConfig, family: Family, probe_src: IpAddr, loopback: &str) -> RuleSet {
    use chains::{OUTPUT, PRERT};
    use Protocol::{Tcp, Udp};
    use RedirectSpelling::{ToPort, ToPorts};

    let lo: IpNet = loopback.parse().expect("loopback cidr");
    let not_lo = || Match::Destination { net: lo, negate: true };
    // Jumps from the built-in chains.
    let jump = |chain: &str, to: &str| Rule::append(chain, vec![], Target::Jump(to.into()));
    let mut r: Vec<(Table, Rule)> = vec![
        (Table::Mangle, jump("PREROUTING", PRERT)),
        (Table::Mangle, jump("OUTPUT", OUTPUT)),
        (Table::Nat, jump("OUTPUT", OUTPUT)),
        (Table::Nat, jump("PREROUTING", PRERT)),
    ];
    if cfg.dns_capture {
        r.push((Table::Raw, jump("PREROUTING", PRERT)));
        r.push((Table::Raw, jump("OUTPUT", OUTPUT)));
    }

    // Virtual interfaces: their inbound TCP goes to the outbound port, and skips the rest of the chain.
    for iface in &cfg.virtual_interfaces {
        let m = || vec![Match::InInterface(iface.clone()), Match::Protocol(Tcp)];
        r.push((Table::Nat, Rule::append(PRERT, m(), redirect(ports::OUTBOUND, ToPorts))));
        r.push((Table::Nat, Rule::append(PRERT, m(), Target::Return)));
    }

    // Connections the proxy's marked packets open get the connmark.
    r.push((
        Table::Mangle,
        Rule::append(PRERT, vec![mark(PROXY_MARK, false)], Target::SetConnmark { value: CONNMARK, mask: MARK_MASK }),
    ));

    // Host probes (SNATed to the probe address by the host) are neither captured inbound nor outbound.
    let probe = |host: Match| vec![host, Match::Protocol(Tcp), Match::ProtocolModule(Tcp)];
    if !cfg.ingress_mode {
        let src = Match::SourceHost { addr: probe_src, negate: false };
        r.push((Table::Nat, Rule::append(PRERT, probe(src), Target::Accept)));
    }
    let dst = Match::DestinationHost { addr: probe_src, negate: false };
    r.push((Table::Nat, Rule::append(OUTPUT, probe(dst), Target::Accept)));

    // Inbound TCP except HBONE and the proxy's own packets goes to the inbound plaintext port.
    if !cfg.ingress_mode {
        let m = vec![
            not_lo(),
            Match::Protocol(Tcp),
            Match::DestPort { port: ports::HBONE, negate: true },
            mark(PROXY_MARK, true),
        ];
        r.push((Table::Nat, Rule::append(PRERT, m, redirect(ports::INBOUND_PLAINTEXT, ToPorts))));
    }

    // Packets of connmarked connections get the mark back, so they route via table 100.
    let ct = Match::Connmark { value: CONNMARK, mask: Some(MARK_MASK), negate: false };
    let restore = Target::RestoreConnmarkMasked { nfmask: u32::MAX, ctmask: u32::MAX };
    r.push((Table::Mangle, Rule::append(OUTPUT, vec![ct], restore)));

    if cfg.dns_capture {
        let udp53 =
            |negate_mark: bool| vec![Match::Protocol(Udp), mark(PROXY_MARK, negate_mark), Match::ProtocolModule(Udp)];
        let mut m = vec![Match::NotOutInterface("lo".into())];
        m.extend(udp53(true));
        m.push(Match::DestPort { port: 53, negate: false });
        r.push((Table::Nat, Rule::append(OUTPUT, m, redirect(ports::DNS, ToPort))));
        let m =
            vec![not_lo(), Match::Protocol(Tcp), Match::DestPort { port: 53, negate: false }, mark(PROXY_MARK, true)];
        r.push((Table::Nat, Rule::append(OUTPUT, m, redirect(ports::DNS, ToPorts))));

        let mut m = udp53(false);
        m.push(Match::DestPort { port: 53, negate: false });
        r.push((Table::Raw, Rule::append(OUTPUT, m, Target::CtZone(DNS_CT_ZONE))));
        let mut m = udp53(true);
        m.push(Match::SourcePort { port: 53, negate: false });
        r.push((Table::Raw, Rule::append(PRERT, m, Target::CtZone(DNS_CT_ZONE))));
    }

    // Connmarked TCP (the proxy's inbound connections) and loopback traffic leave untouched.
    r.push((Table::Nat, Rule::append(OUTPUT, vec![Match::Protocol(Tcp), mark(CONNMARK, false)], Target::Accept)));
    r.push((Table::Nat, Rule::append(OUTPUT, vec![not_lo(), Match::OutInterface("lo".into())], Target::Accept)));

    // Everything else the pod sends over TCP goes to the outbound port.
    let m = vec![not_lo(), Match::Protocol(Tcp), mark(PROXY_MARK, true)];
    r.push((Table::Nat, Rule::append(OUTPUT, m, redirect(ports::OUTBOUND, ToPorts))));

    RuleSet::from_rules(family, r)
}

/// Our chains in the pod's tables; `remove` deletes exactly these and the jumps into them.
pub(crate) const OWNED: [(Table, &[&str]); 3] = [
    (Table::Mangle, &[chains::PRERT, chains::OUTPUT]),
    (Table::Nat, &[chains::PRERT, chains::OUTPUT]),
    (Table::Raw, &[chains::PRERT, chains::OUTPUT]),
];

/// Programs `plan` into `netns` with iptables: per family one `iptables-restore --noflush` that replaces our
/// chains (and only them) atomically, then the connmark routing. Re-applying is idempotent.
pub fn apply_iptables(netns: &Netns, plan: &AmbientPlan, backend: IptablesBackend) -> Result<(), IptablesError> {
    netns.run(|| {
        for family in [Family::V4, Family::V6] {
            let rules = match family {
                Family::V4 => Some(&plan.v4),
                Family::V6 => plan.v6.as_ref(),
            };
            // A family the plan lacks is cleaned, so turning IPv6 off removes stale IPv6 rules.
            iptables::chains::program(backend, family, rules, &OWNED)?;
        }
        Ok(routing::program_fwmark(plan.routes.fwmark_rule(), &plan.families(), true)?)
    })?
}

/// Removes our chains, the jumps into them and the connmark routing from `netns` (iptables, both families).
pub fn remove_iptables(netns: &Netns, backend: IptablesBackend) -> Result<(), IptablesError> {
    netns.run(|| {
        for family in [Family::V4, Family::V6] {
            iptables::chains::program(backend, family, None, &OWNED)?;
        }
        Ok(routing::program_fwmark(ConnmarkRoutes::default().fwmark_rule(), &[Family::V4, Family::V6], false)?)
    })?
}

/// Istio's nftables layout of `plan` (tables `istio-ambient-*`). As in Istio's ambient tables, the plain
/// jumps from the base chains carry no counter; every other rule has one.
pub fn nft_layout(plan: &AmbientPlan) -> Result<NftLayout, NftError> {
    use crate::nft::stmt::Stmt;
    let mut layout = NftLayout::from_rulesets(NFT_PREFIX, &plan.v4, plan.v6.as_ref())?;
    for table in &mut layout.tables {
        let base: Vec<String> = table.chains.iter().filter(|c| c.base.is_some()).map(|c| c.name.clone()).collect();
        for rule in table.rules.iter_mut().filter(|r| base.contains(&r.chain)) {
            if let [Stmt::Counter, Stmt::Jump(_)] = rule.stmts.as_slice() {
                rule.stmts.remove(0);
            }
        }
    }
    Ok(layout)
}

/// Programs `plan` into `netns` with native nftables: one transaction replaces every `istio-ambient-*` table,
/// then the connmark routing.
pub fn apply_nftables(netns: &Netns, plan: &AmbientPlan) -> Result<(), NftError> {
    let layout = nft_layout(plan)?;
    nft::replace_tables(netns, NFT_PREFIX, &layout)?;
    netns.run(|| routing::program_fwmark(plan.routes.fwmark_rule(), &plan.families(), true))??;
    Ok(())
}

/// Deletes the `istio-ambient-*` tables and the connmark routing from `netns`.
pub fn remove_nftables(netns: &Netns) -> Result<(), NftError> {
    nft::replace_tables(netns, NFT_PREFIX, &NftLayout { tables: Vec::new() })?;
    let routes = ConnmarkRoutes::default().fwmark_rule();
    netns.run(|| routing::program_fwmark(routes, &[Family::V4, Family::V6], false))??;
    Ok(())
}

//! Istio's sidecar capture rules (the istio-iptables engine as the CNI plugin runs it), as typed rules.
//!
//! [`build`] reproduces the rule order of Istio's generator exactly, because the goldens pin it and because
//! order is semantics in iptables.

use std::net::{IpAddr, Ipv6Addr};

use ipnet::IpNet;

use istio_contract::ports;
use istio_contract::proxy::TPROXY_OUTBOUND_MARK;

use crate::model::{CtState, Family, Match, OwnerId, Protocol, RedirectSpelling, Rule, RuleSet, Table, Target};

/// The generator's inputs are Istio's settings (istio-iptables' flags), which the contract crate owns.
pub use istio_contract::sidecar::{CidrSpec, InterceptMode, PortSpec, SidecarConfig};

/// Istio-owned chain names.
pub mod chains {
    /// Inbound capture chain (nat, mangle for TPROXY, raw for DNS).
    pub const INBOUND: &str = "ISTIO_INBOUND";
    /// Redirects outbound traffic to the proxy's outbound port.
    pub const REDIRECT: &str = "ISTIO_REDIRECT";
    /// Redirects inbound traffic to the proxy's inbound port.
    pub const IN_REDIRECT: &str = "ISTIO_IN_REDIRECT";
    /// Outbound decision chain.
    pub const OUTPUT: &str = "ISTIO_OUTPUT";
    /// DNS capture chain (nat and raw).
    pub const OUTPUT_DNS: &str = "ISTIO_OUTPUT_DNS";
    /// TPROXY: marks and accepts packets of established inbound connections.
    pub const DIVERT: &str = "ISTIO_DIVERT";
    /// TPROXY: hands new inbound connections to the proxy.
    pub const TPROXY: &str = "ISTIO_TPROXY";
    /// Drops conntrack-INVALID packets.
    pub const DROP: &str = "ISTIO_DROP";
}

/// Source address the proxy uses for inbound passthrough connections.
const PASSTHROUGH_SRC_V4: &str = "127.0.0.6/32";
/// IPv6 source of the proxy's inbound passthrough connections. Unlike 127.0.0.6 (inside 127/8) it is not local
/// by default, so applying a plan with IPv6 rules adds it to `lo` (as istio-iptables does).
pub(crate) const PASSTHROUGH_SRC_V6: Ipv6Addr = Ipv6Addr::new(0, 0, 0, 0, 0, 0, 0, 6);
const LOOPBACK_V6: &str = "::1/128";

/// Policy routing needed by TPROXY: `ip rule add fwmark <mark> lookup <table>` and
/// `ip route add local default dev lo table <table>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TproxyRoutes {
    /// Firewall mark selecting the table.
    pub mark: u32,
    /// Routing table id.
    pub table: u32,
}

/// Everything to program in a pod: rules per family and optional TPROXY routing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// IPv4 rules.
    pub v4: RuleSet,
    /// IPv6 rules, present iff IPv6 is enabled. Applying them also adds the passthrough source `::6/128` to
    /// `lo`, which these rules match on; no separate flag, since the address is needed exactly when they exist.
    pub v6: Option<RuleSet>,
    /// Policy routing for TPROXY mode (for every family in the plan).
    pub tproxy_routes: Option<TproxyRoutes>,
}

/// Collects rules for both families in generation order, like Istio's dual-stack rule builder.
struct Builder {
    v4: Vec<(Table, Rule)>,
    v6: Option<Vec<(Table, Rule)>>,
}

impl Builder {
    fn both(&mut self, table: Table, rule: Rule) {
        if let Some(v6) = &mut self.v6 {
            v6.push((table, rule.clone()));
        }
        self.v4.push((table, rule));
    }

    fn v4(&mut self, table: Table, rule: Rule) {
        self.v4.push((table, rule));
    }

    fn v6(&mut self, table: Table, rule: Rule) {
        if let Some(v6) = &mut self.v6 {
            v6.push((table, rule));
        }
    }

    fn for_family(&mut self, family: Family, table: Table, rule: Rule) {
        match family {
            Family::V4 => self.v4(table, rule),
            Family::V6 => self.v6(table, rule),
        }
    }

    /// Adds a rule that differs between families only by an address.
    fn versioned(&mut self, table: Table, v4: IpNet, v6: IpNet, make: impl Fn(IpNet) -> Rule) {
        self.v4(table, make(v4));
        self.v6(table, make(v6));
    }
}

fn net(s: &str) -> IpNet {
    s.parse().expect("constant CIDR")
}

fn tcp() -> Match {
    Match::Protocol(Protocol::Tcp)
}
fn udp() -> Match {
    Match::Protocol(Protocol::Udp)
}
fn dport(port: u16) -> Match {
    Match::DestPort { port, negate: false }
}
fn not_dport(port: u16) -> Match {
    Match::DestPort { port, negate: true }
}
fn sport(port: u16) -> Match {
    Match::SourcePort { port, negate: false }
}
fn dst(net: IpNet) -> Match {
    Match::Destination { net, negate: false }
}
fn not_dst(net: IpNet) -> Match {
    Match::Destination { net, negate: true }
}
fn src(net: IpNet) -> Match {
    Match::Source { net, negate: false }
}
fn out_if(name: &str) -> Match {
    Match::OutInterface(name.to_string())
}
fn in_if(name: &str) -> Match {
    Match::InInterface(name.to_string())
}
fn uid(id: u32, negate: bool) -> Match {
    Match::OwnerUid { id: OwnerId::Id(id), negate }
}
fn gid(id: u32, negate: bool) -> Match {
    Match::OwnerGid { id: OwnerId::Id(id), negate }
}
fn mark(value: u32, negate: bool) -> Match {
    Match::Mark { value, mask: None, negate }
}
fn jump(chain: &str) -> Target {
    Target::Jump(chain.to_string())
}
fn redirect(port: u16, spelling: RedirectSpelling) -> Target {
    Target::Redirect { port, spelling }
}

fn owner_id(s: &str) -> OwnerId {
    s.parse().map(OwnerId::Id).unwrap_or_else(|_| OwnerId::Name(s.to_string()))
}

fn split_list(s: &str) -> Vec<&str> {
    s.split(',').filter(|v| !v.is_empty()).collect()
}

/// Range include split by family, as istio-iptables' `separateV4V6` does.
struct FamilyRanges {
    wildcard: bool,
    v4: Vec<IpNet>,
    v6: Vec<IpNet>,
}

impl FamilyRanges {
    fn new(spec: &CidrSpec) -> Self {
        match spec {
            CidrSpec::All => Self { wildcard: true, v4: Vec::new(), v6: Vec::new() },
            CidrSpec::List(nets) => Self {
                wildcard: false,
                v4: nets.iter().filter(|n| matches!(n, IpNet::V4(_))).copied().collect(),
                v6: nets.iter().filter(|n| matches!(n, IpNet::V6(_))).copied().collect(),
            },
        }
    }

    fn has_loopback(&self) -> bool {
        self.v4.iter().chain(&self.v6).any(|n| n.addr().is_loopback())
    }

    fn of(&self, family: Family) -> &[IpNet] {
        match family {
            Family::V4 => &self.v4,
            Family::V6 => &self.v6,
        }
    }
}

/// Generates the rules istio-iptables would program for `cfg` (CNI mode).
pub fn build(cfg: &SidecarConfig) -> Plan {
    let mut b = Builder { v4: Vec::new(), v6: cfg.enable_ipv6.then(Vec::new) };
    let tproxy = cfg.mode == InterceptMode::Tproxy;
    let lo4 = IpNet::V4(cfg.host_ipv4_loopback_cidr);
    let lo6 = net(LOOPBACK_V6);
    let include = FamilyRanges::new(&cfg.outbound_ip_ranges_include);
    let dns_v4: Vec<IpAddr> = cfg.dns_servers.iter().filter(|a| a.is_ipv4()).copied().collect();
    let dns_v6: Vec<IpAddr> = cfg.dns_servers.iter().filter(|a| a.is_ipv6()).copied().collect();
    let redirect_dns = cfg.redirect_dns && (cfg.capture_all_dns || !cfg.dns_servers.is_empty());

    // Interfaces that are never captured.
    let mut exclude_tables = vec![Table::Nat];
    if tproxy {
        exclude_tables.push(Table::Mangle);
    }
    for table in exclude_tables {
        for iface in &cfg.exclude_interfaces {
            b.both(table, Rule::append("PREROUTING", vec![in_if(iface)], Target::Return));
            b.both(table, Rule::append("OUTPUT", vec![out_if(iface)], Target::Return));
        }
    }
    for iface in &cfg.reroute_virtual_interfaces {
        b.both(Table::Nat, Rule::insert("PREROUTING", 1, vec![in_if(iface)], Target::Return));
    }

    if cfg.drop_invalid {
        let invalid = Match::Conntrack { states: vec![CtState::Invalid], negate: false };
        b.both(Table::Mangle, Rule::append("PREROUTING", vec![invalid], jump(chains::DROP)));
        b.both(Table::Mangle, Rule::append(chains::DROP, vec![], Target::Drop));
    }

    // nat skeleton.
    let to_ports = RedirectSpelling::ToPorts;
    b.both(Table::Nat, Rule::append(chains::INBOUND, vec![tcp(), dport(cfg.inbound_tunnel_port)], Target::Return));
    b.both(Table::Nat, Rule::append(chains::REDIRECT, vec![tcp()], redirect(cfg.proxy_port, to_ports)));
    b.both(Table::Nat, Rule::append(chains::IN_REDIRECT, vec![tcp()], redirect(cfg.inbound_capture_port, to_ports)));

    inbound(&mut b, cfg, lo4, lo6);

    b.both(Table::Nat, Rule::append("OUTPUT", vec![], jump(chains::OUTPUT)));
    for &port in &cfg.outbound_ports_exclude {
        b.both(Table::Nat, Rule::append(chains::OUTPUT, vec![tcp(), dport(port)], Target::Return));
        b.both(Table::Nat, Rule::append(chains::OUTPUT, vec![udp(), dport(port)], Target::Return));
    }
    b.versioned(Table::Nat, net(PASSTHROUGH_SRC_V4), IpNet::from(IpAddr::V6(PASSTHROUGH_SRC_V6)), |s| {
        Rule::append(chains::OUTPUT, vec![out_if("lo"), src(s)], Target::Return)
    });
    let keep_lo_return = !include.has_loopback();
    for &u in &cfg.proxy_uids {
        let in_redirect_port = if redirect_dns {
            Match::DestPorts { ports: vec![53, cfg.inbound_tunnel_port], negate: true }
        } else {
            not_dport(cfg.inbound_tunnel_port)
        };
        proxy_owner_rules(
            &mut b,
            (lo4, lo6),
            in_redirect_port,
            uid(u, false),
            uid(u, true),
            keep_lo_return,
            redirect_dns,
        );
    }
    for &g in &cfg.proxy_gids {
        let in_redirect_port = not_dport(cfg.inbound_tunnel_port);
        proxy_owner_rules(
            &mut b,
            (lo4, lo6),
            in_redirect_port,
            gid(g, false),
            gid(g, true),
            keep_lo_return,
            redirect_dns,
        );
    }
    owner_groups(&mut b, cfg);
    if redirect_dns {
        dns(&mut b, cfg, &dns_v4, &dns_v6);
    }

    b.versioned(Table::Nat, lo4, lo6, |lo| Rule::append(chains::OUTPUT, vec![dst(lo)], Target::Return));
    for family in [Family::V4, Family::V6] {
        for cidr in cfg.outbound_ip_ranges_exclude.iter().filter(|n| family_of(n) == family) {
            b.for_family(family, Table::Nat, Rule::append(chains::OUTPUT, vec![dst(*cidr)], Target::Return));
        }
    }
    for &port in &cfg.outbound_ports_include {
        b.both(Table::Nat, Rule::append(chains::OUTPUT, vec![tcp(), dport(port)], jump(chains::REDIRECT)));
    }
    for family in [Family::V4, Family::V6] {
        outbound_include(&mut b, cfg, &include, family);
    }
    if tproxy {
        tproxy_extras(&mut b, cfg, lo4, lo6);
    }

    Plan {
        v4: RuleSet::from_rules(Family::V4, b.v4),
        v6: b.v6.map(|rules| RuleSet::from_rules(Family::V6, rules)),
        // As istio-iptables: the routes that deliver TPROXY's marked packets locally only when inbound traffic is
        // captured at all.
        tproxy_routes: (tproxy && cfg.inbound_ports_include != PortSpec::List(Vec::new()))
            .then_some(TproxyRoutes { mark: cfg.tproxy_mark, table: cfg.tproxy_route_table }),
    }
}

fn family_of(n: &IpNet) -> Family {
    match n {
        IpNet::V4(_) => Family::V4,
        IpNet::V6(_) => Family::V6,
    }
}

fn inbound(b: &mut Builder, cfg: &SidecarConfig, lo4: IpNet, lo6: IpNet) {
    if cfg.inbound_ports_include == PortSpec::List(Vec::new()) {
        return;
    }
    let tproxy = cfg.mode == InterceptMode::Tproxy;
    let table = if tproxy {
        b.both(Table::Mangle, Rule::append(chains::DIVERT, vec![], Target::SetMark(cfg.tproxy_mark)));
        b.both(Table::Mangle, Rule::append(chains::DIVERT, vec![], Target::Accept));
        let target = Target::Tproxy { mark: cfg.tproxy_mark, mask: 0xffff_ffff, port: cfg.inbound_capture_port };
        b.versioned(Table::Mangle, lo4, lo6, |lo| {
            Rule::append(chains::TPROXY, vec![not_dst(lo), tcp()], target.clone())
        });
        Table::Mangle
    } else {
        Table::Nat
    };
    b.both(table, Rule::append("PREROUTING", vec![tcp()], jump(chains::INBOUND)));
    let established = || Match::Conntrack { states: vec![CtState::Related, CtState::Established], negate: false };
    let capture = |b: &mut Builder, port: Option<u16>| {
        let base: Vec<Match> = std::iter::once(tcp()).chain(port.map(dport)).collect();
        if tproxy {
            let mut est = base.clone();
            est.push(established());
            b.both(Table::Mangle, Rule::append(chains::INBOUND, est, jump(chains::DIVERT)));
            b.both(Table::Mangle, Rule::append(chains::INBOUND, base, jump(chains::TPROXY)));
        } else {
            b.both(Table::Nat, Rule::append(chains::INBOUND, base, jump(chains::IN_REDIRECT)));
        }
    };
    match &cfg.inbound_ports_include {
        PortSpec::All => {
            for &port in &cfg.inbound_ports_exclude {
                b.both(table, Rule::append(chains::INBOUND, vec![tcp(), dport(port)], Target::Return));
            }
            capture(b, None);
        }
        PortSpec::List(ports) => {
            for &port in ports {
                capture(b, Some(port));
            }
        }
    }
}

/// The per-UID / per-GID triple: proxy loopback calls to a service VIP go back through the proxy, app-to-self
/// loopback traffic is left alone, and everything else from the proxy is never captured.
fn proxy_owner_rules(
    b: &mut Builder,
    (lo4, lo6): (IpNet, IpNet),
    in_redirect_port: Match,
    owner: Match,
    not_owner: Match,
    keep_lo_return: bool,
    redirect_dns: bool,
) {
    b.versioned(Table::Nat, lo4, lo6, |lo| {
        Rule::append(
            chains::OUTPUT,
            vec![out_if("lo"), not_dst(lo), tcp(), in_redirect_port.clone(), owner.clone()],
            jump(chains::IN_REDIRECT),
        )
    });
    if keep_lo_return {
        let matches = if redirect_dns {
            vec![out_if("lo"), tcp(), not_dport(53), not_owner]
        } else {
            vec![out_if("lo"), not_owner]
        };
        b.both(Table::Nat, Rule::append(chains::OUTPUT, matches, Target::Return));
    }
    b.both(Table::Nat, Rule::append(chains::OUTPUT, vec![owner], Target::Return));
}

fn owner_groups(b: &mut Builder, cfg: &SidecarConfig) {
    if cfg.owner_groups_include == "*" {
        for group in split_list(&cfg.owner_groups_exclude) {
            let m = Match::OwnerGid { id: owner_id(group), negate: false };
            b.both(Table::Nat, Rule::append(chains::OUTPUT, vec![m], Target::Return));
        }
    } else {
        let none_of = split_list(&cfg.owner_groups_include)
            .into_iter()
            .map(|g| Match::OwnerGid { id: owner_id(g), negate: true })
            .collect();
        b.both(Table::Nat, Rule::append(chains::OUTPUT, none_of, Target::Return));
    }
}

fn host_net(addr: IpAddr) -> IpNet {
    let len = if addr.is_ipv4() { 32 } else { 128 };
    IpNet::new(addr, len).expect("host prefix")
}

fn dns(b: &mut Builder, cfg: &SidecarConfig, v4: &[IpAddr], v6: &[IpAddr]) {
    let all = cfg.capture_all_dns;
    b.both(Table::Raw, Rule::append("OUTPUT", vec![], jump(chains::OUTPUT_DNS)));
    if all || !v4.is_empty() {
        b.v4(Table::Nat, Rule::append(chains::OUTPUT, vec![], jump(chains::OUTPUT_DNS)));
    }
    if all || !v6.is_empty() {
        b.v6(Table::Nat, Rule::append(chains::OUTPUT, vec![], jump(chains::OUTPUT_DNS)));
    }
    let servers = |family: Family| match family {
        Family::V4 => v4,
        Family::V6 => v6,
    };
    for (proto, spelling) in [(tcp(), RedirectSpelling::ToPorts), (udp(), RedirectSpelling::ToPort)] {
        if all {
            let rule = Rule::append(chains::OUTPUT_DNS, vec![proto, dport(53)], redirect(ports::DNS, spelling));
            b.both(Table::Nat, rule);
            continue;
        }
        for family in [Family::V4, Family::V6] {
            for &s in servers(family) {
                let matches = vec![proto.clone(), dport(53), dst(host_net(s))];
                let rule = Rule::append(chains::OUTPUT_DNS, matches, redirect(ports::DNS, spelling));
                b.for_family(family, Table::Nat, rule);
            }
        }
    }

    // Conntrack zones keep agent<->upstream and app<->agent DNS flows apart.
    let owners = cfg.proxy_uids.iter().map(|&u| uid(u, false)).chain(cfg.proxy_gids.iter().map(|&g| gid(g, false)));
    for owner in owners {
        b.both(Table::Raw, Rule::append(chains::OUTPUT_DNS, vec![udp(), dport(53), owner.clone()], Target::CtZone(1)));
        b.both(Table::Raw, Rule::append(chains::OUTPUT_DNS, vec![udp(), sport(ports::DNS), owner], Target::CtZone(2)));
    }
    if all {
        b.both(Table::Raw, Rule::append("PREROUTING", vec![], jump(chains::INBOUND)));
        b.both(Table::Raw, Rule::append(chains::OUTPUT_DNS, vec![udp(), dport(53)], Target::CtZone(2)));
        b.both(Table::Raw, Rule::append(chains::INBOUND, vec![udp(), sport(53)], Target::CtZone(1)));
        return;
    }
    for family in [Family::V4, Family::V6] {
        let list = servers(family);
        if !list.is_empty() {
            b.for_family(family, Table::Raw, Rule::append("PREROUTING", vec![], jump(chains::INBOUND)));
        }
        for &s in list {
            let out = Rule::append(chains::OUTPUT_DNS, vec![udp(), dport(53), dst(host_net(s))], Target::CtZone(2));
            b.for_family(family, Table::Raw, out);
            let inb = Rule::append(chains::INBOUND, vec![udp(), sport(53), src(host_net(s))], Target::CtZone(1));
            b.for_family(family, Table::Raw, inb);
        }
    }
}

fn outbound_include(b: &mut Builder, cfg: &SidecarConfig, include: &FamilyRanges, family: Family) {
    let reroute = &cfg.reroute_virtual_interfaces;
    if include.wildcard {
        b.for_family(family, Table::Nat, Rule::append(chains::OUTPUT, vec![], jump(chains::REDIRECT)));
        for iface in reroute {
            b.for_family(family, Table::Nat, Rule::insert("PREROUTING", 1, vec![in_if(iface)], jump(chains::REDIRECT)));
        }
        return;
    }
    for &cidr in include.of(family) {
        for iface in reroute {
            let rule = Rule::insert("PREROUTING", 1, vec![in_if(iface), dst(cidr)], jump(chains::REDIRECT));
            b.for_family(family, Table::Nat, rule);
        }
        b.for_family(family, Table::Nat, Rule::append(chains::OUTPUT, vec![dst(cidr)], jump(chains::REDIRECT)));
    }
}

fn tproxy_extras(b: &mut Builder, cfg: &SidecarConfig, lo4: IpNet, lo6: IpNet) {
    let m = cfg.tproxy_mark;
    b.both(Table::Mangle, Rule::append("PREROUTING", vec![tcp(), mark(m, false)], Target::SaveConnmark));
    b.both(Table::Mangle, Rule::append("OUTPUT", vec![tcp(), out_if("lo"), mark(m, false)], Target::Return));
    let owners = cfg.proxy_uids.iter().map(|&u| uid(u, false)).chain(cfg.proxy_gids.iter().map(|&g| gid(g, false)));
    for owner in owners {
        b.versioned(Table::Mangle, lo4, lo6, |lo| {
            Rule::append(
                "OUTPUT",
                vec![not_dst(lo), tcp(), out_if("lo"), owner.clone()],
                Target::SetMark(TPROXY_OUTBOUND_MARK),
            )
        });
    }
    let connmark = Match::Connmark { value: m, mask: None, negate: false };
    b.both(Table::Mangle, Rule::append("OUTPUT", vec![tcp(), connmark], Target::RestoreConnmark));
    b.both(Table::Mangle, Rule::insert(chains::INBOUND, 1, vec![tcp(), mark(m, false)], Target::Return));
    b.versioned(Table::Mangle, net(PASSTHROUGH_SRC_V4), IpNet::from(IpAddr::V6(PASSTHROUGH_SRC_V6)), |s| {
        Rule::insert(chains::INBOUND, 2, vec![tcp(), src(s), in_if("lo")], Target::Return)
    });
    b.both(
        Table::Mangle,
        Rule::insert(chains::INBOUND, 3, vec![tcp(), in_if("lo"), mark(TPROXY_OUTBOUND_MARK, true)], Target::Return),
    );
}

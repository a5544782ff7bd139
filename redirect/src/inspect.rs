//! What a netns holds of our rules compared with what a plan programs: the check behind drift repair and
//! `explain`. One read per family (`iptables-save`) or one netlink rule dump (nftables), no per-rule exec.
//!
//! Expected lines come from the same rendering the apply step feeds the kernel ([`render_rule`] and the
//! nftables layout), so the facts live in one place:
//!
//! - iptables: `ipv4 nat -A ISTIO_OUTPUT ...` for every rule of our chains and every jump into them from a
//!   built-in chain, in the form `iptables-save` prints (`/32` on host addresses, the implicit `-m tcp`,
//!   `--to-ports`), read back with `iptables-save` and normalised the same way;
//! - nftables: `inet istio-ambient-nat istio-output <statements>` for every rule of our tables, recognised
//!   by the tag each rule carries (see [`crate::nft::rules`]).
//!
//! Lines are grouped per table and chain (order inside a chain kept), and each side has a digest, so a
//! re-ordered chain counts as drift too. An ambient report ends with the pod's connmark routing, read over
//! rtnetlink (`ipv4 rule fwmark 0x111/0xfff pref 32764 lookup 100`, `ipv4 route local default dev lo table 100`):
//! without it the packets the rules mark for local delivery (TPROXY'd inbound traffic, the app's replies to the
//! proxy's connections that carry the client's IP) are routed away, so its loss is drift like a rule's.

use std::collections::HashMap;

use netns::Netns;

use crate::ambient::{self, AmbientPlan};
use crate::iptables::{render_rule, IptablesBackend, IptablesError};
use crate::model::{is_builtin_chain, Family, Op, RuleSet, Table};
use crate::nft::layout::NftLayout;
use crate::nft::rules::RuleEntry;
use crate::nft::tag::RuleText;
use crate::nft::NftError;
use crate::routing::{self, FoundFwmark, FwmarkRule};

/// Our rules in one netns: what the plan programs and what is there, by backend.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct RuleReport {
    /// The backend that was read: `iptables-legacy`, `iptables-nft` or `nftables`.
    pub backend: String,
    /// The rule lines the plan programs, grouped per table and chain.
    pub expected: Vec<String>,
    /// The rule lines of our tables and chains found in the netns, grouped the same way.
    pub found: Vec<String>,
    /// Expected lines not found.
    pub missing: Vec<String>,
    /// Found lines not expected (someone else's rule in our chains, or a changed one).
    pub unexpected: Vec<String>,
    /// Digest of `expected` (16 hex digits).
    pub digest_expected: String,
    /// Digest of `found`; differs from `digest_expected` when anything drifted, order included.
    pub digest_found: String,
}

impl RuleReport {
    /// Builds the report from both sides (each already grouped per table and chain).
    pub fn new(backend: impl Into<String>, expected: Vec<String>, found: Vec<String>) -> Self {
        let missing = difference(&expected, &found);
        let unexpected = difference(&found, &expected);
        Self {
            backend: backend.into(),
            digest_expected: digest(&expected),
            digest_found: digest(&found),
            expected,
            found,
            missing,
            unexpected,
        }
    }

    /// The report with `expected` and `found` lines appended to its own.
    fn extended(self, expected: Vec<String>, found: Vec<String>) -> Self {
        RuleReport::new(self.backend, [self.expected, expected].concat(), [self.found, found].concat())
    }

    /// Whether the netns differs from the plan: a rule missing, added, changed or out of order.
    pub fn drifted(&self) -> bool {
        self.digest_expected != self.digest_found || !self.missing.is_empty() || !self.unexpected.is_empty()
    }
}

/// Lines of `a` not matched by a line of `b`, counting duplicates.
fn difference(a: &[String], b: &[String]) -> Vec<String> {
    let mut left: HashMap<&str, usize> = HashMap::new();
    for line in b {
        *left.entry(line).or_default() += 1;
    }
    a.iter()
        .filter(|line| match left.get_mut(line.as_str()) {
            Some(n) if *n > 0 => {
                *n -= 1;
                false
            }
            _ => true,
        })
        .cloned()
        .collect()
}

/// FNV-1a 64 of the lines, as 16 hex digits.
fn digest(lines: &[String]) -> String {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in lines.iter().flat_map(|l| l.bytes().chain([b'\n'])) {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{hash:016x}")
}

/// Orders lines by their first `key_words` words (family, table, chain), keeping the order inside a chain.
fn group(mut lines: Vec<String>, key_words: usize) -> Vec<String> {
    lines.sort_by_cached_key(|l| l.split(' ').take(key_words).map(str::to_owned).collect::<Vec<_>>());
    lines
}

fn family_word(family: Family) -> &'static str {
    match family {
        Family::V4 => "ipv4",
        Family::V6 => "ipv6",
    }
}

/// Which lines of a table's `iptables-save` are ours.
enum Ours<'a> {
    /// Rules of these chains and the jumps into them from built-in chains (ambient, host probe).
    Chains(&'a [(Table, &'a [&'a str])]),
    /// Every rule of these tables (the sidecar owns its tables whole).
    Tables(&'a [Table]),
}

impl Ours<'_> {
    fn keeps(&self, table: &str, chain: &str, target: Option<&str>) -> bool {
        match self {
            Ours::Chains(owned) => owned.iter().filter(|(t, _)| t.name() == table).any(|(_, chains)| {
                chains.contains(&chain) || (is_builtin_chain(chain) && target.is_some_and(|t| chains.contains(&t)))
            }),
            Ours::Tables(tables) => tables.iter().any(|t| t.name() == table),
        }
    }
}

/// The expected lines of `rs`: each table's rules in the order the kernel ends up holding them (inserts
/// applied), normalised as `iptables-save` prints them.
fn expected_iptables(rs: &RuleSet) -> Result<Vec<String>, IptablesError> {
    let mut out = Vec::new();
    for t in &rs.tables {
        let mut chains: Vec<(&str, Vec<String>)> = Vec::new();
        for rule in &t.rules {
            let line = normalise(&render_rule(rule)?, rs.family);
            let list = match chains.iter().position(|(c, _)| *c == rule.chain) {
                Some(i) => &mut chains[i].1,
                None => {
                    chains.push((&rule.chain, Vec::new()));
                    &mut chains.last_mut().expect("just pushed").1
                }
            };
            match rule.op {
                Op::Insert(n) if n >= 1 && ((n - 1) as usize) < list.len() => list.insert((n - 1) as usize, line),
                _ => list.push(line),
            }
        }
        let prefix = format!("{} {}", family_word(rs.family), t.table.name());
        out.extend(chains.into_iter().flat_map(|(_, lines)| lines).map(|l| format!("{prefix} {l}")));
    }
    Ok(out)
}

/// Our lines of one family's `iptables-save` output, normalised.
fn found_iptables(family: Family, save: &str, ours: &Ours<'_>) -> Vec<String> {
    let mut table = "";
    let mut out = Vec::new();
    for line in save.lines() {
        if let Some(name) = line.strip_prefix('*') {
            table = name.trim();
            continue;
        }
        let Some(rest) = line.strip_prefix("-A ") else { continue };
        let chain = rest.split_whitespace().next().unwrap_or_default();
        let target = rest.split(" -j ").nth(1).and_then(|t| t.split_whitespace().next());
        if ours.keeps(table, chain, target) {
            out.push(format!("{} {table} {}", family_word(family), normalise(line, family)));
        }
    }
    out
}

/// Reads our rules of every `(family, rules)` with one `iptables-save` per family and compares.
fn report_iptables(
    netns: &Netns,
    backend: IptablesBackend,
    families: &[(Family, &RuleSet)],
    ours: Ours<'_>,
) -> Result<RuleReport, IptablesError> {
    let mut expected = Vec::new();
    for (_, rs) in families {
        expected.extend(expected_iptables(rs)?);
    }
    let lock = crate::iptables::restore::XtablesLock::new()?;
    let saves = netns.run(|| -> Result<Vec<(Family, String)>, IptablesError> {
        families
            .iter()
            .map(|(family, _)| {
                Ok((*family, crate::iptables::restore::save(backend, *family, None, Some(&lock.file()))?))
            })
            .collect()
    })??;
    let found: Vec<String> = saves.iter().flat_map(|(family, save)| found_iptables(*family, save, &ours)).collect();
    // The backend's name is filled in by `Backend`, which owns it.
    Ok(RuleReport::new(String::new(), group(expected, 4), group(found, 4)))
}

/// Options `iptables-save` prints before any match module, in its order.
const BASIC: [&str; 5] = ["-s", "-d", "-i", "-o", "-p"];
/// Options of the tcp/udp match that `iptables` loads implicitly after `-p tcp` / `-p udp`.
const PROTO_OPTIONS: [&str; 4] = ["--dport", "--sport", "--tcp-flags", "--syn"];
const ALL_ONES: &str = "0xffffffff";

/// One rule line (`-A CHAIN ...`, or `-I CHAIN N ...` taken as an append) in the form `iptables-save` prints
/// it: basic options first (`-s -d -i -o -p`, host addresses with their prefix length), match modules in
/// order with the implicit protocol module spelled out, marks in hex, and the targets' defaults written out.
/// Idempotent, so saved lines and rendered lines meet in the same form.
pub fn normalise(line: &str, family: Family) -> String {
    let words: Vec<&str> = line.split_whitespace().collect();
    let (chain, mut i) = match words.as_slice() {
        ["-A", chain, ..] => (*chain, 2),
        ["-I", chain, n, ..] if n.parse::<u32>().is_ok() => (*chain, 3),
        ["-I", chain, ..] => (*chain, 2),
        _ => return line.trim().to_string(),
    };
    let mut basic: [Option<String>; 5] = Default::default();
    let mut modules: Vec<Vec<String>> = Vec::new();
    let mut target: Vec<String> = Vec::new();
    let mut negate = false;
    let mut protocol = String::new();
    while i < words.len() {
        let word = words[i];
        i += 1;
        if word == "!" {
            negate = true;
            continue;
        }
        let bang = if std::mem::take(&mut negate) { "! " } else { "" };
        if let Some(slot) = BASIC.iter().position(|b| *b == word) {
            let mut value = words.get(i).copied().unwrap_or_default().to_string();
            i += 1;
            if slot < 2 {
                value = network(&value);
            }
            if slot == 4 {
                protocol = value.clone();
            }
            basic[slot] = Some(format!("{bang}{word} {value}"));
        } else if word == "-m" {
            let name = words.get(i).copied().unwrap_or_default();
            i += 1;
            modules.push(vec!["-m".into(), name.into()]);
        } else if word == "-j" {
            target = words[i..].iter().map(|w| w.to_string()).collect();
            break;
        } else {
            let mut values = Vec::new();
            while let Some(v) = words.get(i).filter(|v| !v.starts_with('-') && **v != "!") {
                values.push(v.to_string());
                i += 1;
            }
            let in_proto_module = modules.last().is_some_and(|m| m[1] == protocol);
            if PROTO_OPTIONS.contains(&word) && !in_proto_module && !protocol.is_empty() {
                match modules.iter().position(|m| m[1] == protocol) {
                    Some(_) => {}
                    None => modules.push(vec!["-m".into(), protocol.clone()]),
                }
            }
            if word == "--mark" {
                values = values.iter().map(|v| hex_mark(v)).collect();
            }
            let module = if PROTO_OPTIONS.contains(&word) {
                modules.iter_mut().find(|m| m[1] == protocol)
            } else {
                modules.last_mut()
            };
            let text = std::iter::once(format!("{bang}{word}")).chain(values).collect::<Vec<_>>().join(" ");
            match module {
                Some(m) => m.push(text),
                None => modules.push(vec![text]),
            }
        }
    }
    let mut out = vec![format!("-A {chain}")];
    out.extend(basic.into_iter().flatten());
    out.extend(modules.into_iter().map(|m| m.join(" ")));
    if !target.is_empty() {
        out.push(format!("-j {}", normalise_target(target, family).join(" ")));
    }
    out.join(" ")
}

/// An address or network as iptables-save prints it: the network address and the prefix length.
fn network(value: &str) -> String {
    let net = match value.parse::<ipnet::IpNet>() {
        Ok(net) => net,
        Err(_) => match value.parse::<std::net::IpAddr>() {
            Ok(addr) => ipnet::IpNet::from(addr),
            Err(_) => return value.to_string(),
        },
    };
    let net = net.trunc();
    format!("{}/{}", net.addr(), net.prefix_len())
}

/// A mark value as iptables-save prints it: hex, with the mask if one was given.
fn hex_mark(value: &str) -> String {
    let hex = |v: &str| match v.strip_prefix("0x") {
        Some(_) => v.to_string(),
        None => v.parse::<u32>().map(|n| format!("{n:#x}")).unwrap_or_else(|_| v.to_string()),
    };
    match value.split_once('/') {
        Some((v, m)) => format!("{}/{}", hex(v), hex(m)),
        None => hex(value),
    }
}

/// Target arguments as iptables-save prints them.
fn normalise_target(mut t: Vec<String>, family: Family) -> Vec<String> {
    let name = t.first().cloned().unwrap_or_default();
    match name.as_str() {
        "REDIRECT" => {
            for w in t.iter_mut().filter(|w| *w == "--to-port") {
                *w = "--to-ports".into();
            }
        }
        "MARK" => {
            if let Some(i) = t.iter().position(|w| w == "--set-mark") {
                t[i] = "--set-xmark".into();
                if let Some(v) = t.get_mut(i + 1) {
                    *v = if v.contains('/') { hex_mark(v) } else { format!("{}/{ALL_ONES}", hex_mark(v)) };
                }
            }
        }
        "CONNMARK"
            if t.iter().any(|w| w == "--save-mark" || w == "--restore-mark") && !t.iter().any(|w| w == "--nfmask") =>
        {
            t.extend(["--nfmask", ALL_ONES, "--ctmask", ALL_ONES].map(String::from));
        }
        "TPROXY" => {
            // iptables-save: `--on-port P --on-ip ADDR --tproxy-mark 0xM/0xK`.
            let arg = |name: &str| t.iter().position(|w| w == name).and_then(|i| t.get(i + 1)).cloned();
            let port = arg("--on-port").unwrap_or_default();
            let any = match family {
                Family::V4 => "0.0.0.0",
                Family::V6 => "::",
            };
            let ip = arg("--on-ip").unwrap_or_else(|| any.into());
            let mark = arg("--tproxy-mark").map(|m| hex_mark(&m)).unwrap_or_default();
            return ["TPROXY", "--on-port", &port, "--on-ip", &ip, "--tproxy-mark", &mark].map(String::from).to_vec();
        }
        _ => {}
    }
    t
}

/// The ambient in-pod rules of `plan` against the iptables rules in `netns` (our chains and the jumps into
/// them; the families the plan programs).
pub(crate) fn ambient_iptables(
    netns: &Netns,
    plan: &AmbientPlan,
    backend: IptablesBackend,
) -> Result<RuleReport, IptablesError> {
    let families: Vec<(Family, &RuleSet)> =
        std::iter::once(&plan.v4).chain(plan.v6.as_ref()).map(|rs| (rs.family, rs)).collect();
    with_routing(report_iptables(netns, backend, &families, Ours::Chains(&ambient::OWNED))?, netns, plan)
}

/// `report` (an ambient pod's rules) followed by the pod's connmark routing, expected and as read from `netns`.
fn with_routing<E>(report: RuleReport, netns: &Netns, plan: &AmbientPlan) -> Result<RuleReport, E>
where
    E: From<routing::RoutingError> + From<netns::NetnsError>,
{
    let found = netns.run(|| routing::read_fwmark(plan.routes.fwmark_rule(), &plan.families()))??;
    // The families read: the plan's, less IPv6 where the pod's loopback has it off (nothing is programmed there).
    let families: Vec<Family> = found.iter().map(|f| f.family).collect();
    Ok(report.extended(expected_routing(plan, &families), found_routing(plan.routes.fwmark_rule(), &found)))
}

/// The connmark routing lines `plan` programs in `families` (the plan's, less IPv6 where the pod's loopback has it
/// off), per family: its rule, then its table's local default route.
fn expected_routing(plan: &AmbientPlan, families: &[Family]) -> Vec<String> {
    let rule = plan.routes.fwmark_rule();
    families.iter().flat_map(|&f| [rule_line(f, rule), local_default_line(f, rule.table)]).collect()
}

/// The connmark routing lines found, in the order of [`expected_routing`]: rules by priority, then the table's
/// routes (anything but the local default route shows as one line, so it counts as drift).
fn found_routing(planned: FwmarkRule, found: &[FoundFwmark]) -> Vec<String> {
    let mut lines = Vec::new();
    for f in found {
        let mut rules = f.rules.clone();
        rules.sort_by_key(|r| r.priority);
        lines.extend(rules.into_iter().map(|r| rule_line(f.family, r)));
        if f.local_default {
            lines.push(local_default_line(f.family, planned.table));
        }
        if f.other_routes > 0 {
            lines.push(format!(
                "{} route table {}: {} other routes",
                family_word(f.family),
                planned.table,
                f.other_routes
            ));
        }
    }
    lines
}

fn rule_line(family: Family, r: FwmarkRule) -> String {
    format!("{} rule {}", family_word(family), routing::rule_spec(r))
}

fn local_default_line(family: Family, table: u32) -> String {
    format!("{} route {}", family_word(family), routing::route_spec(table))
}

/// A sidecar `plan` against the iptables rules in `netns` (every rule of the tables the sidecar owns).
pub(crate) fn sidecar_iptables(
    netns: &Netns,
    plan: &crate::sidecar::Plan,
    backend: IptablesBackend,
) -> Result<RuleReport, IptablesError> {
    let families: Vec<(Family, &RuleSet)> =
        std::iter::once(&plan.v4).chain(plan.v6.as_ref()).map(|rs| (rs.family, rs)).collect();
    let mut tables = crate::iptables::OWNED_TABLES.to_vec();
    tables.extend(families.iter().flat_map(|(_, rs)| rs.tables.iter().map(|t| t.table)));
    tables.sort();
    tables.dedup();
    report_iptables(netns, backend, &families, Ours::Tables(&tables))
}

/// Host-probe rules (`owned` chains of the host's nat table) against the host netns.
pub(crate) fn chains_iptables(
    netns: &Netns,
    backend: IptablesBackend,
    families: &[(Family, &RuleSet)],
    owned: &[(Table, &[&str])],
) -> Result<RuleReport, IptablesError> {
    report_iptables(netns, backend, families, Ours::Chains(owned))
}

/// The expected nftables lines of `layout` and their tags.
fn expected_nft(layout: &NftLayout) -> Vec<(String, u64)> {
    let mut out = Vec::new();
    for t in &layout.tables {
        for (chain, rules) in t.chain_rules() {
            for rule in rules {
                let r = RuleText::new(&t.name, &chain.name, &rule.stmts);
                out.push((r.line(&t.name, &chain.name), r.tag));
            }
        }
    }
    out
}

/// `expected` (line, tag) against the rules of tables `tables` in `netns`, read with one rule dump.
pub(crate) fn report_nft(
    netns: &Netns,
    expected: Vec<(String, u64)>,
    tables: &[String],
) -> Result<RuleReport, NftError> {
    let entries: Vec<RuleEntry> = netns.run(|| crate::nft::rules::rules(|t| tables.iter().any(|o| o == t)))??;
    let by_tag: HashMap<u64, &str> = expected.iter().map(|(line, tag)| (*tag, line.as_str())).collect();
    let found = entries
        .iter()
        .map(|e| match e.tag.and_then(|tag| by_tag.get(&tag)) {
            Some(line) => line.to_string(),
            None => format!("inet {} {} <not ours: {}>", e.table, e.chain, e.exprs.join(" ")),
        })
        .collect();
    let expected = expected.into_iter().map(|(line, _)| line).collect();
    Ok(RuleReport::new("nftables", group(expected, 3), group(found, 3)))
}

/// The ambient in-pod rules of `plan` against the `istio-ambient-*` tables in `netns`.
pub(crate) fn ambient_nftables(netns: &Netns, plan: &AmbientPlan) -> Result<RuleReport, NftError> {
    let layout = ambient::nft_layout(plan)?;
    let report = report_nft(netns, expected_nft(&layout), &crate::nft::layout::owned_tables(ambient::NFT_PREFIX))?;
    with_routing(report, netns, plan)
}

/// A sidecar `plan` against the `istio-proxy-*` tables in `netns`.
pub(crate) fn sidecar_nftables(netns: &Netns, plan: &crate::sidecar::Plan) -> Result<RuleReport, NftError> {
    let layout = NftLayout::sidecar(plan)?;
    report_nft(netns, expected_nft(&layout), &crate::nft::layout::owned_tables(crate::nft::layout::SIDECAR_PREFIX))
}

/// Expected (line, tag) pairs of rules `rules` of chain `chain` in table `table` (host probe).
pub(crate) fn expected_nft_chain(
    table: &str,
    chain: &str,
    rules: &[Vec<crate::nft::stmt::Stmt>],
) -> Vec<(String, u64)> {
    rules
        .iter()
        .map(|stmts| {
            let r = RuleText::new(table, chain, stmts);
            (r.line(table, chain), r.tag)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rendered_lines_take_the_form_iptables_save_prints() {
        let cases = [
            ("-A ISTIO_PRERT -s 169.254.7.127 -p tcp -m tcp -j ACCEPT", "-A ISTIO_PRERT -s 169.254.7.127/32 -p tcp -m tcp -j ACCEPT"),
            (
                "-A ISTIO_PRERT ! -d 127.0.0.1/32 -p tcp ! --dport 15008 -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15006",
                "-A ISTIO_PRERT ! -d 127.0.0.1/32 -p tcp -m tcp ! --dport 15008 -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15006",
            ),
            (
                "-A ISTIO_OUTPUT ! -o lo -p udp -m mark ! --mark 0x539/0xfff -m udp --dport 53 -j REDIRECT --to-port 15053",
                "-A ISTIO_OUTPUT ! -o lo -p udp -m mark ! --mark 0x539/0xfff -m udp --dport 53 -j REDIRECT --to-ports 15053",
            ),
            ("-I POSTROUTING 1 -j ISTIO_POSTRT", "-A POSTROUTING -j ISTIO_POSTRT"),
            ("-A X -o lo -s 127.0.0.6/32 -j RETURN", "-A X -s 127.0.0.6/32 -o lo -j RETURN"),
            ("-A X -j MARK --set-mark 1337", "-A X -j MARK --set-xmark 0x539/0xffffffff"),
            ("-A X -d 127.0.0.1/8 -j RETURN", "-A X -d 127.0.0.0/8 -j RETURN"),
        ];
        for (rendered, saved) in cases {
            assert_eq!(normalise(rendered, Family::V4), saved, "{rendered}");
            assert_eq!(normalise(saved, Family::V4), saved, "idempotent: {saved}");
        }
    }

    #[test]
    fn a_missing_or_reordered_line_is_drift() {
        let lines = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let same = RuleReport::new("nftables", lines(&["a", "b"]), lines(&["a", "b"]));
        assert!(!same.drifted());
        let missing = RuleReport::new("nftables", lines(&["a", "b"]), lines(&["a"]));
        assert!(missing.drifted());
        assert_eq!((missing.missing, missing.unexpected), (lines(&["b"]), vec![]));
        let reordered = RuleReport::new("nftables", lines(&["a", "b"]), lines(&["b", "a"]));
        assert!(reordered.drifted() && reordered.missing.is_empty() && reordered.unexpected.is_empty());
    }

    #[test]
    fn lost_or_changed_connmark_routing_is_drift() {
        let plan = ambient::build(&ambient::InpodConfig::default());
        let planned = plan.routes.fwmark_rule();
        let expected = expected_routing(&plan, &plan.families());
        assert_eq!(
            expected,
            ["ipv4 rule fwmark 0x111/0xfff pref 32764 lookup 100", "ipv4 route local default dev lo table 100"]
        );
        let report = |rules: Vec<FwmarkRule>, local_default: bool, other_routes: usize| {
            let found = [FoundFwmark { family: Family::V4, rules, local_default, other_routes }];
            RuleReport::new("nftables", expected.clone(), found_routing(planned, &found))
        };
        assert!(!report(vec![planned], true, 0).drifted(), "as programmed");
        let lost = report(vec![], false, 0);
        assert!(lost.drifted());
        assert_eq!(lost.missing, expected, "the rule and the route, deleted");
        let changed = report(vec![FwmarkRule { mask: None, ..planned }], true, 1);
        assert_eq!(changed.missing, ["ipv4 rule fwmark 0x111/0xfff pref 32764 lookup 100"]);
        assert_eq!(
            changed.unexpected,
            ["ipv4 rule fwmark 0x111 pref 32764 lookup 100", "ipv4 route table 100: 1 other routes"]
        );
    }
}

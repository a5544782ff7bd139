//! Istio's nftables layout of a [`Plan`]: one `inet` table per iptables table, base chains with Istio's hooks
//! and priorities, lower-case-dashed chain names, IPv4 and IPv6 rules merged, a counter on every rule.
//!
//! Translated from the typed rule model, so the iptables and nftables backends always program the same policy.

use std::fmt;

use ipnet::IpNet;

use crate::model::{Family, Match, Op, Protocol, Rule, RuleSet, Table, Target};
use crate::sidecar::Plan;

use super::merge::{merge, Tagged};
use super::stmt::{AddrField, PortField, Stmt};
use super::uapi::netfilter::{
    NF_INET_FORWARD, NF_INET_LOCAL_IN, NF_INET_LOCAL_OUT, NF_INET_POST_ROUTING, NF_INET_PRE_ROUTING,
};
use super::NftError;

/// Table name prefix of the sidecar rules (`istio-proxy-nat`, ...).
pub const SIDECAR_PREFIX: &str = "istio-proxy";

/// Tables in Istio's declaration order (not alphabetical).
const TABLE_ORDER: [Table; 4] = [Table::Nat, Table::Mangle, Table::Raw, Table::Filter];

/// The kind of a base chain (`type ...`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChainType {
    /// `filter`.
    Filter,
    /// `nat`.
    Nat,
    /// `route` (re-routes when the mark changes, like iptables mangle OUTPUT).
    Route,
}

impl ChainType {
    /// Name as nft and the kernel spell it.
    pub fn name(self) -> &'static str {
        match self {
            ChainType::Filter => "filter",
            ChainType::Nat => "nat",
            ChainType::Route => "route",
        }
    }
}

/// Netfilter hooks a base chain can attach to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hook {
    /// NF_INET_PRE_ROUTING.
    Prerouting,
    /// NF_INET_LOCAL_IN.
    Input,
    /// NF_INET_FORWARD.
    Forward,
    /// NF_INET_LOCAL_OUT.
    Output,
    /// NF_INET_POST_ROUTING.
    Postrouting,
}

impl Hook {
    /// Lower-case hook name (also the base chain's name).
    pub fn name(self) -> &'static str {
        match self {
            Hook::Prerouting => "prerouting",
            Hook::Input => "input",
            Hook::Forward => "forward",
            Hook::Output => "output",
            Hook::Postrouting => "postrouting",
        }
    }

    /// Kernel hook number.
    pub fn number(self) -> u32 {
        match self {
            Hook::Prerouting => NF_INET_PRE_ROUTING,
            Hook::Input => NF_INET_LOCAL_IN,
            Hook::Forward => NF_INET_FORWARD,
            Hook::Output => NF_INET_LOCAL_OUT,
            Hook::Postrouting => NF_INET_POST_ROUTING,
        }
    }

    fn of_builtin(chain: &str) -> Option<Hook> {
        Some(match chain {
            "PREROUTING" => Hook::Prerouting,
            "INPUT" => Hook::Input,
            "FORWARD" => Hook::Forward,
            "OUTPUT" => Hook::Output,
            "POSTROUTING" => Hook::Postrouting,
            _ => return None,
        })
    }
}

/// Hook, type and priority of a base chain (policy is always accept).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BaseChain {
    /// Chain type.
    pub kind: ChainType,
    /// Hook.
    pub hook: Hook,
    /// Priority.
    pub priority: i32,
}

impl BaseChain {
    /// The base chain Istio uses for iptables built-in chain `hook` of `table`.
    pub fn istio(table: Table, hook: Hook) -> Self {
        let (kind, priority) = match (table, hook) {
            (Table::Nat, Hook::Postrouting | Hook::Input) => (ChainType::Nat, 100),
            (Table::Nat, _) => (ChainType::Nat, -100),
            (Table::Mangle, Hook::Output) => (ChainType::Route, -150),
            (Table::Mangle, _) => (ChainType::Filter, -150),
            (Table::Raw, _) => (ChainType::Filter, -300),
            (Table::Filter, _) => (ChainType::Filter, 0),
        };
        Self { kind, hook, priority }
    }
}

/// A chain of a table; base chains carry their hook.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NftChain {
    /// Chain name.
    pub name: String,
    /// Hook, for base chains.
    pub base: Option<BaseChain>,
}

/// Where a rule goes when the transaction adds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Position {
    /// At the end of the chain (`add rule`).
    Append,
    /// Before the rule at this 0-based index (`insert rule ... index N`).
    Insert(u32),
}

/// One rule of a table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NftRule {
    /// Chain the rule belongs to.
    pub chain: String,
    /// Placement.
    pub position: Position,
    /// Statements in evaluation order.
    pub stmts: Vec<Stmt>,
}

/// One `inet` table: chains (base chains first) and rules in transaction order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NftTable {
    /// Table name, e.g. `istio-proxy-nat`.
    pub name: String,
    /// Chains in declaration order.
    pub chains: Vec<NftChain>,
    /// Rules in transaction order (inserts where they were generated).
    pub rules: Vec<NftRule>,
}

impl NftTable {
    /// Each chain with its rules in the order the kernel ends up holding them (inserts applied).
    pub fn chain_rules(&self) -> Vec<(&NftChain, Vec<&NftRule>)> {
        self.chains
            .iter()
            .map(|c| {
                let mut list: Vec<&NftRule> = Vec::new();
                for r in self.rules.iter().filter(|r| r.chain == c.name) {
                    match r.position {
                        Position::Insert(i) if (i as usize) < list.len() => list.insert(i as usize, r),
                        _ => list.push(r),
                    }
                }
                (c, list)
            })
            .collect()
    }
}

/// Every table a plan programs, in Istio's order (nat, mangle, raw).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NftLayout {
    /// The tables (only those with rules).
    pub tables: Vec<NftTable>,
}

/// The table names a prefix can own, so stale tables of any of them can be replaced or removed.
pub fn owned_tables(prefix: &str) -> Vec<String> {
    TABLE_ORDER.iter().map(|t| table_name(prefix, *t)).collect()
}

fn table_name(prefix: &str, table: Table) -> String {
    format!("{prefix}-{}", table.name())
}

/// Istio's nftables name of an iptables chain: built-ins by hook, `ISTIO_PRERT` as `istio-prerouting`, others
/// lower-case with dashes (`ISTIO_OUTPUT` → `istio-output`).
pub fn chain_name(iptables: &str) -> String {
    if let Some(hook) = Hook::of_builtin(iptables) {
        return hook.name().to_string();
    }
    match iptables {
        "ISTIO_PRERT" => "istio-prerouting".into(),
        "ISTIO_POSTRT" => "istio-postrouting".into(),
        other => other.to_lowercase().replace('_', "-"),
    }
}

impl NftLayout {
    /// The sidecar layout of `plan` (tables `istio-proxy-*`).
    pub fn sidecar(plan: &Plan) -> Result<Self, NftError> {
        Self::from_rulesets(SIDECAR_PREFIX, &plan.v4, plan.v6.as_ref())
    }

    /// Lays out `v4` and optional `v6` rules as `inet` tables named `<prefix>-<table>`.
    pub fn from_rulesets(prefix: &str, v4: &RuleSet, v6: Option<&RuleSet>) -> Result<Self, NftError> {
        let mut tables = Vec::new();
        for table in TABLE_ORDER {
            let r4 = v4.table(table).map(|t| t.rules.as_slice()).unwrap_or_default();
            let r6 = v6.and_then(|s| s.table(table)).map(|t| t.rules.as_slice()).unwrap_or_default();
            let merged = if v6.is_some() { merge(r4, r6) } else { r4.iter().map(|r| (r, Some(Family::V4))).collect() };
            if merged.is_empty() {
                continue;
            }
            tables.push(lay_out_table(&table_name(prefix, table), table, &merged)?);
        }
        Ok(Self { tables })
    }
}

fn lay_out_table(name: &str, table: Table, merged: &[Tagged<'_>]) -> Result<NftTable, NftError> {
    let mut rules = Vec::with_capacity(merged.len());
    let mut lengths: Vec<(String, u32)> = Vec::new();
    for &(rule, family) in merged {
        let chain = chain_name(&rule.chain);
        let len = match lengths.iter_mut().find(|(c, _)| *c == chain) {
            Some((_, len)) => len,
            None => {
                lengths.push((chain.clone(), 0));
                &mut lengths.last_mut().expect("just pushed").1
            }
        };
        // Istio writes an insert into an empty chain, or past its end, as an append.
        let position = match rule.op {
            Op::Insert(n) if n >= 1 && n - 1 < *len => Position::Insert(n - 1),
            _ => Position::Append,
        };
        *len += 1;
        let stmts = statements(rule, family).map_err(|what| NftError::Untranslatable {
            what,
            table: name.to_string(),
            chain: chain.clone(),
        })?;
        rules.push(NftRule { chain, position, stmts });
    }

    let mut chains: Vec<NftChain> = Vec::new();
    let builtin_order = [Hook::Prerouting, Hook::Input, Hook::Forward, Hook::Output, Hook::Postrouting];
    for hook in builtin_order {
        if rules.iter().any(|r| r.chain == hook.name()) {
            chains.push(NftChain { name: hook.name().into(), base: Some(BaseChain::istio(table, hook)) });
        }
    }
    let owners = merged.iter().map(|(r, _)| r.chain.as_str());
    let targets = merged.iter().filter_map(|(r, _)| match &r.target {
        Target::Jump(c) => Some(c.as_str()),
        _ => None,
    });
    for chain in owners.chain(targets).filter(|c| Hook::of_builtin(c).is_none()) {
        let chain = chain_name(chain);
        if !chains.iter().any(|c| c.name == chain) {
            chains.push(NftChain { name: chain, base: None });
        }
    }
    Ok(NftTable { name: name.to_string(), chains, rules })
}

/// Translates one rule's matches and target into statements, or names what has no translation.
fn statements(rule: &Rule, family: Option<Family>) -> Result<Vec<Stmt>, String> {
    let mut out = Vec::new();
    let mut proto: Option<Protocol> = None;
    for m in &rule.matches {
        let port = |port: u16, field: PortField, negate: bool| match proto {
            Some(p) => Ok(Stmt::Port { proto: p, field, port, negate }),
            None => Err(format!("port match without protocol: {m:?}")),
        };
        match m {
            Match::Protocol(p) => {
                proto = Some(*p);
                out.push(Stmt::L4proto(*p));
            }
            Match::Source { net, negate } => {
                out.push(Stmt::Addr { field: AddrField::Saddr, net: *net, negate: *negate })
            }
            Match::Destination { net, negate } => {
                out.push(Stmt::Addr { field: AddrField::Daddr, net: *net, negate: *negate })
            }
            Match::InInterface(n) => out.push(Stmt::Iifname(n.clone())),
            Match::OutInterface(n) => out.push(Stmt::Oifname(n.clone())),
            Match::DestPort { port: p, negate } => out.push(port(*p, PortField::Dport, *negate)?),
            Match::SourcePort { port: p, negate } => out.push(port(*p, PortField::Sport, *negate)?),
            // `! --dports a,b` is "none of them": one `!=` per port.
            Match::DestPorts { ports, negate: true } => {
                for p in ports {
                    out.push(port(*p, PortField::Dport, true)?);
                }
            }
            Match::DestPorts { ports, negate: false } if ports.len() == 1 => {
                out.push(port(ports[0], PortField::Dport, false)?)
            }
            Match::OwnerUid { id, negate } => out.push(Stmt::SkUid { id: id.clone(), negate: *negate }),
            Match::OwnerGid { id, negate } => out.push(Stmt::SkGid { id: id.clone(), negate: *negate }),
            Match::Mark { value, mask, negate } => out.push(Stmt::Mark { value: *value, mask: *mask, negate: *negate }),
            Match::Connmark { value, mask, negate } => {
                out.push(Stmt::CtMark { value: *value, mask: *mask, negate: *negate })
            }
            Match::Conntrack { states, negate } => out.push(Stmt::CtState { states: states.clone(), negate: *negate }),
            // Only loads the module; the protocol match before it already constrains the packet.
            Match::ProtocolModule(_) => {}
            Match::SourceHost { addr, negate } => {
                out.push(Stmt::Addr { field: AddrField::Saddr, net: IpNet::from(*addr), negate: *negate })
            }
            Match::DestinationHost { addr, negate } => {
                out.push(Stmt::Addr { field: AddrField::Daddr, net: IpNet::from(*addr), negate: *negate })
            }
            Match::NotOutInterface(n) => out.push(Stmt::NotOifname(n.clone())),
            Match::DestinationInSet(set) => match family {
                Some(family) => out.push(Stmt::AddrInSet { field: AddrField::Daddr, family, set: set.clone() }),
                None => return Err(format!("{m:?} in a rule shared by both families")),
            },
            Match::DestPorts { .. } | Match::SocketExists | Match::Socket { .. } => return Err(format!("{m:?}")),
        }
    }
    let action = match &rule.target {
        // TPROXY marks and accepts in one target; nft spells the mark and the verdict out.
        Target::Tproxy { mark, mask, port } => {
            out.push(Stmt::Tproxy { family, port: *port });
            out.push(Stmt::SetMark { value: *mark, mask: *mask });
            out.push(Stmt::Counter);
            out.push(Stmt::Accept);
            return Ok(out);
        }
        Target::Jump(c) => Stmt::Jump(chain_name(c)),
        Target::Return => Stmt::Return,
        Target::Accept => Stmt::Accept,
        Target::Drop => Stmt::Drop,
        Target::Redirect { port, .. } => Stmt::Redirect(*port),
        Target::SetMark(v) => Stmt::SetMark { value: *v, mask: u32::MAX },
        Target::SaveConnmark => Stmt::SaveMarkToCt,
        Target::RestoreConnmark => Stmt::RestoreMarkFromCt,
        Target::CtZone(z) => Stmt::SetCtZone(*z),
        Target::Snat(a) => Stmt::Snat(*a),
        Target::SetConnmark { value, mask } => Stmt::SetCtMarkMasked { value: *value, mask: *mask },
        Target::RestoreConnmarkMasked { nfmask: u32::MAX, ctmask: u32::MAX } => Stmt::RestoreMarkFromCt,
        Target::RestoreConnmarkMasked { .. } => return Err(format!("{:?}", rule.target)),
    };
    out.push(Stmt::Counter);
    out.push(action);
    Ok(out)
}

impl fmt::Display for NftLayout {
    /// The layout as an nft transaction (`nft -f` input) in the style of Istio's goldens: per table `add table`,
    /// `flush table`, `add chain` lines, then `add rule` / `insert rule ... index N` in generation order.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for t in &self.tables {
            writeln!(f, "add table inet {}", t.name)?;
            writeln!(f, "flush table inet {}", t.name)?;
            for c in &t.chains {
                match c.base {
                    Some(b) => writeln!(
                        f,
                        "add chain inet {} {} {{ type {} hook {} priority {} ; }}",
                        t.name,
                        c.name,
                        b.kind.name(),
                        b.hook.name(),
                        b.priority
                    )?,
                    None => writeln!(f, "add chain inet {} {}", t.name, c.name)?,
                }
            }
            for r in &t.rules {
                let stmts: Vec<String> = r.stmts.iter().map(Stmt::to_string).collect();
                match r.position {
                    Position::Append => writeln!(f, "add rule inet {} {} {}", t.name, r.chain, stmts.join(" "))?,
                    Position::Insert(i) => {
                        writeln!(f, "insert rule inet {} {} index {i} {}", t.name, r.chain, stmts.join(" "))?
                    }
                }
            }
        }
        Ok(())
    }
}

//! Typed, renderer-independent description of the packet-redirection rules we program.
//!
//! Matches and targets are semantic (not raw argument strings) so the same [`RuleSet`] can be rendered as
//! iptables-restore text today and translated to nftables over netlink later.

use std::net::{IpAddr, Ipv6Addr};

use ipnet::IpNet;

/// Address family a [`RuleSet`] applies to (iptables vs ip6tables).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Family {
    /// IPv4 (`iptables`).
    V4,
    /// IPv6 (`ip6tables`).
    V6,
}

impl std::fmt::Display for Family {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Family::V4 => "IPv4",
            Family::V6 => "IPv6",
        })
    }
}

/// Netfilter table. The declaration order is alphabetical, which is the order iptables payloads use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Table {
    /// `filter` table.
    Filter,
    /// `mangle` table.
    Mangle,
    /// `nat` table.
    Nat,
    /// `raw` table.
    Raw,
}

impl Table {
    /// Name of the table as iptables spells it.
    pub fn name(self) -> &'static str {
        match self {
            Table::Filter => "filter",
            Table::Mangle => "mangle",
            Table::Nat => "nat",
            Table::Raw => "raw",
        }
    }
}

/// Chains built into netfilter tables; they are never declared or deleted by us.
pub const BUILTIN_CHAINS: [&str; 5] = ["PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"];

/// Whether `chain` is a netfilter built-in chain (as opposed to an Istio-owned one).
pub fn is_builtin_chain(chain: &str) -> bool {
    BUILTIN_CHAINS.contains(&chain)
}

/// How a rule is placed in its chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Append at the end of the chain (`-A`).
    Append,
    /// Insert at a 1-based position (`-I CHAIN N`).
    Insert(u32),
}

/// Transport protocol match.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// TCP.
    Tcp,
    /// UDP.
    Udp,
}

impl Protocol {
    /// Lower-case protocol name.
    pub fn name(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
        }
    }
}

/// A user or group in an owner match: numeric, or a name resolved by the kernel tooling.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OwnerId {
    /// Numeric uid/gid.
    Id(u32),
    /// User or group name (e.g. from `ISTIO_OUTBOUND_OWNER_GROUPS`).
    Name(String),
}

impl std::fmt::Display for OwnerId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OwnerId::Id(id) => write!(f, "{id}"),
            OwnerId::Name(name) => f.write_str(name),
        }
    }
}

/// Conntrack state used by a [`Match::Conntrack`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CtState {
    /// `NEW`.
    New,
    /// `ESTABLISHED`.
    Established,
    /// `RELATED`.
    Related,
    /// `INVALID`.
    Invalid,
}

impl CtState {
    /// Upper-case state name.
    pub fn name(self) -> &'static str {
        match self {
            CtState::New => "NEW",
            CtState::Established => "ESTABLISHED",
            CtState::Related => "RELATED",
            CtState::Invalid => "INVALID",
        }
    }
}

/// One condition of a rule. Rules keep their matches in order; renderers emit them in that order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Match {
    /// Layer-4 protocol (`-p tcp`).
    Protocol(Protocol),
    /// Source address range (`[!] -s cidr`).
    Source {
        /// Range matched.
        net: IpNet,
        /// Match everything outside the range.
        negate: bool,
    },
    /// Destination address range (`[!] -d cidr`).
    Destination {
        /// Range matched.
        net: IpNet,
        /// Match everything outside the range.
        negate: bool,
    },
    /// Incoming interface (`-i name`).
    InInterface(String),
    /// Outgoing interface (`-o name`).
    OutInterface(String),
    /// Destination port of the protocol matched before (`[!] --dport n`).
    DestPort {
        /// Port.
        port: u16,
        /// Match every other port.
        negate: bool,
    },
    /// Source port of the protocol matched before (`[!] --sport n`).
    SourcePort {
        /// Port.
        port: u16,
        /// Match every other port.
        negate: bool,
    },
    /// Set of destination ports (`-m multiport [!] --dports a,b`).
    DestPorts {
        /// Ports, in order.
        ports: Vec<u16>,
        /// Match every port not in the set.
        negate: bool,
    },
    /// Socket owner user (`-m owner [!] --uid-owner x`).
    OwnerUid {
        /// User.
        id: OwnerId,
        /// Match sockets not owned by this user.
        negate: bool,
    },
    /// Socket owner group (`-m owner [!] --gid-owner x`).
    OwnerGid {
        /// Group.
        id: OwnerId,
        /// Match sockets not owned by this group.
        negate: bool,
    },
    /// Packet has a local socket (`-m owner --socket-exists`).
    SocketExists,
    /// Packet mark (`-m mark [!] --mark v[/mask]`).
    Mark {
        /// Value compared after masking.
        value: u32,
        /// Mask; `None` compares the whole mark.
        mask: Option<u32>,
        /// Match packets whose mark differs.
        negate: bool,
    },
    /// Connection mark (`-m connmark [!] --mark v[/mask]`).
    Connmark {
        /// Value compared after masking.
        value: u32,
        /// Mask; `None` compares the whole mark.
        mask: Option<u32>,
        /// Match connections whose mark differs.
        negate: bool,
    },
    /// Conntrack state (`-m conntrack [!] --ctstate A,B`).
    Conntrack {
        /// States, in order.
        states: Vec<CtState>,
        /// Match packets in none of the states.
        negate: bool,
    },
    /// An established or transparent socket exists for the packet (`-m socket [--transparent]`).
    Socket {
        /// Only sockets with IP_TRANSPARENT.
        transparent: bool,
    },
    /// Loads the match module of the protocol matched before (`-m tcp`, `-m udp`). No condition of its own:
    /// Istio spells it, and port options after it belong to it.
    ProtocolModule(Protocol),
    /// Source is one host, written without a prefix length (`[!] -s addr`).
    SourceHost {
        /// The host.
        addr: IpAddr,
        /// Match every other source.
        negate: bool,
    },
    /// Destination is one host, written without a prefix length (`[!] -d addr`).
    DestinationHost {
        /// The host.
        addr: IpAddr,
        /// Match every other destination.
        negate: bool,
    },
    /// Outgoing interface is not `name` (`! -o name`).
    NotOutInterface(String),
    /// Destination address is in the named set (`-m set --match-set NAME dst`; nftables `daddr @NAME`).
    DestinationInSet(String),
}

/// How the REDIRECT port option is spelled. Both mean the same; Istio uses both forms and the goldens pin them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RedirectSpelling {
    /// `--to-ports`.
    ToPorts,
    /// `--to-port`.
    ToPort,
}

/// What happens to a packet that matches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// Jump to another (Istio-owned) chain.
    Jump(String),
    /// Return to the calling chain.
    Return,
    /// Accept the packet.
    Accept,
    /// Drop the packet.
    Drop,
    /// Redirect to a local port (nat).
    Redirect {
        /// Local port.
        port: u16,
        /// Option spelling.
        spelling: RedirectSpelling,
    },
    /// Transparent proxy to a local port, marking the packet (mangle).
    Tproxy {
        /// Mark set on the packet.
        mark: u32,
        /// Mask applied with the mark.
        mask: u32,
        /// Local port.
        port: u16,
    },
    /// Set the packet mark (`MARK --set-mark`).
    SetMark(u32),
    /// Copy the packet mark into the connection mark (`CONNMARK --save-mark`).
    SaveConnmark,
    /// Copy the connection mark into the packet mark (`CONNMARK --restore-mark`).
    RestoreConnmark,
    /// Put the packet in a conntrack zone (`CT --zone n`, raw).
    CtZone(u16),
    /// Source NAT to an address (nat POSTROUTING).
    Snat(IpAddr),
    /// Replace the masked bits of the connection mark (`CONNMARK --set-xmark value/mask`).
    SetConnmark {
        /// New value of the masked bits.
        value: u32,
        /// Bits replaced.
        mask: u32,
    },
    /// Copy the connection mark into the packet mark through masks
    /// (`CONNMARK --restore-mark --nfmask N --ctmask C`).
    RestoreConnmarkMasked {
        /// Packet-mark bits kept (`--nfmask`).
        nfmask: u32,
        /// Connection-mark bits copied (`--ctmask`).
        ctmask: u32,
    },
}

/// One rule: where it goes, what it matches and what it does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    /// Append or insert.
    pub op: Op,
    /// Chain the rule lives in.
    pub chain: String,
    /// Conditions, in rendering order.
    pub matches: Vec<Match>,
    /// Action.
    pub target: Target,
}

impl Rule {
    /// An appended rule.
    pub fn append(chain: &str, matches: Vec<Match>, target: Target) -> Self {
        Self { op: Op::Append, chain: chain.to_string(), matches, target }
    }

    /// A rule inserted at 1-based `position`.
    pub fn insert(chain: &str, position: u32, matches: Vec<Match>, target: Target) -> Self {
        Self { op: Op::Insert(position), chain: chain.to_string(), matches, target }
    }
}

/// The rules of one table, with the Istio-owned chains the table declares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableRules {
    /// Which table.
    pub table: Table,
    /// Istio-owned chains, in declaration order: chains that own rules in the order of their first rule, then
    /// chains that are only jump targets.
    pub chains: Vec<String>,
    /// Rules in generation order.
    pub rules: Vec<Rule>,
}

/// Everything programmed for one address family: the non-empty tables in alphabetical order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleSet {
    /// Family the rules are for.
    pub family: Family,
    /// Non-empty tables, alphabetical.
    pub tables: Vec<TableRules>,
}

impl RuleSet {
    /// Groups `rules` (in generation order) by table and derives each table's chain declarations.
    pub fn from_rules(family: Family, rules: Vec<(Table, Rule)>) -> Self {
        let mut tables: Vec<TableRules> = Vec::new();
        for (table, rule) in rules {
            match tables.iter_mut().find(|t| t.table == table) {
                Some(t) => t.rules.push(rule),
                None => tables.push(TableRules { table, chains: Vec::new(), rules: vec![rule] }),
            }
        }
        for t in &mut tables {
            t.chains = declared_chains(&t.rules);
        }
        tables.sort_by_key(|t| t.table);
        Self { family, tables }
    }

    /// The rules of `table`, if the set touches it.
    pub fn table(&self, table: Table) -> Option<&TableRules> {
        self.tables.iter().find(|t| t.table == table)
    }
}

fn declared_chains(rules: &[Rule]) -> Vec<String> {
    let mut chains: Vec<String> = Vec::new();
    let owners = rules.iter().map(|r| r.chain.as_str());
    let targets = rules.iter().filter_map(|r| match &r.target {
        Target::Jump(c) => Some(c.as_str()),
        _ => None,
    });
    for chain in owners.chain(targets) {
        if !is_builtin_chain(chain) && !chains.iter().any(|c| c == chain) {
            chains.push(chain.to_string());
        }
    }
    chains
}

/// Formats a CIDR the way users (and Istio's goldens) write it: address as given, then the prefix length.
pub fn format_net(net: &IpNet) -> String {
    format!("{}/{}", format_addr(&net.addr()), net.prefix_len())
}

/// Formats an address; IPv4-compatible IPv6 addresses keep their dotted tail (`::127.0.0.53`), as written in
/// resolv.conf and Istio's goldens, where Rust's formatter would print `::7f00:35`.
pub fn format_addr(addr: &IpAddr) -> String {
    match addr {
        IpAddr::V4(a) => a.to_string(),
        IpAddr::V6(a) => format_v6(a),
    }
}

fn format_v6(a: &Ipv6Addr) -> String {
    let s = a.segments();
    if s[..6].iter().all(|&x| x == 0) && s[6] != 0 {
        let o = a.octets();
        return format!("::{}.{}.{}.{}", o[12], o[13], o[14], o[15]);
    }
    a.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v4_compatible_v6_keeps_dotted_tail() {
        assert_eq!(format_addr(&"::127.0.0.53".parse().unwrap()), "::127.0.0.53");
        assert_eq!(format_addr(&"::6".parse().unwrap()), "::6");
        assert_eq!(format_addr(&"::1".parse().unwrap()), "::1");
        assert_eq!(format_net(&"2001:db8::/32".parse().unwrap()), "2001:db8::/32");
        assert_eq!(format_net(&"127.0.0.1/8".parse().unwrap()), "127.0.0.1/8");
    }
}

//! Statements of an nftables rule: the semantic pieces a rule is encoded from (and printed as nft syntax).

use std::fmt;
use std::net::IpAddr;

use ipnet::IpNet;

use crate::model::{format_addr, format_net, CtState, Family, OwnerId, Protocol};

/// Which address of the network header a match reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AddrField {
    /// Source address.
    Saddr,
    /// Destination address.
    Daddr,
}

/// Which port of the transport header a match reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PortField {
    /// Source port.
    Sport,
    /// Destination port.
    Dport,
}

/// One statement of a rule: matches first, then counter and actions, as nft evaluates them in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stmt {
    /// `iifname NAME`.
    Iifname(String),
    /// `oifname NAME`.
    Oifname(String),
    /// `oifname != NAME`.
    NotOifname(String),
    /// `meta l4proto tcp|udp`.
    L4proto(Protocol),
    /// `ip|ip6 saddr|daddr [!=] net`; the family comes from the address.
    Addr {
        /// Header field.
        field: AddrField,
        /// Range matched.
        net: IpNet,
        /// Match everything outside the range.
        negate: bool,
    },
    /// `tcp|udp sport|dport [!=] port`; always preceded by an `L4proto` of the same protocol.
    Port {
        /// Transport protocol of the header.
        proto: Protocol,
        /// Header field.
        field: PortField,
        /// Port.
        port: u16,
        /// Match every other port.
        negate: bool,
    },
    /// `ip|ip6 saddr|daddr @SET`: the address is an element of a named set of the table.
    AddrInSet {
        /// Header field.
        field: AddrField,
        /// Family of the address (and of the set's key).
        family: Family,
        /// Set name.
        set: String,
    },
    /// `meta skuid [!=] id`.
    SkUid {
        /// User.
        id: OwnerId,
        /// Match other owners.
        negate: bool,
    },
    /// `meta skgid [!=] id`.
    SkGid {
        /// Group.
        id: OwnerId,
        /// Match other owners.
        negate: bool,
    },
    /// `meta mark [and MASK] [!=] value`.
    Mark {
        /// Value after masking.
        value: u32,
        /// Mask, `None` for the whole mark.
        mask: Option<u32>,
        /// Match other marks.
        negate: bool,
    },
    /// `ct mark [and MASK] [!=] value`.
    CtMark {
        /// Value after masking.
        value: u32,
        /// Mask, `None` for the whole mark.
        mask: Option<u32>,
        /// Match other marks.
        negate: bool,
    },
    /// `ct state [!=] a,b`.
    CtState {
        /// States, any of which matches.
        states: Vec<CtState>,
        /// Match packets in none of the states.
        negate: bool,
    },
    /// `counter`.
    Counter,
    /// `jump CHAIN`.
    Jump(String),
    /// `return`.
    Return,
    /// `accept`.
    Accept,
    /// `drop`.
    Drop,
    /// `redirect to :PORT`.
    Redirect(u16),
    /// `tproxy [ip|ip6] to :PORT`.
    Tproxy {
        /// Family of the rule (`None`: the packet's).
        family: Option<Family>,
        /// Local port.
        port: u16,
    },
    /// `meta mark set VALUE` (with a mask: `meta mark set meta mark and ~MASK xor VALUE`).
    SetMark {
        /// Bits to set.
        value: u32,
        /// Bits replaced; all ones replaces the whole mark.
        mask: u32,
    },
    /// `ct mark set ct mark & ~MASK | VALUE` (CONNMARK --set-xmark VALUE/MASK).
    SetCtMarkMasked {
        /// New value of the masked bits.
        value: u32,
        /// Bits replaced.
        mask: u32,
    },
    /// `ct mark set mark` (CONNMARK --save-mark).
    SaveMarkToCt,
    /// `meta mark set ct mark` (CONNMARK --restore-mark).
    RestoreMarkFromCt,
    /// `ct zone set ZONE`.
    SetCtZone(u16),
    /// `snat ip|ip6 to ADDR`.
    Snat(IpAddr),
}

fn neq(negate: bool) -> &'static str {
    if negate {
        "!= "
    } else {
        ""
    }
}

fn family_word(net: &IpNet) -> &'static str {
    match net {
        IpNet::V4(_) => "ip",
        IpNet::V6(_) => "ip6",
    }
}

fn masked(f: &mut fmt::Formatter<'_>, what: &str, value: u32, mask: Option<u32>, negate: bool) -> fmt::Result {
    match mask {
        Some(mask) => write!(f, "{what} and {mask:#x} {} {value:#x}", if negate { "!=" } else { "==" }),
        None => write!(f, "{what} {}{value}", neq(negate)),
    }
}

impl fmt::Display for Stmt {
    /// nft syntax, in the style of Istio's nftables transactions.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Stmt::Iifname(n) => write!(f, "iifname {n}"),
            Stmt::Oifname(n) => write!(f, "oifname {n}"),
            Stmt::NotOifname(n) => write!(f, "oifname != {n}"),
            Stmt::AddrInSet { field, family, set } => {
                let fam = match family {
                    Family::V4 => "ip",
                    Family::V6 => "ip6",
                };
                let field = match field {
                    AddrField::Saddr => "saddr",
                    AddrField::Daddr => "daddr",
                };
                write!(f, "{fam} {field} @{set}")
            }
            Stmt::L4proto(p) => write!(f, "meta l4proto {}", p.name()),
            Stmt::Addr { field, net, negate } => {
                let field = match field {
                    AddrField::Saddr => "saddr",
                    AddrField::Daddr => "daddr",
                };
                write!(f, "{} {field} {}{}", family_word(net), neq(*negate), format_net(net))
            }
            Stmt::Port { proto, field, port, negate } => {
                let field = match field {
                    PortField::Sport => "sport",
                    PortField::Dport => "dport",
                };
                write!(f, "{} {field} {}{port}", proto.name(), neq(*negate))
            }
            Stmt::SkUid { id, negate } => write!(f, "meta skuid {}{id}", neq(*negate)),
            Stmt::SkGid { id, negate } => write!(f, "meta skgid {}{id}", neq(*negate)),
            Stmt::Mark { value, mask, negate } => masked(f, "meta mark", *value, *mask, *negate),
            Stmt::CtMark { value, mask, negate } => masked(f, "ct mark", *value, *mask, *negate),
            Stmt::CtState { states, negate } => {
                let list: Vec<String> = states.iter().map(|s| s.name().to_lowercase()).collect();
                write!(f, "ct state {}{}", neq(*negate), list.join(","))
            }
            Stmt::Counter => f.write_str("counter"),
            Stmt::Jump(c) => write!(f, "jump {c}"),
            Stmt::Return => f.write_str("return"),
            Stmt::Accept => f.write_str("accept"),
            Stmt::Drop => f.write_str("drop"),
            Stmt::Redirect(port) => write!(f, "redirect to :{port}"),
            Stmt::Tproxy { family, port } => match family {
                Some(Family::V4) => write!(f, "tproxy ip to :{port}"),
                Some(Family::V6) => write!(f, "tproxy ip6 to :{port}"),
                None => write!(f, "tproxy to :{port}"),
            },
            Stmt::SetMark { value, mask: u32::MAX } => write!(f, "meta mark set {value}"),
            Stmt::SetMark { value, mask } => write!(f, "meta mark set meta mark and {:#x} xor {value:#x}", !mask),
            Stmt::SetCtMarkMasked { value, mask } => write!(f, "ct mark set ct mark & {:#x} | {value:#x}", !mask),
            Stmt::SaveMarkToCt => f.write_str("ct mark set mark"),
            Stmt::RestoreMarkFromCt => f.write_str("meta mark set ct mark"),
            Stmt::SetCtZone(z) => write!(f, "ct zone set {z}"),
            Stmt::Snat(addr) => {
                let fam = if addr.is_ipv4() { "ip" } else { "ip6" };
                write!(f, "snat {fam} to {}", format_addr(addr))
            }
        }
    }
}

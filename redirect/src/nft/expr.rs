//! Encodes rule [`Stmt`]s as nf_tables expressions (the kernel's register machine), the way nft does.
//!
//! Names (interfaces, chains, sets, owners) are checked with [`istio_contract::validate`] as they are encoded:
//! an interface name the kernel would not accept is an error, never cut to fit the 16-byte compare.

use ipnet::IpNet;
use istio_contract::validate::{self, MAX_INTERFACE_NAME, MAX_NFT_NAME};

use crate::model::{CtState, Family, OwnerId, Protocol};

use super::attr::Writer;
use super::stmt::{AddrField, PortField, Stmt};
use super::uapi::netfilter::{NFPROTO_IPV4, NFPROTO_IPV6, NFPROTO_UNSPEC, NF_ACCEPT, NF_DROP};
use super::uapi::nf_nat::NF_NAT_RANGE_PROTO_SPECIFIED;
use super::uapi::nf_tables::*;
use super::NftError;

/// IFNAMSIZ (linux/if.h): an interface name and its NUL.
const IFNAMSIZ: usize = 16;
// A valid name and its NUL always fit the compare.
const _: () = assert!(MAX_INTERFACE_NAME < IFNAMSIZ);

/// The kernel's name of the expression module `stmt` needs beyond the core ones, for error messages.
pub(super) fn feature(stmt: &Stmt) -> Option<&'static str> {
    Some(match stmt {
        Stmt::CtMark { .. }
        | Stmt::CtState { .. }
        | Stmt::SaveMarkToCt
        | Stmt::RestoreMarkFromCt
        | Stmt::SetCtMarkMasked { .. } => "conntrack expression (nft_ct)",
        Stmt::SetCtZone(_) => "conntrack zones (nft_ct, CONFIG_NF_CONNTRACK_ZONES)",
        Stmt::Redirect(_) => "redirect expression (nft_redir)",
        Stmt::Tproxy { .. } => "tproxy expression (nft_tproxy)",
        Stmt::Snat(_) => "nat expression (nft_nat)",
        _ => return None,
    })
}

/// Appends the expressions of `stmts` (inside NFTA_RULE_EXPRESSIONS).
pub(super) fn encode(w: &mut Writer, stmts: &[Stmt]) -> Result<(), NftError> {
    for s in stmts {
        stmt(w, s)?;
    }
    Ok(())
}

fn stmt(w: &mut Writer, s: &Stmt) -> Result<(), NftError> {
    match s {
        Stmt::Iifname(n) => ifname(w, NFT_META_IIFNAME, NFT_CMP_EQ, n)?,
        Stmt::Oifname(n) => ifname(w, NFT_META_OIFNAME, NFT_CMP_EQ, n)?,
        Stmt::NotOifname(n) => ifname(w, NFT_META_OIFNAME, NFT_CMP_NEQ, n)?,
        Stmt::AddrInSet { field, family, set } => {
            let set = validate::identifier(set, MAX_NFT_NAME)?;
            let (nfproto, offset, len) = match (family, field) {
                (Family::V4, AddrField::Saddr) => (NFPROTO_IPV4, 12, 4),
                (Family::V4, AddrField::Daddr) => (NFPROTO_IPV4, 16, 4),
                (Family::V6, AddrField::Saddr) => (NFPROTO_IPV6, 8, 16),
                (Family::V6, AddrField::Daddr) => (NFPROTO_IPV6, 24, 16),
            };
            meta_load(w, NFT_META_NFPROTO);
            cmp(w, NFT_CMP_EQ, &[nfproto]);
            payload(w, NFT_PAYLOAD_NETWORK_HEADER, offset, len);
            expr(w, "lookup", |w| {
                w.string(NFTA_LOOKUP_SET, set);
                w.be32(NFTA_LOOKUP_SREG, NFT_REG_1);
            });
        }
        Stmt::L4proto(p) => {
            meta_load(w, NFT_META_L4PROTO);
            cmp(w, NFT_CMP_EQ, &[proto_number(*p)]);
        }
        Stmt::Addr { field, net, negate } => addr(w, *field, net, *negate),
        Stmt::Port { field, port, negate, .. } => {
            let offset = match field {
                PortField::Sport => 0,
                PortField::Dport => 2,
            };
            payload(w, NFT_PAYLOAD_TRANSPORT_HEADER, offset, 2);
            cmp(w, op(*negate), &port.to_be_bytes());
        }
        Stmt::SkUid { id, negate } => {
            meta_load(w, NFT_META_SKUID);
            cmp(w, op(*negate), &resolve(id, "user")?.to_ne_bytes());
        }
        Stmt::SkGid { id, negate } => {
            meta_load(w, NFT_META_SKGID);
            cmp(w, op(*negate), &resolve(id, "group")?.to_ne_bytes());
        }
        Stmt::Mark { value, mask, negate } => {
            meta_load(w, NFT_META_MARK);
            masked_cmp(w, *value, *mask, *negate);
        }
        Stmt::CtMark { value, mask, negate } => {
            ct_load(w, NFT_CT_MARK);
            masked_cmp(w, *value, *mask, *negate);
        }
        Stmt::CtState { states, negate } => {
            let bits = states.iter().fold(0u32, |acc, s| acc | ct_state_bit(*s));
            ct_load(w, NFT_CT_STATE);
            bitwise(w, &bits.to_ne_bytes(), &[0; 4]);
            // Any of the states: (state & bits) != 0.
            cmp(w, if *negate { NFT_CMP_EQ } else { NFT_CMP_NEQ }, &[0; 4]);
        }
        Stmt::Counter => expr(w, "counter", |w| {
            w.be64(NFTA_COUNTER_BYTES, 0);
            w.be64(NFTA_COUNTER_PACKETS, 0);
        }),
        Stmt::Jump(chain) => verdict(w, NFT_JUMP as u32, Some(validate::identifier(chain, MAX_NFT_NAME)?)),
        Stmt::Return => verdict(w, NFT_RETURN as u32, None),
        Stmt::Accept => verdict(w, NF_ACCEPT, None),
        Stmt::Drop => verdict(w, NF_DROP, None),
        Stmt::Redirect(port) => {
            immediate(w, &port.to_be_bytes());
            expr(w, "redir", |w| {
                w.be32(NFTA_REDIR_REG_PROTO_MIN, NFT_REG_1);
                w.be32(NFTA_REDIR_FLAGS, NF_NAT_RANGE_PROTO_SPECIFIED);
            });
        }
        Stmt::Tproxy { family, port } => {
            immediate(w, &port.to_be_bytes());
            let nfproto = match family {
                Some(f) => nfproto(*f),
                None => NFPROTO_UNSPEC,
            };
            expr(w, "tproxy", |w| {
                w.be32(NFTA_TPROXY_FAMILY, u32::from(nfproto));
                w.be32(NFTA_TPROXY_REG_PORT, NFT_REG_1);
            });
        }
        Stmt::SetMark { value, mask } => {
            if *mask == u32::MAX {
                immediate(w, &value.to_ne_bytes());
            } else {
                meta_load(w, NFT_META_MARK);
                bitwise(w, &(!mask).to_ne_bytes(), &value.to_ne_bytes());
            }
            meta_set(w, NFT_META_MARK);
        }
        Stmt::SetCtMarkMasked { value, mask } => {
            ct_load(w, NFT_CT_MARK);
            bitwise(w, &(!mask).to_ne_bytes(), &value.to_ne_bytes());
            ct_set(w, NFT_CT_MARK);
        }
        Stmt::SaveMarkToCt => {
            meta_load(w, NFT_META_MARK);
            ct_set(w, NFT_CT_MARK);
        }
        Stmt::RestoreMarkFromCt => {
            ct_load(w, NFT_CT_MARK);
            meta_set(w, NFT_META_MARK);
        }
        Stmt::SetCtZone(zone) => {
            immediate(w, &zone.to_ne_bytes());
            ct_set(w, NFT_CT_ZONE);
        }
        Stmt::Snat(addr) => {
            let (family, bytes) = match addr {
                std::net::IpAddr::V4(a) => (NFPROTO_IPV4, a.octets().to_vec()),
                std::net::IpAddr::V6(a) => (NFPROTO_IPV6, a.octets().to_vec()),
            };
            immediate(w, &bytes);
            expr(w, "nat", |w| {
                w.be32(NFTA_NAT_TYPE, NFT_NAT_SNAT);
                w.be32(NFTA_NAT_FAMILY, u32::from(family));
                w.be32(NFTA_NAT_REG_ADDR_MIN, NFT_REG_1);
            });
        }
    }
    Ok(())
}

fn op(negate: bool) -> u32 {
    if negate {
        NFT_CMP_NEQ
    } else {
        NFT_CMP_EQ
    }
}

fn proto_number(p: Protocol) -> u8 {
    match p {
        Protocol::Tcp => 6,
        Protocol::Udp => 17,
    }
}

fn nfproto(f: Family) -> u8 {
    match f {
        Family::V4 => NFPROTO_IPV4,
        Family::V6 => NFPROTO_IPV6,
    }
}

/// Bits of `ct state` (NF_CT_STATE_BIT(IP_CT_*), NF_CT_STATE_INVALID_BIT).
fn ct_state_bit(s: CtState) -> u32 {
    match s {
        CtState::Invalid => 1,
        CtState::Established => 2,
        CtState::Related => 4,
        CtState::New => 8,
    }
}

fn resolve(id: &OwnerId, kind: &'static str) -> Result<u32, NftError> {
    let name = match id {
        OwnerId::Id(n) => return Ok(*n),
        OwnerId::Name(name) => validate::identifier(name, MAX_NFT_NAME)?,
    };
    let unknown = || NftError::UnknownOwner { kind, name: name.to_owned() };
    let found = match kind {
        "user" => nix::unistd::User::from_name(name).ok().flatten().map(|u| u.uid.as_raw()),
        _ => nix::unistd::Group::from_name(name).ok().flatten().map(|g| g.gid.as_raw()),
    };
    found.ok_or_else(unknown)
}

fn expr(w: &mut Writer, name: &str, data: impl FnOnce(&mut Writer)) {
    w.nest(NFTA_LIST_ELEM, |w| {
        w.string(NFTA_EXPR_NAME, name);
        w.nest(NFTA_EXPR_DATA, data);
    });
}

fn data_value(w: &mut Writer, ty: u16, bytes: &[u8]) {
    w.nest(ty, |w| w.put(NFTA_DATA_VALUE, bytes));
}

fn meta_load(w: &mut Writer, key: u32) {
    expr(w, "meta", |w| {
        w.be32(NFTA_META_DREG, NFT_REG_1);
        w.be32(NFTA_META_KEY, key);
    });
}

fn meta_set(w: &mut Writer, key: u32) {
    expr(w, "meta", |w| {
        w.be32(NFTA_META_KEY, key);
        w.be32(NFTA_META_SREG, NFT_REG_1);
    });
}

fn ct_load(w: &mut Writer, key: u32) {
    expr(w, "ct", |w| {
        w.be32(NFTA_CT_DREG, NFT_REG_1);
        w.be32(NFTA_CT_KEY, key);
    });
}

fn ct_set(w: &mut Writer, key: u32) {
    expr(w, "ct", |w| {
        w.be32(NFTA_CT_KEY, key);
        w.be32(NFTA_CT_SREG, NFT_REG_1);
    });
}

fn cmp(w: &mut Writer, op: u32, data: &[u8]) {
    expr(w, "cmp", |w| {
        w.be32(NFTA_CMP_SREG, NFT_REG_1);
        w.be32(NFTA_CMP_OP, op);
        data_value(w, NFTA_CMP_DATA, data);
    });
}

fn payload(w: &mut Writer, base: u32, offset: u32, len: u32) {
    expr(w, "payload", |w| {
        w.be32(NFTA_PAYLOAD_DREG, NFT_REG_1);
        w.be32(NFTA_PAYLOAD_BASE, base);
        w.be32(NFTA_PAYLOAD_OFFSET, offset);
        w.be32(NFTA_PAYLOAD_LEN, len);
    });
}

/// reg1 = (reg1 & mask) ^ xor, over `mask.len()` bytes.
fn bitwise(w: &mut Writer, mask: &[u8], xor: &[u8]) {
    expr(w, "bitwise", |w| {
        w.be32(NFTA_BITWISE_SREG, NFT_REG_1);
        w.be32(NFTA_BITWISE_DREG, NFT_REG_1);
        w.be32(NFTA_BITWISE_LEN, mask.len() as u32);
        data_value(w, NFTA_BITWISE_MASK, mask);
        data_value(w, NFTA_BITWISE_XOR, xor);
    });
}

fn immediate(w: &mut Writer, bytes: &[u8]) {
    expr(w, "immediate", |w| {
        w.be32(NFTA_IMMEDIATE_DREG, NFT_REG_1);
        data_value(w, NFTA_IMMEDIATE_DATA, bytes);
    });
}

fn verdict(w: &mut Writer, code: u32, chain: Option<&str>) {
    expr(w, "immediate", |w| {
        w.be32(NFTA_IMMEDIATE_DREG, NFT_REG_VERDICT);
        w.nest(NFTA_IMMEDIATE_DATA, |w| {
            w.nest(NFTA_DATA_VERDICT, |w| {
                w.be32(NFTA_VERDICT_CODE, code);
                if let Some(chain) = chain {
                    w.string(NFTA_VERDICT_CHAIN, chain);
                }
            })
        });
    });
}

/// The interface name NUL-padded to the kernel's 16 bytes; a name it would not accept is refused, not cut.
fn ifname_bytes(name: &str) -> Result<[u8; IFNAMSIZ], NftError> {
    let name = validate::interface_name(name)?;
    let mut bytes = [0u8; IFNAMSIZ];
    bytes[..name.len()].copy_from_slice(name.as_bytes());
    Ok(bytes)
}

/// `iifname|oifname [!=] NAME`.
fn ifname(w: &mut Writer, key: u32, op: u32, name: &str) -> Result<(), NftError> {
    let bytes = ifname_bytes(name)?;
    meta_load(w, key);
    cmp(w, op, &bytes);
    Ok(())
}

/// `ip[6] saddr|daddr [!=] net`: family check, then the (prefix-shortened or masked) address compare, as nft does.
fn addr(w: &mut Writer, field: AddrField, net: &IpNet, negate: bool) {
    let (family, offset, octets): (u8, u32, Vec<u8>) = match (net, field) {
        (IpNet::V4(n), AddrField::Saddr) => (NFPROTO_IPV4, 12, n.network().octets().to_vec()),
        (IpNet::V4(n), AddrField::Daddr) => (NFPROTO_IPV4, 16, n.network().octets().to_vec()),
        (IpNet::V6(n), AddrField::Saddr) => (NFPROTO_IPV6, 8, n.network().octets().to_vec()),
        (IpNet::V6(n), AddrField::Daddr) => (NFPROTO_IPV6, 24, n.network().octets().to_vec()),
    };
    meta_load(w, NFT_META_NFPROTO);
    cmp(w, NFT_CMP_EQ, &[family]);
    let prefix = usize::from(net.prefix_len());
    if prefix % 8 == 0 && prefix > 0 {
        let len = prefix / 8;
        payload(w, NFT_PAYLOAD_NETWORK_HEADER, offset, len as u32);
        cmp(w, op(negate), &octets[..len]);
    } else {
        payload(w, NFT_PAYLOAD_NETWORK_HEADER, offset, octets.len() as u32);
        let mask = match net {
            IpNet::V4(n) => n.netmask().octets().to_vec(),
            IpNet::V6(n) => n.netmask().octets().to_vec(),
        };
        bitwise(w, &mask, &vec![0; mask.len()]);
        cmp(w, op(negate), &octets);
    }
}

fn masked_cmp(w: &mut Writer, value: u32, mask: Option<u32>, negate: bool) {
    if let Some(mask) = mask.filter(|m| *m != u32::MAX) {
        bitwise(w, &mask.to_ne_bytes(), &[0; 4]);
    }
    cmp(w, op(negate), &value.to_ne_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encoded(stmts: &[Stmt]) -> Result<Vec<u8>, NftError> {
        let mut w = Writer::default();
        encode(&mut w, stmts)?;
        Ok(w.bytes().to_vec())
    }

    #[test]
    fn names_outside_the_allowed_set_are_refused_never_truncated() {
        let bad = [
            Stmt::Iifname("abcdefghijklmnop".into()),
            Stmt::Oifname("eth9\n-I OUTPUT -j ACCEPT".into()),
            Stmt::NotOifname("eth0 x".into()),
            Stmt::Iifname(String::new()),
            Stmt::Jump("istio-output\n".into()),
            Stmt::AddrInSet { field: AddrField::Daddr, family: Family::V4, set: "a b".into() },
            Stmt::SkGid { id: OwnerId::Name("g\n".into()), negate: false },
        ];
        for s in bad {
            assert!(matches!(encoded(std::slice::from_ref(&s)), Err(NftError::Refused(_))), "{s:?}");
        }
    }

    #[test]
    fn a_15_byte_interface_name_is_compared_whole_with_its_nul() {
        let bytes = encoded(&[Stmt::Iifname("abcdefghijklmno".into())]).unwrap();
        let needle = b"abcdefghijklmno\0";
        assert!(bytes.windows(needle.len()).any(|w| w == needle), "the whole name and its NUL are compared");
    }
}

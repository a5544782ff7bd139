//! Named address sets of an `inet` table (`type ipv4_addr` / `ipv6_addr`) whose elements carry a comment, over
//! netlink: create the sets with a base chain that uses them, add and delete elements, look one up by its address,
//! and dump them.

use std::io;
use std::net::IpAddr;

use netns::netlink::uapi::{NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_EXCL, NLM_F_REQUEST};

use super::attr::{attrs, c_string, ip_addr, Writer};
use super::layout::NftChain;
use super::msg::{transaction, Object};
use super::netlink_dump::{exchange, End, Steps};
use super::socket::commit;
use super::stmt::Stmt;
use super::uapi::netfilter::NFPROTO_INET;
use super::uapi::nf_tables::{
    NFTA_DATA_VALUE, NFTA_LIST_ELEM, NFTA_SET_ELEM_KEY, NFTA_SET_ELEM_LIST_ELEMENTS, NFTA_SET_ELEM_LIST_SET,
    NFTA_SET_ELEM_LIST_TABLE, NFTA_SET_ELEM_USERDATA, NFTA_SET_ID, NFTA_SET_KEY_LEN, NFTA_SET_KEY_TYPE, NFTA_SET_NAME,
    NFTA_SET_TABLE, NFTA_SET_USERDATA, NFT_MSG_DELSETELEM, NFT_MSG_GETSETELEM, NFT_MSG_NEWSET, NFT_MSG_NEWSETELEM,
};
use super::uapi::nfnetlink::NFNL_SUBSYS_NFTABLES;
use super::NftError;
use crate::model::Family;

/// nft's datatype numbers (TYPE_IPADDR, TYPE_IP6ADDR): what `nft list` prints the keys as.
const TYPE_IPADDR: u32 = 7;
const TYPE_IP6ADDR: u32 = 8;
/// libnftnl's element user-data TLV type of a comment (NFTNL_UDATA_SET_ELEM_COMMENT).
const UDATA_ELEM_COMMENT: u8 = 0;
/// libnftnl's set user-data TLV type of a comment (NFTNL_UDATA_SET_COMMENT).
const UDATA_SET_COMMENT: u8 = 7;
const FIRST_SEQ: u32 = 1;

/// A named address set of one family.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AddrSet {
    /// Set name.
    pub name: String,
    /// Family of its addresses.
    pub family: Family,
    /// The set's comment (`nft list` shows it), if any.
    pub comment: Option<String>,
}

/// One element: an address and its comment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Element {
    /// The address.
    pub addr: IpAddr,
    /// Its comment (Istio: the pod UID), if any.
    pub comment: Option<String>,
}

/// In one transaction of the calling thread's netns: creates `table` and `sets` unless they exist (their
/// elements are kept), creates `chain` unless it exists and replaces its rules with `rules`.
pub(crate) fn ensure(table: &str, sets: &[AddrSet], chain: &NftChain, rules: &[Vec<Stmt>]) -> Result<(), NftError> {
    let batch = transaction(FIRST_SEQ, |b| {
        b.new_table(table);
        for (i, set) in sets.iter().enumerate() {
            let (key_type, key_len) = match set.family {
                Family::V4 => (TYPE_IPADDR, 4),
                Family::V6 => (TYPE_IP6ADDR, 16),
            };
            let obj = Object { name: format!("set inet {table} {}", set.name), features: vec!["nf_tables sets"] };
            b.raw(NFT_MSG_NEWSET, NLM_F_CREATE, obj, |w| {
                w.string(NFTA_SET_TABLE, table);
                w.string(NFTA_SET_NAME, &set.name);
                w.be32(NFTA_SET_KEY_TYPE, key_type);
                w.be32(NFTA_SET_KEY_LEN, key_len);
                w.be32(NFTA_SET_ID, i as u32 + 1);
                if let Some(comment) = &set.comment {
                    w.put(NFTA_SET_USERDATA, &comment_udata(UDATA_SET_COMMENT, comment));
                }
            });
        }
        b.chain(table, chain);
        b.flush_chain(table, &chain.name);
        for (index, stmts) in rules.iter().enumerate() {
            b.rule(table, &chain.name, index, stmts)?;
        }
        Ok(())
    })?;
    commit(&batch)
}

/// In one transaction: deletes `delete` from `set`, then adds `add`. Adding an address that is already an
/// element keeps the old element (and its comment), so callers delete it in the same transaction to re-own it.
pub(crate) fn change(table: &str, set: &str, delete: &[Element], add: &[Element]) -> Result<(), NftError> {
    transact(table, set, delete, add, NLM_F_CREATE)
}

/// In one transaction: adds `add` to `set` if none of their addresses is an element yet (`nft create element`);
/// else the kernel refuses with EEXIST ([`NftError::is_already_exists`]) and nothing is applied. Neither reads
/// nor rewrites the set's other elements.
pub(crate) fn create(table: &str, set: &str, add: &[Element]) -> Result<(), NftError> {
    transact(table, set, &[], add, NLM_F_CREATE | NLM_F_EXCL)
}

fn transact(table: &str, set: &str, delete: &[Element], add: &[Element], add_flags: u16) -> Result<(), NftError> {
    if delete.is_empty() && add.is_empty() {
        return Ok(());
    }
    let batch = transaction(FIRST_SEQ, |b| {
        for (list, is_delete) in [(delete, true), (add, false)] {
            if list.is_empty() {
                continue;
            }
            let (msg, verb, flags) = if is_delete {
                (NFT_MSG_DELSETELEM, "delete", 0)
            } else if add_flags & NLM_F_EXCL != 0 {
                (NFT_MSG_NEWSETELEM, "create", add_flags)
            } else {
                (NFT_MSG_NEWSETELEM, "add", add_flags)
            };
            let addrs: Vec<String> = list.iter().map(|e| e.addr.to_string()).collect();
            let obj = Object {
                name: format!("{verb} element inet {table} {set} {{ {} }}", addrs.join(", ")),
                features: Vec::new(),
            };
            b.raw(msg, flags, obj, |w| {
                w.string(NFTA_SET_ELEM_LIST_TABLE, table);
                w.string(NFTA_SET_ELEM_LIST_SET, set);
                w.nest(NFTA_SET_ELEM_LIST_ELEMENTS, |w| {
                    for e in list {
                        w.nest(NFTA_LIST_ELEM, |w| element(w, e, is_delete));
                    }
                });
            });
        }
        Ok(())
    })?;
    commit(&batch)
}

fn element(w: &mut Writer, e: &Element, delete: bool) {
    let key = match e.addr {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    };
    w.nest(NFTA_SET_ELEM_KEY, |w| w.put(NFTA_DATA_VALUE, &key));
    if let (Some(comment), false) = (&e.comment, delete) {
        w.put(NFTA_SET_ELEM_USERDATA, &comment_udata(UDATA_ELEM_COMMENT, comment));
    }
}

/// libnftnl user data holding one comment: TLV type `ty`, length, the NUL-terminated comment (at most 254 bytes).
fn comment_udata(ty: u8, comment: &str) -> Vec<u8> {
    let mut text = comment.as_bytes()[..comment.len().min(254)].to_vec();
    text.push(0);
    let mut udata = vec![ty, text.len() as u8];
    udata.extend_from_slice(&text);
    udata
}

/// Every element of `set` in `table` of the calling thread's netns; `Ok(None)` if the set does not exist.
pub(crate) fn elements(table: &str, set: &str) -> Result<Option<Vec<Element>>, NftError> {
    let mut w = Writer::default();
    w.message((NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETSETELEM, NLM_F_REQUEST | NLM_F_DUMP, 1, NFPROTO_INET, 0, |w| {
        w.string(NFTA_SET_ELEM_LIST_TABLE, table);
        w.string(NFTA_SET_ELEM_LIST_SET, set);
    });
    let steps = Steps { send: "send set element dump request", receive: "receive set element dump" };
    let mut out = Vec::new();
    match exchange(w.bytes(), steps, |_, msg| parse_elements(msg, &mut out))? {
        End::Done | End::Errno(0) => Ok(Some(out)),
        End::Errno(libc::ENOENT) => Ok(None),
        End::Errno(errno) => Err(NftError::Rejected {
            object: format!("dump of set inet {table} {set}"),
            source: io::Error::from_raw_os_error(errno),
        }),
    }
}

/// The element of `set` in `table` (calling thread's netns) whose address is `addr`, with its comment; `Ok(None)`
/// if there is none (or no such set). One request for one key (`nft get element`): the cost does not grow with
/// the set's size, as a dump's does.
pub(crate) fn element_of(table: &str, set: &str, addr: IpAddr) -> Result<Option<Element>, NftError> {
    let mut w = Writer::default();
    let key = Element { addr, comment: None };
    w.message((NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETSETELEM, NLM_F_REQUEST | NLM_F_ACK, 1, NFPROTO_INET, 0, |w| {
        w.string(NFTA_SET_ELEM_LIST_TABLE, table);
        w.string(NFTA_SET_ELEM_LIST_SET, set);
        w.nest(NFTA_SET_ELEM_LIST_ELEMENTS, |w| w.nest(NFTA_LIST_ELEM, |w| element(w, &key, true)));
    });
    let steps = Steps { send: "send set element get request", receive: "receive set element" };
    let mut out = Vec::new();
    match exchange(w.bytes(), steps, |_, msg| parse_elements(msg, &mut out))? {
        End::Done | End::Errno(0) => Ok(out.into_iter().find(|e| e.addr == addr)),
        End::Errno(libc::ENOENT) => Ok(None),
        End::Errno(errno) => Err(NftError::Rejected {
            object: format!("get element inet {table} {set} {{ {addr} }}"),
            source: io::Error::from_raw_os_error(errno),
        }),
    }
}

fn parse_elements(msg: &[u8], out: &mut Vec<Element>) {
    for (_, list) in attrs(msg).filter(|(t, _)| *t == NFTA_SET_ELEM_LIST_ELEMENTS) {
        for (_, elem) in attrs(list).filter(|(t, _)| *t == NFTA_LIST_ELEM) {
            let mut addr = None;
            let mut comment = None;
            for (ty, value) in attrs(elem) {
                match ty {
                    NFTA_SET_ELEM_KEY => {
                        addr = attrs(value).find(|(t, _)| *t == NFTA_DATA_VALUE).and_then(|(_, v)| ip_addr(v));
                    }
                    NFTA_SET_ELEM_USERDATA => comment = udata_comment(value),
                    _ => {}
                }
            }
            if let Some(addr) = addr {
                out.push(Element { addr, comment });
            }
        }
    }
}

fn udata_comment(mut data: &[u8]) -> Option<String> {
    while data.len() >= 2 {
        let (ty, len) = (data[0], usize::from(data[1]));
        let value = data.get(2..2 + len)?;
        if ty == UDATA_ELEM_COMMENT {
            return Some(c_string(value));
        }
        data = &data[2 + len..];
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comment_user_data_round_trips() {
        let mut w = Writer::default();
        let e = Element { addr: "10.1.2.3".parse().unwrap(), comment: Some("uid-1".into()) };
        w.nest(NFTA_LIST_ELEM, |w| element(w, &e, false));
        let mut msg = Writer::default();
        msg.nest(NFTA_SET_ELEM_LIST_ELEMENTS, |m| m.put_raw(w.bytes()));
        let mut out = Vec::new();
        parse_elements(msg.bytes(), &mut out);
        assert_eq!(out, vec![e]);
    }
}

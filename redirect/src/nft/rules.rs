//! Reading back the rules of our `inet` tables (one NFT_MSG_GETRULE dump), so drift can be told from a
//! healthy netns without any binary.
//!
//! The kernel hands back expressions in its own canonical form (registers renumbered, defaults filled in,
//! counters with values), which is not what we sent. So every rule we add carries a tag in its user data: a
//! digest of its table, chain and statements as text ([`rule_tag`]). The kernel keeps user data verbatim, so a
//! rule read back with the tag of an expected rule is that rule; one without a known tag was added or replaced
//! by someone else. `nft` ignores user-data TLV types it does not know, so `nft list` output is unchanged.

use std::io;

use super::attr::{attrs, c_string, Writer};
use super::netlink_dump::{exchange, End, Steps, NLM_F_DUMP, NLM_F_REQUEST};
use super::NftError;

const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFT_MSG_GETRULE: u16 = 7;
const NFTA_RULE_TABLE: u16 = 1;
const NFTA_RULE_CHAIN: u16 = 2;
const NFTA_RULE_EXPRESSIONS: u16 = 4;
/// NFTA_RULE_USERDATA: opaque bytes the kernel stores with the rule and dumps back unchanged.
pub(super) const NFTA_RULE_USERDATA: u16 = 7;
const NFTA_LIST_ELEM: u16 = 1;
const NFTA_EXPR_NAME: u16 = 1;
const NFPROTO_INET: u8 = 1;
/// Our user-data TLV type. libnftnl uses 0 (comment) and 1 (ebtables policy) for rules; nft skips other types.
const UDATA_RULE_TAG: u8 = 0xc7;
const TAG_LEN: u8 = 8;

/// A rule of an `inet` table as the kernel holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleEntry {
    /// Table name.
    pub table: String,
    /// Chain name.
    pub chain: String,
    /// Our tag ([`rule_tag`]) if the rule carries one.
    pub tag: Option<u64>,
    /// Names of its expressions in order (`meta`, `cmp`, `immediate`, ...), to describe a rule we did not add.
    pub exprs: Vec<String>,
}

/// The tag of a rule: FNV-1a 64 of `table chain statements`, the statements as `nft` text.
pub fn rule_tag(table: &str, chain: &str, stmts_text: &str) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in table.bytes().chain([b' ']).chain(chain.bytes()).chain([b' ']).chain(stmts_text.bytes()) {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    hash
}

/// Writes the user-data attribute carrying `tag` into a rule message.
pub(super) fn put_tag(w: &mut Writer, tag: u64) {
    let mut data = vec![UDATA_RULE_TAG, TAG_LEN];
    data.extend_from_slice(&tag.to_be_bytes());
    w.put(NFTA_RULE_USERDATA, &data);
}

/// Our tag in a rule's user data (a list of type-length-value items), if present.
fn tag_of(mut udata: &[u8]) -> Option<u64> {
    while udata.len() >= 2 {
        let (ty, len) = (udata[0], usize::from(udata[1]));
        let value = udata.get(2..2 + len)?;
        if ty == UDATA_RULE_TAG && len == usize::from(TAG_LEN) {
            return Some(u64::from_be_bytes(value.try_into().ok()?));
        }
        udata = &udata[2 + len..];
    }
    None
}

/// Every rule of every `inet` table of the calling thread's netns whose table `keep` accepts, in the kernel's
/// order (per table, per chain, in chain order): one dump.
pub(crate) fn rules(keep: impl Fn(&str) -> bool) -> Result<Vec<RuleEntry>, NftError> {
    let mut w = Writer::default();
    w.message((NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETRULE, NLM_F_REQUEST | NLM_F_DUMP, 1, NFPROTO_INET, 0, |_| {});
    let steps = Steps { send: "send rule dump request", receive: "receive rule dump" };
    let mut out = Vec::new();
    let end = exchange(w.bytes(), steps, |family, msg| {
        if family != NFPROTO_INET {
            return;
        }
        let mut entry = RuleEntry { table: String::new(), chain: String::new(), tag: None, exprs: Vec::new() };
        for (ty, payload) in attrs(msg) {
            match ty {
                NFTA_RULE_TABLE => entry.table = c_string(payload),
                NFTA_RULE_CHAIN => entry.chain = c_string(payload),
                NFTA_RULE_USERDATA => entry.tag = tag_of(payload),
                NFTA_RULE_EXPRESSIONS => {
                    for (_, elem) in attrs(payload).filter(|(ty, _)| *ty == NFTA_LIST_ELEM) {
                        if let Some((_, name)) = attrs(elem).find(|(ty, _)| *ty == NFTA_EXPR_NAME) {
                            entry.exprs.push(c_string(name));
                        }
                    }
                }
                _ => {}
            }
        }
        if keep(&entry.table) {
            out.push(entry);
        }
    })?;
    match end {
        End::Done => Ok(out),
        // No table at all in the family: nothing to list.
        End::Errno(libc::ENOENT) => Ok(out),
        End::Errno(errno) => {
            Err(NftError::Rejected { object: "rule dump".into(), source: io::Error::from_raw_os_error(errno) })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tag_reads_back_among_other_user_data() {
        let mut w = Writer::default();
        put_tag(&mut w, 0x0102_0304_0506_0708);
        let (_, payload) = attrs(w.bytes()).next().unwrap();
        let mut udata = vec![0u8, 3, b'h', b'i', 0];
        udata.extend_from_slice(payload);
        assert_eq!(tag_of(&udata), Some(0x0102_0304_0506_0708));
        assert_eq!(tag_of(&[0, 200, 1]), None, "a truncated item ends the walk");
        assert_ne!(rule_tag("t", "c", "accept"), rule_tag("t", "c", "drop"));
    }
}

//! Reading back the rules of our `inet` tables (one NFT_MSG_GETRULE dump), so drift can be told from a
//! healthy netns without any binary.
//!
//! The kernel hands back expressions in its own canonical form, which is not what we sent, so each rule is
//! recognised by the tag in its user data ([`super::tag`]): a rule read back with the tag of an expected rule is
//! that rule; one without a known tag was added or replaced by someone else.

use std::io;

use netns::netlink::uapi::{NLM_F_DUMP, NLM_F_REQUEST};

use super::attr::{attrs, c_string, Writer};
use super::netlink_dump::{exchange, End, Steps};
use super::tag::tag_of;
use super::uapi::netfilter::NFPROTO_INET;
use super::uapi::nf_tables::{
    NFTA_EXPR_NAME, NFTA_LIST_ELEM, NFTA_RULE_CHAIN, NFTA_RULE_EXPRESSIONS, NFTA_RULE_TABLE, NFTA_RULE_USERDATA,
    NFT_MSG_GETRULE,
};
use super::uapi::nfnetlink::NFNL_SUBSYS_NFTABLES;
use super::NftError;

/// A rule of an `inet` table as the kernel holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleEntry {
    /// Table name.
    pub table: String,
    /// Chain name.
    pub chain: String,
    /// Our tag ([`super::tag::RuleText`]) if the rule carries one.
    pub tag: Option<u64>,
    /// Names of its expressions in order (`meta`, `cmp`, `immediate`, ...), to describe a rule we did not add.
    pub exprs: Vec<String>,
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

//! The tag every rule we add carries in its user data, and the one place a rule's text is spelled for it.
//!
//! The kernel hands rules back in its own canonical form (registers renumbered, defaults filled in, counters with
//! values), which is not what we sent, so a rule is recognised by its tag: FNV-1a 64 of `table chain statements`,
//! the statements as `nft` text ([`RuleText`]). The batch that adds a rule ([`super::msg`]) and the inspection that
//! expects it (`crate::inspect`) both take the text and the tag from here, so they cannot disagree: if they did,
//! every rule would read as drift. The kernel keeps user data verbatim; `nft` ignores user-data TLV types it does
//! not know, so `nft list` output is unchanged.

use super::attr::Writer;
use super::stmt::Stmt;
use super::uapi::nf_tables::NFTA_RULE_USERDATA;

/// Our user-data TLV type. libnftnl uses 0 (comment) and 1 (ebtables policy) for rules; nft skips other types.
const UDATA_RULE_TAG: u8 = 0xc7;
const TAG_LEN: u8 = 8;

/// A rule's statements as `nft` text, and its tag in `table`/`chain`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleText {
    /// The statements as `nft list` would show them, space-separated.
    pub text: String,
    /// The digest carried in the rule's user data.
    pub tag: u64,
}

impl RuleText {
    /// The text and tag of the rule `stmts` in chain `chain` of table `table`.
    pub fn new(table: &str, chain: &str, stmts: &[Stmt]) -> Self {
        let text = stmts.iter().map(ToString::to_string).collect::<Vec<_>>().join(" ");
        let tag = digest(table, chain, &text);
        Self { text, tag }
    }

    /// `inet TABLE CHAIN STATEMENTS`, as an inspection report lists the rule.
    pub fn line(&self, table: &str, chain: &str) -> String {
        format!("inet {table} {chain} {}", self.text)
    }
}

/// FNV-1a 64 of `table chain text`.
fn digest(table: &str, chain: &str, text: &str) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in table.bytes().chain([b' ']).chain(chain.bytes()).chain([b' ']).chain(text.bytes()) {
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

/// Our tag in a rule's user data (a list of type-length-value items), if present. A truncated item ends the walk.
pub(super) fn tag_of(mut udata: &[u8]) -> Option<u64> {
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

#[cfg(test)]
mod tests {
    use super::super::attr::attrs;
    use super::*;

    #[test]
    fn the_tag_reads_back_among_other_user_data() {
        let mut w = Writer::default();
        put_tag(&mut w, 0x0102_0304_0506_0708);
        let (_, udata) = attrs(w.bytes()).next().expect("one attribute");
        let udata = [&[0u8, 3, b'a', b'b', b'c'][..], udata].concat();
        assert_eq!(tag_of(&udata), Some(0x0102_0304_0506_0708));
        assert_eq!(tag_of(&[0, 200, 1]), None, "a truncated item ends the walk");
    }

    #[test]
    fn the_tag_covers_table_chain_and_statements() {
        let accept = RuleText::new("t", "c", &[Stmt::Accept]);
        assert_eq!(accept.text, "accept");
        assert_ne!(accept.tag, RuleText::new("t", "c", &[Stmt::Drop]).tag);
        assert_ne!(accept.tag, RuleText::new("t", "d", &[Stmt::Accept]).tag);
        assert_ne!(accept.tag, RuleText::new("u", "c", &[Stmt::Accept]).tag);
        assert_eq!(accept.line("t", "c"), "inet t c accept");
    }
}

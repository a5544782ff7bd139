//! Builds the nfnetlink batch (one transaction) that replaces our tables with a layout, or removes them.

use netns::netlink::uapi::{NLM_F_ACK, NLM_F_APPEND, NLM_F_CREATE, NLM_F_EXCL, NLM_F_REQUEST};

use super::attr::Writer;
use super::expr::{encode, feature};
use super::layout::{ChainType, NftChain, NftLayout, NftTable};
use super::stmt::Stmt;
use super::tag::{put_tag, RuleText};
use super::uapi::netfilter::{NFPROTO_INET, NF_ACCEPT};
use super::uapi::nf_tables::{
    NFTA_CHAIN_HOOK, NFTA_CHAIN_NAME, NFTA_CHAIN_POLICY, NFTA_CHAIN_TABLE, NFTA_CHAIN_TYPE, NFTA_HOOK_HOOKNUM,
    NFTA_HOOK_PRIORITY, NFTA_RULE_CHAIN, NFTA_RULE_EXPRESSIONS, NFTA_RULE_TABLE, NFTA_TABLE_FLAGS, NFTA_TABLE_NAME,
    NFT_MSG_DELRULE, NFT_MSG_DELTABLE, NFT_MSG_NEWCHAIN, NFT_MSG_NEWRULE, NFT_MSG_NEWTABLE,
};
use super::uapi::nfnetlink::{NFNL_MSG_BATCH_BEGIN, NFNL_MSG_BATCH_END, NFNL_SUBSYS_NFTABLES};
use super::NftError;

/// AF_UNSPEC (linux/socket.h): the family of the batch begin and end messages.
const AF_UNSPEC: u8 = 0;

/// What a message of the batch creates or deletes, so a kernel error can name it.
#[derive(Debug, Clone)]
pub(super) struct Object {
    /// Human-readable name, e.g. `rule 2 of inet istio-proxy-nat istio-output (... )`.
    pub(super) name: String,
    /// Kernel features the object needs beyond the nf_tables core; named when the kernel says it lacks one.
    pub(super) features: Vec<&'static str>,
}

/// An encoded batch and, per acknowledged sequence number (from `first_seq` on), the object it carries.
pub(super) struct Batch {
    pub(super) writer: Writer,
    pub(super) first_seq: u32,
    pub(super) objects: Vec<Object>,
}

impl Batch {
    fn new(first_seq: u32) -> Self {
        let mut writer = Writer::default();
        writer.message(NFNL_MSG_BATCH_BEGIN, NLM_F_REQUEST, first_seq, AF_UNSPEC, NFNL_SUBSYS_NFTABLES, |_| {});
        Self { writer, first_seq: first_seq + 1, objects: Vec::new() }
    }

    fn add(&mut self, msg: u16, flags: u16, object: Object, body: impl FnOnce(&mut Writer)) {
        let seq = self.first_seq + self.objects.len() as u32;
        let ty = (NFNL_SUBSYS_NFTABLES << 8) | msg;
        self.writer.message(ty, NLM_F_REQUEST | NLM_F_ACK | flags, seq, NFPROTO_INET, 0, body);
        self.objects.push(object);
    }

    fn finish(mut self) -> Self {
        let seq = self.first_seq + self.objects.len() as u32;
        self.writer.message(NFNL_MSG_BATCH_END, NLM_F_REQUEST, seq, AF_UNSPEC, NFNL_SUBSYS_NFTABLES, |_| {});
        self
    }

    /// `add table` then `delete table`: removes the table whether or not it exists, inside the transaction.
    fn drop_table(&mut self, name: &str) {
        let obj =
            |what: &str| Object { name: format!("{what} table inet {name}"), features: vec!["nf_tables inet family"] };
        self.add(NFT_MSG_NEWTABLE, NLM_F_CREATE, obj("add"), |w| {
            w.string(NFTA_TABLE_NAME, name);
            w.be32(NFTA_TABLE_FLAGS, 0);
        });
        self.add(NFT_MSG_DELTABLE, 0, obj("delete"), |w| w.string(NFTA_TABLE_NAME, name));
    }

    fn table(&mut self, t: &NftTable, exclusive: bool) -> Result<(), NftError> {
        if exclusive {
            let obj = Object { name: format!("table inet {} (new)", t.name), features: vec!["nf_tables inet family"] };
            self.add(NFT_MSG_NEWTABLE, NLM_F_CREATE | NLM_F_EXCL, obj, |w| {
                w.string(NFTA_TABLE_NAME, &t.name);
                w.be32(NFTA_TABLE_FLAGS, 0);
            });
        } else {
            self.new_table(&t.name);
        }
        for c in &t.chains {
            self.chain(&t.name, c);
        }
        // Rules go in the final order of each chain, so the kernel never needs rule positions.
        for (chain, rules) in t.chain_rules() {
            for (index, rule) in rules.into_iter().enumerate() {
                self.rule(&t.name, &chain.name, index, &rule.stmts)?;
            }
        }
        Ok(())
    }

    /// `add table inet NAME` (an existing table is kept as it is).
    pub(super) fn new_table(&mut self, name: &str) {
        let obj = Object { name: format!("table inet {name}"), features: vec!["nf_tables inet family"] };
        self.add(NFT_MSG_NEWTABLE, NLM_F_CREATE, obj, |w| {
            w.string(NFTA_TABLE_NAME, name);
            w.be32(NFTA_TABLE_FLAGS, 0);
        });
    }

    /// `add chain inet TABLE NAME [{ type hook priority }]` (an existing chain with the same hook is kept).
    pub(super) fn chain(&mut self, table: &str, c: &NftChain) {
        let features = match c.base.map(|b| b.kind) {
            Some(ChainType::Nat) => vec!["nat chains (nft_chain_nat)"],
            Some(ChainType::Route) => vec!["route chains (nft_chain_route)"],
            _ => Vec::new(),
        };
        let obj = Object { name: format!("chain inet {table} {}", c.name), features };
        self.add(NFT_MSG_NEWCHAIN, NLM_F_CREATE, obj, |w| {
            w.string(NFTA_CHAIN_TABLE, table);
            w.string(NFTA_CHAIN_NAME, &c.name);
            if let Some(b) = c.base {
                w.nest(NFTA_CHAIN_HOOK, |w| {
                    w.be32(NFTA_HOOK_HOOKNUM, b.hook.number());
                    w.be32(NFTA_HOOK_PRIORITY, b.priority as u32);
                });
                w.be32(NFTA_CHAIN_POLICY, NF_ACCEPT);
                w.string(NFTA_CHAIN_TYPE, b.kind.name());
            }
        });
    }

    /// `flush chain inet TABLE CHAIN`: deletes every rule of the chain.
    pub(super) fn flush_chain(&mut self, table: &str, chain: &str) {
        let obj = Object { name: format!("flush chain inet {table} {chain}"), features: Vec::new() };
        self.add(NFT_MSG_DELRULE, 0, obj, |w| {
            w.string(NFTA_RULE_TABLE, table);
            w.string(NFTA_RULE_CHAIN, chain);
        });
    }

    /// `add rule inet TABLE CHAIN STMTS` at the end of the chain; `index` only names it in errors.
    pub(super) fn rule(&mut self, table: &str, chain: &str, index: usize, stmts: &[Stmt]) -> Result<(), NftError> {
        let RuleText { text, tag } = RuleText::new(table, chain, stmts);
        let mut features: Vec<&'static str> = stmts.iter().filter_map(feature).collect();
        features.dedup();
        let obj = Object { name: format!("rule {index} of inet {table} {chain} ({text})"), features };
        let mut encoded = Ok(());
        self.add(NFT_MSG_NEWRULE, NLM_F_CREATE | NLM_F_APPEND, obj, |w| {
            w.string(NFTA_RULE_TABLE, table);
            w.string(NFTA_RULE_CHAIN, chain);
            w.nest(NFTA_RULE_EXPRESSIONS, |w| encoded = encode(w, stmts));
            // Lets a later inspection recognise the rule (see `rules`).
            put_tag(w, tag);
        });
        encoded
    }

    /// Sends one more message of subsystem nf_tables with a custom body (sets and elements).
    pub(super) fn raw(&mut self, msg: u16, flags: u16, object: Object, body: impl FnOnce(&mut Writer)) {
        self.add(msg, flags, object, body);
    }
}

/// One transaction built by `body` (between batch begin and end).
pub(super) fn transaction(
    first_seq: u32,
    body: impl FnOnce(&mut Batch) -> Result<(), NftError>,
) -> Result<Batch, NftError> {
    let mut batch = Batch::new(first_seq);
    body(&mut batch)?;
    Ok(batch.finish())
}

/// One transaction: drop every table in `owned` (existing or not), then create the layout's tables.
pub(super) fn replace(first_seq: u32, owned: &[String], layout: &NftLayout) -> Result<Batch, NftError> {
    let mut batch = Batch::new(first_seq);
    for name in owned {
        batch.drop_table(name);
    }
    for t in &layout.tables {
        batch.table(t, false)?;
    }
    Ok(batch.finish())
}

/// One transaction that only creates the layout's tables, failing with EEXIST if any of them exists. Used when
/// none of our tables exist: a batch without deletions leaves the kernel no transaction to destroy after an RCU
/// grace period, so closing the socket does not wait for one (see [`super::apply`]).
pub(super) fn create(first_seq: u32, layout: &NftLayout) -> Result<Batch, NftError> {
    let mut batch = Batch::new(first_seq);
    for t in &layout.tables {
        batch.table(t, true)?;
    }
    Ok(batch.finish())
}

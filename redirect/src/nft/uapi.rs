//! The kernel's netfilter numbers that the nf_tables and ipset netlink code sends and reads, each spelled once,
//! under its kernel name, in a module named after the uapi header it comes from. Netlink's own numbers
//! (`NLMSG_*`, `NLM_F_*`, `NLA_F_*`) are `netns::netlink::uapi`'s. The unit tests pin every number the `libc`
//! crate also carries to libc's copy of the headers (message types, verdicts, families, hooks, registers, keys;
//! libc has no `NFTA_*` attributes, no ipset and no nf_nat numbers: those are checked only by running against
//! the kernel, in `tests/nft.rs` and the e2e runs).
//!
//! Not here: nft's userspace datatypes and libnftnl's user-data TLV types (they are not the kernel's; `set` and
//! `tag` hold them), and the rule tag's own TLV type (ours).

/// `linux/netfilter.h`: verdicts and protocol families.
pub(crate) mod netfilter {
    /// `NF_DROP`.
    pub(crate) const NF_DROP: u32 = 0;
    /// `NF_ACCEPT`.
    pub(crate) const NF_ACCEPT: u32 = 1;
    /// `NFPROTO_UNSPEC`.
    pub(crate) const NFPROTO_UNSPEC: u8 = 0;
    /// `NFPROTO_INET`: the dual-stack family of all our tables.
    pub(crate) const NFPROTO_INET: u8 = 1;
    /// `NFPROTO_IPV4`.
    pub(crate) const NFPROTO_IPV4: u8 = 2;
    /// `NFPROTO_IPV6`.
    pub(crate) const NFPROTO_IPV6: u8 = 10;
    /// `NF_INET_PRE_ROUTING`.
    pub(crate) const NF_INET_PRE_ROUTING: u32 = 0;
    /// `NF_INET_LOCAL_IN`.
    pub(crate) const NF_INET_LOCAL_IN: u32 = 1;
    /// `NF_INET_FORWARD`.
    pub(crate) const NF_INET_FORWARD: u32 = 2;
    /// `NF_INET_LOCAL_OUT`.
    pub(crate) const NF_INET_LOCAL_OUT: u32 = 3;
    /// `NF_INET_POST_ROUTING`.
    pub(crate) const NF_INET_POST_ROUTING: u32 = 4;
}

/// `linux/netfilter/nfnetlink.h`: subsystems and batches of NETLINK_NETFILTER.
pub(crate) mod nfnetlink {
    /// `NFNL_SUBSYS_IPSET`.
    pub(crate) const NFNL_SUBSYS_IPSET: u16 = 6;
    /// `NFNL_SUBSYS_NFTABLES`.
    pub(crate) const NFNL_SUBSYS_NFTABLES: u16 = 10;
    /// `NFNL_MSG_BATCH_BEGIN`.
    pub(crate) const NFNL_MSG_BATCH_BEGIN: u16 = 0x10;
    /// `NFNL_MSG_BATCH_END`.
    pub(crate) const NFNL_MSG_BATCH_END: u16 = 0x11;
    /// `sizeof(struct nfgenmsg)`: family u8, version u8, big-endian resource id u16, after every nlmsghdr.
    pub(crate) const NFGENMSG_LEN: usize = 4;
}

/// `linux/netfilter/nf_tables.h`: message types, attributes and enum values of nf_tables.
pub(crate) mod nf_tables {
    /// `NFT_MSG_NEWTABLE`.
    pub(crate) const NFT_MSG_NEWTABLE: u16 = 0;
    /// `NFT_MSG_GETTABLE`.
    pub(crate) const NFT_MSG_GETTABLE: u16 = 1;
    /// `NFT_MSG_DELTABLE`.
    pub(crate) const NFT_MSG_DELTABLE: u16 = 2;
    /// `NFT_MSG_NEWCHAIN`.
    pub(crate) const NFT_MSG_NEWCHAIN: u16 = 3;
    /// `NFT_MSG_NEWRULE`.
    pub(crate) const NFT_MSG_NEWRULE: u16 = 6;
    /// `NFT_MSG_GETRULE`.
    pub(crate) const NFT_MSG_GETRULE: u16 = 7;
    /// `NFT_MSG_DELRULE`.
    pub(crate) const NFT_MSG_DELRULE: u16 = 8;
    /// `NFT_MSG_NEWSET`.
    pub(crate) const NFT_MSG_NEWSET: u16 = 9;
    /// `NFT_MSG_NEWSETELEM`.
    pub(crate) const NFT_MSG_NEWSETELEM: u16 = 12;
    /// `NFT_MSG_GETSETELEM`.
    pub(crate) const NFT_MSG_GETSETELEM: u16 = 13;
    /// `NFT_MSG_DELSETELEM`.
    pub(crate) const NFT_MSG_DELSETELEM: u16 = 14;

    /// `NFTA_LIST_ELEM`.
    pub(crate) const NFTA_LIST_ELEM: u16 = 1;
    /// `NFTA_HOOK_HOOKNUM`.
    pub(crate) const NFTA_HOOK_HOOKNUM: u16 = 1;
    /// `NFTA_HOOK_PRIORITY`.
    pub(crate) const NFTA_HOOK_PRIORITY: u16 = 2;
    /// `NFTA_TABLE_NAME`.
    pub(crate) const NFTA_TABLE_NAME: u16 = 1;
    /// `NFTA_TABLE_FLAGS`.
    pub(crate) const NFTA_TABLE_FLAGS: u16 = 2;
    /// `NFTA_CHAIN_TABLE`.
    pub(crate) const NFTA_CHAIN_TABLE: u16 = 1;
    /// `NFTA_CHAIN_NAME`.
    pub(crate) const NFTA_CHAIN_NAME: u16 = 3;
    /// `NFTA_CHAIN_HOOK`.
    pub(crate) const NFTA_CHAIN_HOOK: u16 = 4;
    /// `NFTA_CHAIN_POLICY`.
    pub(crate) const NFTA_CHAIN_POLICY: u16 = 5;
    /// `NFTA_CHAIN_TYPE`.
    pub(crate) const NFTA_CHAIN_TYPE: u16 = 7;
    /// `NFTA_RULE_TABLE`.
    pub(crate) const NFTA_RULE_TABLE: u16 = 1;
    /// `NFTA_RULE_CHAIN`.
    pub(crate) const NFTA_RULE_CHAIN: u16 = 2;
    /// `NFTA_RULE_EXPRESSIONS`.
    pub(crate) const NFTA_RULE_EXPRESSIONS: u16 = 4;
    /// `NFTA_RULE_USERDATA`: opaque bytes the kernel stores with the rule and dumps back unchanged.
    pub(crate) const NFTA_RULE_USERDATA: u16 = 7;
    /// `NFTA_SET_TABLE`.
    pub(crate) const NFTA_SET_TABLE: u16 = 1;
    /// `NFTA_SET_NAME`.
    pub(crate) const NFTA_SET_NAME: u16 = 2;
    /// `NFTA_SET_KEY_TYPE`.
    pub(crate) const NFTA_SET_KEY_TYPE: u16 = 4;
    /// `NFTA_SET_KEY_LEN`.
    pub(crate) const NFTA_SET_KEY_LEN: u16 = 5;
    /// `NFTA_SET_ID`.
    pub(crate) const NFTA_SET_ID: u16 = 10;
    /// `NFTA_SET_USERDATA`.
    pub(crate) const NFTA_SET_USERDATA: u16 = 13;
    /// `NFTA_SET_ELEM_KEY`.
    pub(crate) const NFTA_SET_ELEM_KEY: u16 = 1;
    /// `NFTA_SET_ELEM_USERDATA`.
    pub(crate) const NFTA_SET_ELEM_USERDATA: u16 = 6;
    /// `NFTA_SET_ELEM_LIST_TABLE`.
    pub(crate) const NFTA_SET_ELEM_LIST_TABLE: u16 = 1;
    /// `NFTA_SET_ELEM_LIST_SET`.
    pub(crate) const NFTA_SET_ELEM_LIST_SET: u16 = 2;
    /// `NFTA_SET_ELEM_LIST_ELEMENTS`.
    pub(crate) const NFTA_SET_ELEM_LIST_ELEMENTS: u16 = 3;
    /// `NFTA_DATA_VALUE`.
    pub(crate) const NFTA_DATA_VALUE: u16 = 1;
    /// `NFTA_DATA_VERDICT`.
    pub(crate) const NFTA_DATA_VERDICT: u16 = 2;
    /// `NFTA_VERDICT_CODE`.
    pub(crate) const NFTA_VERDICT_CODE: u16 = 1;
    /// `NFTA_VERDICT_CHAIN`.
    pub(crate) const NFTA_VERDICT_CHAIN: u16 = 2;
    /// `NFTA_EXPR_NAME`.
    pub(crate) const NFTA_EXPR_NAME: u16 = 1;
    /// `NFTA_EXPR_DATA`.
    pub(crate) const NFTA_EXPR_DATA: u16 = 2;
    /// `NFTA_IMMEDIATE_DREG`.
    pub(crate) const NFTA_IMMEDIATE_DREG: u16 = 1;
    /// `NFTA_IMMEDIATE_DATA`.
    pub(crate) const NFTA_IMMEDIATE_DATA: u16 = 2;
    /// `NFTA_BITWISE_SREG`.
    pub(crate) const NFTA_BITWISE_SREG: u16 = 1;
    /// `NFTA_BITWISE_DREG`.
    pub(crate) const NFTA_BITWISE_DREG: u16 = 2;
    /// `NFTA_BITWISE_LEN`.
    pub(crate) const NFTA_BITWISE_LEN: u16 = 3;
    /// `NFTA_BITWISE_MASK`.
    pub(crate) const NFTA_BITWISE_MASK: u16 = 4;
    /// `NFTA_BITWISE_XOR`.
    pub(crate) const NFTA_BITWISE_XOR: u16 = 5;
    /// `NFTA_CMP_SREG`.
    pub(crate) const NFTA_CMP_SREG: u16 = 1;
    /// `NFTA_CMP_OP`.
    pub(crate) const NFTA_CMP_OP: u16 = 2;
    /// `NFTA_CMP_DATA`.
    pub(crate) const NFTA_CMP_DATA: u16 = 3;
    /// `NFTA_LOOKUP_SET`.
    pub(crate) const NFTA_LOOKUP_SET: u16 = 1;
    /// `NFTA_LOOKUP_SREG`.
    pub(crate) const NFTA_LOOKUP_SREG: u16 = 2;
    /// `NFTA_PAYLOAD_DREG`.
    pub(crate) const NFTA_PAYLOAD_DREG: u16 = 1;
    /// `NFTA_PAYLOAD_BASE`.
    pub(crate) const NFTA_PAYLOAD_BASE: u16 = 2;
    /// `NFTA_PAYLOAD_OFFSET`.
    pub(crate) const NFTA_PAYLOAD_OFFSET: u16 = 3;
    /// `NFTA_PAYLOAD_LEN`.
    pub(crate) const NFTA_PAYLOAD_LEN: u16 = 4;
    /// `NFTA_META_DREG`.
    pub(crate) const NFTA_META_DREG: u16 = 1;
    /// `NFTA_META_KEY`.
    pub(crate) const NFTA_META_KEY: u16 = 2;
    /// `NFTA_META_SREG`.
    pub(crate) const NFTA_META_SREG: u16 = 3;
    /// `NFTA_CT_DREG`.
    pub(crate) const NFTA_CT_DREG: u16 = 1;
    /// `NFTA_CT_KEY`.
    pub(crate) const NFTA_CT_KEY: u16 = 2;
    /// `NFTA_CT_SREG`.
    pub(crate) const NFTA_CT_SREG: u16 = 4;
    /// `NFTA_COUNTER_BYTES`.
    pub(crate) const NFTA_COUNTER_BYTES: u16 = 1;
    /// `NFTA_COUNTER_PACKETS`.
    pub(crate) const NFTA_COUNTER_PACKETS: u16 = 2;
    /// `NFTA_NAT_TYPE`.
    pub(crate) const NFTA_NAT_TYPE: u16 = 1;
    /// `NFTA_NAT_FAMILY`.
    pub(crate) const NFTA_NAT_FAMILY: u16 = 2;
    /// `NFTA_NAT_REG_ADDR_MIN`.
    pub(crate) const NFTA_NAT_REG_ADDR_MIN: u16 = 3;
    /// `NFTA_REDIR_REG_PROTO_MIN`.
    pub(crate) const NFTA_REDIR_REG_PROTO_MIN: u16 = 1;
    /// `NFTA_REDIR_FLAGS`.
    pub(crate) const NFTA_REDIR_FLAGS: u16 = 3;
    /// `NFTA_TPROXY_FAMILY`.
    pub(crate) const NFTA_TPROXY_FAMILY: u16 = 1;
    /// `NFTA_TPROXY_REG_PORT`.
    pub(crate) const NFTA_TPROXY_REG_PORT: u16 = 3;

    /// `NFT_REG_VERDICT`.
    pub(crate) const NFT_REG_VERDICT: u32 = 0;
    /// `NFT_REG_1`.
    pub(crate) const NFT_REG_1: u32 = 1;
    /// `NFT_CMP_EQ`.
    pub(crate) const NFT_CMP_EQ: u32 = 0;
    /// `NFT_CMP_NEQ`.
    pub(crate) const NFT_CMP_NEQ: u32 = 1;
    /// `NFT_META_MARK`.
    pub(crate) const NFT_META_MARK: u32 = 3;
    /// `NFT_META_IIFNAME`.
    pub(crate) const NFT_META_IIFNAME: u32 = 6;
    /// `NFT_META_OIFNAME`.
    pub(crate) const NFT_META_OIFNAME: u32 = 7;
    /// `NFT_META_SKUID`.
    pub(crate) const NFT_META_SKUID: u32 = 10;
    /// `NFT_META_SKGID`.
    pub(crate) const NFT_META_SKGID: u32 = 11;
    /// `NFT_META_NFPROTO`.
    pub(crate) const NFT_META_NFPROTO: u32 = 15;
    /// `NFT_META_L4PROTO`.
    pub(crate) const NFT_META_L4PROTO: u32 = 16;
    /// `NFT_CT_STATE`.
    pub(crate) const NFT_CT_STATE: u32 = 0;
    /// `NFT_CT_MARK`.
    pub(crate) const NFT_CT_MARK: u32 = 3;
    /// `NFT_CT_ZONE`.
    pub(crate) const NFT_CT_ZONE: u32 = 17;
    /// `NFT_PAYLOAD_NETWORK_HEADER`.
    pub(crate) const NFT_PAYLOAD_NETWORK_HEADER: u32 = 1;
    /// `NFT_PAYLOAD_TRANSPORT_HEADER`.
    pub(crate) const NFT_PAYLOAD_TRANSPORT_HEADER: u32 = 2;
    /// `NFT_NAT_SNAT`.
    pub(crate) const NFT_NAT_SNAT: u32 = 0;
    /// `NFT_JUMP`.
    pub(crate) const NFT_JUMP: i32 = -3;
    /// `NFT_RETURN`.
    pub(crate) const NFT_RETURN: i32 = -5;
}

/// `linux/netfilter/nf_nat.h`: NAT range flags.
pub(crate) mod nf_nat {
    /// `NF_NAT_RANGE_PROTO_SPECIFIED`.
    pub(crate) const NF_NAT_RANGE_PROTO_SPECIFIED: u32 = 2;
}

/// `linux/netfilter/ipset/ip_set.h`: ipset's protocol version, commands, attributes and flags.
pub(crate) mod ipset {
    /// `IPSET_PROTOCOL`.
    pub(crate) const IPSET_PROTOCOL: u8 = 7;
    /// `IPSET_CMD_CREATE`.
    pub(crate) const IPSET_CMD_CREATE: u16 = 2;
    /// `IPSET_CMD_DESTROY`.
    pub(crate) const IPSET_CMD_DESTROY: u16 = 3;
    /// `IPSET_CMD_LIST`.
    pub(crate) const IPSET_CMD_LIST: u16 = 7;
    /// `IPSET_CMD_ADD`.
    pub(crate) const IPSET_CMD_ADD: u16 = 9;
    /// `IPSET_CMD_DEL`.
    pub(crate) const IPSET_CMD_DEL: u16 = 10;
    /// `IPSET_ATTR_PROTOCOL`.
    pub(crate) const IPSET_ATTR_PROTOCOL: u16 = 1;
    /// `IPSET_ATTR_SETNAME`.
    pub(crate) const IPSET_ATTR_SETNAME: u16 = 2;
    /// `IPSET_ATTR_TYPENAME`.
    pub(crate) const IPSET_ATTR_TYPENAME: u16 = 3;
    /// `IPSET_ATTR_REVISION`.
    pub(crate) const IPSET_ATTR_REVISION: u16 = 4;
    /// `IPSET_ATTR_FAMILY`.
    pub(crate) const IPSET_ATTR_FAMILY: u16 = 5;
    /// `IPSET_ATTR_DATA`.
    pub(crate) const IPSET_ATTR_DATA: u16 = 7;
    /// `IPSET_ATTR_ADT`.
    pub(crate) const IPSET_ATTR_ADT: u16 = 8;
    /// `IPSET_ATTR_IP` (inside `IPSET_ATTR_DATA`).
    pub(crate) const IPSET_ATTR_IP: u16 = 1;
    /// `IPSET_ATTR_CADT_FLAGS` (inside `IPSET_ATTR_DATA`).
    pub(crate) const IPSET_ATTR_CADT_FLAGS: u16 = 8;
    /// `IPSET_ATTR_COMMENT` (inside `IPSET_ATTR_DATA`).
    pub(crate) const IPSET_ATTR_COMMENT: u16 = 26;
    /// `IPSET_ATTR_IPADDR_IPV4` (inside `IPSET_ATTR_IP`).
    pub(crate) const IPSET_ATTR_IPADDR_IPV4: u16 = 1;
    /// `IPSET_ATTR_IPADDR_IPV6` (inside `IPSET_ATTR_IP`).
    pub(crate) const IPSET_ATTR_IPADDR_IPV6: u16 = 2;
    /// `IPSET_FLAG_WITH_COMMENT` (1 << `IPSET_FLAG_BIT_WITH_COMMENT`).
    pub(crate) const IPSET_FLAG_WITH_COMMENT: u32 = 1 << 4;
}

#[cfg(test)]
mod tests {
    use super::netfilter::*;
    use super::nf_tables::*;
    use super::nfnetlink::*;

    /// Asserts each `ours == libc::NAME` for the names given (every number libc 0.2 also carries).
    macro_rules! pinned {
        ($($name:ident),* $(,)?) => {
            $(assert_eq!(i64::from($name), i64::from(libc::$name), stringify!($name));)*
        };
    }

    #[test]
    fn the_numbers_libc_also_carries_are_the_same() {
        pinned!(NF_DROP, NF_ACCEPT, NFPROTO_UNSPEC, NFPROTO_INET, NFPROTO_IPV4, NFPROTO_IPV6);
        pinned!(NF_INET_PRE_ROUTING, NF_INET_LOCAL_IN, NF_INET_FORWARD, NF_INET_LOCAL_OUT, NF_INET_POST_ROUTING);
        pinned!(NFNL_SUBSYS_IPSET, NFNL_SUBSYS_NFTABLES, NFNL_MSG_BATCH_BEGIN, NFNL_MSG_BATCH_END);
        pinned!(
            NFT_MSG_NEWTABLE,
            NFT_MSG_GETTABLE,
            NFT_MSG_DELTABLE,
            NFT_MSG_NEWCHAIN,
            NFT_MSG_NEWRULE,
            NFT_MSG_GETRULE,
            NFT_MSG_DELRULE,
            NFT_MSG_NEWSET,
            NFT_MSG_NEWSETELEM,
            NFT_MSG_GETSETELEM,
            NFT_MSG_DELSETELEM,
        );
        pinned!(
            NFT_REG_VERDICT,
            NFT_REG_1,
            NFT_CMP_EQ,
            NFT_CMP_NEQ,
            NFT_META_MARK,
            NFT_META_IIFNAME,
            NFT_META_OIFNAME,
            NFT_META_SKUID,
            NFT_META_SKGID,
            NFT_META_NFPROTO,
            NFT_META_L4PROTO,
            NFT_CT_STATE,
            NFT_CT_MARK,
            NFT_CT_ZONE,
            NFT_PAYLOAD_NETWORK_HEADER,
            NFT_PAYLOAD_TRANSPORT_HEADER,
            NFT_NAT_SNAT,
            NFT_JUMP,
            NFT_RETURN,
        );
    }
}

//! Reads back which nftables tables a netns holds (NFT_MSG_GETTABLE dump), without any binary.

use std::io;
use std::os::fd::{AsFd, BorrowedFd};

use netns::netlink::uapi::{NLM_F_DUMP, NLM_F_REQUEST};

use super::attr::{attrs, c_string, Writer};
use super::netlink_dump::{exchange_on, End, Steps};
use super::socket::open;
use super::uapi::nf_tables::{NFTA_TABLE_NAME, NFT_MSG_GETTABLE};
use super::uapi::nfnetlink::NFNL_SUBSYS_NFTABLES;
use super::NftError;

/// A table the kernel holds: netfilter family number (1 inet, 2 ip, 10 ip6, ...) and name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableId {
    /// NFPROTO_* family.
    pub family: u8,
    /// Table name.
    pub name: String,
}

/// Lists every nftables table of the calling thread's netns (all families, including iptables-nft's).
pub(super) fn tables() -> Result<Vec<TableId>, NftError> {
    tables_on(open()?.as_fd())
}

/// [`tables`] over an open socket.
pub(super) fn tables_on(fd: BorrowedFd<'_>) -> Result<Vec<TableId>, NftError> {
    let mut w = Writer::default();
    w.message((NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETTABLE, NLM_F_REQUEST | NLM_F_DUMP, 1, 0, 0, |_| {});
    let steps = Steps { send: "send table dump request", receive: "receive table dump" };
    let mut out = Vec::new();
    let end = exchange_on(fd, w.bytes(), steps, |family, msg| {
        if let Some((_, name)) = attrs(msg).find(|(ty, _)| *ty == NFTA_TABLE_NAME) {
            out.push(TableId { family, name: c_string(name) });
        }
    })?;
    match end {
        End::Done => Ok(out),
        End::Errno(errno) => {
            Err(NftError::Rejected { object: "table dump".into(), source: io::Error::from_raw_os_error(errno) })
        }
    }
}

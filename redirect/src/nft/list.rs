//! Reads back which nftables tables a netns holds (NFT_MSG_GETTABLE dump), without any binary.

use std::io;
use std::os::fd::AsRawFd;

use super::attr::Writer;
use super::socket::open;
use super::NftError;

const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFT_MSG_GETTABLE: u16 = 1;
const NFTA_TABLE_NAME: u16 = 1;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_DUMP: u16 = 0x300;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLMSG_HDRLEN: usize = 16;
const NFGENMSG_LEN: usize = 4;
const NLA_TYPE_MASK: u16 = 0x3fff;

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
    let fd = open()?;
    let mut w = Writer::default();
    w.message((NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETTABLE, NLM_F_REQUEST | NLM_F_DUMP, 1, 0, 0, |_| {});
    let bytes = w.bytes();
    // SAFETY: `bytes` is a valid buffer of the given length.
    if unsafe { libc::send(fd.as_raw_fd(), bytes.as_ptr().cast(), bytes.len(), 0) } < 0 {
        return Err(NftError::Socket { what: "send table dump request", source: io::Error::last_os_error() });
    }
    let mut out = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        // SAFETY: `buf` is writable for its length.
        let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            return Err(NftError::Socket { what: "receive table dump", source: io::Error::last_os_error() });
        }
        let mut data = &buf[..n as usize];
        while data.len() >= NLMSG_HDRLEN {
            let len = u32::from_ne_bytes(data[0..4].try_into().expect("4 bytes")) as usize;
            let ty = u16::from_ne_bytes(data[4..6].try_into().expect("2 bytes"));
            if len < NLMSG_HDRLEN || len > data.len() {
                break;
            }
            match ty {
                NLMSG_DONE => return Ok(out),
                NLMSG_ERROR => {
                    let code = i32::from_ne_bytes(data[16..20].try_into().expect("4 bytes"));
                    let source = io::Error::from_raw_os_error(-code);
                    return Err(NftError::Rejected { object: "table dump".into(), source });
                }
                _ if len >= NLMSG_HDRLEN + NFGENMSG_LEN => {
                    let family = data[NLMSG_HDRLEN];
                    if let Some(name) = table_name(&data[NLMSG_HDRLEN + NFGENMSG_LEN..len]) {
                        out.push(TableId { family, name });
                    }
                }
                _ => {}
            }
            data = &data[(len + 3) & !3..];
        }
    }
}

fn table_name(mut attrs: &[u8]) -> Option<String> {
    while attrs.len() >= 4 {
        let len = usize::from(u16::from_ne_bytes([attrs[0], attrs[1]]));
        let ty = u16::from_ne_bytes([attrs[2], attrs[3]]) & NLA_TYPE_MASK;
        if len < 4 || len > attrs.len() {
            return None;
        }
        if ty == NFTA_TABLE_NAME {
            let raw = &attrs[4..len];
            let end = raw.iter().position(|b| *b == 0).unwrap_or(raw.len());
            return Some(String::from_utf8_lossy(&raw[..end]).into_owned());
        }
        attrs = &attrs[((len + 3) & !3).min(attrs.len())..];
    }
    None
}

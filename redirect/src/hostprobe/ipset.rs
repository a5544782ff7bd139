//! `hash:ip` ipsets with comments over netlink (NFNL_SUBSYS_IPSET), so the iptables host-probe mode needs no
//! `ipset` binary: create, add (re-adding replaces the comment), delete, list.

use std::io;
use std::net::IpAddr;

use netns::netlink::uapi::{NLA_F_NET_BYTEORDER, NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST};

use crate::model::Family;
use crate::nft::attr::{attrs, c_string, ip_addr, Writer};
use crate::nft::netlink_dump::{exchange, End, Steps};
use crate::nft::uapi::ipset::*;
use crate::nft::uapi::netfilter::{NFPROTO_IPV4, NFPROTO_IPV6};
use crate::nft::uapi::nfnetlink::NFNL_SUBSYS_IPSET;
use crate::nft::NftError;

/// hash:ip revision 2, the first with comments (all the probe set uses), as Istio's agent creates the set (the
/// ambient differential, e2e/tests/istio_ambient_differential.rs, compares `ipset list`): a node's set looks the
/// same whichever agent made it.
const HASH_IP_REVISION: u8 = 2;

/// A failed ipset request: what was asked, and the kernel's answer or why none came.
#[derive(Debug, thiserror::Error)]
pub enum IpsetError {
    /// The kernel refused the request (ipset's own codes are above 4096).
    #[error("ipset {what}: {}", describe(*.errno))]
    Kernel {
        /// The request, e.g. `add istio-inpod-probes-v4 10.0.0.5`.
        what: String,
        /// errno or ipset error code.
        errno: i32,
    },
    /// The netlink socket failed, or the kernel did not answer within the socket's receive timeout.
    #[error("ipset {what}: {source}")]
    Socket {
        /// The request.
        what: String,
        /// What failed.
        source: Box<NftError>,
    },
}

fn describe(errno: i32) -> String {
    if errno > 4096 {
        format!("ipset error code {errno}")
    } else {
        io::Error::from_raw_os_error(errno).to_string()
    }
}

fn header(w: &mut Writer, cmd: u16, flags: u16, name: &str, body: impl FnOnce(&mut Writer)) {
    w.message((NFNL_SUBSYS_IPSET << 8) | cmd, NLM_F_REQUEST | flags, 1, NFPROTO_IPV4, 0, |w| {
        w.put(IPSET_ATTR_PROTOCOL, &[IPSET_PROTOCOL]);
        w.string(IPSET_ATTR_SETNAME, name);
        body(w);
    });
}

fn ip_attr(w: &mut Writer, ip: IpAddr) {
    w.nest(IPSET_ATTR_IP, |w| match ip {
        IpAddr::V4(a) => w.put(IPSET_ATTR_IPADDR_IPV4 | NLA_F_NET_BYTEORDER, &a.octets()),
        IpAddr::V6(a) => w.put(IPSET_ATTR_IPADDR_IPV6 | NLA_F_NET_BYTEORDER, &a.octets()),
    });
}

/// Creates `name` as `hash:ip` with comments for `family`; an existing identical set is fine.
pub(crate) fn create(name: &str, family: Family) -> Result<(), IpsetError> {
    let nfproto = match family {
        Family::V4 => NFPROTO_IPV4,
        Family::V6 => NFPROTO_IPV6,
    };
    let mut w = Writer::default();
    header(&mut w, IPSET_CMD_CREATE, NLM_F_ACK, name, |w| {
        w.string(IPSET_ATTR_TYPENAME, "hash:ip");
        w.put(IPSET_ATTR_REVISION, &[HASH_IP_REVISION]);
        w.put(IPSET_ATTR_FAMILY, &[nfproto]);
        w.nest(IPSET_ATTR_DATA, |w| {
            w.put(IPSET_ATTR_CADT_FLAGS | NLA_F_NET_BYTEORDER, &IPSET_FLAG_WITH_COMMENT.to_be_bytes())
        });
    });
    request(&w, format!("create {name} hash:ip family {family} comment"))
}

/// Destroys `name`; a missing set is fine.
pub(crate) fn destroy(name: &str) -> Result<(), IpsetError> {
    let mut w = Writer::default();
    header(&mut w, IPSET_CMD_DESTROY, NLM_F_ACK, name, |_| {});
    match request(&w, format!("destroy {name}")) {
        Err(IpsetError::Kernel { errno: libc::ENOENT, .. }) => Ok(()),
        other => other,
    }
}

/// Adds `ip` with `comment`; an existing entry gets the new comment.
pub(crate) fn add(name: &str, ip: IpAddr, comment: &str) -> Result<(), IpsetError> {
    let mut w = Writer::default();
    header(&mut w, IPSET_CMD_ADD, NLM_F_ACK, name, |w| {
        w.nest(IPSET_ATTR_DATA, |w| {
            ip_attr(w, ip);
            w.string(IPSET_ATTR_COMMENT, comment);
        })
    });
    request(&w, format!("add {name} {ip} comment {comment}"))
}

/// Deletes `ip`; a missing entry is fine.
pub(crate) fn del(name: &str, ip: IpAddr) -> Result<(), IpsetError> {
    let mut w = Writer::default();
    header(&mut w, IPSET_CMD_DEL, NLM_F_ACK, name, |w| w.nest(IPSET_ATTR_DATA, |w| ip_attr(w, ip)));
    request(&w, format!("del {name} {ip}"))
}

/// Every entry of `name` with its comment.
pub(crate) fn list(name: &str) -> Result<Vec<(IpAddr, Option<String>)>, IpsetError> {
    let mut w = Writer::default();
    header(&mut w, IPSET_CMD_LIST, NLM_F_DUMP, name, |_| {});
    let mut out = Vec::new();
    ipset_exchange(&w, &format!("list {name}"), |msg| {
        for (_, adt) in attrs(msg).filter(|(t, _)| *t == IPSET_ATTR_ADT) {
            for (_, data) in attrs(adt).filter(|(t, _)| *t == IPSET_ATTR_DATA) {
                let mut ip = None;
                let mut comment = None;
                for (ty, value) in attrs(data) {
                    match ty {
                        IPSET_ATTR_IP => ip = attrs(value).find_map(|(_, v)| ip_addr(v)),
                        IPSET_ATTR_COMMENT => comment = Some(c_string(value)),
                        _ => {}
                    }
                }
                if let Some(ip) = ip {
                    out.push((ip, comment));
                }
            }
        }
    })?;
    Ok(out)
}

fn request(w: &Writer, what: String) -> Result<(), IpsetError> {
    ipset_exchange(w, &what, |_| {})
}

/// Sends one request and reads answers until the ack (or dump end), handing each data message's attributes
/// to `each`.
fn ipset_exchange(w: &Writer, what: &str, mut each: impl FnMut(&[u8])) -> Result<(), IpsetError> {
    let steps = Steps { send: "send ipset request", receive: "receive ipset answer" };
    match exchange(w.bytes(), steps, |_, msg| each(msg)) {
        Ok(End::Done | End::Errno(0)) => Ok(()),
        Ok(End::Errno(errno)) => Err(IpsetError::Kernel { what: what.to_string(), errno }),
        Err(source) => Err(IpsetError::Socket { what: what.to_string(), source: Box::new(source) }),
    }
}

//! Netlink's own numbers, as `linux/netlink.h` names them: the message header, the message types every family
//! shares, the request flags and the attribute type flags. The workspace spells them here once; families' own
//! numbers (nfnetlink, nf_tables, ipset) live with their users (`redirect::nft::uapi`). The unit tests pin each
//! one to the `libc` crate's copy of the header.

/// `NLMSG_HDRLEN`: size of `struct nlmsghdr` (length u32, type u16, flags u16, sequence u32, port u32), already a
/// multiple of [`NLMSG_ALIGNTO`].
pub const NLMSG_HDRLEN: usize = 16;
/// `NLMSG_ALIGNTO`: every message starts at a multiple of this many bytes.
pub const NLMSG_ALIGNTO: usize = 4;

/// `NLMSG_ERROR`: an error or, with errno 0, an acknowledgement; the payload starts with a negative errno (i32).
pub const NLMSG_ERROR: u16 = 0x2;
/// `NLMSG_DONE`: the end of a multipart (dump) answer.
pub const NLMSG_DONE: u16 = 0x3;

/// `NLM_F_REQUEST`: flag of every request to the kernel.
pub const NLM_F_REQUEST: u16 = 0x1;
/// `NLM_F_ACK`: asks for an acknowledgement (an `NLMSG_ERROR` with errno 0) on success.
pub const NLM_F_ACK: u16 = 0x4;
/// `NLM_F_ROOT`: a GET request returns the whole table.
pub const NLM_F_ROOT: u16 = 0x100;
/// `NLM_F_MATCH`: a GET request returns every match.
pub const NLM_F_MATCH: u16 = 0x200;
/// `NLM_F_DUMP`: a GET request returns every object (`NLM_F_ROOT | NLM_F_MATCH`).
pub const NLM_F_DUMP: u16 = NLM_F_ROOT | NLM_F_MATCH;
/// `NLM_F_EXCL`: a NEW request fails if the object exists.
pub const NLM_F_EXCL: u16 = 0x200;
/// `NLM_F_CREATE`: a NEW request creates the object if it does not exist.
pub const NLM_F_CREATE: u16 = 0x400;
/// `NLM_F_APPEND`: a NEW request adds the object at the end of its list.
pub const NLM_F_APPEND: u16 = 0x800;

/// `NLA_F_NESTED`: the attribute's payload is attributes.
pub const NLA_F_NESTED: u16 = 1 << 15;
/// `NLA_F_NET_BYTEORDER`: the attribute's payload is in network byte order.
pub const NLA_F_NET_BYTEORDER: u16 = 1 << 14;
/// `NLA_TYPE_MASK`: an attribute's type without the two flags above.
pub const NLA_TYPE_MASK: u16 = !(NLA_F_NESTED | NLA_F_NET_BYTEORDER);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_numbers_are_the_kernel_headers_as_libc_has_them() {
        let ours = [
            (NLMSG_ERROR as i32, libc::NLMSG_ERROR),
            (NLMSG_DONE as i32, libc::NLMSG_DONE),
            (NLM_F_REQUEST as i32, libc::NLM_F_REQUEST),
            (NLM_F_ACK as i32, libc::NLM_F_ACK),
            (NLM_F_ROOT as i32, libc::NLM_F_ROOT),
            (NLM_F_MATCH as i32, libc::NLM_F_MATCH),
            (NLM_F_DUMP as i32, libc::NLM_F_DUMP),
            (NLM_F_EXCL as i32, libc::NLM_F_EXCL),
            (NLM_F_CREATE as i32, libc::NLM_F_CREATE),
            (NLM_F_APPEND as i32, libc::NLM_F_APPEND),
            (NLA_F_NESTED as i32, libc::NLA_F_NESTED),
            (NLA_F_NET_BYTEORDER as i32, libc::NLA_F_NET_BYTEORDER),
            (i32::from(NLA_TYPE_MASK), libc::NLA_TYPE_MASK & 0xffff),
        ];
        for (i, (ours, kernel)) in ours.into_iter().enumerate() {
            assert_eq!(ours, kernel, "constant {i}");
        }
        assert_eq!(NLMSG_HDRLEN, std::mem::size_of::<libc::nlmsghdr>());
        assert_eq!(NLMSG_HDRLEN % NLMSG_ALIGNTO, 0);
    }
}

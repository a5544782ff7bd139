//! One request and its answers on a NETLINK_NETFILTER socket of the calling thread's netns: a dump
//! (nf_tables tables or set elements, ipset entries) or an acknowledged ipset command. Every data message is
//! handed to the caller until the kernel ends the exchange; a kernel that stays silent for the socket's receive
//! timeout ([`netns::netlink::RECV_TIMEOUT`]) ends it with an error.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};

use netns::netlink::messages;
use netns::netlink::uapi::NLMSG_DONE;

use super::socket::open;
use super::uapi::nfnetlink::NFGENMSG_LEN;
use super::NftError;

/// How the kernel ended the exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum End {
    /// NLMSG_DONE: the dump is complete.
    Done,
    /// NLMSG_ERROR with this errno; 0 is an acknowledgement.
    Errno(i32),
}

/// What the socket steps are called in errors, e.g. `send table dump request` and `receive table dump`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Steps {
    /// Name of sending the request.
    pub send: &'static str,
    /// Name of reading the answers.
    pub receive: &'static str,
}

/// Sends `request` (one encoded netlink message) and reads the answers until NLMSG_DONE or NLMSG_ERROR, calling
/// `each(nfgen family, attributes)` for every data message. Errors are only [`NftError::Socket`].
pub(crate) fn exchange(request: &[u8], steps: Steps, each: impl FnMut(u8, &[u8])) -> Result<End, NftError> {
    exchange_on(open()?.as_fd(), request, steps, each)
}

/// [`exchange`] on an open socket, so a caller can dump and then commit over one socket (one close).
pub(crate) fn exchange_on(
    fd: BorrowedFd<'_>,
    request: &[u8],
    steps: Steps,
    mut each: impl FnMut(u8, &[u8]),
) -> Result<End, NftError> {
    // SAFETY: `request` is a valid buffer of the given length.
    if unsafe { libc::send(fd.as_raw_fd(), request.as_ptr().cast(), request.len(), 0) } < 0 {
        return Err(NftError::Socket { what: steps.send, source: io::Error::last_os_error() });
    }
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        // Blocks at most the socket's receive timeout: a kernel that never answers is an error, not a hang.
        let n =
            netns::netlink::recv(fd, &mut buf).map_err(|source| NftError::Socket { what: steps.receive, source })?;
        if n == 0 {
            let source = io::Error::new(io::ErrorKind::UnexpectedEof, "the socket returned no data");
            return Err(NftError::Socket { what: steps.receive, source });
        }
        if let Some(end) = answers(&buf[..n], &mut each) {
            return Ok(end);
        }
    }
}

/// Hands each data message of one datagram to `each(nfgen family, attributes)`; `Some` once the kernel ended the
/// exchange. A message too short for its headers is skipped, and the walk stops at a malformed length
/// ([`netns::netlink::messages`]); the next datagram, or the receive timeout, decides then.
fn answers(datagram: &[u8], each: &mut impl FnMut(u8, &[u8])) -> Option<End> {
    for message in messages(datagram) {
        if message.ty == NLMSG_DONE {
            return Some(End::Done);
        }
        if let Some(errno) = message.errno() {
            return Some(End::Errno(errno));
        }
        if let Some((nfgenmsg, attrs)) = message.payload.split_at_checked(NFGENMSG_LEN) {
            each(nfgenmsg[0], attrs);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::super::attr::Writer;
    use super::super::uapi::nf_tables::NFT_MSG_GETTABLE;
    use super::super::uapi::nfnetlink::NFNL_SUBSYS_NFTABLES;
    use super::*;

    const GETTABLE: u16 = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETTABLE;

    /// A bare netlink header of type `ty` whose length field says `len`, followed by `rest`.
    fn raw(len: u32, ty: u16, rest: &[u8]) -> Vec<u8> {
        let mut m = len.to_ne_bytes().to_vec();
        m.extend_from_slice(&ty.to_ne_bytes());
        m.extend_from_slice(&[0; 10]);
        m.extend_from_slice(rest);
        m
    }

    #[test]
    fn data_messages_reach_the_caller_until_the_kernel_ends_the_exchange() {
        let mut w = Writer::default();
        w.message(GETTABLE, 0, 1, 2, 0, |w| w.put(1, b"t\0"));
        w.message(NLMSG_DONE, 0, 1, 0, 0, |_| {});
        let mut seen = Vec::new();
        let end = answers(w.bytes(), &mut |family, attrs: &[u8]| seen.push((family, attrs.len())));
        assert_eq!(end, Some(End::Done));
        assert_eq!(seen, vec![(2, 8)]);
    }

    #[test]
    fn errors_end_the_exchange_with_their_errno() {
        let datagram = raw(20, netns::netlink::uapi::NLMSG_ERROR, &(-libc::ENOENT).to_ne_bytes());
        assert_eq!(answers(&datagram, &mut |_, _: &[u8]| panic!("no data")), Some(End::Errno(libc::ENOENT)));
    }

    #[test]
    fn short_and_malformed_messages_neither_panic_nor_reach_the_caller() {
        // An error without room for its code, as the last bytes of the datagram (indexing past it used to panic).
        let short_error = raw(16, netns::netlink::uapi::NLMSG_ERROR, &[]);
        // Lengths beyond the datagram, below the header, and an unaligned last message without its padding.
        for datagram in [short_error, raw(64, GETTABLE, &[0; 8]), raw(8, GETTABLE, &[0; 8]), raw(17, GETTABLE, &[1])] {
            assert_eq!(answers(&datagram, &mut |_, _: &[u8]| panic!("no data")), None, "{datagram:?}");
        }
    }

    #[test]
    fn a_kernel_that_never_answers_ends_the_exchange_with_a_timeout_error() {
        let fd = open().unwrap();
        netns::netlink::set_recv_timeout(fd.as_fd(), Duration::from_millis(100)).unwrap();
        // Without NLM_F_REQUEST (and NLM_F_ACK) the kernel takes the message and never answers it.
        let mut w = Writer::default();
        w.message(GETTABLE, 0, 1, 0, 0, |_| {});
        let steps = Steps { send: "send table dump request", receive: "receive table dump" };
        let err = exchange_on(fd.as_fd(), w.bytes(), steps, |_, _| {}).unwrap_err();
        let NftError::Socket { what, source } = &err else { panic!("not a socket error: {err}") };
        assert_eq!((*what, source.kind()), ("receive table dump", io::ErrorKind::TimedOut), "{err}");
        assert!(err.to_string().contains("no netlink answer within 100ms"), "{err}");
    }
}

//! One request and its answers on a NETLINK_NETFILTER socket of the calling thread's netns: a dump
//! (nf_tables tables or set elements, ipset entries) or an acknowledged ipset command. Every data message is
//! handed to the caller until the kernel ends the exchange; a kernel that stays silent for the socket's receive
//! timeout ([`netns::netlink::RECV_TIMEOUT`]) ends it with an error.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};

use super::socket::open;
use super::NftError;

/// Flag of every request to the kernel.
pub(crate) const NLM_F_REQUEST: u16 = 0x1;
/// Flag asking for every object (NLM_F_ROOT | NLM_F_MATCH).
pub(crate) const NLM_F_DUMP: u16 = 0x300;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLMSG_HDRLEN: usize = 16;
const NFGENMSG_LEN: usize = 4;

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
        let mut data = &buf[..n];
        while data.len() >= NLMSG_HDRLEN {
            let len = u32::from_ne_bytes(data[0..4].try_into().expect("4 bytes")) as usize;
            let ty = u16::from_ne_bytes(data[4..6].try_into().expect("2 bytes"));
            if len < NLMSG_HDRLEN || len > data.len() {
                break;
            }
            match ty {
                NLMSG_DONE => return Ok(End::Done),
                NLMSG_ERROR => return Ok(End::Errno(-i32::from_ne_bytes(data[16..20].try_into().expect("4 bytes")))),
                _ if len >= NLMSG_HDRLEN + NFGENMSG_LEN => {
                    each(data[NLMSG_HDRLEN], &data[NLMSG_HDRLEN + NFGENMSG_LEN..len]);
                }
                _ => {}
            }
            data = &data[(len + 3) & !3..];
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::super::attr::Writer;
    use super::*;

    #[test]
    fn a_kernel_that_never_answers_ends_the_exchange_with_a_timeout_error() {
        let fd = open().unwrap();
        netns::netlink::set_recv_timeout(fd.as_fd(), Duration::from_millis(100)).unwrap();
        // Without NLM_F_REQUEST (and NLM_F_ACK) the kernel takes the message and never answers it.
        let mut w = Writer::default();
        w.message((10 << 8) | 1, 0, 1, 0, 0, |_| {});
        let steps = Steps { send: "send table dump request", receive: "receive table dump" };
        let err = exchange_on(fd.as_fd(), w.bytes(), steps, |_, _| {}).unwrap_err();
        let NftError::Socket { what, source } = &err else { panic!("not a socket error: {err}") };
        assert_eq!((*what, source.kind()), ("receive table dump", io::ErrorKind::TimedOut), "{err}");
        assert!(err.to_string().contains("no netlink answer within 100ms"), "{err}");
    }
}

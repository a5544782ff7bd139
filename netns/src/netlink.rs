//! Netlink sockets of the calling thread's network namespace (a socket stays in the netns it was opened in), each
//! with a receive timeout: a kernel or peer that never answers makes a request fail with a clear error after
//! [`RECV_TIMEOUT`] instead of hanging the thread (and the pod's enrollment) forever. Every netlink socket the
//! workspace opens itself comes from [`socket`] and is read with [`recv`]; [`addresses`] is the one rtnetlink
//! dump this crate needs.
//!
//! Every received datagram is walked with [`messages`] (bounds-checked, never panics), and netlink's own numbers
//! are spelled once, in [`uapi`].

mod messages;
pub mod uapi;

pub use messages::{messages, Message, Messages};

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::time::Duration;

use uapi::{NLMSG_DONE, NLMSG_HDRLEN, NLM_F_DUMP, NLM_F_REQUEST};

/// How long a netlink socket waits for an answer. The kernel answers netfilter and rtnetlink requests while it
/// handles them, within microseconds to milliseconds; five seconds of silence means it never will.
pub const RECV_TIMEOUT: Duration = Duration::from_secs(5);

const RTM_GETADDR: u16 = 22;
const IFADDRMSG_LEN: usize = 8;
const IFA_ADDRESS: u16 = 1;
const IFA_LOCAL: u16 = 2;
/// Largest answer datagram we read at once (the kernel sizes dump datagrams to the page size or to 32 KiB).
const RECV_BUF: usize = 64 * 1024;

fn check(ret: libc::c_int) -> io::Result<libc::c_int> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// Opens a netlink socket of `protocol` (`NETLINK_NETFILTER`, `NETLINK_ROUTE`, ...) in the calling thread's
/// netns, bound to a kernel-assigned port, whose receives give up after [`RECV_TIMEOUT`].
pub fn socket(protocol: libc::c_int) -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2) call; the returned descriptor is owned right away.
    let fd = check(unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, protocol) })?;
    // SAFETY: `fd` is a fresh descriptor nobody else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    set_recv_timeout(fd.as_fd(), RECV_TIMEOUT)?;
    // SAFETY: a zeroed sockaddr_nl is valid (pid 0: the kernel assigns one).
    let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    addr.nl_family = libc::AF_NETLINK as libc::sa_family_t;
    // SAFETY: `addr` is a valid sockaddr_nl of the given length.
    check(unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&addr as *const libc::sockaddr_nl).cast(),
            std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
        )
    })?;
    Ok(fd)
}

/// Sets how long a blocking receive on `fd` waits (`SO_RCVTIMEO`); [`socket`] sets [`RECV_TIMEOUT`].
pub fn set_recv_timeout(fd: BorrowedFd<'_>, timeout: Duration) -> io::Result<()> {
    let tv = libc::timeval {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_usec: libc::suseconds_t::from(timeout.subsec_micros() as i32),
    };
    // SAFETY: `tv` outlives the call and the length matches its type.
    check(unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&tv as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    })?;
    Ok(())
}

/// The receive timeout set on `fd`, for naming it in errors.
fn recv_timeout(fd: BorrowedFd<'_>) -> Option<Duration> {
    // SAFETY: a zeroed timeval is valid.
    let mut tv: libc::timeval = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::timeval>() as libc::socklen_t;
    // SAFETY: `tv` and `len` are valid for writing and `len` holds the buffer's size.
    let ret = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&mut tv as *mut libc::timeval).cast(),
            &mut len,
        )
    };
    (ret == 0).then(|| Duration::from_secs(tv.tv_sec as u64) + Duration::from_micros(tv.tv_usec as u64))
}

/// Reads one datagram from `fd` into `buf`, waiting at most the socket's receive timeout. A timeout is an error
/// of kind [`io::ErrorKind::TimedOut`] that says how long it waited.
pub fn recv(fd: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<usize> {
    loop {
        // SAFETY: `buf` is writable for its length.
        let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let err = io::Error::last_os_error();
        match err.kind() {
            io::ErrorKind::Interrupted => continue,
            io::ErrorKind::WouldBlock => {
                let waited = recv_timeout(fd).map_or_else(|| "its receive timeout".to_owned(), |t| format!("{t:?}"));
                return Err(io::Error::new(io::ErrorKind::TimedOut, format!("no netlink answer within {waited}")));
            }
            _ => return Err(err),
        }
    }
}

/// Every IPv4 and IPv6 address on the interfaces of the calling thread's netns (an `RTM_GETADDR` dump; what
/// `ip addr` shows), read over a socket from [`socket`].
pub fn addresses() -> io::Result<Vec<IpAddr>> {
    let fd = socket(libc::NETLINK_ROUTE)?;
    let len = NLMSG_HDRLEN + IFADDRMSG_LEN;
    let mut request = Vec::with_capacity(len);
    request.extend_from_slice(&(len as u32).to_ne_bytes());
    request.extend_from_slice(&RTM_GETADDR.to_ne_bytes());
    request.extend_from_slice(&(NLM_F_REQUEST | NLM_F_DUMP).to_ne_bytes());
    // Sequence 1, port 0 (the kernel), then an ifaddrmsg of family AF_UNSPEC: both families.
    request.extend_from_slice(&1u32.to_ne_bytes());
    request.extend_from_slice(&0u32.to_ne_bytes());
    request.extend_from_slice(&[0u8; IFADDRMSG_LEN]);
    // SAFETY: `request` is a valid buffer of the given length; the kernel is the default destination.
    if unsafe { libc::send(fd.as_raw_fd(), request.as_ptr().cast(), request.len(), 0) } < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut out = Vec::new();
    let mut buf = vec![0u8; RECV_BUF];
    loop {
        let n = recv(fd.as_fd(), &mut buf)?;
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "address dump ended without NLMSG_DONE"));
        }
        if let Some(end) = parse_addresses(&buf[..n], &mut out) {
            return end.map(|()| out);
        }
    }
}

/// Collects the addresses of the `RTM_NEWADDR` messages in one datagram; `Some` once the dump ended (`Ok`) or
/// the kernel refused it (`Err` with its errno).
fn parse_addresses(data: &[u8], out: &mut Vec<IpAddr>) -> Option<io::Result<()>> {
    let mut walk = messages(data);
    for message in walk.by_ref() {
        if message.ty == NLMSG_DONE {
            return Some(Ok(()));
        }
        if let Some(errno) = message.errno() {
            return Some(if errno == 0 { Ok(()) } else { Err(io::Error::from_raw_os_error(errno)) });
        }
        let Some((header, mut attrs)) = message.payload.split_at_checked(IFADDRMSG_LEN) else { continue };
        let family = i32::from(header[0]);
        let (mut local, mut address) = (None, None);
        while attrs.len() >= 4 {
            let alen = u16::from_ne_bytes([attrs[0], attrs[1]]) as usize;
            let aty = u16::from_ne_bytes([attrs[2], attrs[3]]);
            if alen < 4 || alen > attrs.len() {
                break;
            }
            let ip = ip_of(family, &attrs[4..alen]);
            match aty {
                IFA_LOCAL => local = ip,
                IFA_ADDRESS => address = ip,
                _ => {}
            }
            attrs = &attrs[((alen + 3) & !3).min(attrs.len())..];
        }
        // As getifaddrs: the local address when the link has a peer, else the address.
        out.extend(local.or(address));
    }
    walk.malformed().then(|| Err(io::Error::new(io::ErrorKind::InvalidData, "truncated netlink message")))
}

fn ip_of(family: i32, bytes: &[u8]) -> Option<IpAddr> {
    match family {
        libc::AF_INET => Some(IpAddr::V4(Ipv4Addr::from(<[u8; 4]>::try_from(bytes).ok()?))),
        libc::AF_INET6 => Some(IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(bytes).ok()?))),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn a_socket_nobody_answers_times_out_with_an_error_naming_the_wait() {
        // No request outstanding: the kernel will never send anything on this socket.
        let fd = socket(libc::NETLINK_ROUTE).unwrap();
        set_recv_timeout(fd.as_fd(), Duration::from_millis(100)).unwrap();
        let started = Instant::now();
        let err = recv(fd.as_fd(), &mut [0u8; 64]).unwrap_err();
        let waited = started.elapsed();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut, "{err}");
        assert!(err.to_string().contains("100ms"), "{err}");
        assert!(waited >= Duration::from_millis(100) && waited < Duration::from_secs(3), "{waited:?}");
    }

    #[test]
    fn sockets_get_the_receive_timeout() {
        let fd = socket(libc::NETLINK_ROUTE).unwrap();
        assert_eq!(recv_timeout(fd.as_fd()), Some(RECV_TIMEOUT));
    }

    #[test]
    fn the_address_dump_shows_loopback() {
        let addrs = addresses().unwrap();
        assert!(addrs.contains(&IpAddr::V4(Ipv4Addr::LOCALHOST)), "{addrs:?}");
    }

    #[test]
    fn a_length_field_beyond_the_datagram_ends_the_dump_as_invalid_data() {
        let mut msg = Vec::new();
        msg.extend_from_slice(&64u32.to_ne_bytes());
        msg.extend_from_slice(&RTM_GETADDR.to_ne_bytes());
        msg.extend_from_slice(&[0u8; 26]);
        let err = parse_addresses(&msg, &mut Vec::new()).unwrap().unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData, "{err}");
    }

    #[test]
    fn a_kernel_error_ends_the_dump_with_its_errno() {
        let mut msg = Vec::new();
        msg.extend_from_slice(&20u32.to_ne_bytes());
        msg.extend_from_slice(&uapi::NLMSG_ERROR.to_ne_bytes());
        msg.extend_from_slice(&[0u8; 10]);
        msg.extend_from_slice(&(-libc::EPERM).to_ne_bytes());
        let err = parse_addresses(&msg, &mut Vec::new()).unwrap().unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EPERM));
    }
}

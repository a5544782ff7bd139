//! `AF_UNIX` `SOCK_SEQPACKET` sockets on tokio, with fd passing (`SCM_RIGHTS`).
//!
//! ZDS puts exactly one protobuf message in each datagram, so the socket keeps message boundaries for us. This
//! module knows nothing of the messages' meaning and sets no deadlines; [`crate::server`] and [`crate::client`]
//! add those.

use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};

use nix::sys::socket::{
    accept4, bind, connect, listen, recvmsg, sendmsg, socket, socketpair, AddressFamily, Backlog, ControlMessage,
    ControlMessageOwned, MsgFlags, SockFlag, SockType, UnixAddr,
};
use nix::sys::stat::{fchmod, Mode};
use tokio::io::unix::AsyncFd;

use crate::ZdsError;

/// Largest datagram a peer may send; ztunnel and Istio's agent both read into a buffer of this size.
/// [`SeqpacketConn::send`] only sends messages strictly under it.
pub const MAX_MESSAGE_LEN: usize = 1024;

/// `SCM_MAX_FD` of Linux: the most fds one datagram can carry. Room for all of them means the kernel never
/// truncates the control data, so every fd it hands us is owned (and closed) by us.
const MAX_FDS_PER_MESSAGE: usize = 253;

fn socket_error(path: &Path, op: &'static str, err: impl Into<std::io::Error>) -> ZdsError {
    ZdsError::Socket { path: path.to_owned(), op, source: err.into() }
}

fn io_error(op: &'static str, err: impl Into<std::io::Error>) -> ZdsError {
    ZdsError::Io { op, source: err.into() }
}

fn new_socket() -> nix::Result<OwnedFd> {
    socket(AddressFamily::Unix, SockType::SeqPacket, SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC, None)
}

fn register(fd: OwnedFd) -> std::io::Result<AsyncFd<OwnedFd>> {
    // SAFETY: the OwnedFd is a valid, open descriptor that the AsyncFd owns from now on; nothing replaces or
    // closes it while it is registered.
    Ok(unsafe { AsyncFd::register(fd)? })
}

/// A listening seqpacket socket bound to a path; the agent's end of the ZDS socket.
#[derive(Debug)]
pub struct SeqpacketListener {
    fd: AsyncFd<OwnedFd>,
    path: PathBuf,
}

impl SeqpacketListener {
    /// Binds and listens at `path` with file mode `mode`.
    ///
    /// A stale socket file left by a previous agent is removed first; any other kind of file at `path` is an
    /// error. Missing parent directories are created. The mode is applied to the socket before `bind(2)`, so
    /// the file never exists with wider permissions, and set again afterwards because the umask may have
    /// narrowed it. The file is not removed on drop: a newer agent may already own the path.
    /// Must be called within a tokio runtime.
    pub fn bind(path: &Path, mode: u32) -> Result<Self, ZdsError> {
        match std::fs::symlink_metadata(path) {
            Ok(meta) if meta.file_type().is_socket() => {
                std::fs::remove_file(path).map_err(|e| socket_error(path, "remove stale socket", e))?;
            }
            Ok(_) => {
                return Err(socket_error(
                    path,
                    "check path",
                    std::io::Error::new(std::io::ErrorKind::AlreadyExists, "exists and is not a socket"),
                ))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(socket_error(path, "stat", e)),
        }
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| socket_error(path, "create parent directory", e))?;
        }
        let fd = new_socket().map_err(|e| socket_error(path, "socket", e))?;
        fchmod(&fd, Mode::from_bits_truncate(mode)).map_err(|e| socket_error(path, "fchmod", e))?;
        let addr = UnixAddr::new(path).map_err(|e| socket_error(path, "address", e))?;
        bind(fd.as_raw_fd(), &addr).map_err(|e| socket_error(path, "bind", e))?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
            .map_err(|e| socket_error(path, "chmod", e))?;
        listen(&fd, Backlog::MAXCONN).map_err(|e| socket_error(path, "listen", e))?;
        let fd = register(fd).map_err(|e| socket_error(path, "register with tokio", e))?;
        Ok(SeqpacketListener { fd, path: path.to_owned() })
    }

    /// The path this listener is bound to.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Waits for the next connection.
    pub async fn accept(&self) -> Result<SeqpacketConn, ZdsError> {
        let fd = loop {
            let mut guard = self.fd.readable().await.map_err(|e| io_error("accept", e))?;
            match guard.try_io(|inner| {
                accept4(inner.as_raw_fd(), SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC)
                    .map_err(std::io::Error::from)
            }) {
                Ok(result) => break result.map_err(|e| io_error("accept", e))?,
                Err(_would_block) => continue,
            }
        };
        // SAFETY: accept4 returned a new descriptor that nothing else owns.
        SeqpacketConn::from_owned(unsafe { OwnedFd::from_raw_fd(fd) })
    }
}

/// One end of a seqpacket connection: whole datagrams in, whole datagrams out, fds alongside.
#[derive(Debug)]
pub struct SeqpacketConn {
    fd: AsyncFd<OwnedFd>,
}

impl SeqpacketConn {
    /// Connects to the listener at `path` (the proxy's side).
    pub async fn connect(path: &Path) -> Result<Self, ZdsError> {
        let fd = new_socket().map_err(|e| socket_error(path, "socket", e))?;
        let addr = UnixAddr::new(path).map_err(|e| socket_error(path, "address", e))?;
        // A unix connect completes at once, or fails with EAGAIN when the listener's backlog is full.
        connect(fd.as_raw_fd(), &addr).map_err(|e| socket_error(path, "connect", e))?;
        Self::from_owned(fd)
    }

    /// A connected pair in this process, e.g. to test a peer without a socket file.
    pub fn pair() -> Result<(Self, Self), ZdsError> {
        let (a, b) = socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
        )
        .map_err(|e| io_error("socketpair", e))?;
        Ok((Self::from_owned(a)?, Self::from_owned(b)?))
    }

    fn from_owned(fd: OwnedFd) -> Result<Self, ZdsError> {
        Ok(SeqpacketConn { fd: register(fd).map_err(|e| io_error("register with tokio", e))? })
    }

    /// Sends one datagram of under [`MAX_MESSAGE_LEN`] bytes, with `fd` in `SCM_RIGHTS` if given.
    pub async fn send(&self, bytes: &[u8], fd: Option<BorrowedFd<'_>>) -> Result<(), ZdsError> {
        if bytes.len() >= MAX_MESSAGE_LEN {
            return Err(ZdsError::TooLarge { len: bytes.len(), max: MAX_MESSAGE_LEN - 1 });
        }
        let fds: Vec<RawFd> = fd.iter().map(|fd| fd.as_raw_fd()).collect();
        let rights = [ControlMessage::ScmRights(&fds)];
        let cmsgs: &[ControlMessage] = if fds.is_empty() { &[] } else { &rights };
        let iov = [IoSlice::new(bytes)];
        loop {
            let mut guard = self.fd.writable().await.map_err(|e| io_error("send", e))?;
            match guard.try_io(|inner| {
                sendmsg::<()>(inner.as_raw_fd(), &iov, cmsgs, MsgFlags::MSG_NOSIGNAL, None)
                    .map_err(std::io::Error::from)
            }) {
                Ok(Ok(n)) if n == bytes.len() => return Ok(()),
                Ok(Ok(n)) => return Err(ZdsError::Protocol(format!("short send of {n} of {} bytes", bytes.len()))),
                Ok(Err(e)) if is_hang_up(&e) => return Err(ZdsError::PeerClosed),
                Ok(Err(e)) => return Err(io_error("send", e)),
                Err(_would_block) => continue,
            }
        }
    }

    /// Receives one datagram and the fds that came with it.
    ///
    /// A datagram over [`MAX_MESSAGE_LEN`] bytes is a protocol error (its fds are closed). End of stream is
    /// [`ZdsError::PeerClosed`]. Cancel-safe: a datagram is either consumed whole or left in the socket.
    pub async fn recv(&self) -> Result<(Vec<u8>, Vec<OwnedFd>), ZdsError> {
        loop {
            let mut guard = self.fd.readable().await.map_err(|e| io_error("recv", e))?;
            match guard.try_io(|inner| recv_once(inner.as_raw_fd())) {
                Ok(Err(e)) if is_hang_up(&e) => return Err(ZdsError::PeerClosed),
                Ok(result) => return result.map_err(|e| io_error("recv", e))?,
                Err(_would_block) => continue,
            }
        }
    }

    /// Encodes and sends one protobuf message.
    pub async fn send_msg(&self, msg: &impl prost::Message, fd: Option<BorrowedFd<'_>>) -> Result<(), ZdsError> {
        self.send(&msg.encode_to_vec(), fd).await
    }

    /// Receives and decodes one protobuf message; `what` names it in errors.
    pub async fn recv_msg<M: prost::Message + Default>(
        &self,
        what: &'static str,
    ) -> Result<(M, Vec<OwnedFd>), ZdsError> {
        let (bytes, fds) = self.recv().await?;
        let msg = M::decode(&bytes[..]).map_err(|source| ZdsError::Decode { what, source })?;
        Ok((msg, fds))
    }
}

impl AsFd for SeqpacketConn {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.get_ref().as_fd()
    }
}

/// The peer is gone. ECONNRESET is how Linux reports a peer that closed with our datagrams still unread.
fn is_hang_up(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EPIPE | libc::ECONNRESET))
}

/// One non-blocking `recvmsg`. The outer result carries `WouldBlock` for tokio; the inner one the outcome.
#[allow(clippy::type_complexity)]
fn recv_once(raw: RawFd) -> std::io::Result<Result<(Vec<u8>, Vec<OwnedFd>), ZdsError>> {
    let mut buf = [0u8; MAX_MESSAGE_LEN];
    let mut cmsg_buf = nix::cmsg_space!([RawFd; MAX_FDS_PER_MESSAGE]);
    let mut iov = [IoSliceMut::new(&mut buf)];
    let msg = recvmsg::<()>(raw, &mut iov, Some(&mut cmsg_buf), MsgFlags::MSG_CMSG_CLOEXEC | MsgFlags::MSG_DONTWAIT)
        .map_err(std::io::Error::from)?;
    let (len, flags) = (msg.bytes, msg.flags);
    let mut fds = Vec::new();
    let Ok(cmsgs) = msg.cmsgs() else {
        return Ok(Err(ZdsError::Protocol("control data truncated (too many fds)".into())));
    };
    for cmsg in cmsgs {
        if let ControlMessageOwned::ScmRights(raws) = cmsg {
            // SAFETY: the kernel just installed these descriptors for us; nothing else owns them.
            fds.extend(raws.into_iter().map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }));
        }
    }
    if flags.contains(MsgFlags::MSG_TRUNC) {
        return Ok(Err(ZdsError::Protocol(format!("datagram truncated: over {MAX_MESSAGE_LEN} bytes"))));
    }
    if len == 0 {
        return Ok(Err(ZdsError::PeerClosed));
    }
    Ok(Ok((buf[..len].to_vec(), fds)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::sys::stat::fstat;

    #[tokio::test]
    async fn datagram_with_fd_round_trip() {
        let (a, b) = SeqpacketConn::pair().unwrap();
        let file = std::fs::File::open("/proc/self/ns/net").unwrap();
        a.send(b"hello", Some(file.as_fd())).await.unwrap();
        a.send(b"second", None).await.unwrap();
        let (bytes, fds) = b.recv().await.unwrap();
        assert_eq!(bytes, b"hello");
        assert_eq!(fds.len(), 1);
        let (want, got) = (fstat(&file).unwrap(), fstat(&fds[0]).unwrap());
        assert_eq!((got.st_dev, got.st_ino), (want.st_dev, want.st_ino));
        let (bytes, fds) = b.recv().await.unwrap();
        assert_eq!(bytes, b"second");
        assert!(fds.is_empty());
    }

    #[tokio::test]
    async fn oversized_send_is_refused() {
        let (a, _b) = SeqpacketConn::pair().unwrap();
        assert!(matches!(
            a.send(&[0u8; MAX_MESSAGE_LEN], None).await,
            Err(ZdsError::TooLarge { len: MAX_MESSAGE_LEN, .. })
        ));
        a.send(&[0u8; MAX_MESSAGE_LEN - 1], None).await.unwrap();
    }

    #[tokio::test]
    async fn oversized_datagram_is_reported_as_truncated() {
        let (a, b) = SeqpacketConn::pair().unwrap();
        let big = [7u8; MAX_MESSAGE_LEN + 1];
        sendmsg::<()>(a.as_fd().as_raw_fd(), &[IoSlice::new(&big)], &[], MsgFlags::empty(), None).unwrap();
        a.send(b"next", None).await.unwrap();
        assert!(matches!(b.recv().await, Err(ZdsError::Protocol(m)) if m.contains("truncated")));
        // The rest of the big datagram is discarded, not delivered as a second message.
        assert_eq!(b.recv().await.unwrap().0, b"next");
    }

    #[tokio::test]
    async fn closed_peer_is_reported() {
        let (a, b) = SeqpacketConn::pair().unwrap();
        drop(a);
        assert!(matches!(b.recv().await, Err(ZdsError::PeerClosed)));
        assert!(matches!(b.send(b"x", None).await, Err(ZdsError::PeerClosed)));
    }
}

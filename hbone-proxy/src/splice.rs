//! Moves bytes between two TCP sockets of this kernel both ways with `splice(2)` through a pipe, so they never
//! cross into user space: the same-node fast path's data plane ([`crate::fast_path`]), where both ends are plain
//! TCP sockets and nothing needs to read or encrypt the bytes.
//!
//! Each direction has its own pipe of at most [`PIPE_SIZE`] bytes: it is filled from one socket while empty, then
//! drained into the other completely before the next fill, so a slow reader holds at most one pipe's worth per
//! direction, and backpressure reaches the sender as with a copy. Half-close works as
//! [`tokio::io::copy_bidirectional`]'s: the end of one side's stream (its FIN) shuts down the write side of the
//! other once everything before it is delivered, and the other direction goes on until its own end. An error on
//! either side ends both. When pipes cannot be made (out of file descriptors, say), the bytes are copied with
//! tokio instead.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};

use nix::fcntl::{fcntl, splice, FcntlArg, OFlag, SpliceFFlags};
use nix::sys::socket::Shutdown;
use tokio::io::Interest;
use tokio::net::TcpStream;

/// The capacity asked for each direction's pipe (the kernel's default is 64 KiB): fewer system calls per byte, and
/// still a small, fixed amount of kernel memory per connection. A kernel that refuses it keeps its default.
pub const PIPE_SIZE: usize = 256 * 1024;

/// Bytes moved each way: (`a` → `b`, `b` → `a`).
pub type Moved = (u64, u64);

/// Moves bytes between `a` and `b` both ways until both directions ended (each with its side's FIN), with
/// `splice(2)` where pipes can be made, else with a copy. On error, the bytes moved until then come with it.
pub async fn bidirectional(a: &mut TcpStream, b: &mut TcpStream) -> Result<Moved, (Moved, io::Error)> {
    let (forward, backward) = match (Pipe::new(), Pipe::new()) {
        (Ok(forward), Ok(backward)) => (forward, backward),
        (Err(error), _) | (_, Err(error)) => {
            tracing::debug!(%error, "no pipe for splice: copying instead");
            return tokio::io::copy_bidirectional_with_sizes(a, b, 64 * 1024, 64 * 1024).await.map_err(|e| ((0, 0), e));
        }
    };
    let (to_b, to_a) = (AtomicU64::new(0), AtomicU64::new(0));
    let result = tokio::try_join!(one_way(a, b, &forward, &to_b), one_way(b, a, &backward, &to_a));
    let moved = (to_b.load(Ordering::Relaxed), to_a.load(Ordering::Relaxed));
    match result {
        Ok(_) => Ok(moved),
        Err(error) => Err((moved, error)),
    }
}

/// One direction's pipe.
struct Pipe {
    read: OwnedFd,
    write: OwnedFd,
}

impl Pipe {
    fn new() -> io::Result<Self> {
        let (read, write) = nix::unistd::pipe2(OFlag::O_NONBLOCK | OFlag::O_CLOEXEC)?;
        if let Err(error) = fcntl(&write, FcntlArg::F_SETPIPE_SZ(PIPE_SIZE as i32)) {
            tracing::debug!(%error, size = PIPE_SIZE, "pipe size not raised: keeping the kernel's default");
        }
        Ok(Pipe { read, write })
    }
}

/// Moves `from`'s stream into `to` through `pipe` until `from`'s FIN, then shuts down `to`'s write side.
async fn one_way(from: &TcpStream, to: &TcpStream, pipe: &Pipe, moved: &AtomicU64) -> io::Result<()> {
    let flags = SpliceFFlags::SPLICE_F_MOVE | SpliceFFlags::SPLICE_F_NONBLOCK;
    loop {
        // The pipe is empty here: fill it with whatever `from` has, up to its capacity.
        let filled = loop {
            from.readable().await?;
            match from.try_io(Interest::READABLE, || Ok(splice(from, None, &pipe.write, None, PIPE_SIZE, flags)?)) {
                Ok(n) => break n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            }
        };
        if filled == 0 {
            return match nix::sys::socket::shutdown(to.as_raw_fd(), Shutdown::Write) {
                // The other side is already gone: nothing left to tell it.
                Ok(()) | Err(nix::errno::Errno::ENOTCONN) => Ok(()),
                Err(e) => Err(e.into()),
            };
        }
        // Drain it completely into `to` before reading more.
        let mut left = filled;
        while left > 0 {
            to.writable().await?;
            match to.try_io(Interest::WRITABLE, || Ok(splice(&pipe.read, None, to, None, left, flags)?)) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    left -= n;
                    moved.fetch_add(n as u64, Ordering::Relaxed);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;

    /// A connected pair of loopback sockets: (client, server).
    async fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();
        let (server, _) = listener.accept().await.unwrap();
        (client, server)
    }

    /// A client → (proxy's a | proxy's b) → server chain, spliced in the middle; each end sends its own bytes
    /// (more than several pipes' worth), half-closes, and reads the other's to the end.
    #[tokio::test]
    async fn both_directions_arrive_whole_and_each_fin_is_passed_on() {
        let (mut client, mut a) = pair().await;
        let (mut b, mut server) = pair().await;
        let proxy = tokio::spawn(async move { bidirectional(&mut a, &mut b).await.map_err(|(_, e)| e.to_string()) });
        let up: Vec<u8> = (0..3 * PIPE_SIZE + 17).map(|i| (i % 251) as u8).collect();
        let down: Vec<u8> = (0..PIPE_SIZE / 3).map(|i| (i % 241) as u8).collect();
        let (up2, down2) = (up.clone(), down.clone());
        let client_side = tokio::spawn(async move {
            client.write_all(&up2).await.unwrap();
            client.shutdown().await.unwrap();
            let mut got = Vec::new();
            client.read_to_end(&mut got).await.unwrap();
            got
        });
        // The server reads the client's stream to its end (the FIN came through) before it answers: half-close.
        let mut got = Vec::new();
        server.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, up, "client → server arrived whole");
        server.write_all(&down2).await.unwrap();
        server.shutdown().await.unwrap();
        assert_eq!(client_side.await.unwrap(), down, "server → client arrived whole after the client's FIN");
        let moved = proxy.await.unwrap().unwrap();
        assert_eq!(moved, (up.len() as u64, down.len() as u64));
    }

    #[tokio::test]
    async fn a_reset_ends_both_directions_with_an_error_and_the_bytes_moved_so_far() {
        let (mut client, mut a) = pair().await;
        let (mut b, mut server) = pair().await;
        let proxy = tokio::spawn(async move { bidirectional(&mut a, &mut b).await });
        client.write_all(b"hello").await.unwrap();
        let mut got = [0u8; 5];
        server.read_exact(&mut got).await.unwrap();
        client.set_zero_linger().unwrap();
        drop(client);
        let ((to_b, _), _error) = proxy.await.unwrap().expect_err("a reset is an error");
        assert_eq!(to_b, 5);
    }
}

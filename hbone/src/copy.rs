//! Carries bytes both ways between an HBONE tunnel and a plain stream (the app's connection), with half-close,
//! without copying them in user space: what is read from the plain stream goes to HTTP/2 as the very buffer it
//! was read into (`Bytes`), and the tunnel's DATA payloads are written to the plain stream as h2 hands them out.
//! A generic copy through `AsyncRead`/`AsyncWrite` pays one extra `memcpy` per byte each way (into h2's send
//! buffer, out of its receive buffer), which on a CPU-bound node is a measurable share of the proxy's time.
//!
//! A budgeted tunnel (see [`crate::budget`]) charges what it reads from the plain stream to its pod's account until
//! it is written to the HBONE connection, starts no read while the account has no room, and keeps no read buffer
//! while it waits; what it received is given back as it reaches the plain stream.

use std::future::poll_fn;
use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::budget::Account;
use crate::stream::{h2_to_io, H2Stream};

/// The most read from the plain stream at once, at first (on the stack, then copied): what an idle or
/// request/response connection needs.
const SMALL_READ: usize = 16 * 1024;
/// Room made once a read filled the buffer (a bulk transfer): the most one DATA frame carries from it. Large reads
/// mean fewer syscalls, fewer HTTP/2 frames and full TLS records (16 KiB each) for all but the last of a frame.
pub(crate) const LARGE_READ: usize = 256 * 1024;

/// What a finished copy carried, and how it ended.
#[derive(Debug)]
pub struct Copied {
    /// Bytes read from the plain stream and sent into the tunnel.
    pub to_tunnel: u64,
    /// Bytes received from the tunnel and written to the plain stream.
    pub from_tunnel: u64,
    /// Why the copy stopped before both sides ended cleanly, if it did.
    pub error: Option<io::Error>,
}

/// Copies both ways until both directions are done: the plain stream's EOF becomes the tunnel's END_STREAM, the
/// tunnel's END_STREAM shuts down the plain stream's write side. The first error ends both directions.
pub async fn bidirectional<T>(tunnel: &mut H2Stream, plain: &mut T) -> Copied
where
    T: AsyncRead + AsyncWrite + Unpin,
{
    let mut up = Up {
        buf: BytesMut::new(),
        read_size: SMALL_READ,
        pending: Bytes::new(),
        account: tunnel.account().cloned(),
        eof: false,
        done: false,
        total: 0,
    };
    let mut down = Down { pending: Bytes::new(), eof: false, done: false, total: 0 };
    let result = poll_fn(|cx| {
        let up_ready = up.poll(cx, tunnel, plain)?.is_ready();
        let down_ready = down.poll(cx, tunnel, plain)?.is_ready();
        if up_ready && down_ready {
            Poll::Ready(Ok(()))
        } else {
            Poll::Pending
        }
    })
    .await;
    Copied { to_tunnel: up.total, from_tunnel: down.total, error: result.err() }
}

/// Plain stream → tunnel.
struct Up {
    /// Where bulk reads land; each read's bytes are split off and frozen, so h2 holds them without a copy.
    buf: BytesMut,
    /// Room made before each read: [`SMALL_READ`], or [`LARGE_READ`] once a read filled it.
    read_size: usize,
    /// Read but not yet handed to h2 (waiting for flow-control capacity).
    pending: Bytes,
    /// The pod account charged with what was read, until it is written to the HBONE connection; `None` when the
    /// tunnel is not budgeted.
    account: Option<Account>,
    eof: bool,
    done: bool,
    total: u64,
}

impl Up {
    fn poll<T>(&mut self, cx: &mut Context<'_>, tunnel: &mut H2Stream, plain: &mut T) -> Poll<io::Result<()>>
    where
        T: AsyncRead + Unpin,
    {
        loop {
            if self.done {
                return Poll::Ready(Ok(()));
            }
            if !self.pending.is_empty() {
                tunnel.send.reserve_capacity(self.pending.len());
                match ready!(tunnel.send.poll_capacity(cx)) {
                    Some(Ok(n)) => {
                        let n = n.min(self.pending.len());
                        if n > 0 {
                            tunnel.send_charged(self.pending.split_to(n), self.account.is_some())?;
                            self.total += n as u64;
                        }
                    }
                    Some(Err(e)) => return Poll::Ready(Err(h2_to_io(e))),
                    None => {
                        return Poll::Ready(Err(io::Error::new(
                            io::ErrorKind::BrokenPipe,
                            "HBONE stream closed by the peer",
                        )))
                    }
                }
                continue;
            }
            if self.eof {
                tunnel.write_closed = true;
                tunnel.send.send_data(Bytes::new(), true).map_err(h2_to_io)?;
                self.done = true;
                continue;
            }
            // No read starts while the pod holds its share of the memory budget (or the node all of it): the app's
            // socket fills and TCP holds the app back.
            if let Some(account) = &self.account {
                if account.poll_room(cx).is_pending() {
                    // Nor does a waiting tunnel keep its read buffer: thousands of them may wait.
                    self.buf = BytesMut::new();
                    return tunnel.poll_reset_while_waiting(cx).map(Err);
                }
            }
            let n = if self.read_size == SMALL_READ {
                // Until the stream proves bulk, reads land on the stack and only what was read is copied out: an idle
                // or request/response tunnel holds no read buffer while it waits (thousands may wait).
                let mut stack = [std::mem::MaybeUninit::<u8>::uninit(); SMALL_READ];
                let mut read = ReadBuf::uninit(&mut stack);
                ready!(Pin::new(&mut *plain).poll_read(cx, &mut read))?;
                self.pending = Bytes::copy_from_slice(read.filled());
                read.filled().len()
            } else {
                // Reuses the allocation once h2 has written out (dropped) the previous chunks, else allocates anew.
                self.buf.reserve(self.read_size);
                let n = ready!(tokio_util::io::poll_read_buf(Pin::new(&mut *plain), cx, &mut self.buf))?;
                self.pending = self.buf.split().freeze();
                n
            };
            if n == 0 {
                self.eof = true;
            } else {
                if let Some(account) = &self.account {
                    account.charge(n);
                }
                if n >= self.read_size {
                    self.read_size = LARGE_READ;
                }
            }
        }
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        if let Some(account) = &self.account {
            account.credit(self.pending.len());
        }
    }
}

/// Tunnel → plain stream.
struct Down {
    /// A DATA payload not yet fully written to the plain stream.
    pending: Bytes,
    eof: bool,
    done: bool,
    total: u64,
}

impl Down {
    fn poll<T>(&mut self, cx: &mut Context<'_>, tunnel: &mut H2Stream, plain: &mut T) -> Poll<io::Result<()>>
    where
        T: AsyncWrite + Unpin,
    {
        loop {
            if self.done {
                return Poll::Ready(Ok(()));
            }
            if !self.pending.is_empty() {
                let n = ready!(Pin::new(&mut *plain).poll_write(cx, &self.pending))?;
                if n == 0 {
                    return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
                }
                self.pending.advance(n);
                self.total += n as u64;
                // Reopen the flow-control window (and give the bytes back to the budget) only for what reached the
                // plain stream.
                tunnel.release(n);
                continue;
            }
            if self.eof {
                ready!(Pin::new(&mut *plain).poll_shutdown(cx))?;
                self.done = true;
                continue;
            }
            ready!(Pin::new(&mut *plain).poll_flush(cx))?;
            match ready!(tunnel.recv.poll_data(cx)) {
                None => self.eof = true,
                Some(Ok(data)) => self.pending = data,
                Some(Err(e)) if e.reason() == Some(h2::Reason::NO_ERROR) => self.eof = true,
                Some(Err(e)) => return Poll::Ready(Err(h2_to_io(e))),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// Both ends of one CONNECT stream over an in-memory HTTP/2 connection: (client's, server's).
    async fn tunnel_pair() -> (H2Stream, H2Stream) {
        let (client_io, server_io) = tokio::io::duplex(1 << 20);
        let server = tokio::spawn(async move {
            let mut conn = h2::server::handshake(server_io).await.expect("server handshake");
            let (request, mut respond) = conn.accept().await.expect("a request").expect("a valid request");
            let send = respond.send_response(http::Response::new(()), false).expect("200");
            tokio::spawn(async move { while conn.accept().await.is_some() {} });
            H2Stream::new(send, request.into_body(), None)
        });
        let (mut client, conn) = h2::client::handshake(client_io).await.expect("client handshake");
        tokio::spawn(conn);
        let request = http::Request::connect("10.0.0.1:80").body(()).expect("CONNECT");
        client = client.ready().await.expect("ready");
        let (response, send) = client.send_request(request, false).expect("send CONNECT");
        let recv = response.await.expect("response").into_body();
        (H2Stream::new(send, recv, None), server.await.expect("server task"))
    }

    #[tokio::test]
    async fn carries_both_ways_with_half_close_and_counts_the_bytes() {
        let (mut near, mut far) = tunnel_pair().await;
        let (mut app, mut plain) = tokio::io::duplex(64 * 1024);
        let upload: Vec<u8> = (0..3_000_000u32).map(|i| i as u8).collect();
        let download = vec![7u8; 1_234_567];
        let copy = tokio::spawn(async move { bidirectional(&mut near, &mut plain).await });
        // The far end reads the whole upload (its END_STREAM arrives once the app shut its write side down), then
        // answers and ends its side.
        let far_end = tokio::spawn({
            let download = download.clone();
            async move {
                let mut got = Vec::new();
                far.read_to_end(&mut got).await.expect("far end reads");
                far.write_all(&download).await.expect("far end writes");
                far.shutdown().await.expect("far end shuts down");
                got
            }
        });
        let mut back = Vec::new();
        let exchange = async {
            app.write_all(&upload).await.expect("app writes");
            app.shutdown().await.expect("app shuts down");
            app.read_to_end(&mut back).await.expect("app reads to EOF");
        };
        // Generous: a broken half-close shows as a hang, which this turns into a failure.
        tokio::time::timeout(std::time::Duration::from_secs(30), exchange).await.expect("both ends reached EOF");
        assert_eq!(far_end.await.expect("far end"), upload);
        assert_eq!(back, download);
        let copied = copy.await.expect("copy task");
        assert!(copied.error.is_none(), "{:?}", copied.error);
        assert_eq!((copied.to_tunnel, copied.from_tunnel), (upload.len() as u64, download.len() as u64));
    }
}

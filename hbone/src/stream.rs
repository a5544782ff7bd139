//! One HBONE tunnel as a byte stream: the body of an HTTP/2 CONNECT stream in both directions.

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use h2::{RecvStream, SendStream};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Whatever must live exactly as long as one tunnel, such as a pooled client stream's reservation on its
/// connection (dropping the tunnel gives the slot back). Opaque here, so this module depends on no user of it.
pub(crate) type StreamGuard = Box<dyn Send + Sync>;

/// The tunnel's byte stream. Shutting down the write side sends END_STREAM; the peer's END_STREAM reads as
/// EOF, so half-close works both ways. Dropping it without a shutdown resets the stream.
pub struct H2Stream {
    pub(crate) send: SendStream<Bytes>,
    pub(crate) recv: RecvStream,
    pending: Bytes,
    pub(crate) write_closed: bool,
    _guard: Option<StreamGuard>,
}

impl std::fmt::Debug for H2Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("H2Stream").field("stream_id", &self.send.stream_id().as_u32()).finish_non_exhaustive()
    }
}

impl H2Stream {
    pub(crate) fn new(send: SendStream<Bytes>, recv: RecvStream, guard: Option<StreamGuard>) -> Self {
        H2Stream { send, recv, pending: Bytes::new(), write_closed: false, _guard: guard }
    }
}

pub(crate) fn h2_to_io(e: h2::Error) -> io::Error {
    if e.is_io() {
        e.into_io().unwrap_or_else(|| io::Error::other("h2 I/O error"))
    } else {
        io::Error::new(io::ErrorKind::ConnectionReset, e)
    }
}

impl AsyncRead for H2Stream {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        loop {
            if !self.pending.is_empty() {
                let n = self.pending.len().min(buf.remaining());
                let chunk = self.pending.split_to(n);
                buf.put_slice(&chunk);
                // Reopen the flow-control window only for what the reader actually consumed.
                let _ = self.recv.flow_control().release_capacity(n);
                return Poll::Ready(Ok(()));
            }
            match ready!(self.recv.poll_data(cx)) {
                None => return Poll::Ready(Ok(())),
                Some(Ok(data)) => self.pending = data,
                Some(Err(e)) if e.reason() == Some(h2::Reason::NO_ERROR) => return Poll::Ready(Ok(())),
                Some(Err(e)) => return Poll::Ready(Err(h2_to_io(e))),
            }
        }
    }
}

impl AsyncWrite for H2Stream {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        if self.write_closed {
            return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
        }
        self.send.reserve_capacity(buf.len());
        match ready!(self.send.poll_capacity(cx)) {
            Some(Ok(n)) => {
                let n = n.min(buf.len());
                self.send.send_data(Bytes::copy_from_slice(&buf[..n]), false).map_err(h2_to_io)?;
                Poll::Ready(Ok(n))
            }
            Some(Err(e)) => Poll::Ready(Err(h2_to_io(e))),
            None => Poll::Ready(Err(io::Error::new(io::ErrorKind::BrokenPipe, "HBONE stream closed by the peer"))),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // The connection task writes frames out as soon as they are queued.
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if !self.write_closed {
            self.write_closed = true;
            self.send.send_data(Bytes::new(), true).map_err(h2_to_io)?;
        }
        Poll::Ready(Ok(()))
    }
}

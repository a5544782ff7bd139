//! One HBONE tunnel as a byte stream: the body of an HTTP/2 CONNECT stream in both directions.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use h2::{RecvStream, SendStream};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::budget::{Account, ConnLedger};

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
    /// The connection's ledger in the memory budget, and this stream's key in it; `None` when not budgeted.
    ledger: Option<(Arc<ConnLedger>, u64)>,
    /// Bytes handed to h2 to send.
    handed: usize,
    _guard: Option<StreamGuard>,
}

impl std::fmt::Debug for H2Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("H2Stream").field("stream_id", &self.send.stream_id().as_u32()).finish_non_exhaustive()
    }
}

impl H2Stream {
    pub(crate) fn new(send: SendStream<Bytes>, recv: RecvStream, guard: Option<StreamGuard>) -> Self {
        H2Stream { send, recv, pending: Bytes::new(), write_closed: false, ledger: None, handed: 0, _guard: guard }
    }

    /// Counts what this stream holds against its connection's ledger, until it is dropped.
    pub(crate) fn budgeted(mut self, ledger: Option<Arc<ConnLedger>>) -> Self {
        self.ledger = ledger.map(|ledger| {
            let key = ledger.track(self.recv.flow_control().clone());
            (ledger, key)
        });
        self
    }

    /// The pod account reads for this stream are charged to, if it is budgeted.
    pub(crate) fn account(&self) -> Option<&Account> {
        self.ledger.as_ref().map(|(ledger, _)| ledger.account())
    }

    /// Hands `data` to h2 to send; it stays charged to [`H2Stream::account`] until written to the socket.
    /// `charged` says whether it already is (else it is charged now); on an error it is given back.
    pub(crate) fn send_charged(&mut self, data: Bytes, charged: bool) -> io::Result<()> {
        let n = data.len();
        if let Err(e) = self.send.send_data(data, false) {
            if let (Some(account), true) = (self.account(), charged) {
                account.credit(n);
            }
            return Err(h2_to_io(e));
        }
        self.handed += n;
        if let Some((ledger, _)) = &self.ledger {
            if !charged {
                ledger.account().charge(n);
            }
            ledger.handed(n);
        }
        Ok(())
    }

    /// While the stream waits for room in the budget: an error once the peer resets it (or the connection fails),
    /// so a waiting stream notices that it ended.
    pub(crate) fn poll_reset_while_waiting(&mut self, cx: &mut Context<'_>) -> Poll<io::Error> {
        match ready!(self.send.poll_reset(cx)) {
            Ok(reason) => Poll::Ready(io::Error::new(io::ErrorKind::ConnectionReset, h2::Error::from(reason))),
            Err(e) => Poll::Ready(h2_to_io(e)),
        }
    }

    /// `n` received bytes reached the reader: reopens the flow-control window and gives them back to the budget.
    pub(crate) fn release(&mut self, n: usize) {
        let _ = self.recv.flow_control().release_capacity(n);
        if let Some((ledger, _)) = &self.ledger {
            ledger.released(n);
        }
    }
}

impl Drop for H2Stream {
    fn drop(&mut self) {
        if let Some((ledger, key)) = self.ledger.take() {
            // Without END_STREAM the stream is reset, and h2 discards what it had not sent yet.
            ledger.forget(key, if self.write_closed { 0 } else { self.handed });
        }
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
                self.release(n);
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
        // A budgeted stream takes no more bytes while its pod's account has no room.
        if let Some(account) = self.account() {
            if account.poll_room(cx).is_pending() {
                return self.poll_reset_while_waiting(cx).map(Err);
            }
        }
        self.send.reserve_capacity(buf.len());
        match ready!(self.send.poll_capacity(cx)) {
            Some(Ok(n)) => {
                let n = n.min(buf.len());
                self.send_charged(Bytes::copy_from_slice(&buf[..n]), false)?;
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

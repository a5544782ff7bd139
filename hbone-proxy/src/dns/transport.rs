//! The upstream transports: how one query is exchanged with one upstream resolver from inside a pod, over the
//! pod's UDP socket for that upstream or over a client connection's TCP connection to it; and DNS over TCP's
//! length-prefixed framing, which the client side uses too.
//!
//! Guarantees:
//! - Sockets are reused: one connected UDP socket per pod and upstream, one TCP connection per client connection
//!   and upstream, each carrying any number of queries under remapped ids ([`super::ids`]); an exchange that
//!   gives up leaves nothing behind on them.
//! - A socket's reader lives exactly as long as its owner: it is aborted when the forwarder (UDP) or the client
//!   connection (TCP) goes.
//! - A UDP receive error (ICMP port unreachable) fails the queries pending on that socket at once, so they move on
//!   to the next upstream. A TCP connection that ends, or whose write stopped midway (out of frame), takes no
//!   more queries; the next query opens a new one, and a query that failed on a reused connection is tried once
//!   on a new one.
//! - Framing reads at most the length it was given (a longer frame is an `InvalidData` error, left unread), and
//!   writes a frame whole or reports the error.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::{TcpStream, UdpSocket};
use tokio::sync::OnceCell;
use tokio::task::AbortHandle;

use super::ids::Pending;
use super::wire::MAX_UDP_PAYLOAD;
use crate::sockets::{self, PodNetns};

/// Aborts a task when dropped: ties an upstream socket's reader to the forwarder or connection that owns it.
#[derive(Debug)]
struct AbortOnDrop(AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// One upstream's UDP socket in one pod: created with the pod, connected (and its reader started) at first use.
#[derive(Debug)]
pub(super) struct UdpUpstream {
    addr: SocketAddr,
    socket: Arc<UdpSocket>,
    pending: Arc<Pending>,
    /// The reader, once connected; aborted when the forwarder goes.
    reader: OnceCell<AbortOnDrop>,
}

impl UdpUpstream {
    /// The upstream at `addr` over `socket`, which was created in the pod's netns.
    pub(super) fn new(addr: SocketAddr, socket: UdpSocket) -> Self {
        UdpUpstream { addr, socket: Arc::new(socket), pending: Pending::new(), reader: OnceCell::new() }
    }

    /// Sends `query` under a fresh id and waits for its answer.
    pub(super) async fn exchange(&self, query: &[u8]) -> io::Result<Vec<u8>> {
        self.reader
            .get_or_try_init(|| async {
                // The socket's namespace is the one it was created in, whatever thread connects it.
                self.socket.connect(self.addr).await?;
                let reader = tokio::spawn(read_udp_answers(self.socket.clone(), self.pending.clone()));
                Ok::<_, io::Error>(AbortOnDrop(reader.abort_handle()))
            })
            .await?;
        let (sent, mut waiting) = self.pending.register(query).ok_or_else(|| io::Error::other("no free query id"))?;
        self.socket.send(&sent).await?;
        waiting.answer().await
    }
}

/// Hands every answer arriving on an upstream UDP socket to its query, until aborted. A receive error (the
/// upstream's port is closed: ICMP port unreachable) fails the queries pending on it, so they move on to the next
/// upstream at once.
async fn read_udp_answers(socket: Arc<UdpSocket>, pending: Arc<Pending>) {
    loop {
        // A buffer per datagram, none while waiting: a pod that asked once holds nothing between its queries.
        // One byte more than is ever relayed: a longer answer is cut to its question anyway.
        let received = match socket.readable().await {
            Ok(()) => {
                let mut buf = vec![0; MAX_UDP_PAYLOAD + 1];
                socket.try_recv(&mut buf).map(|n| buf[..n].to_vec())
            }
            Err(error) => Err(error),
        };
        match received {
            Ok(answer) => pending.deliver(answer),
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => {}
            Err(error) => {
                tracing::debug!(%error, "dns upstream udp receive failed");
                pending.fail_all();
                // Such errors come once per ICMP message; the pause only keeps a stream of them from spinning.
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
}

/// One upstream TCP connection of one client connection: every query of the client to that upstream goes over
/// it, pipelined under fresh ids.
#[derive(Debug)]
struct TcpChannel {
    writer: tokio::sync::Mutex<OwnedWriteHalf>,
    pending: Arc<Pending>,
    _reader: AbortOnDrop,
}

impl TcpChannel {
    fn start(stream: TcpStream) -> Arc<Self> {
        let (mut reader, writer) = stream.into_split();
        let pending = Pending::new();
        let answers = pending.clone();
        let reader = tokio::spawn(async move {
            while let Ok(Some(answer)) = read_frame(&mut reader, usize::from(u16::MAX)).await {
                answers.deliver(answer);
            }
            answers.close();
        });
        Arc::new(TcpChannel {
            writer: tokio::sync::Mutex::new(writer),
            pending,
            _reader: AbortOnDrop(reader.abort_handle()),
        })
    }

    /// Sends `query` under a fresh id and waits for its answer. A write that fails or is given up on midway
    /// closes the channel (the stream would be out of frame).
    async fn exchange(&self, query: &[u8]) -> io::Result<Vec<u8>> {
        let closed = || io::Error::new(io::ErrorKind::ConnectionAborted, "upstream connection closed");
        let (sent, mut waiting) = self.pending.register(query).ok_or_else(closed)?;
        {
            let mut writer = self.writer.lock().await;
            let mut unfinished = CloseUnlessFinished { pending: &self.pending, finished: false };
            write_frame(&mut *writer, &sent).await?;
            unfinished.finished = true;
        }
        waiting.answer().await
    }
}

/// Closes a [`Pending`] when dropped before `finished` is set: a frame was written in part.
struct CloseUnlessFinished<'a> {
    pending: &'a Pending,
    finished: bool,
}

impl Drop for CloseUnlessFinished<'_> {
    fn drop(&mut self) {
        if !self.finished {
            self.pending.close();
        }
    }
}

/// The upstream TCP connections of one client connection, one slot per upstream, each opened at first use.
#[derive(Debug)]
pub(super) struct TcpUpstreams {
    channels: Vec<tokio::sync::Mutex<Option<Arc<TcpChannel>>>>,
}

impl TcpUpstreams {
    pub(super) fn new(upstreams: usize) -> Self {
        TcpUpstreams { channels: (0..upstreams).map(|_| tokio::sync::Mutex::new(None)).collect() }
    }

    /// Sends `query` to upstream `index` (at `addr`) and waits for its answer. A connection already used may have
    /// been closed by the upstream meanwhile: then the query is tried once more on a new one.
    pub(super) async fn exchange(
        &self,
        netns: &PodNetns,
        index: usize,
        addr: SocketAddr,
        query: &[u8],
    ) -> io::Result<Vec<u8>> {
        let (channel, fresh) = self.channel(netns, index, addr).await?;
        match channel.exchange(query).await {
            Err(_) if !fresh => self.channel(netns, index, addr).await?.0.exchange(query).await,
            result => result,
        }
    }

    /// The open connection to upstream `index`, or a new one; `true` when new.
    async fn channel(&self, netns: &PodNetns, index: usize, addr: SocketAddr) -> io::Result<(Arc<TcpChannel>, bool)> {
        let mut slot = self.channels[index].lock().await;
        if let Some(channel) = slot.as_ref().filter(|channel| !channel.pending.is_closed()) {
            return Ok((channel.clone(), false));
        }
        let channel = TcpChannel::start(sockets::connect_in(netns, addr, None).await?);
        *slot = Some(channel.clone());
        Ok((channel, true))
    }
}

/// Reads one 2-byte length-prefixed message; `None` at a clean end of stream, an `InvalidData` error for one
/// longer than `max` (left unread).
pub(super) async fn read_frame<R: AsyncRead + Unpin>(reader: &mut R, max: usize) -> io::Result<Option<Vec<u8>>> {
    let mut len = [0; 2];
    match reader.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = usize::from(u16::from_be_bytes(len));
    if len > max {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("dns message of {len} bytes, over {max}")));
    }
    let mut message = vec![0; len];
    reader.read_exact(&mut message).await?;
    Ok(Some(message))
}

/// Writes `message` with its 2-byte length prefix.
pub(super) async fn write_frame<W: AsyncWrite + Unpin>(writer: &mut W, message: &[u8]) -> io::Result<()> {
    let len = u16::try_from(message.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "dns message longer than 65535 bytes"))?;
    let mut frame = Vec::with_capacity(2 + message.len());
    frame.extend_from_slice(&len.to_be_bytes());
    frame.extend_from_slice(message);
    writer.write_all(&frame).await
}

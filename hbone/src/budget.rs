//! A node-wide budget for the tunnel bytes the proxy holds in user space, shared fairly between its pods.
//!
//! What it counts: bytes read from an app's socket and not yet written to the HBONE connection (the copy's read
//! buffer, then h2's send queue), and DATA received on an HBONE connection and not yet written to the app (h2's
//! receive buffers, up to the flow-control windows). Each pod has an [`Account`]; the node has one
//! [`MemoryBudget`].
//!
//! What it guarantees, when enforced: no read that would add to a pod's held bytes starts once the pod holds its
//! share, or once the node holds the whole budget. The copy stops reading the app's socket (TCP backpressure does
//! the rest) and an HBONE connection stops reading its socket (the peer runs out of flow-control window, then TCP
//! backpressure); nothing is dropped. Each read that starts may overshoot by at most its own size (one read per
//! runtime worker racing at the boundary), so a pod holds at most its share plus a few reads. A pod that fills its
//! share stalls only its own tunnels; others keep the rest of the budget. Pods holding half their share or more
//! stop at three quarters of the node's budget: the last quarter stays for pods that hold little, so several
//! greedy pods together cannot take the whole budget from the others either.
//!
//! Not enforced (a limit of 0), the bytes are still counted, for the metrics.

use std::collections::HashMap;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Received bytes an HBONE connection may charge on estimate (every byte read, frame headers included) before it
/// counts exactly what its streams hold (h2's unreleased receive capacity); it also counts whenever its socket has
/// nothing more to read, and when a stream ends.
const RESYNC_EVERY: usize = 1 << 20;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Tasks waiting for room, woken all at once when bytes are given back (each checks again).
#[derive(Default)]
struct Waiters(Mutex<Vec<Waker>>);

impl Waiters {
    fn push(&self, waker: &Waker) {
        let mut list = lock(&self.0);
        if !list.iter().any(|w| w.will_wake(waker)) {
            list.push(waker.clone());
        }
    }

    fn wake_all(&self) {
        let list = std::mem::take(&mut *lock(&self.0));
        list.into_iter().for_each(Waker::wake);
    }
}

struct Node {
    /// 0: not enforced.
    limit: usize,
    share: usize,
    held: AtomicUsize,
    /// Tasks whose pod had room but the node had none.
    waiters: Waiters,
}

/// The node's budget. Cloning shares it.
#[derive(Clone)]
pub struct MemoryBudget {
    node: Arc<Node>,
}

impl std::fmt::Debug for MemoryBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryBudget")
            .field("limit", &self.node.limit)
            .field("share", &self.node.share)
            .field("held", &self.held())
            .finish()
    }
}

impl MemoryBudget {
    /// A budget of `limit` bytes for the node, of which one pod may hold `share`. A `limit` of 0 counts without
    /// enforcing anything.
    pub fn new(limit: usize, share: usize) -> Self {
        let share = if limit == 0 { 0 } else { share.clamp(1, limit) };
        MemoryBudget { node: Arc::new(Node { limit, share, held: AtomicUsize::new(0), waiters: Waiters::default() }) }
    }

    /// A budget that only counts.
    pub fn unlimited() -> Self {
        Self::new(0, 0)
    }

    /// The node's budget in bytes; 0 when not enforced.
    pub fn limit(&self) -> usize {
        self.node.limit
    }

    /// What one pod may hold, in bytes; 0 when not enforced.
    pub fn share(&self) -> usize {
        self.node.share
    }

    /// Bytes held now, all pods together.
    pub fn held(&self) -> usize {
        self.node.held.load(Ordering::Relaxed)
    }

    /// A new pod's account.
    pub fn account(&self) -> Account {
        Account {
            node: self.node.clone(),
            own: Arc::new(Own { held: AtomicUsize::new(0), waiters: Waiters::default() }),
        }
    }
}

struct Own {
    held: AtomicUsize,
    /// Tasks of this pod waiting for it to give bytes back.
    waiters: Waiters,
}

/// One pod's part of the budget. Cloning shares it.
#[derive(Clone)]
pub struct Account {
    node: Arc<Node>,
    own: Arc<Own>,
}

impl std::fmt::Debug for Account {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Account").field("held", &self.held()).finish_non_exhaustive()
    }
}

impl Account {
    /// Bytes this pod holds now.
    pub fn held(&self) -> usize {
        self.own.held.load(Ordering::Relaxed)
    }

    /// What the node may hold in all for this pod to start a read: the whole budget while the pod holds under half
    /// its share, else all but the last quarter, which stays for the pods that hold little.
    fn node_cap(&self) -> usize {
        if self.held() < self.node.share / 2 {
            self.node.limit
        } else {
            self.node.limit - self.node.limit / 4
        }
    }

    /// Whether a read may start now; if not, `cx` is woken when bytes are given back.
    pub(crate) fn poll_room(&self, cx: &mut Context<'_>) -> Poll<()> {
        let node = &self.node;
        if node.limit == 0 {
            return Poll::Ready(());
        }
        // Register first, then check again, so a give-back between the check and the registration is not missed.
        for _ in 0..2 {
            if self.held() >= node.share {
                self.own.waiters.push(cx.waker());
            } else if node.held.load(Ordering::Relaxed) >= self.node_cap() {
                node.waiters.push(cx.waker());
            } else {
                return Poll::Ready(());
            }
        }
        Poll::Pending
    }

    /// Whether a read may start now, without waiting.
    pub(crate) fn has_room(&self) -> bool {
        self.node.limit == 0
            || (self.held() < self.node.share && self.node.held.load(Ordering::Relaxed) < self.node_cap())
    }

    pub(crate) fn charge(&self, n: usize) {
        if n > 0 {
            self.own.held.fetch_add(n, Ordering::Relaxed);
            self.node.held.fetch_add(n, Ordering::Relaxed);
        }
    }

    pub(crate) fn credit(&self, n: usize) {
        if n == 0 {
            return;
        }
        self.own.held.fetch_sub(n, Ordering::Relaxed);
        self.node.held.fetch_sub(n, Ordering::Relaxed);
        self.wake();
    }

    /// Wakes whoever waits for room (after a give-back this account cannot see, such as a stream's end).
    pub(crate) fn wake(&self) {
        self.own.waiters.wake_all();
        self.node.waiters.wake_all();
    }
}

/// What one HBONE connection holds, charged to its pod's account: the send side as a running count (bytes
/// handed to h2 minus bytes written to the socket), the receive side from h2's unreleased receive capacity of each
/// open stream.
pub(crate) struct ConnLedger {
    account: Account,
    /// Bytes handed to h2 and not yet written to the socket (as far as we can tell: frame headers written count
    /// against it too, and a reset stream's queue is forgiven when the stream is dropped).
    queued: AtomicUsize,
    recv: Mutex<Recv>,
}

#[derive(Default)]
struct Recv {
    /// Open streams' receive sides, to read their unreleased capacity.
    streams: HashMap<u64, h2::FlowControl>,
    next_key: u64,
    /// What the account is charged for this connection's received bytes.
    charged: usize,
    /// Bytes charged on estimate since the last exact count.
    unverified: usize,
}

impl ConnLedger {
    pub(crate) fn new(account: Account) -> Arc<Self> {
        Arc::new(ConnLedger { account, queued: AtomicUsize::new(0), recv: Mutex::default() })
    }

    /// Tracks a stream's received bytes until [`ConnLedger::forget`].
    pub(crate) fn track(&self, flow: h2::FlowControl) -> u64 {
        let mut recv = lock(&self.recv);
        let key = recv.next_key;
        recv.next_key += 1;
        recv.streams.insert(key, flow);
        key
    }

    /// The stream `key` is gone: h2 drops what it still held for it. `handed` is what the stream handed h2 to
    /// send, of which up to h2's per-stream send buffer may have been discarded unsent if it ended abnormally.
    pub(crate) fn forget(&self, key: u64, abnormal_end_with: usize) {
        let mut recv = lock(&self.recv);
        recv.streams.remove(&key);
        // What the stream held is h2's to drop now: counted out at once, the connection may be idle from here on.
        self.resync(&mut recv);
        drop(recv);
        if abnormal_end_with > 0 {
            self.sent(abnormal_end_with.min(MAX_SEND_BUFFER));
        }
        self.account.wake();
    }

    pub(crate) fn account(&self) -> &Account {
        &self.account
    }

    /// `n` more bytes were handed to h2 (already charged when they were read).
    pub(crate) fn handed(&self, n: usize) {
        self.queued.fetch_add(n, Ordering::Relaxed);
    }

    /// `n` bytes were written to the socket.
    fn sent(&self, n: usize) {
        let mut done = 0;
        let _ = self.queued.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |q| {
            done = q.min(n);
            Some(q - done)
        });
        self.account.credit(done);
    }

    /// A stream released `n` received bytes (written to the app).
    pub(crate) fn released(&self, n: usize) {
        let mut recv = lock(&self.recv);
        let done = recv.charged.min(n);
        recv.charged -= done;
        drop(recv);
        self.account.credit(done);
    }

    /// Whether the connection may read from its socket; if not, `cx` is woken when bytes are given back. It may
    /// while it holds no received bytes, whatever its pod holds: what it reads may be the window updates its
    /// pod's queued sends wait for.
    fn poll_read_room(&self, cx: &mut Context<'_>) -> Poll<()> {
        let mut recv = lock(&self.recv);
        if recv.unverified >= RESYNC_EVERY {
            self.resync(&mut recv);
        }
        if recv.charged == 0 || self.account.has_room() {
            return Poll::Ready(());
        }
        if recv.unverified > 0 {
            self.resync(&mut recv);
            if recv.charged == 0 {
                return Poll::Ready(());
            }
        }
        drop(recv);
        self.account.poll_room(cx)
    }

    /// The socket has nothing more to read for now: what was charged on estimate (frame headers, control frames)
    /// is counted exactly, so an idle connection holds no estimate.
    fn drained(&self) {
        let mut recv = lock(&self.recv);
        if recv.unverified > 0 {
            self.resync(&mut recv);
        }
    }

    fn received(&self, n: usize) {
        let mut recv = lock(&self.recv);
        recv.charged += n;
        recv.unverified += n;
        drop(recv);
        self.account.charge(n);
    }

    /// Charges exactly what the open streams hold unreleased.
    fn resync(&self, recv: &mut Recv) {
        let exact: usize = recv.streams.values().map(h2::FlowControl::used_capacity).sum();
        match exact.cmp(&recv.charged) {
            std::cmp::Ordering::Less => self.account.credit(recv.charged - exact),
            std::cmp::Ordering::Greater => self.account.charge(exact - recv.charged),
            std::cmp::Ordering::Equal => {}
        }
        recv.charged = exact;
        recv.unverified = 0;
    }
}

impl Drop for ConnLedger {
    fn drop(&mut self) {
        let recv = std::mem::take(&mut *lock(&self.recv));
        self.account.credit(recv.charged + *self.queued.get_mut());
    }
}

/// h2's per-stream send buffer (`max_send_buffer_size`, h2's default made explicit in [`crate::settings`]): what a
/// reset stream may leave unsent in h2's queue.
pub(crate) const MAX_SEND_BUFFER: usize = 400 * 1024;

/// An HBONE connection's socket (TLS) as h2 sees it: with a ledger, reads wait for room in the budget and writes
/// give bytes back; without one, the socket itself.
pub(crate) struct Metered<T> {
    io: T,
    ledger: Option<Arc<ConnLedger>>,
}

impl<T> Metered<T> {
    pub(crate) fn new(io: T, ledger: Option<Arc<ConnLedger>>) -> Self {
        Metered { io, ledger }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Metered<T> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        if let Some(ledger) = &self.ledger {
            std::task::ready!(ledger.poll_read_room(cx));
        }
        let before = buf.filled().len();
        let read = Pin::new(&mut self.io).poll_read(cx, buf);
        if let Some(ledger) = &self.ledger {
            match &read {
                Poll::Ready(Ok(())) => ledger.received(buf.filled().len() - before),
                Poll::Pending => ledger.drained(),
                Poll::Ready(Err(_)) => {}
            }
        }
        read
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Metered<T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        let n = std::task::ready!(Pin::new(&mut self.io).poll_write(cx, data))?;
        if let Some(ledger) = &self.ledger {
            ledger.sent(n);
        }
        Poll::Ready(Ok(n))
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let n = std::task::ready!(Pin::new(&mut self.io).poll_write_vectored(cx, bufs))?;
        if let Some(ledger) = &self.ledger {
            ledger.sent(n);
        }
        Poll::Ready(Ok(n))
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pod_at_its_share_waits_and_others_keep_the_rest() {
        let budget = MemoryBudget::new(100, 40);
        let (greedy, other) = (budget.account(), budget.account());
        greedy.charge(40);
        assert!(!greedy.has_room(), "the greedy pod is at its share");
        assert!(other.has_room(), "another pod still has room");
        other.charge(40);
        let third = budget.account();
        third.charge(20);
        assert!(!third.has_room(), "the node is at its limit");
        greedy.credit(40);
        assert!(third.has_room());
        assert_eq!(budget.held(), 60);
    }

    #[test]
    fn greedy_pods_together_leave_the_last_quarter_to_pods_that_hold_little() {
        let budget = MemoryBudget::new(100, 40);
        let (a, b, light) = (budget.account(), budget.account(), budget.account());
        a.charge(38);
        b.charge(37);
        assert!(!a.has_room() && !b.has_room(), "pods at half their share or more stop at 75 of 100");
        assert!(light.has_room(), "a pod that holds little still reads");
        light.charge(19);
        assert!(light.has_room());
        light.charge(1);
        assert!(!light.has_room(), "at half its share it stops at 75 too");
    }

    #[test]
    fn a_waiting_task_is_woken_when_its_pod_gives_bytes_back() {
        let budget = MemoryBudget::new(100, 10);
        let account = budget.account();
        account.charge(10);
        let woken = Arc::new(std::sync::atomic::AtomicBool::new(false));
        struct Flag(Arc<std::sync::atomic::AtomicBool>);
        impl std::task::Wake for Flag {
            fn wake(self: Arc<Self>) {
                self.0.store(true, Ordering::SeqCst);
            }
        }
        let waker = Waker::from(Arc::new(Flag(woken.clone())));
        let mut cx = Context::from_waker(&waker);
        assert!(account.poll_room(&mut cx).is_pending());
        account.credit(5);
        assert!(woken.load(Ordering::SeqCst));
        assert!(account.poll_room(&mut cx).is_ready());
    }

    #[test]
    fn a_connection_holding_no_received_bytes_reads_even_when_its_pod_is_full() {
        let budget = MemoryBudget::new(100, 10);
        let account = budget.account();
        let ledger = ConnLedger::new(account.clone());
        // The pod's share is full of bytes waiting to be sent: the window updates they wait for must still be read.
        account.charge(10);
        let waker = Waker::noop();
        let mut cx = Context::from_waker(waker);
        assert!(ledger.poll_read_room(&mut cx).is_ready());
        // Read bytes are charged on estimate (control frames here: no stream holds them), counted out exactly when
        // the pod has no room, so the connection keeps reading.
        ledger.received(5);
        assert_eq!(account.held(), 15);
        assert!(ledger.poll_read_room(&mut cx).is_ready());
        assert_eq!(account.held(), 10, "no stream holds the bytes read");
        drop(ledger);
        account.credit(10);
        assert_eq!(budget.held(), 0);
    }

    #[test]
    fn not_enforced_it_counts_only() {
        let budget = MemoryBudget::unlimited();
        let account = budget.account();
        account.charge(1 << 40);
        assert!(account.has_room());
        assert_eq!(budget.held(), 1 << 40);
    }
}

//! One pooled HTTP/2 connection: its stream accounting, and the task that drives it and takes it out of
//! the pool when it dies, goes idle or stops answering PINGs.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::watch;

use crate::identity::Identity;
use crate::keepalive::{self, Keepalive};

/// What a pooled connection is for: streams may share it only if all three match.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct PoolKey {
    pub(super) src: Identity,
    pub(super) dst_identity: Identity,
    pub(super) dst: SocketAddr,
}

/// A pooled connection as the pool sees it.
pub(super) struct Conn {
    pub(super) id: u64,
    pub(super) send: h2::client::SendRequest<Bytes>,
    /// Streams currently open (or reserved) on this connection.
    pub(super) active: watch::Sender<usize>,
    /// Set once the connection may no longer take streams.
    pub(super) closed: AtomicBool,
    /// What the connection holds, in the source pod's memory budget.
    pub(super) ledger: Option<Arc<crate::budget::ConnLedger>>,
}

impl Conn {
    /// Whether the connection can still open streams: not retired, and no GOAWAY or error received
    /// (h2 reports those through `poll_ready` without waiting).
    pub(super) fn usable(&self) -> bool {
        if self.closed.load(Ordering::Acquire) {
            return false;
        }
        let mut cx = Context::from_waker(Waker::noop());
        if let Poll::Ready(Err(_)) = self.send.clone().poll_ready(&mut cx) {
            self.closed.store(true, Ordering::Release);
            return false;
        }
        true
    }

    pub(super) fn try_reserve(self: &Arc<Self>, max: usize) -> Option<StreamSlot> {
        if !self.usable() {
            return None;
        }
        let limit = max.min(self.send.current_max_send_streams());
        let mut reserved = false;
        self.active.send_if_modified(|n| {
            reserved = *n < limit;
            if reserved {
                *n += 1;
            }
            reserved
        });
        reserved.then(|| StreamSlot { conn: self.clone() })
    }
}

/// A reserved stream on a pooled connection, given back when the tunnel is dropped.
pub(super) struct StreamSlot {
    pub(super) conn: Arc<Conn>,
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        self.conn.active.send_modify(|n| *n -= 1);
    }
}

pub(super) type Conns = HashMap<PoolKey, Vec<Arc<Conn>>>;

/// Resolves once the stream count has stayed at zero for `timeout`.
async fn idle(active: &mut watch::Receiver<usize>, timeout: Duration) {
    loop {
        if *active.borrow_and_update() == 0 {
            if tokio::time::timeout(timeout, active.changed()).await.is_err() {
                return;
            }
        } else if active.changed().await.is_err() {
            return std::future::pending().await;
        }
    }
}

/// How long a connection stays idle before it is closed when the pool holds another one for the same key. A burst
/// of streams dials many connections; once it is over, one per key is enough to reuse, and each idle connection
/// keeps its HTTP/2 and TLS buffers (up to a maximum frame each way, 1 MiB): fifteen left from a burst held about
/// 28 MiB for the pool's whole idle timeout (seen in `proxy_hostile_memory`). The last one waits out the timeout.
pub(super) const SURPLUS_IDLE_TIMEOUT: Duration = Duration::from_secs(5);

/// When an idle connection is retired.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Retire {
    /// Only if the pool holds another connection for its key.
    IfSurplus,
    /// In any case.
    Always,
}

/// The task side of a pooled connection: takes it out of the pool when it ends.
pub(super) struct Driver {
    pub(super) conns: Weak<Mutex<Conns>>,
    pub(super) key: PoolKey,
    pub(super) conn: Arc<Conn>,
}

impl Driver {
    /// Drives the connection until it ends, goes idle, or stops answering PINGs; then retires it.
    pub(super) async fn run<T>(
        self,
        connection: h2::client::Connection<T, Bytes>,
        ping_pong: Option<h2::PingPong>,
        keepalive: Keepalive,
        idle_timeout: Duration,
    ) where
        T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    {
        let mut active = self.conn.active.subscribe();
        let alive = keepalive::until_unresponsive(ping_pong, keepalive);
        tokio::pin!(connection, alive);
        tokio::select! {
            result = &mut connection => {
                if let Err(e) = result {
                    tracing::debug!(dst = %self.key.dst, error = %e, "HBONE connection ended");
                }
            }
            () = &mut alive => {
                tracing::warn!(dst = %self.key.dst, "HBONE connection unresponsive to PING, dropping it");
            }
            () = self.retired_when_idle(&mut active, idle_timeout) => {}
        }
        self.retire();
    }

    /// Resolves once the connection has been taken out of the pool for being idle: after
    /// [`SURPLUS_IDLE_TIMEOUT`] if the pool holds another connection for its key, else after `idle_timeout`.
    async fn retired_when_idle(&self, active: &mut watch::Receiver<usize>, idle_timeout: Duration) {
        let surplus_after = SURPLUS_IDLE_TIMEOUT.min(idle_timeout);
        loop {
            idle(active, surplus_after).await;
            if self.retire_if_idle(Retire::IfSurplus) {
                tracing::debug!(dst = %self.key.dst, "closing a surplus idle HBONE connection");
                return;
            }
            // The only connection for its key: it waits out the rest of the pool's idle timeout, unless a stream
            // opens on it meanwhile (then it starts over).
            let rest = idle_timeout.saturating_sub(surplus_after);
            if tokio::time::timeout(rest, active.changed()).await.is_err() && self.retire_if_idle(Retire::Always) {
                tracing::debug!(dst = %self.key.dst, "closing idle HBONE connection");
                return;
            }
        }
    }

    fn retire_if_idle(&self, when: Retire) -> bool {
        let Some(conns) = self.conns.upgrade() else {
            return true;
        };
        // Under the pool lock no stream can be reserved between the check and the removal, and of two idle
        // connections for one key checking at once, only the first sees the other and goes.
        let mut conns = conns.lock().unwrap_or_else(|p| p.into_inner());
        if *self.conn.active.borrow() != 0 {
            return false;
        }
        let others = conns.get(&self.key).map_or(0, |list| list.iter().filter(|c| c.id != self.conn.id).count());
        if when == Retire::IfSurplus && others == 0 {
            return false;
        }
        self.conn.closed.store(true, Ordering::Release);
        remove(&mut conns, &self.key, self.conn.id);
        true
    }

    fn retire(&self) {
        self.conn.closed.store(true, Ordering::Release);
        if let Some(conns) = self.conns.upgrade() {
            let mut conns = conns.lock().unwrap_or_else(|p| p.into_inner());
            remove(&mut conns, &self.key, self.conn.id);
        }
    }
}

fn remove(conns: &mut Conns, key: &PoolKey, id: u64) {
    if let Some(list) = conns.get_mut(key) {
        list.retain(|c| c.id != id);
        if list.is_empty() {
            conns.remove(key);
        }
    }
}

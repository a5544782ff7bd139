//! Caps on the HBONE connections a server holds at once: in all, and per client identity, so that no single
//! peer identity can take the whole budget. A connection over a cap is refused (see
//! [`crate::server::refuse`]); a held [`ConnectionPermit`] gives its place back when dropped.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use crate::identity::Identity;

/// How many connections may be open at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionCaps {
    /// In all, whoever the clients are.
    pub total: usize,
    /// Per client SPIFFE identity.
    pub per_identity: usize,
}

impl Default for ConnectionCaps {
    /// 16,384 connections, at most 4,096 of them from one identity: room for a busy node (ztunnel clients open one
    /// connection per source identity, destination and 100 streams), far below the proxy's file descriptors.
    fn default() -> Self {
        ConnectionCaps { total: 16_384, per_identity: 4_096 }
    }
}

/// Why a connection was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OverCap {
    /// The server already holds its total number of connections.
    #[error("already {limit} HBONE connections open (the cap for all clients)")]
    Total {
        /// The cap.
        limit: usize,
    },
    /// The client's identity already holds its share.
    #[error("{identity} already has {limit} HBONE connections open (the cap per identity)")]
    PerIdentity {
        /// The client's identity.
        identity: Identity,
        /// The cap.
        limit: usize,
    },
}

#[derive(Debug, Default)]
struct Open {
    total: usize,
    /// Only identities with at least one connection: the map never outgrows the total cap.
    by_identity: HashMap<Identity, usize>,
}

/// Counts the open connections against [`ConnectionCaps`]. Shared by every listener the caps cover.
#[derive(Debug)]
pub struct ConnectionLimiter {
    caps: ConnectionCaps,
    open: Mutex<Open>,
}

impl ConnectionLimiter {
    /// A limiter enforcing `caps`.
    pub fn new(caps: ConnectionCaps) -> Arc<Self> {
        Arc::new(ConnectionLimiter { caps, open: Mutex::default() })
    }

    /// The caps enforced.
    pub fn caps(&self) -> ConnectionCaps {
        self.caps
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        self.lock().total
    }

    /// Takes a place for one connection of `identity`, or says which cap is full.
    pub fn try_acquire(self: &Arc<Self>, identity: &Identity) -> Result<ConnectionPermit, OverCap> {
        let mut open = self.lock();
        if open.total >= self.caps.total {
            return Err(OverCap::Total { limit: self.caps.total });
        }
        let mine = open.by_identity.get(identity).copied().unwrap_or(0);
        if mine >= self.caps.per_identity {
            return Err(OverCap::PerIdentity { identity: identity.clone(), limit: self.caps.per_identity });
        }
        open.total += 1;
        open.by_identity.insert(identity.clone(), mine + 1);
        Ok(ConnectionPermit { limiter: self.clone(), identity: identity.clone() })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Open> {
        self.open.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// One connection's place under the caps; dropping it frees the place.
#[derive(Debug)]
pub struct ConnectionPermit {
    limiter: Arc<ConnectionLimiter>,
    identity: Identity,
}

impl Drop for ConnectionPermit {
    fn drop(&mut self) {
        let mut open = self.limiter.lock();
        open.total -= 1;
        if let Some(n) = open.by_identity.get_mut(&self.identity) {
            *n -= 1;
            if *n == 0 {
                open.by_identity.remove(&self.identity);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(sa: &str) -> Identity {
        Identity::new("cluster.local", "ns1", sa).unwrap()
    }

    #[test]
    fn each_identity_gets_its_share_and_all_together_the_total() {
        let limiter = ConnectionLimiter::new(ConnectionCaps { total: 5, per_identity: 3 });
        let a: Vec<_> = (0..3).map(|_| limiter.try_acquire(&id("a")).unwrap()).collect();
        assert_eq!(limiter.try_acquire(&id("a")).unwrap_err(), OverCap::PerIdentity { identity: id("a"), limit: 3 });
        let b: Vec<_> = (0..2).map(|_| limiter.try_acquire(&id("b")).unwrap()).collect();
        assert_eq!(limiter.try_acquire(&id("c")).unwrap_err(), OverCap::Total { limit: 5 });
        assert_eq!(limiter.open(), 5);

        drop(a);
        assert_eq!(limiter.open(), 2);
        let c = limiter.try_acquire(&id("c")).expect("places freed by a's connections");
        let again = limiter.try_acquire(&id("a")).expect("a may connect again");
        drop((b, c, again));
        assert_eq!(limiter.open(), 0);
        assert!(limiter.lock().by_identity.is_empty(), "identities without connections are forgotten");
    }
}

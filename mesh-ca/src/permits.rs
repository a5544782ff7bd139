//! A bound on concurrent CA requests that serves waiters by priority, as ztunnel orders its requests:
//! [`Priority::RealTime`] (a connection is waiting) before [`Priority::Warmup`] (a workload arrived) before
//! [`Priority::Background`] (a refresh), first come first served within a priority.
//!
//! Guarantees: at most `capacity` [`Permit`]s exist at once; a released permit goes to the best waiter still
//! waiting, and a waiter that gives up (its future dropped, even after a permit was handed to it) loses nothing:
//! the permit passes on.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

/// How urgent a request is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Priority {
    /// A refresh of a valid certificate, or a retry.
    Background,
    /// The first certificate of a newly registered identity.
    Warmup,
    /// A certificate someone is waiting for.
    RealTime,
}

struct State {
    available: usize,
    /// Keyed by (most urgent first, arrival order).
    waiting: BTreeMap<(std::cmp::Reverse<Priority>, u64), oneshot::Sender<Permit>>,
    next: u64,
}

/// The bound; cheap to share behind an `Arc`.
pub struct Permits {
    state: Mutex<State>,
}

/// The right to make one request; released when dropped.
pub struct Permit {
    /// `None` once handed back unused by a waiter that gave up (its release is done by the loop that handed it).
    permits: Option<Arc<Permits>>,
}

impl Permits {
    /// At most `capacity` (at least 1) permits at once.
    pub fn new(capacity: usize) -> Arc<Self> {
        Arc::new(Permits { state: Mutex::new(State { available: capacity.max(1), waiting: BTreeMap::new(), next: 0 }) })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits for a permit at `priority`.
    pub async fn acquire(self: &Arc<Self>, priority: Priority) -> Permit {
        let receiver = {
            let mut state = self.lock();
            if state.available > 0 && state.waiting.is_empty() {
                state.available -= 1;
                return Permit { permits: Some(self.clone()) };
            }
            let (tx, rx) = oneshot::channel();
            let key = (std::cmp::Reverse(priority), state.next);
            state.next += 1;
            state.waiting.insert(key, tx);
            rx
        };
        match receiver.await {
            Ok(permit) => permit,
            // The sender is only dropped with the `Permits`, which this future holds: unreachable, but wait forever
            // rather than panic.
            Err(_) => std::future::pending().await,
        }
    }

    /// Permits not held by anyone.
    pub fn available(&self) -> usize {
        self.lock().available
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let Some(permits) = self.permits.take() else { return };
        loop {
            let next = {
                let mut state = permits.lock();
                match state.waiting.pop_first() {
                    Some((_, tx)) => tx,
                    None => {
                        state.available += 1;
                        return;
                    }
                }
            };
            match next.send(Permit { permits: Some(permits.clone()) }) {
                Ok(()) => return,
                // That waiter gave up: disarm the returned permit (this loop still releases it), try the next one.
                Err(mut permit) => {
                    permit.permits = None;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn waiters_are_served_by_priority_then_arrival() {
        let permits = Permits::new(1);
        let held = permits.acquire(Priority::Background).await;
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for (name, priority) in [
            ("b1", Priority::Background),
            ("w1", Priority::Warmup),
            ("r1", Priority::RealTime),
            ("w2", Priority::Warmup),
        ] {
            let (permits, order) = (permits.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                let _p = permits.acquire(priority).await;
                order.lock().unwrap().push(name);
            }));
            tokio::task::yield_now().await;
        }
        // A waiter that gives up does not keep a permit.
        let gave_up = tokio::spawn({
            let permits = permits.clone();
            async move { permits.acquire(Priority::RealTime).await }
        });
        tokio::task::yield_now().await;
        gave_up.abort();
        let _ = gave_up.await;
        drop(held);
        for task in tasks {
            task.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), ["r1", "w1", "w2", "b1"]);
        assert_eq!(permits.available(), 1);
    }
}

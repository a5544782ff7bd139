//! One pod UID at a time, and a memory of the pods deleted lately: what keeps a pod deleted while its enrollment
//! is in flight from being left behind (its cache entry, its ZDS workload, its host probe entry).
//!
//! Enrollment and removal of a UID each hold that UID's [`Pass`] for their whole run, so they never interleave:
//! a removal that arrives mid-enrollment waits for the enrollment to finish (or to roll itself back) and then
//! removes whatever it left. A pod's deletion is recorded first, without waiting ([`PodGate::mark_deleted`]), so
//! the enrollment in flight sees it at its next stage and rolls back, and any enrollment of that UID that starts
//! later is refused. UIDs are never reused, so a deleted UID only needs remembering while an enrollment of it
//! could still be in flight: [`DELETED_TTL`], at most [`MAX_DELETED`] of them (a deleted-pod flood evicts the
//! oldest first).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::pod::PodUid;

/// How long a deleted UID is remembered: far longer than any enrollment takes (API lookup, rules, the proxy's ack
/// within its deadline, the annotation), short enough that the memory never grows with the node's history.
pub const DELETED_TTL: Duration = Duration::from_secs(10 * 60);

/// Most deleted UIDs remembered at once; beyond it the oldest is forgotten. A UID is 36 bytes, so this bounds the
/// memory to about a megabyte whatever the API server sends.
pub const MAX_DELETED: usize = 16 * 1024;

/// The per-UID locks and the recently deleted UIDs. Cheap to clone; clones share everything.
#[derive(Debug, Clone, Default)]
pub struct PodGate {
    inner: Arc<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    /// The lock of every UID someone holds or waits for; an entry goes with its last user, so the map holds only
    /// the operations in flight.
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    deleted: Mutex<Deleted>,
}

/// Deleted UIDs with the time each was recorded, oldest first in `order`.
#[derive(Debug, Default)]
struct Deleted {
    at: HashMap<String, Instant>,
    order: VecDeque<(Instant, String)>,
}

impl Deleted {
    /// Forgets the UIDs older than [`DELETED_TTL`] and, beyond [`MAX_DELETED`], the oldest.
    fn prune(&mut self, now: Instant) {
        while let Some((at, uid)) = self.order.front() {
            let expired = now.duration_since(*at) >= DELETED_TTL;
            if !expired && self.order.len() <= MAX_DELETED {
                break;
            }
            // An entry re-recorded later has a newer time in `at`; only the current record is dropped.
            if self.at.get(uid) == Some(at) {
                self.at.remove(uid);
            }
            self.order.pop_front();
        }
    }
}

/// Held while one operation on one pod UID runs; dropping it lets the next one in.
#[derive(Debug)]
pub struct Pass {
    gate: PodGate,
    uid: String,
    guard: Option<tokio::sync::OwnedMutexGuard<()>>,
}

impl Drop for Pass {
    fn drop(&mut self) {
        let mut locks = self.gate.locks();
        drop(self.guard.take());
        // Nobody else holds or waits for this UID's lock (they would hold a clone): forget it.
        if locks.get(&self.uid).is_some_and(|lock| Arc::strong_count(lock) == 1) {
            locks.remove(&self.uid);
        }
    }
}

impl PodGate {
    /// Waits until no other operation on `uid` runs, and holds it off until the returned pass is dropped.
    pub async fn enter(&self, uid: &PodUid) -> Pass {
        let lock = self.locks().entry(uid.to_string()).or_default().clone();
        let guard = lock.lock_owned().await;
        Pass { gate: self.clone(), uid: uid.to_string(), guard: Some(guard) }
    }

    /// Records that pod `uid` was deleted: its enrollment in flight rolls back at its next stage, and later ones
    /// are refused.
    pub fn mark_deleted(&self, uid: &PodUid) {
        self.mark_deleted_at(uid, Instant::now());
    }

    fn mark_deleted_at(&self, uid: &str, now: Instant) {
        let mut deleted = self.deleted();
        if deleted.at.insert(uid.to_string(), now) != Some(now) {
            deleted.order.push_back((now, uid.to_string()));
        }
        deleted.prune(now);
    }

    /// Whether pod `uid` was deleted (within [`DELETED_TTL`], among the last [`MAX_DELETED`]).
    pub fn is_deleted(&self, uid: &PodUid) -> bool {
        self.is_deleted_at(uid, Instant::now())
    }

    fn is_deleted_at(&self, uid: &str, now: Instant) -> bool {
        let mut deleted = self.deleted();
        deleted.prune(now);
        deleted.at.contains_key(uid)
    }

    fn locks(&self) -> MutexGuard<'_, HashMap<String, Arc<tokio::sync::Mutex<()>>>> {
        self.inner.locks.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn deleted(&self) -> MutexGuard<'_, Deleted> {
        self.inner.deleted.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn operations_on_one_uid_never_overlap_and_other_uids_go_on() {
        let gate = PodGate::default();
        let first = gate.enter(&PodUid::from("a")).await;
        // Another UID is not held up.
        let other = tokio::time::timeout(Duration::from_secs(5), gate.enter(&PodUid::from("b")))
            .await
            .expect("b enters at once");
        drop(other);
        // The same UID waits for the first pass.
        let waiting = tokio::spawn({
            let gate = gate.clone();
            async move { gate.enter(&PodUid::from("a")).await }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished(), "a second pass for a while the first is held");
        drop(first);
        let second = tokio::time::timeout(Duration::from_secs(5), waiting).await.expect("enters once freed").unwrap();
        drop(second);
        assert!(gate.locks().is_empty(), "locks go with their last user: {:?}", gate.locks());
    }

    #[test]
    fn a_deleted_uid_is_remembered_for_the_ttl_only() {
        let gate = PodGate::default();
        let t0 = Instant::now();
        gate.mark_deleted_at("a", t0);
        assert!(gate.is_deleted_at("a", t0 + DELETED_TTL - Duration::from_secs(1)));
        assert!(!gate.is_deleted_at("b", t0));
        assert!(!gate.is_deleted_at("a", t0 + DELETED_TTL), "forgotten after the TTL");
        assert!(gate.deleted().order.is_empty() && gate.deleted().at.is_empty());
    }

    #[test]
    fn at_most_max_deleted_uids_are_remembered_the_oldest_go_first() {
        let gate = PodGate::default();
        let t0 = Instant::now();
        for n in 0..MAX_DELETED + 10 {
            gate.mark_deleted_at(&format!("uid-{n}"), t0);
        }
        let deleted = gate.deleted();
        assert_eq!((deleted.at.len(), deleted.order.len()), (MAX_DELETED, MAX_DELETED));
        drop(deleted);
        assert!(!gate.is_deleted_at("uid-9", t0), "the oldest were evicted");
        assert!(gate.is_deleted_at("uid-10", t0) && gate.is_deleted_at(&format!("uid-{}", MAX_DELETED + 9), t0));
    }

    #[test]
    fn a_uid_deleted_twice_counts_from_its_last_record() {
        let gate = PodGate::default();
        let t0 = Instant::now();
        gate.mark_deleted_at("a", t0);
        gate.mark_deleted_at("a", t0 + Duration::from_secs(60));
        assert!(gate.is_deleted_at("a", t0 + DELETED_TTL), "the second record still holds");
        assert!(!gate.is_deleted_at("a", t0 + DELETED_TTL + Duration::from_secs(60)));
    }
}

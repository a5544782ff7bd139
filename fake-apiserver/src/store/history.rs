//! The event history: what watches replay, how it is compacted (by count, age or on request), and list
//! snapshots at an older resourceVersion rebuilt from it (for continue tokens).

use super::{Key, Store};
use crate::kinds::ResourceKind;
use crate::status::ApiError;
use serde_json::Value;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

/// What kind of change an event records, named as on the watch wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ChangeType {
    Added,
    Modified,
    Deleted,
}

impl ChangeType {
    pub fn as_str(self) -> &'static str {
        match self {
            ChangeType::Added => "ADDED",
            ChangeType::Modified => "MODIFIED",
            ChangeType::Deleted => "DELETED",
        }
    }
}

/// One entry of the event history.
#[derive(Debug, Clone)]
pub(crate) struct Change {
    pub rv: u64,
    pub kind: &'static ResourceKind,
    pub change: ChangeType,
    /// The object after the change (for deletions: its final state, stamped with the deletion's rv).
    pub object: Arc<Value>,
    /// The object before a modification, so selector-filtered watches can tell entering from leaving.
    pub previous: Option<Arc<Value>>,
    /// When the change happened, for compaction by age.
    pub at: Instant,
}

fn key_of(kind: &'static ResourceKind, obj: &Value) -> Key {
    let meta = |f: &str| obj.pointer(&format!("/metadata/{f}")).and_then(Value::as_str).unwrap_or_default();
    (kind.plural, meta("namespace").to_string(), meta("name").to_string())
}

impl Store {
    /// Whether `rv` is newer than anything this store handed out, and the store was told to refuse those.
    fn unissued(&self, rv: u64) -> bool {
        self.limits.expire_unissued && rv > self.rv
    }

    /// History entries newer than `rv`, or the `Expired` error when `rv` predates the kept history (or, with
    /// expiry of unissued versions, was never handed out).
    pub fn changes_after(&self, rv: u64) -> Result<impl Iterator<Item = &Change>, ApiError> {
        if rv < self.floor {
            return Err(ApiError::expired(rv, self.floor));
        }
        if self.unissued(rv) {
            return Err(ApiError::unissued(rv, self.rv));
        }
        let start = self.history.partition_point(|c| c.rv <= rv);
        Ok(self.history.range(start..))
    }

    /// Forgets all history, like an etcd compaction at the current revision: watching from any older
    /// resourceVersion is expired, watching from the current one still works (nothing was missed).
    pub fn compact(&mut self) {
        self.floor = self.rv;
        self.history.clear();
    }

    /// Drops events beyond the configured count or age (the watch cache's capacity and etcd's compaction).
    pub fn prune_history(&mut self, now: Instant) {
        let too_old = |c: &Change| self.limits.history_age.is_some_and(|age| now.saturating_duration_since(c.at) > age);
        let mut drop = 0;
        let excess = self.history.len().saturating_sub(self.limits.history_events);
        for (i, c) in self.history.iter().enumerate() {
            if i < excess || too_old(c) {
                drop = i + 1;
            } else {
                break;
            }
        }
        for old in self.history.drain(..drop) {
            self.floor = old.rv;
        }
    }

    pub(super) fn record(&mut self, change: Change) {
        self.history.push_back(change);
        self.prune_history(Instant::now());
    }

    /// The objects of `kind` (in `ns`, if given) as they were at `rv`, in key order; 410 when the history
    /// no longer reaches back to `rv`.
    pub fn snapshot(
        &self,
        kind: &'static ResourceKind,
        ns: Option<&str>,
        rv: u64,
    ) -> Result<Vec<Arc<Value>>, ApiError> {
        if rv < self.floor || self.unissued(rv) {
            return Err(ApiError::continue_expired());
        }
        let mut objects: BTreeMap<Key, Arc<Value>> = self
            .objects
            .iter()
            .filter(|((plural, o_ns, _), _)| *plural == kind.plural && ns.is_none_or(|n| n == o_ns))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        for change in self.history.iter().rev().take_while(|c| c.rv > rv).filter(|c| c.kind == kind) {
            let key = key_of(kind, &change.object);
            if ns.is_some_and(|n| n != key.1) {
                continue;
            }
            match (&change.change, &change.previous) {
                (ChangeType::Added, _) => {
                    objects.remove(&key);
                }
                (_, Some(previous)) => {
                    objects.insert(key, previous.clone());
                }
                (_, None) => {}
            }
        }
        Ok(objects.into_values().collect())
    }
}

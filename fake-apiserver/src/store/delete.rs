//! Deletion: immediate (the lenient default and the test control) or graceful, as the real registry does it.
//!
//! Graceful deletion sets `deletionTimestamp` (now + grace) and `deletionGracePeriodSeconds` and emits
//! MODIFIED. When the grace period ends (the kubelet's final grace-0 delete, done here by [`Store::reap`]) the
//! object is removed (DELETED), unless finalizers remain: then it waits, with a grace period of 0, until an
//! update removes the last one. Pods default to their `terminationGracePeriodSeconds` (else 30s) and delete at
//! once when unscheduled or already terminal; other kinds default to 0.

use super::{meta_str, Key, Store};
use crate::ids;
use crate::kinds::ResourceKind;
use crate::status::ApiError;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The parts of a `DeleteOptions` body (or query) the fake honours.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct DeleteOptions {
    /// `gracePeriodSeconds`; `None` for the kind's default.
    pub grace_period_seconds: Option<i64>,
    /// `preconditions` (`uid`, `resourceVersion`).
    pub preconditions: Option<Value>,
}

impl DeleteOptions {
    /// Reads a `DeleteOptions` body (`Value::Null` when the request had none).
    pub fn from_body(body: &Value) -> DeleteOptions {
        DeleteOptions {
            grace_period_seconds: body.get("gracePeriodSeconds").and_then(Value::as_i64),
            preconditions: body.get("preconditions").filter(|p| p.is_object()).cloned(),
        }
    }
}

fn finalizers(obj: &Value) -> Vec<String> {
    obj.pointer("/metadata/finalizers")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).map(str::to_string).collect())
        .unwrap_or_default()
}

fn terminating(obj: &Value) -> bool {
    obj.pointer("/metadata/deletionTimestamp").is_some_and(|t| !t.is_null())
}

fn grace_of(obj: &Value) -> Option<i64> {
    obj.pointer("/metadata/deletionGracePeriodSeconds").and_then(Value::as_i64)
}

/// Whether an update leaves a terminating object with nothing holding it: no finalizer, no grace left.
pub(super) fn finalized(obj: &Value) -> bool {
    terminating(obj) && finalizers(obj).is_empty() && grace_of(obj).unwrap_or(0) == 0
}

/// The grace period a DELETE gets: the request's, else the kind's default (pods: the spec's, else 30s).
fn grace_period(kind: &ResourceKind, obj: &Value, options: &DeleteOptions) -> i64 {
    if kind.kind != "Pod" {
        return 0; // no graceful strategy: a requested grace period is ignored
    }
    let unscheduled = obj.pointer("/spec/nodeName").and_then(Value::as_str).unwrap_or_default().is_empty();
    let phase = obj.pointer("/status/phase").and_then(Value::as_str).unwrap_or_default();
    if unscheduled || matches!(phase, "Succeeded" | "Failed") {
        return 0;
    }
    let default = obj.pointer("/spec/terminationGracePeriodSeconds").and_then(Value::as_i64).unwrap_or(30);
    // As the pod strategy: a negative grace period means "as short as possible but not forced", 1s.
    match options.grace_period_seconds.unwrap_or(default) {
        g if g < 0 => 1,
        g => g,
    }
}

impl Store {
    /// DELETE: checks the preconditions, then removes the object at once (`graceful == false`) or starts
    /// graceful deletion. Returns the object's state after the request.
    pub fn delete(
        &mut self,
        kind: &'static ResourceKind,
        ns: &str,
        name: &str,
        options: &DeleteOptions,
        graceful: bool,
    ) -> Result<Value, ApiError> {
        let key = Store::key(kind, ns, name);
        let existing = self.objects.get(&key).cloned().ok_or_else(|| ApiError::not_found(kind, name))?;
        if let Some(pre) = &options.preconditions {
            for field in ["uid", "resourceVersion"] {
                let want = pre.get(field).and_then(Value::as_str);
                if want.is_some_and(|w| Some(w) != meta_str(&existing, field)) {
                    return Err(ApiError::conflict(
                        kind,
                        name,
                        &format!(
                            "Precondition failed: {field} in precondition: {}, {field} in object meta: {}",
                            want.unwrap_or_default(),
                            meta_str(&existing, field).unwrap_or_default()
                        ),
                    ));
                }
            }
        }
        if !graceful {
            return Ok(self.remove(kind, key, existing));
        }
        let grace = grace_period(kind, &existing, options);
        let held = !finalizers(&existing).is_empty();
        if terminating(&existing) && grace_of(&existing).is_some_and(|current| grace >= current) {
            return Ok((*existing).clone()); // already being deleted at least as soon
        }
        if grace == 0 && !held && kind.kind != "Pod" {
            return Ok(self.remove(kind, key, existing));
        }
        // Pods are always deleted gracefully, as by the real registry: the deletion is written first
        // (MODIFIED with deletionTimestamp, grace 0 included), then a grace period of 0 without finalizers
        // deletes at once (DELETED with that state), answering with it.
        let mut obj = (*existing).clone();
        obj["metadata"]["deletionTimestamp"] = json!(ids::rfc3339_after(Duration::from_secs(grace as u64)));
        obj["metadata"]["deletionGracePeriodSeconds"] = json!(grace);
        if grace > 0 {
            let uid = meta_str(&obj, "uid").unwrap_or_default().to_string();
            self.pending.insert(key.clone(), (uid, Instant::now() + Duration::from_secs(grace as u64)));
        } else {
            self.pending.remove(&key);
        }
        let written = self.commit(kind, key.clone(), obj);
        if grace == 0 && !held {
            return Ok(self.remove(kind, key, Arc::new(written)));
        }
        Ok(written)
    }

    /// Removes the object stored at `key` now, recording DELETED with `last` as its final state.
    pub(super) fn remove(&mut self, kind: &'static ResourceKind, key: Key, last: Arc<Value>) -> Value {
        let previous = self.objects.remove(&key);
        self.pending.remove(&key);
        self.rv += 1;
        let mut obj = (*last).clone();
        obj["metadata"]["resourceVersion"] = json!(self.rv.to_string());
        let change = super::ChangeType::Deleted;
        let object = Arc::new(obj.clone());
        self.record(super::Change { rv: self.rv, kind, change, object, previous, at: Instant::now() });
        obj
    }

    /// When the next graceful deletion's grace period ends.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.pending.values().map(|(_, at)| *at).min()
    }

    /// Ends every grace period that is over: the object goes (DELETED), or, held by finalizers, stays with a
    /// grace period of 0 (MODIFIED) until the last finalizer is removed.
    pub fn reap(&mut self, now: Instant) {
        let due: Vec<(Key, String)> = self
            .pending
            .iter()
            .filter(|(_, (_, at))| *at <= now)
            .map(|(k, (uid, _))| (k.clone(), uid.clone()))
            .collect();
        for (key, uid) in due {
            self.pending.remove(&key);
            let Some(existing) = self.objects.get(&key).cloned() else { continue };
            let Some(kind) = crate::kinds::KINDS.iter().find(|k| k.plural == key.0) else { continue };
            if meta_str(&existing, "uid") != Some(uid.as_str()) || !terminating(&existing) {
                continue; // deleted and re-created meanwhile
            }
            let mut obj = (*existing).clone();
            obj["metadata"]["deletionGracePeriodSeconds"] = json!(0);
            let written = self.commit(kind, key.clone(), obj);
            if finalizers(&existing).is_empty() {
                self.remove(kind, key, Arc::new(written));
            }
        }
    }

    /// Update rules while deleting: the deletion fields are the server's, and a terminating object takes no
    /// new finalizers.
    pub(super) fn check_terminating_update(
        &self,
        kind: &ResourceKind,
        existing: &Value,
        obj: &mut Value,
    ) -> Result<(), ApiError> {
        for field in ["deletionTimestamp", "deletionGracePeriodSeconds"] {
            super::carry_meta(obj, existing, field);
        }
        if terminating(existing) {
            let before = finalizers(existing);
            let added: Vec<String> = finalizers(obj).into_iter().filter(|f| !before.contains(f)).collect();
            if !added.is_empty() {
                return Err(ApiError::invalid(
                    kind,
                    meta_str(existing, "name").unwrap_or_default(),
                    &format!(
                        "metadata.finalizers: Forbidden: no new finalizers can be added if the object is being \
                         deleted, found new finalizers {added:?}"
                    ),
                ));
            }
        }
        Ok(())
    }
}

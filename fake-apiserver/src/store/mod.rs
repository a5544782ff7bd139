//! The object store: current objects, the global resourceVersion counter and the event history watches replay.

use crate::ids;
use crate::kinds::ResourceKind;
use crate::patch::merge_patch;
use crate::status::ApiError;
use serde_json::{json, Value};
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

/// Most events kept for replay; older ones are compacted away as a real apiserver's watch cache would.
const HISTORY_LIMIT: usize = 10_000;

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
}

/// Which part of an object a write addresses: the object itself or its `status` subresource.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Part {
    Main,
    Status,
}

/// `(plural, namespace, name)`; namespace is empty for cluster-scoped kinds.
type Key = (&'static str, String, String);

/// All objects plus history; callers hold it behind a mutex.
#[derive(Debug)]
pub(crate) struct Store {
    objects: BTreeMap<Key, Arc<Value>>,
    rv: u64,
    /// Oldest resourceVersion a watch may resume from; anything older is expired.
    floor: u64,
    history: VecDeque<Change>,
}

fn meta_str<'a>(obj: &'a Value, field: &str) -> Option<&'a str> {
    obj.get("metadata")?.get(field)?.as_str()
}

fn name_of(obj: &Value) -> &str {
    meta_str(obj, "name").unwrap_or_default()
}

/// Sets kind/apiVersion, checks the object's identity against the request and returns `(namespace, name)`.
fn normalize(
    kind: &'static ResourceKind,
    obj: &mut Value,
    path_ns: Option<&str>,
) -> Result<(String, String), ApiError> {
    let Value::Object(map) = obj else {
        return Err(ApiError::bad_request("the request body is not a JSON object"));
    };
    for (field, want) in [("kind", kind.kind), ("apiVersion", kind.api_version)] {
        match map.get(field).and_then(Value::as_str) {
            None | Some("") => {
                map.insert(field.to_string(), json!(want));
            }
            Some(got) if got == want => {}
            Some(got) => {
                return Err(ApiError::bad_request(format!("{field} {got:?} does not match the endpoint's {want:?}")))
            }
        }
    }
    let meta = map.entry("metadata").or_insert_with(|| json!({}));
    if !meta.is_object() {
        return Err(ApiError::bad_request("metadata must be an object"));
    }
    let namespace = if kind.namespaced {
        let body_ns = meta.get("namespace").and_then(Value::as_str).unwrap_or_default();
        let ns = match (body_ns, path_ns) {
            ("", Some(p)) => p.to_string(),
            ("", None) => "default".to_string(),
            (b, Some(p)) if b != p => {
                return Err(ApiError::bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request",
                ))
            }
            (b, _) => b.to_string(),
        };
        meta["namespace"] = json!(ns);
        ns
    } else {
        if let Some(m) = meta.as_object_mut() {
            m.remove("namespace");
        }
        String::new()
    };
    let name = meta.get("name").and_then(Value::as_str).unwrap_or_default();
    if name.is_empty() {
        let prefix = meta.get("generateName").and_then(Value::as_str).unwrap_or_default();
        if prefix.is_empty() {
            return Err(ApiError::bad_request(format!(
                "{} \"\" is invalid: metadata.name: Required value: name or generateName is required",
                kind.kind
            )));
        }
        meta["name"] = json!(format!("{prefix}{}", ids::name_suffix()));
    }
    let name = name_of(obj).to_string();
    Ok((namespace, name))
}

/// Copies a metadata field from `from` to `to`, or removes it from `to` when `from` lacks it.
fn carry_meta(to: &mut Value, from: &Value, field: &str) {
    match from.get("metadata").and_then(|m| m.get(field)) {
        Some(v) => to["metadata"][field] = v.clone(),
        None => {
            if let Some(m) = to.get_mut("metadata").and_then(Value::as_object_mut) {
                m.remove(field);
            }
        }
    }
}

fn carry_top(to: &mut Value, from: &Value, field: &str) {
    match from.get(field) {
        Some(v) => to[field] = v.clone(),
        None => {
            if let Some(m) = to.as_object_mut() {
                m.remove(field);
            }
        }
    }
}

impl Store {
    pub fn new() -> Store {
        Store { objects: BTreeMap::new(), rv: 1, floor: 1, history: VecDeque::new() }
    }

    /// The newest resourceVersion handed out.
    pub fn resource_version(&self) -> u64 {
        self.rv
    }

    fn key(kind: &'static ResourceKind, ns: &str, name: &str) -> Key {
        let ns = if kind.namespaced { ns } else { "" };
        (kind.plural, ns.to_string(), name.to_string())
    }

    pub fn get(&self, kind: &'static ResourceKind, ns: &str, name: &str) -> Option<Arc<Value>> {
        self.objects.get(&Store::key(kind, ns, name)).cloned()
    }

    /// Objects of `kind` in key order (namespace, then name), optionally within one namespace.
    pub fn list<'a>(
        &'a self,
        kind: &'static ResourceKind,
        ns: Option<&'a str>,
    ) -> impl Iterator<Item = &'a Arc<Value>> + 'a {
        self.objects
            .iter()
            .filter(move |((plural, o_ns, _), _)| *plural == kind.plural && ns.is_none_or(|n| n == o_ns))
            .map(|(_, v)| v)
    }

    /// History entries newer than `rv`, or the `Expired` error when `rv` predates the kept history.
    pub fn changes_after(&self, rv: u64) -> Result<impl Iterator<Item = &Change>, ApiError> {
        if rv < self.floor {
            return Err(ApiError::expired(rv, self.floor));
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

    fn record(&mut self, change: Change) {
        self.history.push_back(change);
        while self.history.len() > HISTORY_LIMIT {
            if let Some(old) = self.history.pop_front() {
                self.floor = old.rv;
            }
        }
    }

    /// Stamps `obj` with the next resourceVersion, stores it and records the event.
    fn commit(&mut self, kind: &'static ResourceKind, key: Key, mut obj: Value) -> Value {
        self.rv += 1;
        obj["metadata"]["resourceVersion"] = json!(self.rv.to_string());
        let object = Arc::new(obj.clone());
        let previous = self.objects.insert(key, object.clone());
        let change = if previous.is_some() { ChangeType::Modified } else { ChangeType::Added };
        self.record(Change { rv: self.rv, kind, change, object, previous });
        obj
    }

    /// Adds uid, creationTimestamp and generation the way the apiserver does on create.
    fn stamp_new(kind: &'static ResourceKind, obj: &mut Value, keep_uid: bool) {
        let meta = &mut obj["metadata"];
        if !keep_uid || meta.get("uid").and_then(Value::as_str).is_none_or(str::is_empty) {
            meta["uid"] = json!(ids::new_uid());
        }
        if !keep_uid || meta.get("creationTimestamp").is_none_or(Value::is_null) {
            meta["creationTimestamp"] = json!(ids::now_rfc3339());
        }
        if kind.has_generation && (!keep_uid || meta.get("generation").is_none()) {
            meta["generation"] = json!(1);
        }
    }

    /// POST: stores a new object; `AlreadyExists` when the name is taken.
    pub fn create(
        &mut self,
        kind: &'static ResourceKind,
        path_ns: Option<&str>,
        mut obj: Value,
    ) -> Result<Value, ApiError> {
        let (ns, name) = normalize(kind, &mut obj, path_ns)?;
        let key = Store::key(kind, &ns, &name);
        if self.objects.contains_key(&key) {
            return Err(ApiError::already_exists(kind, &name));
        }
        Store::stamp_new(kind, &mut obj, false);
        Ok(self.commit(kind, key, obj))
    }

    /// Stores `obj` as-is (creating or replacing), keeping given uid/timestamps: the test-control write.
    pub fn upsert(&mut self, kind: &'static ResourceKind, mut obj: Value) -> Result<Value, ApiError> {
        let (ns, name) = normalize(kind, &mut obj, None)?;
        let key = Store::key(kind, &ns, &name);
        match self.objects.get(&key).cloned() {
            Some(existing) => {
                for field in ["uid", "creationTimestamp", "generation"] {
                    if obj["metadata"].get(field).is_none() {
                        carry_meta(&mut obj, &existing, field);
                    }
                }
            }
            None => Store::stamp_new(kind, &mut obj, true),
        }
        Ok(self.commit(kind, key, obj))
    }

    /// PUT: replaces an existing object; `Conflict` when the body's resourceVersion is stale.
    pub fn replace(
        &mut self,
        kind: &'static ResourceKind,
        ns: &str,
        name: &str,
        mut obj: Value,
        part: Part,
    ) -> Result<Value, ApiError> {
        let existing = self.get(kind, ns, name).ok_or_else(|| ApiError::not_found(kind, name))?;
        normalize(kind, &mut obj, Some(ns))?;
        Store::check_rv(kind, name, &existing, &obj)?;
        self.finish_update(kind, &existing, obj, part)
    }

    /// PATCH (merge semantics); with `create_missing` (server-side apply) a missing object is created.
    pub fn patch(
        &mut self,
        kind: &'static ResourceKind,
        ns: &str,
        name: &str,
        patch: &Value,
        part: Part,
        create_missing: bool,
    ) -> Result<Value, ApiError> {
        let Some(existing) = self.get(kind, ns, name) else {
            if !create_missing {
                return Err(ApiError::not_found(kind, name));
            }
            let mut obj = patch.clone();
            if let Some(meta) = obj.get_mut("metadata").filter(|m| m.is_object()) {
                meta.as_object_mut().map(|m| m.remove("resourceVersion"));
            }
            obj["metadata"]["name"] = json!(name);
            return self.create(kind, Some(ns).filter(|_| kind.namespaced), obj);
        };
        if !patch.is_object() {
            return Err(ApiError::bad_request("a merge patch must be a JSON object"));
        }
        Store::check_rv(kind, name, &existing, patch)?;
        let mut obj = (*existing).clone();
        merge_patch(&mut obj, patch);
        normalize(kind, &mut obj, Some(ns))?;
        self.finish_update(kind, &existing, obj, part)
    }

    fn check_rv(kind: &ResourceKind, name: &str, existing: &Value, body: &Value) -> Result<(), ApiError> {
        match meta_str(body, "resourceVersion") {
            Some(rv) if !rv.is_empty() && Some(rv) != meta_str(existing, "resourceVersion") => {
                Err(ApiError::stale(kind, name))
            }
            _ => Ok(()),
        }
    }

    /// Applies apiserver update rules (immutable identity, status only via its subresource, generation),
    /// then commits unless nothing changed.
    fn finish_update(
        &mut self,
        kind: &'static ResourceKind,
        existing: &Arc<Value>,
        mut obj: Value,
        part: Part,
    ) -> Result<Value, ApiError> {
        if name_of(&obj) != name_of(existing) {
            return Err(ApiError::bad_request(format!(
                "the name of the object ({}) does not match the name on the URL ({})",
                name_of(&obj),
                name_of(existing)
            )));
        }
        if part == Part::Status {
            let mut whole = (**existing).clone();
            carry_top(&mut whole, &obj, "status");
            // As the apiserver's pod status strategy: pods/status also writes labels and annotations (Istio's
            // node agent annotates enrolled pods this way), never the spec.
            if kind.kind == "Pod" {
                for field in ["labels", "annotations"] {
                    carry_meta(&mut whole, &obj, field);
                }
            }
            obj = whole;
        } else {
            carry_top(&mut obj, existing, "status");
        }
        for field in ["uid", "creationTimestamp", "resourceVersion", "generation"] {
            carry_meta(&mut obj, existing, field);
        }
        if obj == **existing {
            return Ok(obj);
        }
        if kind.has_generation && obj.get("spec") != existing.get("spec") {
            let generation = existing["metadata"]["generation"].as_i64().unwrap_or(0);
            obj["metadata"]["generation"] = json!(generation + 1);
        }
        let key = Store::key(kind, meta_str(&obj, "namespace").unwrap_or_default(), name_of(&obj));
        Ok(self.commit(kind, key, obj))
    }

    /// DELETE: removes the object and returns its final state; honours DeleteOptions preconditions.
    pub fn delete(
        &mut self,
        kind: &'static ResourceKind,
        ns: &str,
        name: &str,
        preconditions: Option<&Value>,
    ) -> Result<Value, ApiError> {
        let key = Store::key(kind, ns, name);
        let existing = self.objects.get(&key).cloned().ok_or_else(|| ApiError::not_found(kind, name))?;
        if let Some(pre) = preconditions {
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
        self.objects.remove(&key);
        self.rv += 1;
        let mut obj = (*existing).clone();
        obj["metadata"]["resourceVersion"] = json!(self.rv.to_string());
        self.record(Change {
            rv: self.rv,
            kind,
            change: ChangeType::Deleted,
            object: Arc::new(obj.clone()),
            previous: Some(existing),
        });
        Ok(obj)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kinds::by_name;

    fn pod(name: &str) -> Value {
        json!({"metadata": {"name": name}, "spec": {"nodeName": "n1"}})
    }

    #[test]
    fn create_stamps_and_counts() {
        let mut s = Store::new();
        let k = by_name("Pod").unwrap();
        let a = s.create(k, Some("ns"), pod("a")).unwrap();
        let b = s.create(k, Some("ns"), pod("b")).unwrap();
        assert_eq!(a["kind"], "Pod");
        assert_eq!(a["apiVersion"], "v1");
        assert_eq!(a["metadata"]["namespace"], "ns");
        assert!(a["metadata"]["uid"].as_str().is_some_and(|u| !u.is_empty()));
        let rv = |o: &Value| o["metadata"]["resourceVersion"].as_str().unwrap().parse::<u64>().unwrap();
        assert!(rv(&b) > rv(&a));
        assert_eq!(s.create(k, Some("ns"), pod("a")).unwrap_err().code, 409);
    }

    #[test]
    fn update_keeps_status_and_skips_noops() {
        let mut s = Store::new();
        let k = by_name("pods").unwrap();
        let mut p = pod("a");
        p["status"] = json!({"phase": "Running"});
        let stored = s.upsert(k, p).unwrap();
        let mut body = stored.clone();
        body["status"] = json!({"phase": "Failed"});
        let same = s.replace(k, "default", "a", body, Part::Main).unwrap();
        assert_eq!(same, stored, "a status change through the main resource is ignored");
        let patched =
            s.patch(k, "default", "a", &json!({"status": {"phase": "Succeeded"}}), Part::Status, false).unwrap();
        assert_eq!(patched["status"]["phase"], "Succeeded");
        assert_ne!(patched["metadata"]["resourceVersion"], stored["metadata"]["resourceVersion"]);
    }

    #[test]
    fn pod_status_writes_annotations_but_not_the_spec() {
        let mut s = Store::new();
        let k = by_name("pods").unwrap();
        s.upsert(k, pod("a")).unwrap();
        let patch = json!({"metadata": {"annotations": {"ambient.istio.io/redirection": "enabled"}}, "spec": {"x": 1}});
        let patched = s.patch(k, "default", "a", &patch, Part::Status, false).unwrap();
        assert_eq!(patched["metadata"]["annotations"]["ambient.istio.io/redirection"], "enabled");
        assert!(patched["spec"].get("x").is_none(), "the spec is not writable through pods/status");
    }

    #[test]
    fn compaction_expires_old_versions() {
        let mut s = Store::new();
        let k = by_name("Pod").unwrap();
        s.create(k, Some("ns"), pod("a")).unwrap();
        let rv = s.resource_version();
        assert_eq!(s.changes_after(1).unwrap().count(), 1);
        s.compact();
        assert_eq!(s.changes_after(1).err().map(|e| e.code), Some(410));
        assert_eq!(s.changes_after(rv).unwrap().count(), 0, "the current version is still watchable");
    }
}

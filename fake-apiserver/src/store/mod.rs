//! The object store: current objects, the global resourceVersion counter and the event history watches replay.
//!
//! Submodules: `history` (compaction, replay, list snapshots at an older version) and `delete` (immediate and
//! graceful deletion, finalizers).

mod delete;
mod history;
#[cfg(test)]
mod tests;

pub(crate) use delete::DeleteOptions;
pub(crate) use history::{Change, ChangeType};

use crate::config::Config;
use crate::ids;
use crate::kinds::ResourceKind;
use crate::patch::{self, PatchType};
use crate::status::ApiError;
use serde_json::{json, Value};
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Which part of an object a write addresses: the object itself or its `status` subresource.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Part {
    Main,
    Status,
}

/// `(plural, namespace, name)`; namespace is empty for cluster-scoped kinds.
pub(crate) type Key = (&'static str, String, String);

/// What the store takes from the server's [`Config`].
#[derive(Debug, Clone)]
struct Limits {
    history_events: usize,
    history_age: Option<Duration>,
    expire_unissued: bool,
    graceful_deletion: bool,
}

/// All objects plus history; callers hold it behind a mutex.
#[derive(Debug)]
pub(crate) struct Store {
    objects: BTreeMap<Key, Arc<Value>>,
    rv: u64,
    /// Oldest resourceVersion a watch may resume from; anything older is expired.
    floor: u64,
    history: VecDeque<Change>,
    limits: Limits,
    /// Graceful deletions waiting for their grace period to end: object → (uid, deadline).
    pending: BTreeMap<Key, (String, Instant)>,
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

/// The parts of a pod's spec an update may not change: all but container images, `activeDeadlineSeconds`,
/// `tolerations` and `terminationGracePeriodSeconds` (the real server restricts the last two further).
fn pod_spec_fixed(pod: &Value) -> Value {
    let mut spec = pod.get("spec").cloned().unwrap_or(Value::Null);
    if let Some(map) = spec.as_object_mut() {
        for field in ["activeDeadlineSeconds", "tolerations", "terminationGracePeriodSeconds"] {
            map.remove(field);
        }
        for list in ["containers", "initContainers"] {
            for container in map.get_mut(list).and_then(Value::as_array_mut).into_iter().flatten() {
                if let Some(c) = container.as_object_mut() {
                    c.remove("image");
                }
            }
        }
    }
    spec
}

impl Store {
    /// An empty store shaped by `config` (history limits, version origin, deletion semantics).
    pub fn new(config: &Config) -> Store {
        // With expiry of unissued versions, versions start at the clock (in microseconds), so no version a
        // previous server handed out is valid here: they are all older than this store's floor.
        let first = if config.watch.expire_unissued { ids::unix_micros().max(1) } else { 1 };
        Store {
            objects: BTreeMap::new(),
            rv: first,
            floor: first,
            history: VecDeque::new(),
            limits: Limits {
                history_events: config.watch.history_events.max(1),
                history_age: config.watch.history_age,
                expire_unissued: config.watch.expire_unissued,
                graceful_deletion: config.graceful_deletion,
            },
            pending: BTreeMap::new(),
        }
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

    /// Stamps `obj` with the next resourceVersion, stores it and records the event.
    fn commit(&mut self, kind: &'static ResourceKind, key: Key, mut obj: Value) -> Value {
        self.rv += 1;
        obj["metadata"]["resourceVersion"] = json!(self.rv.to_string());
        let object = Arc::new(obj.clone());
        let previous = self.objects.insert(key, object.clone());
        let change = if previous.is_some() { ChangeType::Modified } else { ChangeType::Added };
        self.record(Change { rv: self.rv, kind, change, object, previous, at: Instant::now() });
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
        if let Some(meta) = obj["metadata"].as_object_mut() {
            // Set only by deletion, never by a client.
            meta.remove("deletionTimestamp");
            meta.remove("deletionGracePeriodSeconds");
        }
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

    /// PATCH with the semantics of `ty`; server-side apply creates a missing object.
    pub fn patch(
        &mut self,
        kind: &'static ResourceKind,
        ns: &str,
        name: &str,
        ty: PatchType,
        body: &[u8],
        part: Part,
    ) -> Result<Value, ApiError> {
        let parsed = patch::parse(ty, body)?;
        let Some(existing) = self.get(kind, ns, name) else {
            if ty != PatchType::Apply {
                return Err(ApiError::not_found(kind, name));
            }
            let mut obj = patch::apply(kind, ty, &json!({}), &parsed)?;
            if let Some(meta) = obj.get_mut("metadata").and_then(Value::as_object_mut) {
                meta.remove("resourceVersion");
            }
            obj["metadata"]["name"] = json!(name);
            return self.create(kind, Some(ns).filter(|_| kind.namespaced), obj);
        };
        let mut obj = patch::apply(kind, ty, &existing, &parsed)?;
        Store::check_rv(kind, name, &existing, &obj)?;
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

    /// Applies apiserver update rules (immutable identity, status only via its subresource, generation,
    /// deletion fields), then commits unless nothing changed.
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
        if self.limits.graceful_deletion {
            self.check_terminating_update(kind, existing, &mut obj)?;
        }
        if kind.kind == "Pod" && part == Part::Main && pod_spec_fixed(&obj) != pod_spec_fixed(existing) {
            return Err(ApiError::pod_spec_forbidden(kind, name_of(existing)));
        }
        if obj == **existing {
            return Ok(obj);
        }
        if kind.has_generation && obj.get("spec") != existing.get("spec") {
            let generation = existing["metadata"]["generation"].as_i64().unwrap_or(0);
            obj["metadata"]["generation"] = json!(generation + 1);
        }
        let key = Store::key(kind, meta_str(&obj, "namespace").unwrap_or_default(), name_of(&obj));
        if self.limits.graceful_deletion && delete::finalized(&obj) {
            // The last finalizer of an object whose grace period is over is gone: the update deletes it. As on
            // the real server, watchers see the object as it was stored (DELETED), the writer its update.
            let gone = self.remove(kind, key, existing.clone());
            obj["metadata"]["resourceVersion"] = gone["metadata"]["resourceVersion"].clone();
            return Ok(obj);
        }
        Ok(self.commit(kind, key, obj))
    }
}

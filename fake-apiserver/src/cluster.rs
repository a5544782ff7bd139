//! The shared cluster state behind the HTTP server: the store, change notifications, request log and faults.

use crate::kinds::{self, ResourceKind};
use crate::store::Store;
use crate::Error;
use serde_json::Value;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::watch;

/// One API request as the server received it, so tests can count and inspect client traffic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestRecord {
    /// HTTP method, e.g. `GET`.
    pub method: String,
    /// URL path, e.g. `/api/v1/namespaces/default/pods`.
    pub path: String,
    /// Raw (still percent-encoded) query string, empty when absent.
    pub query: String,
}

impl RequestRecord {
    /// The decoded value of query parameter `name`, e.g. `watch` or `labelSelector`.
    pub fn param(&self, name: &str) -> Option<String> {
        crate::query::Query::parse(&self.query).get(name).map(str::to_string)
    }

    /// Whether this request opened a watch stream (`watch=true` or `watch=1`).
    pub fn is_watch(&self) -> bool {
        crate::query::Query::parse(&self.query).flag("watch")
    }
}

/// A failure the server injects into every request while it is set, to exercise client error handling.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    /// Answer with this HTTP status and a matching `Status` body.
    Status(u16),
    /// Wait this long before handling the request normally.
    Delay(Duration),
    /// Close the connection without answering (new connections are closed right after accept).
    Refuse,
}

#[derive(Debug)]
struct Inner {
    store: Mutex<Store>,
    /// Carries the store's newest resourceVersion; watches wake when it changes.
    changed: watch::Sender<u64>,
    /// Bumped to end every open watch stream.
    drops: watch::Sender<u64>,
    requests: Mutex<Vec<RequestRecord>>,
    fault: Mutex<Option<Fault>>,
    /// Watch streams open right now, by kind name (`Pod`); see [`Cluster::open_watches`].
    open_watches: Mutex<HashMap<&'static str, usize>>,
}

/// The in-memory cluster a fake apiserver serves, plus its test controls. Cheap to clone (shared state).
#[derive(Debug, Clone)]
pub struct Cluster {
    inner: Arc<Inner>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn kind_of(obj: &Value) -> Result<&'static ResourceKind, Error> {
    let name = obj.get("kind").and_then(Value::as_str).unwrap_or_default();
    kinds::by_name(name).ok_or_else(|| Error::UnknownKind(name.to_string()))
}

impl Default for Cluster {
    fn default() -> Self {
        Cluster::new()
    }
}

impl Cluster {
    /// An empty cluster.
    pub fn new() -> Cluster {
        let store = Store::new();
        let (changed, _) = watch::channel(store.resource_version());
        let (drops, _) = watch::channel(0);
        Cluster {
            inner: Arc::new(Inner {
                store: Mutex::new(store),
                changed,
                drops,
                requests: Mutex::new(Vec::new()),
                fault: Mutex::new(None),
                open_watches: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// Runs `f` on the locked store and wakes watches if it handed out new resourceVersions.
    pub(crate) fn with_store<T>(&self, f: impl FnOnce(&mut Store) -> T) -> T {
        let mut store = lock(&self.inner.store);
        let before = store.resource_version();
        let out = f(&mut store);
        let after = store.resource_version();
        drop(store);
        if after != before {
            self.inner.changed.send_replace(after);
        }
        out
    }

    /// Receivers for store changes and for "end all watches"; subscribe before reading the store.
    pub(crate) fn subscribe(&self) -> (watch::Receiver<u64>, watch::Receiver<u64>) {
        (self.inner.changed.subscribe(), self.inner.drops.subscribe())
    }

    /// Creates or replaces an object (kind taken from its `kind` field), emitting ADDED or MODIFIED.
    /// Returns the stored object with resourceVersion, uid and creationTimestamp filled in.
    pub fn upsert(&self, obj: Value) -> Result<Value, Error> {
        let kind = kind_of(&obj)?;
        self.with_store(|s| s.upsert(kind, obj)).map_err(|e| Error::Rejected(e.message))
    }

    /// Deletes an object (emitting DELETED) and returns its final state, or `None` if it did not exist.
    /// `kind` is a kind name or plural, e.g. `Pod` or `pods`.
    pub fn delete(&self, kind: &str, namespace: Option<&str>, name: &str) -> Option<Value> {
        let kind = kinds::by_name(kind)?;
        self.with_store(|s| s.delete(kind, namespace.unwrap_or_default(), name, None)).ok()
    }

    /// The stored object, if present.
    pub fn get(&self, kind: &str, namespace: Option<&str>, name: &str) -> Option<Value> {
        let kind = kinds::by_name(kind)?;
        self.with_store(|s| s.get(kind, namespace.unwrap_or_default(), name)).map(|o| (*o).clone())
    }

    /// Drops the event history so every resourceVersion handed out so far is expired for watches.
    pub fn compact(&self) {
        self.with_store(Store::compact);
    }

    /// Ends every open watch stream (clients see a clean end of stream and re-watch).
    pub fn drop_watches(&self) {
        self.inner.drops.send_modify(|generation| *generation += 1);
    }

    /// Every request received so far, oldest first.
    pub fn requests(&self) -> Vec<RequestRecord> {
        lock(&self.inner.requests).clone()
    }

    /// Forgets the request log, so a test can count only the requests after a point.
    pub fn clear_requests(&self) {
        lock(&self.inner.requests).clear();
    }

    /// Injects `fault` into all following requests until called again with `None`.
    pub fn set_fault(&self, fault: Option<Fault>) {
        *lock(&self.inner.fault) = fault;
    }

    /// How many watch streams of `kind` (a kind name or plural, e.g. `Pod` or `pods`) are open right now,
    /// whatever their namespace or selectors: a test hook, so tests can check that a client shares one watch
    /// instead of opening several. A stream counts from the moment its request is answered until it ends
    /// (timeout, [`Cluster::drop_watches`], shutdown, or the client going away). 0 for an unknown kind.
    pub fn open_watches(&self, kind: &str) -> usize {
        let Some(kind) = kinds::by_name(kind) else { return 0 };
        lock(&self.inner.open_watches).get(kind.kind).copied().unwrap_or(0)
    }

    /// Counts a watch stream of `kind` as open until the returned guard is dropped.
    pub(crate) fn watch_opened(&self, kind: &'static ResourceKind) -> OpenWatch {
        *lock(&self.inner.open_watches).entry(kind.kind).or_default() += 1;
        OpenWatch { cluster: self.clone(), kind: kind.kind }
    }

    pub(crate) fn fault(&self) -> Option<Fault> {
        lock(&self.inner.fault).clone()
    }

    pub(crate) fn log_request(&self, record: RequestRecord) {
        lock(&self.inner.requests).push(record);
    }
}

/// One open watch stream, counted in [`Cluster::open_watches`] while it lives.
#[derive(Debug)]
pub(crate) struct OpenWatch {
    cluster: Cluster,
    kind: &'static str,
}

impl Drop for OpenWatch {
    fn drop(&mut self) {
        if let Some(open) = lock(&self.cluster.inner.open_watches).get_mut(self.kind) {
            *open = open.saturating_sub(1);
        }
    }
}

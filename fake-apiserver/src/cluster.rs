//! The shared cluster state behind the HTTP server: configuration, the store, change notifications, keys and
//! tokens, and the test controls (request log, faults, throttling).

use crate::auth::{Tokens, Unauthenticated, User};
use crate::config::Config;
use crate::kinds::{self, ResourceKind};
use crate::store::{DeleteOptions, Store};
use crate::tls::{self, Pki};
use crate::traffic::{Traffic, TrafficRecord};
use crate::{kubeconfig, Error};
use serde::Serialize;
use serde_json::Value;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// One API request as the server received and answered it, so tests can count and inspect client traffic
/// (for example: "no request was refused with 403").
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RequestRecord {
    /// HTTP method, e.g. `GET`.
    pub method: String,
    /// URL path, e.g. `/api/v1/namespaces/default/pods`.
    pub path: String,
    /// Raw (still percent-encoded) query string, empty when absent.
    pub query: String,
    /// The RBAC verb: `get`, `list`, `watch`, `create`, `update`, `patch`, `delete`, `deletecollection`, or the
    /// lower-case method for paths that are not resources (`/version`, discovery).
    pub verb: String,
    /// Who the request ran as: the token's user, `system:anonymous` without a valid token (when tokens are
    /// not required), or empty when it was refused with 401.
    pub user: String,
    /// The HTTP status answered (200 for a watch, whose errors come inside the stream); 0 while the request
    /// is still being handled, or when an injected [`Fault::Refuse`] closed the connection instead.
    pub status: u16,
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

/// API requests to answer with 429 Too Many Requests and a `Retry-After` header, as API priority and fairness
/// does under load. Applies after authentication, before authorization, to every API request (watches too).
#[derive(Debug, Clone, PartialEq)]
pub enum Throttle {
    /// The next `count` API requests.
    Next {
        /// How many requests to refuse.
        count: u32,
        /// The `Retry-After` header, in seconds.
        retry_after_seconds: u32,
    },
    /// Each API request with probability `fraction` (0 to 1), until cleared.
    Fraction {
        /// The share of requests to refuse.
        fraction: f64,
        /// The `Retry-After` header, in seconds.
        retry_after_seconds: u32,
    },
}

#[derive(Debug)]
struct Inner {
    config: Config,
    store: Mutex<Store>,
    /// Carries the store's newest resourceVersion; watches wake when it changes.
    changed: watch::Sender<u64>,
    /// Bumped to end every open watch stream.
    drops: watch::Sender<u64>,
    /// The request log, each entry with a sequence number so its answer can be filled in later.
    requests: Mutex<Vec<(u64, RequestRecord)>>,
    next_request: AtomicU64,
    fault: Mutex<Option<Fault>>,
    throttle: Mutex<Option<Throttle>>,
    /// Watch streams open right now, by kind name (`Pod`); see [`Cluster::open_watches`].
    open_watches: Mutex<HashMap<&'static str, usize>>,
    /// What was sent to whom: see [`Cluster::traffic`].
    traffic: Traffic,
    tokens: Tokens,
    pki: Option<Pki>,
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
    /// An empty cluster with the lenient default [`Config`].
    pub fn new() -> Cluster {
        let config = Config::default();
        let tokens = Tokens::ephemeral(config.token_rotation_grace);
        Cluster::assemble(config, None, tokens)
    }

    /// An empty cluster configured by `config`: creates or loads its CA and serving certificate (with
    /// [`Config::tls`]) and its token-signing key, in [`Config::state_dir`] when set.
    pub fn with_config(config: Config) -> Result<Cluster, Error> {
        let dir = config.state_dir.as_deref();
        let pki = if config.tls { Some(tls::load_or_create(dir, &config.tls_sans)?) } else { None };
        let tokens = Tokens::load_or_create(dir, config.token_rotation_grace)?;
        Ok(Cluster::assemble(config, pki, tokens))
    }

    fn assemble(config: Config, pki: Option<Pki>, tokens: Tokens) -> Cluster {
        let store = Store::new(&config);
        let (changed, _) = watch::channel(store.resource_version());
        let (drops, _) = watch::channel(0);
        Cluster {
            inner: Arc::new(Inner {
                config,
                store: Mutex::new(store),
                changed,
                drops,
                requests: Mutex::new(Vec::new()),
                next_request: AtomicU64::new(0),
                fault: Mutex::new(None),
                throttle: Mutex::new(None),
                open_watches: Mutex::new(HashMap::new()),
                traffic: Traffic::default(),
                tokens,
                pki,
            }),
        }
    }

    /// How this cluster was configured.
    pub fn config(&self) -> &Config {
        &self.inner.config
    }

    /// Runs `f` on the locked store and wakes watches if it handed out new resourceVersions.
    pub(crate) fn with_store<T>(&self, f: impl FnOnce(&mut Store) -> T) -> T {
        let mut store = lock(&self.inner.store);
        store.prune_history(Instant::now());
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

    /// Deletes an object at once, whatever its finalizers or grace period (emitting DELETED), and returns its
    /// final state, or `None` if it did not exist. `kind` is a kind name or plural, e.g. `Pod` or `pods`.
    pub fn delete(&self, kind: &str, namespace: Option<&str>, name: &str) -> Option<Value> {
        let kind = kinds::by_name(kind)?;
        self.with_store(|s| s.delete(kind, namespace.unwrap_or_default(), name, &DeleteOptions::default(), false)).ok()
    }

    /// Deletes an object as a client's DELETE does with graceful deletion on, whatever the configuration:
    /// with `grace_period_seconds` (`None`: the kind's default, for pods their `terminationGracePeriodSeconds`
    /// or 30), MODIFIED with `deletionTimestamp` now and DELETED after the grace period, unless finalizers hold
    /// it. Returns the object's state after the request, `None` if it did not exist. The grace period ends only
    /// while the cluster is served (the server removes due objects).
    pub fn delete_gracefully(
        &self,
        kind: &str,
        namespace: Option<&str>,
        name: &str,
        grace_period_seconds: Option<i64>,
    ) -> Option<Value> {
        let kind = kinds::by_name(kind)?;
        let options = DeleteOptions { grace_period_seconds, preconditions: None };
        self.with_store(|s| s.delete(kind, namespace.unwrap_or_default(), name, &options, true)).ok()
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

    /// Every request received so far, oldest first. Requests to the test endpoints (`/fake/...`) are not
    /// recorded.
    pub fn requests(&self) -> Vec<RequestRecord> {
        lock(&self.inner.requests).iter().map(|(_, r)| r.clone()).collect()
    }

    /// Forgets the request log, so a test can count only the requests after a point.
    pub fn clear_requests(&self) {
        lock(&self.inner.requests).clear();
    }

    /// What the server sent to its clients since it started or since [`Cluster::clear_traffic`], one record per
    /// front end, user, verb and resource (see [`TrafficRecord`] for what each figure counts).
    pub fn traffic(&self) -> Vec<TrafficRecord> {
        self.inner.traffic.records()
    }

    /// Forgets the traffic counters, so a measurement can count only what was sent after a point (a watch
    /// stream open across the point counts only its later frames).
    pub fn clear_traffic(&self) {
        self.inner.traffic.clear();
    }

    /// The traffic counters, for the HTTP layer.
    pub(crate) fn traffic_counters(&self) -> &Traffic {
        &self.inner.traffic
    }

    /// Injects `fault` into all following requests until called again with `None`.
    pub fn set_fault(&self, fault: Option<Fault>) {
        *lock(&self.inner.fault) = fault;
    }

    /// Answers API requests with 429 as `throttle` says, until called again with `None` (or, for
    /// [`Throttle::Next`], until that many requests were refused).
    pub fn set_throttle(&self, throttle: Option<Throttle>) {
        *lock(&self.inner.throttle) = throttle;
    }

    /// How many watch streams of `kind` (a kind name or plural, e.g. `Pod` or `pods`) are open right now,
    /// whatever their namespace or selectors: a test hook, so tests can check that a client shares one watch
    /// instead of opening several. A stream counts from the moment its request is answered until it ends
    /// (timeout, [`Cluster::drop_watches`], shutdown, or the client going away). 0 for an unknown kind.
    pub fn open_watches(&self, kind: &str) -> usize {
        let Some(kind) = kinds::by_name(kind) else { return 0 };
        lock(&self.inner.open_watches).get(kind.kind).copied().unwrap_or(0)
    }

    /// PEM of the CA that signed the serving certificate, `None` when serving plain http.
    pub fn ca_pem(&self) -> Option<&str> {
        self.inner.pki.as_ref().map(|p| p.ca_pem.as_str())
    }

    /// A bearer token for `user`, valid until a rotation of that user's tokens retires it.
    pub fn token_for(&self, user: &User) -> String {
        self.inner.tokens.issue(user)
    }

    /// A token for the service account `namespace/name` (what a pod finds in its projected token file).
    pub fn service_account_token(&self, namespace: &str, name: &str) -> String {
        self.token_for(&User::service_account(namespace, name))
    }

    /// Rotates `user`'s tokens: returns a new one; every older one keeps working for
    /// [`Config::token_rotation_grace`], then gets 401.
    pub fn rotate_token(&self, user: &User) -> Result<String, Error> {
        self.inner.tokens.rotate(user)
    }

    /// The token kubeconfigs carry: the admin's (`system:masters`) when tokens are checked (authentication
    /// or RBAC on), else the historical placeholder `fake-token`.
    pub fn kubeconfig_token(&self) -> String {
        if self.inner.config.authentication || self.inner.config.rbac {
            self.token_for(&User::admin())
        } else {
            "fake-token".to_string()
        }
    }

    /// A kubeconfig for the server at `url` (with the CA when serving https) that authenticates with `token`.
    pub fn kubeconfig_with_token(&self, url: &str, token: &str) -> String {
        kubeconfig::kubeconfig_yaml_with(url, self.ca_pem(), token)
    }

    /// A kubeconfig for the server at `url` as the admin ([`Cluster::kubeconfig_token`]).
    pub fn kubeconfig(&self, url: &str) -> String {
        self.kubeconfig_with_token(url, &self.kubeconfig_token())
    }

    pub(crate) fn tls_config(&self) -> Option<Arc<rustls::ServerConfig>> {
        self.inner.pki.as_ref().map(|p| p.server.clone())
    }

    /// The user an `Authorization` header value authenticates.
    pub(crate) fn authenticate(&self, authorization: Option<&str>) -> Result<User, Unauthenticated> {
        self.inner.tokens.authenticate(authorization)
    }

    /// Counts a watch stream of `kind` as open until the returned guard is dropped.
    pub(crate) fn watch_opened(&self, kind: &'static ResourceKind) -> OpenWatch {
        *lock(&self.inner.open_watches).entry(kind.kind).or_default() += 1;
        OpenWatch { cluster: self.clone(), kind: kind.kind }
    }

    pub(crate) fn fault(&self) -> Option<Fault> {
        lock(&self.inner.fault).clone()
    }

    /// `Some(retry_after_seconds)` when this request is to be throttled.
    pub(crate) fn throttled(&self) -> Option<u32> {
        let mut throttle = lock(&self.inner.throttle);
        match throttle.as_mut()? {
            Throttle::Next { count, retry_after_seconds } => {
                let retry = *retry_after_seconds;
                *count = count.saturating_sub(1);
                if *count == 0 {
                    *throttle = None;
                }
                Some(retry)
            }
            Throttle::Fraction { fraction, retry_after_seconds } => {
                (crate::ids::unit_random() < *fraction).then_some(*retry_after_seconds)
            }
        }
    }

    /// Records a request as it arrives; [`Cluster::log_answer`] fills in its answer.
    pub(crate) fn log_request(&self, record: RequestRecord) -> u64 {
        let seq = self.inner.next_request.fetch_add(1, Ordering::Relaxed);
        lock(&self.inner.requests).push((seq, record));
        seq
    }

    /// Fills in who request `seq` ran as and how it was answered.
    pub(crate) fn log_answer(&self, seq: u64, verb: &str, user: &str, status: u16) {
        let mut log = lock(&self.inner.requests);
        if let Some((_, record)) = log.iter_mut().rev().find(|(s, _)| *s == seq) {
            record.verb = verb.to_string();
            record.user = user.to_string();
            record.status = status;
        }
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

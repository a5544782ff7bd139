use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};

use prometheus_client::registry::Registry;

/// What the probe server reports, shared between the binary's components (which change it) and the server (which
/// reads it per request). Cheap to clone: every clone sees the same state.
///
/// Readiness is a set of named [`Blocker`]s: each component registers its own and clears it when its part is
/// ready, and the process is ready while none blocks. A fresh state has none, so it is ready: register blockers
/// before serving the probes (the shared main registers `startup` for the binary).
///
/// It also carries the metrics registry, so one value is all a binary hands to [`serve`](super::serve) and all its
/// components need to register metrics.
#[derive(Debug, Clone)]
pub struct ProbeState {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    /// Every blocker ever registered, in registration order (the order `/readyz` lists them in).
    blockers: Mutex<Vec<Entry>>,
    registry: Arc<Mutex<Registry>>,
    /// A local process whose metrics `/metrics` appends to the registry's (see [`super::merge`]).
    appended: OnceLock<super::merge::Source>,
}

#[derive(Debug)]
struct Entry {
    name: &'static str,
    /// Why it blocks; `None` once cleared.
    reason: Option<String>,
}

impl ProbeState {
    /// Creates the state around the binary's metrics `registry`, with no blockers.
    pub fn new(registry: Arc<Mutex<Registry>>) -> Self {
        ProbeState { inner: Arc::new(Inner { blockers: Mutex::default(), registry, appended: OnceLock::new() }) }
    }

    /// Registers the blocker `name`, blocking with `reason` until its owner clears it. Registering a name twice
    /// returns a handle to the same blocker (and sets its reason).
    pub fn blocker(&self, name: &'static str, reason: impl Into<String>) -> Blocker {
        let blocker = Blocker { state: self.clone(), name };
        {
            let mut blockers = self.blockers();
            if !blockers.iter().any(|entry| entry.name == name) {
                blockers.push(Entry { name, reason: None });
            }
        }
        blocker.block(reason);
        blocker
    }

    /// Whether `/readyz` currently answers 200: no blocker blocks.
    pub fn is_ready(&self) -> bool {
        self.blockers().iter().all(|entry| entry.reason.is_none())
    }

    /// The blockers still blocking, as `(name, reason)` in registration order; empty when ready.
    pub fn blocking(&self) -> Vec<(&'static str, String)> {
        self.blockers().iter().filter_map(|entry| Some((entry.name, entry.reason.clone()?))).collect()
    }

    /// The registry `/metrics` encodes; register metrics here.
    pub fn registry(&self) -> &Arc<Mutex<Registry>> {
        &self.inner.registry
    }

    /// Runs `f` on the registry (to register metrics, or to encode them).
    pub fn with_registry<T>(&self, f: impl FnOnce(&mut Registry) -> T) -> T {
        // Registering and encoding leave the registry consistent at every step, so a panic elsewhere cannot
        // have corrupted it.
        f(&mut self.inner.registry.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Makes `/metrics` append the metrics `GET http://{addr}/metrics` answers (families the registry does not
    /// have), so one scraped port carries a second process's too. Set once; a second call changes nothing and
    /// returns false.
    pub fn append_metrics_from(&self, addr: SocketAddr) -> bool {
        self.inner.appended.set(super::merge::Source::new(addr)).is_ok()
    }

    /// The process whose metrics `/metrics` appends, if any.
    pub fn appended_metrics_source(&self) -> Option<&super::merge::Source> {
        self.inner.appended.get()
    }

    fn blockers(&self) -> MutexGuard<'_, Vec<Entry>> {
        // Each entry is replaced whole, so a panic elsewhere cannot leave one half-written.
        self.inner.blockers.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Sets the reason of `name` (`None` clears it); true if that changed anything.
    fn set(&self, name: &'static str, reason: Option<String>) -> bool {
        let mut blockers = self.blockers();
        let Some(entry) = blockers.iter_mut().find(|entry| entry.name == name) else { return false };
        if entry.reason == reason {
            return false;
        }
        match &reason {
            Some(reason) => tracing::info!(blocker = name, %reason, "not ready"),
            None => tracing::info!(blocker = name, "cleared"),
        }
        entry.reason = reason;
        if blockers.iter().all(|entry| entry.reason.is_none()) {
            tracing::info!("ready");
        }
        true
    }
}

/// One component's say in readiness: while it blocks, `/readyz` answers 503 and names it with its reason.
/// Dropping it leaves it as it is (a component that died blocking keeps the process unready).
#[derive(Debug, Clone)]
pub struct Blocker {
    state: ProbeState,
    name: &'static str,
}

impl Blocker {
    /// Blocks readiness with `reason` (or changes the reason); true if that changed anything.
    pub fn block(&self, reason: impl Into<String>) -> bool {
        self.state.set(self.name, Some(reason.into()))
    }

    /// Stops blocking; true if it was blocking.
    pub fn clear(&self) -> bool {
        self.state.set(self.name, None)
    }

    /// Whether it currently blocks.
    pub fn is_blocking(&self) -> bool {
        self.reason().is_some()
    }

    /// Why it blocks, or `None` when it does not.
    pub fn reason(&self) -> Option<String> {
        self.state.blockers().iter().find(|entry| entry.name == self.name).and_then(|entry| entry.reason.clone())
    }

    /// Its name, as `/readyz` lists it.
    pub fn name(&self) -> &'static str {
        self.name
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_only_once_every_blocker_clears_and_each_is_listed() {
        let state = ProbeState::new(Arc::default());
        let seen_by_server = state.clone();
        assert!(seen_by_server.is_ready(), "no blockers: ready");

        let config = state.blocker("cni-config", "waiting for a primary CNI config");
        let watch = state.blocker("pod-watch", "listing pods");
        assert!(!seen_by_server.is_ready());
        assert_eq!(
            seen_by_server.blocking(),
            vec![
                ("cni-config", "waiting for a primary CNI config".to_owned()),
                ("pod-watch", "listing pods".to_owned())
            ]
        );

        assert!(config.clear());
        assert!(!config.clear(), "clearing twice changes nothing");
        assert!(!seen_by_server.is_ready(), "one blocker still blocks");
        assert_eq!(seen_by_server.blocking(), vec![("pod-watch", "listing pods".to_owned())]);

        assert!(watch.clear());
        assert!(seen_by_server.is_ready());
        assert_eq!(seen_by_server.blocking(), vec![]);

        assert!(config.block("CNI config removed"));
        assert!(!config.block("CNI config removed"), "same reason changes nothing");
        assert_eq!(config.reason().as_deref(), Some("CNI config removed"));
        assert!(!seen_by_server.is_ready());
    }

    #[test]
    fn registering_a_name_again_shares_the_blocker() {
        let state = ProbeState::new(Arc::default());
        let first = state.blocker("startup", "starting");
        let second = state.blocker("startup", "still starting");
        assert_eq!(first.reason().as_deref(), Some("still starting"));
        second.clear();
        assert!(!first.is_blocking());
        assert_eq!(state.blocking(), vec![]);
    }
}

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use prometheus_client::registry::Registry;

/// The reason a fresh [`ProbeState`] reports until the binary calls [`ProbeState::set_ready`].
const STARTING: &str = "starting";

/// What the probe server reports, shared between the binary (which changes it) and the server (which
/// reads it per request). Cheap to clone: every clone sees the same state.
///
/// It also carries the metrics registry, so one value is all a binary hands to [`serve`](super::serve)
/// and all its components need to register metrics.
#[derive(Debug, Clone)]
pub struct ProbeState {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    /// `None` when ready, otherwise why not.
    not_ready: Mutex<Option<String>>,
    registry: Arc<Mutex<Registry>>,
}

impl ProbeState {
    /// Creates the state around the binary's metrics `registry`. It starts not ready (reason
    /// `"starting"`) so the kubelet does not route to the pod before the binary says so.
    pub fn new(registry: Arc<Mutex<Registry>>) -> Self {
        ProbeState { inner: Arc::new(Inner { not_ready: Mutex::new(Some(STARTING.to_owned())), registry }) }
    }

    /// Marks the process ready: `/readyz` answers 200 from now on.
    pub fn set_ready(&self) {
        if self.not_ready().take().is_some() {
            tracing::info!("ready");
        }
    }

    /// Marks the process not ready: `/readyz` answers 503 with `reason` in the body, so whoever looks
    /// at a failing probe sees why.
    pub fn set_not_ready(&self, reason: impl Into<String>) {
        let reason = reason.into();
        let mut not_ready = self.not_ready();
        if not_ready.as_deref() != Some(reason.as_str()) {
            tracing::info!(%reason, "not ready");
            *not_ready = Some(reason);
        }
    }

    /// Whether `/readyz` currently answers 200.
    pub fn is_ready(&self) -> bool {
        self.not_ready().is_none()
    }

    /// Why the process is not ready, or `None` when it is.
    pub fn reason(&self) -> Option<String> {
        self.not_ready().clone()
    }

    /// The registry `/metrics` encodes; register metrics here.
    pub fn registry(&self) -> &Arc<Mutex<Registry>> {
        &self.inner.registry
    }

    fn not_ready(&self) -> MutexGuard<'_, Option<String>> {
        // The value is a plain Option, always consistent, so a panic elsewhere cannot corrupt it.
        self.inner.not_ready.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_not_ready_and_follows_updates_across_clones() {
        let state = ProbeState::new(Arc::default());
        let seen_by_server = state.clone();
        assert!(!seen_by_server.is_ready());
        assert_eq!(seen_by_server.reason().as_deref(), Some(STARTING));

        state.set_ready();
        assert!(seen_by_server.is_ready());
        assert_eq!(seen_by_server.reason(), None);

        state.set_not_ready("CNI config missing");
        assert!(!seen_by_server.is_ready());
        assert_eq!(seen_by_server.reason().as_deref(), Some("CNI config missing"));
    }
}

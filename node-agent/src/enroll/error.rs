//! Why an enrollment or a removal failed: each variant names the pod and the step, and its message is what the
//! plugin's failed ADD reports (CNI error text) and what `explain` shows as the last error.

use std::time::Duration;

/// Why a pod could not be enrolled or removed; the message goes back to the plugin.
#[derive(Debug, thiserror::Error)]
pub enum EnrollError {
    /// The pod's netns could not be opened or found.
    #[error("pod {pod}: netns: {reason}")]
    Netns {
        /// namespace/name.
        pod: String,
        /// What went wrong.
        reason: String,
    },
    /// The in-pod rules could not be programmed.
    #[error("pod {pod}: in-pod rules: {reason}")]
    Rules {
        /// namespace/name.
        pod: String,
        /// What went wrong.
        reason: String,
    },
    /// The node proxy did not take the pod (none connected, or it answered with an error).
    #[error("pod {pod}: node proxy: {source}")]
    Proxy {
        /// namespace/name.
        pod: String,
        /// The ZDS error.
        source: zds::ZdsError,
    },
    /// An API call failed.
    #[error("pod {pod}: {what}: {source}")]
    Api {
        /// namespace/name.
        pod: String,
        /// Which call.
        what: &'static str,
        /// The API error.
        source: kube::Error,
    },
    /// An API call got no answer in time (a connection the server stopped answering: kube waits up to its 295 s
    /// read timeout).
    #[error("pod {pod}: {what}: no answer from the API server within {after:?}")]
    ApiTimeout {
        /// namespace/name.
        pod: String,
        /// Which call.
        what: &'static str,
        /// The bound.
        after: Duration,
    },
    /// The pod's annotations cannot be turned into rules (an injected or over-long interface name, ...): refused
    /// before any rule, as the sidecar path refuses them with CNI code 7.
    #[error("pod {pod}: {source}")]
    Invalid {
        /// namespace/name.
        pod: String,
        /// The annotation at fault and why.
        source: istio_contract::validate::SettingsError,
    },
    /// The plugin's enrollment task ended without an answer (it panicked).
    #[error("pod {pod}: enrollment task: {reason}")]
    Task {
        /// namespace/name.
        pod: String,
        /// Why the task ended.
        reason: String,
    },
    /// The plugin's enrollment was not done by its answer deadline, when the plugin may give up on it: stopped
    /// there and undone, as a failure.
    #[error(
        "pod {pod}: enrollment not done by the plugin's answer deadline ({deadline:?} after the request; it was at \
         {step}): not enrolled (undone)"
    )]
    TooLate {
        /// namespace/name.
        pod: String,
        /// The step it had reached: where the time went.
        step: &'static str,
        /// [`cni::plugin_event::AGENT_ANSWER_DEADLINE`].
        deadline: Duration,
    },
    /// The pod was deleted before or while it was being enrolled: refused, and whatever was done undone.
    #[error("pod {pod} (uid {uid}) was deleted: not enrolled (stopped before {stage}, nothing left behind)")]
    Deleted {
        /// namespace/name.
        pod: String,
        /// The deleted pod's UID.
        uid: String,
        /// The stage at which the deletion was noticed.
        stage: &'static str,
    },
}

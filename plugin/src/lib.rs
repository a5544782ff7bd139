//! What the `istio-cni` plugin shares with the node agent: a pod's facts as the plugin sees them, and Istio's
//! sidecar decision and rule programming, so the agent's in-place repair redirects a pod exactly as ADD would.
#![warn(missing_docs)]

pub mod pod;
pub mod sidecar;

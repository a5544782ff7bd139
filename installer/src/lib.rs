//! install-cni: puts the istio-cni plugin binary, its kubeconfig and its CNI config entry on a node and keeps
//! them there. The pure, synchronous pieces (the CNI config planner, the kubeconfig, crash-safe writes) are
//! tested on temp dirs against Istio's fixtures; [`agent`] drives them from the binary's watch loop.
//!
//! The binary and the modules only it needs (settings, the agent loop, metrics, the API server calls) come with
//! the default `runtime` feature; without it the library is the pure pieces alone, which is what the fuzz targets
//! build.

#[cfg(feature = "runtime")]
pub mod agent;
pub mod atomic;
pub mod binaries;
pub mod cniconf;
#[cfg(feature = "runtime")]
pub mod config;
pub mod crash;
pub mod fight;
pub mod journal;
pub mod kubeconfig;
#[cfg(feature = "runtime")]
pub mod metrics;
#[cfg(feature = "runtime")]
pub mod safe_upgrade;

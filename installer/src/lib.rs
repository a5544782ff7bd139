//! install-cni: puts the istio-cni plugin binary, its kubeconfig and its CNI config entry on a node and keeps
//! them there. The pure, synchronous pieces (the CNI config planner, the kubeconfig, crash-safe writes) are
//! tested on temp dirs against Istio's fixtures; [`agent`] drives them from the binary's watch loop.

pub mod agent;
pub mod atomic;
pub mod binaries;
pub mod cniconf;
pub mod config;
pub mod fight;
pub mod journal;
pub mod kubeconfig;
pub mod metrics;
pub mod safe_upgrade;

//! The code under fuzz, compiled here from its own source files: modules of binary crates (the plugin's
//! netconf, install-cni's CNI config handling, hbone-proxy's local workload file) and the dependency-free
//! modules of library crates (ZDS messages, the HBONE CONNECT rules, SPIFFE identities). Going by file instead
//! of by crate keeps kube, hyper, rustls and tokio out of the instrumented build, so it fits in CI.

/// install-cni's crash-safe writes, which its CNI config module uses.
#[path = "../../installer/src/atomic.rs"]
pub mod atomic;

/// install-cni's CNI config module: discovery, parsing, insertion, cleanup.
#[path = "../../installer/src/cniconf/mod.rs"]
pub mod cniconf;

/// The `istio-cni` plugin's netconf.
#[path = "../../plugin/src/config.rs"]
pub mod plugin_config;

/// hbone-proxy's local workload file.
#[path = "../../hbone-proxy/src/directory/workload.rs"]
pub mod workload;

/// The ZDS protobuf messages.
#[path = "../../zds/src/messages.rs"]
pub mod zds_messages;

/// The HBONE server's CONNECT rules.
#[path = "../../hbone/src/connect.rs"]
pub mod hbone_connect;

/// SPIFFE identities as the HBONE crate builds and parses them.
#[path = "../../hbone/src/identity.rs"]
pub mod identity;

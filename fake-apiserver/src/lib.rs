//! A fake Kubernetes API server for tests: real REST and watch protocol, in-memory objects, as lenient or as
//! strict as a test needs.
//!
//! It serves core/v1 pods, namespaces, nodes (each with `status`), service accounts and config maps,
//! apps/v1 daemonsets and rbac.authorization.k8s.io/v1 roles and bindings, well enough for the `kube`
//! client (`Api`, `runtime::watcher`, reflectors) and anything else that speaks the API. Tests drive it
//! through [`FakeApiServer`] (or a [`Cluster`]), the binary through [`serve`].
//!
//! # Lenient by default, strict on request
//!
//! [`Config::default`] is the server the suite has always used: plain http, any token, no RBAC, instant
//! deletion, no server-side watch timeout, 10,000 events of history and a bookmark every second to watches
//! that ask. [`Config::strict`] turns on every behaviour of a real kube-apiserver our binaries could notice;
//! each is also its own option (the table in [`config`] lists every option, flag and default):
//!
//! - **TLS** ([`Config::tls`]): https with the fake's own CA; [`Config::state_dir`] keeps the CA, serving
//!   certificate and token-signing key, so a restarted server is trusted by its old clients and accepts
//!   their tokens. Kubeconfigs from [`FakeApiServer::kubeconfig_yaml`] carry the CA and a token.
//! - **Authentication** ([`Config::authentication`]): as the real server, an invalid bearer token gets 401 and
//!   a request with none runs as `system:anonymous` (so RBAC answers it, usually 403). Tokens come
//!   from [`FakeApiServer::service_account_token`] / [`Cluster::token_for`]; [`Cluster::rotate_token`] retires
//!   a subject's older tokens after [`Config::token_rotation_grace`].
//! - **RBAC** ([`Config::rbac`]): the stored ClusterRoles, Roles and their bindings are enforced (403 with a
//!   `Status` body). Every request is logged with its verb, user and status ([`Cluster::requests`], and
//!   `GET /fake/requests`), so a test can assert that nothing was refused; what each client was sent (requests,
//!   bytes, list items and watch events per front end, user, verb and resource) is summed in
//!   [`Cluster::traffic`].
//! - **Graceful deletion** ([`Config::graceful_deletion`]): `deletionTimestamp`, grace periods and finalizers.
//! - **Watches** ([`WatchConfig`]): server-side timeouts, compacted history (410 for expired versions, also
//!   for versions the server never issued) and the bookmark interval.
//! - **Field selectors** ([`Config::strict_field_selectors`]): only the real server's fields per kind.
//! - **Throttling** ([`Cluster::set_throttle`]): 429 with `Retry-After` on request.
//!
//! Always as the real server, whatever the configuration: strategic-merge and JSON patches have their own
//! semantics (not merge), unknown patch types get 415, and a paged list is one consistent snapshot (its
//! continue token pins the resourceVersion; once compacted away the token gets 410).
//!
//! # Test endpoints
//!
//! For tests that run the binary, the library's controls are also served under `/fake/` (no token needed,
//! not recorded in the request log; a real server has no such paths):
//!
//! | request | effect |
//! |---|---|
//! | `GET /fake/requests` | the request log, a JSON array of [`RequestRecord`] |
//! | `DELETE /fake/requests` | forget the request log |
//! | `PUT /fake/throttle` `{"next": N, "retryAfterSeconds": S}` | the next N API requests get 429 |
//! | `PUT /fake/throttle` `{"fraction": F, "retryAfterSeconds": S}` | each API request gets 429 with probability F |
//! | `DELETE /fake/throttle` | stop throttling |
//! | `POST /fake/tokens` `{"serviceAccount": "NS/NAME"}` or `{"user": U, "groups": [..]}` | `{"token": …}` |
//! | `POST /fake/tokens/rotate` (same body) | a new token; older ones expire after the rotation grace |
//! | `POST /fake/compact` | compact the history: older resourceVersions get 410 |
//! | `POST /fake/drop-watches` | end every open watch |

pub mod config;

mod auth;
mod cluster;
mod debug;
mod fake;
mod ids;
mod kinds;
mod kubeconfig;
mod patch;
mod query;
mod rbac;
mod routes;
mod seed;
mod selectors;
mod server;
mod state;
mod status;
mod store;
mod tls;
mod traffic;
mod watch;

pub use auth::{User, ADMIN_USER, MASTERS_GROUP};
pub use cluster::{Cluster, Fault, RequestRecord, Throttle};
pub use config::{Config, WatchConfig};
pub use fake::{Builder, FakeApiServer};
pub use kubeconfig::{kubeconfig_yaml, kubeconfig_yaml_with};
pub use seed::parse_objects;
pub use server::serve;
pub use traffic::TrafficRecord;

use std::path::{Path, PathBuf};

/// Everything that can go wrong starting or controlling a fake server.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The listen address could not be bound.
    #[error("binding the fake apiserver to {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: std::net::SocketAddr,
        /// Why binding failed.
        source: std::io::Error,
    },
    /// The server thread or its tokio runtime could not be created.
    #[error("starting the fake apiserver runtime: {0}")]
    Runtime(std::io::Error),
    /// A test control or seed file named a kind the fake does not serve.
    #[error("object kind {0:?} is not served by the fake apiserver")]
    UnknownKind(String),
    /// The object is invalid for the API (e.g. no name, wrong apiVersion for its kind).
    #[error("object rejected: {0}")]
    Rejected(String),
    /// A seed file is neither valid JSON nor valid YAML.
    #[error("parsing seed objects: {0}")]
    ParseSeed(String),
    /// The kubeconfig file could not be written.
    #[error("writing kubeconfig {path}: {source}")]
    WriteKubeconfig {
        /// The kubeconfig path.
        path: PathBuf,
        /// Why writing failed.
        source: std::io::Error,
    },
    /// A file in the state directory could not be read or written.
    #[error("state file {path}: {source}")]
    State {
        /// The file or directory.
        path: PathBuf,
        /// Why it failed.
        source: std::io::Error,
    },
    /// A certificate, key or TLS configuration could not be made or read.
    #[error("TLS material: {0}")]
    Certificate(String),
}

/// Writes `contents` to `path` atomically (temp file + rename), so pollers never see a partial file.
pub fn write_file_atomically(path: &Path, contents: &str) -> Result<(), Error> {
    let err = |source| Error::WriteKubeconfig { path: path.to_path_buf(), source };
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    std::fs::write(&tmp, contents).map_err(err)?;
    std::fs::rename(&tmp, path).map_err(err)
}

//! A fake Kubernetes API server for tests: plain HTTP, real REST and watch protocol, in-memory objects.
//!
//! It serves core/v1 pods (with `status`), namespaces and nodes and apps/v1 daemonsets well enough for
//! the `kube` client (`Api`, `runtime::watcher`, reflectors) and anything else that speaks the API.
//! Tests drive it through [`FakeApiServer`] (or a [`Cluster`]), the binary through [`serve`].

mod cluster;
mod ids;
mod kinds;
mod kubeconfig;
mod patch;
mod query;
mod routes;
mod seed;
mod selectors;
mod server;
mod status;
mod store;
mod watch;

pub use cluster::{Cluster, Fault, RequestRecord};
pub use kubeconfig::kubeconfig_yaml;
pub use seed::parse_objects;
pub use server::serve;

use serde_json::Value;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use tokio::sync::oneshot;

/// Everything that can go wrong starting or controlling a fake server.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The listen address could not be bound.
    #[error("binding the fake apiserver to {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
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
}

/// Writes `contents` to `path` atomically (temp file + rename), so pollers never see a partial file.
pub fn write_file_atomically(path: &Path, contents: &str) -> Result<(), Error> {
    let err = |source| Error::WriteKubeconfig { path: path.to_path_buf(), source };
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    std::fs::write(&tmp, contents).map_err(err)?;
    std::fs::rename(&tmp, path).map_err(err)
}

/// A fake apiserver running on its own thread and runtime, so plain `#[test]`s can use it.
/// Dropping it stops the server and ends all open connections.
#[derive(Debug)]
pub struct FakeApiServer {
    addr: SocketAddr,
    cluster: Cluster,
    shutdown: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl FakeApiServer {
    /// Starts an empty server on an ephemeral port of 127.0.0.1.
    pub fn start() -> Result<FakeApiServer, Error> {
        FakeApiServer::start_on(SocketAddr::from(([127, 0, 0, 1], 0)))
    }

    /// Starts an empty server on `addr` (port 0 picks a free port).
    pub fn start_on(addr: SocketAddr) -> Result<FakeApiServer, Error> {
        let listener = std::net::TcpListener::bind(addr).map_err(|source| Error::Bind { addr, source })?;
        FakeApiServer::start_with_listener(listener)
    }

    /// Serves on an already bound listener, e.g. one created inside a test's "node" network namespace so
    /// that plugins running there reach the server on that namespace's loopback.
    pub fn start_with_listener(listener: std::net::TcpListener) -> Result<FakeApiServer, Error> {
        let addr = SocketAddr::from(([0, 0, 0, 0], 0));
        let bound = listener.local_addr().map_err(|source| Error::Bind { addr, source })?;
        listener.set_nonblocking(true).map_err(|source| Error::Bind { addr, source })?;
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(Error::Runtime)?;
        let cluster = Cluster::new();
        let (shutdown, stop) = oneshot::channel::<()>();
        let served = cluster.clone();
        let thread = std::thread::Builder::new()
            .name(format!("fake-apiserver-{}", bound.port()))
            .spawn(move || {
                runtime.block_on(async move {
                    match tokio::net::TcpListener::from_std(listener) {
                        Ok(listener) => serve(listener, served, async { stop.await.unwrap_or(()) }).await,
                        Err(e) => tracing::error!("fake apiserver listener unusable: {e}"),
                    }
                });
            })
            .map_err(Error::Runtime)?;
        Ok(FakeApiServer { addr: bound, cluster, shutdown: Some(shutdown), thread: Some(thread) })
    }

    /// The address the server listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Base URL, e.g. `http://127.0.0.1:34567`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The served cluster, cloneable to hand to other threads.
    pub fn cluster(&self) -> &Cluster {
        &self.cluster
    }

    /// A kubeconfig pointing at this server.
    pub fn kubeconfig_yaml(&self) -> String {
        kubeconfig_yaml(&self.url())
    }

    /// Writes [`Self::kubeconfig_yaml`] to `path`.
    pub fn write_kubeconfig(&self, path: &Path) -> Result<(), Error> {
        write_file_atomically(path, &self.kubeconfig_yaml())
    }

    /// See [`Cluster::upsert`].
    pub fn upsert(&self, obj: Value) -> Result<Value, Error> {
        self.cluster.upsert(obj)
    }

    /// See [`Cluster::delete`].
    pub fn delete(&self, kind: &str, namespace: Option<&str>, name: &str) -> Option<Value> {
        self.cluster.delete(kind, namespace, name)
    }

    /// See [`Cluster::get`].
    pub fn get(&self, kind: &str, namespace: Option<&str>, name: &str) -> Option<Value> {
        self.cluster.get(kind, namespace, name)
    }

    /// See [`Cluster::compact`].
    pub fn compact(&self) {
        self.cluster.compact();
    }

    /// See [`Cluster::drop_watches`].
    pub fn drop_watches(&self) {
        self.cluster.drop_watches();
    }

    /// See [`Cluster::open_watches`].
    pub fn open_watches(&self, kind: &str) -> usize {
        self.cluster.open_watches(kind)
    }

    /// See [`Cluster::requests`].
    pub fn requests(&self) -> Vec<RequestRecord> {
        self.cluster.requests()
    }

    /// See [`Cluster::clear_requests`].
    pub fn clear_requests(&self) {
        self.cluster.clear_requests();
    }

    /// See [`Cluster::set_fault`].
    pub fn set_fault(&self, fault: Option<Fault>) {
        self.cluster.set_fault(fault);
    }
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

//! [`FakeApiServer`]: a fake server on its own thread and runtime, so plain `#[test]`s can use it, and its
//! [`Builder`].

use crate::auth::User;
use crate::cluster::{Cluster, Fault, RequestRecord, Throttle};
use crate::config::Config;
use crate::server::{serve_front_end, FrontEnd};
use crate::{write_file_atomically, Error};
use serde_json::Value;
use std::net::SocketAddr;
use std::path::Path;
use std::thread::JoinHandle;
use tokio::sync::oneshot;

/// Where a server listens.
#[derive(Debug)]
enum Listen {
    Addr(SocketAddr),
    Listener(std::net::TcpListener),
}

/// Configures a [`FakeApiServer`] before starting it: `FakeApiServer::builder().config(Config::strict())
/// .listener(l).start()`. Without calls: the lenient default [`Config`] on an ephemeral port of 127.0.0.1.
#[derive(Debug)]
pub struct Builder {
    config: Config,
    listen: Listen,
    objects: Vec<Value>,
    front_end: String,
}

impl Builder {
    /// Serves with `config` (see [`Config`] for every option and its default).
    pub fn config(mut self, config: Config) -> Builder {
        self.config = config;
        self
    }

    /// Binds `addr` (port 0 picks a free port).
    pub fn listen_on(mut self, addr: SocketAddr) -> Builder {
        self.listen = Listen::Addr(addr);
        self
    }

    /// Serves on an already bound listener, e.g. one created inside a test's "node" network namespace so
    /// that plugins running there reach the server on that namespace's loopback.
    pub fn listener(mut self, listener: std::net::TcpListener) -> Builder {
        self.listen = Listen::Listener(listener);
        self
    }

    /// Stores `objects` (as [`FakeApiServer::upsert`] would) before the first request is served: a server
    /// restarted from a backup comes back with its store, RBAC included, rather than refusing clients meanwhile.
    pub fn objects(mut self, objects: impl IntoIterator<Item = Value>) -> Builder {
        self.objects.extend(objects);
        self
    }

    /// Names this server's listener in [`Cluster::traffic`] (default: empty).
    pub fn front_end(mut self, name: &str) -> Builder {
        self.front_end = name.to_string();
        self
    }

    /// Binds, creates or loads the TLS material and keys, and starts serving on a thread of its own. The
    /// listen address (unless a wildcard) is added to the serving certificate's names.
    pub fn start(self) -> Result<FakeApiServer, Error> {
        let listener = match self.listen {
            Listen::Listener(l) => l,
            Listen::Addr(addr) => std::net::TcpListener::bind(addr).map_err(|source| Error::Bind { addr, source })?,
        };
        let wildcard = SocketAddr::from(([0, 0, 0, 0], 0));
        let bound = listener.local_addr().map_err(|source| Error::Bind { addr: wildcard, source })?;
        listener.set_nonblocking(true).map_err(|source| Error::Bind { addr: bound, source })?;
        let mut config = self.config;
        if !bound.ip().is_unspecified() {
            config.tls_sans.push(bound.ip().to_string());
        }
        let tls = config.tls;
        let cluster = Cluster::with_config(config)?;
        for object in self.objects {
            cluster.upsert(object)?;
        }
        let front_end = FrontEnd { name: self.front_end.into(), owns_watches: true };
        spawn(listener, bound, tls, cluster, front_end)
    }
}

/// Serves `cluster` on `listener` (bound to `bound`) as `front_end`, on a thread and runtime of its own.
fn spawn(
    listener: std::net::TcpListener,
    bound: SocketAddr,
    tls: bool,
    cluster: Cluster,
    front_end: FrontEnd,
) -> Result<FakeApiServer, Error> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(Error::Runtime)?;
    let (shutdown, stop) = oneshot::channel::<()>();
    let served = cluster.clone();
    let thread = std::thread::Builder::new()
        .name(format!("fake-apiserver-{}", bound.port()))
        .spawn(move || {
            runtime.block_on(async move {
                match tokio::net::TcpListener::from_std(listener) {
                    Ok(listener) => {
                        serve_front_end(listener, served, front_end, async { stop.await.unwrap_or(()) }).await
                    }
                    Err(e) => tracing::error!("fake apiserver listener unusable: {e}"),
                }
            });
        })
        .map_err(Error::Runtime)?;
    Ok(FakeApiServer { addr: bound, tls, cluster, shutdown: Some(shutdown), thread: Some(thread) })
}

/// A fake apiserver running on its own thread and runtime, so plain `#[test]`s can use it.
/// Dropping it stops the server and ends all open connections.
#[derive(Debug)]
pub struct FakeApiServer {
    addr: SocketAddr,
    tls: bool,
    cluster: Cluster,
    shutdown: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl FakeApiServer {
    /// A [`Builder`] with the lenient default configuration on an ephemeral port of 127.0.0.1.
    pub fn builder() -> Builder {
        Builder {
            config: Config::default(),
            listen: Listen::Addr(SocketAddr::from(([127, 0, 0, 1], 0))),
            objects: Vec::new(),
            front_end: String::new(),
        }
    }

    /// Starts an empty lenient server on an ephemeral port of 127.0.0.1.
    pub fn start() -> Result<FakeApiServer, Error> {
        FakeApiServer::builder().start()
    }

    /// Starts an empty lenient server on `addr` (port 0 picks a free port).
    pub fn start_on(addr: SocketAddr) -> Result<FakeApiServer, Error> {
        FakeApiServer::builder().listen_on(addr).start()
    }

    /// Serves leniently on an already bound listener (see [`Builder::listener`]).
    pub fn start_with_listener(listener: std::net::TcpListener) -> Result<FakeApiServer, Error> {
        FakeApiServer::builder().listener(listener).start()
    }

    /// One more listener for this server's cluster (same store, watches, tokens, request log and traffic
    /// counters), on a thread of its own and named `front_end` in [`Cluster::traffic`]: e.g. one in each of
    /// several test nodes' network namespaces, so every node reaches the one API server on its own loopback.
    /// The serving certificate names only the first listener's address and [`Config::tls_sans`], so bind the
    /// same address (in another namespace) for https. Dropping the returned server closes only this
    /// listener and its connections; watches served by the others go on.
    pub fn another_front_end(&self, listener: std::net::TcpListener, front_end: &str) -> Result<FakeApiServer, Error> {
        let wildcard = SocketAddr::from(([0, 0, 0, 0], 0));
        let bound = listener.local_addr().map_err(|source| Error::Bind { addr: wildcard, source })?;
        listener.set_nonblocking(true).map_err(|source| Error::Bind { addr: bound, source })?;
        let name = FrontEnd { name: front_end.into(), owns_watches: false };
        spawn(listener, bound, self.tls, self.cluster.clone(), name)
    }

    /// The address the server listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Base URL, e.g. `http://127.0.0.1:34567` (`https://` with TLS).
    pub fn url(&self) -> String {
        let scheme = if self.tls { "https" } else { "http" };
        format!("{scheme}://{}", self.addr)
    }

    /// The served cluster, cloneable to hand to other threads.
    pub fn cluster(&self) -> &Cluster {
        &self.cluster
    }

    /// PEM of the server's CA, `None` when serving plain http.
    pub fn ca_pem(&self) -> Option<String> {
        self.cluster.ca_pem().map(str::to_string)
    }

    /// A kubeconfig pointing at this server: with its CA when serving https, and the admin's token when
    /// tokens are checked (see [`Cluster::kubeconfig_token`]).
    pub fn kubeconfig_yaml(&self) -> String {
        self.cluster.kubeconfig(&self.url())
    }

    /// A kubeconfig pointing at this server that authenticates with `token`.
    pub fn kubeconfig_with_token(&self, token: &str) -> String {
        self.cluster.kubeconfig_with_token(&self.url(), token)
    }

    /// Writes [`Self::kubeconfig_yaml`] to `path`.
    pub fn write_kubeconfig(&self, path: &Path) -> Result<(), Error> {
        write_file_atomically(path, &self.kubeconfig_yaml())
    }

    /// See [`Cluster::service_account_token`].
    pub fn service_account_token(&self, namespace: &str, name: &str) -> String {
        self.cluster.service_account_token(namespace, name)
    }

    /// Rotates the tokens of service account `namespace/name`: see [`Cluster::rotate_token`].
    pub fn rotate_service_account_token(&self, namespace: &str, name: &str) -> Result<String, Error> {
        self.cluster.rotate_token(&User::service_account(namespace, name))
    }

    /// See [`Cluster::upsert`].
    pub fn upsert(&self, obj: Value) -> Result<Value, Error> {
        self.cluster.upsert(obj)
    }

    /// See [`Cluster::delete`].
    pub fn delete(&self, kind: &str, namespace: Option<&str>, name: &str) -> Option<Value> {
        self.cluster.delete(kind, namespace, name)
    }

    /// See [`Cluster::delete_gracefully`].
    pub fn delete_gracefully(
        &self,
        kind: &str,
        namespace: Option<&str>,
        name: &str,
        grace_period_seconds: Option<i64>,
    ) -> Option<Value> {
        self.cluster.delete_gracefully(kind, namespace, name, grace_period_seconds)
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

    /// See [`Cluster::traffic`].
    pub fn traffic(&self) -> Vec<crate::TrafficRecord> {
        self.cluster.traffic()
    }

    /// See [`Cluster::clear_traffic`].
    pub fn clear_traffic(&self) {
        self.cluster.clear_traffic();
    }

    /// See [`Cluster::set_fault`].
    pub fn set_fault(&self, fault: Option<Fault>) {
        self.cluster.set_fault(fault);
    }

    /// See [`Cluster::set_throttle`].
    pub fn set_throttle(&self, throttle: Option<Throttle>) {
        self.cluster.set_throttle(throttle);
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

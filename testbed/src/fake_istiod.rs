//! A fake istiod for real proxy processes: the scripted xDS server of `xds::testing` and the CA of
//! `mesh_ca::testing`, served from a tokio runtime of their own on listeners bound inside a network namespace (a
//! test node's, so the proxies running there and on linked nodes reach it), answering every proxy as istiod would.
//!
//! Guarantees:
//! - every Delta ADS stream (each proxy, each reconnect) gets, for each type it subscribes to, one first answer
//!   (possibly empty) holding the whole current set of that type, plus the removal of every name the client said
//!   it held (`initial_resource_versions`) that is no longer in the set; after that, every change the test makes
//!   ([`FakeControlPlane::set_workload`], [`FakeControlPlane::set_policy`], the removals) is pushed to every open
//!   stream as the upserts and removals that bring it to the current set;
//! - it tells how many open streams have applied a given version of the set (the client ACKed, or NACKed, every
//!   response that brought it there: [`FakeControlPlane::synced_streams`], [`FakeControlPlane::wait_synced`]), so a
//!   test can wait for the proxies to have a change instead of guessing;
//! - the CA signs a proxy's impersonated requests for the pods the test placed on the proxy's node
//!   ([`FakeControlPlane::add_node`] registers the proxy's token, its own pod and the trusted node account;
//!   [`FakeControlPlane::place_pod`] a pod), and refuses the others as istiod does;
//! - [`FakeControlPlane::stop`] closes both listeners and every open connection (istiod away);
//!   [`FakeControlPlane::start`] serves again on the same addresses with the same TLS certificates, so the proxies'
//!   roots still hold;
//! - a test thread never blocks on the runtime for longer than one short call; nothing here sleeps.
//!
//! The xDS server checks no token (the proxies of different nodes hold different ones); the CA checks each.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr, TcpListener};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use mesh_ca::testing::{Caller, FakeCa, FakeCaServer, Pod};
use tokio::sync::watch;
use xds::testing::{resource, FakeIstiod, FakeStream, ServingCert};
use xds::wire::security::{Authorization, StringMatch};
use xds::wire::workload::{address, Address, TunnelProtocol, Workload};
use xds::wire::{DeltaDiscoveryResponse, Resource, ResourceType};

use crate::NetnsGuard;

/// The mesh's trust domain.
pub const TRUST_DOMAIN: &str = "cluster.local";
/// The name both servers' certificates carry (`ALT_XDS_HOSTNAME`, `ALT_CA_HOSTNAME`).
pub const SERVER_NAME: &str = xds::testing::SERVER_NAME;
/// The namespace the node proxies run in.
pub const PROXY_NAMESPACE: &str = "istio-system";
/// The node proxies' service account: the node account the CA trusts to impersonate the node's pods.
pub const PROXY_SERVICE_ACCOUNT: &str = "ztunnel";
/// The cluster id the proxies are given, and their workloads' uids start with.
pub const CLUSTER_ID: &str = "Kubernetes";
/// The most resources one response carries (a large set goes out in several).
const RESOURCES_PER_RESPONSE: usize = 1000;

/// What istiod holds: every resource by type and name, with the version it was last set at.
#[derive(Default)]
struct Resources {
    version: u64,
    by_type: HashMap<ResourceType, BTreeMap<String, Resource>>,
    /// The version each type last changed at: a push skips the types a stream already has (no diff of 10,000
    /// workloads for a policy change).
    changed_at: HashMap<ResourceType, u64>,
}

/// State shared with the runtime's tasks.
struct Shared {
    resources: Mutex<Resources>,
    /// Bumped at every change; each stream pushes the difference.
    changed: watch::Sender<u64>,
    streams: Mutex<Streams>,
    /// Bumped whenever a stream opens, closes or gets further in sync.
    streams_changed: watch::Sender<u64>,
}

/// The ADS streams: how many were accepted, and each open one with the resources version its client has ACKed
/// everything up to (`None` until it has subscribed to both types and ACKed their first answers).
#[derive(Default)]
struct Streams {
    accepted: u64,
    open: BTreeMap<u64, Option<u64>>,
}

impl Shared {
    fn resources(&self) -> MutexGuard<'_, Resources> {
        self.resources.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn streams(&self) -> MutexGuard<'_, Streams> {
        self.streams.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The servers while they run: dropping them closes the listeners and every connection.
/// How long the streams' tasks may take to go once the servers are stopped.
const STOP_LIMIT: std::time::Duration = std::time::Duration::from_secs(10);

struct Running {
    xds: tokio::task::JoinHandle<()>,
    _ca: FakeCaServer,
}

impl Drop for Running {
    fn drop(&mut self) {
        self.xds.abort();
    }
}

/// The fake istiod; stopped on drop.
pub struct FakeControlPlane {
    runtime: Option<tokio::runtime::Runtime>,
    netns: std::path::PathBuf,
    reach_at: IpAddr,
    xds_port: u16,
    ca_port: u16,
    istiod_cert: ServingCert,
    ca: FakeCa,
    ca_tls_root: String,
    shared: Arc<Shared>,
    running: Option<Running>,
    trusted: bool,
}

impl Drop for FakeControlPlane {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            // Aborting the servers' tasks needs no runtime context; the runtime then goes without waiting for them.
            drop(self.running.take());
            runtime.shutdown_background();
        }
    }
}

impl FakeControlPlane {
    /// Starts both servers on ephemeral ports of every address of `netns` (a node's namespace); the proxies reach
    /// them at `reach_at` (an address of that namespace they can route to: the node's link address, or 127.0.0.1
    /// from the node itself).
    pub fn start_in(netns: &NetnsGuard, reach_at: IpAddr) -> Self {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("fake-istiod")
            .enable_all()
            .build()
            .expect("the fake istiod's runtime");
        let (changed, _) = watch::channel(0);
        let shared = Arc::new(Shared {
            resources: Mutex::default(),
            changed,
            streams: Mutex::default(),
            streams_changed: watch::channel(0).0,
        });
        let ca = FakeCa::new(TRUST_DOMAIN, mesh_ca::clock::Clock::System);
        let mut fake = FakeControlPlane {
            runtime: Some(runtime),
            netns: netns.path(),
            reach_at,
            xds_port: 0,
            ca_port: 0,
            istiod_cert: ServingCert::new(),
            ca,
            ca_tls_root: String::new(),
            shared,
            running: None,
            trusted: false,
        };
        fake.start();
        fake
    }

    fn runtime(&self) -> &tokio::runtime::Runtime {
        self.runtime.as_ref().expect("the runtime lives as long as the fake")
    }

    /// Binds `0.0.0.0:port` inside the fake's netns. A port given again is retried while in use: the listener of
    /// the previous start closes as its aborted task is dropped, on the runtime's threads.
    fn bind(&self, port: u16) -> TcpListener {
        let ns = netns::Netns::open(&self.netns).expect("open the fake istiod's netns");
        let bind = || ns.run(|| TcpListener::bind(SocketAddr::from(([0, 0, 0, 0], port)))).expect("enter the netns");
        if port == 0 {
            return bind().unwrap_or_else(|e| panic!("bind the fake istiod: {e}"));
        }
        crate::wait::eventually(&format!("the fake istiod's port {port} is free again"), || bind().ok())
    }

    /// (Re)starts serving on the same ports (ephemeral ones the first time). Starting a running fake changes nothing.
    pub fn start(&mut self) {
        if self.running.is_some() {
            return;
        }
        let (xds_listener, ca_listener) = (self.bind(self.xds_port), self.bind(self.ca_port));
        self.xds_port = xds_listener.local_addr().expect("xDS port").port();
        self.ca_port = ca_listener.local_addr().expect("CA port").port();
        let (cert, ca, shared) = (self.istiod_cert.clone(), self.ca.clone(), self.shared.clone());
        let (running, tls_root) = self.runtime().block_on(async move {
            let istiod = FakeIstiod::start_with(xds_listener, None, &cert).await;
            let ca_server = ca.serve_on(ca_listener).await;
            let tls_root = ca_server.tls_root_pem().to_owned();
            let xds = tokio::spawn(serve_streams(istiod, shared));
            (Running { xds, _ca: ca_server }, tls_root)
        });
        self.ca_tls_root = tls_root;
        self.running = Some(running);
    }

    /// Stops serving: both listeners close and every open connection is cut, as when istiod goes away. Returns once
    /// every stream's task is gone (aborting is asynchronous), so a change made after it reaches no proxy.
    pub fn stop(&mut self) {
        let mut changed = self.shared.streams_changed.subscribe();
        drop(self.running.take());
        let closed = async {
            while !self.shared.streams().open.is_empty() {
                if changed.changed().await.is_err() {
                    return;
                }
            }
        };
        let gone = self.runtime().block_on(async { tokio::time::timeout(STOP_LIMIT, closed).await.is_ok() });
        assert!(gone, "the fake istiod's streams were still open {STOP_LIMIT:?} after it stopped");
    }

    /// Whether the servers run.
    pub fn running(&self) -> bool {
        self.running.is_some()
    }

    /// The CA, to register callers and pods or read what it was asked.
    pub fn ca(&self) -> &FakeCa {
        &self.ca
    }

    /// The xDS address the proxies dial.
    pub fn xds_address(&self) -> SocketAddr {
        SocketAddr::new(self.reach_at, self.xds_port)
    }

    /// The CA address the proxies dial.
    pub fn ca_address(&self) -> SocketAddr {
        SocketAddr::new(self.reach_at, self.ca_port)
    }

    /// ADS streams accepted so far (every proxy's, every reconnect), and open now.
    pub fn streams(&self) -> (usize, usize) {
        let streams = self.shared.streams();
        (streams.accepted as usize, streams.open.len())
    }

    /// The version of the current resource set (bumped by every change).
    pub fn version(&self) -> u64 {
        self.shared.resources().version
    }

    /// How many open streams have been sent the resource set of `version` (or a later one) and ACKed (or NACKed)
    /// every response that carried it: the proxies that have applied it (a proxy ACKs after applying).
    pub fn synced_streams(&self, version: u64) -> usize {
        self.shared.streams().open.values().filter(|synced| synced.is_some_and(|v| v >= version)).count()
    }

    /// Waits (woken by each stream's progress, no polling) until at least `streams` open streams are synced to
    /// `version` ([`FakeControlPlane::synced_streams`]); whether they were within `limit`.
    pub fn wait_synced(&self, version: u64, streams: usize, limit: std::time::Duration) -> bool {
        let mut changed = self.shared.streams_changed.subscribe();
        let wait = async {
            while self.synced_streams(version) < streams {
                if changed.changed().await.is_err() {
                    return;
                }
            }
        };
        self.runtime().block_on(async { tokio::time::timeout(limit, wait).await.is_ok() })
            && self.synced_streams(version) >= streams
    }

    /// Registers a node proxy running as pod `proxy_pod` (namespace [`PROXY_NAMESPACE`], service account
    /// [`PROXY_SERVICE_ACCOUNT`]) on `node`, whose address is `node_ip`: the CA learns its token, its pod and that its
    /// account may impersonate the node's pods. Returns the proxy's environment (ztunnel's variables) for this fake.
    pub fn add_node(&mut self, node: &str, proxy_pod: &str, node_ip: IpAddr) -> Vec<(String, String)> {
        let token = format!("token-of-{proxy_pod}");
        let uid = format!("uid-of-{proxy_pod}");
        self.ca.add_caller(
            &token,
            Caller {
                namespace: PROXY_NAMESPACE.into(),
                service_account: PROXY_SERVICE_ACCOUNT.into(),
                pod_name: proxy_pod.into(),
                pod_uid: uid.clone(),
            },
        );
        self.ca.add_pod(Pod {
            namespace: PROXY_NAMESPACE.into(),
            name: proxy_pod.into(),
            uid,
            service_account: PROXY_SERVICE_ACCOUNT.into(),
            node: node.into(),
            failed: false,
        });
        if !self.trusted {
            self.ca.trust_node_account(PROXY_NAMESPACE, PROXY_SERVICE_ACCOUNT);
            self.trusted = true;
        }
        // The CA's endpoint root is also the mesh root peers chain to: the TLS root and the signing root, as one
        // bundle.
        let ca_roots = format!("{}\n{}", self.ca_tls_root.trim_end(), self.ca.root_pem());
        [
            ("CONTROL_PLANE", "istiod".to_owned()),
            ("XDS_ADDRESS", self.xds_address().to_string()),
            ("CA_ADDRESS", self.ca_address().to_string()),
            ("XDS_ROOT_CA", self.istiod_cert.ca_pem().to_owned()),
            ("CA_ROOT_CA", ca_roots),
            ("ALT_XDS_HOSTNAME", SERVER_NAME.to_owned()),
            ("ALT_CA_HOSTNAME", SERVER_NAME.to_owned()),
            ("AUTH_TOKEN", token),
            ("POD_NAME", proxy_pod.to_owned()),
            ("POD_NAMESPACE", PROXY_NAMESPACE.to_owned()),
            ("NODE_NAME", node.to_owned()),
            ("INSTANCE_IP", node_ip.to_string()),
            ("CLUSTER_ID", CLUSTER_ID.to_owned()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect()
    }

    /// Tells the CA pod `namespace/name` (service account `service_account`) runs on `node`, so that node's proxy
    /// may have its identity's certificate.
    pub fn place_pod(&self, namespace: &str, name: &str, service_account: &str, node: &str) {
        self.ca.add_pod(Pod {
            namespace: namespace.into(),
            name: name.into(),
            uid: format!("uid-of-{namespace}-{name}"),
            service_account: service_account.into(),
            node: node.into(),
            failed: false,
        });
    }

    /// Sets (adds or replaces) a workload, under its uid, and pushes it to every open stream.
    pub fn set_workload(&self, workload: Workload) {
        let name = workload.uid.clone();
        let address = Address { r#type: Some(address::Type::Workload(workload)) };
        self.set(ResourceType::Address, &name, |version| {
            resource(&name, version, ResourceType::Address.type_url(), &address)
        });
    }

    /// Sets many workloads at once (one push).
    pub fn set_workloads(&self, workloads: impl IntoIterator<Item = Workload>) {
        self.change(ResourceType::Address, |r| {
            for workload in workloads {
                let name = workload.uid.clone();
                let address = Address { r#type: Some(address::Type::Workload(workload)) };
                let version = r.version.to_string();
                let res = resource(&name, &version, ResourceType::Address.type_url(), &address);
                r.by_type.entry(ResourceType::Address).or_default().insert(name, res);
            }
        });
    }

    /// Sets (adds or replaces) an authorization policy, under `namespace/name`, and pushes it.
    pub fn set_policy(&self, policy: Authorization) {
        let name = format!("{}/{}", policy.namespace, policy.name);
        self.set(ResourceType::Authorization, &name, |version| {
            resource(&name, version, ResourceType::Authorization.type_url(), &policy)
        });
    }

    /// Removes a resource of type `ty` by name (a workload's uid, a policy's `namespace/name`) and pushes the
    /// removal.
    pub fn remove(&self, ty: ResourceType, name: &str) {
        self.change(ty, |r| {
            if let Some(set) = r.by_type.get_mut(&ty) {
                set.remove(name);
            }
        });
    }

    /// Removes every workload (one push).
    pub fn remove_all_workloads(&self) {
        self.change(ResourceType::Address, |r| {
            r.by_type.remove(&ResourceType::Address);
        });
    }

    fn set(&self, ty: ResourceType, name: &str, make: impl FnOnce(&str) -> Resource) {
        self.change(ty, |r| {
            let res = make(&r.version.to_string());
            r.by_type.entry(ty).or_default().insert(name.to_owned(), res);
        });
    }

    fn change(&self, ty: ResourceType, apply: impl FnOnce(&mut Resources)) {
        let version = {
            let mut r = self.shared.resources();
            r.version += 1;
            let version = r.version;
            r.changed_at.insert(ty, version);
            apply(&mut r);
            r.version
        };
        self.shared.changed.send_replace(version);
    }
}

/// A pod's workload as istiod sends it for an ambient pod (HBONE): uid `Kubernetes//Pod/<ns>/<name>`.
pub fn pod_workload(namespace: &str, name: &str, service_account: &str, ip: IpAddr, node: &str) -> Workload {
    let addresses = match ip {
        IpAddr::V4(v4) => v4.octets().to_vec(),
        IpAddr::V6(v6) => v6.octets().to_vec(),
    };
    Workload {
        uid: pod_uid(namespace, name),
        name: name.into(),
        namespace: namespace.into(),
        addresses: vec![addresses],
        tunnel_protocol: TunnelProtocol::Hbone as i32,
        service_account: service_account.into(),
        trust_domain: TRUST_DOMAIN.into(),
        node: node.into(),
        cluster_id: CLUSTER_ID.into(),
        workload_name: name.into(),
        ..Default::default()
    }
}

/// The uid istiod gives pod `namespace/name`.
pub fn pod_uid(namespace: &str, name: &str) -> String {
    format!("{CLUSTER_ID}//Pod/{namespace}/{name}")
}

/// An exact string match.
pub fn exact(value: &str) -> StringMatch {
    StringMatch { match_type: Some(xds::wire::security::string_match::MatchType::Exact(value.into())) }
}

/// Accepts streams until the server stops; each is served by [`serve_stream`].
async fn serve_streams(mut istiod: FakeIstiod, shared: Arc<Shared>) {
    let mut streams = tokio::task::JoinSet::new();
    while let Some(stream) = istiod.accept_stream().await {
        let id = {
            let mut s = shared.streams();
            s.accepted += 1;
            let id = s.accepted;
            s.open.insert(id, None);
            id
        };
        streams.spawn(serve_stream(id, stream, shared.clone()));
        while streams.try_join_next().is_some() {}
    }
}

/// Lists a stream as open while it lives.
struct Open(u64, Arc<Shared>);

impl Drop for Open {
    fn drop(&mut self) {
        self.1.streams().open.remove(&self.0);
        self.1.streams_changed.send_modify(|n| *n += 1);
    }
}

/// One ADS stream (number `id`): each type's first answer when the client subscribes, then every change; records
/// the version the client has ACKed everything up to.
async fn serve_stream(id: u64, mut stream: FakeStream, shared: Arc<Shared>) {
    let _open = Open(id, shared.clone());
    let mut changed = shared.changed.subscribe();
    // Per subscribed type: name -> version the client holds.
    let mut held: HashMap<ResourceType, Held> = HashMap::new();
    let mut nonce = 0u64;
    // Responses not answered yet, and the resources version the ones sent so far bring the client to.
    let mut outstanding: std::collections::HashSet<String> = Default::default();
    let mut version = 0u64;
    loop {
        tokio::select! {
            request = stream.next_request() => {
                let Some(request) = request else { return };
                let Some(ty) = ResourceType::from_type_url(&request.type_url) else { continue };
                if !request.response_nonce.is_empty() {
                    outstanding.remove(&request.response_nonce);
                } else if !held.contains_key(&ty) {
                    let names = request.initial_resource_versions.clone();
                    let client = held.entry(ty).or_insert(Held { names, seen: 0 });
                    let (at, sent) = push(&stream, &shared, ty, client, &mut nonce, true);
                    version = if held.len() == 1 { at } else { version.min(at) };
                    outstanding.extend(sent);
                }
            }
            result = changed.changed() => {
                if result.is_err() {
                    return;
                }
                let mut round = u64::MAX;
                for (ty, client) in &mut held {
                    let (at, sent) = push(&stream, &shared, *ty, client, &mut nonce, false);
                    round = round.min(at);
                    outstanding.extend(sent);
                }
                if round != u64::MAX {
                    version = round;
                }
            }
        }
        if held.len() == ResourceType::ALL.len() && outstanding.is_empty() {
            let before = shared.streams().open.insert(id, Some(version));
            if before != Some(Some(version)) {
                shared.streams_changed.send_modify(|n| *n += 1);
            }
        }
    }
}

/// What a stream's client holds of one type: name -> version, and the resources version it was last brought to.
struct Held {
    names: BTreeMap<String, String>,
    seen: u64,
}

/// Sends `client` what brings it to the current set of `ty` (always at least one response when `first`); returns
/// the resources version it was brought to and the nonces sent.
fn push(
    stream: &FakeStream,
    shared: &Shared,
    ty: ResourceType,
    client: &mut Held,
    nonce: &mut u64,
    first: bool,
) -> (u64, Vec<String>) {
    let (upserts, removed, version) = {
        let r = shared.resources();
        if !first && r.changed_at.get(&ty).is_none_or(|at| *at <= client.seen) {
            client.seen = r.version;
            return (r.version, Vec::new());
        }
        let empty = BTreeMap::new();
        let current = r.by_type.get(&ty).unwrap_or(&empty);
        let held = &client.names;
        let upserts: Vec<Resource> = current
            .iter()
            .filter(|(name, res)| held.get(*name) != Some(&res.version))
            .map(|(_, res)| res.clone())
            .collect();
        let removed: Vec<String> = held.keys().filter(|name| !current.contains_key(*name)).cloned().collect();
        (upserts, removed, r.version)
    };
    client.seen = version;
    if upserts.is_empty() && removed.is_empty() && !first {
        return (version, Vec::new());
    }
    for name in &removed {
        client.names.remove(name);
    }
    for res in &upserts {
        client.names.insert(res.name.clone(), res.version.clone());
    }
    let mut chunks: Vec<Vec<Resource>> = upserts.chunks(RESOURCES_PER_RESPONSE).map(<[Resource]>::to_vec).collect();
    if chunks.is_empty() {
        chunks.push(Vec::new());
    }
    let mut removed = Some(removed);
    let mut sent = Vec::new();
    for resources in chunks {
        *nonce += 1;
        sent.push(nonce.to_string());
        stream.send(DeltaDiscoveryResponse {
            type_url: ty.type_url().to_owned(),
            system_version_info: version.to_string(),
            nonce: nonce.to_string(),
            resources,
            removed_resources: removed.take().unwrap_or_default(),
        });
    }
    (version, sent)
}

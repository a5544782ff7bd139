//! "A fleet": several test nodes served by one fake API server, as the nodes of one cluster are, so a test or a
//! benchmark can run an agent and a proxy on each and count what each of them costs the API server.
//!
//! Guarantees: every node joined with [`Fleet::join`] is a [`Cluster`] (its own netns, bridge, pod subnet and
//! run dir) whose `api` is a front end of the fleet's one server, listening on the node's own loopback at the
//! same address as every other node (so one serving certificate and every kubeconfig fit every node): objects,
//! watches, resourceVersions, tokens, RBAC, the request log and the traffic counters are shared. The node's
//! CNI plugin reaches the server through a front end of its own, so [`fake_apiserver::Cluster::traffic`] tells
//! the plugin apart from the node agent, although both run as the istio-cni service account, as on a real node.
//! The server is as strict as [`crate::mesh::api_config`] but with a real server's watch timing
//! ([`fleet_config`]), so idle watches are not re-opened every few seconds as in the test clusters.

use std::path::Path;
use std::time::Duration;

use fake_apiserver::{Config, FakeApiServer, WatchConfig};
use tempfile::TempDir;

use crate::chart;
use crate::mesh::{chart_rbac, Cluster, RuleBackend};
use crate::node::Node;

/// The fleet server's configuration: [`Config::strict`] (https, tokens, RBAC, graceful deletion, the real
/// server's field selectors) with the real server's watch timing: no server-side cap below the client's own
/// `timeoutSeconds` (kube clients ask for 290 s), a bookmark every `bookmark_interval` (the real server's: a
/// minute), 75 s of history, with room for the tens of thousands of events a fleet's pods make.
pub fn fleet_config(state_dir: &Path, bookmark_interval: Duration) -> Config {
    let strict = Config::strict();
    Config {
        state_dir: Some(state_dir.to_path_buf()),
        watch: WatchConfig {
            min_timeout: None,
            bookmark_interval,
            history_events: 200_000,
            history_age: Some(Duration::from_secs(75)),
            ..strict.watch
        },
        ..strict
    }
}

/// The name of the front end a node's CNI plugin uses, in the fleet server's traffic counters.
pub fn plugin_front_end(node: &str) -> String {
    format!("{node}/plugin")
}

/// One fake API server and the state dir of its CA and keys; nodes join it with [`Fleet::join`].
pub struct Fleet {
    /// The server, listening on 127.0.0.1 of the namespace that started the fleet (front end `hub`).
    pub api: FakeApiServer,
    _state: TempDir,
}

impl Fleet {
    /// Starts the server ([`fleet_config`], a bookmark a minute) seeded with the chart's RBAC (ambient and the
    /// bundled proxy on).
    pub fn start() -> Fleet {
        Self::start_with_bookmarks(Duration::from_secs(60))
    }

    /// [`Fleet::start`] with a bookmark every `bookmark_interval` (a short one lets a quick run see bookmarks).
    pub fn start_with_bookmarks(bookmark_interval: Duration) -> Fleet {
        let state = tempfile::Builder::new().prefix("fleet-apiserver-").tempdir().expect("fleet state dir");
        let api = FakeApiServer::builder()
            .config(fleet_config(state.path(), bookmark_interval))
            .front_end("hub")
            .objects(chart_rbac(&[]))
            .start()
            .expect("start the fleet's API server");
        Fleet { api, _state: state }
    }

    /// A new node, `name` in the traffic counters, whose rules use `backend`: the API server on its loopback
    /// (front end `name`, for the node agent and the proxy) and a second front end for its CNI plugin
    /// ([`plugin_front_end`]), whose kubeconfig is in the run dir as install-cni leaves it.
    pub fn join(&self, name: &str, backend: RuleBackend) -> FleetNode {
        let node = Node::new();
        let port = self.api.addr().port();
        let ns = node.netns().open().expect("open node netns");
        let bind = |port: u16| {
            ns.run(|| std::net::TcpListener::bind(("127.0.0.1", port)))
                .expect("enter node netns")
                .expect("bind a front end of the fleet's API server")
        };
        let api = self.api.another_front_end(bind(port), name).expect("serve the node's front end");
        let plugin = self.api.another_front_end(bind(0), &plugin_front_end(name)).expect("serve the plugin's");
        let cluster = Cluster { node, api, plugin_overrides: backend.netconf() };
        std::fs::create_dir_all(cluster.run_dir()).expect("run dir");
        let token = cluster.token(chart::CNI_SERVICE_ACCOUNT);
        let kubeconfig = self.api.cluster().kubeconfig_with_token(&plugin.url(), &token);
        let path = cluster.run_dir().join(istio_contract::paths::KUBECONFIG_FILE);
        fake_apiserver::write_file_atomically(&path, &kubeconfig).expect("write the plugin's kubeconfig");
        FleetNode { cluster, _plugin_api: plugin }
    }
}

/// A node of a [`Fleet`]: its [`Cluster`] and the front end its CNI plugin uses (closed after the cluster).
pub struct FleetNode {
    /// The node, its runtime, and the fleet's API server on its loopback.
    pub cluster: Cluster,
    _plugin_api: FakeApiServer,
}

//! Connects to an istiod (or the grpc-go interop server, `interop/run.sh`) with the xds client and prints what it
//! is given, for `XDS_PROBE_SECONDS` (default 30). Settings are ztunnel's variables, resolved by
//! `xds::settings`: `XDS_ADDRESS`, `XDS_ROOT_CA`, `ALT_XDS_HOSTNAME`, `AUTH_TOKEN`, `XDS_HEADER_*`,
//! `ISTIO_META_CLUSTER_ID`, `POD_NAME`, `POD_NAMESPACE`, `NODE_NAME`, `INSTANCE_IP`, `ISTIO_META(JSON)_*`.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use xds::ads::{AdsClient, AdsConfig, Handler, Upsert};
use xds::channel::Channel;
use xds::settings::{self, Endpoint};
use xds::wire::ResourceType;

struct Print;

impl Handler for Print {
    fn apply(&mut self, ty: ResourceType, upserts: Vec<Upsert>, removals: Vec<String>) -> Vec<(String, String)> {
        let first = upserts.first().map(|u| u.name.as_str()).unwrap_or("-");
        println!("apply {ty:?}: {} upserts (first {first}), {} removals {removals:?}", upserts.len(), removals.len());
        Vec::new()
    }
}

#[tokio::main]
async fn main() {
    let vars: BTreeMap<String, String> = std::env::vars().collect();
    let filter = vars.get("RUST_LOG").cloned().unwrap_or_else(|| "info".into());
    tracing_subscriber::fmt().with_env_filter(filter).init();
    let config = settings::channel_config(Endpoint::Xds, &vars, Path::exists)
        .expect("xDS settings")
        .expect("XDS_ADDRESS is empty: xDS disabled");
    let channel = Channel::new(config).expect("channel configuration");
    let identity = settings::node_identity(&vars).expect("node settings");
    let (client, mut readiness) = AdsClient::new(channel, AdsConfig::new(identity.node()), Print);
    let seconds = vars.get("XDS_PROBE_SECONDS").and_then(|s| s.parse().ok()).unwrap_or(30);
    tokio::spawn(async move {
        readiness.wait().await;
        println!("ready");
    });
    client.run(tokio::time::sleep(Duration::from_secs(seconds))).await;
}

//! Connects to an istiod (or the grpc-go interop server, `interop/run.sh`) with the xds client and prints what it
//! is given, for `XDS_PROBE_SECONDS` (default 30). Settings as ztunnel names them: `XDS_ADDRESS`, `XDS_ROOT_CA`
//! (a PEM file), `ALT_XDS_HOSTNAME`, `AUTH_TOKEN` (a file if it exists, else the token), `ISTIO_META_CLUSTER_ID` (and every
//! `ISTIO_META_*`/`ISTIO_METAJSON_*`),
//! `POD_NAME`, `POD_NAMESPACE`, `NODE_NAME`, `INSTANCE_IP`.

use std::time::Duration;

use xds::ads::{AdsClient, AdsConfig, Handler, NodeIdentity, Upsert};
use xds::channel::{Channel, ChannelConfig, Roots, Token};
use xds::wire::ResourceType;

struct Print;

impl Handler for Print {
    fn apply(&mut self, ty: ResourceType, upserts: Vec<Upsert>, removals: Vec<String>) -> Vec<(String, String)> {
        let first = upserts.first().map(|u| u.name.as_str()).unwrap_or("-");
        println!("apply {ty:?}: {} upserts (first {first}), {} removals {removals:?}", upserts.len(), removals.len());
        Vec::new()
    }
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt().with_env_filter(env("RUST_LOG").unwrap_or_else(|| "info".into())).init();
    let address = env("XDS_ADDRESS").unwrap_or_else(|| "https://localhost:15012".into());
    let roots = Roots::File(env("XDS_ROOT_CA").unwrap_or_else(|| "/var/run/secrets/istio/root-cert.pem".into()).into());
    let mut config = ChannelConfig::new(address, roots);
    config.alt_hostname = env("ALT_XDS_HOSTNAME");
    config.token = match env("AUTH_TOKEN") {
        Some(t) if std::path::Path::new(&t).exists() => Token::File(t.into()),
        Some(t) => Token::Literal(t),
        None => Token::None,
    };
    config.cluster_id = env("ISTIO_META_CLUSTER_ID").unwrap_or_else(|| "Kubernetes".into());
    let channel = Channel::new(config).expect("channel configuration");
    let identity = NodeIdentity {
        instance_ip: env("INSTANCE_IP").and_then(|ip| ip.parse().ok()),
        instance_ips: env("INSTANCE_IP").and_then(|ip| ip.parse().ok()).into_iter().collect(),
        pod_name: env("POD_NAME").unwrap_or_else(|| "ztunnel-probe".into()),
        pod_namespace: env("POD_NAMESPACE").unwrap_or_else(|| "istio-system".into()),
        node_name: env("NODE_NAME").unwrap_or_default(),
        extra_metadata: Default::default(),
    }
    .with_istio_meta_env(std::env::vars())
    .with_istio_metajson_env(std::env::vars())
    .expect("ISTIO_METAJSON_* variables");
    let (client, mut readiness) = AdsClient::new(channel, AdsConfig::new(identity.node()), Print);
    let seconds = env("XDS_PROBE_SECONDS").and_then(|s| s.parse().ok()).unwrap_or(30);
    tokio::spawn(async move {
        readiness.wait().await;
        println!("ready");
    });
    client.run(tokio::time::sleep(Duration::from_secs(seconds))).await;
}

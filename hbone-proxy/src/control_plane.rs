//! `CONTROL_PLANE=istiod`: the proxy joins an Istio control plane as ztunnel does (issue #32). Workloads and
//! authorization policies come over Delta xDS (crate `xds`, applied by [`XdsSource`]); certificates from istiod's CA
//! (crate `mesh-ca`), one per local identity, fetched ahead and refreshed at half-life. Every setting is read from
//! ztunnel's variables (`XDS_ADDRESS`, `CA_ADDRESS`, `XDS_ROOT_CA`, `CA_ROOT_CA`, `AUTH_TOKEN`, `ALT_*_HOSTNAME`,
//! `*_HEADER_*`, `CLUSTER_ID`, `POD_NAME`, `POD_NAMESPACE`, `NODE_NAME`, `INSTANCE_IP`, `ISTIO_META_*`), as
//! [`crate::config::IstiodArgs::environment`] gathers them; the certificates' lifetime is the proxy's `SECRET_TTL`.
//!
//! Guarantees:
//! - start-up fails with an error naming the variable when a setting cannot be used (no address, no mesh root);
//! - the mesh trust roots (what peers' certificates must chain to) are the CA endpoint's root certificate, read
//!   once at start: the root istiod's chart publishes as `istio-ca-root-cert`;
//! - readiness (and so taking pods from the node agent) waits for istiod's first answer of both types, so no pod
//!   is served before its peers and policies are known (fail closed); after that, istiod being away leaves the last
//!   state in force (held certificates stay valid until they expire).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context as _};
use hbone::MeshTls;
use hbone_proxy::authorization::Policies;
use hbone_proxy::directory::xds_source::XdsSource;
use hbone_proxy::directory::Directory;
use mesh_ca::client::CaClient;
use mesh_ca::manager::{CertificateManager, ManagerConfig};
use xds::ads::{AdsClient, AdsConfig};
use xds::channel::{Channel, Roots};
use xds::settings::{self, Endpoint};

/// The certificate manager on istiod's CA (asking for leaves of lifetime `ttl`), and the mesh TLS policy of
/// `trust_domain` with istiod's mesh root.
pub fn certificates(
    env: &BTreeMap<String, String>,
    trust_domain: &str,
    ttl: std::time::Duration,
) -> anyhow::Result<(CertificateManager, MeshTls)> {
    let Some(channel) = settings::channel_config(Endpoint::Ca, env, Path::exists).map_err(anyhow::Error::msg)? else {
        bail!("CA_ADDRESS is empty: CONTROL_PLANE=istiod takes its certificates from istiod's CA");
    };
    let roots = match &channel.roots {
        Roots::File(path) => hbone::ca::read_certs(path).context("the mesh root certificate (CA_ROOT_CA)")?,
        Roots::Pem(pem) => {
            hbone::ca::parse_certs(pem, Path::new("CA_ROOT_CA")).context("the mesh root certificate (CA_ROOT_CA)")?
        }
        Roots::System => bail!("CA_ROOT_CA=SYSTEM: the mesh root certificate is needed to verify peers"),
    };
    let settings = mesh_ca::client::RequestSettings { ttl, ..Default::default() };
    tracing::info!(address = %channel.address, ttl = ?settings.ttl, "certificates from istiod's CA");
    let tls = MeshTls::new(trust_domain, &roots).context("mesh TLS policy on istiod's root")?;
    let client = CaClient::new(channel, settings).context("istiod's CA channel")?;
    Ok((CertificateManager::new(Arc::new(client), ManagerConfig::default()), tls))
}

/// Starts the xDS client that keeps `directory` and `policies` as istiod says; `ready` is sent once istiod's first
/// answer of both types has been applied.
pub fn watch(
    env: &BTreeMap<String, String>,
    directory: Directory,
    policies: Policies,
    ready: tokio::sync::oneshot::Sender<()>,
) -> anyhow::Result<()> {
    let Some(channel) = settings::channel_config(Endpoint::Xds, env, Path::exists).map_err(anyhow::Error::msg)? else {
        bail!("XDS_ADDRESS is empty: CONTROL_PLANE=istiod takes its workloads from istiod");
    };
    let node = settings::node_identity(env).map_err(anyhow::Error::msg)?;
    tracing::info!(address = %channel.address, node_id = %node.node_id(), "workloads and policies from istiod");
    let channel = Channel::new(channel).context("istiod's xDS channel")?;
    let (client, mut readiness) =
        AdsClient::new(channel, AdsConfig::new(node.node()), XdsSource::new(directory, policies));
    tokio::spawn(client.run(std::future::pending()));
    tokio::spawn(async move {
        readiness.wait().await;
        let _ = ready.send(());
    });
    Ok(())
}

//! `hbone-proxy`: the bundled HBONE node proxy. Takes each enrolled pod's netns from the node agent over
//! ZDS, listens inside the pod (15001, 15006, 15008, DNS on 15053) and carries mesh traffic over HBONE.

mod admin;
mod config;
mod context;
mod directory;
mod dns;
mod endpoints;
mod inbound;
mod mesh;
mod metrics;
mod outbound;
mod pod;
mod sockets;
mod workloads;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};

use anyhow::Context;
use daemon::drain::{Drain, DrainMode};
use daemon::probes::ProbeState;
use hbone::{MeshCa, MeshTls};

use crate::config::Config;
use crate::directory::Directory;
use crate::mesh::Mesh;
use crate::workloads::Workloads;

/// The host's resolver configuration: the DNS upstreams when `DNS_UPSTREAMS` is not set.
const RESOLV_CONF: &str = "/etc/resolv.conf";

fn main() -> anyhow::Result<()> {
    let config = Config::from_env_and_args();
    config.common.init_logging();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting tokio")?;
    runtime.block_on(run(config))
}

async fn run(config: Config) -> anyhow::Result<()> {
    let ca = match &config.ca_dir {
        Some(dir) => MeshCa::load(dir).context("loading the mesh CA")?,
        None => MeshCa::load_or_create(&config.state_dir, &config.trust_domain).context("self-signed mesh CA")?,
    }
    .with_leaf_lifetime(config.secret_ttl);
    let tls = MeshTls::new(&config.trust_domain, ca.roots()).context("mesh TLS policy")?;
    let directory = Directory::new(&config.trust_domain);
    // Kept alive for the life of the process: dropping it stops the reloads.
    let _local_watch = match &config.local_workloads {
        Some(path) => Some(directory::local_file::watch(path, directory.clone())?),
        None => None,
    };
    if config.kube_workloads {
        // In the background: an unreachable API must not hold up the pods' proxies.
        tokio::spawn(directory::kube_source::watch_inferred(directory.clone()));
    }
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = metrics::Metrics::register(&mut registry);
    let probes = ProbeState::new(Arc::new(Mutex::new(registry)));
    for port in [config.common.readiness_port, config.common.monitoring_port] {
        let addr = SocketAddr::new(config.common.listen_address, port);
        endpoints::serve(addr, probes.clone()).await.with_context(|| format!("binding {addr}"))?;
    }
    let dns = dns::Upstreams::new(&config.dns_upstreams, Path::new(RESOLV_CONF)).context("DNS upstreams")?;
    tracing::info!(upstreams = ?dns.addrs(), "DNS forwarder upstreams");
    let (drain, watcher) = Drain::new();
    let deadline = config.termination_deadline;
    let mesh = Arc::new(Mesh {
        ca,
        tls,
        directory,
        dns,
        metrics,
        drain: watcher,
        termination_deadline: deadline,
        mtls_mode: config.mtls_mode,
    });
    tracing::info!(mode = ?config.mtls_mode, secret_ttl = ?config.secret_ttl, "mesh policy");
    let workloads = Workloads::new(mesh, probes);
    admin::serve(config.admin_port, workloads.view())
        .await
        .with_context(|| format!("binding the admin port 127.0.0.1:{}", config.admin_port))?;
    let shutdown = daemon::signals::shutdown_signal()?;
    tokio::select! {
        () = workloads.run(&config.inpod_uds) => {}
        signal = shutdown => tracing::info!(?signal, ?deadline, "shutting down: draining connections"),
    }
    drop(workloads);
    // Dropping the workloads closed every listener and sent GOAWAY on the inbound HBONE connections; open
    // connections may finish until the deadline, and are cut when the process exits.
    drain.start(DrainMode::Graceful);
    match tokio::time::timeout(deadline, drain.drained()).await {
        Ok(()) => tracing::info!("all connections finished"),
        Err(_) => tracing::warn!(?deadline, "connections still open at the termination deadline: closing them"),
    }
    Ok(())
}

//! `hbone-proxy`: the bundled HBONE node proxy. Takes each enrolled pod's netns from the node agent over
//! ZDS, listens inside the pod (15001, 15006, 15008, DNS on 15053) and carries mesh traffic over HBONE.

mod admin;
mod config;
mod control_plane;
mod dns;
mod fast_path;
mod heap;
mod inbound;
mod memory;
mod mesh;
mod metrics;
mod outbound;
mod pod;
mod ratelimit;
mod refusal;
mod sockets;
mod splice;
mod traffic;
mod workloads;

use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context as _;
use daemon::lifecycle::Context;
use hbone::{MeshCa, MeshTls};
// The workload directory lives in the library (the fuzz targets build its parser too); `crate::directory` is it.
use hbone_proxy::directory;

use crate::config::{Config, ControlPlane};
use crate::directory::Directory;
use crate::mesh::{Certificates, Mesh};
use crate::workloads::Workloads;
use hbone_proxy::authorization::Policies;

/// The host's resolver configuration: the DNS upstreams when `DNS_UPSTREAMS` is not set.
const RESOLV_CONF: &str = "/etc/resolv.conf";

fn main() -> ExitCode {
    daemon::lifecycle::main(run)
}

async fn run(config: Config, ctx: Context) -> anyhow::Result<()> {
    if let Err(param) = heap::keep_transfer_buffers() {
        tracing::warn!(param, "glibc refused a heap threshold; bulk transfers fault their buffers in afresh");
    }
    let directory = Directory::new(&config.trust_domain);
    let policies = Policies::default();
    // Kept alive for the life of the process: dropping it stops the reloads.
    let _local_watch = match &config.local_workloads {
        Some(path) => Some(directory::local_file::watch(path, directory.clone())?),
        None => None,
    };
    let (listed_tx, listed) = tokio::sync::oneshot::channel();
    let (certificates, tls, source) = match config.control_plane {
        ControlPlane::Local => {
            let ca = match &config.ca_dir {
                Some(dir) => MeshCa::load(dir).context("loading the mesh CA")?,
                None => {
                    MeshCa::load_or_create(&config.state_dir, &config.trust_domain).context("self-signed mesh CA")?
                }
            }
            .with_leaf_lifetime(config.secret_ttl);
            let tls = MeshTls::new(&config.trust_domain, ca.roots()).context("mesh TLS policy")?;
            if config.kube_workloads {
                tokio::spawn(directory::kube_source::watch_inferred(directory.clone(), listed_tx));
            } else {
                let _ = listed_tx.send(());
            }
            (
                Certificates::Local(Arc::new(ca)),
                tls,
                ("kubernetes", "waiting for the first list of pods from the API server"),
            )
        }
        ControlPlane::Istiod => {
            let env = config.istiod.environment();
            let (manager, tls) = control_plane::certificates(&env, &config.trust_domain, config.secret_ttl)?;
            control_plane::watch(&env, directory.clone(), policies.clone(), listed_tx)?;
            (Certificates::Istiod(manager), tls, ("istiod", "waiting for istiod's first workloads and policies"))
        }
    };
    let metrics = ctx.probes.with_registry(metrics::Metrics::register);
    let buffers = memory::budget(config.buffer_budget_mib, config.buffer_budget_per_pod_mib);
    ctx.probes.with_registry(|registry| memory::register(registry, &buffers));
    tokio::spawn(heap::give_back_after_bursts({
        let buffers = buffers.clone();
        move || buffers.held()
    }));
    let dns = dns::upstreams::Upstreams::new(&config.dns_upstreams, Path::new(RESOLV_CONF)).context("DNS upstreams")?;
    tracing::info!(upstreams = ?dns.addrs(), "DNS forwarder upstreams");
    let deadline = config.common.termination_deadline;
    let mesh = Arc::new(Mesh {
        certificates,
        policies,
        tls,
        directory,
        dns,
        metrics,
        cluster_id: config.cluster_id.clone(),
        drain: ctx.drain.clone(),
        termination_deadline: deadline,
        mtls_mode: config.mtls_mode,
        hbone: mesh::InboundHbone::new(&config),
        same_node_fast_path: config.same_node_fast_path,
        buffers,
        local_pods: mesh::LocalPods::default(),
    });
    tracing::info!(
        control_plane = ?config.control_plane,
        mode = ?config.mtls_mode,
        secret_ttl = ?config.secret_ttl,
        same_node_fast_path = config.same_node_fast_path,
        buffer_budget_mib = config.buffer_budget_mib,
        buffer_budget_per_pod_mib = config.buffer_budget_per_pod_mib,
        "mesh policy"
    );
    let workloads = Workloads::new(mesh, &ctx.probes);
    admin::serve(config.admin_port, workloads.view(), ctx.drain)
        .await
        .with_context(|| format!("the admin port 127.0.0.1:{}", config.admin_port))?;
    // From here on, the workloads' own blocker tells readiness.
    ctx.startup.clear();
    // Fail closed: until the workloads are listed (pods from the API server, or istiod's first answer), a mesh
    // destination would look like one outside the mesh and its traffic would leave in plaintext. So no pod is taken
    // from the agent before then: their outbound connections find no listener (refused), and the agent's ADDs wait
    // for a proxy, as when none runs.
    let waiting = ctx.probes.blocker(source.0, source.1);
    let mut shutdown = std::pin::pin!(ctx.shutdown);
    tokio::select! {
        _ = listed => {}
        signal = &mut shutdown => {
            tracing::info!(?signal, "shutting down before the pods were listed");
            return Ok(());
        }
    }
    waiting.clear();
    tokio::select! {
        () = workloads.run(&config.inpod_uds) => {}
        signal = shutdown => tracing::info!(?signal, ?deadline, "shutting down: draining connections"),
    }
    // Dropping the workloads closes every listener and sends GOAWAY on the inbound HBONE connections; open
    // connections may finish until the deadline (the shared main's drain), and are cut when the process exits.
    drop(workloads);
    Ok(())
}

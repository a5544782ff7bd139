//! `node-agent`: enrolls ambient pods on this node and streams their network namespaces to the node proxy; its
//! repair controller also repairs (in place), labels or deletes sidecar pods that started before the plugin was ready.
//!
//! `node-agent explain ...` is the operator's subcommand: it asks the running agent, on its admin port, why a pod
//! is or is not in the mesh (see [`explain`]).

mod admin;
mod admin_api;
mod ambient_state;
mod cache;
mod config;
mod drift;
mod enroll;
mod event_server;
mod explain;
mod metrics;
mod node_pods;
mod plugin_logs;
mod plugin_socket;
mod pod;
mod pod_gate;
mod pod_lookup;
mod probe_selftest;
mod repair;
mod timeline;
mod watch;

use std::net::{Ipv4Addr, SocketAddr};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use daemon::lifecycle::Context;
use redirect::backend::Backend;
use redirect::hostprobe::{find_kubelet_uid, HostProbe, HostProbeConfig};
use zds::server::{ServerConfig, ZdsServer};

use crate::ambient_state::AmbientState;
use crate::cache::PodCache;
use crate::config::Config;
use crate::enroll::Enroller;
use crate::metrics::Metrics;
use crate::node_pods::NodePods;
use crate::pod_lookup::PodLookup;

fn main() -> ExitCode {
    // The subcommand first: the daemon's flags and env are not its own.
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if args.get(1).is_some_and(|a| a == "explain") {
        return explain::cli::main(&args[2..]);
    }
    daemon::lifecycle::main(run)
}

async fn run(config: Config, ctx: Context) -> anyhow::Result<()> {
    let Context { probes, startup, drain, shutdown } = ctx;
    if let Some(port) = config.install_cni_metrics_port {
        probes.append_metrics_from(SocketAddr::from((Ipv4Addr::LOCALHOST, port)));
        tracing::info!(port, "serving install-cni's metrics after ours");
    }
    let selectors = config.selectors().context("AMBIENT_ENABLEMENT_SELECTOR")?;
    let metrics = probes.with_registry(Metrics::register);
    let mut kube_config = kube::Config::infer().await.context("Kubernetes client configuration")?;
    // Named in the API server's audit log, apart from the plugin (the same service account).
    if let (Ok(name), Ok(value)) =
        ("user-agent".try_into(), concat!("node-agent/", env!("CARGO_PKG_VERSION")).try_into())
    {
        kube_config.headers.push((name, value));
    }
    let client = kube::Client::try_from(kube_config).context("Kubernetes client")?;
    // Ambient pods and in-place repairs of sidecar pods get their rules from the same backend.
    let backend = if config.ambient_enabled || repair::repairs_in_place(&config.repair) {
        Some(select_backend(&config).await?)
    } else {
        None
    };
    // One watch of this node's pods feeds the repair controller and enrollment: both subscribe before it runs.
    let mut pods = NodePods::new(client.clone(), &config.node_name);
    if let Some(repair) = repair::start(client.clone(), &config, metrics.clone(), backend, &mut pods) {
        tokio::spawn(repair);
    }
    let enrollment = config.ambient_enabled.then(|| pods.subscribe());
    // The plugin's pod source, in every mode: its ADD asks the agent instead of the API.
    let pod_store = pods.lookups();
    let explained_pods = pod_store.store.clone();
    let drift_pods = pod_store.store.clone();
    tokio::spawn(pods.run());
    let host_netns = match &config.host_netns {
        Some(path) => netns::Netns::open(path).with_context(|| format!("HOST_NETNS {}", path.display()))?,
        None => netns::Netns::current()?,
    };
    let event_checks = event_server::EventChecks::new(&config, &host_netns).context("plugin event checks")?;
    let (Some(backend), Some(pod_events)) = (backend.filter(|_| config.ambient_enabled), enrollment) else {
        // Sidecar-only installs run the agent for the repair controller and as the plugin's pod source: no ambient
        // rules, host probe or ZDS socket.
        tracing::info!("ambient disabled: the repair controller runs, and the plugin's pod lookups are served");
        // Sidecar pods' rules are checked for drift here too (their netns found through the host /proc), with the
        // repair controller's backend or one selected for the check; a node where none can be selected runs without.
        let drift_backend = if config.drift_check_interval.is_zero() {
            None
        } else if !config.host_proc.is_dir() {
            let host_proc = config.host_proc.display();
            tracing::info!(%host_proc, "no host /proc: sidecar pods' rules are not checked for drift");
            None
        } else if backend.is_some() {
            backend
        } else {
            select_backend(&config)
                .await
                .inspect_err(
                    |e| tracing::warn!(error = %format!("{e:#}"), "sidecar pods' rules are not checked for drift"),
                )
                .ok()
        };
        let drift = drift_backend.map(|b| drift::Drift::new(&config, b, None, drift_pods, metrics.clone()));
        let explained_backend = drift_backend.or(backend);
        let mut explainer =
            explain::build::Explainer::new(&config, selectors, explained_pods, None, None, explained_backend);
        if let Some(drift) = &drift {
            explainer = explainer.with_drift(drift.clone());
        }
        admin::serve(config.admin_port, Arc::new(explainer), drain.clone()).await;
        match event_server::bind(&config.cni_agent_run_dir) {
            Ok((listener, socket)) => {
                tracing::info!(socket = %socket.display(), "serving the plugin's pod lookups");
                let lookup = PodLookup::new(pod_store, None, metrics.clone());
                tokio::spawn(event_server::serve(listener, None, lookup, client, metrics, event_checks, drain.clone()));
            }
            // Only a fast path: the plugin looks pods up in the API when the socket is missing.
            Err(e) => {
                tracing::warn!(error = %format!("{e:#}"), "cannot serve the plugin's pod lookups; the plugin asks the API")
            }
        }
        drop(drain);
        startup.clear();
        if let Some(drift) = drift {
            tokio::spawn(drift.run());
        }
        let sig = shutdown.await;
        tracing::info!(signal = ?sig, "shutting down");
        return Ok(());
    };
    let mut probe_config = HostProbeConfig {
        enable_ipv6: config.ambient_ipv6,
        snat_v4: config.host_probe_snat_ip,
        snat_v6: config.host_probe_snat_ipv6,
        ..HostProbeConfig::default()
    };
    if matches!(backend, Backend::Nftables) {
        // Istio's nftables rule SNATs only the kubelet's sockets (`meta skuid`): without the kubelet's uid there is
        // no rule to program, and guessing one (root) would SNAT the wrong sockets and fail the real probes.
        let proc = config.host_proc.clone();
        let uid = tokio::task::spawn_blocking(move || find_kubelet_uid(&proc))
            .await
            .context("kubelet lookup task")?
            .context("NATIVE_NFTABLES: the host probe rule matches the kubelet's uid, which was not found")?;
        tracing::info!(uid, "host probe rule matches the kubelet's uid");
        probe_config.kubelet_uid = uid;
    }
    // The self-test connects from the host netns as the kubelet would: as its uid where the rule matches it.
    let selftest_path = probe_selftest::ProbePath {
        snat_v4: probe_config.snat_v4,
        snat_v6: probe_config.snat_v6,
        ipv6: probe_config.enable_ipv6,
        uid: matches!(backend, Backend::Nftables).then_some(probe_config.kubelet_uid),
    };
    let selftest_host = netns::Netns::from_fd(host_netns.try_clone_fd().context("HOST_NETNS fd")?, host_netns.path())
        .context("HOST_NETNS")?;
    let hostprobe = tokio::task::spawn_blocking(move || HostProbe::ensure(host_netns, backend, probe_config))
        .await
        .context("host probe task")?
        .context("host probe SNAT rules")?;
    let zds = ZdsServer::bind(&config.ztunnel_uds_address, ServerConfig::default())
        .await
        .with_context(|| format!("ZDS socket {}", config.ztunnel_uds_address.display()))?;
    let cache = PodCache::default();
    let selftest_cache = cache.clone();
    // What the agent holds of its ambient pods: enrollment writes it, drift and explain read it.
    let ambient = Arc::new(AmbientState::new(&config, backend, cache.clone(), hostprobe, metrics.clone()));
    let enroller = Enroller::new(config.clone(), client.clone(), zds.handle(), ambient.clone(), metrics.clone());
    // Re-checks the enrolled pods' rules and the host probe rule, and repairs drift (see `drift`); started below.
    let drift = drift::Drift::new(&config, backend, Some(ambient.clone()), drift_pods, metrics.clone());

    // Caches first, then the pods enrolled before a restart, and only then the proxy and the plugin.
    let (synced_tx, synced_rx) = tokio::sync::oneshot::channel();
    let (namespaces, namespace_writer) = kube::runtime::reflector::store();
    // Served from here on, so explain can tell why a pod waits while the caches sync.
    let explainer = explain::build::Explainer::new(
        &config,
        selectors.clone(),
        explained_pods,
        Some(namespaces.clone()),
        Some(ambient),
        Some(backend),
    )
    .with_drift(drift.clone());
    admin::serve(config.admin_port, Arc::new(explainer), drain.clone()).await;
    let sources = watch::Sources { pods: pod_events, client: client.clone(), namespace_store: namespace_writer };
    tokio::spawn(watch::run(sources, config.clone(), selectors, enroller.clone(), metrics.clone(), synced_tx));
    startup.block("waiting for this node's pods to be listed and the pods enrolled before a restart to be found");
    synced_rx.await.context("pod watcher ended before syncing")?;

    let zds_handle = zds.handle();
    let zds_drain = drain.clone();
    tokio::spawn(zds.serve(Arc::new(cache), async move {
        zds_drain.signaled().await;
    }));
    let (listener, socket) = event_server::bind(&config.cni_agent_run_dir).context("plugin event socket")?;
    let logs = plugin_logs::bind(&config.cni_agent_run_dir).context("plugin log socket")?;
    tokio::spawn(plugin_logs::serve(logs, drain.clone()));
    tracing::info!(socket = %socket.display(), "serving plugin events");
    let ambient = event_server::Ambient { enroller, selectors: config.selectors()?, excluded: config.excluded() };
    let lookup = PodLookup::new(pod_store, Some(namespaces), metrics.clone());
    tokio::spawn(event_server::serve(
        listener,
        Some(ambient),
        lookup,
        client,
        metrics.clone(),
        event_checks,
        drain.clone(),
    ));
    drop(drain);
    startup.clear();
    // A failed probe self-test asks for a drift check at once: a missing host probe rule is put back right away.
    let selftest_drift = drift.clone();
    tokio::spawn(drift.run());
    if config.probe_selftest_interval.is_zero() {
        tracing::info!("host probe self-test off (PROBE_SELFTEST_INTERVAL=0s)");
    } else {
        let interval = config.probe_selftest_interval;
        let selftest = probe_selftest::SelfTest::new(
            selftest_host,
            selftest_cache,
            selftest_path,
            interval,
            metrics.clone(),
            probes,
        )
        .on_failure(move || selftest_drift.check_now());
        tokio::spawn(selftest.run());
    }

    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            sig = &mut shutdown => {
                tracing::info!(signal = ?sig, "shutting down; in-pod rules stay in place");
                break;
            }
            _ = tick.tick() => {
                metrics.ztunnel_connected.set(zds_handle.connected() as i64);
            }
        }
    }
    // The shared main turns the agent unready and drains the socket servers (bounded by
    // CONNECTION_TERMINATION_DEADLINE).
    Ok(())
}

/// The in-pod rules backend (`NATIVE_NFTABLES`, `FORCE_IPTABLES_BINARY`, or detected from the host's tables).
async fn select_backend(config: &Config) -> anyhow::Result<Backend> {
    // Detection runs the iptables binaries and lists tables: blocking work, off the async workers.
    let (native, force) = (config.native_nftables, config.force_iptables_binary.clone());
    tokio::task::spawn_blocking(move || {
        let backend = Backend::select(native, force.as_deref())?;
        tracing::info!(%backend, "in-pod rules backend");
        redirect::backend::warn_if_mixed(backend);
        anyhow::Ok(backend)
    })
    .await
    .context("rule backend selection task")?
}

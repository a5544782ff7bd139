//! One function per CNI command. Each returns the stdout payload (if any) or a CNI error.

use std::collections::HashMap;
use std::net::IpAddr;

use cni::plugin_event::{CmdAdd, PodSetupAnswer};
use cni::{CniError, Command, ErrorCode, Invocation, Version, SUPPORTED_VERSIONS};
use netns::Netns;
use redirect::backend::Backend;
use redirect::iptables::IptablesError;
use serde_json::json;

use crate::config::PluginConf;
use crate::k8s::{self, ApiServer};
use istio_contract::pod::PodInfo;
use istio_contract::sidecar::{self, Decision};

use crate::agent::{self, SetupError};
use crate::{ambient, logging};

/// Name prefix of the istio-cni DaemonSet's pods, which must never wait on themselves.
const OWN_POD_PREFIX: &str = "istio-cni-node-";

/// When the process's `main` began: the ADD's log line says how long the plugin's own part took.
pub static STARTED: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();

/// Milliseconds since `since`, for a log field.
fn ms_since(since: std::time::Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}

/// Runs the command named by the environment.
pub fn run(env: &HashMap<String, String>, stdin: Vec<u8>) -> Result<Option<String>, CniError> {
    let inv = Invocation::from_env(env)?;
    if inv.command == Command::Version {
        return Ok(Some(version_reply(&stdin)));
    }
    let conf = PluginConf::parse(&stdin)?;
    let version = conf.version()?;
    logging::init(conf.log_level(), &conf.run_dir());
    let span = tracing::info_span!(
        "cni",
        command = ?inv.command,
        container = %inv.container_id,
        namespace = inv.args.pod_namespace().unwrap_or_default(),
        pod = inv.args.pod_name().unwrap_or_default(),
        uid = inv.args.pod_uid().unwrap_or_default(),
    );
    let _guard = span.enter();
    tracing::debug!(
        network = %conf.name,
        ambient = conf.ambient_enabled,
        ambient_detection_retry = conf.enable_ambient_detection_retry,
        native_nftables = conf.native_nftables,
        selectors = ?conf.enablement_selectors,
        bin_dir = ?conf.kubernetes.as_ref().and_then(|k| k.cni_bin_dir.as_deref()),
        "netconf"
    );
    let needs = |min: Version| {
        if version < min {
            Err(CniError::new(
                ErrorCode::IncompatibleVersion,
                format!("{:?} needs cniVersion {min} or later, got {version}", inv.command),
            ))
        } else {
            Ok(())
        }
    };
    match inv.command {
        Command::Add => add(&inv, &conf, version, env).map(Some),
        Command::Del => {
            // Sidecar rules live in the pod netns and vanish with it; there is nothing to undo.
            tracing::debug!("DEL: nothing to clean up");
            Ok(None)
        }
        Command::Check => {
            needs(Version(0, 4, 0))?;
            check(&inv, &conf, version).map(|_| None)
        }
        Command::Status => {
            needs(Version(1, 1, 0))?;
            status(&conf).map(|_| None)
        }
        Command::Gc => {
            needs(Version(1, 1, 0))?;
            // The plugin keeps no per-attachment state (no files, no IPAM, no host rules), so GC has nothing to
            // collect; tests prove that ADD leaves nothing behind outside the pod netns but the log file.
            tracing::debug!(valid = conf.valid_attachments.as_ref().map_or(0, Vec::len), "GC: no state kept");
            Ok(None)
        }
        Command::Version => unreachable!("handled above"),
    }
}

fn version_reply(stdin: &[u8]) -> String {
    let asked = serde_json::from_slice::<serde_json::Value>(stdin)
        .ok()
        .and_then(|v| v.get("cniVersion")?.as_str().map(String::from))
        .filter(|v| Version::supported(v).is_ok())
        .unwrap_or_else(|| Version::LATEST.to_string());
    json!({ "cniVersion": asked, "supportedVersions": SUPPORTED_VERSIONS }).to_string()
}

fn internal(e: impl std::fmt::Display) -> CniError {
    CniError::new(ErrorCode::Internal, e.to_string())
}

fn add(
    inv: &Invocation,
    conf: &PluginConf,
    version: Version,
    env: &HashMap<String, String>,
) -> Result<String, CniError> {
    let result = match &conf.prev_result {
        Some(prev) => cni::result::convert(prev, version)?,
        None => cni::result::empty(version),
    };
    let out = result.to_string();
    let (Some(namespace), Some(name)) = (inv.args.pod_namespace(), inv.args.pod_name()) else {
        tracing::info!("no K8S_POD_NAMESPACE/K8S_POD_NAME in CNI_ARGS: not a Kubernetes pod, passing through");
        return Ok(out);
    };
    if conf.pod_namespace.as_deref() == Some(namespace) && name.starts_with(OWN_POD_PREFIX) {
        tracing::info!("istio-cni's own pod, passing through");
        return Ok(out);
    }
    if conf.excluded_namespaces().any(|n| n == namespace) {
        tracing::info!("namespace is excluded, passing through");
        return Ok(out);
    }
    let netns = Netns::open(&inv.netns)
        .map_err(|e| CniError::new(ErrorCode::InvalidEnv, format!("CNI_NETNS {:?} is not usable: {e}", inv.netns)))?;
    let event = CmdAdd {
        netns: inv.netns.clone(),
        pod_name: name.to_string(),
        pod_namespace: namespace.to_string(),
        ips: result["ips"].as_array().cloned().unwrap_or_default(),
        pod_uid: inv.args.pod_uid().map(String::from),
    };
    // The fast path: one round trip to the node agent, which answers from its watch of the node's pods.
    let asked = std::time::Instant::now();
    let before_ms = STARTED.get().map_or(0.0, |started| asked.duration_since(*started).as_secs_f64() * 1e3);
    match agent::pod_setup(&conf.run_dir(), &event, conf.ambient_enabled) {
        Ok(PodSetupAnswer::Enrolled) => {
            // How the ADD's time divides: the plugin before its request (from `main`), the agent's round trip.
            tracing::info!(before_ms, agent_ms = ms_since(asked), "ambient pod enrolled by the node agent");
            return Ok(out);
        }
        Ok(PodSetupAnswer::Sidecar { pod }) => {
            redirect_sidecar(&netns, &pod, &result, conf, env)?;
            return Ok(out);
        }
        Err(SetupError::Failed(e)) => return Err(e),
        Err(SetupError::Fallback(reason)) => {
            tracing::warn!(%reason, "the node agent cannot answer for the pod: looking it up in the API server");
        }
    }
    let (attempts, interval) = conf.pod_lookup();
    let try_again = |e: k8s::LookupError| CniError::new(ErrorCode::TryAgainLater, e.to_string());
    let api = ApiServer::connect(&conf.kubeconfig(), attempts, interval).map_err(try_again)?;
    let pod = api.pod(namespace, name).map_err(try_again)?;
    if conf.ambient_enabled && ambient::is_ambient(conf, &api, &pod)? {
        agent::hand_over(&conf.run_dir(), &event)?;
        tracing::info!("ambient pod enrolled by the node agent");
        return Ok(out);
    }
    redirect_sidecar(&netns, &PodInfo::from(&pod), &result, conf, env)?;
    Ok(out)
}

/// The sidecar path: Istio's decision, then the pod's redirect rules with the chosen backend, all or nothing.
fn redirect_sidecar(
    netns: &Netns,
    pod: &PodInfo,
    result: &serde_json::Value,
    conf: &PluginConf,
    env: &HashMap<String, String>,
) -> Result<(), CniError> {
    if let Decision::Skip(skip) = sidecar::decide(pod) {
        tracing::info!(reason = ?skip, "no redirection needed, passing through");
        return Ok(());
    }
    let has_v6 = cni::result::addresses(result).iter().any(IpAddr::is_ipv6);
    // A pod whose annotations make no sense must not start without its rules: the CNI spec's invalid config.
    let settings =
        sidecar::settings(pod, has_v6).map_err(|e| CniError::new(ErrorCode::InvalidConfig, e.to_string()))?;
    let plan = redirect::sidecar::build(&settings);
    let (force, named) = match conf.force_iptables_binary.as_deref() {
        Some(force) => (Some(force), "netconf key force_iptables_binary"),
        None => (env.get("FORCE_IPTABLES_BINARY").map(String::as_str), "FORCE_IPTABLES_BINARY"),
    };
    // An unknown binary is a configuration error naming where it came from, like an invalid annotation.
    let backend = Backend::select(conf.native_nftables, force.filter(|f| !f.is_empty())).map_err(|e| match e {
        IptablesError::UnknownForcedBinary(_) => {
            CniError::new(ErrorCode::InvalidConfig, format!("invalid {named}: {e}"))
        }
        e => internal(e),
    })?;
    // Whether the host also holds rules of another backend is worth a warning, not a wait: look on another thread
    // while the rules go in.
    let span = tracing::Span::current();
    let mixed = std::thread::spawn(move || span.in_scope(|| redirect::backend::warn_if_mixed(backend)));
    // Never leave half a rule set: a pod that fails ADD is retried by the kubelet from a clean slate.
    let programmed = backend.program(netns, &plan);
    let _ = mixed.join();
    programmed.map_err(|e| {
        CniError::new(ErrorCode::Internal, format!("programming redirect rules with {backend} failed"))
            .with_details(e.to_string())
    })?;
    tracing::info!(%backend, ipv6 = plan.v6.is_some(), "redirect rules programmed");
    Ok(())
}

fn check(inv: &Invocation, conf: &PluginConf, version: Version) -> Result<(), CniError> {
    let Some(prev) = &conf.prev_result else {
        return Err(CniError::new(ErrorCode::InvalidConfig, "CHECK needs a prevResult"));
    };
    // A prevResult that does not even decode is not an attachment we can vouch for (decoding error, as in ADD).
    cni::result::convert(prev, version)?;
    Netns::open(&inv.netns)
        .map_err(|e| CniError::new(ErrorCode::InvalidEnv, format!("CNI_NETNS {:?} is not usable: {e}", inv.netns)))?;
    Ok(())
}

fn status(conf: &PluginConf) -> Result<(), CniError> {
    let kubeconfig = conf.kubeconfig();
    if let Err(e) = std::fs::metadata(&kubeconfig) {
        return Err(CniError::new(
            ErrorCode::NotAvailable,
            format!("kubeconfig {} is not readable: {e}", kubeconfig.display()),
        ));
    }
    if conf.ambient_enabled {
        let socket = conf.run_dir().join(istio_contract::paths::PLUGIN_EVENT_SOCKET);
        if let Err(e) = std::os::unix::net::UnixStream::connect(&socket) {
            return Err(CniError::new(
                ErrorCode::NotAvailable,
                format!("node agent socket {} does not answer: {e}", socket.display()),
            ));
        }
    }
    Ok(())
}

//! One-shot reads of a pod's rules, for `explain` and the drift loop: an enrolled ambient pod's rules and probe
//! entry, a sidecar pod's rules, a running pod's netns. They change nothing; each runs on a blocking thread bounded
//! by [`PER_POD_TIMEOUT`].

use std::net::IpAddr;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use netns::Netns;
use redirect::ambient;
use redirect::backend::Backend;
use redirect::hostprobe::{HostProbe, ProbeEntry};
use redirect::inspect::RuleReport;
use serde::Serialize;

use super::PER_POD_TIMEOUT;
use crate::ambient_state::AmbientState;
use crate::cache::Enrolled;
use crate::config::Config;
use crate::pod::{ips as pod_ips, PodUid};
use crate::repair::in_place::sidecar_plan;

/// Why a pod's rules could not be inspected or repaired.
#[derive(Debug, thiserror::Error)]
pub enum DriftError {
    /// The pod is not enrolled (or was deleted).
    #[error("pod is not enrolled")]
    NotEnrolled,
    /// The enrolled pod's netns is unknown (not found again after a restart).
    #[error("the pod's netns is unknown")]
    NoNetns,
    /// The pod has no IP, so neither its netns nor its sidecar plan can be found.
    #[error("no pod IP in status")]
    NoIp,
    /// The pod's netns was not found through `/proc`.
    #[error("netns not found through {0}")]
    NetnsNotFound(String),
    /// The pod's annotations do not make valid settings.
    #[error("{0}")]
    Settings(String),
    /// Reading or programming the rules failed.
    #[error("{0}")]
    Backend(String),
    /// The host probe set could not be read or programmed.
    #[error("host probe: {0}")]
    HostProbe(String),
    /// The check did not end within [`PER_POD_TIMEOUT`].
    #[error("check did not end within {0:?}")]
    TimedOut(Duration),
    /// The blocking task died.
    #[error("task: {0}")]
    Task(String),
}

/// An enrolled ambient pod's rules and host probe entry, for `explain`.
#[derive(Debug, Clone, Serialize)]
pub struct PodRules {
    /// Expected and found in-pod rules, with the diff.
    pub rules: RuleReport,
    /// Whether every pod IP the host probe set takes is in it under this pod's UID.
    pub in_host_probe_set: bool,
}

/// Reads an enrolled ambient pod's rules in its netns (from the cache's fd) and whether it is in the host probe
/// set; changes nothing and takes no pass (a read during an enrollment shows the enrollment's progress). `pod`
/// gives the annotations the plan is built from.
pub async fn inspect_pod(state: &AmbientState, pod: &Pod) -> Result<PodRules, DriftError> {
    let entry = state.cache().get(&PodUid::of(pod)).ok_or(DriftError::NotEnrolled)?;
    let plan = ambient_plan(state, pod)?;
    let netns = entry_netns(&entry)?;
    let (backend, probe) = (state.backend(), state.hostprobe());
    blocking(move || {
        let rules = backend.inspect_ambient(&netns, &plan).map_err(|e| DriftError::Backend(e.to_string()))?;
        let entries = probe.entries().map_err(|e| DriftError::HostProbe(e.to_string()))?;
        Ok(PodRules { rules, in_host_probe_set: missing_probe_ips(&probe, &entries, &entry).is_empty() })
    })
    .await
}

/// Reads a sidecar pod's rules in `netns` and compares them with the plan the plugin programs for `pod`
/// (built as in-place repair builds it); changes nothing.
pub async fn inspect_sidecar(backend: Backend, netns: Netns, pod: &Pod) -> Result<RuleReport, DriftError> {
    let plan = sidecar_plan(pod).map_err(|e| DriftError::Settings(e.to_string()))?;
    blocking(move || backend.inspect_sidecar(&netns, &plan).map_err(|e| DriftError::Backend(e.to_string()))).await
}

/// Finds a running pod's netns through `HOST_PROC` (by its UID and IPs, as the watch finds running pods).
pub async fn find_netns(config: &Config, pod: &Pod) -> Result<Netns, DriftError> {
    let (proc_dir, uid, ips) = (config.host_proc.clone(), PodUid::of(pod), pod_ips(pod));
    if ips.is_empty() {
        return Err(DriftError::NoIp);
    }
    let shown = proc_dir.display().to_string();
    blocking(move || {
        netns::discover::find_pod_netns(&proc_dir, uid.as_str(), &ips)
            .map_err(|e| DriftError::Backend(e.to_string()))?
            .ok_or(DriftError::NetnsNotFound(shown))
    })
    .await
}

/// Runs `work` on a blocking thread, bounded by [`PER_POD_TIMEOUT`] (the thread itself runs on).
pub(super) async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, DriftError> + Send + 'static,
) -> Result<T, DriftError> {
    match tokio::time::timeout(PER_POD_TIMEOUT, tokio::task::spawn_blocking(work)).await {
        Ok(Ok(result)) => result,
        Ok(Err(e)) => Err(DriftError::Task(e.to_string())),
        Err(_) => Err(DriftError::TimedOut(PER_POD_TIMEOUT)),
    }
}

pub(super) fn ambient_plan(state: &AmbientState, pod: &Pod) -> Result<ambient::AmbientPlan, DriftError> {
    let config = state.inpod_config(pod).map_err(|e| DriftError::Settings(e.to_string()))?;
    Ok(ambient::build(&config))
}

pub(super) fn entry_netns(entry: &Enrolled) -> Result<Netns, DriftError> {
    let fd = entry.netns.as_ref().ok_or(DriftError::NoNetns)?;
    let fd = fd.try_clone().map_err(|e| DriftError::Backend(e.to_string()))?;
    Netns::from_fd(fd, "cached pod netns").map_err(|e| DriftError::Backend(e.to_string()))
}

/// The pod's IPs the probe set takes that it lacks under the pod's UID.
pub(super) fn missing_probe_ips(probe: &HostProbe, entries: &[ProbeEntry], entry: &Enrolled) -> Vec<IpAddr> {
    entry
        .ips
        .iter()
        .map(|ip| ip.to_canonical())
        .filter(|ip| probe.covers(*ip))
        .filter(|ip| !entries.iter().any(|e| e.ip == *ip && e.pod_uid.as_deref() == Some(entry.uid.as_str())))
        .collect()
}

//! Istio's in-place repair (`REPAIR_REPAIR_PODS`): a broken pod's network namespace is found through `/proc` and
//! given the sidecar redirect rules the plugin would have programmed at ADD: the same decision (istio-contract)
//! and the same programming step (`Backend::program`). The kubelet's next retry of the validation init container
//! then passes.

use std::net::IpAddr;
use std::path::PathBuf;

use istio_contract::pod::PodInfo;
use istio_contract::sidecar::{self, Decision, SettingsError};
use k8s_openapi::api::core::v1::Pod;
use redirect::backend::{Backend, BackendError};
use redirect::sidecar::Plan;

use crate::config::Config;
use crate::pod::{ips as pod_ips, PodUid};

/// Why a pod could not be repaired in place; the controller then falls back to the next mode, if any.
#[derive(Debug, thiserror::Error)]
pub enum RepairError {
    /// The pod has no IP in its status yet, so its netns cannot be told apart from others.
    #[error("no pod IP in status: its netns cannot be identified")]
    NoIp,
    /// Scanning the host's `/proc` failed.
    #[error("scanning {proc_dir} for the pod's netns: {source}")]
    Discover {
        /// The scanned proc directory (`HOST_PROC`).
        proc_dir: PathBuf,
        /// What failed.
        source: netns::discover::DiscoverError,
    },
    /// No process of the pod in a netns holding one of its IPs.
    #[error("netns not found through {proc_dir} (pod IPs {ips:?})")]
    NetnsNotFound {
        /// The scanned proc directory (`HOST_PROC`).
        proc_dir: PathBuf,
        /// The IPs a matching netns must hold.
        ips: Vec<IpAddr>,
    },
    /// The pod's annotations do not make valid settings.
    #[error(transparent)]
    Settings(#[from] SettingsError),
    /// Programming the rules failed (partial rules removed).
    #[error("programming redirect rules with {backend} failed: {source}")]
    Program {
        /// The backend that failed.
        backend: Backend,
        /// What failed.
        source: BackendError,
    },
    /// The blocking scan-and-program task died.
    #[error("repair task: {0}")]
    Task(#[from] tokio::task::JoinError),
}

/// The sidecar rules the plugin programs for `pod` at ADD (its annotations, IPv6 when it has an IPv6 address): what
/// in-place repair programs and what the drift check compares a sidecar pod's netns with.
pub fn sidecar_plan(pod: &Pod) -> Result<Plan, RepairError> {
    let ips = pod_ips(pod);
    if ips.is_empty() {
        return Err(RepairError::NoIp);
    }
    Ok(redirect::sidecar::build(&sidecar::settings(&PodInfo::from(pod), ips.iter().any(IpAddr::is_ipv6))?))
}

/// In-place repair with the agent's rule backend and `/proc`.
#[derive(Debug, Clone)]
pub struct InPlace {
    backend: Backend,
    proc_dir: PathBuf,
    excluded: Vec<String>,
}

impl InPlace {
    /// Repairs with `backend` (the agent's `NATIVE_NFTABLES` / `FORCE_IPTABLES_BINARY` choice), finding netns under
    /// `HOST_PROC` and honouring `EXCLUDE_NAMESPACES` as the plugin honours its excluded namespaces.
    pub fn new(backend: Backend, config: &Config) -> Self {
        Self { backend, proc_dir: config.host_proc.clone(), excluded: config.excluded() }
    }

    /// Why the plugin would not have redirected `pod` (excluded namespace, host network, [`sidecar::decide`]'s
    /// reasons), so in-place repair leaves it alone too; `None` for a pod to repair.
    pub fn skip_reason(&self, pod: &Pod) -> Option<String> {
        let ns = crate::pod::namespace(pod);
        if self.excluded.iter().any(|n| n == ns) {
            return Some(format!("namespace {ns} is excluded"));
        }
        let info = PodInfo::from(pod);
        if info.host_network {
            return Some("host network pod".into());
        }
        match sidecar::decide(&info) {
            Decision::Redirect => None,
            Decision::Skip(skip) => Some(format!("the plugin would not redirect it: {skip:?}")),
        }
    }

    /// Programs the sidecar rules of `pod` (which [`InPlace::skip_reason`] accepted) into its netns; blocks on
    /// `/proc` and the rule tools on a blocking thread.
    pub async fn repair(&self, pod: &Pod) -> Result<(), RepairError> {
        let ips = pod_ips(pod);
        let plan = sidecar_plan(pod)?;
        let (this, uid) = (self.clone(), PodUid::of(pod));
        tokio::task::spawn_blocking(move || {
            let netns = netns::discover::find_pod_netns(&this.proc_dir, &uid, &ips)
                .map_err(|source| RepairError::Discover { proc_dir: this.proc_dir.clone(), source })?
                .ok_or_else(|| RepairError::NetnsNotFound { proc_dir: this.proc_dir.clone(), ips: ips.clone() })?;
            let backend = this.backend;
            backend.program(&netns, &plan).map_err(|source| RepairError::Program { backend, source })?;
            let (backend, ipv6) = (this.backend, plan.v6.is_some());
            tracing::info!(%backend, ipv6, netns = ?netns.id(), "redirect rules programmed");
            Ok(())
        })
        .await?
    }
}

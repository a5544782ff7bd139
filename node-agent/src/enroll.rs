//! Enrolling and removing one pod, in the order: netns, in-pod rules, proxy Add (acked), host probe
//! entry, annotation. Every step is idempotent, so the work queue and the CNI path can both retry.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Instant;

use istio_contract::names::{
    AMBIENT_BYPASS_INBOUND_CAPTURE, AMBIENT_DNS_CAPTURE, AMBIENT_REDIRECTION, AMBIENT_REDIRECTION_ENABLED,
    REROUTE_VIRTUAL_INTERFACES,
};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use netns::Netns;
use redirect::ambient::{self, InpodConfig};
use redirect::backend::Backend;
use redirect::hostprobe::HostProbe;
use serde_json::json;
use tracing::Instrument as _;
use zds::messages::WorkloadInfo;
use zds::server::ZdsHandle;

use crate::cache::{Enrolled, PodCache};
use crate::config::Config;
use crate::metrics::Metrics;

/// Why a pod could not be enrolled or removed; the message goes back to the plugin.
#[derive(Debug, thiserror::Error)]
pub enum EnrollError {
    /// The pod's netns could not be opened or found.
    #[error("pod {pod}: netns: {reason}")]
    Netns {
        /// namespace/name.
        pod: String,
        /// What went wrong.
        reason: String,
    },
    /// The in-pod rules could not be programmed.
    #[error("pod {pod}: in-pod rules: {reason}")]
    Rules {
        /// namespace/name.
        pod: String,
        /// What went wrong.
        reason: String,
    },
    /// The node proxy did not take the pod (none connected, or it answered with an error).
    #[error("pod {pod}: node proxy: {source}")]
    Proxy {
        /// namespace/name.
        pod: String,
        /// The ZDS error.
        source: zds::ZdsError,
    },
    /// An API call failed.
    #[error("pod {pod}: {what}: {source}")]
    Api {
        /// namespace/name.
        pod: String,
        /// Which call.
        what: &'static str,
        /// The API error.
        source: kube::Error,
    },
}

/// Performs enrollments; shared by the plugin event server, the pod watcher and startup.
pub struct Enroller {
    config: Config,
    backend: Backend,
    client: Client,
    zds: ZdsHandle,
    cache: PodCache,
    hostprobe: HostProbe,
    metrics: Metrics,
}

/// What the proxy needs to know about a pod's identity.
fn workload_info(pod: &Pod) -> WorkloadInfo {
    WorkloadInfo {
        name: pod.metadata.name.clone().unwrap_or_default(),
        namespace: pod.metadata.namespace.clone().unwrap_or_default(),
        service_account: pod
            .spec
            .as_ref()
            .and_then(|s| s.service_account_name.clone())
            .unwrap_or_else(|| "default".into()),
    }
}

fn key(pod: &Pod) -> String {
    format!(
        "{}/{}",
        pod.metadata.namespace.as_deref().unwrap_or_default(),
        pod.metadata.name.as_deref().unwrap_or_default()
    )
}

impl Enroller {
    /// Wires the pieces together.
    pub fn new(
        config: Config,
        backend: Backend,
        client: Client,
        zds: ZdsHandle,
        cache: PodCache,
        hostprobe: HostProbe,
        metrics: Metrics,
    ) -> Arc<Self> {
        Arc::new(Self { config, backend, client, zds, cache, hostprobe, metrics })
    }

    /// The cache of enrolled pods.
    pub fn cache(&self) -> &PodCache {
        &self.cache
    }

    /// The in-pod rule settings for `pod`: agent defaults overridden by the pod's annotations.
    pub fn inpod_config(&self, pod: &Pod) -> InpodConfig {
        let empty = BTreeMap::new();
        let ann = pod.metadata.annotations.as_ref().unwrap_or(&empty);
        let flag = |k: &str| ann.get(k).map(|v| v.trim().eq_ignore_ascii_case("true"));
        InpodConfig {
            dns_capture: flag(AMBIENT_DNS_CAPTURE).unwrap_or(self.config.ambient_dns_capture),
            ingress_mode: flag(AMBIENT_BYPASS_INBOUND_CAPTURE).unwrap_or(false),
            virtual_interfaces: ann
                .get(REROUTE_VIRTUAL_INTERFACES)
                .map(|v| v.split(',').map(str::trim).filter(|s| !s.is_empty()).map(String::from).collect())
                .unwrap_or_default(),
            enable_ipv6: self.config.ambient_ipv6,
            ..InpodConfig::default()
        }
    }

    /// Enrolls `pod`, whose netns is `netns`, and answers only when every step is done (or failed).
    pub async fn enroll(&self, pod: &Pod, netns: Netns, ips: Vec<IpAddr>) -> Result<(), EnrollError> {
        let span =
            tracing::info_span!("enroll", pod = %key(pod), uid = pod.metadata.uid.as_deref().unwrap_or_default());
        self.enroll_steps(pod, netns, ips).instrument(span).await
    }

    async fn enroll_steps(&self, pod: &Pod, netns: Netns, ips: Vec<IpAddr>) -> Result<(), EnrollError> {
        let name = key(pod);
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        let started = Instant::now();
        let fd = netns.try_clone_fd().map_err(|e| EnrollError::Netns { pod: name.clone(), reason: e.to_string() })?;
        self.program_rules(pod, netns).await?;
        self.metrics.phase("rules", started);

        let started = Instant::now();
        let info = workload_info(pod);
        let fd = Arc::new(fd);
        self.cache.insert(Enrolled { uid: uid.clone(), info: info.clone(), ips: ips.clone(), netns: Some(fd.clone()) });
        if let Err(source) = self.zds.add(&uid, info, fd.as_ref()).await {
            self.annotate(pod, "pending").await.ok();
            return Err(EnrollError::Proxy { pod: name, source });
        }
        self.metrics.phase("proxy_ack", started);

        if let Err(e) = self.hostprobe.add(&uid, &ips) {
            tracing::error!(error = %e, "host probe set");
        }
        let started = Instant::now();
        self.annotate(pod, AMBIENT_REDIRECTION_ENABLED).await?;
        self.metrics.phase("annotate", started);
        self.metrics.enrolled_pods.set(self.cache.count() as i64);
        tracing::info!(?ips, "enrolled");
        Ok(())
    }

    /// Puts a pod enrolled before a restart back into the cache, so the next proxy connection gets it in its
    /// snapshot (Keep when its netns is unknown). With `reprogram` its rules are applied again first: the apply
    /// replaces them atomically, so no packet escapes during the swap.
    pub async fn restore(
        &self,
        pod: &Pod,
        netns: Option<Netns>,
        ips: Vec<IpAddr>,
        reprogram: bool,
    ) -> Result<(), EnrollError> {
        let name = key(pod);
        let mut fd = None;
        if let Some(netns) = netns {
            fd = Some(Arc::new(
                netns.try_clone_fd().map_err(|e| EnrollError::Netns { pod: name.clone(), reason: e.to_string() })?,
            ));
            if reprogram {
                self.program_rules(pod, netns).await?;
            }
        }
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        if let Err(e) = self.hostprobe.add(&uid, &ips) {
            tracing::error!(pod = %name, error = %e, "host probe set");
        }
        self.cache.insert(Enrolled { uid, info: workload_info(pod), ips, netns: fd });
        self.metrics.enrolled_pods.set(self.cache.count() as i64);
        Ok(())
    }

    /// Programs the pod's in-pod rules on a blocking thread (the apply enters the netns and may exec iptables).
    async fn program_rules(&self, pod: &Pod, netns: Netns) -> Result<(), EnrollError> {
        let (backend, plan) = (self.backend, ambient::build(&self.inpod_config(pod)));
        let failed = |reason: String| EnrollError::Rules { pod: key(pod), reason };
        tokio::task::spawn_blocking(move || backend.apply_ambient(&netns, &plan))
            .await
            .map_err(|e| failed(e.to_string()))?
            .map_err(|e| failed(e.to_string()))
    }

    /// Removes a pod: host probe entries, cache, in-pod rules (unless the pod is going away with its netns),
    /// proxy Del to every connection, and the annotation (unless deleted).
    pub async fn remove(&self, pod: &Pod, deleting: bool) -> Result<(), EnrollError> {
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        let name = key(pod);
        let Some(entry) = self.cache.remove(&uid) else { return Ok(()) };
        if let Err(e) = self.hostprobe.remove(&uid, &entry.ips) {
            tracing::error!(pod = %name, error = %e, "host probe set");
        }
        if !deleting {
            if let Some(fd) = entry.netns.as_ref().and_then(|fd| fd.try_clone().ok()) {
                let backend = self.backend;
                let removed = tokio::task::spawn_blocking(move || {
                    Netns::from_fd(fd, "cached pod netns")
                        .map_err(|e| e.to_string())
                        .and_then(|ns| backend.remove_ambient(&ns).map_err(|e| e.to_string()))
                })
                .await;
                if let Ok(Err(e)) | Err(e) = removed.map_err(|e| e.to_string()) {
                    tracing::error!(pod = %name, error = %e, "removing in-pod rules");
                }
            }
        }
        if let Err(e) = self.zds.del(&uid).await {
            tracing::warn!(pod = %name, error = %e, "proxy Del");
        }
        if !deleting {
            self.annotate_remove(pod).await?;
        }
        self.metrics.enrolled_pods.set(self.cache.count() as i64);
        tracing::info!(pod = %name, "removed from ambient");
        Ok(())
    }

    async fn annotate(&self, pod: &Pod, state: &str) -> Result<(), EnrollError> {
        let patch = json!({ "metadata": { "annotations": { AMBIENT_REDIRECTION: state } } });
        self.patch_status(pod, patch).await
    }

    async fn annotate_remove(&self, pod: &Pod) -> Result<(), EnrollError> {
        let patch = json!({ "metadata": { "annotations": { AMBIENT_REDIRECTION: null } } });
        self.patch_status(pod, patch).await
    }

    /// Through `pods/status`, as Istio does, so the agent needs no write access to pods themselves.
    async fn patch_status(&self, pod: &Pod, patch: serde_json::Value) -> Result<(), EnrollError> {
        let api: Api<Pod> = Api::namespaced(self.client.clone(), pod.metadata.namespace.as_deref().unwrap_or_default());
        api.patch_status(
            pod.metadata.name.as_deref().unwrap_or_default(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
        .map(drop)
        .map_err(|source| EnrollError::Api { pod: key(pod), what: "annotate", source })
    }
}

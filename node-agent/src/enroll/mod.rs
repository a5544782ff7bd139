//! Enrolling and removing one pod, in the order: netns, in-pod rules, proxy Add (acked), host probe
//! entry, annotation. Every step is idempotent, so the work queue and the CNI path can both retry.
//!
//! The rules of one enrollment (step order, stages, what a failure undoes and in which order) are in
//! [`procedure`], apart from the I/O, which [`Enroller`] performs ([`procedure::Effects`]). What it enrolls into
//! (cache, gate, host probe set, records) is the agent's [`AmbientState`], which the drift check and explain read
//! directly.
//!
//! **Deletion mid-enrollment.** Enrollment and removal of one pod UID never interleave (see [`crate::pod_gate`]):
//! each holds the UID's pass for its whole run. A pod's deletion is recorded at once ([`Enroller::mark_deleted`],
//! from the pod watch) and checked at every [`Stage`], the points between the steps: an enrollment that finds
//! its pod deleted undoes what it did (cache entry, proxy Del, host probe entry) and fails with
//! [`EnrollError::Deleted`], which the plugin's ADD reports; an enrollment of a deleted UID is refused before its
//! first step. The watch's removal, waiting for the pass, then finds nothing left, or removes what an enrollment
//! failing for another reason kept (its cache entry). So after a deletion at any stage: no cache entry, no ZDS
//! workload (the proxy got Del or never got Add, and a reconnecting proxy's snapshot lacks it), no probe entry.
//!
//! The host probe set changes (netlink, or ipset) run on blocking threads, like the rules; nothing here blocks an
//! async worker.
//!
//! **Test hook (debug builds only).** With `NODE_AGENT_TEST_PAUSE_STAGE=<stage>` (a [`Stage::name`]) and
//! `NODE_AGENT_TEST_PAUSE_DIR=<dir>`, every enrollment reaching that stage creates `<dir>/<pod uid>.paused` and
//! waits until `<dir>/<pod uid>.resume` exists (at most a minute), then checks for a deletion as always. The
//! end-to-end tests (`testbed::node_agent::EnrollmentPause`) delete a pod at each stage this way; they run the
//! `target/debug` binaries. Release builds (`--release`, the image) compile none of it and ignore both variables.

use std::net::IpAddr;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use istio_contract::names::{AMBIENT_REDIRECTION, AMBIENT_REDIRECTION_ENABLED};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use netns::Netns;
use redirect::ambient;
use serde_json::json;
use tracing::Instrument as _;
use zds::messages::WorkloadInfo;
use zds::server::ZdsHandle;

mod error;
mod procedure;

pub use error::EnrollError;
pub use procedure::Stage;
use procedure::{workload_info, Effects, OnFailure, Procedure, Unannotated};

use crate::ambient_state::AmbientState;
use crate::cache::Enrolled;
use crate::config::Config;
use crate::explain::report::ProxyState;
use crate::metrics::Metrics;
use crate::pod::{key, PodUid};
use crate::pod_gate::Pass;
use crate::timeline::{Clock, Source, Step, Timed};

/// The longest one API call of an enrollment may take before it counts as failed.
pub const API_CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// Performs enrollments; shared by the plugin event server, the pod watcher and startup. What it enrolls into is
/// the agent's [`AmbientState`], which the drift check and explain read without it.
pub struct Enroller {
    config: Config,
    client: Client,
    zds: ZdsHandle,
    state: Arc<AmbientState>,
    metrics: Metrics,
    /// Enrolled pods (the proxy acked them) whose annotation failed: the watch's retry annotates them
    /// ([`Enroller::annotate_pending`]); nothing else would, since they are enrolled.
    unannotated: Unannotated,
    #[cfg(debug_assertions)]
    pause: Option<pause::Pause>,
}

impl Enroller {
    /// Enrolls into `state`, with `config`'s node, through `client` (the annotations) and `zds` (the proxy).
    pub fn new(
        config: Config,
        client: Client,
        zds: ZdsHandle,
        state: Arc<AmbientState>,
        metrics: Metrics,
    ) -> Arc<Self> {
        Arc::new(Self {
            config,
            client,
            zds,
            state,
            metrics,
            unannotated: Unannotated::default(),
            #[cfg(debug_assertions)]
            pause: pause::Pause::from_env(),
        })
    }

    /// Records that `pod` was deleted, without waiting for anything: an enrollment of it in flight rolls back at
    /// its next stage, and any later one is refused. Called by the pod watch before it removes the pod.
    pub fn mark_deleted(&self, pod: &Pod) {
        let uid = PodUid::of(pod);
        if !uid.is_empty() {
            self.state.gate().mark_deleted(&uid);
        }
    }

    /// Whether pod `namespace/name` still exists with UID `uid` on this node, by a consistent read: a relist
    /// asks before it removes an enrolled pod it did not list.
    pub async fn still_exists(&self, namespace: &str, name: &str, uid: &str) -> Result<bool, kube::Error> {
        let pod = Api::<Pod>::namespaced(self.client.clone(), namespace).get_opt(name).await?;
        Ok(pod.is_some_and(|p| {
            p.metadata.uid.as_deref() == Some(uid)
                && p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(self.config.node_name.as_str())
        }))
    }

    /// What the agent holds of its ambient pods, which enrollment writes.
    pub fn state(&self) -> &AmbientState {
        &self.state
    }

    /// Enrolls `pod`, whose netns is `netns`, and answers only when every step is done (or failed). Holds the
    /// pod's pass throughout, so a removal of it waits; fails with [`EnrollError::Deleted`] (after undoing its
    /// steps) when the pod was deleted before or during it. A pod that fails a later step stays in the cache
    /// (and at the proxy), for the watch's retry: it runs meanwhile, and its traffic needs the proxy. `search` is
    /// the `/proc` search that found `netns`: the record's `netns` step starts with it.
    pub async fn enroll(&self, pod: &Pod, netns: Netns, ips: Vec<IpAddr>, search: Timed) -> Result<(), EnrollError> {
        self.procedure().run(pod, netns, ips, OnFailure::Keep, Some(search)).await
    }

    /// The enrollment procedure, over this enroller's effects and state.
    fn procedure(&self) -> Procedure<'_, Self> {
        Procedure {
            effects: self,
            gate: self.state.gate(),
            recorder: self.state.recorder(),
            unannotated: &self.unannotated,
        }
    }

    /// Records that the watch's `/proc` search for running `pod`'s netns failed with `error`, so that `explain`
    /// shows the failed step and its time instead of nothing. A pod enrolled meanwhile (by the plugin), or deleted,
    /// keeps its record.
    pub async fn search_failed(&self, pod: &Pod, ips: &[IpAddr], search: Timed, error: &str) {
        let uid = PodUid::of(pod);
        let _pass = self.state.gate().enter(&uid).await;
        if self.state.gate().is_deleted(&uid) || self.state.cache().get(&uid).is_some() {
            return;
        }
        self.state.recorder().begin(&uid, Source::Watch, ips, search.started());
        self.state.recorder().timed(&uid, Step::Netns, search, Some(error.to_string()));
        self.state.recorder().finish(&uid, Err(error.to_string()));
    }

    /// Like [`Enroller::enroll`], for the plugin's ADD: all or nothing. A failure undoes what was done (cache
    /// entry, proxy Del, host probe entry) before it is answered, because the failed ADD makes the runtime tear
    /// the sandbox down: a pod kept would hold its netns, and the proxy run it, until the pod is deleted. So does
    /// an enrollment that ends after `answer_by`, when the plugin may have given up on the answer
    /// ([`cni::plugin_event::AGENT_ANSWER_DEADLINE`]); its annotation is taken back too.
    ///
    /// The enrollment runs in a task of its own: the plugin's request ends when the plugin stops waiting, and the
    /// enrollment must not be cut off at whatever step it had reached then, with nothing undone.
    pub async fn enroll_for_plugin(
        self: &Arc<Self>,
        pod: &Pod,
        netns: Netns,
        ips: Vec<IpAddr>,
        answer_by: Instant,
    ) -> Result<(), EnrollError> {
        let (enroller, owned) = (self.clone(), pod.clone());
        let task = tokio::spawn(async move {
            enroller.procedure().run(&owned, netns, ips, OnFailure::Undo { answer_by }, None).await
        });
        task.await.unwrap_or_else(|e| Err(EnrollError::Task { pod: key(pod), reason: e.to_string() }))
    }

    /// Annotates `pod` `enabled` if it is enrolled but its annotation failed at its enrollment (a no-op
    /// otherwise): the watch's reconciliation of an enrolled pod calls it, and retries it with backoff when it
    /// fails, so the annotation, which other nodes' proxies find the pod by, is not lost to one failed request.
    pub async fn annotate_pending(&self, pod: &Pod) -> Result<(), EnrollError> {
        let uid = PodUid::of(pod);
        if !self.unannotated.contains(&uid) {
            return Ok(());
        }
        let _pass = self.state.gate().enter(&uid).await;
        if !self.unannotated.contains(&uid) || self.state.cache().get(&uid).is_none() {
            return Ok(());
        }
        let clock = Clock::start();
        let annotated = self.annotate(pod, AMBIENT_REDIRECTION_ENABLED).await;
        self.state.recorder().result(&uid, Step::Annotate, clock, annotated)?;
        self.state.recorder().finish(&uid, Ok(()));
        self.unannotated.remove(&uid);
        tracing::info!(pod = %key(pod), uid = %uid, "annotated after a failed attempt");
        Ok(())
    }

    /// Puts a pod enrolled before a restart back into the cache, so the next proxy connection gets it in its
    /// snapshot (Keep when its netns is unknown). With `reprogram` its rules are applied again first: the apply
    /// replaces them atomically, so no packet escapes during the swap. `netns` is what the `/proc` search timed
    /// by `search` found, or why it found nothing.
    pub async fn restore(
        &self,
        pod: &Pod,
        netns: Result<Netns, String>,
        ips: Vec<IpAddr>,
        reprogram: bool,
        search: Timed,
    ) -> Result<(), EnrollError> {
        let name = key(pod);
        let uid = PodUid::of(pod);
        let _pass = self.state.gate().enter(&uid).await;
        if self.state.gate().is_deleted(&uid) {
            return Err(EnrollError::Deleted { pod: name, uid: uid.into(), stage: Stage::Rules.name() });
        }
        self.state.recorder().begin(&uid, Source::Restore, &ips, search.started());
        let result = self.restore_steps(pod, netns, ips, reprogram, search).await;
        self.state.recorder().finish(&uid, result.as_ref().map(drop).map_err(ToString::to_string));
        result
    }

    async fn restore_steps(
        &self,
        pod: &Pod,
        netns: Result<Netns, String>,
        ips: Vec<IpAddr>,
        reprogram: bool,
        search: Timed,
    ) -> Result<(), EnrollError> {
        let name = key(pod);
        let uid = PodUid::of(pod);
        let mut fd = None;
        let clock = Clock::start();
        let netns = match netns {
            Ok(netns) => {
                let opened =
                    netns.try_clone_fd().map_err(|e| EnrollError::Netns { pod: name.clone(), reason: e.to_string() });
                let error = opened.as_ref().err().map(ToString::to_string);
                self.state.recorder().timed(&uid, Step::Netns, search.then(clock.stop()), error);
                fd = Some(Arc::new(opened?));
                Some(netns)
            }
            Err(error) => {
                let error = format!("{error}: restored without it, so its proxy keeps what it had (Keep)");
                self.state.recorder().timed(&uid, Step::Netns, search, Some(error));
                None
            }
        };
        if let Some(netns) = netns {
            if reprogram {
                let clock = Clock::start();
                let programmed = self.program_rules(pod, netns).await;
                self.state.recorder().result(&uid, Step::Rules, clock, programmed)?;
            }
        }
        let clock = Clock::start();
        let probed = self.probe_add(&uid, &ips).await;
        if let Err(e) = &probed {
            tracing::error!(pod = %name, error = %e, "host probe set");
        }
        self.state.recorder().step(&uid, Step::Probe, clock, probed.err());
        self.state.recorder().proxy(&uid, ProxyState::Snapshot);
        self.cache_insert(Enrolled { uid, info: workload_info(pod), ips, netns: fd });
        Ok(())
    }

    /// Removes a pod: host probe entries, cache, in-pod rules (unless the pod is going away with its netns),
    /// proxy Del to every connection, and the annotation (unless deleted). Waits for an enrollment of the pod in
    /// flight to end first, then removes what it left.
    pub async fn remove(&self, pod: &Pod, deleting: bool) -> Result<(), EnrollError> {
        let uid = PodUid::of(pod);
        let name = key(pod);
        let _pass = self.state.gate().enter(&uid).await;
        self.unannotated.remove(&uid);
        self.state.recorder().forget(&uid);
        let Some(entry) = self.state.cache().remove(&uid) else { return Ok(()) };
        if let Err(e) = self.probe_remove(&uid, &entry.ips).await {
            tracing::error!(pod = %name, error = %e, "host probe set");
        }
        if !deleting {
            if let Some(fd) = entry.netns.as_ref().and_then(|fd| fd.try_clone().ok()) {
                let backend = self.state.backend();
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
        self.metrics.enrolled_pods.set(self.state.cache().count() as i64);
        tracing::info!(pod = %name, "removed from ambient");
        Ok(())
    }

    async fn annotate_remove(&self, pod: &Pod) -> Result<(), EnrollError> {
        annotate_remove(&self.client, pod).await
    }
}

/// The effects of an enrollment, on the node and the API.
impl Effects for Enroller {
    async fn pause(&self, stage: Stage, uid: &PodUid) {
        #[cfg(debug_assertions)]
        if let Some(pause) = &self.pause {
            pause.at(stage, uid).await;
        }
        #[cfg(not(debug_assertions))]
        let _ = (stage, uid);
    }

    /// Programs the pod's in-pod rules on a blocking thread (the apply enters the netns and may exec iptables).
    /// An invalid annotation is refused before anything is programmed; the reason names it.
    async fn program_rules(&self, pod: &Pod, netns: Netns) -> Result<(), EnrollError> {
        let failed = |reason: String| EnrollError::Rules { pod: key(pod), reason };
        let config = self.state.inpod_config(pod).map_err(|source| EnrollError::Invalid { pod: key(pod), source })?;
        let (backend, plan) = (self.state.backend(), ambient::build(&config));
        tokio::task::spawn_blocking(move || backend.apply_ambient(&netns, &plan))
            .await
            .map_err(|e| failed(e.to_string()))?
            .map_err(|e| failed(e.to_string()))
    }

    fn cache_insert(&self, entry: Enrolled) {
        self.state.cache().insert(entry);
        self.metrics.enrolled_pods.set(self.state.cache().count() as i64);
    }

    fn cache_remove(&self, uid: &PodUid) {
        self.state.cache().remove(uid);
        self.metrics.enrolled_pods.set(self.state.cache().count() as i64);
    }

    async fn proxy_add(&self, uid: &PodUid, info: WorkloadInfo, netns: &OwnedFd) -> Result<(), zds::ZdsError> {
        self.zds.add(uid, info, netns).await
    }

    async fn proxy_del(&self, uid: &PodUid) -> Result<(), zds::ZdsError> {
        self.zds.del(uid).await
    }

    /// On a blocking thread: it enters the host netns and talks netlink.
    async fn probe_add(&self, uid: &PodUid, ips: &[IpAddr]) -> Result<(), String> {
        let (probe, uid, ips) = (self.state.hostprobe(), uid.clone(), ips.to_vec());
        tokio::task::spawn_blocking(move || probe.add(&uid, &ips).map_err(|e| e.to_string()))
            .await
            .map_err(|e| e.to_string())?
    }

    /// On a blocking thread.
    async fn probe_remove(&self, uid: &PodUid, ips: &[IpAddr]) -> Result<(), String> {
        let (probe, uid, ips) = (self.state.hostprobe(), uid.clone(), ips.to_vec());
        tokio::task::spawn_blocking(move || probe.remove(&uid, &ips).map_err(|e| e.to_string()))
            .await
            .map_err(|e| e.to_string())?
    }

    async fn annotate(&self, pod: &Pod, state: &'static str) -> Result<(), EnrollError> {
        let patch = json!({ "metadata": { "annotations": { AMBIENT_REDIRECTION: state } } });
        patch_status(&self.client, pod, patch).await
    }

    fn take_back_annotation(&self, pod: &Pod, pass: Pass) {
        let (client, pod) = (self.client.clone(), pod.clone());
        let take_back = async move {
            let _pass = pass;
            if let Err(e) = annotate_remove(&client, &pod).await {
                tracing::warn!(error = %e, "taking back the annotation of an enrollment rolled back");
            }
        };
        tokio::spawn(take_back.in_current_span());
    }
}

/// Takes the ambient annotation off `pod`.
async fn annotate_remove(client: &Client, pod: &Pod) -> Result<(), EnrollError> {
    let patch = json!({ "metadata": { "annotations": { AMBIENT_REDIRECTION: null } } });
    patch_status(client, pod, patch).await
}

/// The field manager of the agent's writes (the pod's `managedFields` and the API server's audit log name it):
/// without one a real API server records the writer as `unknown`.
pub(crate) const FIELD_MANAGER: &str = "node-agent";

/// Through `pods/status`, as Istio does, so the agent needs no write access to pods themselves. Bounded by
/// [`API_CALL_TIMEOUT`]: an enrollment waiting on an unanswered request would hold the pod's netns and its rollback
/// (found by the soak test).
async fn patch_status(client: &Client, pod: &Pod, patch: serde_json::Value) -> Result<(), EnrollError> {
    let api: Api<Pod> = Api::namespaced(client.clone(), crate::pod::namespace(pod));
    let name = crate::pod::name(pod);
    let params = PatchParams { field_manager: Some(FIELD_MANAGER.into()), ..PatchParams::default() };
    let patch = Patch::Merge(&patch);
    match tokio::time::timeout(API_CALL_TIMEOUT, api.patch_status(name, &params, &patch)).await {
        Ok(answer) => answer.map(drop).map_err(|source| EnrollError::Api { pod: key(pod), what: "annotate", source }),
        Err(_) => Err(EnrollError::ApiTimeout { pod: key(pod), what: "annotate", after: API_CALL_TIMEOUT }),
    }
}

/// The test hook that pauses enrollments at one [`Stage`] (see the module doc). Debug builds only.
#[cfg(debug_assertions)]
mod pause {
    use std::path::PathBuf;
    use std::time::Duration;

    use super::Stage;

    /// Names the stage to pause at ([`Stage::name`]).
    const STAGE_ENV: &str = "NODE_AGENT_TEST_PAUSE_STAGE";
    /// The directory of the `<uid>.paused` and `<uid>.resume` files.
    const DIR_ENV: &str = "NODE_AGENT_TEST_PAUSE_DIR";
    /// Longest pause: a test that never resumes does not hold the pod forever.
    const LONGEST: Duration = Duration::from_secs(60);
    /// How often the resume file is looked for.
    const POLL: Duration = Duration::from_millis(10);

    /// Where to pause, from the environment.
    #[derive(Debug)]
    pub(super) struct Pause {
        stage: Stage,
        dir: PathBuf,
    }

    impl Pause {
        /// The hook, when both variables are set and the stage is known.
        pub(super) fn from_env() -> Option<Self> {
            let (stage, dir) = (std::env::var(STAGE_ENV).ok()?, std::env::var_os(DIR_ENV)?);
            let Some(stage) = Stage::ALL.into_iter().find(|s| s.name() == stage) else {
                let known: Vec<&str> = Stage::ALL.iter().map(|s| s.name()).collect();
                tracing::error!(stage, ?known, "{STAGE_ENV} names no enrollment stage: test hook off");
                return None;
            };
            tracing::warn!(stage = stage.name(), dir = ?dir, "test hook on: enrollments pause at this stage");
            Some(Self { stage, dir: dir.into() })
        }

        /// At `stage` of pod `uid`: announces the pause and waits for the test to resume it.
        pub(super) async fn at(&self, stage: Stage, uid: &str) {
            if stage != self.stage {
                return;
            }
            let (paused, resume) = (self.dir.join(format!("{uid}.paused")), self.dir.join(format!("{uid}.resume")));
            if let Err(e) = tokio::fs::write(&paused, stage.name()).await {
                tracing::error!(error = %e, path = %paused.display(), "test hook: cannot announce the pause");
                return;
            }
            tracing::info!(stage = stage.name(), resume = %resume.display(), "test hook: enrollment paused");
            let deadline = tokio::time::Instant::now() + LONGEST;
            while !tokio::fs::try_exists(&resume).await.unwrap_or(false) {
                if tokio::time::Instant::now() >= deadline {
                    tracing::warn!(stage = stage.name(), "test hook: not resumed within {LONGEST:?}; going on");
                    return;
                }
                tokio::time::sleep(POLL).await;
            }
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;
        use testbed::node_agent::EnrollmentPause;

        #[test]
        fn the_testbed_arms_the_hook_with_the_agents_names() {
            let stages: Vec<&str> = Stage::ALL.iter().map(|s| s.name()).collect();
            assert_eq!(stages, EnrollmentPause::STAGES);
            assert_eq!((STAGE_ENV, DIR_ENV), (EnrollmentPause::STAGE_ENV, EnrollmentPause::DIR_ENV));
        }
    }
}

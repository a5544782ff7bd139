//! One enrollment's rules, apart from its I/O (as ztunnel splits its per-pod state machine from its I/O loop):
//! which steps run in which order, where a deletion or the plugin's deadline stops it, and what a failure undoes,
//! in which order. The effects on the node and the API (rules, the cache and the proxy, the host probe set, the
//! annotation) are behind [`Effects`]: [`super::Enroller`] performs them; the unit tests below put a fake in their
//! place that logs every effect, fails the one a test names and deletes the pod at the stage a test names.
//!
//! The rules, each pinned by a test that fails with the rule broken:
//! - **Order.** Rules, then the cache entry and the proxy's Add, then the host probe entry, then the annotation
//!   (`enabled`). Between two steps is a [`Stage`], where a deletion is noticed.
//! - **Rollback order.** A rollback undoes only what was done, last done first for the proxy: the cache entry
//!   goes first (a proxy connecting then gets a snapshot without the pod), then the proxy's Del, then the host
//!   probe entry. The in-pod rules stay (the netns goes with the pod).
//! - **Deletion.** A pod deleted before or during its enrollment is rolled back at the next stage, and the
//!   enrollment fails with [`EnrollError::Deleted`]; a deleted pod is refused before its first step. The deletion
//!   wins over a failed proxy Add or a failed annotation.
//! - **The plugin's enrollment is all or nothing** ([`OnFailure::Undo`]): any failure rolls back, and an
//!   annotation that was set (or whose request may have landed) is taken back after the rollback; past its answer
//!   deadline no step starts, and a step still running is abandoned ([`EnrollError::TooLate`]).
//! - **The watch's enrollment keeps what was done** ([`OnFailure::Keep`]) for its retry: nothing is undone, and a
//!   failed annotation is left for [`Unannotated`]'s retry.
//! - **A failed proxy Add** annotates the pod `pending` (Istio's partial add) and fails.

use std::collections::HashSet;
use std::future::Future;
use std::net::IpAddr;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use istio_contract::names::AMBIENT_REDIRECTION_ENABLED;
use k8s_openapi::api::core::v1::Pod;
use netns::Netns;
use tracing::Instrument as _;
use zds::messages::WorkloadInfo;

use super::error::EnrollError;
use crate::cache::Enrolled;
use crate::explain::report::ProxyState;
use crate::pod::{key, PodUid};
use crate::pod_gate::{Pass, PodGate};
use crate::timeline::{Clock, Recorder, Source, Step, Timed};

/// The points between the steps of an enrollment, in order: where a deletion of the pod is noticed (and what
/// was done rolled back), and where the debug builds' test hook can pause (see [`super`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// The netns is open; nothing is programmed yet.
    Rules,
    /// The in-pod rules are programmed; next the cache entry and the proxy's Add.
    Proxy,
    /// The proxy acked the Add; next the host probe entry.
    Probe,
    /// The host probe entry is in; next the annotation.
    Annotate,
    /// Annotated: everything is done, the reply is next.
    Enrolled,
}

impl Stage {
    /// Every stage, in enrollment order: the names the test hook accepts.
    #[cfg(any(debug_assertions, test))]
    pub const ALL: [Stage; 5] = [Stage::Rules, Stage::Proxy, Stage::Probe, Stage::Annotate, Stage::Enrolled];

    /// The stage's name, as logs, errors and the test hook spell it.
    pub fn name(self) -> &'static str {
        match self {
            Stage::Rules => "rules",
            Stage::Proxy => "proxy",
            Stage::Probe => "probe",
            Stage::Annotate => "annotate",
            Stage::Enrolled => "enrolled",
        }
    }
}

/// What an enrollment has done so far: what a rollback must undo.
#[derive(Debug, Default)]
struct Done {
    /// The cache entry is in, and the proxy was sent (or is being sent) the Add.
    proxy: bool,
    /// The host probe entry was (or may have been, on a failure) added.
    probe: bool,
    /// The annotation was set: a rollback after it takes it back.
    annotated: bool,
    /// The plugin's answer deadline (its path only): no step starts after it, and a step still running at it is
    /// abandoned, so a plugin that gave up never leaves an enrollment holding the pod's netns.
    answer_by: Option<Instant>,
}

/// What a failed enrollment leaves in place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnFailure {
    /// What was done stays, for a retry (the watch's path: the pod runs on).
    Keep,
    /// Everything done is undone (the plugin's path: the runtime tears the sandbox down), also when the
    /// enrollment ends after `answer_by`.
    Undo {
        /// When the plugin may have stopped waiting for the answer.
        answer_by: Instant,
    },
}

/// What an enrollment does to the node and the API; [`super::Enroller`] does it for real.
pub trait Effects: Sync {
    /// At `stage` of pod `uid`'s enrollment, before the deletion check: the debug builds' test hook pauses here.
    fn pause(&self, stage: Stage, uid: &PodUid) -> impl Future<Output = ()> + Send;
    /// Programs `pod`'s in-pod rules in `netns`; an invalid annotation is refused before anything is programmed.
    fn program_rules(&self, pod: &Pod, netns: Netns) -> impl Future<Output = Result<(), EnrollError>> + Send;
    /// Puts the pod into the cache (the proxy's snapshots).
    fn cache_insert(&self, entry: Enrolled);
    /// Takes pod `uid` out of the cache.
    fn cache_remove(&self, uid: &PodUid);
    /// Sends the proxy pod `uid`'s Add and waits for its ack.
    fn proxy_add(
        &self,
        uid: &PodUid,
        info: WorkloadInfo,
        netns: &OwnedFd,
    ) -> impl Future<Output = Result<(), zds::ZdsError>> + Send;
    /// Sends every proxy connection pod `uid`'s Del.
    fn proxy_del(&self, uid: &PodUid) -> impl Future<Output = Result<(), zds::ZdsError>> + Send;
    /// Adds pod `uid`'s `ips` to the host probe set.
    fn probe_add(&self, uid: &PodUid, ips: &[IpAddr]) -> impl Future<Output = Result<(), String>> + Send;
    /// Takes pod `uid`'s `ips` out of the host probe set.
    fn probe_remove(&self, uid: &PodUid, ips: &[IpAddr]) -> impl Future<Output = Result<(), String>> + Send;
    /// Sets `pod`'s ambient annotation to `state`.
    fn annotate(&self, pod: &Pod, state: &'static str) -> impl Future<Output = Result<(), EnrollError>> + Send;
    /// Takes `pod`'s ambient annotation off in the background, holding the pod's `pass` until the request ends,
    /// so a retried enrollment of the pod waits for it.
    fn take_back_annotation(&self, pod: &Pod, pass: Pass);
}

/// Enrolled pods (the proxy acked them) whose annotation failed: the watch's retry annotates them; nothing else
/// would, since they are enrolled.
#[derive(Debug, Default)]
pub struct Unannotated(Mutex<HashSet<PodUid>>);

impl Unannotated {
    /// Whether pod `uid`'s annotation is still to do.
    pub fn contains(&self, uid: &PodUid) -> bool {
        self.lock().contains(uid)
    }

    /// Pod `uid`'s annotation is to do.
    pub fn insert(&self, uid: PodUid) {
        self.lock().insert(uid);
    }

    /// Pod `uid`'s annotation is done, or the pod left.
    pub fn remove(&self, uid: &PodUid) {
        self.lock().remove(uid);
    }

    fn lock(&self) -> MutexGuard<'_, HashSet<PodUid>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// What the proxy needs to know about a pod's identity.
pub fn workload_info(pod: &Pod) -> WorkloadInfo {
    WorkloadInfo {
        name: crate::pod::name(pod).to_string(),
        namespace: crate::pod::namespace(pod).to_string(),
        service_account: pod
            .spec
            .as_ref()
            .and_then(|s| s.service_account_name.clone())
            .unwrap_or_else(|| "default".into()),
    }
}

/// One enrollment's procedure over `effects`, with the agent's per-pod gate, its recorder and its pending
/// annotations.
pub struct Procedure<'a, E> {
    /// The steps' effects.
    pub effects: &'a E,
    /// One operation per pod, and the deleted pods.
    pub gate: &'a PodGate,
    /// The pod's record and the latency histogram.
    pub recorder: &'a Recorder,
    /// Annotations the watch's retry is to do.
    pub unannotated: &'a Unannotated,
}

impl<E: Effects> Procedure<'_, E> {
    /// Enrolls `pod`, whose netns is `netns`, holding its pass throughout, and leaves what `on_failure` says after
    /// a failure. `search` is the `/proc` search that found `netns`: the record's `netns` step starts with it.
    pub async fn run(
        &self,
        pod: &Pod,
        netns: Netns,
        ips: Vec<IpAddr>,
        on_failure: OnFailure,
        search: Option<Timed>,
    ) -> Result<(), EnrollError> {
        let uid = PodUid::of(pod);
        let span = tracing::info_span!("enroll", pod = %key(pod), uid = %uid);
        async {
            let answer_by = match on_failure {
                OnFailure::Undo { answer_by } => Some(answer_by),
                OnFailure::Keep => None,
            };
            // Another operation on the pod may hold its pass: the plugin waits for the pass no longer than it waits
            // for the answer.
            let Some(pass) = by_deadline(answer_by, self.gate.enter(&uid)).await else {
                return Err(too_late(pod, "waiting for another operation on the pod to end"));
            };
            let mut done = Done { answer_by, ..Done::default() };
            let source = if on_failure == OnFailure::Keep { Source::Watch } else { Source::Plugin };
            // A deleted pod is refused before its first step: its record went with its removal.
            if !self.gate.is_deleted(&uid) {
                self.recorder.begin(&uid, source, &ips, search.map_or_else(Clock::start, Timed::started));
            }
            let mut result = self.steps(pod, &uid, netns, &ips, &mut done, on_failure, search).await;
            let OnFailure::Undo { answer_by } = on_failure else {
                self.recorder.finish(&uid, result.as_ref().map(drop).map_err(ToString::to_string));
                return result;
            };
            if result.is_ok() && Instant::now() > answer_by {
                result = Err(too_late(pod, Stage::Enrolled.name()));
            }
            match &result {
                // A deletion was rolled back at its checkpoint already.
                Err(EnrollError::Deleted { .. }) | Ok(()) => {}
                Err(error) => {
                    self.undo(&uid, &ips, &done).await;
                    tracing::info!(%error, "enrollment for the plugin failed: rolled back");
                }
            }
            // After the rollback, which let go of the netns, and without holding up the answer: this request may
            // take a while. The pass goes with it, so a retried ADD of the pod waits for it.
            if done.annotated && !matches!(result, Ok(()) | Err(EnrollError::Deleted { .. })) {
                self.effects.take_back_annotation(pod, pass);
            }
            self.recorder.finish(&uid, result.as_ref().map(drop).map_err(ToString::to_string));
            result
        }
        .instrument(span)
        .await
    }

    #[allow(clippy::too_many_arguments)] // the procedure's own state, passed down once
    async fn steps(
        &self,
        pod: &Pod,
        uid: &PodUid,
        netns: Netns,
        ips: &[IpAddr],
        done: &mut Done,
        on_failure: OnFailure,
        search: Option<Timed>,
    ) -> Result<(), EnrollError> {
        self.checkpoint(Stage::Rules, pod, uid, ips, done).await?;
        let clock = Clock::start();
        let fd = netns.try_clone_fd().map_err(|e| EnrollError::Netns { pod: key(pod), reason: e.to_string() });
        // The watch's `/proc` search that found the netns is part of this step.
        let step = search.map_or_else(|| clock.stop(), |search| search.then(clock.stop()));
        self.recorder.timed(uid, Step::Netns, step, fd.as_ref().err().map(ToString::to_string));
        let fd = fd?;
        let clock = Clock::start();
        let programmed = self.effects.program_rules(pod, netns).await;
        self.recorder.result(uid, Step::Rules, clock, programmed)?;

        self.checkpoint(Stage::Proxy, pod, uid, ips, done).await?;
        let clock = Clock::start();
        let info = workload_info(pod);
        let fd = Arc::new(fd);
        self.effects.cache_insert(Enrolled {
            uid: uid.clone(),
            info: info.clone(),
            ips: ips.to_vec(),
            netns: Some(fd.clone()),
        });
        done.proxy = true;
        self.recorder.proxy(uid, ProxyState::Sent);
        let added = by_deadline(done.answer_by, self.effects.proxy_add(uid, info, fd.as_ref())).await;
        let Some(added) = added else { return Err(too_late(pod, Step::ProxyAck.name())) };
        if let Err(source) = added {
            self.recorder.proxy(uid, ProxyState::Error { message: source.to_string() });
            self.recorder.step(uid, Step::ProxyAck, clock, Some(source.to_string()));
            // Deleted meanwhile: the deletion wins over the proxy's answer (and the answer over the deadline).
            self.deletion_check(Stage::Probe, pod, uid, ips, done).await?;
            // As Istio's partial add: the plugin's ADD fails too, but the pod says why until its retry.
            let _ = by_deadline(done.answer_by, self.effects.annotate(pod, "pending")).await;
            return Err(EnrollError::Proxy { pod: key(pod), source });
        }
        self.recorder.proxy(uid, ProxyState::Acked);
        self.recorder.step(uid, Step::ProxyAck, clock, None);

        self.checkpoint(Stage::Probe, pod, uid, ips, done).await?;
        done.probe = true;
        let clock = Clock::start();
        let probed = self.effects.probe_add(uid, ips).await;
        if let Err(e) = &probed {
            tracing::error!(error = %e, "host probe set");
        }
        self.recorder.step(uid, Step::Probe, clock, probed.err());

        self.checkpoint(Stage::Annotate, pod, uid, ips, done).await?;
        let clock = Clock::start();
        let annotated = by_deadline(done.answer_by, self.effects.annotate(pod, AMBIENT_REDIRECTION_ENABLED)).await;
        // A request abandoned at the deadline may still land: the rollback takes it back like a done one.
        done.annotated = annotated.as_ref().is_none_or(Result::is_ok);
        let annotated = annotated.unwrap_or_else(|| Err(too_late(pod, Step::Annotate.name())));
        self.recorder.step(uid, Step::Annotate, clock, annotated.as_ref().err().map(ToString::to_string));
        if let Err(e) = annotated {
            // A deleted pod cannot be annotated: that is the deletion, not an API failure. The failure names its
            // own step, also when it is the deadline's.
            self.deletion_check(Stage::Enrolled, pod, uid, ips, done).await?;
            if on_failure == OnFailure::Keep {
                self.unannotated.insert(uid.clone());
            }
            return Err(e);
        }
        self.unannotated.remove(uid);
        self.checkpoint(Stage::Enrolled, pod, uid, ips, done).await?;
        tracing::info!(?ips, "enrolled");
        Ok(())
    }

    /// Between two steps: pauses here if the test hook says so (debug builds), then, if the pod was deleted
    /// meanwhile, undoes what was `done` and fails with [`EnrollError::Deleted`]; past the plugin's deadline, fails
    /// with [`EnrollError::TooLate`] (the caller's rollback undoes what was done).
    async fn checkpoint(
        &self,
        stage: Stage,
        pod: &Pod,
        uid: &PodUid,
        ips: &[IpAddr],
        done: &Done,
    ) -> Result<(), EnrollError> {
        self.deletion_check(stage, pod, uid, ips, done).await?;
        if done.answer_by.is_some_and(|by| Instant::now() >= by) {
            return Err(too_late(pod, stage.name()));
        }
        Ok(())
    }

    /// [`Procedure::checkpoint`] without the deadline: after a failed step, whose error is the answer unless the
    /// pod was deleted.
    async fn deletion_check(
        &self,
        stage: Stage,
        pod: &Pod,
        uid: &PodUid,
        ips: &[IpAddr],
        done: &Done,
    ) -> Result<(), EnrollError> {
        self.effects.pause(stage, uid).await;
        if !self.gate.is_deleted(uid) {
            return Ok(());
        }
        self.undo(uid, ips, done).await;
        tracing::info!(stage = stage.name(), "pod deleted during its enrollment: refused and rolled back");
        Err(EnrollError::Deleted { pod: key(pod), uid: uid.to_string(), stage: stage.name() })
    }

    /// Undoes what an enrollment of pod `uid` has `done`: out of the cache (first, so a proxy connecting now gets
    /// a snapshot without it) and the proxy's Del, then the host probe entry.
    async fn undo(&self, uid: &PodUid, ips: &[IpAddr], done: &Done) {
        if done.proxy {
            self.effects.cache_remove(uid);
            if let Err(e) = self.effects.proxy_del(uid).await {
                tracing::warn!(error = %e, "proxy Del of a pod not enrolled after all");
            }
        }
        if done.probe {
            if let Err(e) = self.effects.probe_remove(uid, ips).await {
                tracing::error!(error = %e, "host probe set");
            }
        }
    }
}

/// The failure of a plugin enrollment of `pod` not done by its answer deadline, at `step`.
pub fn too_late(pod: &Pod, step: &'static str) -> EnrollError {
    EnrollError::TooLate { pod: key(pod), step, deadline: cni::plugin_event::AGENT_ANSWER_DEADLINE }
}

/// Runs `step` to its end, or until `deadline` (when there is one): `None` when the deadline came first.
async fn by_deadline<T>(deadline: Option<Instant>, step: impl Future<Output = T>) -> Option<T> {
    match deadline {
        Some(by) => tokio::time::timeout_at(by.into(), step).await.ok(),
        None => Some(step.await),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use k8s_openapi::api::core::v1::PodStatus;
    use kube::api::ObjectMeta;
    use prometheus_client::registry::Registry;

    use super::*;
    use crate::metrics::Metrics;

    /// The effects, logged in the order they ran; fails the effects named in `fail`, deletes the pod at the stage
    /// `delete_at` names or while the effect `delete_in` names runs, and with `hung_annotation` never answers the
    /// annotation request.
    #[derive(Default)]
    struct Fake {
        log: Mutex<Vec<&'static str>>,
        fail: Vec<&'static str>,
        delete_at: Option<Stage>,
        delete_in: Option<&'static str>,
        hung_annotation: bool,
        gate: PodGate,
    }

    impl Fake {
        fn did(&self, effect: &'static str, uid: &PodUid) -> bool {
            self.log.lock().unwrap().push(effect);
            if self.delete_in == Some(effect) {
                self.gate.mark_deleted(uid);
            }
            !self.fail.contains(&effect)
        }

        fn log(&self) -> Vec<&'static str> {
            self.log.lock().unwrap().clone()
        }
    }

    impl Effects for Fake {
        async fn pause(&self, stage: Stage, uid: &PodUid) {
            if self.delete_at == Some(stage) {
                self.gate.mark_deleted(uid);
            }
        }

        async fn program_rules(&self, pod: &Pod, _netns: Netns) -> Result<(), EnrollError> {
            let ok = self.did("rules", &PodUid::of(pod));
            ok.then_some(()).ok_or_else(|| EnrollError::Rules { pod: key(pod), reason: "refused".into() })
        }

        fn cache_insert(&self, entry: Enrolled) {
            self.did("cache insert", &entry.uid);
        }

        fn cache_remove(&self, uid: &PodUid) {
            self.did("cache remove", uid);
        }

        async fn proxy_add(&self, uid: &PodUid, _: WorkloadInfo, _: &OwnedFd) -> Result<(), zds::ZdsError> {
            self.did("proxy add", uid).then_some(()).ok_or(zds::ZdsError::NoProxy)
        }

        async fn proxy_del(&self, uid: &PodUid) -> Result<(), zds::ZdsError> {
            self.did("proxy del", uid).then_some(()).ok_or(zds::ZdsError::NoProxy)
        }

        async fn probe_add(&self, uid: &PodUid, _: &[IpAddr]) -> Result<(), String> {
            self.did("probe add", uid).then_some(()).ok_or_else(|| "netlink".into())
        }

        async fn probe_remove(&self, uid: &PodUid, _: &[IpAddr]) -> Result<(), String> {
            self.did("probe remove", uid).then_some(()).ok_or_else(|| "netlink".into())
        }

        async fn annotate(&self, pod: &Pod, state: &'static str) -> Result<(), EnrollError> {
            let effect = if state == AMBIENT_REDIRECTION_ENABLED { "annotate enabled" } else { "annotate pending" };
            let ok = self.did(effect, &PodUid::of(pod));
            if self.hung_annotation {
                // The API never answers: only the deadline ends the step.
                std::future::pending::<()>().await;
            }
            let timeout = EnrollError::ApiTimeout { pod: key(pod), what: "annotate", after: Duration::ZERO };
            ok.then_some(()).ok_or(timeout)
        }

        fn take_back_annotation(&self, pod: &Pod, _pass: Pass) {
            self.did("annotation taken back", &PodUid::of(pod));
        }
    }

    fn pod() -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some("web".into()),
                namespace: Some("lab".into()),
                uid: Some("u1".into()),
                ..ObjectMeta::default()
            },
            status: Some(PodStatus { pod_ip: Some("10.0.0.1".into()), ..PodStatus::default() }),
            ..Pod::default()
        }
    }

    /// What one enrollment over `fake` left: its result, the effects in order, and the agent's state after it.
    struct Ran {
        result: Result<(), EnrollError>,
        log: Vec<&'static str>,
        recorder: Recorder,
        unannotated: Unannotated,
    }

    async fn run(fake: Fake, on_failure: OnFailure) -> Ran {
        let recorder = Recorder::new(Metrics::register(&mut Registry::default()));
        let unannotated = Unannotated::default();
        let procedure = Procedure { effects: &fake, gate: &fake.gate, recorder: &recorder, unannotated: &unannotated };
        let netns = Netns::current().expect("this process's netns");
        let result = procedure.run(&pod(), netns, crate::pod::ips(&pod()), on_failure, None).await;
        Ran { result, log: fake.log(), recorder, unannotated }
    }

    fn plugin() -> OnFailure {
        OnFailure::Undo { answer_by: Instant::now() + Duration::from_secs(60) }
    }

    const ENROLLED: [&str; 5] = ["rules", "cache insert", "proxy add", "probe add", "annotate enabled"];

    #[tokio::test]
    async fn the_steps_run_in_order_and_are_recorded_under_the_step_names() {
        for on_failure in [OnFailure::Keep, plugin()] {
            let ran = run(Fake::default(), on_failure).await;
            ran.result.unwrap();
            assert_eq!(ran.log, ENROLLED, "{on_failure:?}");
            let timeline = ran.recorder.timelines().get(&PodUid::from("u1")).unwrap();
            let phases: Vec<&str> = timeline.phases.iter().map(|p| p.phase.as_str()).collect();
            assert_eq!(phases, ["netns", "rules", "proxy_ack", "probe", "annotate"]);
            assert_eq!(timeline.outcome, "enrolled");
        }
    }

    #[tokio::test]
    async fn a_deletion_at_each_stage_undoes_what_was_done_cache_then_proxy_then_probe() {
        let expected: [(Stage, &[&str]); 5] = [
            (Stage::Rules, &[]),
            (Stage::Proxy, &["rules"]),
            (Stage::Probe, &["rules", "cache insert", "proxy add", "cache remove", "proxy del"]),
            (
                Stage::Annotate,
                &["rules", "cache insert", "proxy add", "probe add", "cache remove", "proxy del", "probe remove"],
            ),
            (
                Stage::Enrolled,
                &[
                    "rules",
                    "cache insert",
                    "proxy add",
                    "probe add",
                    "annotate enabled",
                    "cache remove",
                    "proxy del",
                    "probe remove",
                ],
            ),
        ];
        assert_eq!(expected.map(|(s, _)| s), Stage::ALL);
        for on_failure in [OnFailure::Keep, plugin()] {
            for (stage, log) in expected {
                let ran = run(Fake { delete_at: Some(stage), ..Fake::default() }, on_failure).await;
                let Err(EnrollError::Deleted { stage: at, .. }) = ran.result else {
                    panic!("{stage:?}, {on_failure:?}: {:?}", ran.result)
                };
                assert_eq!(at, stage.name());
                assert_eq!(ran.log, log, "deleted at {stage:?}, {on_failure:?}");
            }
        }
    }

    #[tokio::test]
    async fn a_deleted_pod_is_refused_before_its_first_step_and_gets_no_record() {
        let fake = Fake::default();
        fake.gate.mark_deleted(&PodUid::from("u1"));
        let ran = run(fake, plugin()).await;
        assert!(matches!(ran.result, Err(EnrollError::Deleted { stage: "rules", .. })), "{:?}", ran.result);
        assert_eq!(ran.log, Vec::<&str>::new());
        assert!(ran.recorder.timelines().get(&PodUid::from("u1")).is_none());
    }

    #[tokio::test]
    async fn the_plugins_failed_enrollment_rolls_back_what_was_done_in_order() {
        let expected: [(&str, &[&str]); 3] = [
            ("rules", &["rules"]),
            ("proxy add", &["rules", "cache insert", "proxy add", "annotate pending", "cache remove", "proxy del"]),
            (
                "annotate enabled",
                &[
                    "rules",
                    "cache insert",
                    "proxy add",
                    "probe add",
                    "annotate enabled",
                    "cache remove",
                    "proxy del",
                    "probe remove",
                ],
            ),
        ];
        for (failing, log) in expected {
            let ran = run(Fake { fail: vec![failing], ..Fake::default() }, plugin()).await;
            assert!(ran.result.is_err(), "{failing}");
            assert_eq!(ran.log, log, "{failing} failed");
            assert!(!ran.unannotated.contains(&PodUid::from("u1")), "{failing}: nothing left for a retry");
        }
    }

    #[tokio::test]
    async fn a_failed_host_probe_entry_fails_nothing() {
        for on_failure in [OnFailure::Keep, plugin()] {
            let ran = run(Fake { fail: vec!["probe add"], ..Fake::default() }, on_failure).await;
            ran.result.unwrap();
            assert_eq!(ran.log, ENROLLED);
        }
    }

    #[tokio::test]
    async fn an_annotation_abandoned_at_the_deadline_is_rolled_back_then_taken_back_last() {
        // The steps before the annotation take no time in the fake: a loaded machine still has them done by then.
        let answer_by = Instant::now() + Duration::from_secs(1);
        let fake = Fake { hung_annotation: true, ..Fake::default() };
        let ran = run(fake, OnFailure::Undo { answer_by }).await;
        assert!(matches!(ran.result, Err(EnrollError::TooLate { step: "annotate", .. })), "{:?}", ran.result);
        let mut log = ENROLLED.to_vec();
        log.extend(["cache remove", "proxy del", "probe remove", "annotation taken back"]);
        assert_eq!(ran.log, log);
    }

    #[tokio::test]
    async fn past_the_plugins_deadline_no_step_starts() {
        let ran = run(Fake::default(), OnFailure::Undo { answer_by: Instant::now() }).await;
        assert!(matches!(ran.result, Err(EnrollError::TooLate { step: "rules", .. })), "{:?}", ran.result);
        assert_eq!(ran.log, Vec::<&str>::new());
    }

    #[tokio::test]
    async fn the_watchs_failed_enrollment_keeps_what_was_done_for_its_retry() {
        let ran = run(Fake { fail: vec!["proxy add"], ..Fake::default() }, OnFailure::Keep).await;
        assert!(matches!(ran.result, Err(EnrollError::Proxy { .. })), "{:?}", ran.result);
        assert_eq!(ran.log, ["rules", "cache insert", "proxy add", "annotate pending"]);

        let ran = run(Fake { fail: vec!["annotate enabled"], ..Fake::default() }, OnFailure::Keep).await;
        assert!(ran.result.is_err());
        assert_eq!(ran.log, ENROLLED, "nothing undone");
        assert!(ran.unannotated.contains(&PodUid::from("u1")), "the annotation is left for the watch's retry");
    }

    #[tokio::test]
    async fn a_deletion_wins_over_a_failed_proxy_add_or_annotation() {
        for on_failure in [OnFailure::Keep, plugin()] {
            let fake = Fake { fail: vec!["proxy add"], delete_in: Some("proxy add"), ..Fake::default() };
            let ran = run(fake, on_failure).await;
            assert!(matches!(ran.result, Err(EnrollError::Deleted { stage: "probe", .. })), "{:?}", ran.result);
            assert_eq!(ran.log, ["rules", "cache insert", "proxy add", "cache remove", "proxy del"], "no pending");

            let failing = "annotate enabled";
            let fake = Fake { fail: vec![failing], delete_in: Some(failing), ..Fake::default() };
            let ran = run(fake, on_failure).await;
            assert!(matches!(ran.result, Err(EnrollError::Deleted { stage: "enrolled", .. })), "{:?}", ran.result);
            assert!(!ran.unannotated.contains(&PodUid::from("u1")), "a deleted pod is not left for a retry");
            assert_eq!(ran.log.last(), Some(&"probe remove"));
        }
    }
}

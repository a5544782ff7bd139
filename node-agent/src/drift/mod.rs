//! Drift detection and repair: rules can disappear after enrollment (another agent flushes a table, an init
//! container or a debug session changes them) and nothing would notice until traffic breaks. Every
//! `DRIFT_CHECK_INTERVAL` (jittered) and on demand ([`Drift::check_now`]) the agent compares:
//!
//! - each enrolled ambient pod's in-pod rules with the plan it programs ([`Backend::inspect_ambient`]: one
//!   `iptables-save` per family or one nftables rule dump), and re-programs a pod that drifted with the
//!   backend's atomic apply (`kind="inpod_rules"`);
//! - the host netns's probe SNAT rule ([`HostProbe::inspect`]) and each pod's probe set entries, re-ensured or
//!   re-added when gone (`kind="host_probe"`);
//! - running sidecar pods' rules with the plugin's plan (netns found through `/proc`), re-programmed only with
//!   `DRIFT_REPAIR_SIDECAR=true` (`kind="sidecar_rules"`).
//!
//! Sidecar-only installs (`AMBIENT_ENABLED=false`) have no ambient state: there only the sidecar pods are checked.
//!
//! Drift is counted in `nodeagent_drift_detected_total{kind}` when first seen (a drift that stays unrepaired
//! counts once) and repairs in `nodeagent_drift_repaired_total{kind}`; each repair is logged once, as a warning
//! with the missing and unexpected lines.
//!
//! Safety: an ambient pod is checked holding its pass ([`crate::pod_gate`]), so a check never runs during the
//! pod's enrollment or removal and never touches a removed pod; the pass travels with the blocking work, so a
//! check that outlives its [`PER_POD_TIMEOUT`] still holds it until it ends, and the pod is skipped while it
//! runs. A failing repair is retried with a growing backoff and logged throttled.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::runtime::reflector::{ObjectRef, Store};
use netns::Netns;
use redirect::backend::Backend;
use redirect::hostprobe::ProbeEntry;
use redirect::inspect::RuleReport;
use serde::Serialize;
use tokio::sync::Notify;

use crate::ambient_state::AmbientState;
use crate::cache::Enrolled;
use crate::config::Config;
use crate::metrics::{DriftKind, Metrics};
use crate::pod::{self, ips as pod_ips, PodUid};
use crate::repair::in_place::{sidecar_plan, InPlace};

pub mod read;

use read::{ambient_plan, blocking, entry_netns, missing_probe_ips};
pub use read::{find_netns, inspect_pod, inspect_sidecar, DriftError};

/// The longest one pod's check (read, and repair if needed) may hold up the round; the pod is skipped until the
/// late check ends.
pub const PER_POD_TIMEOUT: Duration = Duration::from_secs(20);
/// First wait before re-trying a repair that failed; doubles per failure up to [`MAX_REPAIR_BACKOFF`].
const FIRST_REPAIR_BACKOFF: Duration = Duration::from_secs(5);
/// Longest wait between attempts to repair a pod whose repair keeps failing.
const MAX_REPAIR_BACKOFF: Duration = Duration::from_secs(10 * 60);
/// Most lines of a diff kept per pod (a table flooded with foreign rules does not flood the agent's memory).
const MAX_DIFF_LINES: usize = 50;

/// Metric label of an ambient pod's rules.
pub const KIND_INPOD: &str = "inpod_rules";
/// Metric label of the host probe rule and entries.
pub const KIND_HOST_PROBE: &str = "host_probe";
/// Metric label of a sidecar pod's rules.
pub const KIND_SIDECAR: &str = "sidecar_rules";

/// The latest drift check of one pod, for `explain`.
#[derive(Debug, Clone, Serialize)]
pub struct LastCheck {
    /// `ambient` or `sidecar`.
    pub mode: &'static str,
    /// When the check ran (RFC 3339).
    pub checked_at: String,
    /// Whether the rules (or, for ambient, the probe entry) had drifted when checked.
    pub drifted: bool,
    /// Expected lines that were missing (at most 50).
    pub missing: Vec<String>,
    /// Lines found that were not expected (at most 50).
    pub unexpected: Vec<String>,
    /// Ambient only: whether the pod was in the host probe set.
    pub in_host_probe_set: Option<bool>,
    /// When the pod was last repaired (RFC 3339).
    pub last_repair: Option<String>,
    /// Repairs of this pod since the agent started.
    pub repairs: u64,
    /// Why the latest check or repair failed.
    pub error: Option<String>,
}

fn now() -> String {
    jiff::Timestamp::now().to_string()
}

fn capped(lines: &[String]) -> Vec<String> {
    lines.iter().take(MAX_DIFF_LINES).cloned().collect()
}

/// A factor in [0.85, 1.15] from the clock's nanoseconds: enough spread that agents and pods do not check in step.
fn jitter(interval: Duration) -> Duration {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().subsec_nanos();
    let factor = 0.85 + 0.3 * (f64::from(nanos % 1000) / 1000.0);
    interval.mul_f64(factor)
}

/// What one pod's check found and did, from its blocking task.
struct Outcome {
    report: Option<RuleReport>,
    in_probe_set: Option<bool>,
    repaired_rules: bool,
    repaired_probe: bool,
    error: Option<String>,
}

/// Per-pod memory of the loop: the latest check, the repair backoff, and whether a check is still running.
#[derive(Debug, Default)]
struct PodState {
    last: Option<LastCheck>,
    /// Drift seen at the previous check and not repaired (so it is not counted as detected again).
    drift_open: bool,
    failures: u32,
    next_repair: Option<Instant>,
    busy: Arc<std::sync::atomic::AtomicBool>,
    throttle: daemon::throttle::Throttle,
}

impl PodState {
    fn may_repair(&self) -> bool {
        self.next_repair.is_none_or(|at| Instant::now() >= at)
    }

    fn failed(&mut self) {
        self.failures = self.failures.saturating_add(1);
        let backoff = FIRST_REPAIR_BACKOFF.saturating_mul(1 << self.failures.min(8)).min(MAX_REPAIR_BACKOFF);
        self.next_repair = Some(Instant::now() + backoff);
    }

    fn succeeded(&mut self) {
        (self.failures, self.next_repair) = (0, None);
    }
}

/// The drift checker: cheap to clone; clones share the state, so the admin endpoint can trigger a check and
/// `explain` can read the latest results.
#[derive(Clone)]
pub struct Drift {
    inner: Arc<Inner>,
}

struct Inner {
    /// The ambient side (enrolled pods, host probe); `None` in sidecar-only installs.
    ambient: Option<Arc<AmbientState>>,
    /// The backend the sidecar pods' rules are read and re-programmed with.
    backend: Backend,
    pods: Store<Pod>,
    metrics: Metrics,
    interval: Duration,
    repair_sidecar: bool,
    sidecar: InPlace,
    proc_dir: std::path::PathBuf,
    wake: Notify,
    state: Mutex<HashMap<PodUid, PodState>>,
    host_throttle: Mutex<daemon::throttle::Throttle>,
    /// The host probe rule drifted at the previous check and is not repaired yet (counted once).
    host_drift_open: std::sync::atomic::AtomicBool,
}

impl Drift {
    /// The checker of this node's sidecar pods, read with `backend`, and, with `ambient` (ambient on), of its
    /// enrolled pods and the host probe rule; `pods` is the watch's store of this node's pods (the annotations the
    /// plans come from, and the sidecar pods to check).
    pub fn new(
        config: &Config,
        backend: Backend,
        ambient: Option<Arc<AmbientState>>,
        pods: Store<Pod>,
        metrics: Metrics,
    ) -> Self {
        let sidecar = InPlace::new(backend, config);
        Self {
            inner: Arc::new(Inner {
                ambient,
                backend,
                pods,
                metrics,
                interval: config.drift_check_interval,
                repair_sidecar: config.drift_repair_sidecar,
                sidecar,
                proc_dir: config.host_proc.clone(),
                wake: Notify::new(),
                state: Mutex::default(),
                host_throttle: Mutex::default(),
                host_drift_open: Default::default(),
            }),
        }
    }

    /// Asks for a check of every pod now (the loop runs one round as soon as it is free).
    pub fn check_now(&self) {
        self.inner.wake.notify_one();
    }

    /// The latest check of pod `uid`, if it was checked.
    pub fn last_check(&self, uid: &str) -> Option<LastCheck> {
        self.state().get(uid).and_then(|s| s.last.clone())
    }

    fn state(&self) -> MutexGuard<'_, HashMap<PodUid, PodState>> {
        self.inner.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Checks every `DRIFT_CHECK_INTERVAL` (jittered; never with `0s`) and whenever [`Drift::check_now`] asks.
    pub async fn run(self) {
        let interval = self.inner.interval;
        if interval.is_zero() {
            tracing::info!("periodic drift check off (DRIFT_CHECK_INTERVAL=0s); on-demand checks only");
        } else {
            tracing::info!(?interval, repair_sidecar = self.inner.repair_sidecar, "drift check on");
        }
        loop {
            let wait = if interval.is_zero() { Duration::from_secs(365 * 24 * 3600) } else { jitter(interval) };
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = self.inner.wake.notified() => {}
            }
            self.round().await;
        }
    }

    /// One check of the host probe rule, every enrolled ambient pod and every sidecar pod.
    async fn round(&self) {
        let mut seen: Vec<PodUid> = Vec::new();
        if let Some(ambient) = &self.inner.ambient {
            seen = self.check_ambient_side(ambient).await;
        }
        seen.extend(self.check_sidecars().await);
        // Pods gone since: their memory goes (the map holds this node's pods only).
        self.state().retain(|uid, s| seen.contains(uid) || s.busy.load(std::sync::atomic::Ordering::Relaxed));
    }

    /// The host probe rule and every enrolled ambient pod. Returns the UIDs checked.
    async fn check_ambient_side(&self, ambient: &Arc<AmbientState>) -> Vec<PodUid> {
        self.check_host_probe(ambient).await;
        let probe = ambient.hostprobe();
        let entries = match blocking(move || probe.entries().map_err(|e| DriftError::HostProbe(e.to_string()))).await {
            Ok(entries) => Some(entries),
            Err(e) => {
                self.host_warn(&format!("reading the host probe set: {e}"));
                None
            }
        };
        let mut seen = Vec::new();
        for entry in ambient.cache().pods() {
            seen.push(entry.uid.clone());
            self.check_ambient(ambient, entry.uid.clone(), entries.as_deref()).await;
        }
        seen
    }

    fn host_warn(&self, message: &str) {
        let held = self.inner.host_throttle.lock().unwrap_or_else(std::sync::PoisonError::into_inner).hit();
        if let Some(held) = held {
            tracing::warn!(held, "drift check: {message}");
        }
    }

    /// The host netns's probe SNAT rule: re-ensured when it drifted.
    async fn check_host_probe(&self, ambient: &AmbientState) {
        let probe = ambient.hostprobe();
        let result = blocking(move || {
            let report = probe.inspect().map_err(|e| DriftError::HostProbe(e.to_string()))?;
            if report.drifted() {
                let repaired = probe.reensure().map_err(|e| e.to_string());
                return Ok(Some((report, repaired)));
            }
            Ok(None)
        })
        .await;
        let kind = DriftKind { kind: KIND_HOST_PROBE };
        let open = &self.inner.host_drift_open;
        match result {
            Ok(None) => open.store(false, std::sync::atomic::Ordering::Relaxed),
            Ok(Some((report, repaired))) => {
                if !open.swap(repaired.is_err(), std::sync::atomic::Ordering::Relaxed) {
                    self.inner.metrics.drift_detected.get_or_create(&kind).inc();
                }
                match repaired {
                    Ok(()) => {
                        self.inner.metrics.drift_repaired.get_or_create(&kind).inc();
                        tracing::warn!(
                            backend = %report.backend,
                            missing = ?report.missing,
                            unexpected = ?report.unexpected,
                            "host probe SNAT rule drifted: re-programmed"
                        );
                    }
                    Err(e) => self.host_warn(&format!("host probe SNAT rule drifted; re-programming failed: {e}")),
                }
            }
            Err(e) => self.host_warn(&format!("reading the host probe SNAT rule: {e}")),
        }
    }

    /// One enrolled ambient pod, under its pass.
    async fn check_ambient(&self, ambient: &Arc<AmbientState>, uid: PodUid, entries: Option<&[ProbeEntry]>) {
        let busy = {
            let mut state = self.state();
            let s = state.entry(uid.clone()).or_default();
            if s.busy.swap(true, std::sync::atomic::Ordering::AcqRel) {
                return; // the previous check of this pod is still running
            }
            s.busy.clone()
        };
        let release = BusyGuard(busy);
        // Waiting for the pass is bounded too: an enrollment holding it for long only delays this pod's check.
        let Ok(Some((pass, entry))) = tokio::time::timeout(PER_POD_TIMEOUT, ambient.enrolled_pass(&uid)).await else {
            return;
        };
        let Some(pod) = self.pod_of(&entry) else { return };
        let may_repair = self.state().get(&uid).is_none_or(PodState::may_repair);
        let plan = match ambient_plan(ambient, &pod) {
            Ok(plan) => plan,
            Err(e) => return self.record_error(&uid, "ambient", e.to_string()),
        };
        let netns = match entry_netns(&entry) {
            Ok(netns) => netns,
            Err(DriftError::NoNetns) => return, // Keep at the proxy: nothing to compare
            Err(e) => return self.record_error(&uid, "ambient", e.to_string()),
        };
        let (backend, probe) = (ambient.backend(), ambient.hostprobe());
        let missing_ips = entries.map(|entries| missing_probe_ips(&probe, entries, &entry));
        let task = tokio::task::spawn_blocking(move || {
            // The pass and the busy flag go with the work: they are released when it ends, even after a timeout.
            let (_pass, _release) = (pass, release);
            let mut out =
                Outcome { report: None, in_probe_set: None, repaired_rules: false, repaired_probe: false, error: None };
            match backend.inspect_ambient(&netns, &plan) {
                Ok(report) => {
                    if report.drifted() && may_repair {
                        match backend.apply_ambient(&netns, &plan) {
                            Ok(()) => out.repaired_rules = true,
                            Err(e) => out.error = Some(format!("re-programming the in-pod rules: {e}")),
                        }
                    }
                    out.report = Some(report);
                }
                Err(e) => out.error = Some(format!("reading the in-pod rules: {e}")),
            }
            match missing_ips {
                None => {}
                Some(missing) if missing.is_empty() => out.in_probe_set = Some(true),
                // Confirmed under the pass before repairing: the round's snapshot may predate the pod's entry.
                Some(_) => match probe.entries().map(|now| missing_probe_ips(&probe, &now, &entry)) {
                    Ok(ips) if !ips.is_empty() => {
                        out.in_probe_set = Some(false);
                        if may_repair {
                            match probe.add(&entry.uid, &ips) {
                                Ok(()) => out.repaired_probe = true,
                                Err(e) => out.error = Some(format!("re-adding the host probe entry: {e}")),
                            }
                        }
                    }
                    Ok(_) => out.in_probe_set = Some(true),
                    Err(e) => out.error = Some(format!("reading the host probe set: {e}")),
                },
            }
            out
        });
        let outcome = match tokio::time::timeout(PER_POD_TIMEOUT, task).await {
            Ok(Ok(outcome)) => outcome,
            Ok(Err(e)) => return self.record_error(&uid, "ambient", format!("task: {e}")),
            Err(_) => {
                return self.record_error(&uid, "ambient", format!("check did not end within {PER_POD_TIMEOUT:?}"))
            }
        };
        self.record(&uid, &pod, "ambient", outcome, KIND_INPOD);
    }

    /// The store's pod of an enrolled entry (same UID), whose annotations the plan comes from.
    fn pod_of(&self, entry: &Enrolled) -> Option<Arc<Pod>> {
        let key = ObjectRef::new(&entry.info.name).within(&entry.info.namespace);
        self.inner.pods.get(&key).filter(|p| p.metadata.uid.as_deref() == Some(entry.uid.as_str()))
    }

    /// Sidecar pods: running, not terminating, not enrolled, ones the plugin redirects; their netns found in one
    /// `/proc` scan. Returns the UIDs checked.
    async fn check_sidecars(&self) -> Vec<PodUid> {
        let cache = self.inner.ambient.as_ref().map(|e| e.cache());
        let candidates: Vec<Arc<Pod>> = self
            .inner
            .pods
            .state()
            .into_iter()
            .filter(|p| {
                let uid = PodUid::of(p);
                pod::is_running(p)
                    && !pod::is_terminating(p)
                    && !uid.is_empty()
                    && cache.is_none_or(|c| c.get(&uid).is_none())
                    && !pod_ips(p).is_empty()
                    && self.inner.sidecar.skip_reason(p).is_none()
            })
            .collect();
        if candidates.is_empty() {
            return Vec::new();
        }
        let proc_dir = self.inner.proc_dir.clone();
        let asked: Vec<(String, Vec<IpAddr>)> = candidates.iter().map(|p| (PodUid::of(p).into(), pod_ips(p))).collect();
        let scan = blocking(move || {
            let borrowed: Vec<(&str, &[IpAddr])> = asked.iter().map(|(u, ips)| (u.as_str(), ips.as_slice())).collect();
            netns::discover::find_pods_netns(&proc_dir, &borrowed).map_err(|e| DriftError::Backend(e.to_string()))
        });
        let mut found = match scan.await {
            Ok(found) => found,
            Err(e) => {
                self.host_warn(&format!("scanning /proc for sidecar pods' netns: {e}"));
                return Vec::new();
            }
        };
        let mut checked = Vec::new();
        for pod in candidates {
            let uid = PodUid::of(&pod);
            if let Some(netns) = found.remove(uid.as_str()) {
                checked.push(uid.clone());
                self.check_sidecar(uid, pod, netns).await;
            }
        }
        checked
    }

    async fn check_sidecar(&self, uid: PodUid, pod: Arc<Pod>, netns: Netns) {
        let (may_repair, busy) = {
            let mut state = self.state();
            let s = state.entry(uid.clone()).or_default();
            if s.busy.swap(true, std::sync::atomic::Ordering::AcqRel) {
                return;
            }
            (self.inner.repair_sidecar && s.may_repair(), s.busy.clone())
        };
        let release = BusyGuard(busy);
        let plan = match sidecar_plan(&pod) {
            Ok(plan) => plan,
            Err(e) => return self.record_error(&uid, "sidecar", e.to_string()),
        };
        let backend = self.inner.backend;
        let task = tokio::task::spawn_blocking(move || {
            let _release = release;
            let mut out =
                Outcome { report: None, in_probe_set: None, repaired_rules: false, repaired_probe: false, error: None };
            match backend.inspect_sidecar(&netns, &plan) {
                Ok(report) => {
                    if report.drifted() && may_repair {
                        match backend.program(&netns, &plan) {
                            Ok(()) => out.repaired_rules = true,
                            Err(e) => out.error = Some(format!("re-programming the sidecar rules: {e}")),
                        }
                    }
                    out.report = Some(report);
                }
                Err(e) => out.error = Some(format!("reading the sidecar rules: {e}")),
            }
            out
        });
        match tokio::time::timeout(PER_POD_TIMEOUT, task).await {
            Ok(Ok(outcome)) => self.record(&uid, &pod, "sidecar", outcome, KIND_SIDECAR),
            Ok(Err(e)) => self.record_error(&uid, "sidecar", format!("task: {e}")),
            Err(_) => self.record_error(&uid, "sidecar", format!("check did not end within {PER_POD_TIMEOUT:?}")),
        }
    }

    /// Counts, logs and remembers one pod's check.
    fn record(&self, uid: &PodUid, pod: &Pod, mode: &'static str, out: Outcome, kind: &'static str) {
        let name = pod::key(pod);
        let metrics = &self.inner.metrics;
        let rules_drifted = out.report.as_ref().is_some_and(RuleReport::drifted);
        let probe_drifted = out.in_probe_set == Some(false);
        let mut state = self.state();
        let s = state.entry(uid.clone()).or_default();
        if (rules_drifted || probe_drifted) && !s.drift_open {
            if rules_drifted {
                metrics.drift_detected.get_or_create(&DriftKind { kind }).inc();
            }
            if probe_drifted {
                metrics.drift_detected.get_or_create(&DriftKind { kind: KIND_HOST_PROBE }).inc();
            }
        }
        let repaired = out.repaired_rules || out.repaired_probe;
        if out.repaired_rules {
            metrics.drift_repaired.get_or_create(&DriftKind { kind }).inc();
        }
        if out.repaired_probe {
            metrics.drift_repaired.get_or_create(&DriftKind { kind: KIND_HOST_PROBE }).inc();
        }
        let (missing, unexpected) =
            out.report.as_ref().map(|r| (capped(&r.missing), capped(&r.unexpected))).unwrap_or_default();
        let backend = out.report.as_ref().map(|r| r.backend.clone()).unwrap_or_default();
        if repaired {
            tracing::warn!(
                pod = %name, uid = %uid, %backend, rules = out.repaired_rules, host_probe_entry = out.repaired_probe,
                ?missing, ?unexpected, "{mode} pod's rules drifted: repaired"
            );
        } else if rules_drifted && !s.drift_open && out.error.is_none() {
            let why = if mode == "sidecar" && !self.inner.repair_sidecar {
                "DRIFT_REPAIR_SIDECAR is off"
            } else {
                "backing off after failed repairs"
            };
            tracing::warn!(pod = %name, uid = %uid, %backend, ?missing, ?unexpected, "{mode} pod's rules drifted; not repaired: {why}");
        }
        if let Some(error) = &out.error {
            s.failed();
            if let Some(held) = s.throttle.hit() {
                tracing::warn!(pod = %name, uid = %uid, held, error = %error, "drift check");
            }
        } else if repaired {
            s.succeeded();
        }
        s.drift_open = (rules_drifted || probe_drifted) && !repaired;
        let previous = s.last.take();
        s.last = Some(LastCheck {
            mode,
            checked_at: now(),
            drifted: rules_drifted || probe_drifted,
            missing,
            unexpected,
            in_host_probe_set: out.in_probe_set.or(previous.as_ref().and_then(|p| p.in_host_probe_set)),
            last_repair: if repaired { Some(now()) } else { previous.as_ref().and_then(|p| p.last_repair.clone()) },
            repairs: previous.as_ref().map_or(0, |p| p.repairs) + u64::from(repaired),
            error: out.error,
        });
    }

    /// Remembers (and logs, throttled) a check that could not run.
    fn record_error(&self, uid: &PodUid, mode: &'static str, error: String) {
        let mut state = self.state();
        let s = state.entry(uid.clone()).or_default();
        if let Some(held) = s.throttle.hit() {
            tracing::warn!(uid = %uid, held, error = %error, "drift check of a {mode} pod");
        }
        let previous = s.last.take();
        s.last = Some(LastCheck {
            mode,
            checked_at: now(),
            drifted: previous.as_ref().is_some_and(|p| p.drifted),
            missing: previous.as_ref().map(|p| p.missing.clone()).unwrap_or_default(),
            unexpected: previous.as_ref().map(|p| p.unexpected.clone()).unwrap_or_default(),
            in_host_probe_set: previous.as_ref().and_then(|p| p.in_host_probe_set),
            last_repair: previous.as_ref().and_then(|p| p.last_repair.clone()),
            repairs: previous.as_ref().map_or(0, |p| p.repairs),
            error: Some(error),
        });
    }
}

/// Clears a pod's busy flag when its check's work ends (also when it ends after the round gave up on it).
struct BusyGuard(Arc<std::sync::atomic::AtomicBool>);

impl Drop for BusyGuard {
    fn drop(&mut self) {
        self.0.store(false, std::sync::atomic::Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jitter_stays_within_fifteen_percent() {
        for _ in 0..100 {
            let d = jitter(Duration::from_secs(60));
            assert!(d >= Duration::from_secs(51) && d <= Duration::from_secs(69), "{d:?}");
        }
    }

    #[test]
    fn a_failing_repair_backs_off_up_to_the_cap_and_a_success_resets_it() {
        let mut s = PodState::default();
        assert!(s.may_repair());
        s.failed();
        assert!(!s.may_repair(), "not again at once");
        for _ in 0..40 {
            s.failed();
        }
        let wait = s.next_repair.unwrap().saturating_duration_since(Instant::now());
        assert!(wait <= MAX_REPAIR_BACKOFF && wait > MAX_REPAIR_BACKOFF / 2, "{wait:?}");
        s.succeeded();
        assert!(s.may_repair());
    }
}

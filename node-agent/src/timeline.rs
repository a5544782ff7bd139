//! What the agent remembers of each pod's latest enrollment, for `node-agent explain`: where it came from (the
//! plugin, the watch, or a restart), when each step started and how long it took, what the node proxy answered
//! (ZDS), and the last error with its time.
//!
//! Bounded: a record exists only for a pod the agent tried to enroll and has not removed (the enroller forgets it
//! when the pod leaves), and at most [`MAX_RECORDS`] are kept, the oldest dropped first.
//!
//! **One vocabulary, one clock.** An enrollment's steps are the [`Step`]s (netns, rules, proxy_ack, probe,
//! annotate), and the [`Recorder`] is the only writer of both their timeline phases and their
//! `nodeagent_enrollment_duration_seconds{phase}` observations: each step recorded is one phase of the pod's record
//! and one observation of the histogram, of the same [`Timed`] span, under the same name.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use crate::explain::report::{Phase, ProxyState, Timeline, Timestamped};
use crate::metrics::Metrics;
use crate::pod::PodUid;

/// The most records kept: far above the pods a node runs (the kubelet's default is 110), so only a leak would
/// reach it.
pub const MAX_RECORDS: usize = 4096;

/// Who started an enrollment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The plugin's ADD (`/podsetup` or `/cmdadd`).
    Plugin,
    /// The pod watch, for a running pod found through `/proc`.
    Watch,
    /// The agent's restart: a pod enrolled before it, put back into the cache.
    Restore,
}

impl Source {
    /// The name explain prints.
    pub fn name(self) -> &'static str {
        match self {
            Source::Plugin => "plugin",
            Source::Watch => "watch",
            Source::Restore => "restore",
        }
    }
}

/// The steps of an enrollment, in order: the phases of a pod's record and the `phase` label values of
/// `nodeagent_enrollment_duration_seconds`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Opening the pod's netns; for a running pod found through `/proc` (the watch, a restart), the search too.
    Netns,
    /// Programming the in-pod rules.
    Rules,
    /// The node proxy's Add, until its ack.
    ProxyAck,
    /// The pod's host probe set entry.
    Probe,
    /// The pod's ambient annotation.
    Annotate,
}

impl Step {
    /// Every step, in enrollment order.
    #[cfg(test)]
    pub const ALL: [Step; 5] = [Step::Netns, Step::Rules, Step::ProxyAck, Step::Probe, Step::Annotate];

    /// The step's name: its phase in the record and its `phase` label in the histogram.
    pub fn name(self) -> &'static str {
        match self {
            Step::Netns => "netns",
            Step::Rules => "rules",
            Step::ProxyAck => "proxy_ack",
            Step::Probe => "probe",
            Step::Annotate => "annotate",
        }
    }
}

/// Writes an enrollment's record and its steps' latency observations together: the one place either is written,
/// so the histogram and `explain` never time a step differently. Cheap to clone; clones share the records.
#[derive(Debug, Clone)]
pub struct Recorder {
    timelines: Timelines,
    metrics: Metrics,
}

impl Recorder {
    /// Records into fresh timelines and `metrics`' enrollment histogram.
    pub fn new(metrics: Metrics) -> Self {
        Self { timelines: Timelines::default(), metrics }
    }

    /// The records, for readers (`explain`, the watch's relist).
    pub fn timelines(&self) -> &Timelines {
        &self.timelines
    }

    /// A new enrollment of pod `uid` began at `started` (see [`Timelines::begin`]).
    pub fn begin(&self, uid: &PodUid, source: Source, ips: &[IpAddr], started: Clock) {
        self.timelines.begin(uid, source, ips, started);
    }

    /// `step` of pod `uid`'s enrollment, begun at `started` and ended now, with `error` if it failed: one phase of
    /// the record and one observation of the histogram, of the same span.
    pub fn step(&self, uid: &PodUid, step: Step, started: Clock, error: Option<String>) {
        self.timed(uid, step, started.stop(), error);
    }

    /// [`Recorder::step`], for a step timed already (the `/proc` search came first).
    pub fn timed(&self, uid: &PodUid, step: Step, timed: Timed, error: Option<String>) {
        self.timelines.timed_phase(uid, step, timed, error);
        self.metrics.phase_took(step.name(), timed.took());
    }

    /// [`Recorder::step`] for a step whose `result` is handed on.
    pub fn result<T, E: std::fmt::Display>(
        &self,
        uid: &PodUid,
        step: Step,
        started: Clock,
        result: Result<T, E>,
    ) -> Result<T, E> {
        self.step(uid, step, started, result.as_ref().err().map(ToString::to_string));
        result
    }

    /// What the node proxy was told about pod `uid`, or answered.
    pub fn proxy(&self, uid: &PodUid, state: ProxyState) {
        self.timelines.proxy(uid, state);
    }

    /// Pod `uid`'s enrollment ended with `outcome`.
    pub fn finish(&self, uid: &PodUid, outcome: Result<(), String>) {
        self.timelines.finish(uid, outcome);
    }

    /// Pod `uid` left: its record goes.
    pub fn forget(&self, uid: &PodUid) {
        self.timelines.forget(uid);
    }
}

/// When a step started, on both clocks: the wall clock for the report, the monotonic one for its duration.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    at: SystemTime,
    started: Instant,
}

impl Clock {
    /// Now.
    pub fn start() -> Self {
        Self { at: SystemTime::now(), started: Instant::now() }
    }

    /// The step begun at this clock ends now.
    pub fn stop(self) -> Timed {
        Timed { started: self, took: self.started.elapsed() }
    }
}

/// A step already timed: the watch's `/proc` search for a pod's netns ends before the pod's enrollment begins
/// (and one scan serves many pods), so its record gets the step whole.
#[derive(Debug, Clone, Copy)]
pub struct Timed {
    started: Clock,
    took: Duration,
}

impl Timed {
    /// When the step began.
    pub fn started(self) -> Clock {
        self.started
    }

    /// How long it took.
    pub fn took(self) -> Duration {
        self.took
    }

    /// This step and `next`, which followed it, as one step.
    pub fn then(self, next: Timed) -> Timed {
        Timed { started: self.started, took: self.took + next.took }
    }
}

/// One pod's record.
#[derive(Debug, Clone)]
struct Record {
    source: Source,
    ips: Vec<IpAddr>,
    started: Clock,
    phases: Vec<Phase>,
    proxy: ProxyState,
    outcome: Option<Result<(), String>>,
    last_error: Option<Timestamped>,
}

/// Every pod's record; shared, cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct Timelines {
    records: Arc<Mutex<HashMap<PodUid, Record>>>,
}

/// RFC 3339, in UTC.
pub fn rfc3339(at: SystemTime) -> String {
    jiff::Timestamp::try_from(at).map(|t| t.to_string()).unwrap_or_else(|_| format!("{at:?}"))
}

fn millis(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

impl Timelines {
    /// A new enrollment of pod `uid` with `ips` began at `started`: its steps so far are forgotten, its last error
    /// kept.
    pub fn begin(&self, uid: &PodUid, source: Source, ips: &[IpAddr], started: Clock) {
        let mut records = self.lock();
        if !records.contains_key(uid) && records.len() >= MAX_RECORDS {
            if let Some(oldest) = records.iter().min_by_key(|(_, r)| r.started.at).map(|(k, _)| k.clone()) {
                records.remove(&oldest);
            }
        }
        let last_error = records.remove(uid).and_then(|r| r.last_error);
        let record = Record {
            source,
            ips: ips.to_vec(),
            started,
            phases: Vec::new(),
            proxy: ProxyState::NotSent,
            outcome: None,
            last_error,
        };
        records.insert(uid.clone(), record);
    }

    /// `step` of pod `uid`'s enrollment, timed already, with `error` (if it failed); written by the [`Recorder`]
    /// only.
    fn timed_phase(&self, uid: &str, step: Step, timed: Timed, error: Option<String>) {
        if let Some(record) = self.lock().get_mut(uid) {
            record.phases.push(Phase {
                phase: step.name().to_string(),
                started_at: rfc3339(timed.started.at),
                duration_ms: millis(timed.took),
                error,
            });
        }
    }

    /// What the node proxy was told about pod `uid`, or answered.
    pub fn proxy(&self, uid: &PodUid, state: ProxyState) {
        if let Some(record) = self.lock().get_mut(uid) {
            record.proxy = state;
        }
    }

    /// Pod `uid`'s enrollment ended with `outcome`; an error becomes its last error, with the time.
    pub fn finish(&self, uid: &PodUid, outcome: Result<(), String>) {
        if let Some(record) = self.lock().get_mut(uid) {
            if let Err(e) = &outcome {
                record.last_error = Some(Timestamped { message: e.clone(), at: rfc3339(SystemTime::now()) });
            }
            record.outcome = Some(outcome);
        }
    }

    /// Pod `uid` left (removed, deleted): its record goes.
    pub fn forget(&self, uid: &PodUid) {
        self.lock().remove(uid);
    }

    /// Keeps, of the records whose enrollment has ended, those of the pods `keep` names: a relist drops those of
    /// pods deleted while the watch was down, which no Delete will remove. A record in progress stays.
    pub fn retain_ended(&self, keep: impl Fn(&str) -> bool) {
        self.lock().retain(|uid, r| r.outcome.is_none() || keep(uid));
    }

    /// Pod `uid`'s record as explain shows it, if there is one.
    pub fn get(&self, uid: &PodUid) -> Option<Timeline> {
        let records = self.lock();
        let r = records.get(uid)?;
        Some(Timeline {
            source: r.source.name().to_string(),
            ips: r.ips.clone(),
            started_at: rfc3339(r.started.at),
            total_ms: r.outcome.as_ref().and(r.phases.last()).map(|_| {
                let phases: f64 = r.phases.iter().map(|p| p.duration_ms).sum();
                (phases * 1e3).round() / 1e3
            }),
            phases: r.phases.clone(),
            proxy: r.proxy.clone(),
            outcome: match &r.outcome {
                None => "in progress".to_string(),
                Some(Ok(())) => "enrolled".to_string(),
                Some(Err(e)) => format!("failed: {e}"),
            },
            failed: matches!(r.outcome, Some(Err(_))),
            last_error: r.last_error.clone(),
        })
    }

    /// How many records are kept.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<PodUid, Record>> {
        self.records.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use prometheus_client::registry::Registry;

    fn u(uid: &str) -> PodUid {
        uid.into()
    }

    /// A recorder, with the registry its histogram is in.
    fn recorder() -> (Recorder, Registry) {
        let mut registry = Registry::default();
        let metrics = Metrics::register(&mut registry);
        (Recorder::new(metrics), registry)
    }

    /// The histogram's count and sum (seconds) for `phase`.
    fn observed(registry: &Registry, phase: &str) -> (u64, f64) {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, registry).unwrap();
        let value = |what: &str| {
            let prefix = format!("nodeagent_enrollment_duration_seconds_{what}{{phase=\"{phase}\"}} ");
            text.lines().find_map(|l| l.strip_prefix(&prefix)).map(|v| v.trim().parse::<f64>().unwrap())
        };
        (value("count").unwrap_or(0.0) as u64, value("sum").unwrap_or(0.0))
    }

    #[test]
    fn the_steps_are_the_histograms_phases_in_enrollment_order() {
        let names: Vec<&str> = Step::ALL.iter().map(|s| s.name()).collect();
        assert_eq!(names, ["netns", "rules", "proxy_ack", "probe", "annotate"]);
    }

    #[test]
    fn a_step_is_one_phase_and_one_observation_of_the_same_span() {
        let (r, registry) = recorder();
        r.begin(&u("u1"), Source::Watch, &[], Clock::start());
        let search = Timed { started: Clock::start(), took: Duration::from_millis(20) };
        r.timed(
            &u("u1"),
            Step::Netns,
            search.then(Timed { started: Clock::start(), took: Duration::from_millis(5) }),
            None,
        );
        r.step(&u("u1"), Step::Rules, Clock::start(), Some("refused".into()));
        let got = r.timelines().get(&u("u1")).unwrap();
        let phases: Vec<&str> = got.phases.iter().map(|p| p.phase.as_str()).collect();
        assert_eq!(phases, ["netns", "rules"]);
        for (step, phase) in [(Step::Netns, &got.phases[0]), (Step::Rules, &got.phases[1])] {
            let (count, sum) = observed(&registry, step.name());
            assert_eq!(count, 1, "{step:?}: one observation per recorded step, failed or not");
            assert!((sum * 1e3 - phase.duration_ms).abs() < 1e-3, "{step:?}: {sum} s vs {} ms", phase.duration_ms);
        }
        assert!(got.phases[0].duration_ms >= 25.0, "the search is in the netns step: {:?}", got.phases[0]);
        assert_eq!(observed(&registry, "proxy_ack").0, 0, "a step not recorded is not observed");
    }

    #[test]
    fn a_failed_enrollment_keeps_its_steps_and_error_until_the_next_one_and_removal_forgets_it() {
        let (r, _registry) = recorder();
        let t = r.timelines().clone();
        t.begin(&u("u1"), Source::Plugin, &[], Clock::start());
        r.step(&u("u1"), Step::Rules, Clock::start(), None);
        t.proxy(&u("u1"), ProxyState::Sent);
        t.proxy(&u("u1"), ProxyState::Error { message: "no proxy connected".into() });
        r.step(&u("u1"), Step::ProxyAck, Clock::start(), Some("no proxy connected".into()));
        t.finish(&u("u1"), Err("node proxy: no proxy connected".into()));
        let got = t.get(&u("u1")).unwrap();
        assert_eq!((got.source.as_str(), got.failed), ("plugin", true));
        assert_eq!(got.phases.iter().map(|p| p.phase.as_str()).collect::<Vec<_>>(), ["rules", "proxy_ack"]);
        assert!(got.last_error.as_ref().unwrap().message.contains("no proxy"));
        assert!(got.last_error.unwrap().at.ends_with('Z'), "RFC 3339 in UTC");

        t.begin(&u("u1"), Source::Watch, &[], Clock::start());
        let again = t.get(&u("u1")).unwrap();
        assert!(again.phases.is_empty() && !again.failed && again.outcome == "in progress");
        assert!(again.last_error.is_some(), "the last error outlives the retry that has not ended");
        t.forget(&u("u1"));
        assert!(t.get(&u("u1")).is_none());
        r.step(&u("u1"), Step::Rules, Clock::start(), None);
        assert!(t.get(&u("u1")).is_none(), "only an enrollment's beginning creates a record");
    }

    #[test]
    fn a_step_timed_before_the_record_is_kept_whole_and_starts_the_record() {
        let (r, _registry) = recorder();
        let t = r.timelines();
        let search = Timed { started: Clock::start(), took: Duration::from_millis(20) };
        let open = Clock::start().stop();
        t.begin(&u("u1"), Source::Watch, &[], search.started());
        r.timed(&u("u1"), Step::Netns, search.then(open), None);
        let got = t.get(&u("u1")).unwrap();
        assert_eq!(got.started_at, got.phases[0].started_at, "the record starts with the search");
        assert!(got.phases[0].duration_ms >= 20.0, "the search's time is in the step: {:?}", got.phases[0]);
    }

    #[test]
    fn a_relist_drops_ended_records_of_pods_it_did_not_list_but_keeps_those_in_progress() {
        let t = Timelines::default();
        for uid in ["listed", "gone", "in-progress"] {
            t.begin(&u(uid), Source::Watch, &[], Clock::start());
        }
        t.finish(&u("listed"), Err("netns not found".into()));
        t.finish(&u("gone"), Err("netns not found".into()));
        t.retain_ended(|uid| uid == "listed");
        assert!(t.get(&u("listed")).is_some() && t.get(&u("in-progress")).is_some());
        assert!(t.get(&u("gone")).is_none());
    }

    #[test]
    fn the_records_are_capped() {
        let t = Timelines::default();
        for i in 0..MAX_RECORDS + 10 {
            t.begin(&u(&format!("u{i}")), Source::Watch, &[], Clock::start());
        }
        assert_eq!(t.len(), MAX_RECORDS);
    }
}

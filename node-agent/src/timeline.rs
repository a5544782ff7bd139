//! What the agent remembers of each pod's latest enrollment, for `node-agent explain`: where it came from (the
//! plugin, the watch, or a restart), when each step started and how long it took, what the node proxy answered
//! (ZDS), and the last error with its time.
//!
//! Bounded: a record exists only for a pod the agent tried to enroll and has not removed (the enroller forgets it
//! when the pod leaves), and at most [`MAX_RECORDS`] are kept, the oldest dropped first.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use crate::explain::report::{Phase, ProxyState, Timeline, Timestamped};

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
    records: Arc<Mutex<HashMap<String, Record>>>,
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
    pub fn begin(&self, uid: &str, source: Source, ips: &[IpAddr], started: Clock) {
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
        records.insert(uid.to_string(), record);
    }

    /// Step `name` of pod `uid`'s enrollment, begun at `started`, ended now with `error` (if it failed).
    pub fn phase(&self, uid: &str, name: &'static str, started: Clock, error: Option<String>) {
        self.timed_phase(uid, name, started.stop(), error);
    }

    /// Step `name` of pod `uid`'s enrollment, timed already, with `error` (if it failed).
    pub fn timed_phase(&self, uid: &str, name: &'static str, step: Timed, error: Option<String>) {
        if let Some(record) = self.lock().get_mut(uid) {
            record.phases.push(Phase {
                phase: name.to_string(),
                started_at: rfc3339(step.started.at),
                duration_ms: millis(step.took),
                error,
            });
        }
    }

    /// What the node proxy was told about pod `uid`, or answered.
    pub fn proxy(&self, uid: &str, state: ProxyState) {
        if let Some(record) = self.lock().get_mut(uid) {
            record.proxy = state;
        }
    }

    /// Pod `uid`'s enrollment ended with `outcome`; an error becomes its last error, with the time.
    pub fn finish(&self, uid: &str, outcome: Result<(), String>) {
        if let Some(record) = self.lock().get_mut(uid) {
            if let Err(e) = &outcome {
                record.last_error = Some(Timestamped { message: e.clone(), at: rfc3339(SystemTime::now()) });
            }
            record.outcome = Some(outcome);
        }
    }

    /// Pod `uid` left (removed, deleted): its record goes.
    pub fn forget(&self, uid: &str) {
        self.lock().remove(uid);
    }

    /// Keeps, of the records whose enrollment has ended, those of the pods `keep` names: a relist drops those of
    /// pods deleted while the watch was down, which no Delete will remove. A record in progress stays.
    pub fn retain_ended(&self, keep: impl Fn(&str) -> bool) {
        self.lock().retain(|uid, r| r.outcome.is_none() || keep(uid));
    }

    /// Pod `uid`'s record as explain shows it, if there is one.
    pub fn get(&self, uid: &str) -> Option<Timeline> {
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

    fn lock(&self) -> MutexGuard<'_, HashMap<String, Record>> {
        self.records.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_enrollment_keeps_its_steps_and_error_until_the_next_one_and_removal_forgets_it() {
        let t = Timelines::default();
        t.begin("u1", Source::Plugin, &[], Clock::start());
        t.phase("u1", "rules", Clock::start(), None);
        t.proxy("u1", ProxyState::Sent);
        t.proxy("u1", ProxyState::Error { message: "no proxy connected".into() });
        t.phase("u1", "proxy_ack", Clock::start(), Some("no proxy connected".into()));
        t.finish("u1", Err("node proxy: no proxy connected".into()));
        let got = t.get("u1").unwrap();
        assert_eq!((got.source.as_str(), got.failed), ("plugin", true));
        assert_eq!(got.phases.iter().map(|p| p.phase.as_str()).collect::<Vec<_>>(), ["rules", "proxy_ack"]);
        assert!(got.last_error.as_ref().unwrap().message.contains("no proxy"));
        assert!(got.last_error.unwrap().at.ends_with('Z'), "RFC 3339 in UTC");

        t.begin("u1", Source::Watch, &[], Clock::start());
        let again = t.get("u1").unwrap();
        assert!(again.phases.is_empty() && !again.failed && again.outcome == "in progress");
        assert!(again.last_error.is_some(), "the last error outlives the retry that has not ended");
        t.forget("u1");
        assert!(t.get("u1").is_none());
        t.phase("u1", "rules", Clock::start(), None);
        assert!(t.get("u1").is_none(), "only an enrollment's beginning creates a record");
    }

    #[test]
    fn a_step_timed_before_the_record_is_kept_whole_and_starts_the_record() {
        let t = Timelines::default();
        let search = Timed { started: Clock::start(), took: Duration::from_millis(20) };
        let open = Clock::start().stop();
        t.begin("u1", Source::Watch, &[], search.started());
        t.timed_phase("u1", "netns", search.then(open), None);
        let got = t.get("u1").unwrap();
        assert_eq!(got.started_at, got.phases[0].started_at, "the record starts with the search");
        assert!(got.phases[0].duration_ms >= 20.0, "the search's time is in the step: {:?}", got.phases[0]);
    }

    #[test]
    fn a_relist_drops_ended_records_of_pods_it_did_not_list_but_keeps_those_in_progress() {
        let t = Timelines::default();
        for uid in ["listed", "gone", "in-progress"] {
            t.begin(uid, Source::Watch, &[], Clock::start());
        }
        t.finish("listed", Err("netns not found".into()));
        t.finish("gone", Err("netns not found".into()));
        t.retain_ended(|uid| uid == "listed");
        assert!(t.get("listed").is_some() && t.get("in-progress").is_some());
        assert!(t.get("gone").is_none());
    }

    #[test]
    fn the_records_are_capped() {
        let t = Timelines::default();
        for i in 0..MAX_RECORDS + 10 {
            t.begin(&format!("u{i}"), Source::Watch, &[], Clock::start());
        }
        assert_eq!(t.len(), MAX_RECORDS);
    }
}

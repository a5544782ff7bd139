//! What the agent reads off a pod object, in one place: its UID ([`PodUid`]), its [`namespace`], [`name`] and
//! `namespace/name` [`key`], its [`ips`] and its lifecycle ([`terminal_phase`], [`is_terminal`], [`is_terminating`], [`is_running`]).
//!
//! Guarantees: every reader takes any pod object, however partial (a watch's tombstone, a pod rebuilt from the
//! cache), and never fails: a missing field reads as empty (UID `""`, key `"/"`, no IPs, no phase). Every module of
//! the agent reads these facts here, so the watch, enrollment, repair, drift and explain cannot disagree about
//! which pod an object is, which IPs it has, or whether it has finished.

use std::fmt;
use std::net::IpAddr;

use k8s_openapi::api::core::v1::Pod;

/// A pod's UID: the key of every per-pod record the agent keeps (cache, gate, timelines, backoff, drift). Empty
/// only for an object without one, which no API server sends.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PodUid(String);

impl PodUid {
    /// The UID of `pod`; empty when it has none.
    pub fn of(pod: &Pod) -> Self {
        Self(pod.metadata.uid.clone().unwrap_or_default())
    }

    /// The UID as the API spells it.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether the object had no UID.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl From<String> for PodUid {
    fn from(uid: String) -> Self {
        Self(uid)
    }
}

impl From<&str> for PodUid {
    fn from(uid: &str) -> Self {
        Self(uid.to_string())
    }
}

impl From<PodUid> for String {
    fn from(uid: PodUid) -> Self {
        uid.0
    }
}

/// Reads as the `&str` the per-pod records are keyed by.
impl std::ops::Deref for PodUid {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

impl std::borrow::Borrow<str> for PodUid {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for PodUid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The pod's namespace; empty when it has none.
pub fn namespace(pod: &Pod) -> &str {
    pod.metadata.namespace.as_deref().unwrap_or_default()
}

/// The pod's name; empty when it has none.
pub fn name(pod: &Pod) -> &str {
    pod.metadata.name.as_deref().unwrap_or_default()
}

/// `namespace/name`: how logs, errors and explain name a pod.
pub fn key(pod: &Pod) -> String {
    format!("{}/{}", namespace(pod), name(pod))
}

/// The pod's IPs from its status: `podIPs`, else `podIP`; unparsable entries are left out. Enrollment, in-place
/// repair and the drift check find a running pod's netns by them.
pub fn ips(pod: &Pod) -> Vec<IpAddr> {
    let status = pod.status.as_ref();
    status
        .and_then(|s| s.pod_ips.as_ref())
        .map(|ips| ips.iter().filter_map(|ip| ip.ip.parse().ok()).collect())
        .or_else(|| status.and_then(|s| s.pod_ip.as_ref()).and_then(|ip| ip.parse().ok()).map(|ip| vec![ip]))
        .unwrap_or_default()
}

/// The pod's phase when it has finished (`Succeeded` or `Failed`: its containers are gone).
pub fn terminal_phase(pod: &Pod) -> Option<&str> {
    pod.status.as_ref().and_then(|s| s.phase.as_deref()).filter(|p| matches!(*p, "Succeeded" | "Failed"))
}

/// Whether the pod has finished ([`terminal_phase`]).
pub fn is_terminal(pod: &Pod) -> bool {
    terminal_phase(pod).is_some()
}

/// Being deleted gracefully (`deletionTimestamp` set): still running (its grace period or finalizers hold it), not
/// yet gone.
pub fn is_terminating(pod: &Pod) -> bool {
    pod.metadata.deletion_timestamp.is_some()
}

/// Whether the pod's phase is `Running`.
pub fn is_running(pod: &Pod) -> bool {
    pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{PodIP, PodStatus};
    use kube::api::ObjectMeta;

    fn pod(phase: Option<&str>, pod_ips: Option<Vec<&str>>, pod_ip: Option<&str>) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some("web".into()),
                namespace: Some("lab".into()),
                uid: Some("u1".into()),
                ..ObjectMeta::default()
            },
            status: Some(PodStatus {
                phase: phase.map(Into::into),
                pod_ips: pod_ips.map(|ips| ips.into_iter().map(|ip| PodIP { ip: ip.into() }).collect()),
                pod_ip: pod_ip.map(Into::into),
                ..PodStatus::default()
            }),
            ..Pod::default()
        }
    }

    #[test]
    fn a_partial_object_reads_as_empty() {
        let empty = Pod::default();
        assert!(PodUid::of(&empty).is_empty());
        assert_eq!(key(&empty), "/");
        assert!(ips(&empty).is_empty());
        assert!(!is_terminal(&empty) && !is_terminating(&empty) && !is_running(&empty));
    }

    #[test]
    fn uid_and_key() {
        let p = pod(None, None, None);
        assert_eq!(PodUid::of(&p).as_str(), "u1");
        assert_eq!(PodUid::of(&p), PodUid::from("u1"));
        assert_eq!((namespace(&p), name(&p), key(&p).as_str()), ("lab", "web", "lab/web"));
    }

    #[test]
    fn pod_ips_win_over_pod_ip_and_bad_entries_are_left_out() {
        let both = pod(None, Some(vec!["10.0.0.1", "fd00::1", "bogus"]), Some("10.9.9.9"));
        assert_eq!(ips(&both), ["10.0.0.1".parse::<IpAddr>().unwrap(), "fd00::1".parse().unwrap()]);
        let single = pod(None, None, Some("10.0.0.2"));
        assert_eq!(ips(&single), ["10.0.0.2".parse::<IpAddr>().unwrap()]);
    }

    #[test]
    fn only_succeeded_and_failed_are_terminal() {
        for (phase, terminal) in [("Succeeded", true), ("Failed", true), ("Running", false), ("Pending", false)] {
            let p = pod(Some(phase), None, None);
            assert_eq!(is_terminal(&p), terminal, "{phase}");
            assert_eq!(terminal_phase(&p), terminal.then_some(phase));
            assert_eq!(is_running(&p), phase == "Running");
        }
    }
}

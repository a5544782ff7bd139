//! Detects a config fight: another agent that keeps reverting our entry (Cilium with `cni.exclusive`, a primary
//! CNI's own installer re-rendering its conflist, …), so operators see it instead of a silently flapping node.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Counts reverts by other writers in a sliding window.
#[derive(Debug)]
pub struct FightDetector {
    threshold: usize,
    window: Duration,
    reverts: VecDeque<Instant>,
}

impl FightDetector {
    /// A fight is more than `threshold` reverts within `window`.
    pub fn new(threshold: usize, window: Duration) -> Self {
        Self { threshold, window, reverts: VecDeque::new() }
    }

    /// Records one revert; true when this revert makes it a fight. The count then starts over, so a long fight
    /// is reported once per `threshold` reverts rather than on every one.
    pub fn record(&mut self, now: Instant) -> bool {
        while self.reverts.front().is_some_and(|t| now.duration_since(*t) > self.window) {
            self.reverts.pop_front();
        }
        self.reverts.push_back(now);
        if self.reverts.len() > self.threshold {
            self.reverts.clear();
            return true;
        }
        false
    }
}

/// Names the likely other writer from the plugin types in the contested file, with the knob that stops it.
pub fn likely_culprit(conflist: &serde_json::Value) -> &'static str {
    let types: Vec<&str> = conflist["plugins"]
        .as_array()
        .into_iter()
        .flatten()
        .chain(std::iter::once(conflist))
        .filter_map(|p| p["type"].as_str())
        .collect();
    let has = |t: &str| types.iter().any(|x| x.contains(t));
    if has("cilium") {
        "Cilium's agent (cni.exclusive=true deletes or rewrites foreign CNI config; set cni.exclusive=false)"
    } else if has("calico") {
        "Calico's install-cni (it re-renders its conflist; let istio own a separate file with ISTIO_OWNED_CNI_CONFIG)"
    } else if has("aws-cni") || has("vpc") {
        "aws-vpc-cni's aws-node (it rewrites 10-aws.conflist on restart)"
    } else if has("flannel") {
        "flannel's install-cni container"
    } else if has("ptp") || has("kindnet") {
        "kindnet (it rewrites 10-kindnet.conflist)"
    } else {
        "another agent that owns this CNI config file"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn more_than_threshold_reverts_in_the_window_is_a_fight() {
        let mut d = FightDetector::new(3, Duration::from_secs(10));
        let t0 = Instant::now();
        assert!(!d.record(t0));
        assert!(!d.record(t0 + Duration::from_secs(1)));
        assert!(!d.record(t0 + Duration::from_secs(2)));
        assert!(d.record(t0 + Duration::from_secs(3)), "fourth revert within 10s");
        assert!(!d.record(t0 + Duration::from_secs(4)), "count starts over after reporting");
    }

    #[test]
    fn slow_reverts_are_not_a_fight() {
        let mut d = FightDetector::new(2, Duration::from_secs(10));
        let t0 = Instant::now();
        for i in 0..10 {
            assert!(!d.record(t0 + Duration::from_secs(11 * i)));
        }
    }

    #[test]
    fn culprit_is_named_from_the_file() {
        assert!(likely_culprit(&json!({"plugins": [{"type": "cilium-cni"}]})).contains("cni.exclusive"));
        assert!(likely_culprit(&json!({"plugins": [{"type": "calico"}]})).contains("Calico"));
        assert!(likely_culprit(&json!({"type": "bridge"})).contains("another agent"));
    }
}

use super::*;
use crate::config::WatchConfig;
use crate::kinds::by_name;

fn pod(name: &str) -> Value {
    json!({"metadata": {"name": name}, "spec": {"nodeName": "n1"}})
}

fn lenient() -> Store {
    Store::new(&Config::default())
}

fn graceful() -> Store {
    Store::new(&Config { graceful_deletion: true, ..Config::default() })
}

fn rv(o: &Value) -> u64 {
    o["metadata"]["resourceVersion"].as_str().unwrap().parse().unwrap()
}

fn merge(s: &mut Store, name: &str, patch: Value, part: Part) -> Result<Value, ApiError> {
    let k = by_name("pods").unwrap();
    s.patch(k, "default", name, PatchType::Merge, patch.to_string().as_bytes(), part)
}

#[test]
fn create_stamps_and_counts() {
    let mut s = lenient();
    let k = by_name("Pod").unwrap();
    let a = s.create(k, Some("ns"), pod("a")).unwrap();
    let b = s.create(k, Some("ns"), pod("b")).unwrap();
    assert_eq!(a["kind"], "Pod");
    assert_eq!(a["apiVersion"], "v1");
    assert_eq!(a["metadata"]["namespace"], "ns");
    assert!(a["metadata"]["uid"].as_str().is_some_and(|u| !u.is_empty()));
    assert!(rv(&b) > rv(&a));
    assert_eq!(s.create(k, Some("ns"), pod("a")).unwrap_err().code, 409);
}

#[test]
fn update_keeps_status_and_skips_noops() {
    let mut s = lenient();
    let k = by_name("pods").unwrap();
    let mut p = pod("a");
    p["status"] = json!({"phase": "Running"});
    let stored = s.upsert(k, p).unwrap();
    let mut body = stored.clone();
    body["status"] = json!({"phase": "Failed"});
    let same = s.replace(k, "default", "a", body, Part::Main).unwrap();
    assert_eq!(same, stored, "a status change through the main resource is ignored");
    let patched = merge(&mut s, "a", json!({"status": {"phase": "Succeeded"}}), Part::Status).unwrap();
    assert_eq!(patched["status"]["phase"], "Succeeded");
    assert_ne!(patched["metadata"]["resourceVersion"], stored["metadata"]["resourceVersion"]);
}

#[test]
fn pod_status_writes_annotations_but_not_the_spec() {
    let mut s = lenient();
    let k = by_name("pods").unwrap();
    s.upsert(k, pod("a")).unwrap();
    let patch = json!({"metadata": {"annotations": {"ambient.istio.io/redirection": "enabled"}}, "spec": {"x": 1}});
    let patched = merge(&mut s, "a", patch, Part::Status).unwrap();
    assert_eq!(patched["metadata"]["annotations"]["ambient.istio.io/redirection"], "enabled");
    assert!(patched["spec"].get("x").is_none(), "the spec is not writable through pods/status");
}

#[test]
fn a_patch_with_a_stale_resource_version_conflicts() {
    let mut s = lenient();
    let stored = s.upsert(by_name("pods").unwrap(), pod("a")).unwrap();
    let stale = json!({"metadata": {"resourceVersion": "1", "labels": {"x": "y"}}});
    assert_eq!(merge(&mut s, "a", stale, Part::Main).unwrap_err().code, 409);
    let current = json!({"metadata": {"resourceVersion": stored["metadata"]["resourceVersion"], "labels": {"x": "y"}}});
    assert!(merge(&mut s, "a", current, Part::Main).is_ok());
}

#[test]
fn compaction_expires_old_versions() {
    let mut s = lenient();
    let k = by_name("Pod").unwrap();
    s.create(k, Some("ns"), pod("a")).unwrap();
    let rv = s.resource_version();
    assert_eq!(s.changes_after(1).unwrap().count(), 1);
    s.compact();
    assert_eq!(s.changes_after(1).err().map(|e| e.code), Some(410));
    assert_eq!(s.changes_after(rv).unwrap().count(), 0, "the current version is still watchable");
}

#[test]
fn history_is_bounded_by_count_and_age() {
    let config = |watch| Config { watch, ..Config::default() };
    let mut s = Store::new(&config(WatchConfig { history_events: 2, ..WatchConfig::default() }));
    let k = by_name("Pod").unwrap();
    let first = s.resource_version();
    for name in ["a", "b", "c"] {
        s.create(k, Some("ns"), pod(name)).unwrap();
    }
    assert_eq!(s.changes_after(first).err().map(|e| e.code), Some(410), "the first event was dropped");
    assert_eq!(s.changes_after(first + 1).unwrap().count(), 2);

    let aged = WatchConfig { history_age: Some(Duration::from_secs(60)), ..WatchConfig::default() };
    let mut s = Store::new(&config(aged));
    let before = s.resource_version();
    s.create(k, Some("ns"), pod("a")).unwrap();
    s.prune_history(Instant::now() + Duration::from_secs(30));
    assert!(s.changes_after(before).is_ok(), "young events stay");
    s.prune_history(Instant::now() + Duration::from_secs(61));
    assert_eq!(s.changes_after(before).err().map(|e| e.code), Some(410), "old events are compacted");
    assert!(s.changes_after(s.resource_version()).is_ok(), "nothing was missed from the newest version");
}

#[test]
fn unissued_versions_expire_only_when_asked() {
    let k = by_name("Pod").unwrap();
    let mut s = lenient();
    s.create(k, Some("ns"), pod("a")).unwrap();
    assert!(s.changes_after(s.resource_version() + 100).is_ok(), "lenient: a future version waits");

    let strict = Config { watch: WatchConfig { expire_unissued: true, ..WatchConfig::default() }, ..Config::default() };
    let mut s = Store::new(&strict);
    assert!(s.resource_version() > 1_000_000_000, "versions start at the clock");
    s.create(k, Some("ns"), pod("a")).unwrap();
    assert_eq!(s.changes_after(s.resource_version() + 1).err().map(|e| e.code), Some(410));
    assert_eq!(s.changes_after(5).err().map(|e| e.code), Some(410), "a previous server's version is too old");
    let restarted = Store::new(&strict);
    assert!(restarted.resource_version() > s.resource_version() - 10, "a later store starts above");
}

#[test]
fn snapshots_rebuild_an_older_list() {
    let mut s = lenient();
    let k = by_name("Pod").unwrap();
    s.create(k, Some("ns"), pod("a")).unwrap();
    s.create(k, Some("ns"), pod("b")).unwrap();
    let at = s.resource_version();
    s.create(k, Some("ns"), pod("c")).unwrap();
    s.delete(k, "ns", "a", &DeleteOptions::default(), false).unwrap();
    s.upsert(k, json!({"metadata": {"name": "b", "namespace": "ns", "labels": {"v": "2"}}})).unwrap();
    let names = |objs: Vec<Arc<Value>>| objs.iter().map(|o| name_of(o).to_string()).collect::<Vec<_>>();
    let then = s.snapshot(k, Some("ns"), at).unwrap();
    assert_eq!(names(then.clone()), ["a", "b"]);
    assert!(then[1]["metadata"].get("labels").is_none(), "b as it was");
    assert_eq!(names(s.snapshot(k, None, s.resource_version()).unwrap()), ["b", "c"]);
    assert!(s.snapshot(k, Some("other"), at).unwrap().is_empty());
    s.compact();
    assert_eq!(s.snapshot(k, Some("ns"), at).unwrap_err().code, 410);
}

#[test]
fn lenient_delete_is_immediate_whatever_the_finalizers() {
    let mut s = lenient();
    let k = by_name("Pod").unwrap();
    let mut p = pod("a");
    p["metadata"]["finalizers"] = json!(["x"]);
    s.upsert(k, p).unwrap();
    let last = s.delete(k, "default", "a", &DeleteOptions::default(), s.limits.graceful_deletion).unwrap();
    assert!(last["metadata"].get("deletionTimestamp").is_none());
    assert!(s.get(k, "default", "a").is_none());
}

#[test]
fn graceful_pod_deletion_waits_for_the_grace_period() {
    let mut s = graceful();
    let k = by_name("Pod").unwrap();
    let mut p = pod("a");
    p["spec"]["terminationGracePeriodSeconds"] = json!(5);
    s.upsert(k, p).unwrap();
    let opts = DeleteOptions::default();
    let terminating = s.delete(k, "default", "a", &opts, true).unwrap();
    assert_eq!(terminating["metadata"]["deletionGracePeriodSeconds"], 5);
    assert!(terminating["metadata"]["deletionTimestamp"].is_string());
    assert!(s.get(k, "default", "a").is_some(), "still there during the grace period");
    let deadline = s.next_deadline().expect("a pending deletion");
    s.reap(deadline - Duration::from_millis(1));
    assert!(s.get(k, "default", "a").is_some());
    // A second DELETE with a longer grace period changes nothing; one with 0 deletes now.
    let again = s.delete(k, "default", "a", &DeleteOptions { grace_period_seconds: Some(60), ..opts.clone() }, true);
    assert_eq!(again.unwrap()["metadata"]["resourceVersion"], terminating["metadata"]["resourceVersion"]);
    s.reap(deadline);
    assert!(s.get(k, "default", "a").is_none(), "gone once the grace period is over");
    let kinds: Vec<_> = s.changes_after(1).unwrap().map(|c| c.change.as_str()).collect();
    // The end of the grace period is the kubelet's grace-0 DELETE: written (MODIFIED), then gone (DELETED).
    assert_eq!(kinds, ["ADDED", "MODIFIED", "MODIFIED", "DELETED"]);
}

#[test]
fn pods_default_to_30s_and_unscheduled_or_finished_ones_go_at_once() {
    let mut s = graceful();
    let k = by_name("Pod").unwrap();
    s.upsert(k, pod("a")).unwrap();
    let out = s.delete(k, "default", "a", &DeleteOptions::default(), true).unwrap();
    assert_eq!(out["metadata"]["deletionGracePeriodSeconds"], 30);
    s.upsert(k, json!({"metadata": {"name": "pending"}, "spec": {}})).unwrap();
    s.delete(k, "default", "pending", &DeleteOptions::default(), true).unwrap();
    assert!(s.get(k, "default", "pending").is_none(), "unscheduled");
    let mut done = pod("done");
    done["status"] = json!({"phase": "Succeeded"});
    s.upsert(k, done).unwrap();
    s.delete(k, "default", "done", &DeleteOptions::default(), true).unwrap();
    assert!(s.get(k, "default", "done").is_none(), "terminal");
    let ns = by_name("Namespace").unwrap();
    s.upsert(ns, json!({"metadata": {"name": "n"}})).unwrap();
    s.delete(ns, "", "n", &DeleteOptions::default(), true).unwrap();
    assert!(s.get(ns, "", "n").is_none(), "other kinds: grace 0");
}

#[test]
fn finalizers_hold_deletion_until_removed() {
    let mut s = graceful();
    let k = by_name("Pod").unwrap();
    let mut p = pod("a");
    p["metadata"]["finalizers"] = json!(["example.com/hold"]);
    s.upsert(k, p).unwrap();
    let zero = DeleteOptions { grace_period_seconds: Some(0), preconditions: None };
    let held = s.delete(k, "default", "a", &zero, true).unwrap();
    assert_eq!(held["metadata"]["deletionGracePeriodSeconds"], 0);
    let add = json!({"metadata": {"finalizers": ["example.com/hold", "new"]}});
    assert_eq!(merge(&mut s, "a", add, Part::Main).unwrap_err().code, 422, "no new finalizers while deleting");
    let unset = json!({"metadata": {"deletionTimestamp": null}});
    let still = merge(&mut s, "a", unset, Part::Main).unwrap();
    assert!(still["metadata"]["deletionTimestamp"].is_string(), "clients cannot undo a deletion");
    let last = merge(&mut s, "a", json!({"metadata": {"finalizers": null}}), Part::Main).unwrap();
    assert!(last["metadata"]["deletionTimestamp"].is_string());
    assert!(s.get(k, "default", "a").is_none(), "removing the last finalizer deletes");
    let kinds: Vec<_> = s.changes_after(1).unwrap().map(|c| c.change.as_str()).collect();
    assert_eq!(kinds, ["ADDED", "MODIFIED", "DELETED"]);
}

#[test]
fn finalizers_outlast_the_grace_period() {
    let mut s = graceful();
    let k = by_name("Pod").unwrap();
    let mut p = pod("a");
    p["metadata"]["finalizers"] = json!(["f"]);
    s.upsert(k, p).unwrap();
    s.delete(k, "default", "a", &DeleteOptions { grace_period_seconds: Some(1), preconditions: None }, true).unwrap();
    s.reap(s.next_deadline().unwrap());
    let waiting = s.get(k, "default", "a").expect("held by its finalizer");
    assert_eq!(waiting["metadata"]["deletionGracePeriodSeconds"], 0);
    assert_eq!(s.next_deadline(), None);
    merge(&mut s, "a", json!({"metadata": {"finalizers": []}}), Part::Main).unwrap();
    assert!(s.get(k, "default", "a").is_none());
}

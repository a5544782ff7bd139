//! Watch behaviour through kube's watcher and raw watch API: events, selectors, expiry, relisting.

mod support;

use fake_apiserver::{FakeApiServer, Fault};
use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, WatchEvent, WatchParams};
use kube::runtime::watcher::{self, Event};
use kube::ResourceExt;
use serde_json::json;
use std::collections::BTreeSet;
use std::time::Duration;
use support::{client, pod_json};

/// Generous per-event deadline; events normally arrive within milliseconds.
const EVENT_DEADLINE: Duration = Duration::from_secs(20);

type WatcherStream = std::pin::Pin<Box<dyn Stream<Item = Result<Event<Pod>, watcher::Error>> + Send>>;

async fn next_item(stream: &mut WatcherStream) -> Result<Event<Pod>, watcher::Error> {
    tokio::time::timeout(EVENT_DEADLINE, stream.next())
        .await
        .expect("watcher produced an item before the deadline")
        .expect("watcher streams never end")
}

async fn next_event(stream: &mut WatcherStream) -> Event<Pod> {
    next_item(stream).await.expect("no watcher error")
}

/// A compact description of an event, for readable assertions.
fn describe(event: &Event<Pod>) -> String {
    match event {
        Event::Init => "init".into(),
        Event::InitApply(p) => format!("init-apply {}", p.name_any()),
        Event::InitDone => "init-done".into(),
        Event::Apply(p) => format!("apply {}", p.name_any()),
        Event::Delete(p) => format!("delete {}", p.name_any()),
    }
}

fn watcher_for(api: Api<Pod>, config: watcher::Config) -> WatcherStream {
    watcher::watcher(api, config).boxed()
}

async fn expect_events(stream: &mut WatcherStream, expected: &[&str]) {
    for want in expected {
        assert_eq!(describe(&next_event(stream).await), *want);
    }
}

#[tokio::test]
async fn watcher_sees_added_modified_deleted() {
    let server = FakeApiServer::start().unwrap();
    server.upsert(pod_json("default", "a", "n1", json!({}))).unwrap();
    let api: Api<Pod> = Api::namespaced(client(&server).await, "default");
    let mut stream = watcher_for(api, watcher::Config::default());
    expect_events(&mut stream, &["init", "init-apply a", "init-done"]).await;

    server.upsert(pod_json("default", "b", "n1", json!({}))).unwrap();
    expect_events(&mut stream, &["apply b"]).await;
    server.upsert(pod_json("other", "elsewhere", "n1", json!({}))).unwrap();
    server.upsert(pod_json("default", "a", "n1", json!({"changed": "yes"}))).unwrap();
    match next_event(&mut stream).await {
        Event::Apply(p) => {
            assert_eq!(p.name_any(), "a", "the pod in another namespace is not seen");
            assert_eq!(p.labels().get("changed").map(String::as_str), Some("yes"));
        }
        other => panic!("expected the modification of a, got {}", describe(&other)),
    }
    server.delete("Pod", Some("default"), "b").unwrap();
    expect_events(&mut stream, &["delete b"]).await;
}

#[tokio::test]
async fn watcher_relists_after_compaction_and_converges() {
    let server = FakeApiServer::start().unwrap();
    server.upsert(pod_json("default", "a", "n1", json!({}))).unwrap();
    server.upsert(pod_json("default", "b", "n1", json!({}))).unwrap();
    let api: Api<Pod> = Api::namespaced(client(&server).await, "default");
    let mut stream = watcher_for(api, watcher::Config::default());
    expect_events(&mut stream, &["init", "init-apply a", "init-apply b", "init-done"]).await;

    // Compaction alone does not disturb a watch that has seen everything.
    server.compact();
    server.upsert(pod_json("default", "live", "n1", json!({}))).unwrap();
    expect_events(&mut stream, &["apply live"]).await;

    // Disconnect the watcher, change things while it cannot reconnect, then compact so the
    // resourceVersion it resumes from is too old: it must get 410 in-stream and relist.
    server.set_fault(Some(Fault::Refuse));
    server.drop_watches();
    server.upsert(pod_json("default", "c", "n1", json!({}))).unwrap();
    server.delete("Pod", Some("default"), "a").unwrap();
    server.compact();
    server.clear_requests();
    server.set_fault(None);

    let mut saw_gone = false;
    let mut relisted = false;
    let mut buffer = BTreeSet::new();
    let mut state: BTreeSet<String> = ["b", "live"].map(String::from).into();
    let want: BTreeSet<String> = ["b", "c", "live"].map(String::from).into();
    while !(relisted && state == want) {
        match next_item(&mut stream).await {
            Err(watcher::Error::WatchError(status)) if status.code == 410 => {
                assert_eq!(status.reason, "Expired");
                saw_gone = true;
            }
            Err(_) => {} // connection refused while the fault was set
            Ok(Event::Init) => buffer.clear(),
            Ok(Event::InitApply(p)) => {
                buffer.insert(p.name_any());
            }
            Ok(Event::InitDone) => {
                state = std::mem::take(&mut buffer);
                relisted = true;
            }
            Ok(Event::Apply(p)) => {
                state.insert(p.name_any());
            }
            Ok(Event::Delete(p)) => {
                state.remove(&p.name_any());
            }
        }
    }
    assert!(saw_gone, "the watcher was told its resourceVersion expired");
    let log = server.requests();
    let resumed = log.iter().find(|r| r.is_watch()).expect("the watcher resumed watching");
    assert!(resumed.param("resourceVersion").is_some_and(|rv| !rv.is_empty() && rv != "0"));
    assert_eq!(log.iter().filter(|r| !r.is_watch()).count(), 1, "exactly one relist: {log:?}");

    server.upsert(pod_json("default", "d", "n1", json!({}))).unwrap();
    expect_events(&mut stream, &["apply d"]).await;
}

#[tokio::test]
async fn selector_filtered_watch_sees_objects_leave_and_enter() {
    let server = FakeApiServer::start().unwrap();
    let api: Api<Pod> = Api::all(client(&server).await);
    let mut stream = watcher_for(api, watcher::Config::default().labels("app=web"));
    expect_events(&mut stream, &["init", "init-done"]).await;

    server.upsert(pod_json("default", "a", "n1", json!({"app": "web"}))).unwrap();
    expect_events(&mut stream, &["apply a"]).await;
    server.upsert(pod_json("default", "a", "n1", json!({"app": "db"}))).unwrap();
    expect_events(&mut stream, &["delete a"]).await;
    server.upsert(pod_json("default", "ignored", "n1", json!({"app": "db"}))).unwrap();
    server.upsert(pod_json("default", "a", "n1", json!({"app": "web"}))).unwrap();
    expect_events(&mut stream, &["apply a"]).await;
}

#[tokio::test]
async fn streaming_list_initial_events() {
    let server = FakeApiServer::start().unwrap();
    server.upsert(pod_json("default", "a", "n1", json!({}))).unwrap();
    let api: Api<Pod> = Api::all(client(&server).await);
    let mut stream = watcher_for(api, watcher::Config::default().streaming_lists());
    expect_events(&mut stream, &["init", "init-apply a", "init-done"]).await;
    server.upsert(pod_json("default", "b", "n1", json!({}))).unwrap();
    expect_events(&mut stream, &["apply b"]).await;
    assert!(server.requests().iter().all(|r| r.is_watch()), "no LIST with streaming lists");
}

#[tokio::test]
async fn raw_watch_expiry_bookmarks_and_timeout() {
    let server = FakeApiServer::start().unwrap();
    let created = server.upsert(pod_json("default", "a", "n1", json!({}))).unwrap();
    let old_rv = created["metadata"]["resourceVersion"].as_str().unwrap().to_string();
    let api: Api<Pod> = Api::namespaced(client(&server).await, "default");

    server.upsert(pod_json("default", "b", "n1", json!({}))).unwrap();
    server.compact();
    let mut expired = api.watch(&WatchParams::default(), &old_rv).await.expect("a 200 watch response").boxed();
    match tokio::time::timeout(EVENT_DEADLINE, expired.next()).await.unwrap() {
        Some(Ok(WatchEvent::Error(status))) => {
            assert_eq!((status.code, status.reason.as_str()), (410, "Expired"));
        }
        other => panic!("expected an in-stream 410, got {other:?}"),
    }
    assert!(tokio::time::timeout(EVENT_DEADLINE, expired.next()).await.unwrap().is_none(), "stream ends");

    let list = api.list(&Default::default()).await.unwrap();
    let rv = list.metadata.resource_version.unwrap();
    let mut bookmarked =
        api.watch(&WatchParams { bookmarks: true, ..WatchParams::default() }, &rv).await.unwrap().boxed();
    match tokio::time::timeout(EVENT_DEADLINE, bookmarked.next()).await.unwrap() {
        Some(Ok(WatchEvent::Bookmark(b))) => assert_eq!(b.metadata.resource_version, rv),
        other => panic!("expected a bookmark, got {other:?}"),
    }

    let mut timed = api.watch(&WatchParams::default().timeout(1), &rv).await.unwrap().boxed();
    let ended = tokio::time::timeout(EVENT_DEADLINE, async { while timed.next().await.is_some() {} }).await;
    assert!(ended.is_ok(), "timeoutSeconds ends the stream");
}

/// Polls `count` until it equals `want`, failing after [`EVENT_DEADLINE`].
async fn until_count(what: &str, want: usize, count: impl Fn() -> usize) {
    testbed::wait::eventually_async(&format!("{what}: {want} open watches"), || (count() == want).then_some(())).await;
}

#[tokio::test]
async fn open_watches_counts_the_streams_open_right_now_per_kind() {
    let server = FakeApiServer::start().unwrap();
    let client = client(&server).await;
    let all: Api<Pod> = Api::all(client.clone());
    let rv = all.list(&Default::default()).await.unwrap().metadata.resource_version.unwrap();
    assert_eq!(server.open_watches("pods"), 0);

    // Counted as soon as the watch request is answered, whatever the namespace or selectors.
    let first = all.watch(&WatchParams::default(), &rv).await.unwrap().boxed();
    let on_node = WatchParams::default().fields("spec.nodeName=n1");
    let second = Api::<Pod>::namespaced(client, "default").watch(&on_node, &rv).await.unwrap().boxed();
    assert_eq!((server.open_watches("Pod"), server.open_watches("pods")), (2, 2));
    assert_eq!((server.open_watches("namespaces"), server.open_watches("no-such-kind")), (0, 0));

    // Forgotten when the client goes away, and when the server ends its streams.
    drop(first);
    until_count("after the client dropped one", 1, || server.open_watches("pods")).await;
    server.drop_watches();
    until_count("after drop_watches", 0, || server.open_watches("pods")).await;
    drop(second);
}

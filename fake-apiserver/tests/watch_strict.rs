//! Watches like the real server's: server-side timeouts, bookmarks only on request, compacted history, and
//! versions the server never issued (a restart on a restored store) expiring so that clients relist.

mod support;

use fake_apiserver::{Config, FakeApiServer, WatchConfig};
use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, WatchEvent, WatchParams};
use kube::runtime::watcher::{self, Event};
use kube::ResourceExt;
use serde_json::json;
use std::collections::BTreeSet;
use std::time::Duration;
use support::{client, pod_json};

fn with_watch(watch: WatchConfig) -> FakeApiServer {
    FakeApiServer::builder().config(Config { watch, ..Config::default() }).start().unwrap()
}

async fn next<T>(stream: &mut (impl Stream<Item = T> + Unpin)) -> Option<T> {
    tokio::time::timeout(testbed::wait::DEADLINE, stream.next()).await.expect("an item or the end before the deadline")
}

async fn current_rv(api: &Api<Pod>) -> String {
    api.list(&Default::default()).await.unwrap().metadata.resource_version.unwrap()
}

#[tokio::test]
async fn the_server_ends_watches_after_its_timeout_and_watchers_resume() {
    let watch = WatchConfig { min_timeout: Some(Duration::from_millis(200)), ..WatchConfig::default() };
    let server = with_watch(watch);
    let api: Api<Pod> = Api::all(client(&server).await);
    let rv = current_rv(&api).await;
    let mut raw = api.watch(&WatchParams::default(), &rv).await.unwrap().boxed();
    assert!(next(&mut raw).await.is_none(), "a watch without timeoutSeconds ends on the server's timeout");

    // A watcher, driven on its own task, reports the pods it is told about.
    let (tx, mut applied) = tokio::sync::mpsc::unbounded_channel();
    let watching = tokio::spawn(async move {
        let mut stream = watcher::watcher(api, watcher::Config::default()).boxed();
        while let Some(event) = stream.next().await {
            if let Event::Apply(p) = event.expect("no watcher error") {
                let _ = tx.send(p.name_any());
            }
        }
    });
    let watches = || server.requests().iter().filter(|r| r.is_watch()).count();
    let before = watches();
    testbed::wait::eventually_async("the watcher re-watched after two server-side timeouts", || {
        (watches() >= before + 3).then_some(())
    })
    .await;
    server.upsert(pod_json("default", "late", "n1", json!({}))).unwrap();
    let got = tokio::time::timeout(testbed::wait::DEADLINE, applied.recv()).await.expect("before the deadline");
    assert_eq!(got.as_deref(), Some("late"), "the resumed watch delivers");
    watching.abort();
}

#[tokio::test]
async fn bookmarks_only_for_watches_that_ask() {
    let server = with_watch(WatchConfig { bookmark_interval: Duration::from_millis(20), ..WatchConfig::default() });
    let api: Api<Pod> = Api::all(client(&server).await);
    let rv = current_rv(&api).await;
    let mut plain = api.watch(&WatchParams::default().disable_bookmarks(), &rv).await.unwrap().boxed();
    let mut asked = api.watch(&WatchParams::default(), &rv).await.unwrap().boxed();
    for _ in 0..3 {
        match next(&mut asked).await {
            Some(Ok(WatchEvent::Bookmark(b))) => assert_eq!(b.metadata.resource_version, rv),
            other => panic!("expected a bookmark, got {other:?}"),
        }
    }
    server.upsert(pod_json("default", "a", "n1", json!({}))).unwrap();
    match next(&mut plain).await {
        Some(Ok(WatchEvent::Added(p))) => assert_eq!(p.name_any(), "a", "no bookmark came before the event"),
        other => panic!("expected the ADDED event and nothing before it, got {other:?}"),
    }
}

#[tokio::test]
async fn a_small_history_expires_versions_with_410() {
    let server = with_watch(WatchConfig { history_events: 2, ..WatchConfig::default() });
    let api: Api<Pod> = Api::all(client(&server).await);
    let old = current_rv(&api).await;
    for name in ["a", "b", "c"] {
        server.upsert(pod_json("default", name, "n1", json!({}))).unwrap();
    }
    let mut expired = api.watch(&WatchParams::default(), &old).await.unwrap().boxed();
    match next(&mut expired).await {
        Some(Ok(WatchEvent::Error(e))) => assert_eq!((e.code, e.reason.as_str()), (410, "Expired")),
        other => panic!("expected an in-stream 410, got {other:?}"),
    }
    assert!(next(&mut expired).await.is_none());
}

#[tokio::test]
async fn a_version_the_server_never_issued_gets_410() {
    let server = with_watch(WatchConfig { expire_unissued: true, ..WatchConfig::default() });
    let api: Api<Pod> = Api::all(client(&server).await);
    let future = (current_rv(&api).await.parse::<u64>().unwrap() + 1000).to_string();
    let mut stream = api.watch(&WatchParams::default(), &future).await.unwrap().boxed();
    match next(&mut stream).await {
        Some(Ok(WatchEvent::Error(e))) => assert_eq!(e.code, 410),
        other => panic!("expected an in-stream 410, got {other:?}"),
    }
}

#[tokio::test]
async fn a_restart_on_a_restored_store_makes_watchers_relist() {
    let config = Config { watch: WatchConfig { expire_unissued: true, ..WatchConfig::default() }, ..Config::default() };
    let first = FakeApiServer::builder().config(config.clone()).start().unwrap();
    let addr = first.addr();
    for name in ["gone", "kept"] {
        first.upsert(pod_json("default", name, "n1", json!({}))).unwrap();
    }
    let api: Api<Pod> = Api::all(client(&first).await);
    let mut stream = watcher::watcher(api, watcher::Config::default()).boxed();
    let mut state = BTreeSet::new();
    let mut buffer = BTreeSet::new();
    let mut apply = |event: Event<Pod>, state: &mut BTreeSet<String>| match event {
        Event::Init => buffer.clear(),
        Event::InitApply(p) => {
            buffer.insert(p.name_any());
        }
        Event::InitDone => *state = std::mem::take(&mut buffer),
        Event::Apply(p) => {
            state.insert(p.name_any());
        }
        Event::Delete(p) => {
            state.remove(&p.name_any());
        }
    };
    while state.len() < 2 {
        apply(next(&mut stream).await.unwrap().unwrap(), &mut state);
    }
    drop(first);

    // The restored store lacks "gone" and has "new"; the watcher only learns that by relisting.
    let second = FakeApiServer::builder().config(config).listen_on(addr).start().unwrap();
    for name in ["kept", "new"] {
        second.upsert(pod_json("default", name, "n1", json!({}))).unwrap();
    }
    let want: BTreeSet<String> = ["kept", "new"].map(String::from).into();
    let mut saw_gone = false;
    while state != want {
        match next(&mut stream).await.expect("watchers never end") {
            Ok(event) => apply(event, &mut state),
            Err(watcher::Error::WatchError(status)) if status.code == 410 => saw_gone = true,
            Err(_) => {} // the server was down for a moment
        }
    }
    assert!(saw_gone, "the old resourceVersion was refused with 410");
    let relists = second.requests().iter().filter(|r| !r.is_watch()).count();
    assert!(relists >= 1, "the watcher relisted: {:?}", second.requests());
}

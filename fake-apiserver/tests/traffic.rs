//! What the server counts per client ([`fake_apiserver::TrafficRecord`]) and the front ends that share one
//! server's cluster: a client of any front end sees the one store, and each front end's traffic is its own.

mod support;

use fake_apiserver::{FakeApiServer, TrafficRecord};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use kube::runtime::watcher::{self, Event};
use serde_json::json;
use std::time::Duration;
use support::{client, pod_json};

/// Generous per-event deadline; events normally arrive within milliseconds.
const EVENT_DEADLINE: Duration = Duration::from_secs(20);

/// The record of `front_end`'s `verb` on pods, if any request was counted.
fn pods(traffic: &[TrafficRecord], front_end: &str, verb: &str) -> Option<TrafficRecord> {
    traffic.iter().find(|r| r.front_end == front_end && r.verb == verb && r.resource == "pods").cloned()
}

#[tokio::test]
async fn each_front_end_counts_the_lists_and_watch_events_its_clients_received() {
    let server = FakeApiServer::builder().front_end("first").start().unwrap();
    server.upsert(pod_json("default", "a", "n1", json!({}))).unwrap();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let second = server.another_front_end(listener, "second").unwrap();

    let api: Api<Pod> = Api::namespaced(client(&second).await, "default");
    let mut events = watcher::watcher(api, watcher::Config::default()).boxed();
    let mut next =
        async || tokio::time::timeout(EVENT_DEADLINE, events.next()).await.expect("an event in time").unwrap().unwrap();
    assert!(matches!(next().await, Event::Init));
    assert!(matches!(next().await, Event::InitApply(_)), "the second front end lists the first's store");
    assert!(matches!(next().await, Event::InitDone));
    server.upsert(pod_json("default", "b", "n1", json!({}))).unwrap();
    server.upsert(pod_json("default", "c", "n2", json!({}))).unwrap();
    assert!(matches!(next().await, Event::Apply(_)));
    assert!(matches!(next().await, Event::Apply(_)));

    let traffic = server.traffic();
    let list = pods(&traffic, "second", "list").expect("the list was counted");
    assert_eq!((list.requests, list.objects), (1, 1), "one list request carrying one pod");
    assert!(list.bytes > 0);
    let watch = pods(&traffic, "second", "watch").expect("the watch was counted");
    assert_eq!((watch.requests, watch.objects), (1, 2), "one watch that carried two events so far");
    assert!(watch.bytes > 0);
    assert!(traffic.iter().all(|r| r.front_end == "second"), "nothing came in on the first: {traffic:?}");

    server.clear_traffic();
    assert!(server.traffic().is_empty());
    // Closing a front end leaves the server and its other front ends serving.
    drop(events);
    drop(second);
    let api: Api<Pod> = Api::namespaced(client(&server).await, "default");
    assert_eq!(api.list(&Default::default()).await.unwrap().items.len(), 3);
    let list = pods(&server.traffic(), "first", "list").expect("counted on the first front end");
    assert_eq!(list.objects, 3);
}

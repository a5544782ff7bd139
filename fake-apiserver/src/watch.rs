//! Watch streams: one JSON event per line in a chunked 200 response, replayed from history then live.

use crate::cluster::Cluster;
use crate::kinds::ResourceKind;
use crate::selectors::Filter;
use crate::status::ApiError;
use crate::store::{Change, ChangeType};
use bytes::Bytes;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;

/// Response body type shared by all handlers.
pub(crate) type Body = http_body_util::combinators::UnsyncBoxBody<Bytes, Infallible>;

/// Everything a watch request asked for.
#[derive(Debug, Clone)]
pub(crate) struct WatchSpec {
    pub kind: &'static ResourceKind,
    pub filter: Filter,
    /// `None` for `resourceVersion` absent or "0": start with ADDED for every current object.
    pub resource_version: Option<u64>,
    pub send_initial_events: bool,
    pub bookmarks: bool,
    /// How often an idle watch that asked for bookmarks receives one.
    pub bookmark_interval: Duration,
    /// When the server ends the stream (the client's `timeoutSeconds` or the server-side timeout).
    pub timeout: Option<Duration>,
}

fn line(kind: &str, object: &Value) -> Bytes {
    let mut text = json!({"type": kind, "object": object}).to_string();
    text.push('\n');
    Bytes::from(text)
}

fn bookmark(kind: &ResourceKind, rv: u64, initial_end: bool) -> Bytes {
    let mut object = json!({
        "kind": kind.kind,
        "apiVersion": kind.api_version,
        "metadata": {"resourceVersion": rv.to_string()}
    });
    if initial_end {
        object["metadata"]["annotations"] = json!({"k8s.io/initial-events-end": "true"});
    }
    line("BOOKMARK", &object)
}

/// What a selector-filtered watcher sees for one change: modifications that move an object out of
/// (into) the selection arrive as DELETED (ADDED), as on a real apiserver.
fn translate(spec: &WatchSpec, change: &Change) -> Option<Bytes> {
    if change.kind != spec.kind {
        return None;
    }
    let now = spec.filter.matches(&change.object);
    let before = change.previous.as_deref().is_some_and(|p| spec.filter.matches(p));
    let kind = match change.change {
        ChangeType::Added if now => ChangeType::Added,
        ChangeType::Deleted if before => ChangeType::Deleted,
        ChangeType::Modified if before && now => ChangeType::Modified,
        ChangeType::Modified if before => ChangeType::Deleted,
        ChangeType::Modified if now => ChangeType::Added,
        _ => return None,
    };
    Some(line(kind.as_str(), &change.object))
}

/// Starts the watch on a background task and returns the streaming response body.
pub(crate) fn watch_body(cluster: Cluster, spec: WatchSpec) -> Body {
    let (tx, rx) = mpsc::channel::<Bytes>(256);
    // Counted from now (before the client sees the response) until the stream's task ends.
    let open = cluster.watch_opened(spec.kind);
    tokio::spawn(async move {
        run(cluster, spec, tx).await;
        drop(open);
    });
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok::<_, Infallible>(Frame::data(b)), rx))
    });
    StreamBody::new(stream).boxed_unsync()
}

/// Reads what this watcher has not seen yet: `Err` with the Status line when its position expired.
fn catch_up(cluster: &Cluster, spec: &WatchSpec, pos: &mut u64) -> Result<Vec<Bytes>, Bytes> {
    cluster.with_store(|store| {
        let lines = store
            .changes_after(*pos)
            .map_err(|e| line("ERROR", &e.to_status()))?
            .filter_map(|c| translate(spec, c))
            .collect();
        *pos = store.resource_version().max(*pos);
        Ok(lines)
    })
}

async fn run(cluster: Cluster, spec: WatchSpec, tx: mpsc::Sender<Bytes>) {
    let (mut changed, mut drops) = cluster.subscribe();
    let deadline = spec.timeout.map(|t| Instant::now() + t);
    let (initial, mut pos): (Vec<Arc<Value>>, u64) = match spec.resource_version {
        Some(rv) if !spec.send_initial_events => (Vec::new(), rv),
        _ => cluster.with_store(|s| {
            let objects = s
                .list(spec.kind, spec.filter.namespace.as_deref())
                .filter(|o| spec.filter.matches(o))
                .cloned()
                .collect();
            (objects, s.resource_version())
        }),
    };
    for obj in initial {
        if tx.send(line("ADDED", &obj)).await.is_err() {
            return;
        }
    }
    if spec.send_initial_events && spec.bookmarks && tx.send(bookmark(spec.kind, pos, true)).await.is_err() {
        return;
    }
    let every = spec.bookmark_interval.max(Duration::from_millis(1));
    let mut ticker = tokio::time::interval_at(Instant::now() + every, every);
    loop {
        let lines = match catch_up(&cluster, &spec, &mut pos) {
            Ok(lines) => lines,
            Err(error) => {
                let _ = tx.send(error).await;
                return;
            }
        };
        for l in lines {
            if tx.send(l).await.is_err() {
                return;
            }
        }
        let timeout = async {
            match deadline {
                Some(d) => tokio::time::sleep_until(d).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            // Ending on drop_watches()/shutdown takes precedence over delivering more events.
            biased;
            _ = drops.changed() => return,
            r = changed.changed() => if r.is_err() { return },
            _ = timeout => return,
            _ = ticker.tick(), if spec.bookmarks => {
                if tx.send(bookmark(spec.kind, pos, false)).await.is_err() {
                    return;
                }
            }
            _ = tx.closed() => return,
        }
    }
}

/// Parses a watch's `resourceVersion` parameter ("" and "0" mean "start from the current state").
pub(crate) fn parse_rv(raw: Option<&str>) -> Result<Option<u64>, ApiError> {
    match raw {
        None | Some("") | Some("0") => Ok(None),
        Some(s) => s.parse().map(Some).map_err(|_| ApiError::bad_request(format!("invalid resourceVersion {s:?}"))),
    }
}

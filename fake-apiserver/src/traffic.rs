//! What the server sent to its clients, summed per front end, user, verb and resource ([`TrafficRecord`]): the
//! figures a fleet's API load is modelled from (requests, response bytes, objects in lists and watch events).
//!
//! Guarantees: every answered API request is counted once in `requests`, whatever its status (requests to the
//! test endpoints `/fake/...` are not); `bytes` is every byte of every response body as it left the HTTP layer
//! (before TLS, without headers), a watch's counted frame by frame as it is sent, so a stream still open is
//! counted up to now; `objects` is the number of objects the client received: a list's `items`, one for any
//! other 2xx answer carrying an object, and for a watch its ADDED, MODIFIED and DELETED events (BOOKMARKs are
//! counted apart, ERROR events in neither).

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Body;
use serde::Serialize;
use serde_json::Value;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// What the server sent for one kind of request of one client, summed since the server started or since the
/// counters were last cleared ([`crate::Cluster::traffic`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TrafficRecord {
    /// The front end (listener) the requests came in on: empty for a server's own listener unless named with
    /// [`crate::Builder::front_end`], else the name given to [`crate::FakeApiServer::another_front_end`].
    pub front_end: String,
    /// Who the requests ran as (as in [`crate::RequestRecord::user`]).
    pub user: String,
    /// The RBAC verb: `get`, `list`, `watch`, `patch`, ... (the lower-case method for non-resource paths).
    pub verb: String,
    /// `resource[/subresource]` with its group when not core (`pods`, `pods/status`, `daemonsets.apps`), or
    /// the path of a non-resource request (`/version`).
    pub resource: String,
    /// Requests answered.
    pub requests: u64,
    /// Response body bytes sent.
    pub bytes: u64,
    /// Objects sent: list items, watch ADDED/MODIFIED/DELETED events, one per other 2xx answer.
    pub objects: u64,
    /// Watch BOOKMARK events sent.
    pub bookmarks: u64,
}

/// The key of one [`TrafficRecord`].
type Key = (String, String, String, String);

/// The counters, shared by the cluster and the response bodies being sent.
#[derive(Debug, Default, Clone)]
pub(crate) struct Traffic {
    records: Arc<Mutex<BTreeMap<Key, TrafficRecord>>>,
}

impl Traffic {
    fn update(&self, key: &Key, f: impl FnOnce(&mut TrafficRecord)) {
        let mut records = self.records.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let record = records.entry(key.clone()).or_insert_with(|| TrafficRecord {
            front_end: key.0.clone(),
            user: key.1.clone(),
            verb: key.2.clone(),
            resource: key.3.clone(),
            ..TrafficRecord::default()
        });
        f(record);
    }

    /// Every record, in key order.
    pub(crate) fn records(&self) -> Vec<TrafficRecord> {
        self.records.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).values().cloned().collect()
    }

    /// Forgets every record.
    pub(crate) fn clear(&self) {
        self.records.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).clear();
    }

    /// Counts one answered request and returns its body, which counts its bytes and objects as they are sent.
    pub(crate) fn count<B: Body<Data = Bytes>>(
        &self,
        key: Key,
        status: u16,
        body: B,
    ) -> impl Body<Data = Bytes, Error = B::Error> {
        self.update(&key, |r| r.requests += 1);
        let ok = (200..300).contains(&status);
        let verb = key.2.clone();
        let traffic = self.clone();
        body.map_frame(move |frame| {
            if let Some(data) = frame.data_ref() {
                let (objects, bookmarks) = match verb.as_str() {
                    "watch" => watch_event(data),
                    "list" if ok => (list_items(data), 0),
                    _ if ok => (1, 0),
                    _ => (0, 0),
                };
                traffic.update(&key, |r| {
                    r.bytes += data.len() as u64;
                    r.objects += objects;
                    r.bookmarks += bookmarks;
                });
            }
            frame
        })
    }
}

/// A watch frame (one event line): `(1, 0)` for an object event, `(0, 1)` for a bookmark, else nothing.
fn watch_event(line: &Bytes) -> (u64, u64) {
    // The server writes `{"type":...` first (serde_json keeps insertion order).
    let kind = line.strip_prefix(br#"{"type":""#).unwrap_or_default();
    if kind.starts_with(b"BOOKMARK") {
        (0, 1)
    } else if [&b"ADDED"[..], b"MODIFIED", b"DELETED"].iter().any(|k| kind.starts_with(k)) {
        (1, 0)
    } else {
        (0, 0)
    }
}

/// How many `items` a list body holds (a list is answered in one frame).
fn list_items(body: &Bytes) -> u64 {
    serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| v.get("items").and_then(Value::as_array).map(|items| items.len() as u64))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watch_lines_are_told_apart_by_type() {
        assert_eq!(watch_event(&Bytes::from_static(br#"{"type":"ADDED","object":{}}"#)), (1, 0));
        assert_eq!(watch_event(&Bytes::from_static(br#"{"type":"DELETED","object":{}}"#)), (1, 0));
        assert_eq!(watch_event(&Bytes::from_static(br#"{"type":"BOOKMARK","object":{}}"#)), (0, 1));
        assert_eq!(watch_event(&Bytes::from_static(br#"{"type":"ERROR","object":{}}"#)), (0, 0));
    }

    #[test]
    fn list_items_are_counted() {
        assert_eq!(list_items(&Bytes::from_static(br#"{"kind":"PodList","items":[{},{},{}]}"#)), 3);
        assert_eq!(list_items(&Bytes::from_static(b"not json")), 0);
    }
}

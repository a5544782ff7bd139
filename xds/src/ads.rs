//! The Delta ADS client: one bidirectional stream to istiod carrying every subscribed type.
//!
//! Guarantees:
//! * each stream opens with one wildcard request per type (Address first, then Authorization), each carrying the
//!   node, and `initial_resource_versions` = every name → version accepted for that type, so istiod can send the
//!   removals made while the client was away;
//! * every response is answered: an ACK (`type_url` + `response_nonce`), or a NACK (the same plus
//!   `error_detail = Status{code: 0, message: "name: reason; …"}`) when any resource was rejected; rejection is
//!   per resource (see [`crate::wire::resource`] and [`Handler::apply`]), the good resources of the same response
//!   still apply; an unknown type is logged and ACKed;
//! * a rejected resource's version is not recorded (the version held before, if any, stays); removals drop the
//!   name; only the consumer ([`Handler`]) ever sees resource contents, and only validated ones;
//! * readiness ([`Readiness`]) turns true once the first response of every subscribed type has been applied and
//!   answered, and stays true across reconnects;
//! * reconnects back off as ztunnel does: 10 ms doubling to 15 s after a connection error or most gRPC statuses,
//!   back to 10 ms after `Unknown`, `Cancelled`, `DeadlineExceeded` or istiod's connection-age `Unavailable`
//!   (`transport is closing`, `received prior goaway`), immediately after a stream that ended OK having received
//!   a response. One deviation: the reset and immediate classes apply only to a stream that had received at
//!   least one response; a stream that fails or ends before any doubles the delay, so neither a hostile nor a
//!   misconfigured server (istiod without ambient answers every stream with `Unknown`) gets a 10 ms loop.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::net::IpAddr;
use std::time::Duration;

use prost::Message;
use tokio::sync::watch;

use crate::channel::{Channel, ChannelError};
use crate::grpc::{Code, GrpcStatus};
use crate::wire::resource::truncate;
use crate::wire::scan::count_fields;
use crate::wire::{
    decode_resource, DecodedResource, DeltaDiscoveryRequest, DeltaDiscoveryResponse, Node, ResourceType, Status,
    Struct, Value,
};

/// The gRPC method of Delta ADS.
pub const DELTA_ADS_PATH: &str = "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources";

/// `DeltaDiscoveryResponse.resources`.
const RESPONSE_RESOURCES_TAG: u32 = 2;
/// `DeltaDiscoveryResponse.removed_resources`.
const RESPONSE_REMOVED_TAG: u32 = 6;

/// Longest NACK message sent; the rest of the rejections are counted, not listed.
pub const MAX_NACK_MESSAGE: usize = 16 * 1024;

/// Who this proxy is, as istiod reads it from the node id and metadata.
#[derive(Clone, Debug, Default)]
pub struct NodeIdentity {
    /// `INSTANCE_IP`; `1.1.1.1` when unknown, as ztunnel does.
    pub instance_ip: Option<IpAddr>,
    /// Every pod IP (`INSTANCE_IPS` metadata, comma-joined).
    pub instance_ips: Vec<IpAddr>,
    /// `POD_NAME`.
    pub pod_name: String,
    /// `POD_NAMESPACE`.
    pub pod_namespace: String,
    /// `NODE_NAME`.
    pub node_name: String,
    /// Further metadata (`ISTIO_META_<K>` as `<K>`, e.g. `CLUSTER_ID`, `ISTIO_VERSION`).
    pub extra_metadata: BTreeMap<String, Value>,
}

impl NodeIdentity {
    /// `ztunnel~{ip}~{pod}.{ns}~{ns}.svc.cluster.local`.
    pub fn node_id(&self) -> String {
        let ip = self.instance_ip.unwrap_or(IpAddr::from([1, 1, 1, 1]));
        let (pod, ns) = (&self.pod_name, &self.pod_namespace);
        format!("ztunnel~{ip}~{pod}.{ns}~{ns}.svc.cluster.local")
    }

    /// The node sent in the first request of each type.
    pub fn node(&self) -> Node {
        let mut metadata = Struct { fields: self.extra_metadata.clone() };
        let ips: Vec<String> = self.instance_ips.iter().map(IpAddr::to_string).collect();
        metadata.fields.insert("NAME".into(), Value::string(&self.pod_name));
        metadata.fields.insert("NAMESPACE".into(), Value::string(&self.pod_namespace));
        metadata.fields.insert("INSTANCE_IPS".into(), Value::string(ips.join(",")));
        metadata.fields.insert("NODE_NAME".into(), Value::string(&self.node_name));
        Node { id: self.node_id(), cluster: String::new(), metadata: Some(metadata) }
    }

    /// Adds `ISTIO_META_<K>=v` variables as metadata `<K>: v` (string values); other variables are ignored.
    pub fn with_istio_meta_env(mut self, vars: impl IntoIterator<Item = (String, String)>) -> Self {
        for (k, v) in vars {
            if let Some(key) = k.strip_prefix("ISTIO_META_") {
                if !key.is_empty() {
                    self.extra_metadata.insert(key.to_owned(), Value::string(v));
                }
            }
        }
        self
    }

    /// Adds `ISTIO_METAJSON_<K>=<json>` variables as metadata `<K>: <json as a Value>`; other variables are ignored.
    /// Fails on the first value that is not JSON, or nests deeper than 32 levels.
    pub fn with_istio_metajson_env(mut self, vars: impl IntoIterator<Item = (String, String)>) -> Result<Self, String> {
        for (k, v) in vars {
            let Some(key) = k.strip_prefix("ISTIO_METAJSON_").filter(|key| !key.is_empty()) else { continue };
            let json: serde_json::Value = serde_json::from_str(&v).map_err(|e| format!("{k}: {e}"))?;
            let value = json_to_value(&json, 32).ok_or_else(|| format!("{k}: nested too deep"))?;
            self.extra_metadata.insert(key.to_owned(), value);
        }
        Ok(self)
    }
}

/// A JSON value as a `google.protobuf.Value`; `None` past `depth` levels.
fn json_to_value(json: &serde_json::Value, depth: usize) -> Option<Value> {
    use crate::wire::envoy::{value::Kind, ListValue};
    let depth = depth.checked_sub(1)?;
    let kind = match json {
        serde_json::Value::Null => Kind::NullValue(0),
        serde_json::Value::Bool(b) => Kind::BoolValue(*b),
        serde_json::Value::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or(f64::NAN)),
        serde_json::Value::String(s) => Kind::StringValue(s.clone()),
        serde_json::Value::Array(items) => {
            Kind::ListValue(ListValue { values: items.iter().map(|v| json_to_value(v, depth)).collect::<Option<_>>()? })
        }
        serde_json::Value::Object(fields) => Kind::StructValue(Struct {
            fields: fields.iter().map(|(k, v)| Some((k.clone(), json_to_value(v, depth)?))).collect::<Option<_>>()?,
        }),
    };
    Some(Value { kind: Some(kind) })
}

/// Settings of the ADS client.
#[derive(Clone, Debug)]
pub struct AdsConfig {
    /// The node.
    pub node: Node,
    /// Types subscribed (wildcard), in request order.
    pub types: Vec<ResourceType>,
    /// Largest serialized resource decoded; larger ones are rejected unread.
    pub max_resource_bytes: usize,
    /// Most resources plus removals in one response; a response over it ends the stream unread (checked on the
    /// serialized bytes, before decoding allocates anything).
    pub max_resources_per_response: usize,
    /// First and reset backoff.
    pub backoff_initial: Duration,
    /// Backoff cap.
    pub backoff_max: Duration,
}

impl AdsConfig {
    /// Address and Authorization, 10 ms → 15 s backoff, resources up to 4 MiB each, a million per response.
    pub fn new(node: Node) -> Self {
        AdsConfig {
            node,
            types: ResourceType::ALL.to_vec(),
            max_resource_bytes: 4 * 1024 * 1024,
            max_resources_per_response: 1_000_000,
            backoff_initial: Duration::from_millis(10),
            backoff_max: Duration::from_secs(15),
        }
    }
}

/// One added or changed resource, validated.
#[derive(Clone, Debug, PartialEq)]
pub struct Upsert {
    /// Resource name (workload uid, `ns/hostname`, `ns/name`).
    pub name: String,
    /// Resource version as istiod sent it.
    pub version: String,
    /// The resource.
    pub resource: DecodedResource,
}

/// The consumer of updates (the proxy's state).
pub trait Handler: Send + 'static {
    /// Applies one response: `removals` (names; a name may be unknown) first, then `upserts`. Returns the upserts it
    /// refused, as `(name, reason)`; they are NACKed and their versions not recorded. Must not block for long: the
    /// stream waits.
    fn apply(&mut self, ty: ResourceType, upserts: Vec<Upsert>, removals: Vec<String>) -> Vec<(String, String)>;
}

/// Whether the client has applied a first response of every subscribed type.
#[derive(Clone, Debug)]
pub struct Readiness(watch::Receiver<bool>);

impl Readiness {
    /// True once ready.
    pub fn is_ready(&self) -> bool {
        *self.0.borrow()
    }

    /// Waits until ready (forever if the client never gets there).
    pub async fn wait(&mut self) {
        let _ = self.0.wait_for(|ready| *ready).await;
    }
}

/// How one stream ended.
#[derive(Debug)]
pub enum StreamEnd {
    /// No stream: connect, TLS, HTTP/2 handshake or configuration failed.
    Connect(ChannelError),
    /// The server (or a reset, mapped as tonic maps HTTP/2 errors) ended the stream with this status.
    Status(GrpcStatus),
    /// The server ended the stream with OK; `responses` is how many responses it had sent.
    Ended {
        /// Responses received on the stream.
        responses: u64,
    },
}

impl StreamEnd {
    fn from_stream_error(e: ChannelError) -> Self {
        match e {
            ChannelError::Status(s) => StreamEnd::Status(s),
            ChannelError::Http2(e) => StreamEnd::Status(status_of_h2(&e)),
            ChannelError::Frame(e) => StreamEnd::Status(GrpcStatus { code: Code::Internal, message: e.to_string() }),
            ChannelError::Decode(e) => StreamEnd::Status(GrpcStatus { code: Code::Internal, message: e.to_string() }),
            other => StreamEnd::Connect(other),
        }
    }
}

/// The status a gRPC client reports for an HTTP/2 failure (as tonic maps them).
fn status_of_h2(e: &h2::Error) -> GrpcStatus {
    let code = match e.reason() {
        Some(h2::Reason::CANCEL) => Code::Cancelled,
        Some(h2::Reason::REFUSED_STREAM) => Code::Unavailable,
        Some(h2::Reason::ENHANCE_YOUR_CALM) => Code::ResourceExhausted,
        Some(h2::Reason::INADEQUATE_SECURITY) => Code::PermissionDenied,
        Some(_) => Code::Internal,
        None => Code::Unknown,
    };
    GrpcStatus { code, message: e.to_string() }
}

/// ztunnel's reconnect backoff.
#[derive(Clone, Debug)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    current: Duration,
}

impl Backoff {
    /// Starts at `initial`.
    pub fn new(initial: Duration, max: Duration) -> Self {
        Backoff { initial, max, current: initial }
    }

    /// How long to wait before reconnecting after `end`, on a stream that had received `responses` responses.
    /// The reset and immediate classes apply only to a stream that had worked (at least one response): a server
    /// that fails every stream at once, e.g. istiod without `PILOT_ENABLE_AMBIENT=true` (an `Unknown` status), is
    /// retried with doubling delays rather than every 10 ms.
    pub fn after(&mut self, end: &StreamEnd, responses: u64) -> Duration {
        let worked = responses > 0;
        let reset = match end {
            StreamEnd::Ended { .. } if worked => return Duration::ZERO,
            StreamEnd::Ended { .. } | StreamEnd::Connect(_) => false,
            StreamEnd::Status(_) if !worked => false,
            StreamEnd::Status(s) => match s.code {
                Code::Unknown | Code::Cancelled | Code::DeadlineExceeded => true,
                Code::Unavailable => {
                    s.message.contains("transport is closing") || s.message.contains("received prior goaway")
                }
                _ => false,
            },
        };
        self.current = if reset { self.initial } else { (self.current * 2).min(self.max) };
        self.current
    }
}

/// The Delta ADS client. [`AdsClient::run`] drives it until the shutdown future completes.
pub struct AdsClient<H> {
    channel: Channel,
    config: AdsConfig,
    handler: H,
    held: BTreeMap<ResourceType, BTreeMap<String, String>>,
    not_yet_seen: BTreeSet<ResourceType>,
    ready: watch::Sender<bool>,
    backoff: Backoff,
    /// Responses received on the last (or current) stream.
    last_stream_responses: u64,
}

impl<H: Handler> AdsClient<H> {
    /// A client on `channel` handing updates to `handler`; the [`Readiness`] turns true as the module says.
    pub fn new(channel: Channel, config: AdsConfig, handler: H) -> (Self, Readiness) {
        let (ready, readiness) = watch::channel(config.types.is_empty());
        let backoff = Backoff::new(config.backoff_initial, config.backoff_max);
        let not_yet_seen = config.types.iter().copied().collect();
        let client = AdsClient {
            channel,
            config,
            handler,
            held: BTreeMap::new(),
            not_yet_seen,
            ready,
            backoff,
            last_stream_responses: 0,
        };
        (client, Readiness(readiness))
    }

    /// The versions held for `ty` (what the next stream echoes).
    pub fn held_versions(&self, ty: ResourceType) -> BTreeMap<String, String> {
        self.held.get(&ty).cloned().unwrap_or_default()
    }

    /// Runs streams back to back, with backoff, until `shutdown` completes.
    pub async fn run(mut self, shutdown: impl Future<Output = ()>) {
        tokio::pin!(shutdown);
        loop {
            let end = tokio::select! {
                end = self.run_stream() => end,
                () = &mut shutdown => return,
            };
            let delay = self.backoff.after(&end, self.last_stream_responses);
            match &end {
                StreamEnd::Ended { responses } => tracing::info!(responses, ?delay, "xDS stream ended"),
                StreamEnd::Connect(e) => tracing::warn!(error = %e, ?delay, "xDS connection failed"),
                StreamEnd::Status(s) => tracing::warn!(error = %s, ?delay, "xDS stream failed"),
            }
            if !delay.is_zero() {
                tokio::select! {
                    () = tokio::time::sleep(delay) => {}
                    () = &mut shutdown => return,
                }
            }
        }
    }

    /// One stream, from connect to its end.
    pub async fn run_stream(&mut self) -> StreamEnd {
        let connection = match self.channel.connect().await {
            Ok(c) => c,
            Err(e) => return StreamEnd::Connect(e),
        };
        let (mut sink, mut stream) = match connection.streaming(DELTA_ADS_PATH).await {
            Ok(call) => call,
            Err(e) => return StreamEnd::from_stream_error(e),
        };
        for ty in &self.config.types {
            let request = DeltaDiscoveryRequest {
                node: Some(self.config.node.clone()),
                type_url: ty.type_url().to_owned(),
                initial_resource_versions: self.held_versions(*ty),
                ..Default::default()
            };
            if let Err(e) = sink.send(&request) {
                return StreamEnd::from_stream_error(e);
            }
        }
        tracing::info!(types = self.config.types.len(), "xDS stream open");
        self.last_stream_responses = 0;
        let mut responses = 0u64;
        loop {
            let bytes = match stream.message_bytes().await {
                Ok(Some(bytes)) => bytes,
                Ok(None) => return StreamEnd::Ended { responses },
                Err(e) => return StreamEnd::from_stream_error(e),
            };
            let response = match self.decode_response(bytes) {
                Ok(r) => r,
                Err(message) => return StreamEnd::Status(GrpcStatus { code: Code::Internal, message }),
            };
            responses += 1;
            self.last_stream_responses = responses;
            let (answer, ty) = self.handle_response(response);
            if let Err(e) = sink.send(&answer) {
                return StreamEnd::from_stream_error(e);
            }
            if let Some(ty) = ty {
                if self.not_yet_seen.remove(&ty) && self.not_yet_seen.is_empty() {
                    tracing::info!("xDS ready: every subscribed type applied");
                    self.ready.send_replace(true);
                }
            }
        }
    }

    /// Decodes a response after checking, on its bytes, that it holds at most `max_resources_per_response`
    /// resources and removals.
    fn decode_response(&self, bytes: bytes::Bytes) -> Result<DeltaDiscoveryResponse, String> {
        let [resources, removals] = count_fields(&bytes, [RESPONSE_RESOURCES_TAG, RESPONSE_REMOVED_TAG])
            .map_err(|e| format!("response: {e}"))?;
        let max = self.config.max_resources_per_response;
        if resources.saturating_add(removals) > max {
            return Err(format!("response holds {resources} resources and {removals} removals, over the {max} limit"));
        }
        DeltaDiscoveryResponse::decode(bytes).map_err(|e| format!("response: {e}"))
    }

    /// Applies one response and builds its ACK or NACK; returns the type if it is one subscribed.
    fn handle_response(&mut self, response: DeltaDiscoveryResponse) -> (DeltaDiscoveryRequest, Option<ResourceType>) {
        let mut answer = DeltaDiscoveryRequest {
            type_url: response.type_url.clone(),
            response_nonce: response.nonce.clone(),
            ..Default::default()
        };
        let Some(ty) = ResourceType::from_type_url(&response.type_url).filter(|t| self.config.types.contains(t)) else {
            tracing::warn!(type_url = %truncate(&response.type_url, 128), "xDS response of an unknown type, ACKed");
            return (answer, None);
        };
        let mut rejected: Vec<(String, String)> = Vec::new();
        let mut upserts = Vec::with_capacity(response.resources.len());
        let mut names_in_response = BTreeSet::new();
        for resource in &response.resources {
            if !names_in_response.insert(resource.name.as_str()) {
                rejected.push((resource.name.clone(), "duplicate name in response".into()));
                continue;
            }
            match decode_resource(ty, resource, self.config.max_resource_bytes) {
                Ok(decoded) => upserts.push(Upsert {
                    name: resource.name.clone(),
                    version: resource.version.clone(),
                    resource: decoded,
                }),
                Err(e) => rejected.push((resource.name.clone(), e.to_string())),
            }
        }
        let offered: Vec<(String, String)> = upserts.iter().map(|u| (u.name.clone(), u.version.clone())).collect();
        let removals = response.removed_resources;
        let refused = self.handler.apply(ty, upserts, removals.clone());
        let refused_names: BTreeSet<&str> = refused.iter().map(|(n, _)| n.as_str()).collect();
        let held = self.held.entry(ty).or_default();
        for name in &removals {
            held.remove(name);
        }
        let mut accepted = 0usize;
        for (name, version) in offered {
            if !refused_names.contains(name.as_str()) {
                held.insert(name, version);
                accepted += 1;
            }
        }
        rejected.extend(refused);
        tracing::debug!(
            type_url = ty.type_url(),
            accepted,
            rejected = rejected.len(),
            removed = removals.len(),
            "xDS response applied"
        );
        if !rejected.is_empty() {
            let message = nack_message(&rejected);
            tracing::warn!(type_url = ty.type_url(), %message, "xDS NACK");
            answer.error_detail = Some(Status { code: 0, message, details: vec![] });
        }
        (answer, Some(ty))
    }
}

/// `name: reason; name: reason`, bounded by [`MAX_NACK_MESSAGE`].
fn nack_message(rejected: &[(String, String)]) -> String {
    let mut message = String::new();
    for (i, (name, reason)) in rejected.iter().enumerate() {
        let entry = format!("{}: {}", truncate(name, 256), truncate(reason, 512));
        if message.len() + entry.len() + 2 > MAX_NACK_MESSAGE {
            message.push_str(&format!("; … and {} more", rejected.len() - i));
            break;
        }
        if i > 0 {
            message.push_str("; ");
        }
        message.push_str(&entry);
    }
    message
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(code: Code, message: &str) -> StreamEnd {
        StreamEnd::Status(GrpcStatus { code, message: message.into() })
    }

    #[test]
    fn backoff_classes() {
        let ms = Duration::from_millis;
        let mut b = Backoff::new(ms(10), Duration::from_secs(15));
        let conn = || StreamEnd::Connect(ChannelError::ConnectTimeout("x".into()));
        assert_eq!(b.after(&conn(), 0), ms(20));
        assert_eq!(b.after(&status(Code::Unauthenticated, ""), 0), ms(40));
        assert_eq!(b.after(&status(Code::Unauthenticated, ""), 5), ms(80));
        assert_eq!(b.after(&StreamEnd::Ended { responses: 3 }, 3), Duration::ZERO);
        assert_eq!(b.after(&StreamEnd::Ended { responses: 0 }, 0), ms(160));
        assert_eq!(b.after(&status(Code::Unavailable, "connection refused"), 1), ms(320));
        assert_eq!(b.after(&status(Code::Unavailable, "transport is closing"), 1), ms(10));
        assert_eq!(b.after(&conn(), 0), ms(20));
        assert_eq!(b.after(&status(Code::Unavailable, "received prior goaway: code: NO_ERROR"), 7), ms(10));
        for code in [Code::Unknown, Code::Cancelled, Code::DeadlineExceeded] {
            b.after(&conn(), 0);
            assert_eq!(b.after(&status(code, ""), 1), ms(10), "{code:?}");
        }
        // The same statuses before any response: doubling (istiod without ambient answers Unknown at once).
        assert_eq!(b.after(&status(Code::Unknown, "ztunnel requires PILOT_ENABLE_AMBIENT=true"), 0), ms(20));
        assert_eq!(b.after(&status(Code::Unavailable, "transport is closing"), 0), ms(40));
        for _ in 0..20 {
            b.after(&conn(), 0);
        }
        assert_eq!(b.after(&conn(), 0), Duration::from_secs(15));
    }

    #[test]
    fn node_id_and_metadata() {
        let id = NodeIdentity {
            instance_ip: Some("10.0.0.5".parse().unwrap()),
            instance_ips: vec!["10.0.0.5".parse().unwrap(), "fd00::5".parse().unwrap()],
            pod_name: "ztunnel-abc".into(),
            pod_namespace: "istio-system".into(),
            node_name: "node-1".into(),
            extra_metadata: BTreeMap::new(),
        }
        .with_istio_meta_env([
            ("ISTIO_META_CLUSTER_ID".to_owned(), "Kubernetes".to_owned()),
            ("OTHER".to_owned(), "x".to_owned()),
        ]);
        let node = id.node();
        assert_eq!(node.id, "ztunnel~10.0.0.5~ztunnel-abc.istio-system~istio-system.svc.cluster.local");
        let md = node.metadata.unwrap().fields;
        let get = |k: &str| md.get(k).and_then(Value::as_str).map(str::to_owned);
        assert_eq!(get("NAME").as_deref(), Some("ztunnel-abc"));
        assert_eq!(get("NAMESPACE").as_deref(), Some("istio-system"));
        assert_eq!(get("INSTANCE_IPS").as_deref(), Some("10.0.0.5,fd00::5"));
        assert_eq!(get("NODE_NAME").as_deref(), Some("node-1"));
        assert_eq!(get("CLUSTER_ID").as_deref(), Some("Kubernetes"));
        assert_eq!(md.len(), 5);
        assert!(NodeIdentity::default().node_id().starts_with("ztunnel~1.1.1.1~"));
    }

    #[test]
    fn metajson_variables_become_structured_metadata() {
        use crate::wire::envoy::{value::Kind, ListValue};
        let id = NodeIdentity::default()
            .with_istio_metajson_env([
                ("ISTIO_METAJSON_LABELS".to_owned(), r#"{"app":"z","n":[1,true,null]}"#.to_owned()),
                ("ISTIO_META_X".to_owned(), "{".to_owned()),
            ])
            .unwrap();
        let labels = &id.extra_metadata["LABELS"];
        let Some(Kind::StructValue(s)) = &labels.kind else { panic!("{labels:?}") };
        assert_eq!(s.fields["app"], Value::string("z"));
        let list = ListValue {
            values: vec![
                Value { kind: Some(Kind::NumberValue(1.0)) },
                Value { kind: Some(Kind::BoolValue(true)) },
                Value { kind: Some(Kind::NullValue(0)) },
            ],
        };
        assert_eq!(s.fields["n"], Value { kind: Some(Kind::ListValue(list)) });
        assert_eq!(id.extra_metadata.len(), 1);
        let bad = NodeIdentity::default().with_istio_metajson_env([("ISTIO_METAJSON_A".to_owned(), "{".to_owned())]);
        assert!(bad.unwrap_err().starts_with("ISTIO_METAJSON_A: "));
        let deep = format!("{}{}", "[".repeat(40), "]".repeat(40));
        let deep = NodeIdentity::default().with_istio_metajson_env([("ISTIO_METAJSON_D".to_owned(), deep)]);
        assert_eq!(deep.unwrap_err(), "ISTIO_METAJSON_D: nested too deep");
    }

    #[test]
    fn nack_message_is_bounded() {
        let rejected: Vec<_> = (0..10_000).map(|i| (format!("name-{i}"), "x".repeat(100))).collect();
        let m = nack_message(&rejected);
        assert!(m.len() <= MAX_NACK_MESSAGE + 64, "{}", m.len());
        assert!(m.starts_with("name-0: xxx"));
        assert!(m.ends_with("more"));
        assert_eq!(nack_message(&[("a".into(), "r1".into()), ("b".into(), "r2".into())]), "a: r1; b: r2");
    }
}

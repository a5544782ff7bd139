//! Envoy's delta discovery messages and the Google well-known types they carry.
//!
//! Field numbers: `envoy.config.core.v3.Node` (id=1, cluster=2, metadata=3; 5, `build_version`, is reserved in v3
//! and so never sent), `google.protobuf.Struct`/`Value`/`ListValue`/`Any`, `google.rpc.Status`,
//! `envoy.service.discovery.v3.DeltaDiscoveryRequest`/`DeltaDiscoveryResponse`/`Resource`.

use std::collections::BTreeMap;

/// `google.protobuf.Any`: a serialized message and the URL naming its type.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Any {
    /// `type.googleapis.com/<full message name>`.
    #[prost(string, tag = "1")]
    pub type_url: String,
    /// The serialized message.
    #[prost(bytes = "vec", tag = "2")]
    pub value: Vec<u8>,
}

/// `google.rpc.Status`: the error detail of a NACK.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Status {
    /// gRPC status code (istiod only logs it; a NACK is any request with `error_detail` set).
    #[prost(int32, tag = "1")]
    pub code: i32,
    /// Human-readable reason.
    #[prost(string, tag = "2")]
    pub message: String,
    /// Structured details (never sent by this client).
    #[prost(message, repeated, tag = "3")]
    pub details: Vec<Any>,
}

/// `google.protobuf.Struct`: a JSON object.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Struct {
    /// The object's members, ordered by key so the encoding is deterministic.
    #[prost(btree_map = "string, message", tag = "1")]
    pub fields: BTreeMap<String, Value>,
}

/// `google.protobuf.ListValue`: a JSON array.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ListValue {
    /// The array's elements.
    #[prost(message, repeated, tag = "1")]
    pub values: Vec<Value>,
}

/// `google.protobuf.Value`: a JSON value.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Value {
    /// Which JSON value this is; `None` decodes from an empty message.
    #[prost(oneof = "value::Kind", tags = "1, 2, 3, 4, 5, 6")]
    pub kind: Option<value::Kind>,
}

/// The oneof of [`Value`].
pub mod value {
    /// A JSON value.
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Kind {
        /// `null` (the enum `google.protobuf.NullValue` has the single value 0).
        #[prost(int32, tag = "1")]
        NullValue(i32),
        /// A number.
        #[prost(double, tag = "2")]
        NumberValue(f64),
        /// A string.
        #[prost(string, tag = "3")]
        StringValue(String),
        /// A boolean.
        #[prost(bool, tag = "4")]
        BoolValue(bool),
        /// An object.
        #[prost(message, tag = "5")]
        StructValue(super::Struct),
        /// An array.
        #[prost(message, tag = "6")]
        ListValue(super::ListValue),
    }
}

impl Value {
    /// A string value.
    pub fn string(s: impl Into<String>) -> Self {
        Value { kind: Some(value::Kind::StringValue(s.into())) }
    }

    /// The string inside, if this is a string value.
    pub fn as_str(&self) -> Option<&str> {
        match &self.kind {
            Some(value::Kind::StringValue(s)) => Some(s),
            _ => None,
        }
    }
}

/// `envoy.config.core.v3.Node`: who is asking. istiod parses `id` and `metadata`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Node {
    /// `ztunnel~{ip}~{pod}.{ns}~{ns}.svc.cluster.local`.
    #[prost(string, tag = "1")]
    pub id: String,
    /// Unused by istiod for ztunnel; left empty.
    #[prost(string, tag = "2")]
    pub cluster: String,
    /// Proxy metadata (`NAME`, `NAMESPACE`, `INSTANCE_IPS`, `NODE_NAME`, `ISTIO_META_*`).
    #[prost(message, optional, tag = "3")]
    pub metadata: Option<Struct>,
}

/// `envoy.service.discovery.v3.DeltaDiscoveryRequest`: subscription, ACK or NACK.
#[derive(Clone, PartialEq, prost::Message)]
pub struct DeltaDiscoveryRequest {
    /// Sent on the first request of each type on a stream only.
    #[prost(message, optional, tag = "1")]
    pub node: Option<Node>,
    /// The resource type this request is about.
    #[prost(string, tag = "2")]
    pub type_url: String,
    /// Names to subscribe; empty on the first request means wildcard.
    #[prost(string, repeated, tag = "3")]
    pub resource_names_subscribe: Vec<String>,
    /// Names to unsubscribe.
    #[prost(string, repeated, tag = "4")]
    pub resource_names_unsubscribe: Vec<String>,
    /// On a new stream: every name → version the client holds for this type.
    #[prost(btree_map = "string, string", tag = "5")]
    pub initial_resource_versions: BTreeMap<String, String>,
    /// The nonce of the response this request ACKs or NACKs.
    #[prost(string, tag = "6")]
    pub response_nonce: String,
    /// Set on a NACK only.
    #[prost(message, optional, tag = "7")]
    pub error_detail: Option<Status>,
}

/// `envoy.service.discovery.v3.Resource`: one named, versioned resource of a delta response.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Resource {
    /// Opaque version (istiod: a content hash for Address, empty for Authorization).
    #[prost(string, tag = "1")]
    pub version: String,
    /// The resource itself.
    #[prost(message, optional, tag = "2")]
    pub resource: Option<Any>,
    /// The resource's name (workload uid, `ns/hostname`, `ns/name`).
    #[prost(string, tag = "3")]
    pub name: String,
    /// Other names (on-demand only).
    #[prost(string, repeated, tag = "4")]
    pub aliases: Vec<String>,
}

/// `envoy.service.discovery.v3.DeltaDiscoveryResponse`: upserts and removals of one type.
#[derive(Clone, PartialEq, prost::Message)]
pub struct DeltaDiscoveryResponse {
    /// Informational.
    #[prost(string, tag = "1")]
    pub system_version_info: String,
    /// Added or changed resources.
    #[prost(message, repeated, tag = "2")]
    pub resources: Vec<Resource>,
    /// The type of every resource in this response.
    #[prost(string, tag = "4")]
    pub type_url: String,
    /// Echoed in the ACK/NACK.
    #[prost(string, tag = "5")]
    pub nonce: String,
    /// Names removed.
    #[prost(string, repeated, tag = "6")]
    pub removed_resources: Vec<String>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    #[test]
    fn any_and_status_bytes() {
        let any = Any { type_url: "t".into(), value: vec![1, 2] };
        assert_eq!(any.encode_to_vec(), [0x0a, 0x01, b't', 0x12, 0x02, 1, 2]);
        let status = Status { code: 3, message: "m".into(), details: vec![any.clone()] };
        let bytes = [0x08, 0x03, 0x12, 0x01, b'm', 0x1a, 0x07, 0x0a, 0x01, b't', 0x12, 0x02, 1, 2];
        assert_eq!(status.encode_to_vec(), bytes);
        assert_eq!(Status::decode(&bytes[..]).unwrap(), status);
    }

    #[test]
    fn struct_value_bytes() {
        let mut s = Struct::default();
        s.fields.insert("k".into(), Value::string("v"));
        // fields=1 map entry {key=1 "k", value=2 Value{string_value=3 "v"}}
        let bytes = [0x0a, 0x08, 0x0a, 0x01, b'k', 0x12, 0x03, 0x1a, 0x01, b'v'];
        assert_eq!(s.encode_to_vec(), bytes);
        assert_eq!(Struct::decode(&bytes[..]).unwrap(), s);
        // Every kind's tag and wire type.
        let kinds = [
            (Value { kind: Some(value::Kind::NullValue(0)) }, vec![0x08, 0x00]),
            (Value { kind: Some(value::Kind::NumberValue(1.0)) }, vec![0x11, 0, 0, 0, 0, 0, 0, 0xf0, 0x3f]),
            (Value { kind: Some(value::Kind::BoolValue(true)) }, vec![0x20, 0x01]),
            (Value { kind: Some(value::Kind::StructValue(Struct::default())) }, vec![0x2a, 0x00]),
            (
                Value { kind: Some(value::Kind::ListValue(ListValue { values: vec![Value::string("")] })) },
                vec![0x32, 0x04, 0x0a, 0x02, 0x1a, 0x00],
            ),
        ];
        for (v, b) in kinds {
            assert_eq!(v.encode_to_vec(), b, "{v:?}");
            assert_eq!(Value::decode(&b[..]).unwrap(), v);
        }
    }

    #[test]
    fn node_bytes() {
        let mut md = Struct::default();
        md.fields.insert("N".into(), Value::string("x"));
        let node = Node { id: "a~b".into(), cluster: "c".into(), metadata: Some(md) };
        let bytes = [
            0x0a, 0x03, b'a', b'~', b'b', // id=1
            0x12, 0x01, b'c', // cluster=2
            0x1a, 0x0a, 0x0a, 0x08, 0x0a, 0x01, b'N', 0x12, 0x03, 0x1a, 0x01, b'x', // metadata=3
        ];
        assert_eq!(node.encode_to_vec(), bytes);
        assert_eq!(Node::decode(&bytes[..]).unwrap(), node);
        // Field 5 (build_version, reserved in v3) from an old peer is skipped, not an error.
        let mut old = bytes.to_vec();
        old.extend_from_slice(&[0x2a, 0x01, b'v']);
        assert_eq!(Node::decode(&old[..]).unwrap(), node);
    }

    #[test]
    fn delta_request_bytes() {
        let mut versions = BTreeMap::new();
        versions.insert("n".into(), "1".into());
        let req = DeltaDiscoveryRequest {
            node: Some(Node { id: "i".into(), ..Default::default() }),
            type_url: "t".into(),
            resource_names_subscribe: vec!["s".into()],
            resource_names_unsubscribe: vec!["u".into()],
            initial_resource_versions: versions,
            response_nonce: "x".into(),
            error_detail: Some(Status { code: 0, message: "e".into(), details: vec![] }),
        };
        let bytes = [
            0x0a, 0x03, 0x0a, 0x01, b'i', // node=1
            0x12, 0x01, b't', // type_url=2
            0x1a, 0x01, b's', // subscribe=3
            0x22, 0x01, b'u', // unsubscribe=4
            0x2a, 0x06, 0x0a, 0x01, b'n', 0x12, 0x01, b'1', // initial_resource_versions=5
            0x32, 0x01, b'x', // response_nonce=6
            0x3a, 0x03, 0x12, 0x01, b'e', // error_detail=7 (code 0 is not encoded)
        ];
        assert_eq!(req.encode_to_vec(), bytes);
        assert_eq!(DeltaDiscoveryRequest::decode(&bytes[..]).unwrap(), req);
        // An ACK: type_url and nonce only.
        let ack = DeltaDiscoveryRequest { type_url: "t".into(), response_nonce: "x".into(), ..Default::default() };
        assert_eq!(ack.encode_to_vec(), [0x12, 0x01, b't', 0x32, 0x01, b'x']);
    }

    #[test]
    fn delta_response_bytes() {
        let resp = DeltaDiscoveryResponse {
            system_version_info: "v".into(),
            resources: vec![Resource {
                version: "1".into(),
                resource: Some(Any { type_url: "t".into(), value: vec![] }),
                name: "n".into(),
                aliases: vec!["a".into()],
            }],
            type_url: "t".into(),
            nonce: "x".into(),
            removed_resources: vec!["r".into()],
        };
        let bytes = [
            0x0a, 0x01, b'v', // system_version_info=1
            0x12, 0x0e, // resources=2
            0x0a, 0x01, b'1', // version=1
            0x12, 0x03, 0x0a, 0x01, b't', // resource=2 Any
            0x1a, 0x01, b'n', // name=3
            0x22, 0x01, b'a', // aliases=4
            0x22, 0x01, b't', // type_url=4
            0x2a, 0x01, b'x', // nonce=5
            0x32, 0x01, b'r', // removed_resources=6
        ];
        assert_eq!(resp.encode_to_vec(), bytes);
        assert_eq!(DeltaDiscoveryResponse::decode(&bytes[..]).unwrap(), resp);
    }
}

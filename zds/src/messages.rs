//! Protobuf messages of package `istio.workload.zds`, written by hand with prost derives (no protoc needed).
//!
//! Field numbers follow Istio's `zds.proto`; the unit tests pin the wire bytes ztunnel expects.

/// Protocol version the proxy announces in its hello.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum Version {
    /// Proto3 default; never valid on the wire.
    NotUsed = 0,
    /// The only version in use.
    V1 = 1,
}

/// First message of every connection, sent by the proxy.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ZdsHello {
    /// Protocol version the proxy speaks; the agent accepts only [`Version::V1`].
    #[prost(enumeration = "Version", tag = "1")]
    pub version: i32,
}

/// Identity of a workload, so the proxy can mint its certificate without asking the API server.
#[derive(Clone, PartialEq, prost::Message)]
pub struct WorkloadInfo {
    /// Pod name.
    #[prost(string, tag = "1")]
    pub name: String,
    /// Pod namespace.
    #[prost(string, tag = "2")]
    pub namespace: String,
    /// Pod service account.
    #[prost(string, tag = "3")]
    pub service_account: String,
    // Field 4 (trust_domain) is reserved upstream.
}

/// Enroll a pod; the datagram carries exactly one fd, the pod's network namespace.
#[derive(Clone, PartialEq, prost::Message)]
pub struct AddWorkload {
    /// Pod UID.
    #[prost(string, tag = "1")]
    pub uid: String,
    /// Pod identity. ztunnel exits when it is missing, so senders always set it.
    #[prost(message, optional, tag = "2")]
    pub workload_info: Option<WorkloadInfo>,
}

/// Snapshot entry for a pod whose netns the agent does not have: the proxy keeps it if it already runs it.
#[derive(Clone, PartialEq, prost::Message)]
pub struct KeepWorkload {
    /// Pod UID.
    #[prost(string, tag = "1")]
    pub uid: String,
}

/// Unenroll a pod: the proxy stops serving it.
#[derive(Clone, PartialEq, prost::Message)]
pub struct DelWorkload {
    /// Pod UID (field 2 upstream; field 1 was used by an old version).
    #[prost(string, tag = "2")]
    pub uid: String,
}

/// Marks the end of the snapshot; the proxy drops every pod that was not in it.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SnapshotSent {}

/// The proxy's answer to every request; a non-empty `error` means the request failed.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Ack {
    /// Empty on success, the reason otherwise.
    #[prost(string, tag = "1")]
    pub error: String,
}

/// Every message the agent sends after the hello.
#[derive(Clone, PartialEq, prost::Message)]
pub struct WorkloadRequest {
    /// The one request this datagram carries.
    #[prost(oneof = "workload_request::Payload", tags = "1, 2, 3, 5")]
    pub payload: Option<workload_request::Payload>,
}

/// The oneof of [`WorkloadRequest`].
pub mod workload_request {
    /// What the agent asks of the proxy.
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Payload {
        /// Enroll a pod (carries its netns fd).
        #[prost(message, tag = "1")]
        Add(super::AddWorkload),
        /// Unenroll a pod.
        #[prost(message, tag = "2")]
        Del(super::DelWorkload),
        /// End of snapshot.
        #[prost(message, tag = "3")]
        SnapshotSent(super::SnapshotSent),
        /// Keep a pod whose netns is unknown (snapshot only).
        #[prost(message, tag = "5")]
        Keep(super::KeepWorkload),
    }
}

/// Every message the proxy sends after the hello.
#[derive(Clone, PartialEq, prost::Message)]
pub struct WorkloadResponse {
    /// The one response this datagram carries.
    #[prost(oneof = "workload_response::Payload", tags = "1")]
    pub payload: Option<workload_response::Payload>,
}

/// The oneof of [`WorkloadResponse`].
pub mod workload_response {
    /// What the proxy answers.
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Payload {
        /// Acknowledgement of the last request.
        #[prost(message, tag = "1")]
        Ack(super::Ack),
    }
}

impl ZdsHello {
    /// The hello every V1 proxy sends.
    pub fn v1() -> Self {
        ZdsHello { version: Version::V1 as i32 }
    }
}

impl WorkloadRequest {
    /// An `AddWorkload` request (identity always set, as ztunnel requires).
    pub fn add(uid: &str, info: WorkloadInfo) -> Self {
        Self::from(workload_request::Payload::Add(AddWorkload { uid: uid.to_owned(), workload_info: Some(info) }))
    }

    /// A `KeepWorkload` request.
    pub fn keep(uid: &str) -> Self {
        Self::from(workload_request::Payload::Keep(KeepWorkload { uid: uid.to_owned() }))
    }

    /// A `DelWorkload` request.
    pub fn del(uid: &str) -> Self {
        Self::from(workload_request::Payload::Del(DelWorkload { uid: uid.to_owned() }))
    }

    /// The `SnapshotSent` marker.
    pub fn snapshot_sent() -> Self {
        Self::from(workload_request::Payload::SnapshotSent(SnapshotSent {}))
    }
}

impl From<workload_request::Payload> for WorkloadRequest {
    fn from(payload: workload_request::Payload) -> Self {
        WorkloadRequest { payload: Some(payload) }
    }
}

impl WorkloadResponse {
    /// An ack: `None` for success, `Some(reason)` for failure.
    pub fn ack(error: Option<String>) -> Self {
        WorkloadResponse { payload: Some(workload_response::Payload::Ack(Ack { error: error.unwrap_or_default() })) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    #[test]
    fn hello_v1_bytes() {
        assert_eq!(ZdsHello::v1().encode_to_vec(), [0x08, 0x01]);
        let back = ZdsHello::decode(&[0x08u8, 0x01][..]).unwrap();
        assert_eq!(back.version(), Version::V1);
    }

    #[test]
    fn empty_ack_bytes() {
        assert_eq!(WorkloadResponse::ack(None).encode_to_vec(), [0x0a, 0x00]);
        let back = WorkloadResponse::decode(&[0x0au8, 0x00][..]).unwrap();
        assert_eq!(back, WorkloadResponse::ack(None));
    }

    #[test]
    fn snapshot_sent_bytes() {
        assert_eq!(WorkloadRequest::snapshot_sent().encode_to_vec(), [0x1a, 0x00]);
    }

    #[test]
    fn field_numbers_on_the_wire() {
        // Del uses field 2 for the uid; Keep is oneof tag 5.
        assert_eq!(WorkloadRequest::del("u").encode_to_vec(), [0x12, 0x03, 0x12, 0x01, b'u']);
        assert_eq!(WorkloadRequest::keep("u").encode_to_vec(), [0x2a, 0x03, 0x0a, 0x01, b'u']);
        let info = WorkloadInfo { name: "n".into(), namespace: "s".into(), service_account: "a".into() };
        assert_eq!(
            WorkloadRequest::add("u", info).encode_to_vec(),
            [
                0x0a, 0x0e, // add, 14 bytes
                0x0a, 0x01, b'u', // uid
                0x12, 0x09, // workload_info, 9 bytes
                0x0a, 0x01, b'n', 0x12, 0x01, b's', 0x1a, 0x01, b'a',
            ]
        );
    }

    #[test]
    fn round_trips() {
        let info = WorkloadInfo { name: "pod-1".into(), namespace: "default".into(), service_account: "sa".into() };
        for req in [
            WorkloadRequest::add("uid-1", info),
            WorkloadRequest::keep("uid-2"),
            WorkloadRequest::del("uid-3"),
            WorkloadRequest::snapshot_sent(),
        ] {
            assert_eq!(WorkloadRequest::decode(&req.encode_to_vec()[..]).unwrap(), req);
        }
        let nack = WorkloadResponse::ack(Some("no netns".into()));
        assert_eq!(WorkloadResponse::decode(&nack.encode_to_vec()[..]).unwrap(), nack);
        let hello = ZdsHello::v1();
        assert_eq!(ZdsHello::decode(&hello.encode_to_vec()[..]).unwrap(), hello);
    }

    #[test]
    fn an_ack_is_not_a_hello() {
        // A proxy that skips the hello and acks is caught by decoding: the wire type of field 1 differs.
        assert!(ZdsHello::decode(&WorkloadResponse::ack(None).encode_to_vec()[..]).is_err());
    }
}

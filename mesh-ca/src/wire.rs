//! The protobuf messages of istiod's CA service, `istio.v1.auth.IstioCertificateService`
//! (`istio.io/api` `security/v1alpha1/ca.proto`), written by hand with prost derives.
//!
//! Guarantees: field numbers follow the published definition (`IstioCertificateRequest{csr=1,
//! validity_duration=3, metadata=4}`, `IstioCertificateResponse{cert_chain=1}`), pinned byte for byte by the unit
//! tests; `metadata` is the `google.protobuf.Struct` of the `xds` crate. Unknown fields are skipped by prost.

use xds::wire::{Struct, Value};

/// The gRPC path of the one call the client makes.
pub const CREATE_CERTIFICATE_PATH: &str = "/istio.v1.auth.IstioCertificateService/CreateCertificate";

/// The metadata key istiod reads to sign for another identity than the caller's (node proxies only).
pub const IMPERSONATED_IDENTITY: &str = "ImpersonatedIdentity";

/// `istio.v1.auth.IstioCertificateRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct IstioCertificateRequest {
    /// The PEM-encoded PKCS#10 request.
    #[prost(string, tag = "1")]
    pub csr: String,
    /// Requested lifetime in seconds; istiod applies its default to 0 or less and refuses more than its maximum.
    #[prost(int64, tag = "3")]
    pub validity_duration: i64,
    /// Options; this client only sets [`IMPERSONATED_IDENTITY`].
    #[prost(message, optional, tag = "4")]
    pub metadata: Option<Struct>,
}

impl IstioCertificateRequest {
    /// The impersonated identity carried in the metadata, if any (what istiod reads with `GetStringValue`).
    pub fn impersonated_identity(&self) -> Option<&str> {
        self.metadata.as_ref()?.fields.get(IMPERSONATED_IDENTITY)?.as_str().filter(|s| !s.is_empty())
    }

    /// A request for `csr`, valid `validity_seconds`, signed for `identity` on the caller's behalf.
    pub fn impersonating(csr: String, validity_seconds: i64, identity: &str) -> Self {
        let mut metadata = Struct::default();
        metadata.fields.insert(IMPERSONATED_IDENTITY.to_owned(), Value::string(identity));
        IstioCertificateRequest { csr, validity_duration: validity_seconds, metadata: Some(metadata) }
    }
}

/// `istio.v1.auth.IstioCertificateResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct IstioCertificateResponse {
    /// PEM certificates: the leaf first, then each intermediate, then the root bundle (possibly several roots in
    /// that one last element).
    #[prost(string, repeated, tag = "1")]
    pub cert_chain: Vec<String>,
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::*;

    #[test]
    fn request_bytes_are_pinned() {
        let request = IstioCertificateRequest::impersonating("C".into(), 86400, "spiffe://td/ns/a/sa/b");
        let bytes = request.encode_to_vec();
        let id = b"spiffe://td/ns/a/sa/b";
        let mut value = vec![0x1a, id.len() as u8]; // Value.string_value (3)
        value.extend_from_slice(id);
        let mut entry = vec![0x0a, 20]; // key (1): "ImpersonatedIdentity"
        entry.extend_from_slice(IMPERSONATED_IDENTITY.as_bytes());
        entry.push(0x12); // value (2)
        entry.push(value.len() as u8);
        entry.extend_from_slice(&value);
        let mut metadata = vec![0x0a, entry.len() as u8]; // Struct.fields (1)
        metadata.extend_from_slice(&entry);
        let mut expected = vec![0x0a, 1, b'C']; // csr (1)
        expected.extend_from_slice(&[0x18, 0x80, 0xa3, 0x05]); // validity_duration (3) = 86400
        expected.push(0x22); // metadata (4)
        expected.push(metadata.len() as u8);
        expected.extend_from_slice(&metadata);
        assert_eq!(bytes, expected);
        let decoded = IstioCertificateRequest::decode(bytes.as_slice()).unwrap();
        assert_eq!(decoded.impersonated_identity(), Some("spiffe://td/ns/a/sa/b"));
        assert_eq!(IstioCertificateRequest::default().impersonated_identity(), None);
    }

    #[test]
    fn response_bytes_are_pinned() {
        let response = IstioCertificateResponse { cert_chain: vec!["a".into(), "bc".into()] };
        assert_eq!(response.encode_to_vec(), [0x0a, 1, b'a', 0x0a, 2, b'b', b'c']);
        // Unknown fields (here 2, a varint) are skipped.
        let decoded = IstioCertificateResponse::decode(&[0x10, 0x05, 0x0a, 1, b'x'][..]).unwrap();
        assert_eq!(decoded.cert_chain, ["x"]);
    }
}

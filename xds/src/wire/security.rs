//! Package `istio.security` (Istio's `pkg/workloadapi/security/authorization.proto`): the Authorization resource.
//!
//! Naming follows Istio's proto (`groups=5 → Group{rules=1} → Rules{matches=2}`); ztunnel's copy calls the same
//! nesting `rules → Rule{clauses} → Clause{matches}` with the same field numbers, so the wire is identical.

use super::workload::Extension;

/// An authorization policy, named `namespace/name`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Authorization {
    /// Name.
    #[prost(string, tag = "1")]
    pub name: String,
    /// Namespace.
    #[prost(string, tag = "2")]
    pub namespace: String,
    /// Scope ([`Scope`]).
    #[prost(enumeration = "Scope", tag = "3")]
    pub scope: i32,
    /// Action ([`Action`]).
    #[prost(enumeration = "Action", tag = "4")]
    pub action: i32,
    /// OR of groups.
    #[prost(message, repeated, tag = "5")]
    pub groups: Vec<Group>,
    /// Evaluate and log only.
    #[prost(bool, tag = "6")]
    pub dry_run: bool,
    /// Extensions.
    #[prost(message, repeated, tag = "7")]
    pub extensions: Vec<Extension>,
}

/// A group: AND of its rules (ztunnel: `Rule`).
#[derive(Clone, PartialEq, prost::Message)]
pub struct Group {
    /// Rules.
    #[prost(message, repeated, tag = "1")]
    pub rules: Vec<Rules>,
}

/// Rules: OR of matches (ztunnel: `Clause`).
#[derive(Clone, PartialEq, prost::Message)]
pub struct Rules {
    /// Matches (field 1 is unused upstream).
    #[prost(message, repeated, tag = "2")]
    pub matches: Vec<Match>,
}

/// One match: AND of its non-empty fields.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Match {
    /// Source namespaces.
    #[prost(message, repeated, tag = "1")]
    pub namespaces: Vec<StringMatch>,
    /// Not these source namespaces.
    #[prost(message, repeated, tag = "2")]
    pub not_namespaces: Vec<StringMatch>,
    /// Source service accounts.
    #[prost(message, repeated, tag = "11")]
    pub service_accounts: Vec<ServiceAccountMatch>,
    /// Not these source service accounts.
    #[prost(message, repeated, tag = "12")]
    pub not_service_accounts: Vec<ServiceAccountMatch>,
    /// Source principals.
    #[prost(message, repeated, tag = "3")]
    pub principals: Vec<StringMatch>,
    /// Not these source principals.
    #[prost(message, repeated, tag = "4")]
    pub not_principals: Vec<StringMatch>,
    /// Source IP ranges.
    #[prost(message, repeated, tag = "5")]
    pub source_ips: Vec<Address>,
    /// Not these source IP ranges.
    #[prost(message, repeated, tag = "6")]
    pub not_source_ips: Vec<Address>,
    /// Destination IP ranges.
    #[prost(message, repeated, tag = "7")]
    pub destination_ips: Vec<Address>,
    /// Not these destination IP ranges.
    #[prost(message, repeated, tag = "8")]
    pub not_destination_ips: Vec<Address>,
    /// Destination ports (packed).
    #[prost(uint32, repeated, tag = "9")]
    pub destination_ports: Vec<u32>,
    /// Not these destination ports (packed).
    #[prost(uint32, repeated, tag = "10")]
    pub not_destination_ports: Vec<u32>,
    /// Extensions.
    #[prost(message, repeated, tag = "13")]
    pub extensions: Vec<Extension>,
}

/// `istio.security.Address`: an IP range.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Address {
    /// Raw 4 or 16 bytes.
    #[prost(bytes = "vec", tag = "1")]
    pub address: Vec<u8>,
    /// Prefix length.
    #[prost(uint32, tag = "2")]
    pub length: u32,
}

/// `istio.security.ServiceAccountMatch`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ServiceAccountMatch {
    /// Namespace.
    #[prost(string, tag = "1")]
    pub namespace: String,
    /// Service account (`serviceAccount` upstream).
    #[prost(string, tag = "2")]
    pub service_account: String,
}

/// `google.protobuf.Empty`.
#[derive(Clone, Copy, PartialEq, prost::Message)]
pub struct Empty {}

/// `istio.security.StringMatch`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct StringMatch {
    /// The kind of match; `None` is rejected by validation.
    #[prost(oneof = "string_match::MatchType", tags = "1, 2, 3, 4")]
    pub match_type: Option<string_match::MatchType>,
}

/// The oneof of [`StringMatch`].
pub mod string_match {
    /// How the string is matched.
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum MatchType {
        /// Equal.
        #[prost(string, tag = "1")]
        Exact(String),
        /// Starts with.
        #[prost(string, tag = "2")]
        Prefix(String),
        /// Ends with.
        #[prost(string, tag = "3")]
        Suffix(String),
        /// Any non-empty value.
        #[prost(message, tag = "4")]
        Presence(super::Empty),
    }
}

/// `istio.security.Scope`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum Scope {
    /// Every workload.
    Global = 0,
    /// The policy's namespace.
    Namespace = 1,
    /// Workloads listing it in `authorization_policies`.
    WorkloadSelector = 2,
}

/// `istio.security.Action`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum Action {
    /// Allow.
    Allow = 0,
    /// Deny.
    Deny = 1,
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    #[test]
    fn authorization_bytes() {
        let exact = |s: &str| StringMatch { match_type: Some(string_match::MatchType::Exact(s.into())) };
        let m = Match {
            namespaces: vec![exact("a")],
            not_namespaces: vec![StringMatch { match_type: Some(string_match::MatchType::Prefix("b".into())) }],
            principals: vec![StringMatch { match_type: Some(string_match::MatchType::Suffix("c".into())) }],
            not_principals: vec![StringMatch { match_type: Some(string_match::MatchType::Presence(Empty {})) }],
            source_ips: vec![Address { address: vec![10, 0, 0, 0], length: 8 }],
            not_source_ips: vec![Address::default()],
            destination_ips: vec![Address::default()],
            not_destination_ips: vec![Address::default()],
            destination_ports: vec![80, 443],
            not_destination_ports: vec![1],
            service_accounts: vec![ServiceAccountMatch { namespace: "n".into(), service_account: "s".into() }],
            not_service_accounts: vec![ServiceAccountMatch::default()],
            extensions: vec![Extension::default()],
        };
        let m_bytes = [
            0x0a, 0x03, 0x0a, 0x01, b'a', // namespaces=1 exact
            0x12, 0x03, 0x12, 0x01, b'b', // not_namespaces=2 prefix
            0x1a, 0x03, 0x1a, 0x01, b'c', // principals=3 suffix
            0x22, 0x02, 0x22, 0x00, // not_principals=4 presence
            0x2a, 0x08, 0x0a, 0x04, 10, 0, 0, 0, 0x10, 0x08, // source_ips=5
            0x32, 0x00, 0x3a, 0x00, 0x42, 0x00, // 6, 7, 8
            0x4a, 0x03, 0x50, 0xbb, 0x03, // destination_ports=9 packed
            0x52, 0x01, 0x01, // not_destination_ports=10 packed
            0x5a, 0x06, 0x0a, 0x01, b'n', 0x12, 0x01, b's', // service_accounts=11
            0x62, 0x00, // not_service_accounts=12
            0x6a, 0x00, // extensions=13
        ];
        assert_eq!(m.encode_to_vec(), m_bytes);
        assert_eq!(Match::decode(&m_bytes[..]).unwrap(), m);

        let a = Authorization {
            name: "p".into(),
            namespace: "n".into(),
            scope: Scope::WorkloadSelector as i32,
            action: Action::Deny as i32,
            groups: vec![Group {
                rules: vec![Rules { matches: vec![Match { destination_ports: vec![1], ..Default::default() }] }],
            }],
            dry_run: true,
            extensions: vec![],
        };
        let bytes = [
            0x0a, 0x01, b'p', 0x12, 0x01, b'n', // name=1 namespace=2
            0x18, 0x02, 0x20, 0x01, // scope=3 action=4
            0x2a, 0x07, 0x0a, 0x05, 0x12, 0x03, 0x4a, 0x01,
            0x01, // groups=5 → rules=1 → matches=2 → ports=9
            0x30, 0x01, // dry_run=6
        ];
        assert_eq!(a.encode_to_vec(), bytes);
        assert_eq!(Authorization::decode(&bytes[..]).unwrap(), a);
        // Unpacked repeated ports (allowed by proto3 decoders) decode the same.
        let unpacked = [0x4a, 0x01, 0x01];
        let packed_form = Match::decode(&unpacked[..]).unwrap();
        let unpacked_form = Match::decode(&[0x48u8, 0x01][..]).unwrap();
        assert_eq!(packed_form, unpacked_form);
    }
}

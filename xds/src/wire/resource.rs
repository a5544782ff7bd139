//! Turning one `Resource` of a delta response into a validated typed value, or a reason to reject it.
//!
//! Guarantees: [`decode_resource`] never panics and allocates at most what the bounded input holds: the
//! serialized resource is checked against the caller's size limit *before* prost decodes it. A resource is
//! accepted only if its `Any` type matches the response's type, it decodes, every enumeration value is one the
//! proto defines, every IP is 4 or 16 bytes with a prefix length that fits, every port fits in 16 bits, and its
//! name is the key istiod derives from its content (workload `uid`, service `namespace/hostname`, policy
//! `namespace/name`), so later removals by name find it.

use prost::Message;

use super::envoy::Resource;
use super::security::{self, Authorization};
use super::workload::{self, Address};

/// Type URL of Istio's Address resource.
pub const ADDRESS_TYPE_URL: &str = "type.googleapis.com/istio.workload.Address";
/// Type URL of Istio's Authorization resource.
pub const AUTHORIZATION_TYPE_URL: &str = "type.googleapis.com/istio.security.Authorization";

/// The resource types this client understands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ResourceType {
    /// `istio.workload.Address` (workloads and services).
    Address,
    /// `istio.security.Authorization`.
    Authorization,
}

impl ResourceType {
    /// Every type, in the order the client subscribes.
    pub const ALL: [ResourceType; 2] = [ResourceType::Address, ResourceType::Authorization];

    /// The type URL on the wire.
    pub fn type_url(self) -> &'static str {
        match self {
            ResourceType::Address => ADDRESS_TYPE_URL,
            ResourceType::Authorization => AUTHORIZATION_TYPE_URL,
        }
    }

    /// The type a URL names, if known.
    pub fn from_type_url(url: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.type_url() == url)
    }
}

/// A resource that passed validation.
// Moved once per resource into the consumer; boxing would cost an allocation per workload for nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq)]
pub enum DecodedResource {
    /// A workload or a service.
    Address(Address),
    /// A policy.
    Authorization(Authorization),
}

/// Why one resource was rejected; the text goes into the NACK as `name: reason`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResourceError {
    /// The resource has no name.
    #[error("resource has no name")]
    NoName,
    /// The resource has no `Any` body.
    #[error("resource has no body")]
    NoBody,
    /// The `Any`'s type is not the response's type.
    #[error("type {found:?} in a {expected} response")]
    WrongType {
        /// The response's type URL.
        expected: &'static str,
        /// The `Any`'s type URL (truncated).
        found: String,
    },
    /// The serialized resource is over the limit; it was not decoded.
    #[error("resource is {size} bytes, over the {max} byte limit")]
    TooLarge {
        /// Its size.
        size: usize,
        /// The limit.
        max: usize,
    },
    /// prost could not decode it.
    #[error("decode: {0}")]
    Decode(String),
    /// It decoded but a field is invalid.
    #[error("{0}")]
    Invalid(String),
}

/// Decodes and validates `resource` as a `ty`, refusing a body over `max_bytes` before decoding.
pub fn decode_resource(
    ty: ResourceType,
    resource: &Resource,
    max_bytes: usize,
) -> Result<DecodedResource, ResourceError> {
    if resource.name.is_empty() {
        return Err(ResourceError::NoName);
    }
    let any = resource.resource.as_ref().ok_or(ResourceError::NoBody)?;
    if any.type_url != ty.type_url() {
        return Err(ResourceError::WrongType { expected: ty.type_url(), found: truncate(&any.type_url, 128) });
    }
    if any.value.len() > max_bytes {
        return Err(ResourceError::TooLarge { size: any.value.len(), max: max_bytes });
    }
    let bytes = any.value.as_slice();
    match ty {
        ResourceType::Address => {
            let address = Address::decode(bytes).map_err(|e| ResourceError::Decode(e.to_string()))?;
            validate_address(&resource.name, &address).map_err(ResourceError::Invalid)?;
            Ok(DecodedResource::Address(address))
        }
        ResourceType::Authorization => {
            let policy = Authorization::decode(bytes).map_err(|e| ResourceError::Decode(e.to_string()))?;
            validate_authorization(&resource.name, &policy).map_err(ResourceError::Invalid)?;
            Ok(DecodedResource::Authorization(policy))
        }
    }
}

/// The first `max` bytes of `s` (on a char boundary), so a hostile string cannot bloat a NACK or a log line.
pub(crate) fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

type Check = Result<(), String>;

fn known_enum<E: TryFrom<i32>>(value: i32, field: &str) -> Check {
    E::try_from(value).map(|_| ()).map_err(|_| format!("{field}: unknown enum value {value}"))
}

fn ip_bytes(bytes: &[u8], field: &str) -> Check {
    match bytes.len() {
        4 | 16 => Ok(()),
        n => Err(format!("{field}: IP address of {n} bytes")),
    }
}

fn prefix(bytes: &[u8], length: u32, field: &str) -> Check {
    ip_bytes(bytes, field)?;
    if length as usize > bytes.len() * 8 {
        return Err(format!("{field}: prefix length {length} too long"));
    }
    Ok(())
}

fn port(p: u32, field: &str) -> Check {
    if p > u32::from(u16::MAX) {
        return Err(format!("{field}: port {p} out of range"));
    }
    Ok(())
}

fn ports(list: &[workload::Port], field: &str) -> Check {
    for p in list {
        port(p.service_port, field)?;
        port(p.target_port, field)?;
        known_enum::<workload::AppProtocol>(p.app_protocol, field)?;
    }
    Ok(())
}

fn network_address(a: &workload::NetworkAddress, field: &str) -> Check {
    match a.length {
        Some(len) => prefix(&a.address, len, field),
        None => ip_bytes(&a.address, field),
    }
}

fn gateway(g: &workload::GatewayAddress, field: &str) -> Check {
    use workload::gateway_address::Destination;
    match &g.destination {
        Some(Destination::Address(a)) => network_address(a, field)?,
        Some(Destination::Hostname(_)) => {}
        None => return Err(format!("{field}: no destination")),
    }
    port(g.hbone_mtls_port, field)
}

fn validate_address(name: &str, address: &Address) -> Check {
    use workload::address::Type;
    match &address.r#type {
        None => Err("address is neither a workload nor a service".into()),
        Some(Type::Workload(w)) => {
            if w.uid != name {
                return Err(format!("workload uid {:?} is not the resource name", truncate(&w.uid, 128)));
            }
            for a in &w.addresses {
                ip_bytes(a, "workload.addresses")?;
            }
            known_enum::<workload::TunnelProtocol>(w.tunnel_protocol, "workload.tunnel_protocol")?;
            known_enum::<workload::WorkloadType>(w.workload_type, "workload.workload_type")?;
            known_enum::<workload::WorkloadStatus>(w.status, "workload.status")?;
            known_enum::<workload::NetworkMode>(w.network_mode, "workload.network_mode")?;
            if let Some(g) = &w.waypoint {
                gateway(g, "workload.waypoint")?;
            }
            if let Some(g) = &w.network_gateway {
                gateway(g, "workload.network_gateway")?;
            }
            if let Some(t) = &w.application_tunnel {
                known_enum::<workload::application_tunnel::Protocol>(t.protocol, "workload.application_tunnel")?;
                port(t.port, "workload.application_tunnel")?;
            }
            for list in w.services.values() {
                ports(&list.ports, "workload.services")?;
            }
            Ok(())
        }
        Some(Type::Service(s)) => {
            let key = format!("{}/{}", s.namespace, s.hostname);
            if key != name {
                return Err(format!("service key {:?} is not the resource name", truncate(&key, 128)));
            }
            for a in &s.addresses {
                network_address(a, "service.addresses")?;
            }
            ports(&s.ports, "service.ports")?;
            if let Some(g) = &s.waypoint {
                gateway(g, "service.waypoint")?;
            }
            for w in &s.weighted_waypoints {
                if let Some(g) = &w.destination {
                    gateway(g, "service.weighted_waypoints")?;
                }
            }
            if let Some(lb) = &s.load_balancing {
                for scope in &lb.routing_preference {
                    known_enum::<workload::load_balancing::Scope>(*scope, "service.load_balancing")?;
                }
                known_enum::<workload::load_balancing::Mode>(lb.mode, "service.load_balancing.mode")?;
                known_enum::<workload::load_balancing::HealthPolicy>(lb.health_policy, "service.load_balancing")?;
            }
            known_enum::<workload::IpFamilies>(s.ip_families, "service.ip_families")?;
            known_enum::<workload::service::Visibility>(s.visibility, "service.visibility")
        }
    }
}

fn string_matches(list: &[security::StringMatch], field: &str) -> Check {
    if list.iter().any(|m| m.match_type.is_none()) {
        return Err(format!("{field}: string match without a kind"));
    }
    Ok(())
}

fn ranges(list: &[security::Address], field: &str) -> Check {
    list.iter().try_for_each(|a| prefix(&a.address, a.length, field))
}

fn validate_authorization(name: &str, policy: &Authorization) -> Check {
    let key = format!("{}/{}", policy.namespace, policy.name);
    if key != name {
        return Err(format!("policy key {:?} is not the resource name", truncate(&key, 128)));
    }
    known_enum::<security::Scope>(policy.scope, "scope")?;
    known_enum::<security::Action>(policy.action, "action")?;
    for m in policy.groups.iter().flat_map(|g| &g.rules).flat_map(|r| &r.matches) {
        string_matches(&m.namespaces, "namespaces")?;
        string_matches(&m.not_namespaces, "not_namespaces")?;
        string_matches(&m.principals, "principals")?;
        string_matches(&m.not_principals, "not_principals")?;
        ranges(&m.source_ips, "source_ips")?;
        ranges(&m.not_source_ips, "not_source_ips")?;
        ranges(&m.destination_ips, "destination_ips")?;
        ranges(&m.not_destination_ips, "not_destination_ips")?;
        m.destination_ports.iter().try_for_each(|p| port(*p, "destination_ports"))?;
        m.not_destination_ports.iter().try_for_each(|p| port(*p, "not_destination_ports"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::envoy::Any;
    use crate::wire::workload::{address, Workload};

    fn wrap(ty: ResourceType, name: &str, value: Vec<u8>) -> Resource {
        Resource {
            name: name.into(),
            version: "1".into(),
            resource: Some(Any { type_url: ty.type_url().into(), value }),
            aliases: vec![],
        }
    }

    fn workload(uid: &str) -> Address {
        Address {
            r#type: Some(address::Type::Workload(Workload {
                uid: uid.into(),
                addresses: vec![vec![10, 0, 0, 1]],
                ..Default::default()
            })),
        }
    }

    #[test]
    fn accepts_a_valid_workload() {
        let r = wrap(ResourceType::Address, "u", workload("u").encode_to_vec());
        assert_eq!(decode_resource(ResourceType::Address, &r, 1024), Ok(DecodedResource::Address(workload("u"))));
    }

    #[test]
    fn hand_assembled_bytes_decode() {
        // Address{workload=1 {uid=20 "u", addresses=3 [10.0.0.1]}}
        let bytes = vec![0x0a, 0x0a, 0x1a, 0x04, 10, 0, 0, 1, 0xa2, 0x01, 0x01, b'u'];
        let r = wrap(ResourceType::Address, "u", bytes);
        assert_eq!(decode_resource(ResourceType::Address, &r, 1024), Ok(DecodedResource::Address(workload("u"))));
        // Authorization{name "p", namespace "n", scope=2}
        let r = wrap(ResourceType::Authorization, "n/p", vec![0x0a, 0x01, b'p', 0x12, 0x01, b'n', 0x18, 0x02]);
        assert!(matches!(
            decode_resource(ResourceType::Authorization, &r, 1024),
            Ok(DecodedResource::Authorization(_))
        ));
    }

    #[test]
    fn rejects_before_decoding_when_too_large() {
        // Garbage that would fail to decode: the size check comes first.
        let r = wrap(ResourceType::Address, "u", vec![0xff; 2000]);
        assert_eq!(
            decode_resource(ResourceType::Address, &r, 1024),
            Err(ResourceError::TooLarge { size: 2000, max: 1024 })
        );
    }

    #[test]
    fn rejections() {
        let ty = ResourceType::Address;
        let mut r = wrap(ty, "u", workload("u").encode_to_vec());
        r.name.clear();
        assert_eq!(decode_resource(ty, &r, 1024), Err(ResourceError::NoName));
        let mut r = wrap(ty, "u", vec![]);
        r.resource = None;
        assert_eq!(decode_resource(ty, &r, 1024), Err(ResourceError::NoBody));
        let r = wrap(ResourceType::Authorization, "u", workload("u").encode_to_vec());
        assert!(matches!(decode_resource(ty, &r, 1024), Err(ResourceError::WrongType { .. })));
        let r = wrap(ty, "u", vec![0x0a, 0x05, 0x01]);
        assert!(matches!(decode_resource(ty, &r, 1024), Err(ResourceError::Decode(_))));
        let r = wrap(ty, "u", vec![]);
        assert!(matches!(decode_resource(ty, &r, 1024), Err(ResourceError::Invalid(_))));
        let r = wrap(ty, "other", workload("u").encode_to_vec());
        assert!(matches!(decode_resource(ty, &r, 1024), Err(ResourceError::Invalid(_))));
        // tunnel_protocol = 7 is not a TunnelProtocol.
        let r = wrap(ty, "u", vec![0x0a, 0x06, 0x28, 0x07, 0xa2, 0x01, 0x01, b'u']);
        let err = decode_resource(ty, &r, 1024).unwrap_err();
        assert_eq!(err.to_string(), "workload.tunnel_protocol: unknown enum value 7");
        // A 5-byte address.
        let r = wrap(ty, "u", vec![0x0a, 0x0b, 0x1a, 0x05, 1, 2, 3, 4, 5, 0xa2, 0x01, 0x01, b'u']);
        assert_eq!(decode_resource(ty, &r, 1024).unwrap_err().to_string(), "workload.addresses: IP address of 5 bytes");
        // Authorization with an unknown action and a /33 range.
        let aty = ResourceType::Authorization;
        let r = wrap(aty, "n/p", vec![0x0a, 0x01, b'p', 0x12, 0x01, b'n', 0x20, 0x05]);
        assert_eq!(decode_resource(aty, &r, 1024).unwrap_err().to_string(), "action: unknown enum value 5");
        let bad_range = security::Authorization {
            name: "p".into(),
            namespace: "n".into(),
            groups: vec![security::Group {
                rules: vec![security::Rules {
                    matches: vec![security::Match {
                        source_ips: vec![security::Address { address: vec![1, 2, 3, 4], length: 33 }],
                        ..Default::default()
                    }],
                }],
            }],
            ..Default::default()
        };
        let r = wrap(aty, "n/p", bad_range.encode_to_vec());
        assert!(decode_resource(aty, &r, 1024).unwrap_err().to_string().contains("prefix length 33"));
    }

    #[test]
    fn truncate_respects_char_boundaries() {
        assert_eq!(truncate("ab", 5), "ab");
        assert_eq!(truncate("aé", 2), "a…");
    }
}

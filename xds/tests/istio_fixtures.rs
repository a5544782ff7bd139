//! Resources encoded by Istio's own generated Go types (`interop/istio-fixtures`, every field set) decode into the
//! hand-written messages as the same values, re-encode to as many bytes (byte for byte where no oneof sits beside
//! other fields), and pass validation under the names istiod gives them. Regenerate the fixtures with `interop/fixtures.sh`.

use std::collections::BTreeMap;

use prost::Message;
use xds::wire::resource::{ADDRESS_TYPE_URL, AUTHORIZATION_TYPE_URL};
use xds::wire::security::{
    self, string_match::MatchType, Authorization, Empty, Group, Rules, ServiceAccountMatch, StringMatch,
};
use xds::wire::workload::*;
use xds::wire::{decode_resource, Any, DecodedResource, Resource, ResourceType};

fn ext() -> Vec<Extension> {
    vec![Extension {
        name: "ext".into(),
        config: Some(Any { type_url: "type.googleapis.com/x.Y".into(), value: vec![1, 2] }),
    }]
}

fn host_gateway() -> GatewayAddress {
    GatewayAddress {
        destination: Some(gateway_address::Destination::Hostname(NamespacedHostname {
            namespace: "istio-system".into(),
            hostname: "waypoint.istio-system.svc.cluster.local".into(),
        })),
        hbone_mtls_port: 15008,
    }
}

fn address_gateway() -> GatewayAddress {
    GatewayAddress {
        destination: Some(gateway_address::Destination::Address(NetworkAddress {
            network: "net-2".into(),
            address: vec![172, 16, 0, 1],
            length: Some(32),
        })),
        hbone_mtls_port: 15009,
    }
}

fn workload() -> Address {
    let mut services = BTreeMap::new();
    services.insert(
        "default/svc-a.default.svc.cluster.local".to_owned(),
        PortList { ports: vec![Port { service_port: 80, target_port: 8080, app_protocol: AppProtocol::Http2 as i32 }] },
    );
    services.insert(
        "default/svc-b.default.svc.cluster.local".to_owned(),
        PortList { ports: vec![Port { service_port: 443, target_port: 8443, app_protocol: 0 }] },
    );
    let mut v6 = vec![0u8; 16];
    v6[0] = 0xfd;
    v6[15] = 5;
    Address {
        r#type: Some(address::Type::Workload(Workload {
            uid: "Kubernetes//Pod/default/pod-a".into(),
            name: "pod-a".into(),
            namespace: "default".into(),
            addresses: vec![vec![10, 244, 1, 5], v6],
            hostname: "pod-a.example".into(),
            network: "net-1".into(),
            tunnel_protocol: TunnelProtocol::Hbone as i32,
            trust_domain: "td.local".into(),
            service_account: "sa-a".into(),
            waypoint: Some(host_gateway()),
            network_gateway: Some(address_gateway()),
            node: "node-1".into(),
            canonical_name: "app-a".into(),
            canonical_revision: "v2".into(),
            workload_type: WorkloadType::Pod as i32,
            workload_name: "deploy-a".into(),
            native_tunnel: true,
            application_tunnel: Some(ApplicationTunnel {
                protocol: application_tunnel::Protocol::Proxy as i32,
                port: 15088,
            }),
            services,
            authorization_policies: vec!["default/allow-a".into()],
            status: WorkloadStatus::Unhealthy as i32,
            cluster_id: "c1".into(),
            locality: Some(Locality { region: "r".into(), zone: "z".into(), subzone: "s".into() }),
            network_mode: NetworkMode::HostNetwork as i32,
            extensions: ext(),
            capacity: Some(UInt32Value { value: 3 }),
        })),
    }
}

fn service() -> Address {
    use load_balancing::{HealthPolicy, Mode, Scope};
    Address {
        r#type: Some(address::Type::Service(Service {
            name: "svc-a".into(),
            namespace: "default".into(),
            hostname: "svc-a.default.svc.cluster.local".into(),
            addresses: vec![NetworkAddress { network: "net-1".into(), address: vec![10, 96, 0, 10], length: None }],
            ports: vec![
                Port { service_port: 80, target_port: 8080, app_protocol: AppProtocol::Http11 as i32 },
                Port { service_port: 9090, target_port: 0, app_protocol: AppProtocol::Grpc as i32 },
            ],
            subject_alt_names: vec!["spiffe://td.local/ns/default/sa/sa-a".into()],
            waypoint: Some(host_gateway()),
            load_balancing: Some(LoadBalancing {
                routing_preference: vec![Scope::Network as i32, Scope::Region as i32, Scope::Zone as i32],
                mode: Mode::Failover as i32,
                health_policy: HealthPolicy::AllowAll as i32,
            }),
            ip_families: IpFamilies::Dual as i32,
            extensions: ext(),
            canonical: true,
            ingress_use_waypoint: true,
            weighted_waypoints: vec![WeightedWaypoint { destination: Some(address_gateway()), weight: 7 }],
            visibility: service::Visibility::Namespace as i32,
        })),
    }
}

fn policy() -> Authorization {
    let m = |t: MatchType| StringMatch { match_type: Some(t) };
    let mut v6 = vec![0u8; 16];
    v6[0] = 0xfd;
    Authorization {
        name: "allow-a".into(),
        namespace: "default".into(),
        scope: security::Scope::WorkloadSelector as i32,
        action: security::Action::Deny as i32,
        groups: vec![Group {
            rules: vec![Rules {
                matches: vec![security::Match {
                    namespaces: vec![m(MatchType::Exact("ns-a".into()))],
                    not_namespaces: vec![m(MatchType::Prefix("kube-".into()))],
                    service_accounts: vec![ServiceAccountMatch {
                        namespace: "ns-a".into(),
                        service_account: "sa-a".into(),
                    }],
                    not_service_accounts: vec![ServiceAccountMatch {
                        namespace: "ns-b".into(),
                        service_account: "sa-b".into(),
                    }],
                    principals: vec![m(MatchType::Suffix("/sa/sa-a".into()))],
                    not_principals: vec![m(MatchType::Presence(Empty {}))],
                    source_ips: vec![security::Address { address: vec![10, 0, 0, 0], length: 8 }],
                    not_source_ips: vec![security::Address { address: vec![10, 1, 0, 0], length: 16 }],
                    destination_ips: vec![security::Address { address: v6, length: 64 }],
                    not_destination_ips: vec![security::Address { address: vec![192, 168, 0, 1], length: 32 }],
                    destination_ports: vec![80, 8080],
                    not_destination_ports: vec![22],
                    extensions: ext(),
                }],
            }],
        }],
        dry_run: true,
        extensions: ext(),
    }
}

/// Decodes to `expected`; re-encodes to as many bytes, holding the same value. (Not the same bytes: Go writes a
/// oneof after the message's other fields, prost writes fields in number order; both are valid proto3.)
fn check<M: Message + Default + PartialEq + std::fmt::Debug>(bytes: &[u8], expected: &M) {
    assert_eq!(&M::decode(bytes).expect("decodes"), expected);
    let ours = expected.encode_to_vec();
    assert_eq!(ours.len(), bytes.len());
    assert_eq!(&M::decode(&ours[..]).unwrap(), expected);
}

fn accepted(ty: ResourceType, name: &str, type_url: &str, bytes: &[u8]) -> DecodedResource {
    let r = Resource {
        name: name.into(),
        version: "v".into(),
        resource: Some(Any { type_url: type_url.into(), value: bytes.to_vec() }),
        aliases: vec![],
    };
    decode_resource(ty, &r, 1 << 20).expect("valid")
}

#[test]
fn workload_from_istio_go_types() {
    let bytes = include_bytes!("fixtures/address-workload.bin");
    check(bytes, &workload());
    let got = accepted(ResourceType::Address, "Kubernetes//Pod/default/pod-a", ADDRESS_TYPE_URL, bytes);
    assert_eq!(got, DecodedResource::Address(workload()));
}

#[test]
fn service_from_istio_go_types() {
    let bytes = include_bytes!("fixtures/address-service.bin");
    check(bytes, &service());
    let got = accepted(ResourceType::Address, "default/svc-a.default.svc.cluster.local", ADDRESS_TYPE_URL, bytes);
    assert_eq!(got, DecodedResource::Address(service()));
}

#[test]
fn authorization_from_istio_go_types() {
    let bytes = include_bytes!("fixtures/authorization.bin");
    check(bytes, &policy());
    assert_eq!(policy().encode_to_vec(), bytes, "byte for byte");
    let got = accepted(ResourceType::Authorization, "default/allow-a", AUTHORIZATION_TYPE_URL, bytes);
    assert_eq!(got, DecodedResource::Authorization(policy()));
}

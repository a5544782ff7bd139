//! Package `istio.workload` (Istio's `pkg/workloadapi/workload.proto`): the Address resource and what it holds.
//!
//! Every field of the proto is modelled. Enumerations are `i32` fields with a matching prost enumeration;
//! [`crate::wire::resource`] rejects a resource holding a value the enumeration does not know.

use std::collections::BTreeMap;

use super::envoy::Any;

/// `google.protobuf.UInt32Value`.
#[derive(Clone, Copy, PartialEq, prost::Message)]
pub struct UInt32Value {
    /// The value.
    #[prost(uint32, tag = "1")]
    pub value: u32,
}

/// The Address resource: a workload or a service.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Address {
    /// Which of the two it is; `None` is rejected by validation.
    #[prost(oneof = "address::Type", tags = "1, 2")]
    pub r#type: Option<address::Type>,
}

/// The oneof of [`Address`].
pub mod address {
    /// A workload or a service.
    // The proto's shape; a Workload is the common case, so boxing it would only add an allocation.
    #[allow(clippy::large_enum_variant)]
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Type {
        /// A workload, named by its uid.
        #[prost(message, tag = "1")]
        Workload(super::Workload),
        /// A service, named `namespace/hostname`.
        #[prost(message, tag = "2")]
        Service(super::Service),
    }
}

/// A service.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Service {
    /// Service name.
    #[prost(string, tag = "1")]
    pub name: String,
    /// Service namespace.
    #[prost(string, tag = "2")]
    pub namespace: String,
    /// Fully qualified hostname.
    #[prost(string, tag = "3")]
    pub hostname: String,
    /// Virtual IPs.
    #[prost(message, repeated, tag = "4")]
    pub addresses: Vec<NetworkAddress>,
    /// Ports.
    #[prost(message, repeated, tag = "5")]
    pub ports: Vec<Port>,
    /// Extra SANs a client should accept.
    #[prost(string, repeated, tag = "6")]
    pub subject_alt_names: Vec<String>,
    /// The service's waypoint.
    #[prost(message, optional, tag = "7")]
    pub waypoint: Option<GatewayAddress>,
    /// Load-balancing settings.
    #[prost(message, optional, tag = "8")]
    pub load_balancing: Option<LoadBalancing>,
    /// IP families ([`IpFamilies`]).
    #[prost(enumeration = "IpFamilies", tag = "9")]
    pub ip_families: i32,
    /// Extensions.
    #[prost(message, repeated, tag = "10")]
    pub extensions: Vec<Extension>,
    /// Canonical service for its hostname.
    #[prost(bool, tag = "11")]
    pub canonical: bool,
    /// Ingress traffic goes through the waypoint.
    #[prost(bool, tag = "12")]
    pub ingress_use_waypoint: bool,
    /// Weighted waypoints.
    #[prost(message, repeated, tag = "13")]
    pub weighted_waypoints: Vec<WeightedWaypoint>,
    /// Visibility ([`service::Visibility`]).
    #[prost(enumeration = "service::Visibility", tag = "14")]
    pub visibility: i32,
}

/// Enumerations nested in [`Service`].
pub mod service {
    /// Who may see the service.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
    #[repr(i32)]
    pub enum Visibility {
        /// Everyone.
        Public = 0,
        /// Its namespace only.
        Namespace = 1,
    }
}

/// `istio.workload.IPFamilies`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum IpFamilies {
    /// Inferred from the addresses.
    Automatic = 0,
    /// IPv4 only.
    Ipv4Only = 1,
    /// IPv6 only.
    Ipv6Only = 2,
    /// Both.
    Dual = 3,
}

/// `istio.workload.NetworkMode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum NetworkMode {
    /// Pod network.
    Standard = 0,
    /// Host network.
    HostNetwork = 1,
}

/// `istio.workload.LoadBalancing`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct LoadBalancing {
    /// Locality preference order ([`load_balancing::Scope`]).
    #[prost(enumeration = "load_balancing::Scope", repeated, tag = "1")]
    pub routing_preference: Vec<i32>,
    /// Mode ([`load_balancing::Mode`]).
    #[prost(enumeration = "load_balancing::Mode", tag = "2")]
    pub mode: i32,
    /// Health policy ([`load_balancing::HealthPolicy`]).
    #[prost(enumeration = "load_balancing::HealthPolicy", tag = "3")]
    pub health_policy: i32,
}

/// Enumerations nested in [`LoadBalancing`].
pub mod load_balancing {
    /// A locality level.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
    #[repr(i32)]
    pub enum Scope {
        /// Unset.
        UnspecifiedScope = 0,
        /// Region.
        Region = 1,
        /// Zone.
        Zone = 2,
        /// Subzone.
        Subzone = 3,
        /// Node.
        Node = 4,
        /// Cluster.
        Cluster = 5,
        /// Network.
        Network = 6,
    }

    /// How the preference applies.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
    #[repr(i32)]
    pub enum Mode {
        /// Unset.
        UnspecifiedMode = 0,
        /// Only matching endpoints.
        Strict = 1,
        /// Prefer matching, fail over.
        Failover = 2,
        /// Passthrough.
        Passthrough = 3,
    }

    /// Which endpoints qualify.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
    #[repr(i32)]
    pub enum HealthPolicy {
        /// Healthy ones only.
        OnlyHealthy = 0,
        /// All.
        AllowAll = 1,
    }
}

/// A workload (a pod, a WorkloadEntry…), named by `uid`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Workload {
    /// Unique id, e.g. `Kubernetes//Pod/default/pod`.
    #[prost(string, tag = "20")]
    pub uid: String,
    /// Name.
    #[prost(string, tag = "1")]
    pub name: String,
    /// Namespace.
    #[prost(string, tag = "2")]
    pub namespace: String,
    /// IPs, raw 4 or 16 bytes each.
    #[prost(bytes = "vec", repeated, tag = "3")]
    pub addresses: Vec<Vec<u8>>,
    /// Hostname (instead of addresses).
    #[prost(string, tag = "21")]
    pub hostname: String,
    /// Network.
    #[prost(string, tag = "4")]
    pub network: String,
    /// Tunnel protocol ([`TunnelProtocol`]).
    #[prost(enumeration = "TunnelProtocol", tag = "5")]
    pub tunnel_protocol: i32,
    /// Trust domain; empty means `cluster.local`.
    #[prost(string, tag = "6")]
    pub trust_domain: String,
    /// Service account; empty means `default`.
    #[prost(string, tag = "7")]
    pub service_account: String,
    /// Waypoint.
    #[prost(message, optional, tag = "8")]
    pub waypoint: Option<GatewayAddress>,
    /// Network gateway.
    #[prost(message, optional, tag = "19")]
    pub network_gateway: Option<GatewayAddress>,
    /// Node name.
    #[prost(string, tag = "9")]
    pub node: String,
    /// Canonical name.
    #[prost(string, tag = "10")]
    pub canonical_name: String,
    /// Canonical revision.
    #[prost(string, tag = "11")]
    pub canonical_revision: String,
    /// Workload type ([`WorkloadType`]).
    #[prost(enumeration = "WorkloadType", tag = "12")]
    pub workload_type: i32,
    /// Workload (controller) name.
    #[prost(string, tag = "13")]
    pub workload_name: String,
    /// The workload speaks HBONE itself.
    #[prost(bool, tag = "14")]
    pub native_tunnel: bool,
    /// Application tunnel.
    #[prost(message, optional, tag = "23")]
    pub application_tunnel: Option<ApplicationTunnel>,
    /// Services, keyed `namespace/hostname`.
    #[prost(btree_map = "string, message", tag = "22")]
    pub services: BTreeMap<String, PortList>,
    /// Names (`ns/name`) of WORKLOAD_SELECTOR policies applying to it.
    #[prost(string, repeated, tag = "16")]
    pub authorization_policies: Vec<String>,
    /// Health ([`WorkloadStatus`]).
    #[prost(enumeration = "WorkloadStatus", tag = "17")]
    pub status: i32,
    /// Cluster id; empty means `Kubernetes`.
    #[prost(string, tag = "18")]
    pub cluster_id: String,
    /// Locality.
    #[prost(message, optional, tag = "24")]
    pub locality: Option<Locality>,
    /// Network mode ([`NetworkMode`]).
    #[prost(enumeration = "NetworkMode", tag = "25")]
    pub network_mode: i32,
    /// Extensions.
    #[prost(message, repeated, tag = "26")]
    pub extensions: Vec<Extension>,
    /// Relative capacity.
    #[prost(message, optional, tag = "27")]
    pub capacity: Option<UInt32Value>,
}

/// `istio.workload.Locality`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Locality {
    /// Region.
    #[prost(string, tag = "1")]
    pub region: String,
    /// Zone.
    #[prost(string, tag = "2")]
    pub zone: String,
    /// Subzone.
    #[prost(string, tag = "3")]
    pub subzone: String,
}

/// `istio.workload.WorkloadStatus`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum WorkloadStatus {
    /// Healthy.
    Healthy = 0,
    /// Unhealthy.
    Unhealthy = 1,
}

/// `istio.workload.WorkloadType`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum WorkloadType {
    /// Deployment.
    Deployment = 0,
    /// CronJob.
    Cronjob = 1,
    /// Pod.
    Pod = 2,
    /// Job.
    Job = 3,
}

/// `istio.workload.PortList`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct PortList {
    /// Ports.
    #[prost(message, repeated, tag = "1")]
    pub ports: Vec<Port>,
}

/// `istio.workload.Port`.
#[derive(Clone, Copy, PartialEq, prost::Message)]
pub struct Port {
    /// Service port.
    #[prost(uint32, tag = "1")]
    pub service_port: u32,
    /// Target port.
    #[prost(uint32, tag = "2")]
    pub target_port: u32,
    /// Application protocol ([`AppProtocol`]).
    #[prost(enumeration = "AppProtocol", tag = "3")]
    pub app_protocol: i32,
}

/// `istio.workload.AppProtocol`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum AppProtocol {
    /// Unknown.
    Unknown = 0,
    /// HTTP/1.1.
    Http11 = 1,
    /// HTTP/2.
    Http2 = 2,
    /// gRPC.
    Grpc = 3,
    /// TCP.
    Tcp = 4,
    /// TLS.
    Tls = 5,
}

/// `istio.workload.TunnelProtocol`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum TunnelProtocol {
    /// Plain.
    None = 0,
    /// HBONE.
    Hbone = 1,
    /// Sidecar mTLS.
    LegacyIstioMtls = 2,
}

/// `istio.workload.ApplicationTunnel`.
#[derive(Clone, Copy, PartialEq, prost::Message)]
pub struct ApplicationTunnel {
    /// Protocol ([`application_tunnel::Protocol`]).
    #[prost(enumeration = "application_tunnel::Protocol", tag = "1")]
    pub protocol: i32,
    /// Port.
    #[prost(uint32, tag = "2")]
    pub port: u32,
}

/// Enumerations nested in [`ApplicationTunnel`].
pub mod application_tunnel {
    /// Application tunnel protocol.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
    #[repr(i32)]
    pub enum Protocol {
        /// None.
        None = 0,
        /// PROXY protocol.
        Proxy = 1,
    }
}

/// `istio.workload.GatewayAddress`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct GatewayAddress {
    /// Where the gateway is.
    #[prost(oneof = "gateway_address::Destination", tags = "1, 2")]
    pub destination: Option<gateway_address::Destination>,
    /// HBONE mTLS port.
    #[prost(uint32, tag = "3")]
    pub hbone_mtls_port: u32,
}

/// The oneof of [`GatewayAddress`].
pub mod gateway_address {
    /// A hostname or an address.
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Destination {
        /// A service hostname.
        #[prost(message, tag = "1")]
        Hostname(super::NamespacedHostname),
        /// An address.
        #[prost(message, tag = "2")]
        Address(super::NetworkAddress),
    }
}

/// `istio.workload.WeightedWaypoint`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct WeightedWaypoint {
    /// The waypoint.
    #[prost(message, optional, tag = "1")]
    pub destination: Option<GatewayAddress>,
    /// Its weight.
    #[prost(uint32, tag = "2")]
    pub weight: u32,
}

/// `istio.workload.NetworkAddress`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct NetworkAddress {
    /// Network.
    #[prost(string, tag = "1")]
    pub network: String,
    /// Raw 4 or 16 bytes.
    #[prost(bytes = "vec", tag = "2")]
    pub address: Vec<u8>,
    /// Prefix length (proto3 `optional`).
    #[prost(uint32, optional, tag = "3")]
    pub length: Option<u32>,
}

/// `istio.workload.NamespacedHostname`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct NamespacedHostname {
    /// Namespace.
    #[prost(string, tag = "1")]
    pub namespace: String,
    /// Hostname.
    #[prost(string, tag = "2")]
    pub hostname: String,
}

/// `istio.workload.Extension`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Extension {
    /// Name.
    #[prost(string, tag = "1")]
    pub name: String,
    /// Configuration.
    #[prost(message, optional, tag = "2")]
    pub config: Option<Any>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    fn roundtrip<M: Message + Default + PartialEq + std::fmt::Debug>(m: &M, bytes: &[u8]) {
        assert_eq!(m.encode_to_vec(), bytes, "encode {m:?}");
        assert_eq!(&M::decode(bytes).unwrap(), m, "decode");
    }

    #[test]
    fn workload_field_numbers() {
        let mut services = BTreeMap::new();
        services.insert(
            "n/h".into(),
            PortList { ports: vec![Port { service_port: 80, target_port: 8080, app_protocol: 1 }] },
        );
        let w = Workload {
            uid: "u".into(),
            name: "n".into(),
            namespace: "s".into(),
            addresses: vec![vec![10, 0, 0, 1]],
            hostname: "h".into(),
            network: "w".into(),
            tunnel_protocol: TunnelProtocol::Hbone as i32,
            trust_domain: "t".into(),
            service_account: "a".into(),
            node: "d".into(),
            canonical_name: "c".into(),
            canonical_revision: "r".into(),
            workload_type: WorkloadType::Pod as i32,
            workload_name: "k".into(),
            native_tunnel: true,
            services,
            authorization_policies: vec!["p".into()],
            status: WorkloadStatus::Unhealthy as i32,
            cluster_id: "x".into(),
            network_mode: NetworkMode::HostNetwork as i32,
            capacity: Some(UInt32Value { value: 2 }),
            ..Default::default()
        };
        let bytes = [
            0x0a, 0x01, b'n', // name=1
            0x12, 0x01, b's', // namespace=2
            0x1a, 0x04, 10, 0, 0, 1, // addresses=3
            0x22, 0x01, b'w', // network=4
            0x28, 0x01, // tunnel_protocol=5 HBONE
            0x32, 0x01, b't', // trust_domain=6
            0x3a, 0x01, b'a', // service_account=7
            0x4a, 0x01, b'd', // node=9
            0x52, 0x01, b'c', // canonical_name=10
            0x5a, 0x01, b'r', // canonical_revision=11
            0x60, 0x02, // workload_type=12 POD
            0x6a, 0x01, b'k', // workload_name=13
            0x70, 0x01, // native_tunnel=14
            0x82, 0x01, 0x01, b'p', // authorization_policies=16
            0x88, 0x01, 0x01, // status=17
            0x92, 0x01, 0x01, b'x', // cluster_id=18
            0xa2, 0x01, 0x01, b'u', // uid=20
            0xaa, 0x01, 0x01, b'h', // hostname=21
            0xb2, 0x01, 0x10, // services=22 entry, 16 bytes
            0x0a, 0x03, b'n', b'/', b'h', // key
            0x12, 0x09, 0x0a, 0x07, 0x08, 0x50, 0x10, 0x90, 0x3f, 0x18, 0x01, // PortList{Port{80, 8080, HTTP11}}
            0xc8, 0x01, 0x01, // network_mode=25
            0xda, 0x01, 0x02, 0x08, 0x02, // capacity=27
        ];
        roundtrip(&w, &bytes);
        let addr =
            Address { r#type: Some(address::Type::Workload(Workload { uid: "u".into(), ..Default::default() })) };
        roundtrip(&addr, &[0x0a, 0x04, 0xa2, 0x01, 0x01, b'u']);
    }

    #[test]
    fn workload_nested_messages() {
        let w = Workload {
            waypoint: Some(GatewayAddress {
                destination: Some(gateway_address::Destination::Hostname(NamespacedHostname {
                    namespace: "n".into(),
                    hostname: "h".into(),
                })),
                hbone_mtls_port: 15008,
            }),
            network_gateway: Some(GatewayAddress {
                destination: Some(gateway_address::Destination::Address(NetworkAddress {
                    network: String::new(),
                    address: vec![1, 2, 3, 4],
                    length: Some(0),
                })),
                hbone_mtls_port: 0,
            }),
            application_tunnel: Some(ApplicationTunnel { protocol: 1, port: 9 }),
            locality: Some(Locality { region: "r".into(), zone: "z".into(), subzone: "s".into() }),
            extensions: vec![Extension { name: "e".into(), config: None }],
            ..Default::default()
        };
        let bytes = [
            0x42, 0x0b, 0x0a, 0x06, 0x0a, 0x01, b'n', 0x12, 0x01, b'h', 0x18, 0xa0, 0x75, // waypoint=8 (15008)
            0x9a, 0x01, 0x0a, 0x12, 0x08, 0x12, 0x04, 1, 2, 3, 4, 0x18,
            0x00, // network_gateway=19 (length=0 sent)
            0xba, 0x01, 0x04, 0x08, 0x01, 0x10, 0x09, // application_tunnel=23
            0xc2, 0x01, 0x09, 0x0a, 0x01, b'r', 0x12, 0x01, b'z', 0x1a, 0x01, b's', // locality=24
            0xd2, 0x01, 0x03, 0x0a, 0x01, b'e', // extensions=26
        ];
        roundtrip(&w, &bytes);
    }

    #[test]
    fn service_field_numbers() {
        let s = Service {
            name: "n".into(),
            namespace: "s".into(),
            hostname: "h".into(),
            addresses: vec![NetworkAddress { network: "w".into(), address: vec![10, 0, 0, 2], length: None }],
            ports: vec![Port { service_port: 80, target_port: 0, app_protocol: 0 }],
            subject_alt_names: vec!["a".into()],
            waypoint: Some(GatewayAddress::default()),
            load_balancing: Some(LoadBalancing { routing_preference: vec![2, 4], mode: 1, health_policy: 1 }),
            ip_families: IpFamilies::Dual as i32,
            extensions: vec![],
            canonical: true,
            ingress_use_waypoint: true,
            weighted_waypoints: vec![WeightedWaypoint { destination: None, weight: 3 }],
            visibility: service::Visibility::Namespace as i32,
        };
        let bytes = [
            0x0a, 0x01, b'n', 0x12, 0x01, b's', 0x1a, 0x01, b'h', // 1..3
            0x22, 0x09, 0x0a, 0x01, b'w', 0x12, 0x04, 10, 0, 0, 2, // addresses=4
            0x2a, 0x02, 0x08, 0x50, // ports=5
            0x32, 0x01, b'a', // subject_alt_names=6
            0x3a, 0x00, // waypoint=7
            0x42, 0x08, 0x0a, 0x02, 0x02, 0x04, 0x10, 0x01, 0x18, 0x01, // load_balancing=8 (packed scopes)
            0x48, 0x03, // ip_families=9
            0x58, 0x01, 0x60, 0x01, // canonical=11, ingress_use_waypoint=12
            0x6a, 0x02, 0x10, 0x03, // weighted_waypoints=13
            0x70, 0x01, // visibility=14
        ];
        roundtrip(&s, &bytes);
        let addr = Address { r#type: Some(address::Type::Service(Service { name: "n".into(), ..Default::default() })) };
        roundtrip(&addr, &[0x12, 0x03, 0x0a, 0x01, b'n']);
    }
}

//! The directory source for istiod (issue #32): the workloads istiod sends over Delta ADS (crate `xds`), applied to
//! the [`Directory`] as they arrive, and its authorization policies, applied to the proxy's [`Policies`]. The proxy
//! runs it with `CONTROL_PLANE=istiod`.
//!
//! Guarantees:
//! - A workload becomes one directory entry under [`SOURCE`], keyed by its uid (the resource's name, which `xds`
//!   has already checked equals the uid). istiod's empty fields read as Istio reads them: an empty trust domain is
//!   the proxy's own (the directory fills it in), an empty service account `default`.
//! - HBONE is taken from `tunnel_protocol` (istiod sets it for pods the node agent annotated) or from
//!   `native_tunnel`; anything else is plain TCP.
//! - A removal drops the entry of that name; a name that is not a workload here (a service key, a policy) changes
//!   nothing.
//! - Policies are held in [`Policies`] under their resource name (`namespace/name`), and each workload's
//!   `authorization_policies` is recorded there; a removal of either drops it. Services are accepted and counted,
//!   not applied. A policy is never NACKed: what cannot be evaluated is held as unenforceable (see
//!   [`crate::authorization`]), which never allows what it might deny.
//! - A workload the directory refuses (an address another source owns, say) is NACKed by name with the
//!   directory's reason; the others in the same response still apply.

use std::net::IpAddr;

use xds::ads::{Handler, Upsert};
use xds::wire::resource::DecodedResource;
use xds::wire::workload::{address, TunnelProtocol};
use xds::wire::ResourceType;

use super::{Directory, Protocol, Workload};
use crate::authorization::Policies;

/// The name this source's entries are kept under in the [`Directory`].
pub const SOURCE: &str = "istiod";

/// What istiod has sent that this source does not apply (yet), for the config dump.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Unapplied {
    /// Services held by istiod's view.
    pub services: usize,
}

/// The [`Handler`] that applies istiod's workloads to a [`Directory`].
#[derive(Debug)]
pub struct XdsSource {
    directory: Directory,
    policies: Policies,
    services: std::collections::HashSet<String>,
}

impl XdsSource {
    /// A source that applies workloads to `directory` and policies to `policies`.
    pub fn new(directory: Directory, policies: Policies) -> Self {
        Self { directory, policies, services: Default::default() }
    }

    /// The services held but not applied.
    pub fn unapplied(&self) -> Unapplied {
        Unapplied { services: self.services.len() }
    }
}

/// istiod's workload as a directory entry.
pub fn workload(w: &xds::wire::workload::Workload) -> Workload {
    let hbone = w.tunnel_protocol == TunnelProtocol::Hbone as i32 || w.native_tunnel;
    let ips = w
        .addresses
        .iter()
        .filter_map(|a| match a.len() {
            4 => <[u8; 4]>::try_from(a.as_slice()).ok().map(IpAddr::from),
            16 => <[u8; 16]>::try_from(a.as_slice()).ok().map(IpAddr::from),
            _ => None,
        })
        .collect();
    Workload {
        uid: w.uid.clone(),
        name: w.name.clone(),
        namespace: w.namespace.clone(),
        service_account: if w.service_account.is_empty() { "default".into() } else { w.service_account.clone() },
        trust_domain: w.trust_domain.clone(),
        workload_ips: ips,
        protocol: if hbone { Protocol::Hbone } else { Protocol::Tcp },
        node: w.node.clone(),
        workload_name: w.workload_name.clone(),
        canonical_name: w.canonical_name.clone(),
        canonical_revision: w.canonical_revision.clone(),
        cluster_id: w.cluster_id.clone(),
        require_mtls: false,
    }
}

impl Handler for XdsSource {
    fn apply(&mut self, ty: ResourceType, upserts: Vec<Upsert>, removals: Vec<String>) -> Vec<(String, String)> {
        for name in removals {
            match ty {
                ResourceType::Authorization => {
                    self.policies.remove(&name);
                }
                ResourceType::Address => {
                    self.policies.unselect(&name);
                    if !self.directory.remove(SOURCE, &name) {
                        self.services.remove(&name);
                    }
                }
            }
        }
        let mut refused = Vec::new();
        for upsert in upserts {
            match upsert.resource {
                DecodedResource::Address(a) => match a.r#type {
                    Some(address::Type::Workload(w)) => {
                        self.policies.select(&w.uid, &w.authorization_policies);
                        if let Err(e) = self.directory.upsert(SOURCE, workload(&w)) {
                            refused.push((upsert.name, e.to_string()));
                        }
                    }
                    Some(address::Type::Service(_)) => {
                        self.services.insert(upsert.name);
                    }
                    None => {}
                },
                DecodedResource::Authorization(policy) => self.policies.upsert(&upsert.name, &policy),
            }
        }
        refused
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use xds::wire::workload::{Address, Service, Workload as XdsWorkload};

    fn pod(uid: &str, ip: [u8; 4], tunnel: TunnelProtocol) -> Upsert {
        let w = XdsWorkload {
            uid: uid.into(),
            name: "web".into(),
            namespace: "shop".into(),
            addresses: vec![ip.to_vec()],
            tunnel_protocol: tunnel as i32,
            node: "node-1".into(),
            ..Default::default()
        };
        Upsert {
            name: uid.into(),
            version: "1".into(),
            resource: DecodedResource::Address(Address { r#type: Some(address::Type::Workload(w)) }),
        }
    }

    #[test]
    fn istiods_workloads_become_directory_entries_and_leave_with_their_removal() {
        let directory = Directory::new("cluster.local");
        let mut source = XdsSource::new(directory.clone(), Policies::default());
        let service = Upsert {
            name: "shop/web.shop.svc.cluster.local".into(),
            version: "1".into(),
            resource: DecodedResource::Address(Address {
                r#type: Some(address::Type::Service(Service {
                    name: "web".into(),
                    namespace: "shop".into(),
                    hostname: "web.shop.svc.cluster.local".into(),
                    ..Default::default()
                })),
            }),
        };
        let upserts = vec![
            pod("Kubernetes//Pod/shop/a", [10, 0, 0, 1], TunnelProtocol::Hbone),
            pod("Kubernetes//Pod/shop/b", [10, 0, 0, 2], TunnelProtocol::None),
            service,
        ];
        assert_eq!(source.apply(ResourceType::Address, upserts, Vec::new()), Vec::new());
        let a = directory.lookup("10.0.0.1".parse().unwrap()).expect("a is in the directory");
        assert_eq!(a.workload.protocol, Protocol::Hbone);
        assert_eq!(a.workload.service_account, "default", "istiod's empty service account");
        assert_eq!(a.workload.trust_domain, "cluster.local", "istiod's empty trust domain is the proxy's");
        let b = directory.lookup("10.0.0.2".parse().unwrap()).expect("b is in the directory");
        assert_eq!(b.workload.protocol, Protocol::Tcp, "not annotated: plain TCP");
        assert_eq!(source.unapplied(), Unapplied { services: 1 });

        let removals = vec!["Kubernetes//Pod/shop/a".to_string(), "shop/web.shop.svc.cluster.local".to_string()];
        assert_eq!(source.apply(ResourceType::Address, Vec::new(), removals), Vec::new());
        assert!(directory.lookup("10.0.0.1".parse().unwrap()).is_none(), "a was removed");
        assert!(directory.lookup("10.0.0.2".parse().unwrap()).is_some(), "b stays");
        assert_eq!(source.unapplied(), Unapplied::default());
    }

    #[test]
    fn istiods_policies_and_each_workloads_selection_reach_the_policies_and_leave_with_their_removal() {
        use crate::authorization::{Connection, Denied, Governed};
        use xds::wire::security::{self as sec, Authorization};

        let (directory, policies) = (Directory::new("cluster.local"), Policies::default());
        let mut source = XdsSource::new(directory, policies.clone());
        let deny = Authorization {
            name: "gate".into(),
            namespace: "shop".into(),
            scope: sec::Scope::WorkloadSelector as i32,
            action: sec::Action::Deny as i32,
            groups: vec![sec::Group { rules: vec![sec::Rules { matches: vec![sec::Match::default()] }] }],
            ..Default::default()
        };
        let policy =
            Upsert { name: "shop/gate".into(), version: "1".into(), resource: DecodedResource::Authorization(deny) };
        assert_eq!(source.apply(ResourceType::Authorization, vec![policy], Vec::new()), Vec::new());
        let mut selected = pod("Kubernetes//Pod/shop/a", [10, 0, 0, 1], TunnelProtocol::Hbone);
        if let DecodedResource::Address(Address { r#type: Some(address::Type::Workload(w)) }) = &mut selected.resource {
            w.authorization_policies = vec!["shop/gate".into()];
        }
        assert_eq!(source.apply(ResourceType::Address, vec![selected], Vec::new()), Vec::new());

        let client = hbone::Identity::new("cluster.local", "other", "x").unwrap();
        let conn = Connection {
            source: Some(&client),
            source_ip: "10.0.0.9".parse().unwrap(),
            destination: "10.0.0.1:80".parse().unwrap(),
        };
        let a = Governed { uid: "Kubernetes//Pod/shop/a", namespace: "shop" };
        assert_eq!(policies.check(a, &conn), Err(Denied::Policy("shop/gate".into())), "a selects the DENY");
        let b = Governed { uid: "Kubernetes//Pod/shop/b", namespace: "shop" };
        assert_eq!(policies.check(b, &conn), Ok(()), "b does not");

        // The policy's removal (an Authorization removal) lifts it.
        assert_eq!(source.apply(ResourceType::Authorization, Vec::new(), vec!["shop/gate".into()]), Vec::new());
        assert_eq!(policies.check(a, &conn), Ok(()));
        assert!(policies.is_empty());
    }
}

//! The workload directory: which destination IPs belong to mesh workloads, what protocol they speak and
//! which identity they must prove.
//!
//! Each source (the local YAML file, [`local_file`], and the Kubernetes API, [`kube_source`]) replaces its own
//! complete set of workloads with [`Directory::replace`]; lookups see the union of all sources.

#[cfg(feature = "runtime")]
pub mod kube_source;
#[cfg(feature = "runtime")]
pub mod local_file;
mod workload;

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, RwLock};

use hbone::Identity;

pub use workload::{parse_local_config, Protocol, Workload};

/// A destination found in the directory.
#[derive(Debug, Clone)]
pub struct Destination {
    /// The workload owning the address.
    pub workload: Arc<Workload>,
    /// The identity it must prove (`spiffe://<td>/ns/<ns>/sa/<sa>`).
    pub identity: Identity,
}

/// Why a workload entry was not usable.
#[derive(Debug, thiserror::Error)]
pub enum DirectoryError {
    /// The workload's namespace, service account or trust domain do not form a SPIFFE identity.
    #[error("workload {uid:?}: {source}")]
    Identity {
        /// The workload's uid.
        uid: String,
        /// What was wrong.
        source: hbone::IdentityError,
    },
}

type Entries = HashMap<IpAddr, Destination>;

/// The union of every source's workloads, keyed by IP. Cheap to clone; clones share the contents.
#[derive(Debug, Clone)]
pub struct Directory {
    trust_domain: String,
    sources: Arc<RwLock<HashMap<&'static str, Entries>>>,
}

impl Directory {
    /// An empty directory; workloads without a trust domain get `trust_domain`.
    pub fn new(trust_domain: impl Into<String>) -> Self {
        Directory { trust_domain: trust_domain.into(), sources: Arc::default() }
    }

    /// Replaces everything `source` contributed with `workloads`. Invalid entries are skipped and returned,
    /// so one bad entry does not hide the rest.
    pub fn replace(&self, source: &'static str, workloads: Vec<Workload>) -> Vec<DirectoryError> {
        let mut entries = Entries::new();
        let mut errors = Vec::new();
        for workload in workloads {
            let trust_domain =
                if workload.trust_domain.is_empty() { self.trust_domain.as_str() } else { &workload.trust_domain };
            let identity = match Identity::new(trust_domain, &workload.namespace, &workload.service_account) {
                Ok(identity) => identity,
                Err(source) => {
                    errors.push(DirectoryError::Identity { uid: workload.uid.clone(), source });
                    continue;
                }
            };
            let workload = Arc::new(workload);
            for ip in &workload.workload_ips {
                entries
                    .insert(ip.to_canonical(), Destination { workload: workload.clone(), identity: identity.clone() });
            }
        }
        tracing::info!(source, addresses = entries.len(), "workload directory updated");
        self.sources.write().unwrap_or_else(|p| p.into_inner()).insert(source, entries);
        errors
    }

    /// The workload owning `ip`, if any source knows it.
    pub fn lookup(&self, ip: IpAddr) -> Option<Destination> {
        let ip = ip.to_canonical();
        self.sources.read().unwrap_or_else(|p| p.into_inner()).values().find_map(|entries| entries.get(&ip).cloned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn workload(ips: &[&str], protocol: Protocol) -> Workload {
        Workload {
            uid: "u1".into(),
            name: "web".into(),
            namespace: "shop".into(),
            service_account: "web-sa".into(),
            trust_domain: String::new(),
            workload_ips: ips.iter().map(|ip| ip.parse().unwrap()).collect(),
            protocol,
            node: "node-1".into(),
            workload_name: "web".into(),
            canonical_name: "web".into(),
            canonical_revision: "latest".into(),
            cluster_id: String::new(),
            require_mtls: false,
        }
    }

    #[test]
    fn lookup_finds_each_address_with_the_identity_in_the_default_trust_domain() {
        let dir = Directory::new("cluster.local");
        assert!(dir.replace("file", vec![workload(&["10.0.0.5", "fd00::5"], Protocol::Hbone)]).is_empty());
        let found = dir.lookup("10.0.0.5".parse().unwrap()).expect("v4 address");
        assert_eq!(found.identity.to_string(), "spiffe://cluster.local/ns/shop/sa/web-sa");
        assert_eq!(found.workload.protocol, Protocol::Hbone);
        assert!(dir.lookup("::ffff:10.0.0.5".parse().unwrap()).is_some(), "v4-mapped form is the same address");
        assert!(dir.lookup("fd00::5".parse().unwrap()).is_some());
        assert!(dir.lookup("10.0.0.6".parse().unwrap()).is_none());
    }

    #[test]
    fn replacing_a_source_drops_its_old_entries_only() {
        let dir = Directory::new("cluster.local");
        dir.replace("file", vec![workload(&["10.0.0.5"], Protocol::Hbone)]);
        dir.replace("other", vec![workload(&["10.0.0.7"], Protocol::Tcp)]);
        dir.replace("file", vec![]);
        assert!(dir.lookup("10.0.0.5".parse().unwrap()).is_none());
        assert!(dir.lookup("10.0.0.7".parse().unwrap()).is_some());
    }

    #[test]
    fn an_invalid_identity_is_reported_and_skipped() {
        let dir = Directory::new("cluster.local");
        let mut bad = workload(&["10.0.0.8"], Protocol::Hbone);
        bad.namespace = "a/b".into();
        let errors = dir.replace("file", vec![bad, workload(&["10.0.0.5"], Protocol::Hbone)]);
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(dir.lookup("10.0.0.8".parse().unwrap()).is_none());
        assert!(dir.lookup("10.0.0.5".parse().unwrap()).is_some());
    }
}

//! The workload directory: which destination IPs belong to mesh workloads, what protocol they speak and
//! which identity they must prove.
//!
//! Each source (the local YAML file, [`local_file`], and the Kubernetes API, [`kube_source`]) replaces its own
//! complete set of workloads with [`Directory::replace`]; lookups see the union of all sources, and
//! [`Directory::listing`] shows them all (the admin endpoint's `/config_dump`).

#[cfg(feature = "runtime")]
pub mod kube_source;
#[cfg(feature = "runtime")]
pub mod local_file;
mod workload;

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::{Arc, RwLock};

use hbone::Identity;
use serde::Serialize;

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

/// What one source contributed: its destinations by address, and each accepted workload once.
#[derive(Debug, Default)]
struct Entries {
    by_ip: HashMap<IpAddr, Destination>,
    workloads: Vec<Arc<Workload>>,
}

/// The union of every source's workloads, keyed by IP. Cheap to clone; clones share the contents.
#[derive(Debug, Clone)]
pub struct Directory {
    trust_domain: String,
    sources: Arc<RwLock<HashMap<&'static str, Entries>>>,
}

/// What the directory holds, as the admin endpoint's `/config_dump` shows it: so an operator (or a test) sees
/// which workloads the proxy knows and where each came from, without reading its log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Listing {
    /// The workloads, each once, ordered by source and uid: at most the limit asked for.
    pub workloads: Vec<ListedWorkload>,
    /// How many workloads and addresses each source holds, counting the ones left out of `workloads`.
    pub sources: BTreeMap<&'static str, SourceCount>,
    /// How many workloads were left out of `workloads` to keep the listing within its limit.
    pub omitted: usize,
}

/// One workload of a [`Listing`]: ztunnel's field names (its `/config_dump` lists workloads the same way), the
/// trust domain it proves (the proxy's own when its source left it out), and the source that listed it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ListedWorkload {
    /// The source that listed it (`local-file` or `kubernetes`).
    pub source: &'static str,
    /// The workload.
    #[serde(flatten)]
    pub workload: Workload,
}

/// The size of one source in a [`Listing`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct SourceCount {
    /// Workloads with a valid identity.
    pub workloads: usize,
    /// Distinct addresses they own.
    pub addresses: usize,
}

impl Directory {
    /// An empty directory; workloads without a trust domain get `trust_domain`.
    pub fn new(trust_domain: impl Into<String>) -> Self {
        Directory { trust_domain: trust_domain.into(), sources: Arc::default() }
    }

    /// Replaces everything `source` contributed with `workloads`. Invalid entries are skipped and returned,
    /// so one bad entry does not hide the rest.
    pub fn replace(&self, source: &'static str, workloads: Vec<Workload>) -> Vec<DirectoryError> {
        let mut entries = Entries::default();
        let mut errors = Vec::new();
        for mut workload in workloads {
            if workload.trust_domain.is_empty() {
                workload.trust_domain.clone_from(&self.trust_domain);
            }
            let identity = match Identity::new(&workload.trust_domain, &workload.namespace, &workload.service_account) {
                Ok(identity) => identity,
                Err(source) => {
                    errors.push(DirectoryError::Identity { uid: workload.uid.clone(), source });
                    continue;
                }
            };
            let workload = Arc::new(workload);
            for ip in &workload.workload_ips {
                entries
                    .by_ip
                    .insert(ip.to_canonical(), Destination { workload: workload.clone(), identity: identity.clone() });
            }
            entries.workloads.push(workload);
        }
        tracing::info!(source, addresses = entries.by_ip.len(), "workload directory updated");
        self.sources.write().unwrap_or_else(|p| p.into_inner()).insert(source, entries);
        errors
    }

    /// The workload owning `ip`, if any source knows it.
    pub fn lookup(&self, ip: IpAddr) -> Option<Destination> {
        let ip = ip.to_canonical();
        self.sources
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .find_map(|entries| entries.by_ip.get(&ip).cloned())
    }

    /// Every source's workloads, at most `limit` of them (the rest only counted), for `/config_dump`.
    pub fn listing(&self, limit: usize) -> Listing {
        let sources = self.sources.read().unwrap_or_else(|p| p.into_inner());
        let counts = sources
            .iter()
            .map(|(source, entries)| {
                (*source, SourceCount { workloads: entries.workloads.len(), addresses: entries.by_ip.len() })
            })
            .collect();
        let mut all: Vec<(&'static str, &Arc<Workload>)> =
            sources.iter().flat_map(|(source, entries)| entries.workloads.iter().map(move |w| (*source, w))).collect();
        all.sort_by(|(a_source, a), (b_source, b)| {
            (a_source, &a.uid, &a.workload_ips).cmp(&(b_source, &b.uid, &b.workload_ips))
        });
        let omitted = all.len().saturating_sub(limit);
        let workloads = all
            .into_iter()
            .take(limit)
            .map(|(source, workload)| ListedWorkload { source, workload: Workload::clone(workload) })
            .collect();
        Listing { workloads, sources: counts, omitted }
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
    fn the_listing_shows_each_workload_once_with_its_source_and_trust_domain() {
        let dir = Directory::new("cluster.local");
        let mut web = workload(&["10.0.0.5", "fd00::5"], Protocol::Hbone);
        web.uid = "web".into();
        let mut db = workload(&["10.0.0.7"], Protocol::Tcp);
        db.uid = "db".into();
        db.trust_domain = "example.org".into();
        let mut bad = workload(&["10.0.0.8"], Protocol::Hbone);
        bad.namespace = "a/b".into();
        dir.replace("local-file", vec![db, bad]);
        dir.replace("kubernetes", vec![web]);

        let listing = dir.listing(10);
        let listed: Vec<(&str, &str, &str, usize)> = listing
            .workloads
            .iter()
            .map(|w| {
                (w.source, w.workload.uid.as_str(), w.workload.trust_domain.as_str(), w.workload.workload_ips.len())
            })
            .collect();
        assert_eq!(
            listed,
            [("kubernetes", "web", "cluster.local", 2), ("local-file", "db", "example.org", 1)],
            "each valid workload once, by source and uid, with the trust domain it proves"
        );
        assert_eq!(listing.sources["kubernetes"], SourceCount { workloads: 1, addresses: 2 });
        assert_eq!(listing.sources["local-file"], SourceCount { workloads: 1, addresses: 1 });
        assert_eq!(listing.omitted, 0);
    }

    #[test]
    fn the_listing_is_bounded_and_counts_what_it_leaves_out() {
        let dir = Directory::new("cluster.local");
        let many: Vec<Workload> = (0..5)
            .map(|n| {
                let mut w = workload(&[&format!("10.0.1.{n}")], Protocol::Hbone);
                w.uid = format!("u{n}");
                w
            })
            .collect();
        dir.replace("kubernetes", many);
        let listing = dir.listing(3);
        let uids: Vec<&str> = listing.workloads.iter().map(|w| w.workload.uid.as_str()).collect();
        assert_eq!(uids, ["u0", "u1", "u2"]);
        assert_eq!(listing.omitted, 2);
        assert_eq!(listing.sources["kubernetes"], SourceCount { workloads: 5, addresses: 5 }, "the counts are whole");
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

//! The workload directory: which destination IPs belong to mesh workloads, what protocol they speak and
//! which identity they must prove.
//!
//! Each source (the local YAML file, [`local_file`], and the Kubernetes API, [`kube_source`]) keeps its own set of
//! workloads, by uid: whole with [`Directory::replace`], or one workload at a time with [`Directory::upsert`] and
//! [`Directory::remove`] (and [`Directory::retain`] to sweep what a relist no longer holds), each costing only
//! that workload's addresses, however many the source holds. Lookups see the union of all sources (the first
//! source by name that lists an address answers), and [`Directory::listing`] shows them all (the admin endpoint's
//! `/config_dump`).
//!
//! What it guarantees when two workloads of one source claim the same address (a pod deleted and its address
//! given to a new pod before the old pod's deletion arrives):
//! - the newest claim owns the address: the workload that began claiming it last (an update of a workload that
//!   keeps the address keeps its claim's age, so a terminating pod's status change never takes the address back);
//! - when the owner leaves (or drops the address), the address goes to the newest remaining claimant; when a
//!   claimant that does not own it leaves, the owner keeps it;
//! - each workload is held once (one [`Arc`]), however many addresses it has and whoever looks it up.

#[cfg(feature = "runtime")]
pub mod kube_source;
#[cfg(feature = "runtime")]
pub mod local_file;
mod workload;
#[cfg(feature = "runtime")]
pub mod xds_source;

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
    pub workload: Workload,
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

/// The workloads that claim one address, in the order their claims began: the last one owns it. Almost always
/// one, so the earlier claims are an empty (unallocated) list.
#[derive(Debug)]
struct Claims {
    owner: Arc<Destination>,
    /// Earlier claims still standing, oldest first.
    earlier: Vec<Arc<Destination>>,
}

/// What one source contributed: each accepted workload by key (its uid), and the claims on each address.
#[derive(Debug, Default)]
struct Entries {
    by_key: HashMap<String, Arc<Destination>>,
    by_ip: HashMap<IpAddr, Claims>,
}

impl Entries {
    /// Makes `destination` the entry under `key`, replacing an older version: addresses it keeps keep their
    /// claim's age, addresses it drops are handed back, new ones are claimed as the newest.
    fn upsert(&mut self, key: &str, destination: Destination) {
        let new = Arc::new(destination);
        let old = match self.by_key.get_mut(key) {
            Some(slot) => Some(std::mem::replace(slot, new.clone())),
            None => {
                self.by_key.insert(key.to_owned(), new.clone());
                None
            }
        };
        let mut new_ips = canonical_ips(&new.workload);
        if let Some(old) = &old {
            for ip in canonical_ips(&old.workload) {
                if new_ips.contains(&ip) {
                    if let Some(claims) = self.by_ip.get_mut(&ip) {
                        claims.update(old, &new);
                    }
                } else {
                    self.unclaim(ip, old);
                }
            }
            let old_ips = canonical_ips(&old.workload);
            new_ips.retain(|ip| !old_ips.contains(ip));
        }
        for ip in new_ips {
            match self.by_ip.get_mut(&ip) {
                Some(claims) => claims.earlier.push(std::mem::replace(&mut claims.owner, new.clone())),
                None => {
                    self.by_ip.insert(ip, Claims { owner: new.clone(), earlier: Vec::new() });
                }
            }
        }
    }

    /// Drops the entry under `key` and its claims; whether there was one.
    fn remove(&mut self, key: &str) -> bool {
        let Some(old) = self.by_key.remove(key) else {
            return false;
        };
        for ip in canonical_ips(&old.workload) {
            self.unclaim(ip, &old);
        }
        true
    }

    /// Withdraws `who`'s claim on `ip`: if it owned the address, the newest earlier claim takes it over.
    fn unclaim(&mut self, ip: IpAddr, who: &Arc<Destination>) {
        let Some(claims) = self.by_ip.get_mut(&ip) else {
            return;
        };
        if Arc::ptr_eq(&claims.owner, who) {
            match claims.earlier.pop() {
                Some(previous) => claims.owner = previous,
                None => {
                    self.by_ip.remove(&ip);
                }
            }
        } else {
            claims.earlier.retain(|claim| !Arc::ptr_eq(claim, who));
        }
    }
}

impl Claims {
    /// Puts `new` where `old` stood, keeping its place in the order.
    fn update(&mut self, old: &Arc<Destination>, new: &Arc<Destination>) {
        for claim in std::iter::once(&mut self.owner).chain(self.earlier.iter_mut()) {
            if Arc::ptr_eq(claim, old) {
                *claim = new.clone();
            }
        }
    }
}

/// `workload`'s addresses in canonical form (v4-mapped IPv6 as IPv4), each once.
fn canonical_ips(workload: &Workload) -> Vec<IpAddr> {
    let mut ips: Vec<IpAddr> = Vec::with_capacity(workload.workload_ips.len());
    for ip in &workload.workload_ips {
        let ip = ip.to_canonical();
        if !ips.contains(&ip) {
            ips.push(ip);
        }
    }
    ips
}

/// The union of every source's workloads, keyed by IP. Cheap to clone; clones share the contents.
#[derive(Debug, Clone)]
pub struct Directory {
    trust_domain: String,
    sources: Arc<RwLock<BTreeMap<&'static str, Entries>>>,
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

    /// `workload` with its trust domain filled in and the identity it proves.
    fn destination(&self, mut workload: Workload) -> Result<Destination, DirectoryError> {
        if workload.trust_domain.is_empty() {
            workload.trust_domain.clone_from(&self.trust_domain);
        }
        match Identity::new(&workload.trust_domain, &workload.namespace, &workload.service_account) {
            Ok(identity) => Ok(Destination { workload, identity }),
            Err(source) => Err(DirectoryError::Identity { uid: workload.uid, source }),
        }
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, BTreeMap<&'static str, Entries>> {
        self.sources.write().unwrap_or_else(|p| p.into_inner())
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<&'static str, Entries>> {
        self.sources.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Replaces everything `source` contributed with `workloads`; where two claim an address, the later in the list
    /// owns it. Invalid entries are skipped and returned, so one bad entry does not hide the rest. Workloads
    /// without a uid, or repeating one, are each kept (a local file need not name them).
    pub fn replace(&self, source: &'static str, workloads: Vec<Workload>) -> Vec<DirectoryError> {
        let mut entries = Entries::default();
        let mut errors = Vec::new();
        for (n, workload) in workloads.into_iter().enumerate() {
            let key = if workload.uid.is_empty() || entries.by_key.contains_key(&workload.uid) {
                // Not a uid the Kubernetes API would give (NUL), so never one a later upsert names.
                format!("{}\0{n}", workload.uid)
            } else {
                workload.uid.clone()
            };
            match self.destination(workload) {
                Ok(destination) => entries.upsert(&key, destination),
                Err(error) => errors.push(error),
            }
        }
        tracing::info!(source, addresses = entries.by_ip.len(), "workload directory replaced");
        self.write().insert(source, entries);
        errors
    }

    /// Adds `workload` to `source`, or replaces that source's entry with the same uid. An invalid entry is not
    /// added and removes the older one (the source no longer lists a usable workload under that uid). An entry
    /// equal to the one held changes nothing.
    pub fn upsert(&self, source: &'static str, workload: Workload) -> Result<(), DirectoryError> {
        let uid = workload.uid.clone();
        let destination = match self.destination(workload) {
            Ok(destination) => destination,
            Err(error) => {
                self.remove(source, &uid);
                return Err(error);
            }
        };
        let mut sources = self.write();
        let entries = sources.entry(source).or_default();
        if entries.by_key.get(&uid).is_some_and(|held| held.workload == destination.workload) {
            return Ok(());
        }
        entries.upsert(&uid, destination);
        Ok(())
    }

    /// Removes `source`'s workload `uid`; whether it held one. Its addresses go back to whichever other workload
    /// of the source claimed them most recently.
    pub fn remove(&self, source: &'static str, uid: &str) -> bool {
        self.write().get_mut(source).is_some_and(|entries| entries.remove(uid))
    }

    /// Keeps only `source`'s workloads whose uid `keep` accepts (after a relist: the ones it listed).
    pub fn retain(&self, source: &'static str, mut keep: impl FnMut(&str) -> bool) {
        let mut sources = self.write();
        let Some(entries) = sources.get_mut(source) else {
            return;
        };
        let gone: Vec<String> = entries.by_key.keys().filter(|uid| !keep(uid)).cloned().collect();
        for uid in &gone {
            entries.remove(uid);
        }
        tracing::info!(source, removed = gone.len(), addresses = entries.by_ip.len(), "workload directory swept");
    }

    /// The workload owning `ip`, if any source knows it (the first source by name, if several do).
    pub fn lookup(&self, ip: IpAddr) -> Option<Arc<Destination>> {
        let ip = ip.to_canonical();
        self.read().values().find_map(|entries| Some(entries.by_ip.get(&ip)?.owner.clone()))
    }

    /// Every source's workloads, at most `limit` of them (the rest only counted), for `/config_dump`.
    pub fn listing(&self, limit: usize) -> Listing {
        let sources = self.read();
        let counts = sources
            .iter()
            .map(|(source, entries)| {
                (*source, SourceCount { workloads: entries.by_key.len(), addresses: entries.by_ip.len() })
            })
            .collect();
        let mut all: Vec<(&'static str, &Workload)> = sources
            .iter()
            .flat_map(|(source, entries)| entries.by_key.values().map(move |d| (*source, &d.workload)))
            .collect();
        all.sort_by(|(a_source, a), (b_source, b)| {
            (a_source, &a.uid, &a.workload_ips).cmp(&(b_source, &b.uid, &b.workload_ips))
        });
        let omitted = all.len().saturating_sub(limit);
        let workloads = all
            .into_iter()
            .take(limit)
            .map(|(source, workload)| ListedWorkload { source, workload: workload.clone() })
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

    fn pod(uid: &str, ips: &[&str]) -> Workload {
        Workload { uid: uid.into(), name: uid.into(), ..workload(ips, Protocol::Hbone) }
    }

    fn owner(dir: &Directory, ip: &str) -> Option<String> {
        dir.lookup(ip.parse().unwrap()).map(|d| d.workload.uid.clone())
    }

    /// A pod deleted and its address given to a new pod before the old pod's deletion arrives: the deletion must
    /// not take the address from the new pod (dropping the address on every deletion would).
    #[test]
    fn a_reused_address_stays_with_the_new_pod_when_the_old_ones_deletion_arrives() {
        let dir = Directory::new("cluster.local");
        dir.upsert("kubernetes", pod("old", &["10.0.0.5"])).unwrap();
        dir.upsert("kubernetes", pod("new", &["10.0.0.5"])).unwrap();
        assert_eq!(owner(&dir, "10.0.0.5").as_deref(), Some("new"), "the newest claim owns the address");
        assert!(dir.remove("kubernetes", "old"));
        assert_eq!(owner(&dir, "10.0.0.5").as_deref(), Some("new"), "the old pod's deletion left it alone");
        assert_eq!(dir.listing(10).sources["kubernetes"], SourceCount { workloads: 1, addresses: 1 });
        assert!(dir.remove("kubernetes", "new"));
        assert_eq!(owner(&dir, "10.0.0.5"), None);
        assert_eq!(dir.listing(10).sources["kubernetes"], SourceCount { workloads: 0, addresses: 0 });
        assert!(!dir.remove("kubernetes", "new"), "nothing left to remove");
    }

    #[test]
    fn when_the_owner_of_a_contested_address_leaves_the_newest_remaining_claim_gets_it() {
        let dir = Directory::new("cluster.local");
        for uid in ["a", "b", "c"] {
            dir.upsert("kubernetes", pod(uid, &["10.0.0.5"])).unwrap();
        }
        assert_eq!(dir.listing(10).sources["kubernetes"], SourceCount { workloads: 3, addresses: 1 });
        assert!(dir.remove("kubernetes", "c"));
        assert_eq!(owner(&dir, "10.0.0.5").as_deref(), Some("b"));
        assert!(dir.remove("kubernetes", "b"));
        assert_eq!(owner(&dir, "10.0.0.5").as_deref(), Some("a"));
    }

    /// The old pod's status keeps changing while it terminates: an update that keeps the address keeps the claim's
    /// age, so it never takes the address back, and the address it is handed back is its latest version.
    #[test]
    fn an_update_that_keeps_an_address_does_not_make_its_claim_newer() {
        let dir = Directory::new("cluster.local");
        dir.upsert("kubernetes", pod("old", &["10.0.0.5"])).unwrap();
        dir.upsert("kubernetes", pod("new", &["10.0.0.5"])).unwrap();
        let terminating = Workload { workload_name: "terminating".into(), ..pod("old", &["10.0.0.5"]) };
        dir.upsert("kubernetes", terminating).unwrap();
        assert_eq!(owner(&dir, "10.0.0.5").as_deref(), Some("new"));
        dir.remove("kubernetes", "new");
        let found = dir.lookup("10.0.0.5".parse().unwrap()).expect("handed back to the old pod");
        assert_eq!(found.workload.workload_name, "terminating", "its latest version");
    }

    #[test]
    fn an_update_moves_a_workload_between_addresses() {
        let dir = Directory::new("cluster.local");
        dir.upsert("kubernetes", pod("a", &["10.0.0.5", "fd00::5"])).unwrap();
        dir.upsert("kubernetes", pod("b", &["10.0.0.6"])).unwrap();
        // `a` drops one address and claims `b`'s: the newest claim there.
        dir.upsert("kubernetes", pod("a", &["fd00::5", "::ffff:10.0.0.6"])).unwrap();
        assert_eq!(owner(&dir, "10.0.0.5"), None, "the dropped address is released");
        assert_eq!(owner(&dir, "fd00::5").as_deref(), Some("a"));
        assert_eq!(owner(&dir, "10.0.0.6").as_deref(), Some("a"), "v4-mapped is the same address");
        dir.upsert("kubernetes", pod("a", &["fd00::5"])).unwrap();
        assert_eq!(owner(&dir, "10.0.0.6").as_deref(), Some("b"), "handed back to the claim still standing");
        assert_eq!(dir.listing(10).sources["kubernetes"], SourceCount { workloads: 2, addresses: 2 });
    }

    #[test]
    fn an_update_to_an_invalid_identity_removes_the_workload() {
        let dir = Directory::new("cluster.local");
        dir.upsert("kubernetes", pod("a", &["10.0.0.5"])).unwrap();
        let bad = Workload { namespace: "a/b".into(), ..pod("a", &["10.0.0.5"]) };
        assert!(dir.upsert("kubernetes", bad).is_err());
        assert_eq!(owner(&dir, "10.0.0.5"), None);
        assert_eq!(dir.listing(10).sources["kubernetes"], SourceCount { workloads: 0, addresses: 0 });
    }

    #[test]
    fn retain_sweeps_what_a_relist_did_not_hold_and_hands_addresses_back() {
        let dir = Directory::new("cluster.local");
        dir.upsert("kubernetes", pod("kept", &["10.0.0.5"])).unwrap();
        dir.upsert("kubernetes", pod("gone", &["10.0.0.5", "10.0.0.6"])).unwrap();
        dir.upsert("other", pod("gone", &["10.0.0.7"])).unwrap();
        dir.retain("kubernetes", |uid| uid == "kept");
        assert_eq!(owner(&dir, "10.0.0.5").as_deref(), Some("kept"));
        assert_eq!(owner(&dir, "10.0.0.6"), None);
        assert_eq!(owner(&dir, "10.0.0.7").as_deref(), Some("gone"), "other sources are untouched");
        let uids: Vec<(&str, String)> =
            dir.listing(10).workloads.into_iter().map(|w| (w.source, w.workload.uid)).collect();
        assert_eq!(uids, [("kubernetes", "kept".to_owned()), ("other", "gone".to_owned())]);
    }

    #[test]
    fn a_replaced_list_keeps_workloads_without_or_repeating_a_uid_and_the_later_one_owns_a_shared_address() {
        let dir = Directory::new("cluster.local");
        let unnamed = |name: &str, ips: &[&str]| Workload { uid: String::new(), name: name.into(), ..pod("", ips) };
        let errors = dir.replace(
            "local-file",
            vec![unnamed("first", &["10.0.0.5"]), unnamed("second", &["10.0.0.6"]), unnamed("third", &["10.0.0.5"])],
        );
        assert!(errors.is_empty(), "{errors:?}");
        let found = dir.lookup("10.0.0.5".parse().unwrap()).unwrap();
        assert_eq!(found.workload.name, "third");
        assert_eq!(dir.listing(10).sources["local-file"], SourceCount { workloads: 3, addresses: 2 });
        let mut names: Vec<String> = dir.listing(10).workloads.into_iter().map(|w| w.workload.name).collect();
        names.sort();
        assert_eq!(names, ["first", "second", "third"]);
    }

    #[test]
    fn an_address_two_sources_list_is_answered_by_the_first_source_by_name() {
        let dir = Directory::new("cluster.local");
        dir.upsert("local-file", pod("from-file", &["10.0.0.5"])).unwrap();
        dir.upsert("kubernetes", pod("from-api", &["10.0.0.5"])).unwrap();
        assert_eq!(owner(&dir, "10.0.0.5").as_deref(), Some("from-api"));
        dir.remove("kubernetes", "from-api");
        assert_eq!(owner(&dir, "10.0.0.5").as_deref(), Some("from-file"));
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

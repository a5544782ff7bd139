//! istiod's authorization policies (`istio.security.Authorization`, issue #32), held as they arrive over xDS and
//! checked for every connection a pod accepts: inbound HBONE, captured plaintext, and the same-node fast path.
//!
//! The semantics are Istio's for ambient (L4) policies, as ztunnel enforces them:
//! - a workload is governed by the `Global` policies, by the `Namespace` policies of its namespace, and by the
//!   `WorkloadSelector` policies its own xDS entry names (`authorization_policies`, `namespace/name`);
//! - a `dry_run` policy is held but never enforced;
//! - a connection is denied when any DENY policy matches it; otherwise it is allowed when the workload has no ALLOW
//!   policy, or when one of them matches;
//! - a policy matches when any of its groups does; a group when all its rules do; a rule when any of its matches
//!   does; a match when every field it sets does (a list field when any entry matches, a `not_` field when none
//!   does). Principals are compared without `spiffe://` (`cluster.local/ns/a/sa/b`), as Istio writes them.
//!
//! What it guarantees beyond that:
//! - **Never allow what a policy denies.** A part of a policy this proxy cannot evaluate (an extension, a string
//!   match of no kind, an address that is neither 4 nor 16 bytes, an action it does not know) is held as
//!   *unenforceable*: in a DENY policy (or one of an unknown action) it matches every connection, so the policy
//!   denies all it governs; in an ALLOW policy it matches none, so it allows nothing by that part. Each such policy is
//!   logged once when it arrives and listed by [`Policies::unenforceable`].
//! - A connection with no proven identity (plaintext) matches no principal, namespace or service account, and is
//!   matched by every `not_` field of those kinds.
//! - A workload istiod has not listed yet (a pod's first moments: the agent enrolls it before the kubelet reports
//!   its IP and istiod sends it) is denied everything while its namespace has `WorkloadSelector` policies, since
//!   any of them might select it; `Global` and `Namespace` policies apply to it as to any workload.
//! - What istiod sends is bounded by the xDS client (message size, resource count); nothing here allocates per
//!   connection.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, PoisonError, RwLock};

use hbone::identity::Identity;
use xds::wire::security::{self as wire, string_match::MatchType};

/// What a policy does when it matches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Allows what it matches (and, being there, denies what no ALLOW policy matches).
    Allow,
    /// Denies what it matches.
    Deny,
}

/// Which workloads a policy governs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scope {
    Global,
    Namespace,
    Selected,
}

/// One string condition.
#[derive(Debug, Clone)]
enum Text {
    Exact(String),
    Prefix(String),
    Suffix(String),
    Present,
}

impl Text {
    fn matches(&self, value: &str) -> bool {
        match self {
            Text::Exact(s) => value == s,
            Text::Prefix(s) => value.starts_with(s.as_str()),
            Text::Suffix(s) => value.ends_with(s.as_str()),
            Text::Present => !value.is_empty(),
        }
    }
}

/// An address range.
#[derive(Debug, Clone, Copy)]
struct Cidr {
    ip: IpAddr,
    len: u8,
}

impl Cidr {
    fn contains(&self, ip: IpAddr) -> bool {
        match (self.ip, ip.to_canonical()) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let len = u32::from(self.len.min(32));
                let mask = if len == 0 { 0 } else { u32::MAX << (32 - len) };
                u32::from(net) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let len = u32::from(self.len.min(128));
                let mask = if len == 0 { 0 } else { u128::MAX << (128 - len) };
                u128::from(net) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }
}

/// One match of a rule, compiled: AND of the fields it sets.
#[derive(Debug, Clone, Default)]
struct Match {
    namespaces: Vec<Text>,
    not_namespaces: Vec<Text>,
    service_accounts: Vec<(String, String)>,
    not_service_accounts: Vec<(String, String)>,
    principals: Vec<Text>,
    not_principals: Vec<Text>,
    source_ips: Vec<Cidr>,
    not_source_ips: Vec<Cidr>,
    destination_ips: Vec<Cidr>,
    not_destination_ips: Vec<Cidr>,
    destination_ports: Vec<u32>,
    not_destination_ports: Vec<u32>,
    /// Something here could not be evaluated: see the module's guarantees.
    unenforceable: bool,
}

/// A connection, as a policy sees it.
#[derive(Debug, Clone, Copy)]
pub struct Connection<'a> {
    /// The client's identity, as its certificate (or, on the fast path, its enrollment) proves it; `None` in
    /// plaintext.
    pub source: Option<&'a Identity>,
    /// The client's address.
    pub source_ip: IpAddr,
    /// Where the client connects in the pod.
    pub destination: SocketAddr,
}

/// A connection as the matches read it: with the client's principal written once, as Istio writes it.
struct Subject<'a> {
    connection: &'a Connection<'a>,
    principal: Option<String>,
}

impl Match {
    fn matches(&self, subject: &Subject<'_>, action: Action) -> bool {
        if self.unenforceable {
            return action == Action::Deny;
        }
        let (c, principal) = (subject.connection, &subject.principal);
        let texts = |list: &[Text], value: Option<&str>| value.is_some_and(|v| list.iter().any(|t| t.matches(v)));
        let accounts = |list: &[(String, String)]| {
            c.source.is_some_and(|id| list.iter().any(|(ns, sa)| *ns == id.namespace && *sa == id.service_account))
        };
        let namespace = c.source.map(|id| id.namespace.as_str());
        let (src, dst, port) = (c.source_ip, c.destination.ip(), u32::from(c.destination.port()));
        let within = |list: &[Cidr], ip: IpAddr| list.iter().any(|n| n.contains(ip));
        (self.namespaces.is_empty() || texts(&self.namespaces, namespace))
            && !texts(&self.not_namespaces, namespace)
            && (self.service_accounts.is_empty() || accounts(&self.service_accounts))
            && !accounts(&self.not_service_accounts)
            && (self.principals.is_empty() || texts(&self.principals, principal.as_deref()))
            && !texts(&self.not_principals, principal.as_deref())
            && (self.source_ips.is_empty() || within(&self.source_ips, src))
            && !within(&self.not_source_ips, src)
            && (self.destination_ips.is_empty() || within(&self.destination_ips, dst))
            && !within(&self.not_destination_ips, dst)
            && (self.destination_ports.is_empty() || self.destination_ports.contains(&port))
            && !self.not_destination_ports.contains(&port)
    }
}

/// One policy, compiled from istiod's resource.
#[derive(Debug, Clone)]
pub struct Policy {
    name: String,
    namespace: String,
    scope: Scope,
    action: Action,
    dry_run: bool,
    /// OR of groups; each an AND of rules; each an OR of matches.
    groups: Vec<Vec<Vec<Match>>>,
    /// Why part of it cannot be evaluated, if so.
    unenforceable: Option<String>,
}

impl Policy {
    /// Compiles `policy`; parts it cannot evaluate are kept as unenforceable (see the module's guarantees).
    pub fn compile(policy: &wire::Authorization) -> Policy {
        let mut why: Vec<String> = Vec::new();
        let action = match wire::Action::try_from(policy.action) {
            Ok(wire::Action::Allow) => Action::Allow,
            Ok(wire::Action::Deny) => Action::Deny,
            Err(_) => {
                why.push(format!("unknown action {}", policy.action));
                Action::Deny
            }
        };
        let scope = match wire::Scope::try_from(policy.scope) {
            Ok(wire::Scope::Global) => Scope::Global,
            Ok(wire::Scope::Namespace) => Scope::Namespace,
            Ok(wire::Scope::WorkloadSelector) => Scope::Selected,
            Err(_) => {
                // Governs nobody we could name: as a DENY it would be lost, so it governs every workload.
                why.push(format!("unknown scope {}", policy.scope));
                Scope::Global
            }
        };
        if !policy.extensions.is_empty() {
            why.push("policy extensions".to_owned());
        }
        let groups = policy
            .groups
            .iter()
            .map(|g| g.rules.iter().map(|r| r.matches.iter().map(|m| compile_match(m, &mut why)).collect()).collect())
            .collect();
        let mut compiled = Policy {
            name: policy.name.clone(),
            namespace: policy.namespace.clone(),
            scope,
            action,
            dry_run: policy.dry_run,
            groups,
            unenforceable: None,
        };
        if !why.is_empty() {
            why.dedup();
            compiled.unenforceable = Some(why.join(", "));
            if !policy.extensions.is_empty() || action == Action::Deny && policy.action != wire::Action::Deny as i32 {
                // The policy as a whole is not understood: one unenforceable match stands for all of it.
                compiled.groups = vec![vec![vec![Match { unenforceable: true, ..Match::default() }]]];
            }
        }
        compiled
    }

    /// `namespace/name`, as workloads name the policies selecting them.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    fn matches(&self, subject: &Subject<'_>) -> bool {
        self.groups.iter().any(|rules| rules.iter().all(|any| any.iter().any(|m| m.matches(subject, self.action))))
    }
}

fn texts(list: &[wire::StringMatch], why: &mut Vec<String>, unenforceable: &mut bool) -> Vec<Text> {
    list.iter()
        .filter_map(|s| match &s.match_type {
            Some(MatchType::Exact(v)) => Some(Text::Exact(v.clone())),
            Some(MatchType::Prefix(v)) => Some(Text::Prefix(v.clone())),
            Some(MatchType::Suffix(v)) => Some(Text::Suffix(v.clone())),
            Some(MatchType::Presence(_)) => Some(Text::Present),
            None => {
                why.push("a string match of no kind".to_owned());
                *unenforceable = true;
                None
            }
        })
        .collect()
}

fn cidrs(list: &[wire::Address], why: &mut Vec<String>, unenforceable: &mut bool) -> Vec<Cidr> {
    list.iter()
        .filter_map(|a| {
            let ip = match a.address.len() {
                4 => <[u8; 4]>::try_from(a.address.as_slice()).ok().map(IpAddr::from),
                16 => <[u8; 16]>::try_from(a.address.as_slice()).ok().map(IpAddr::from),
                _ => None,
            };
            let max = if a.address.len() == 4 { 32 } else { 128 };
            match ip {
                Some(ip) if a.length <= max => Some(Cidr { ip, len: a.length as u8 }),
                _ => {
                    why.push(format!("an address of {} bytes /{}", a.address.len(), a.length));
                    *unenforceable = true;
                    None
                }
            }
        })
        .collect()
}

fn compile_match(m: &wire::Match, why: &mut Vec<String>) -> Match {
    let mut bad = !m.extensions.is_empty();
    if bad {
        why.push("match extensions".to_owned());
    }
    let accounts = |list: &[wire::ServiceAccountMatch]| {
        list.iter().map(|s| (s.namespace.clone(), s.service_account.clone())).collect::<Vec<_>>()
    };
    Match {
        namespaces: texts(&m.namespaces, why, &mut bad),
        not_namespaces: texts(&m.not_namespaces, why, &mut bad),
        service_accounts: accounts(&m.service_accounts),
        not_service_accounts: accounts(&m.not_service_accounts),
        principals: texts(&m.principals, why, &mut bad),
        not_principals: texts(&m.not_principals, why, &mut bad),
        source_ips: cidrs(&m.source_ips, why, &mut bad),
        not_source_ips: cidrs(&m.not_source_ips, why, &mut bad),
        destination_ips: cidrs(&m.destination_ips, why, &mut bad),
        not_destination_ips: cidrs(&m.not_destination_ips, why, &mut bad),
        destination_ports: m.destination_ports.clone(),
        not_destination_ports: m.not_destination_ports.clone(),
        unenforceable: bad,
    }
}

/// The workload a connection is for: its xDS uid (for the policies it selects) and namespace.
#[derive(Debug, Clone, Copy)]
pub struct Governed<'a> {
    /// The workload's uid as istiod names it (`cluster//Pod/ns/name`); empty when istiod has not listed it.
    pub uid: &'a str,
    /// The workload's namespace.
    pub namespace: &'a str,
}

/// Why a connection was denied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Denied {
    /// A DENY policy (`namespace/name`) matched.
    Policy(String),
    /// ALLOW policies govern the workload and none matched.
    NoAllowMatched,
    /// istiod has not listed the workload yet, so which selector policies it is under is unknown, and its namespace
    /// has some: until it is listed, none of them could be applied (a pod's first moments, or istiod away).
    Unlisted,
}

impl std::fmt::Display for Denied {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Denied::Policy(p) => write!(f, "denied by authorization policy {p}"),
            Denied::NoAllowMatched => f.write_str("no ALLOW authorization policy matched"),
            Denied::Unlisted => {
                f.write_str("the workload is not listed by istiod yet and its namespace has workload-selector policies")
            }
        }
    }
}

#[derive(Debug, Default)]
struct State {
    by_key: HashMap<String, Arc<Policy>>,
    /// What each workload (xDS uid) lists in `authorization_policies`.
    selected: HashMap<String, Vec<String>>,
}

/// The policies istiod sent, shared by the xDS source (which writes) and every pod's connections (which check).
/// Cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct Policies(Arc<RwLock<State>>);

impl Policies {
    fn read(&self) -> std::sync::RwLockReadGuard<'_, State> {
        self.0.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, State> {
        self.0.write().unwrap_or_else(PoisonError::into_inner)
    }

    /// Holds `policy` under `key` (the resource name, `namespace/name`), replacing any before it.
    pub fn upsert(&self, key: &str, policy: &wire::Authorization) {
        let compiled = Policy::compile(policy);
        if let Some(why) = &compiled.unenforceable {
            tracing::warn!(policy = key, action = ?compiled.action, %why,
                "authorization policy not fully enforceable: a DENY denies all it governs, an ALLOW allows nothing by those parts");
        }
        self.write().by_key.insert(key.to_owned(), Arc::new(compiled));
    }

    /// Drops the policy `key`; whether it was held.
    pub fn remove(&self, key: &str) -> bool {
        self.write().by_key.remove(key).is_some()
    }

    /// Records the policies workload `uid` selects (an empty list forgets it).
    pub fn select(&self, uid: &str, policies: &[String]) {
        let mut state = self.write();
        if policies.is_empty() {
            state.selected.remove(uid);
        } else {
            state.selected.insert(uid.to_owned(), policies.to_vec());
        }
    }

    /// Forgets what workload `uid` selects.
    pub fn unselect(&self, uid: &str) {
        self.write().selected.remove(uid);
    }

    /// How many policies are held.
    pub fn len(&self) -> usize {
        self.read().by_key.len()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The held policies that are not fully enforceable, with why (sorted by key).
    pub fn unenforceable(&self) -> Vec<(String, String)> {
        let mut out: Vec<(String, String)> = self
            .read()
            .by_key
            .iter()
            .filter_map(|(k, p)| p.unenforceable.clone().map(|why| (k.clone(), why)))
            .collect();
        out.sort();
        out
    }

    /// The held policies' keys with their action (sorted), for the config dump.
    pub fn listing(&self) -> Vec<(String, Action, bool)> {
        let mut out: Vec<(String, Action, bool)> =
            self.read().by_key.iter().map(|(k, p)| (k.clone(), p.action, p.dry_run)).collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// Whether `connection` to `workload` may go ahead (see the module's rules).
    pub fn check(&self, workload: Governed<'_>, connection: &Connection<'_>) -> Result<(), Denied> {
        let state = self.read();
        if state.by_key.is_empty() {
            return Ok(());
        }
        if workload.uid.is_empty()
            && state
                .by_key
                .values()
                .any(|p| !p.dry_run && p.scope == Scope::Selected && p.namespace == workload.namespace)
        {
            return Err(Denied::Unlisted);
        }
        let selected = state.selected.get(workload.uid).map(Vec::as_slice).unwrap_or_default();
        let governing = state.by_key.iter().filter(|(key, p)| {
            !p.dry_run
                && match p.scope {
                    Scope::Global => true,
                    Scope::Namespace => p.namespace == workload.namespace,
                    Scope::Selected => selected.iter().any(|s| s == *key),
                }
        });
        let principal =
            connection.source.map(|id| format!("{}/ns/{}/sa/{}", id.trust_domain, id.namespace, id.service_account));
        let subject = Subject { connection, principal };
        let mut allows = false;
        let mut allowed = false;
        for (key, policy) in governing {
            match policy.action {
                Action::Deny if policy.matches(&subject) => return Err(Denied::Policy(key.clone())),
                Action::Deny => {}
                Action::Allow => {
                    allows = true;
                    allowed = allowed || policy.matches(&subject);
                }
            }
        }
        if allows && !allowed {
            return Err(Denied::NoAllowMatched);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use wire::{Address, Authorization, Group, Rules, ServiceAccountMatch, StringMatch};

    fn exact(s: &str) -> StringMatch {
        StringMatch { match_type: Some(MatchType::Exact(s.into())) }
    }

    fn policy(
        ns: &str,
        name: &str,
        scope: wire::Scope,
        action: wire::Action,
        matches: Vec<wire::Match>,
    ) -> Authorization {
        Authorization {
            name: name.into(),
            namespace: ns.into(),
            scope: scope as i32,
            action: action as i32,
            groups: vec![Group { rules: vec![Rules { matches }] }],
            ..Default::default()
        }
    }

    fn id(ns: &str, sa: &str) -> Identity {
        Identity::new("cluster.local", ns, sa).unwrap()
    }

    const WEB: Governed<'static> = Governed { uid: "Kubernetes//Pod/shop/web", namespace: "shop" };

    fn conn<'a>(source: Option<&'a Identity>, src: &str, port: u16) -> Connection<'a> {
        Connection {
            source,
            source_ip: src.parse().unwrap(),
            destination: SocketAddr::new("10.0.0.2".parse().unwrap(), port),
        }
    }

    #[test]
    fn without_policies_everything_is_allowed_and_a_deny_in_the_namespace_denies_what_it_matches() {
        let policies = Policies::default();
        let client = id("other", "client");
        assert_eq!(policies.check(WEB, &conn(Some(&client), "10.0.0.1", 80)), Ok(()));

        let from_other = wire::Match { namespaces: vec![exact("other")], ..Default::default() };
        policies
            .upsert("shop/gate", &policy("shop", "gate", wire::Scope::Namespace, wire::Action::Deny, vec![from_other]));
        let denied = policies.check(WEB, &conn(Some(&client), "10.0.0.1", 80)).unwrap_err();
        assert_eq!(denied, Denied::Policy("shop/gate".into()));
        let friend = id("shop", "friend");
        assert_eq!(policies.check(WEB, &conn(Some(&friend), "10.0.0.1", 80)), Ok(()), "another namespace's client");
        assert_eq!(policies.check(WEB, &conn(None, "10.0.0.1", 80)), Ok(()), "plaintext has no namespace to match");
        let elsewhere = Governed { uid: "Kubernetes//Pod/db/db", namespace: "db" };
        assert_eq!(policies.check(elsewhere, &conn(Some(&client), "10.0.0.1", 80)), Ok(()), "another namespace's pod");
        assert!(policies.remove("shop/gate"));
        assert_eq!(policies.check(WEB, &conn(Some(&client), "10.0.0.1", 80)), Ok(()));
    }

    #[test]
    fn an_allow_policy_allows_what_it_matches_and_denies_the_rest_of_what_it_governs() {
        let policies = Policies::default();
        let m = wire::Match {
            principals: vec![exact("cluster.local/ns/shop/sa/front")],
            destination_ports: vec![8080],
            ..Default::default()
        };
        let allow = policy("shop", "front-only", wire::Scope::WorkloadSelector, wire::Action::Allow, vec![m]);
        policies.upsert("shop/front-only", &allow);
        let front = id("shop", "front");
        // Not selected by the workload yet: it governs nobody.
        assert_eq!(policies.check(WEB, &conn(Some(&id("x", "y")), "10.0.0.1", 80)), Ok(()));
        policies.select(WEB.uid, &["shop/front-only".to_owned()]);
        assert_eq!(policies.check(WEB, &conn(Some(&front), "10.0.0.1", 8080)), Ok(()));
        assert_eq!(policies.check(WEB, &conn(Some(&front), "10.0.0.1", 9090)), Err(Denied::NoAllowMatched), "port");
        assert_eq!(
            policies.check(WEB, &conn(Some(&id("shop", "back")), "10.0.0.1", 8080)),
            Err(Denied::NoAllowMatched)
        );
        assert_eq!(policies.check(WEB, &conn(None, "10.0.0.1", 8080)), Err(Denied::NoAllowMatched), "plaintext");
        policies.unselect(WEB.uid);
        assert_eq!(policies.check(WEB, &conn(None, "10.0.0.1", 8080)), Ok(()));
        // A pod istiod has not listed yet, in a namespace with selector policies: which of them select it is
        // unknown, so nothing is let through until it is listed.
        let unlisted = Governed { uid: "", namespace: "shop" };
        assert_eq!(policies.check(unlisted, &conn(Some(&front), "10.0.0.1", 8080)), Err(Denied::Unlisted));
        let elsewhere = Governed { uid: "", namespace: "db" };
        assert_eq!(policies.check(elsewhere, &conn(Some(&front), "10.0.0.1", 8080)), Ok(()), "none in its namespace");
    }

    #[test]
    fn not_fields_ip_ranges_service_accounts_and_dry_run() {
        let policies = Policies::default();
        let m = wire::Match {
            not_principals: vec![StringMatch { match_type: Some(MatchType::Presence(wire::Empty {})) }],
            ..Default::default()
        };
        // Istio's "deny requests without a principal": plaintext is denied, mTLS is not.
        policies.upsert(
            "istio-system/mtls",
            &policy("istio-system", "mtls", wire::Scope::Global, wire::Action::Deny, vec![m]),
        );
        assert!(policies.check(WEB, &conn(None, "10.0.0.1", 80)).is_err());
        assert_eq!(policies.check(WEB, &conn(Some(&id("a", "b")), "10.0.0.1", 80)), Ok(()));
        policies.remove("istio-system/mtls");

        let ranges = wire::Match {
            source_ips: vec![Address { address: vec![10, 1, 0, 0], length: 16 }],
            not_source_ips: vec![Address { address: vec![10, 1, 2, 3], length: 32 }],
            service_accounts: vec![ServiceAccountMatch { namespace: "a".into(), service_account: "b".into() }],
            ..Default::default()
        };
        policies.upsert("shop/r", &policy("shop", "r", wire::Scope::Namespace, wire::Action::Allow, vec![ranges]));
        let ab = id("a", "b");
        assert_eq!(policies.check(WEB, &conn(Some(&ab), "10.1.9.9", 80)), Ok(()));
        assert!(policies.check(WEB, &conn(Some(&ab), "10.1.2.3", 80)).is_err(), "excluded address");
        assert!(policies.check(WEB, &conn(Some(&ab), "10.2.0.1", 80)).is_err(), "outside the range");
        assert!(policies.check(WEB, &conn(Some(&id("a", "c")), "10.1.9.9", 80)).is_err(), "another account");

        let mut dry = policy("shop", "dry", wire::Scope::Namespace, wire::Action::Deny, vec![wire::Match::default()]);
        dry.dry_run = true;
        policies.upsert("shop/dry", &dry);
        assert_eq!(policies.check(WEB, &conn(Some(&ab), "10.1.9.9", 80)), Ok(()), "dry run is not enforced");
    }

    #[test]
    fn what_cannot_be_evaluated_never_allows_what_a_policy_denies() {
        let policies = Policies::default();
        let client = id("other", "client");
        let odd = wire::Match { source_ips: vec![Address { address: vec![1, 2, 3], length: 8 }], ..Default::default() };
        // In a DENY: denies every connection it governs.
        policies.upsert(
            "shop/odd-deny",
            &policy("shop", "odd-deny", wire::Scope::Namespace, wire::Action::Deny, vec![odd.clone()]),
        );
        assert!(policies.check(WEB, &conn(Some(&client), "10.0.0.1", 80)).is_err());
        assert_eq!(policies.unenforceable().len(), 1);
        policies.remove("shop/odd-deny");
        // In an ALLOW: allows nothing by that match.
        policies.upsert(
            "shop/odd-allow",
            &policy("shop", "odd-allow", wire::Scope::Namespace, wire::Action::Allow, vec![odd]),
        );
        assert!(policies.check(WEB, &conn(Some(&client), "10.0.0.1", 80)).is_err());
        policies.remove("shop/odd-allow");
        // An unknown action: denies all it governs.
        let mut unknown =
            policy("shop", "new", wire::Scope::Namespace, wire::Action::Allow, vec![wire::Match::default()]);
        unknown.action = 7;
        policies.upsert("shop/new", &unknown);
        assert!(policies.check(WEB, &conn(Some(&client), "10.0.0.1", 80)).is_err());
        // An ALLOW with no rule at all allows nothing; one with an empty rule allows everything.
        policies.remove("shop/new");
        let mut none = policy("shop", "none", wire::Scope::Namespace, wire::Action::Allow, Vec::new());
        none.groups.clear();
        policies.upsert("shop/none", &none);
        assert!(policies.check(WEB, &conn(Some(&client), "10.0.0.1", 80)).is_err());
        policies.upsert(
            "shop/all",
            &policy("shop", "all", wire::Scope::Namespace, wire::Action::Allow, vec![wire::Match::default()]),
        );
        assert_eq!(policies.check(WEB, &conn(Some(&client), "10.0.0.1", 80)), Ok(()));
    }
}

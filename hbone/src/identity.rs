//! SPIFFE workload identities in Istio's `spiffe://<td>/ns/<ns>/sa/<sa>` form.

use std::fmt;
use std::str::FromStr;

/// The URI scheme prefix every mesh identity starts with.
const SPIFFE_PREFIX: &str = "spiffe://";

/// A workload identity: who a certificate speaks for, and what a peer is expected to be.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Identity {
    /// The mesh trust domain, e.g. `cluster.local`.
    pub trust_domain: String,
    /// The Kubernetes namespace of the workload.
    pub namespace: String,
    /// The Kubernetes service account of the workload.
    pub service_account: String,
}

/// Why a string is not a valid mesh identity.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    /// The text does not start with `spiffe://`.
    #[error("identity {0:?} does not start with spiffe://")]
    Scheme(String),
    /// The path is not exactly `/ns/<ns>/sa/<sa>`.
    #[error("identity {0:?} is not of the form spiffe://<td>/ns/<ns>/sa/<sa>")]
    Shape(String),
    /// The trust domain has characters SPIFFE does not allow (lower-case letters, digits, `.`, `-`, `_`).
    #[error("identity {0:?} has an invalid trust domain")]
    TrustDomain(String),
    /// A namespace or service account is empty, `.`/`..`, or has characters SPIFFE paths do not allow.
    #[error("identity {0:?} has an invalid path segment {1:?}")]
    Segment(String, String),
}

impl Identity {
    /// Builds an identity from its parts, checking each part the same way parsing does.
    pub fn new(
        trust_domain: impl Into<String>,
        namespace: impl Into<String>,
        service_account: impl Into<String>,
    ) -> Result<Self, IdentityError> {
        let id = Identity {
            trust_domain: trust_domain.into(),
            namespace: namespace.into(),
            service_account: service_account.into(),
        };
        id.to_string().parse()
    }

    /// Whether this identity belongs to `trust_domain`.
    pub fn in_trust_domain(&self, trust_domain: &str) -> bool {
        self.trust_domain == trust_domain
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{SPIFFE_PREFIX}{}/ns/{}/sa/{}", self.trust_domain, self.namespace, self.service_account)
    }
}

impl FromStr for Identity {
    type Err = IdentityError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let rest = s.strip_prefix(SPIFFE_PREFIX).ok_or_else(|| IdentityError::Scheme(s.to_string()))?;
        let parts: Vec<&str> = rest.split('/').collect();
        let [td, "ns", ns, "sa", sa] = parts.as_slice() else {
            return Err(IdentityError::Shape(s.to_string()));
        };
        if !valid_trust_domain(td) {
            return Err(IdentityError::TrustDomain(s.to_string()));
        }
        for segment in [ns, sa] {
            if !valid_segment(segment) {
                return Err(IdentityError::Segment(s.to_string(), segment.to_string()));
            }
        }
        Ok(Identity { trust_domain: td.to_string(), namespace: ns.to_string(), service_account: sa.to_string() })
    }
}

fn valid_trust_domain(td: &str) -> bool {
    !td.is_empty() && td.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-._".contains(&b))
}

fn valid_segment(segment: &str) -> bool {
    !segment.is_empty()
        && segment != "."
        && segment != ".."
        && segment.bytes().all(|b| b.is_ascii_alphanumeric() || b"-._".contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_displays_round_trip() {
        let text = "spiffe://cluster.local/ns/default/sa/bookinfo-productpage";
        let id: Identity = text.parse().unwrap();
        assert_eq!(id.trust_domain, "cluster.local");
        assert_eq!(id.namespace, "default");
        assert_eq!(id.service_account, "bookinfo-productpage");
        assert_eq!(id.to_string(), text);
        assert_eq!(Identity::new("cluster.local", "default", "bookinfo-productpage").unwrap(), id);
    }

    #[test]
    fn rejects_malformed_identities() {
        let bad = [
            ("http://cluster.local/ns/a/sa/b", "scheme"),
            ("spiffe://cluster.local/ns/a/sa/b/", "shape"),
            ("spiffe://cluster.local/ns/a/sa", "shape"),
            ("spiffe://cluster.local/sa/b/ns/a", "shape"),
            ("spiffe://cluster.local/ns/a/sa/b/extra", "shape"),
            ("spiffe://cluster.local/ns//sa/b", "segment"),
            ("spiffe://cluster.local/ns/../sa/b", "segment"),
            ("spiffe://cluster.local/ns/a/sa/b?x=1", "segment"),
            ("spiffe://Cluster.Local/ns/a/sa/b", "trust domain"),
            ("spiffe:///ns/a/sa/b", "trust domain"),
            ("spiffe://td:8080/ns/a/sa/b", "trust domain"),
        ];
        for (text, why) in bad {
            let err = text.parse::<Identity>().unwrap_err();
            let kind = match err {
                IdentityError::Scheme(_) => "scheme",
                IdentityError::Shape(_) => "shape",
                IdentityError::TrustDomain(_) => "trust domain",
                IdentityError::Segment(..) => "segment",
            };
            assert_eq!(kind, why, "{text}");
        }
        assert!(Identity::new("cluster.local", "a/b", "c").is_err());
    }
}

//! ztunnel's environment variables, resolved into a [`ChannelConfig`] (for xDS or the CA) and a [`NodeIdentity`].
//!
//! Guarantees: resolution is a pure function of the variables given and of which files exist (both passed in, so
//! tests need no process environment); it follows ztunnel's precedence (see each function) and reports a value it
//! cannot use as an error naming the variable, never a panic. Files are not read here: the channel reads the roots
//! at every connect and the token at every call.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use crate::ads::NodeIdentity;
use crate::channel::{ChannelConfig, Roots, Token};

/// Where istiod's roots are mounted by the chart (ConfigMap `istio-ca-root-cert`).
pub const DEFAULT_ROOT_CERT: &str = "/var/run/secrets/istio/root-cert.pem";
/// Where the chart projects the `istio-ca` token.
pub const DEFAULT_TOKEN: &str = "/var/run/secrets/tokens/istio-token";

/// Which of istiod's two services a channel is for; they differ only in their variables' prefixes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `XDS_ADDRESS`, `XDS_ROOT_CA`, `ALT_XDS_HOSTNAME`, `XDS_HEADER_<K>`.
    Xds,
    /// `CA_ADDRESS`, `CA_ROOT_CA`, `ALT_CA_HOSTNAME`, `CA_HEADER_<K>`.
    Ca,
}

impl Endpoint {
    fn prefix(self) -> &'static str {
        match self {
            Endpoint::Xds => "XDS",
            Endpoint::Ca => "CA",
        }
    }
}

fn get<'a>(vars: &'a BTreeMap<String, String>, name: &str) -> Option<&'a str> {
    vars.get(name).map(String::as_str)
}

/// The channel for `endpoint`, or `None` when its address is set but empty (disabled).
///
/// * address: `<P>_ADDRESS`; else `https://istiod.istio-system.svc:15012` in a pod (`KUBERNETES_SERVICE_HOST`
///   set), else `https://localhost:15012`; no scheme means https. (`PROXY_CONFIG.discoveryAddress` is not read.)
/// * roots: `<P>_ROOT_CA` = `SYSTEM`, inline PEM, or a file path; default [`DEFAULT_ROOT_CERT`];
/// * alternate SAN: `ALT_<P>_HOSTNAME`;
/// * token: `AUTH_TOKEN`, a file if it exists, else the token itself; default [`DEFAULT_TOKEN`] if it exists,
///   else none;
/// * `clusterid`: `ISTIO_META_CLUSTER_ID`, else `CLUSTER_ID`, else `Kubernetes`;
/// * headers: each `<P>_HEADER_<K>=v` as `<k>: v` (lowercased name).
pub fn channel_config(
    endpoint: Endpoint,
    vars: &BTreeMap<String, String>,
    exists: impl Fn(&Path) -> bool,
) -> Result<Option<ChannelConfig>, String> {
    let p = endpoint.prefix();
    let address = match get(vars, &format!("{p}_ADDRESS")) {
        Some(a) if a.trim().is_empty() => return Ok(None),
        Some(a) => a.trim().to_owned(),
        None if get(vars, "KUBERNETES_SERVICE_HOST").is_some() => "https://istiod.istio-system.svc:15012".to_owned(),
        None => "https://localhost:15012".to_owned(),
    };
    let roots = match get(vars, &format!("{p}_ROOT_CA")).map(str::trim) {
        Some("SYSTEM") => Roots::System,
        Some(pem) if pem.starts_with("-----BEGIN") => Roots::Pem(pem.as_bytes().to_vec()),
        Some(path) if !path.is_empty() => Roots::File(PathBuf::from(path)),
        _ => Roots::File(PathBuf::from(DEFAULT_ROOT_CERT)),
    };
    let mut config = ChannelConfig::new(address, roots);
    config.alt_hostname = get(vars, &format!("ALT_{p}_HOSTNAME")).filter(|h| !h.is_empty()).map(str::to_owned);
    config.token = match get(vars, "AUTH_TOKEN").filter(|t| !t.is_empty()) {
        Some(t) if exists(Path::new(t)) => Token::File(PathBuf::from(t)),
        Some(t) => Token::Literal(t.to_owned()),
        None if exists(Path::new(DEFAULT_TOKEN)) => Token::File(PathBuf::from(DEFAULT_TOKEN)),
        None => Token::None,
    };
    config.cluster_id = get(vars, "ISTIO_META_CLUSTER_ID")
        .or_else(|| get(vars, "CLUSTER_ID"))
        .filter(|c| !c.is_empty())
        .unwrap_or("Kubernetes")
        .to_owned();
    let header_prefix = format!("{p}_HEADER_");
    for (k, v) in vars {
        if let Some(name) = k.strip_prefix(&header_prefix).filter(|n| !n.is_empty()) {
            config.headers.push((name.to_ascii_lowercase(), v.clone()));
        }
    }
    Ok(Some(config))
}

/// The node: `INSTANCE_IP` (also the one `INSTANCE_IPS` entry), `POD_NAME`, `POD_NAMESPACE`, `NODE_NAME`, every
/// `ISTIO_META_<K>` and `ISTIO_METAJSON_<K>`.
pub fn node_identity(vars: &BTreeMap<String, String>) -> Result<NodeIdentity, String> {
    let instance_ip = match get(vars, "INSTANCE_IP").filter(|ip| !ip.is_empty()) {
        Some(ip) => Some(ip.parse::<IpAddr>().map_err(|e| format!("INSTANCE_IP {ip:?}: {e}"))?),
        None => None,
    };
    let identity = NodeIdentity {
        instance_ip,
        instance_ips: instance_ip.into_iter().collect(),
        pod_name: get(vars, "POD_NAME").unwrap_or_default().to_owned(),
        pod_namespace: get(vars, "POD_NAMESPACE").unwrap_or_default().to_owned(),
        node_name: get(vars, "NODE_NAME").unwrap_or_default().to_owned(),
        extra_metadata: BTreeMap::new(),
    };
    let all = || vars.iter().map(|(k, v)| (k.clone(), v.clone()));
    identity.with_istio_meta_env(all()).with_istio_metajson_env(all())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn defaults_outside_and_inside_a_pod() {
        let c = channel_config(Endpoint::Xds, &vars(&[]), |_| false).unwrap().unwrap();
        assert_eq!(c.address, "https://localhost:15012");
        assert!(matches!(&c.roots, Roots::File(p) if p == Path::new(DEFAULT_ROOT_CERT)));
        assert!(matches!(c.token, Token::None));
        assert_eq!(c.cluster_id, "Kubernetes");
        assert!(c.alt_hostname.is_none() && c.headers.is_empty());
        let pod = vars(&[("KUBERNETES_SERVICE_HOST", "10.96.0.1")]);
        let c = channel_config(Endpoint::Ca, &pod, |p| p == Path::new(DEFAULT_TOKEN)).unwrap().unwrap();
        assert_eq!(c.address, "https://istiod.istio-system.svc:15012");
        assert!(matches!(&c.token, Token::File(p) if p == Path::new(DEFAULT_TOKEN)));
    }

    #[test]
    fn explicit_settings_per_endpoint() {
        let env = vars(&[
            ("XDS_ADDRESS", "istiod.x:15012"),
            ("CA_ADDRESS", ""),
            ("XDS_ROOT_CA", "SYSTEM"),
            ("ALT_XDS_HOSTNAME", "istiod.istio-system.svc"),
            ("AUTH_TOKEN", "/t/token"),
            ("CLUSTER_ID", "c2"),
            ("XDS_HEADER_X-Tenant", "a"),
            ("CA_HEADER_Other", "b"),
        ]);
        let c = channel_config(Endpoint::Xds, &env, |p| p == Path::new("/t/token")).unwrap().unwrap();
        assert_eq!(c.address, "istiod.x:15012");
        assert!(matches!(c.roots, Roots::System));
        assert_eq!(c.alt_hostname.as_deref(), Some("istiod.istio-system.svc"));
        assert!(matches!(&c.token, Token::File(p) if p == Path::new("/t/token")));
        assert_eq!(c.cluster_id, "c2");
        assert_eq!(c.headers, [("x-tenant".to_owned(), "a".to_owned())]);
        assert!(channel_config(Endpoint::Ca, &env, |_| false).unwrap().is_none(), "empty CA_ADDRESS disables it");
        // A token that is not a file is the token; ISTIO_META_CLUSTER_ID wins; inline PEM roots.
        let env = vars(&[
            ("AUTH_TOKEN", "eyJ.literal"),
            ("ISTIO_META_CLUSTER_ID", "c1"),
            ("CLUSTER_ID", "c2"),
            ("CA_ROOT_CA", "-----BEGIN CERTIFICATE-----\nxx\n-----END CERTIFICATE-----\n"),
        ]);
        let c = channel_config(Endpoint::Ca, &env, |_| false).unwrap().unwrap();
        assert!(matches!(&c.token, Token::Literal(t) if t == "eyJ.literal"));
        assert_eq!(c.cluster_id, "c1");
        assert!(matches!(&c.roots, Roots::Pem(p) if p.starts_with(b"-----BEGIN")));
    }

    #[test]
    fn node_identity_from_the_downward_api() {
        let env = vars(&[
            ("INSTANCE_IP", "10.0.0.3"),
            ("POD_NAME", "ztunnel-1"),
            ("POD_NAMESPACE", "istio-system"),
            ("NODE_NAME", "n1"),
            ("ISTIO_META_ISTIO_VERSION", "1.29"),
            ("ISTIO_METAJSON_LABELS", r#"{"a":"b"}"#),
        ]);
        let id = node_identity(&env).unwrap();
        assert_eq!(id.node_id(), "ztunnel~10.0.0.3~ztunnel-1.istio-system~istio-system.svc.cluster.local");
        assert_eq!(id.instance_ips, ["10.0.0.3".parse::<IpAddr>().unwrap()]);
        assert!(id.extra_metadata.contains_key("ISTIO_VERSION") && id.extra_metadata.contains_key("LABELS"));
        assert!(node_identity(&vars(&[("INSTANCE_IP", "nope")])).unwrap_err().starts_with("INSTANCE_IP"));
        assert!(node_identity(&vars(&[("ISTIO_METAJSON_X", "{")])).is_err());
    }
}

//! The request headers an HBONE client sends with CONNECT: where the connection came from (`forwarded`),
//! who sent it (`baggage`) and a fresh trace context (`traceparent`).

use std::net::SocketAddr;

use http::HeaderValue;
use ring::rand::{SecureRandom, SystemRandom};

/// What the source workload is, for the W3C `baggage` header peers use in telemetry.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Baggage {
    /// `k8s.cluster.name`, if known.
    pub cluster: Option<String>,
    /// `k8s.namespace.name`: the source namespace.
    pub namespace: String,
    /// The workload's kind and name, sent as `k8s.<kind>.name=<name>` (e.g. `deployment`, `web`).
    pub workload: Option<(String, String)>,
    /// `service.name`, the canonical service, if known.
    pub service_name: Option<String>,
    /// `service.version`, the canonical revision, if known.
    pub service_version: Option<String>,
}

impl Baggage {
    /// Baggage that only names the source namespace.
    pub fn namespace(namespace: impl Into<String>) -> Self {
        Baggage { namespace: namespace.into(), ..Default::default() }
    }

    /// The header value, `key=value` pairs joined by commas, known entries only.
    pub fn header_value(&self) -> String {
        let mut entries = Vec::new();
        if let Some(cluster) = &self.cluster {
            entries.push(format!("k8s.cluster.name={cluster}"));
        }
        entries.push(format!("k8s.namespace.name={}", self.namespace));
        if let Some((kind, name)) = &self.workload {
            entries.push(format!("k8s.{kind}.name={name}"));
        }
        if let Some(name) = &self.service_name {
            entries.push(format!("service.name={name}"));
        }
        if let Some(version) = &self.service_version {
            entries.push(format!("service.version={version}"));
        }
        entries.join(",")
    }
}

/// `forwarded: for="<ip:port>"`, with IPv6 addresses in brackets (RFC 7239).
pub fn forwarded(src: SocketAddr) -> HeaderValue {
    HeaderValue::from_str(&format!("for=\"{src}\"")).expect("a socket address is a valid header value")
}

/// A new random W3C `traceparent` (version 00, not sampled).
pub fn traceparent() -> HeaderValue {
    let rng = SystemRandom::new();
    let mut trace = [0u8; 16];
    let mut span = [0u8; 8];
    // All-zero ids are invalid; draw again in the (astronomically unlikely) case.
    while trace.iter().all(|b| *b == 0) || span.iter().all(|b| *b == 0) {
        rng.fill(&mut trace).expect("the system random source works");
        rng.fill(&mut span).expect("the system random source works");
    }
    let hex = |bytes: &[u8]| bytes.iter().map(|b| format!("{b:02x}")).collect::<String>();
    HeaderValue::from_str(&format!("00-{}-{}-00", hex(&trace), hex(&span))).expect("hex is a valid header value")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forwarded_brackets_ipv6() {
        assert_eq!(forwarded("10.0.0.1:4321".parse().unwrap()), "for=\"10.0.0.1:4321\"");
        assert_eq!(forwarded("[fd00::1]:4321".parse().unwrap()), "for=\"[fd00::1]:4321\"");
    }

    #[test]
    fn baggage_lists_known_entries() {
        assert_eq!(Baggage::namespace("ns1").header_value(), "k8s.namespace.name=ns1");
        let full = Baggage {
            cluster: Some("Kubernetes".into()),
            namespace: "ns1".into(),
            workload: Some(("deployment".into(), "web".into())),
            service_name: Some("web".into()),
            service_version: Some("v1".into()),
        };
        assert_eq!(
            full.header_value(),
            "k8s.cluster.name=Kubernetes,k8s.namespace.name=ns1,k8s.deployment.name=web,service.name=web,service.version=v1"
        );
    }

    #[test]
    fn traceparent_is_w3c_shaped_and_random() {
        let a = traceparent();
        let b = traceparent();
        assert_ne!(a, b);
        let parts: Vec<&str> = a.to_str().unwrap().split('-').collect();
        assert_eq!(parts.len(), 4);
        assert_eq!((parts[0], parts[1].len(), parts[2].len(), parts[3]), ("00", 32, 16, "00"));
        assert!(parts[1].bytes().all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()));
    }
}

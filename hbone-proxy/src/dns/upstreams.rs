//! Upstream configuration: which resolvers every pod's forwarder relays to, in the order they are tried.
//!
//! Guarantees: `DNS_UPSTREAMS`, when given, is used as it is; otherwise the host's `/etc/resolv.conf`
//! nameservers, in their order, on port 53, without scoped IPv6 addresses (their scope names a host interface
//! the pod does not have). An unreadable resolv.conf fails the proxy's start.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Port of an upstream given without one.
const DEFAULT_UPSTREAM_PORT: u16 = 53;

/// Why the upstream resolvers could not be determined.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamsError {
    /// The host's resolver configuration could not be read.
    #[error("reading {path}: {source}")]
    ResolvConf {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
}

/// The upstream resolvers every pod's forwarder relays to, tried in order.
#[derive(Debug, Clone)]
pub struct Upstreams(Arc<[SocketAddr]>);

impl Upstreams {
    /// `configured` (`DNS_UPSTREAMS`) when given, otherwise the nameservers of the host's `resolv_conf`.
    pub fn new(configured: &[SocketAddr], resolv_conf: &Path) -> Result<Self, UpstreamsError> {
        if !configured.is_empty() {
            return Ok(Upstreams(configured.into()));
        }
        let text = std::fs::read_to_string(resolv_conf)
            .map_err(|source| UpstreamsError::ResolvConf { path: resolv_conf.to_path_buf(), source })?;
        Ok(Upstreams(nameservers(&text).into()))
    }

    /// The resolvers, in the order they are tried.
    pub fn addrs(&self) -> &[SocketAddr] {
        &self.0
    }
}

/// Parses one `DNS_UPSTREAMS` entry: `ip`, `ip:port` or `[ipv6]:port`; the port defaults to 53.
pub fn parse_upstream(text: &str) -> Result<SocketAddr, String> {
    let text = text.trim();
    text.parse::<SocketAddr>()
        .or_else(|_| text.parse::<IpAddr>().map(|ip| SocketAddr::new(ip, DEFAULT_UPSTREAM_PORT)))
        .map_err(|_| format!("{text:?} is not an ip or ip:port"))
}

/// The `nameserver` addresses of a resolv.conf text, on port 53. Scoped IPv6 addresses (`fe80::1%eth0`) are
/// skipped: the scope names a host interface that does not exist in the pod.
fn nameservers(resolv_conf: &str) -> Vec<SocketAddr> {
    resolv_conf
        .lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            (words.next()? == "nameserver").then_some(())?;
            let ip: IpAddr = words.next()?.parse().ok()?;
            Some(SocketAddr::new(ip, DEFAULT_UPSTREAM_PORT))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upstreams_parse_with_and_without_port() {
        assert_eq!(parse_upstream("10.0.0.2"), Ok(SocketAddr::from(([10, 0, 0, 2], 53))));
        assert_eq!(parse_upstream(" 10.0.0.2:5353"), Ok(SocketAddr::from(([10, 0, 0, 2], 5353))));
        assert_eq!(parse_upstream("fd00::1"), Ok("[fd00::1]:53".parse().unwrap()));
        assert_eq!(parse_upstream("[fd00::1]:54"), Ok("[fd00::1]:54".parse().unwrap()));
        assert!(parse_upstream("resolver.local").is_err());
    }

    #[test]
    fn resolv_conf_nameservers_in_order() {
        let text = "# generated\nsearch svc.cluster.local\nnameserver 10.0.0.2\nnameserver fe80::1%eth0\n\
                    options ndots:5\nnameserver  fd00::53 \n";
        assert_eq!(nameservers(text), vec![SocketAddr::from(([10, 0, 0, 2], 53)), "[fd00::53]:53".parse().unwrap()]);
    }
}

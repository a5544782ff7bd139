//! Name resolution for the control plane's address, the way `/etc/resolv.conf` says, without the C library: the
//! proxy's image is static and has no NSS, so `getaddrinfo` cannot be relied on.
//!
//! Guarantees:
//! * a literal IP address (v4, or v6 without brackets) is used as is: no file is read, no query is sent;
//! * otherwise the resolv.conf file ([`NameResolution::resolv_conf`], default [`DEFAULT_RESOLV_CONF`]) is read
//!   again at every resolution (at most [`MAX_RESOLV_CONF_BYTES`]) and its `nameserver`s, `search` domains (or
//!   `domain`), `options ndots:`, `timeout:` and `attempts:` are applied as glibc would: a name with fewer dots
//!   than `ndots` is tried with each search domain first, then as is; a name ending in `.` is never expanded.
//!   `/etc/hosts` is consulted first, as glibc's `files dns` order does;
//! * queries go over UDP (TCP when truncated) to the nameservers' [`NameResolution::port`] (53; tests change it);
//!   no DNS-over-TLS/HTTPS, so no second TLS stack;
//! * at most [`MAX_ADDRESSES`] addresses are returned, IPv4 before IPv6 (hickory's default strategy); an empty
//!   answer is an error naming the host.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

use hickory_resolver::config::{ResolveHosts, ResolverConfig};
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::Resolver;
use tokio::io::AsyncReadExt;

/// Where resolv.conf is read from.
pub const DEFAULT_RESOLV_CONF: &str = "/etc/resolv.conf";
/// Largest resolv.conf read.
pub const MAX_RESOLV_CONF_BYTES: u64 = 64 * 1024;
/// Most addresses kept from one resolution.
pub const MAX_ADDRESSES: usize = 16;

/// How host names are resolved.
#[derive(Clone, Debug)]
pub struct NameResolution {
    /// The resolv.conf file.
    pub resolv_conf: PathBuf,
    /// The nameservers' port (resolv.conf has no port syntax; 53 but in tests).
    pub port: u16,
}

impl Default for NameResolution {
    fn default() -> Self {
        NameResolution { resolv_conf: PathBuf::from(DEFAULT_RESOLV_CONF), port: 53 }
    }
}

/// Why a host name did not resolve.
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    /// The resolv.conf file could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The resolv.conf file is unusable (too large, no nameserver, a bad search domain).
    #[error("{path}: {reason}")]
    Config {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The lookup failed (no such name, no answer in time, a server failure).
    #[error("resolving {host:?}: {reason}")]
    Lookup {
        /// The name.
        host: String,
        /// Why.
        reason: String,
    },
}

/// The socket addresses of `host:port`; see the module documentation.
pub async fn resolve(host: &str, port: u16, settings: &NameResolution) -> Result<Vec<SocketAddr>, ResolveError> {
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(vec![SocketAddr::new(ip, port)]);
    }
    let resolver = resolver(settings).await?;
    let lookup_err = |reason: String| ResolveError::Lookup { host: host.to_owned(), reason };
    let lookup = resolver.lookup_ip(host).await.map_err(|e| lookup_err(e.to_string()))?;
    let addresses: Vec<SocketAddr> = lookup.iter().take(MAX_ADDRESSES).map(|ip| SocketAddr::new(ip, port)).collect();
    if addresses.is_empty() {
        return Err(lookup_err("no address".into()));
    }
    tracing::debug!(host, ?addresses, "resolved");
    Ok(addresses)
}

async fn resolver(settings: &NameResolution) -> Result<Resolver<TokioRuntimeProvider>, ResolveError> {
    let path = &settings.resolv_conf;
    let read_err = |source| ResolveError::Read { path: path.clone(), source };
    let config_err = |reason: String| ResolveError::Config { path: path.clone(), reason };
    let file = tokio::fs::File::open(path).await.map_err(read_err)?;
    let mut bytes = Vec::new();
    file.take(MAX_RESOLV_CONF_BYTES + 1).read_to_end(&mut bytes).await.map_err(read_err)?;
    if bytes.len() as u64 > MAX_RESOLV_CONF_BYTES {
        return Err(config_err(format!("over {MAX_RESOLV_CONF_BYTES} bytes")));
    }
    let (config, mut options) =
        hickory_resolver::system_conf::parse_resolv_conf(&bytes).map_err(|e| config_err(e.to_string()))?;
    options.use_hosts_file = ResolveHosts::Always;
    let mut name_servers = config.name_servers().to_vec();
    for server in &mut name_servers {
        for connection in &mut server.connections {
            connection.port = settings.port;
        }
    }
    let config = ResolverConfig::from_parts(config.domain().cloned(), config.search().to_vec(), name_servers);
    Resolver::builder_with_config(config, TokioRuntimeProvider::default())
        .with_options(options)
        .build()
        .map_err(|e| config_err(e.to_string()))
}

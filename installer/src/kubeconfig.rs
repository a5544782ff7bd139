//! The kubeconfig the `istio-cni` plugin uses to reach the API server, rendered from the agent's
//! in-cluster environment and service-account files, in the exact shape Istio writes.

use std::fmt;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use base64::Engine as _;

/// Where the kubeconfig's parts come from (`KUBERNETES_SERVICE_*`, `KUBE_CA_FILE`,
/// `SKIP_TLS_VERIFY`, the service-account dir).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KubeconfigSettings {
    /// `KUBERNETES_SERVICE_PROTOCOL`; `https` when unset or empty.
    pub protocol: Option<String>,
    /// `KUBERNETES_SERVICE_HOST`.
    pub host: Option<String>,
    /// `KUBERNETES_SERVICE_PORT`.
    pub port: Option<String>,
    /// `KUBE_CA_FILE`; `<service_account_dir>/ca.crt` when unset.
    pub ca_file: Option<PathBuf>,
    /// `SKIP_TLS_VERIFY`: no CA, `insecure-skip-tls-verify: true` instead.
    pub skip_tls_verify: bool,
    /// The service-account dir holding `token` (and by default `ca.crt`).
    pub service_account_dir: PathBuf,
}

/// A rendered kubeconfig. It embeds the service-account token, so its `Debug` output is redacted
/// and it has no `Display`: only [`Kubeconfig::as_bytes`] reveals it, for writing the file.
#[derive(Clone, PartialEq, Eq)]
pub struct Kubeconfig(String);

impl Kubeconfig {
    /// The file content to write (mode `KUBECONFIG_MODE`).
    pub fn as_bytes(&self) -> &[u8] {
        self.0.as_bytes()
    }
}

impl fmt::Debug for Kubeconfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Kubeconfig(<redacted: contains a service-account token>)")
    }
}

/// Why the kubeconfig cannot be rendered; names the variable or file to fix.
#[derive(Debug, thiserror::Error)]
pub enum KubeconfigError {
    /// `KUBERNETES_SERVICE_HOST` is unset or empty.
    #[error("KUBERNETES_SERVICE_HOST not set. Is this not running within a pod?")]
    HostUnset,
    /// `KUBERNETES_SERVICE_PORT` is unset or empty.
    #[error("KUBERNETES_SERVICE_PORT not set. Is this not running within a pod?")]
    PortUnset,
    /// `KUBERNETES_SERVICE_HOST` holds characters that cannot be part of a host.
    #[error("KUBERNETES_SERVICE_HOST {0:?} is not a valid host")]
    BadHost(String),
    /// `KUBERNETES_SERVICE_PORT` is not a port number.
    #[error("KUBERNETES_SERVICE_PORT {0:?} is not a port number")]
    BadPort(String),
    /// `KUBERNETES_SERVICE_PROTOCOL` is neither `http` nor `https`.
    #[error("KUBERNETES_SERVICE_PROTOCOL {0:?} is not http or https")]
    BadProtocol(String),
    /// The CA file or the token file could not be read.
    #[error("reading {what} {path}: {source}")]
    Read {
        /// Which file: the CA or the token.
        what: &'static str,
        /// The file concerned.
        path: PathBuf,
        /// The underlying I/O error.
        source: io::Error,
    },
    /// The CA file or the token file is empty.
    #[error("{what} {path} is empty")]
    Empty {
        /// Which file: the CA or the token.
        what: &'static str,
        /// The file concerned.
        path: PathBuf,
    },
}

/// Renders the plugin's kubeconfig (server, inlined CA or skip-TLS, the service-account token),
/// byte-identical to Istio's output for the same inputs.
pub fn render(settings: &KubeconfigSettings) -> Result<Kubeconfig, KubeconfigError> {
    let host = settings.host.as_deref().filter(|h| !h.is_empty()).ok_or(KubeconfigError::HostUnset)?;
    let port = settings.port.as_deref().filter(|p| !p.is_empty()).ok_or(KubeconfigError::PortUnset)?;
    let protocol = settings.protocol.as_deref().filter(|p| !p.is_empty()).unwrap_or("https");
    if protocol != "https" && protocol != "http" {
        return Err(KubeconfigError::BadProtocol(protocol.to_owned()));
    }
    let host_ok = host.chars().all(|c| c.is_ascii_alphanumeric() || ".-_:%".contains(c));
    if !host_ok {
        return Err(KubeconfigError::BadHost(host.to_owned()));
    }
    if port.parse::<u16>().is_err() {
        return Err(KubeconfigError::BadPort(port.to_owned()));
    }
    let server = if host.contains(':') {
        format!("{protocol}://[{host}]:{port}")
    } else {
        format!("{protocol}://{host}:{port}")
    };
    let trust = if settings.skip_tls_verify {
        "insecure-skip-tls-verify: true".to_owned()
    } else {
        let default_ca = settings.service_account_dir.join("ca.crt");
        let ca_path = settings.ca_file.as_deref().unwrap_or(&default_ca);
        let ca = read_nonempty("CA file", ca_path)?;
        format!("certificate-authority-data: {}", base64::engine::general_purpose::STANDARD.encode(ca))
    };
    let token_bytes = read_nonempty("service-account token", &settings.service_account_dir.join("token"))?;
    let token = yaml_scalar(String::from_utf8_lossy(&token_bytes).trim_end());
    Ok(Kubeconfig(format!(
        "apiVersion: v1
clusters:
- cluster:
    {trust}
    server: {server}
  name: local
contexts:
- context:
    cluster: local
    user: istio-cni
  name: istio-cni-context
current-context: istio-cni-context
kind: Config
users:
- name: istio-cni
  user:
    token: {token}
"
    )))
}

fn read_nonempty(what: &'static str, path: &Path) -> Result<Vec<u8>, KubeconfigError> {
    let bytes = fs::read(path).map_err(|source| KubeconfigError::Read { what, path: path.to_owned(), source })?;
    if bytes.is_empty() {
        return Err(KubeconfigError::Empty { what, path: path.to_owned() });
    }
    Ok(bytes)
}

/// A token as a YAML scalar: plain when that is unambiguous (JWTs always are), else double-quoted
/// (a JSON string is a valid YAML double-quoted scalar).
fn yaml_scalar(value: &str) -> String {
    let plain = value.starts_with(|c: char| c.is_ascii_alphabetic())
        && value.chars().all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
        && !matches!(
            value.to_ascii_lowercase().as_str(),
            "true" | "false" | "null" | "yes" | "no" | "on" | "off" | "y" | "n"
        );
    if plain {
        value.to_owned()
    } else {
        serde_json::to_string(value).expect("a string always serialises")
    }
}

//! The CNI error object and the spec's well-known error codes.

use serde::{Deserialize, Serialize};

/// Error codes defined by the CNI spec (0–99 are reserved for the spec).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorCode {
    /// 1: the requested cniVersion is not supported.
    IncompatibleVersion = 1,
    /// 2: a field in the network configuration is not supported.
    UnsupportedField = 2,
    /// 3: the container is unknown or does not exist.
    UnknownContainer = 3,
    /// 4: a required environment variable is missing or invalid.
    InvalidEnv = 4,
    /// 5: an I/O failure, such as reading stdin.
    Io = 5,
    /// 6: stdin could not be decoded.
    Decoding = 6,
    /// 7: the network configuration is invalid.
    InvalidConfig = 7,
    /// 11: a transient failure; the runtime should retry later.
    TryAgainLater = 11,
    /// 50: STATUS: the plugin is not available.
    NotAvailable = 50,
    /// 51: STATUS: the plugin is not available and existing containers may be disrupted.
    NotAvailableDisruptive = 51,
    /// 999: a failure that has no spec code (plugin-specific).
    Internal = 999,
}

/// A CNI error as printed on stdout: `{"cniVersion","code","msg","details"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("CNI error {code}: {msg}{}", if details.is_empty() { String::new() } else { format!(" ({details})") })]
pub struct CniError {
    /// Version of the spec the error is reported in.
    #[serde(rename = "cniVersion", default)]
    pub cni_version: String,
    /// Spec or plugin error code.
    pub code: u32,
    /// Short message naming the cause.
    pub msg: String,
    /// Longer details, possibly empty.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub details: String,
}

impl CniError {
    /// Builds an error with a code and message; the version is filled in when it is printed.
    pub fn new(code: ErrorCode, msg: impl Into<String>) -> Self {
        Self { cni_version: String::new(), code: code as u32, msg: msg.into(), details: String::new() }
    }

    /// Adds details (for example the stderr of a failing tool).
    pub fn with_details(mut self, details: impl Into<String>) -> Self {
        self.details = details.into();
        self
    }

    /// Renders the error JSON for stdout, reporting it in `version`.
    pub fn to_json(&self, version: &str) -> String {
        let mut e = self.clone();
        e.cni_version = version.to_string();
        serde_json::to_string(&e).unwrap_or_else(|_| {
            format!(r#"{{"cniVersion":"{version}","code":{},"msg":"unprintable error"}}"#, self.code)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_json_has_spec_fields() {
        let e = CniError::new(ErrorCode::InvalidEnv, "CNI_NETNS is required").with_details("ADD");
        let v: serde_json::Value = serde_json::from_str(&e.to_json("1.0.0")).unwrap();
        assert_eq!(v["cniVersion"], "1.0.0");
        assert_eq!(v["code"], 4);
        assert_eq!(v["msg"], "CNI_NETNS is required");
        assert_eq!(v["details"], "ADD");
    }
}

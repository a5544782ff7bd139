//! Continue tokens of paged lists: the resourceVersion of the first page and where the last page ended,
//! base64-encoded JSON as the real server's (`{"v":"meta.k8s.io/v1","rv":…,"start":…}`).

use crate::status::ApiError;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use serde_json::{json, Value};

/// What a continue token carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Token {
    /// The resourceVersion every page of the list is read at.
    pub rv: u64,
    /// `(namespace, name)` of the last object already returned.
    pub after: (String, String),
}

/// The token's wire form.
pub(crate) fn encode(token: &Token) -> String {
    let (ns, name) = &token.after;
    URL_SAFE_NO_PAD.encode(json!({"v": "meta.k8s.io/v1", "rv": token.rv, "start": format!("{ns}/{name}")}).to_string())
}

/// Reads a token; 400 for anything this server did not hand out.
pub(crate) fn decode(text: &str) -> Result<Token, ApiError> {
    let invalid = || ApiError::bad_request(format!("continue key is not valid: {text:?}"));
    let raw = URL_SAFE_NO_PAD.decode(text.trim_end_matches('=')).map_err(|_| invalid())?;
    let value: Value = serde_json::from_slice(&raw).map_err(|_| invalid())?;
    if value.get("v").and_then(Value::as_str) != Some("meta.k8s.io/v1") {
        return Err(invalid());
    }
    let rv = value.get("rv").and_then(Value::as_u64).ok_or_else(invalid)?;
    let (ns, name) = value.get("start").and_then(Value::as_str).and_then(|s| s.split_once('/')).ok_or_else(invalid)?;
    Ok(Token { rv, after: (ns.to_string(), name.to_string()) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_refuses_junk() {
        let t = Token { rv: 42, after: ("ns".into(), "pod-1".into()) };
        assert_eq!(decode(&encode(&t)), Ok(t));
        let cluster_scoped = Token { rv: 7, after: (String::new(), "node-1".into()) };
        assert_eq!(decode(&encode(&cluster_scoped)), Ok(cluster_scoped));
        for junk in ["ns/pod-1", "e30", "!!"] {
            assert_eq!(decode(junk).map_err(|e| e.code), Err(400), "{junk}");
        }
    }
}

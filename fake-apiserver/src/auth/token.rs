//! Bearer tokens as signed JWTs (HS256), shaped like the apiserver's service-account tokens.
//!
//! Clients treat tokens as opaque strings; the fake only needs to recognise its own. A token names its user
//! and groups, and the subject's token generation at issue time, which rotation retires.

use super::User;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use ring::hmac;
use serde_json::{json, Value};
use std::time::{SystemTime, UNIX_EPOCH};

/// The issuer and audience a real cluster's tokens carry by default.
const ISSUER: &str = "https://kubernetes.default.svc.cluster.local";

/// What a valid token says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Claims {
    /// The user the token authenticates.
    pub user: User,
    /// The subject's token generation when the token was issued.
    pub generation: u64,
}

/// A signed token for `user` at `generation`.
pub(crate) fn sign(key: &hmac::Key, user: &User, generation: u64) -> String {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or_default();
    let mut claims = json!({
        "iss": ISSUER,
        "aud": [ISSUER],
        "sub": user.name,
        "iat": now,
        "nbf": now,
        "jti": crate::ids::new_uid(),
        "fake.groups": user.groups,
        "fake.generation": generation,
    });
    if let Some((namespace, name)) = user.service_account_parts() {
        claims["kubernetes.io"] = json!({"namespace": namespace, "serviceaccount": {"name": name}});
    }
    let header = json!({"alg": "HS256", "typ": "JWT", "kid": "fake-apiserver"});
    let signed =
        format!("{}.{}", URL_SAFE_NO_PAD.encode(header.to_string()), URL_SAFE_NO_PAD.encode(claims.to_string()));
    let tag = hmac::sign(key, signed.as_bytes());
    format!("{signed}.{}", URL_SAFE_NO_PAD.encode(tag.as_ref()))
}

/// The claims of `token` when `key` signed it, `None` for anything else.
pub(crate) fn verify(key: &hmac::Key, token: &str) -> Option<Claims> {
    let (signed, tag) = token.rsplit_once('.')?;
    let tag = URL_SAFE_NO_PAD.decode(tag).ok()?;
    hmac::verify(key, signed.as_bytes(), &tag).ok()?;
    let (_, payload) = signed.split_once('.')?;
    let claims: Value = serde_json::from_slice(&URL_SAFE_NO_PAD.decode(payload).ok()?).ok()?;
    let name = claims.get("sub")?.as_str()?.to_string();
    let groups = claims
        .get("fake.groups")?
        .as_array()?
        .iter()
        .map(|g| g.as_str().map(str::to_string))
        .collect::<Option<Vec<_>>>()?;
    let generation = claims.get("fake.generation")?.as_u64()?;
    Some(Claims { user: User { name, groups }, generation })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_tampering() {
        let key = hmac::Key::new(hmac::HMAC_SHA256, b"0123456789abcdef0123456789abcdef");
        let user = User::service_account("istio-system", "istio-cni");
        let token = sign(&key, &user, 3);
        assert_eq!(verify(&key, &token), Some(Claims { user: user.clone(), generation: 3 }));
        assert_ne!(sign(&key, &user, 3), token, "every token is distinct");
        let other = hmac::Key::new(hmac::HMAC_SHA256, b"another key, another cluster....");
        assert_eq!(verify(&other, &token), None);
        let (head, rest) = token.split_once('.').unwrap();
        let (_, sig) = rest.rsplit_once('.').unwrap();
        let forged = URL_SAFE_NO_PAD.encode(r#"{"sub":"admin","fake.groups":["system:masters"],"fake.generation":3}"#);
        assert_eq!(verify(&key, &format!("{head}.{forged}.{sig}")), None);
        for junk in ["", "a.b", "a.b.c", "fake-token"] {
            assert_eq!(verify(&key, junk), None, "{junk}");
        }
    }
}

//! Test endpoints under `/fake/`, for tests that run the binary: the same controls the library offers.
//! They need no token and are not recorded in the request log (a real server has no such paths).
//!
//! The table of endpoints is in the crate docs.

use crate::auth::User;
use crate::cluster::{Cluster, Throttle};
use crate::routes::{error_response, json_response};
use crate::status::ApiError;
use crate::watch::Body;
use hyper::{Method, Response};
use serde_json::{json, Value};

/// Whether `path` is one of the test endpoints.
pub(crate) fn is_debug(path: &str) -> bool {
    path == "/fake" || path.starts_with("/fake/")
}

fn user_of(body: &Value) -> Result<User, ApiError> {
    if let Some(sa) = body.get("serviceAccount").and_then(Value::as_str) {
        let (ns, name) = sa.split_once('/').ok_or_else(|| ApiError::bad_request("serviceAccount is NAMESPACE/NAME"))?;
        return Ok(User::service_account(ns, name));
    }
    let name = body.get("user").and_then(Value::as_str).ok_or_else(|| ApiError::bad_request("no user"))?;
    let groups: Vec<&str> = body
        .get("groups")
        .and_then(Value::as_array)
        .map(|g| g.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    Ok(User::new(name, &groups))
}

fn throttle_of(body: &Value) -> Result<Throttle, ApiError> {
    let retry_after_seconds =
        body.get("retryAfterSeconds").and_then(Value::as_u64).unwrap_or(1).try_into().unwrap_or(u32::MAX);
    if let Some(n) = body.get("next").and_then(Value::as_u64) {
        return Ok(Throttle::Next { count: n.try_into().unwrap_or(u32::MAX), retry_after_seconds });
    }
    match body.get("fraction").and_then(Value::as_f64) {
        Some(fraction) if (0.0..=1.0).contains(&fraction) => Ok(Throttle::Fraction { fraction, retry_after_seconds }),
        _ => Err(ApiError::bad_request("throttle needs \"next\": N or \"fraction\": 0..1")),
    }
}

/// Answers one test-endpoint request.
pub(crate) fn handle(cluster: &Cluster, method: &Method, path: &str, body: &[u8]) -> Response<Body> {
    let body: Value = if body.is_empty() { Value::Null } else { serde_json::from_slice(body).unwrap_or(Value::Null) };
    let done = || json_response(200, &json!({}));
    let result = match (method, path.trim_end_matches('/')) {
        (&Method::GET, "/fake/requests") => Ok(json_response(200, &json!(cluster.requests()))),
        (&Method::DELETE, "/fake/requests") => {
            cluster.clear_requests();
            Ok(done())
        }
        (&Method::PUT, "/fake/throttle") => throttle_of(&body).map(|t| {
            cluster.set_throttle(Some(t));
            done()
        }),
        (&Method::DELETE, "/fake/throttle") => {
            cluster.set_throttle(None);
            Ok(done())
        }
        (&Method::POST, "/fake/tokens") => {
            user_of(&body).map(|u| json_response(200, &json!({"token": cluster.token_for(&u)})))
        }
        (&Method::POST, "/fake/tokens/rotate") => user_of(&body).and_then(|u| {
            let token = cluster.rotate_token(&u).map_err(|e| ApiError::bad_request(e.to_string()))?;
            Ok(json_response(200, &json!({"token": token})))
        }),
        (&Method::POST, "/fake/compact") => {
            cluster.compact();
            Ok(done())
        }
        (&Method::POST, "/fake/drop-watches") => {
            cluster.drop_watches();
            Ok(done())
        }
        _ => Err(ApiError::no_route(path)),
    };
    result.unwrap_or_else(|e| error_response(&e))
}

//! API errors and their wire form, the `Status` object the real apiserver returns on failure.

use crate::kinds::ResourceKind;
use serde_json::{json, Value};

/// A failed API operation; rendered as a `Status` body with `code` as the HTTP status.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ApiError {
    pub code: u16,
    pub reason: &'static str,
    pub message: String,
    details: Option<Value>,
}

fn details(kind: &ResourceKind, name: &str) -> Option<Value> {
    let mut d = json!({"name": name, "kind": kind.plural});
    if !kind.group.is_empty() {
        d["group"] = json!(kind.group);
    }
    Some(d)
}

impl ApiError {
    pub fn not_found(kind: &ResourceKind, name: &str) -> ApiError {
        ApiError {
            code: 404,
            reason: "NotFound",
            message: format!("{} \"{name}\" not found", kind.plural),
            details: details(kind, name),
        }
    }

    pub fn already_exists(kind: &ResourceKind, name: &str) -> ApiError {
        ApiError {
            code: 409,
            reason: "AlreadyExists",
            message: format!("{} \"{name}\" already exists", kind.plural),
            details: details(kind, name),
        }
    }

    pub fn conflict(kind: &ResourceKind, name: &str, why: &str) -> ApiError {
        ApiError {
            code: 409,
            reason: "Conflict",
            message: format!("Operation cannot be fulfilled on {} \"{name}\": {why}", kind.plural),
            details: details(kind, name),
        }
    }

    pub fn stale(kind: &ResourceKind, name: &str) -> ApiError {
        ApiError::conflict(
            kind,
            name,
            "the object has been modified; please apply your changes to the latest version and try again",
        )
    }

    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError { code: 400, reason: "BadRequest", message: message.into(), details: None }
    }

    pub fn expired(requested: u64, oldest: u64) -> ApiError {
        ApiError {
            code: 410,
            reason: "Expired",
            message: format!("too old resource version: {requested} ({oldest})"),
            details: None,
        }
    }

    pub fn unsupported_media_type(content_type: &str) -> ApiError {
        ApiError {
            code: 415,
            reason: "UnsupportedMediaType",
            message: format!("the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml; got {content_type:?}"),
            details: None,
        }
    }

    pub fn method_not_allowed(method: &str) -> ApiError {
        ApiError {
            code: 405,
            reason: "MethodNotAllowed",
            message: format!("the server does not allow this method on the requested resource: {method}"),
            details: None,
        }
    }

    pub fn no_route(path: &str) -> ApiError {
        ApiError {
            code: 404,
            reason: "NotFound",
            message: format!("the server could not find the requested resource (path {path})"),
            details: None,
        }
    }

    /// The error an injected `Fault::Status(code)` produces.
    pub fn injected(code: u16) -> ApiError {
        let reason = match code {
            400 => "BadRequest",
            401 => "Unauthorized",
            403 => "Forbidden",
            404 => "NotFound",
            409 => "Conflict",
            410 => "Expired",
            429 => "TooManyRequests",
            500 => "InternalError",
            503 => "ServiceUnavailable",
            504 => "Timeout",
            _ => "Unknown",
        };
        ApiError { code, reason, message: format!("injected fault: HTTP {code}"), details: None }
    }

    /// The `Status` object describing this error.
    pub fn to_status(&self) -> Value {
        let mut s = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        });
        if let Some(d) = &self.details {
            s["details"] = d.clone();
        }
        s
    }
}

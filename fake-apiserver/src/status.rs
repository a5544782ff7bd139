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

/// `StatusDetails` as the real server writes it: empty fields left out, `group` before `kind`.
pub(crate) fn details_of(name: &str, group: &str, kind: &str) -> Value {
    let mut d = serde_json::Map::new();
    for (field, value) in [("name", name), ("group", group), ("kind", kind)] {
        if !value.is_empty() {
            d.insert(field.to_string(), json!(value));
        }
    }
    Value::Object(d)
}

fn details(kind: &ResourceKind, name: &str) -> Option<Value> {
    Some(details_of(name, kind.group, kind.plural))
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

    /// A watch or continue token naming a version this server never handed out (only with expiry of
    /// unissued versions), 410 like an expired one so that clients relist.
    pub fn unissued(requested: u64, newest: u64) -> ApiError {
        ApiError {
            code: 410,
            reason: "Expired",
            message: format!("too old resource version: {requested} was never issued by this server (newest {newest})"),
            details: None,
        }
    }

    /// A continue token whose resourceVersion left the history: the real server's words.
    pub fn continue_expired() -> ApiError {
        ApiError {
            code: 410,
            reason: "Expired",
            message: "The provided continue parameter is too old to display a consistent list result. You can start \
                      a new list without the continue parameter."
                .to_string(),
            details: None,
        }
    }

    /// 415 for a body in a format the endpoint does not take (the real server does not name it).
    pub fn unsupported_media_type() -> ApiError {
        ApiError {
            code: 415,
            reason: "UnsupportedMediaType",
            // The real server's words whatever the type (kube-apiserver v1.34).
            message: "415: Unsupported Media Type".to_string(),
            details: Some(json!({})),
        }
    }

    /// 422 for a request the server understood but cannot apply (a patch that does not fit, a directive the
    /// fake does not implement).
    pub fn unprocessable(message: impl Into<String>) -> ApiError {
        ApiError { code: 422, reason: "Invalid", message: message.into(), details: None }
    }

    /// 422 for an object that fails validation (the details name the kind, not the resource, as the real
    /// server's).
    pub fn invalid(kind: &ResourceKind, name: &str, why: &str) -> ApiError {
        ApiError {
            code: 422,
            reason: "Invalid",
            message: format!("{} \"{name}\" is invalid: {why}", kind.kind),
            details: Some(details_of(name, kind.group, kind.kind)),
        }
    }

    /// 422 for a pod update that changes its spec beyond what the real server lets change (the real message
    /// then adds a diff of the two specs, which this one leaves out).
    pub fn pod_spec_forbidden(kind: &ResourceKind, name: &str) -> ApiError {
        let why = "Forbidden: pod updates may not change fields other than `spec.containers[*].image`,\
                   `spec.initContainers[*].image`,`spec.activeDeadlineSeconds`,`spec.tolerations` (only additions \
                   to existing tolerations),`spec.terminationGracePeriodSeconds` (allow it to be set to 1 if it was \
                   previously negative)";
        let mut e = ApiError::invalid(kind, name, &format!("spec: {why}"));
        if let Some(d) = e.details.as_mut() {
            d["causes"] = json!([{"reason": "FieldValueForbidden", "message": why, "field": "spec"}]);
        }
        e
    }

    /// 401 for a request without a valid bearer token.
    pub fn unauthorized() -> ApiError {
        ApiError { code: 401, reason: "Unauthorized", message: "Unauthorized".to_string(), details: None }
    }

    /// 403 with the real server's message and details.
    pub fn forbidden(message: String, details: Option<Value>) -> ApiError {
        ApiError { code: 403, reason: "Forbidden", message, details }
    }

    /// 429 as API priority and fairness answers it.
    pub fn too_many_requests(retry_after_seconds: u32) -> ApiError {
        ApiError {
            code: 429,
            reason: "TooManyRequests",
            message: "Too many requests, please try again later.".to_string(),
            details: Some(json!({"retryAfterSeconds": retry_after_seconds})),
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

    /// The `Status` object describing this error, its fields in the real server's order.
    pub fn to_status(&self) -> Value {
        let mut s = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
        });
        if let Some(d) = &self.details {
            s["details"] = d.clone();
        }
        s["code"] = json!(self.code);
        s
    }
}

//! PATCH in its four flavours, each with the real server's semantics:
//!
//! - `application/merge-patch+json`: RFC 7386 (objects merge, `null` deletes, lists are replaced);
//! - `application/strategic-merge-patch+json`: lists with a merge key (containers by `name`, conditions by
//!   `type`, ...) merge element by element, `$patch` (`merge`, `replace`, `delete`), `$retainKeys`,
//!   `$deleteFromPrimitiveList/<field>` and `$setElementOrder/<field>` directives (see [`strategic`]);
//!   an unknown directive gets 422;
//! - `application/json-patch+json`: RFC 6902 operations; one that fails (a `test`, a missing path) gets 422;
//! - `application/apply-patch+yaml` (server-side apply): approximated as a strategic merge of the applied
//!   configuration that creates a missing object; field ownership is not tracked.
//!
//! Any other content type gets 415, as on the real server.

mod schema;
mod strategic;

use crate::kinds::ResourceKind;
use crate::status::ApiError;
use serde_json::Value;

/// The patch flavour, from the request's content type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PatchType {
    /// RFC 7386 JSON merge patch.
    Merge,
    /// Kubernetes strategic merge patch.
    Strategic,
    /// RFC 6902 JSON patch.
    Json,
    /// Server-side apply.
    Apply,
}

impl PatchType {
    /// The flavour a `Content-Type` names; 415 for anything else.
    pub fn from_content_type(content_type: &str) -> Result<PatchType, ApiError> {
        match content_type.split(';').next().unwrap_or_default().trim() {
            "application/merge-patch+json" => Ok(PatchType::Merge),
            "application/strategic-merge-patch+json" => Ok(PatchType::Strategic),
            "application/json-patch+json" => Ok(PatchType::Json),
            "application/apply-patch+yaml" => Ok(PatchType::Apply),
            other => {
                tracing::debug!(content_type = other, "unsupported patch content type");
                Err(ApiError::unsupported_media_type())
            }
        }
    }
}

/// A decoded patch body.
#[derive(Debug, Clone)]
pub(crate) enum Parsed {
    /// A merge, strategic or apply document.
    Document(Value),
    /// JSON patch operations.
    Operations(json_patch::Patch),
}

/// Decodes a patch body of flavour `ty`; 400 when it is not what the flavour requires.
pub(crate) fn parse(ty: PatchType, body: &[u8]) -> Result<Parsed, ApiError> {
    let bad = |e: &dyn std::fmt::Display| ApiError::bad_request(format!("invalid patch body: {e}"));
    match ty {
        PatchType::Json => serde_json::from_slice(body).map(Parsed::Operations).map_err(|e| bad(&e)),
        PatchType::Apply => serde_yaml::from_slice(body).map(Parsed::Document).map_err(|e| bad(&e)),
        PatchType::Merge | PatchType::Strategic => {
            serde_json::from_slice(body).map(Parsed::Document).map_err(|e| bad(&e))
        }
    }
}

/// `original` with `patch` applied.
pub(crate) fn apply(kind: &ResourceKind, ty: PatchType, original: &Value, patch: &Parsed) -> Result<Value, ApiError> {
    let mut doc = original.clone();
    match (ty, patch) {
        (PatchType::Json, Parsed::Operations(ops)) => {
            json_patch::patch(&mut doc, ops).map_err(|e| ApiError::unprocessable(format!("json patch: {e}")))?;
        }
        (PatchType::Merge, Parsed::Document(p)) => {
            if !p.is_object() {
                return Err(ApiError::bad_request("a merge patch must be a JSON object"));
            }
            json_patch::merge(&mut doc, p);
        }
        (PatchType::Strategic | PatchType::Apply, Parsed::Document(p)) => {
            doc = strategic::merge(kind.kind, original, p).map_err(ApiError::unprocessable)?;
        }
        _ => return Err(ApiError::bad_request("the patch body does not match its content type")),
    }
    Ok(doc)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kinds::by_name;
    use serde_json::json;

    fn run(ty: PatchType, original: Value, patch: &str) -> Result<Value, ApiError> {
        apply(by_name("Pod").unwrap(), ty, &original, &parse(ty, patch.as_bytes())?)
    }

    #[test]
    fn merge_patch_is_rfc7386() {
        let doc = json!({"a": "b", "c": {"d": "e", "f": "g"}, "l": [1, 2]});
        let out = run(PatchType::Merge, doc, r#"{"a": "z", "c": {"f": null, "h": 1}, "l": [3]}"#).unwrap();
        assert_eq!(out, json!({"a": "z", "c": {"d": "e", "h": 1}, "l": [3]}));
        assert_eq!(run(PatchType::Merge, json!({}), "[1]").unwrap_err().code, 400);
    }

    #[test]
    fn json_patch_is_rfc6902() {
        let doc = json!({"metadata": {"labels": {"a": "1"}}, "spec": {"containers": [{"name": "x"}]}});
        let ops = r#"[{"op": "add", "path": "/metadata/labels/b", "value": "2"},
                      {"op": "remove", "path": "/metadata/labels/a"},
                      {"op": "add", "path": "/spec/containers/-", "value": {"name": "y"}},
                      {"op": "test", "path": "/spec/containers/0/name", "value": "x"}]"#;
        let out = run(PatchType::Json, doc.clone(), ops).unwrap();
        assert_eq!(
            out,
            json!({"metadata": {"labels": {"b": "2"}}, "spec": {"containers": [{"name": "x"}, {"name": "y"}]}})
        );
        let failing = r#"[{"op": "test", "path": "/spec/containers/0/name", "value": "nope"}]"#;
        assert_eq!(run(PatchType::Json, doc.clone(), failing).unwrap_err().code, 422);
        assert_eq!(run(PatchType::Json, doc, r#"{"op": "add"}"#).unwrap_err().code, 400);
    }

    #[test]
    fn unknown_content_types_are_refused() {
        assert_eq!(PatchType::from_content_type("application/json").unwrap_err().code, 415);
        assert_eq!(PatchType::from_content_type("application/json-patch+json; charset=utf-8"), Ok(PatchType::Json));
    }
}

//! JSON merge patch (RFC 7386), used for every PATCH flavour the fake accepts.

use serde_json::Value;

/// Applies `patch` to `target` in place: objects merge recursively, `null` deletes, anything else replaces.
pub(crate) fn merge_patch(target: &mut Value, patch: &Value) {
    let Value::Object(patch_map) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(serde_json::Map::new());
    }
    if let Value::Object(target_map) = target {
        for (key, value) in patch_map {
            if value.is_null() {
                target_map.remove(key);
            } else {
                merge_patch(target_map.entry(key.clone()).or_insert(Value::Null), value);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn rfc7386_examples() {
        let mut doc = json!({"a": "b", "c": {"d": "e", "f": "g"}, "l": [1, 2]});
        merge_patch(&mut doc, &json!({"a": "z", "c": {"f": null, "h": 1}, "l": [3]}));
        assert_eq!(doc, json!({"a": "z", "c": {"d": "e", "h": 1}, "l": [3]}));

        let mut scalar = json!({"a": 1});
        merge_patch(&mut scalar, &json!({"a": {"b": null, "c": 2}}));
        assert_eq!(scalar, json!({"a": {"c": 2}}));
    }
}

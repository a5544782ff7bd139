//! Seed files: the initial objects of a fake cluster, as multi-document YAML, a JSON array or a `List`.

use crate::Error;
use serde::Deserialize;
use serde_json::Value;

/// Expands `List`-shaped values (anything with an `items` array) into their items.
fn flatten(value: Value, out: &mut Vec<Value>) {
    match value {
        Value::Null => {}
        Value::Array(items) => items.into_iter().for_each(|i| flatten(i, out)),
        Value::Object(mut map) if map.get("items").is_some_and(Value::is_array) => {
            if let Some(Value::Array(items)) = map.remove("items") {
                items.into_iter().for_each(|i| flatten(i, out));
            }
        }
        other => out.push(other),
    }
}

/// Parses seed text into individual Kubernetes objects (JSON is tried first, then multi-document YAML).
pub fn parse_objects(text: &str) -> Result<Vec<Value>, Error> {
    let mut out = Vec::new();
    if let Ok(value) = serde_json::from_str::<Value>(text) {
        flatten(value, &mut out);
        return Ok(out);
    }
    for doc in serde_yaml::Deserializer::from_str(text) {
        let value = Value::deserialize(doc).map_err(|e| Error::ParseSeed(e.to_string()))?;
        flatten(value, &mut out);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yaml_json_and_lists() {
        let yaml =
            "kind: Pod\nmetadata: {name: a}\n---\n---\nkind: List\nitems:\n- kind: Node\n  metadata: {name: n}\n";
        let objs = parse_objects(yaml).unwrap();
        assert_eq!(objs.len(), 2);
        assert_eq!(objs[1]["kind"], "Node");
        let json = r#"[{"kind":"Pod","metadata":{"name":"a"}},{"kind":"PodList","items":[{"kind":"Pod"}]}]"#;
        assert_eq!(parse_objects(json).unwrap().len(), 2);
        assert!(parse_objects("a: [").is_err());
    }
}

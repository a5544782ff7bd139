//! Strategic merge patch, the subset of apimachinery's semantics the served kinds need.
//!
//! Maps merge recursively and `null` deletes a field. Lists follow [`list_strategy`]: keyed lists merge element
//! by element (an element of the patch updates the original element with the same key or is appended),
//! primitive merge lists are a set union, all others are replaced. Directives: `$patch: replace` (a map or a
//! keyed list, given as an element `{"$patch": "replace"}`, is replaced instead of merged), `$patch: delete`
//! (a map field, or a keyed list element), `$patch: merge`, `$retainKeys`, `$deleteFromPrimitiveList/<f>` and
//! `$setElementOrder/<f>` (the listed elements first, in that order, then the others as they were). Any other
//! `$` key is refused.

use super::schema::{list_strategy, ListStrategy};
use serde_json::{Map, Value};

type Result<T> = std::result::Result<T, String>;

/// `original` with the strategic merge `patch` applied, for an object of `kind`.
pub(crate) fn merge(kind: &str, original: &Value, patch: &Value) -> Result<Value> {
    let Value::Object(patch) = patch else { return Err("a strategic merge patch must be a JSON object".into()) };
    let empty = Map::new();
    let original = original.as_object().unwrap_or(&empty);
    merge_map(kind, &[], original, patch).map(Value::Object)
}

fn directive(map: &Map<String, Value>) -> Option<&str> {
    map.get("$patch").and_then(Value::as_str)
}

fn child<'a>(path: &[&'a str], key: &'a str) -> Vec<&'a str> {
    let mut p = path.to_vec();
    p.push(key);
    p
}

fn merge_map<'a>(
    kind: &str,
    path: &[&'a str],
    original: &Map<String, Value>,
    patch: &'a Map<String, Value>,
) -> Result<Map<String, Value>> {
    match patch.get("$patch") {
        None => {}
        Some(Value::String(d)) if d == "merge" => {}
        Some(Value::String(d)) if d == "replace" => return merge_map(kind, path, &Map::new(), &without_patch(patch)),
        Some(Value::String(d)) if d == "delete" => return Ok(Map::new()),
        Some(other) => return Err(format!("unknown patch type: {other} in map: {}", Value::Object(patch.clone()))),
    }
    let mut result = original.clone();
    let mut deletions = Vec::new();
    let mut orders = Vec::new();
    for (key, value) in patch {
        if key == "$patch" || key == "$retainKeys" {
            continue;
        }
        if let Some(field) = key.strip_prefix("$deleteFromPrimitiveList/") {
            deletions.push((field, value));
            continue;
        }
        if let Some(field) = key.strip_prefix("$setElementOrder/") {
            orders.push((field, value));
            continue;
        }
        if key.starts_with('$') {
            return Err(format!("unsupported strategic merge patch directive {key:?}"));
        }
        let path = child(path, key);
        match value {
            Value::Null => {
                result.remove(key);
            }
            Value::Object(p) if directive(p) == Some("delete") => {
                result.remove(key);
            }
            Value::Object(p) => {
                let empty = Map::new();
                let o = result.get(key).and_then(Value::as_object).unwrap_or(&empty);
                let merged = merge_map(kind, &path, o, p)?;
                result.insert(key.clone(), Value::Object(merged));
            }
            Value::Array(p) => {
                let o = result.get(key).and_then(Value::as_array).cloned().unwrap_or_default();
                result.insert(key.clone(), Value::Array(merge_list(kind, &path, &o, p)?));
            }
            scalar => {
                result.insert(key.clone(), scalar.clone());
            }
        }
    }
    for (field, values) in deletions {
        let values = values.as_array().ok_or_else(|| format!("$deleteFromPrimitiveList/{field} must be a list"))?;
        if let Some(Value::Array(list)) = result.get_mut(field) {
            list.retain(|v| !values.contains(v));
        }
    }
    for (field, order) in orders {
        let order = order.as_array().ok_or_else(|| format!("$setElementOrder/{field} must be a list"))?;
        let strategy = list_strategy(kind, &child(path, field));
        if let Some(Value::Array(list)) = result.get_mut(field) {
            set_order(list, order, strategy);
        }
    }
    if let Some(retain) = patch.get("$retainKeys") {
        let keys: Vec<&str> = retain
            .as_array()
            .and_then(|a| a.iter().map(Value::as_str).collect())
            .ok_or_else(|| "$retainKeys must be a list of strings".to_string())?;
        result.retain(|k, _| keys.contains(&k.as_str()));
    }
    Ok(result)
}

fn without_patch(map: &Map<String, Value>) -> Map<String, Value> {
    map.iter().filter(|(k, _)| *k != "$patch").map(|(k, v)| (k.clone(), v.clone())).collect()
}

/// A patch value with its directives resolved, as when it lands where the original had nothing.
fn fresh(kind: &str, path: &[&str], value: &Value) -> Result<Value> {
    match value {
        Value::Object(p) => merge_map(kind, path, &Map::new(), p).map(Value::Object),
        Value::Array(p) => merge_list(kind, path, &[], p).map(Value::Array),
        other => Ok(other.clone()),
    }
}

fn merge_list(kind: &str, path: &[&str], original: &[Value], patch: &[Value]) -> Result<Vec<Value>> {
    let is_replace = |v: &Value| v.as_object().is_some_and(|m| directive(m) == Some("replace") && m.len() == 1);
    if patch.iter().any(is_replace) {
        return patch.iter().filter(|v| !is_replace(v)).map(|v| fresh(kind, path, v)).collect();
    }
    match list_strategy(kind, path) {
        ListStrategy::Replace => patch.iter().map(|v| fresh(kind, path, v)).collect(),
        ListStrategy::MergePrimitives => {
            let mut out = original.to_vec();
            for v in patch {
                if v.is_object() || v.is_array() {
                    return Err(format!("list {} merges as a set of scalars, got {v}", path.join(".")));
                }
                if !out.contains(v) {
                    out.push(v.clone());
                }
            }
            Ok(out)
        }
        ListStrategy::MergeByKey(key) => {
            let mut out = original.to_vec();
            for element in patch {
                let Value::Object(p) = element else {
                    return Err(format!("list {} holds maps merged by {key:?}, got {element}", path.join(".")));
                };
                let Some(id) = p.get(key) else {
                    return Err(format!("map: {element} does not contain declared merge key: {key}"));
                };
                if directive(p) == Some("delete") {
                    out.retain(|o| o.get(key) != Some(id));
                    continue;
                }
                match out.iter().position(|o| o.get(key) == Some(id)) {
                    Some(i) => {
                        let empty = Map::new();
                        let o = out[i].as_object().unwrap_or(&empty);
                        out[i] = Value::Object(merge_map(kind, path, o, p)?);
                    }
                    None => out.push(Value::Object(merge_map(kind, path, &Map::new(), p)?)),
                }
            }
            Ok(out)
        }
    }
}

/// Moves the elements named in `order` to the front, in that order; the rest keep their relative order.
fn set_order(list: &mut Vec<Value>, order: &[Value], strategy: ListStrategy) {
    let id = |v: &Value| -> Value {
        match strategy {
            ListStrategy::MergeByKey(key) => v.get(key).cloned().unwrap_or(Value::Null),
            _ => v.clone(),
        }
    };
    let wanted: Vec<Value> = order.iter().map(id).collect();
    let mut rest = std::mem::take(list);
    for w in &wanted {
        if let Some(i) = rest.iter().position(|v| id(v) == *w) {
            list.push(rest.remove(i));
        }
    }
    list.append(&mut rest);
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod() -> Value {
        json!({
            "metadata": {"name": "p", "finalizers": ["a"], "labels": {"x": "1", "y": "2"}},
            "spec": {
                "containers": [
                    {"name": "app", "image": "app:1", "env": [{"name": "A", "value": "1"}]},
                    {"name": "istio-proxy", "image": "proxy:1"}
                ],
                "tolerations": [{"key": "t1"}]
            }
        })
    }

    #[test]
    fn keyed_lists_merge_by_name() {
        let patch = json!({"spec": {"containers": [
            {"name": "app", "image": "app:2", "env": [{"name": "B", "value": "2"}]},
            {"name": "new", "image": "new:1"}
        ], "tolerations": [{"key": "t2"}]}});
        let out = merge("Pod", &pod(), &patch).unwrap();
        assert_eq!(
            out["spec"]["containers"],
            json!([
                {"name": "app", "image": "app:2", "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]},
                {"name": "istio-proxy", "image": "proxy:1"},
                {"name": "new", "image": "new:1"}
            ])
        );
        assert_eq!(out["spec"]["tolerations"], json!([{"key": "t2"}]), "a list without a merge key is replaced");
    }

    #[test]
    fn directives() {
        let delete = json!({"spec": {"containers": [{"name": "istio-proxy", "$patch": "delete"}]}});
        let out = merge("Pod", &pod(), &delete).unwrap();
        assert_eq!(out["spec"]["containers"].as_array().unwrap().len(), 1);

        let replace = json!({"spec": {"containers": [{"$patch": "replace"}, {"name": "only"}]}});
        assert_eq!(merge("Pod", &pod(), &replace).unwrap()["spec"]["containers"], json!([{"name": "only"}]));

        let map_replace = json!({"metadata": {"labels": {"$patch": "replace", "z": "3"}}});
        assert_eq!(merge("Pod", &pod(), &map_replace).unwrap()["metadata"]["labels"], json!({"z": "3"}));

        let map_delete = json!({"metadata": {"labels": {"$patch": "delete"}}});
        assert!(merge("Pod", &pod(), &map_delete).unwrap()["metadata"].get("labels").is_none());

        let finalizers = json!({"metadata": {"finalizers": ["b", "a"], "$deleteFromPrimitiveList/finalizers": ["a"]}});
        assert_eq!(merge("Pod", &pod(), &finalizers).unwrap()["metadata"]["finalizers"], json!(["b"]));

        let retain = json!({"metadata": {"$retainKeys": ["name"], "labels": {"q": "1"}}});
        assert_eq!(merge("Pod", &pod(), &retain).unwrap()["metadata"], json!({"name": "p"}));

        let order = json!({"spec": {"$setElementOrder/containers": [{"name": "istio-proxy"}, {"name": "app"}]}});
        let out = merge("Pod", &pod(), &order).unwrap();
        assert_eq!(out["spec"]["containers"][0]["name"], "istio-proxy");
    }

    #[test]
    fn refuses_what_it_cannot_do() {
        let missing_key = json!({"spec": {"containers": [{"image": "x"}]}});
        assert!(merge("Pod", &pod(), &missing_key).unwrap_err().contains("merge key: name"));
        let unknown = json!({"spec": {"$weird": 1}});
        assert!(merge("Pod", &pod(), &unknown).is_err());
        assert!(merge("Pod", &pod(), &json!({"metadata": {"$patch": "explode"}})).is_err());
        assert!(merge("Pod", &pod(), &json!([1])).is_err());
    }
}

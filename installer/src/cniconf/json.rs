//! Pure byte-in/byte-out transforms of CNI config files, in Istio's output format.

use serde_json::{Map, Value};

use super::entry::{PluginEntry, CNI_VERSION, PLUGIN_TYPE};
use super::error::Malformed;

/// Name of the list a single-plugin `.conf` is wrapped into (Istio's choice).
const WRAPPED_LIST_NAME: &str = "k8s-pod-network";

/// How libcni reads a config file, from its name: only a `.conflist` is read as a list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConfForm {
    /// `.conf` / `.json`: one plugin, which must have a `type`.
    Single,
    /// `.conflist`: a list; a top-level `type` means nothing there.
    List,
}

impl ConfForm {
    /// The form libcni gives the file at `path`.
    pub fn of(path: &std::path::Path) -> Self {
        if path.extension().is_some_and(|e| e == "conflist") {
            ConfForm::List
        } else {
            ConfForm::Single
        }
    }
}

/// Merges our entry into an existing config: a single-plugin config is wrapped into a list named
/// `k8s-pod-network` with cniVersion `0.3.1`, keeping every field of the original plugin but its
/// `cniVersion`; in a list every existing `istio-cni` entry is removed and ours appended last.
/// A file is single when libcni reads it so (`form` is [`ConfForm::Single`]) and it has a top-level
/// `type`; a single-form file without one is taken as a list, so a list in an oddly named file works.
/// Istio decides by `type` alone, so a `.conflist` with a stray top-level `type` gets wrapped whole
/// as one plugin of that type: the node's network breaks. The form keeps that list a list. Output: canonical JSON (see
/// [`standalone`] for the one exception).
pub fn insert(existing: &[u8], entry: &PluginEntry, form: ConfForm) -> Result<Vec<u8>, Malformed> {
    let mut map = parse_object(existing)?;
    let ours = entry.to_list_json();
    let list = if form == ConfForm::Single && map.contains_key("type") {
        map.shift_remove("cniVersion");
        let mut list = Map::new();
        list.insert("cniVersion".into(), Value::from(CNI_VERSION));
        list.insert("name".into(), Value::from(WRAPPED_LIST_NAME));
        list.insert("plugins".into(), Value::Array(vec![Value::Object(map), ours]));
        list
    } else {
        let plugins = without_ours(&mut map)?;
        plugins.push(ours);
        map
    };
    Ok(canonical(Value::Object(list)))
}

/// Removes every `istio-cni` entry from a config list and re-serialises it canonically, for
/// cleanup. A list written by Istio or by us comes back byte-identical apart from our entry.
pub fn remove_entry(existing: &[u8]) -> Result<Vec<u8>, Malformed> {
    let mut map = parse_object(existing)?;
    without_ours(&mut map)?;
    Ok(canonical(Value::Object(map)))
}

/// The standalone config for `CHAINED_CNI_PLUGIN=false`: our entry alone, keys in Istio's struct
/// order (not sorted), 2-space indented, trailing newline.
pub fn standalone(entry: &PluginEntry) -> Vec<u8> {
    pretty(&entry.to_json())
}

/// Parses a config file's bytes as a JSON object.
pub(crate) fn parse_object(bytes: &[u8]) -> Result<Map<String, Value>, Malformed> {
    match serde_json::from_slice(bytes)? {
        Value::Object(map) => Ok(map),
        _ => Err(Malformed::NotObject),
    }
}

/// The `plugins` array of a list, checked to hold only objects.
pub(crate) fn plugins(map: &Map<String, Value>) -> Result<&Vec<Value>, Malformed> {
    match map.get("plugins") {
        Some(Value::Array(plugins)) => all_objects(plugins).map(|()| plugins),
        _ => Err(Malformed::NoPluginList),
    }
}

/// Tells whether a plugin object is an `istio-cni` entry.
pub(crate) fn is_ours(plugin: &Value) -> bool {
    plugin.get("type").and_then(Value::as_str) == Some(PLUGIN_TYPE)
}

fn without_ours(map: &mut Map<String, Value>) -> Result<&mut Vec<Value>, Malformed> {
    match map.get_mut("plugins") {
        Some(Value::Array(plugins)) => {
            all_objects(plugins)?;
            plugins.retain(|p| !is_ours(p));
            Ok(plugins)
        }
        _ => Err(Malformed::NoPluginList),
    }
}

fn all_objects(plugins: &[Value]) -> Result<(), Malformed> {
    match plugins.iter().position(|p| !p.is_object()) {
        Some(i) => Err(Malformed::PluginNotObject(i)),
        None => Ok(()),
    }
}

/// Go's `json.MarshalIndent(m, "", "  ")` of a `map[string]any` plus a newline: keys sorted
/// bytewise at every level. serde_json keeps insertion order in this workspace (`preserve_order`),
/// so the sort is explicit.
pub(crate) fn canonical(value: Value) -> Vec<u8> {
    pretty(&sorted(value))
}

fn sorted(value: Value) -> Value {
    match value {
        Value::Object(map) => {
            let mut fields: Vec<(String, Value)> = map.into_iter().collect();
            fields.sort_by(|a, b| a.0.cmp(&b.0));
            Value::Object(fields.into_iter().map(|(k, v)| (k, sorted(v))).collect())
        }
        Value::Array(items) => Value::Array(items.into_iter().map(sorted).collect()),
        other => other,
    }
}

fn pretty(value: &Value) -> Vec<u8> {
    let mut out = serde_json::to_vec_pretty(value).expect("a JSON value always serialises");
    out.push(b'\n');
    out
}

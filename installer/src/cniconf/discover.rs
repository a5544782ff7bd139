//! Finding the primary CNI config the way the kubelet and container runtimes (libcni) pick the
//! default network: the first loadable `.conf`/`.conflist`/`.json` in lexical order.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::error::{ConfError, Malformed};
use super::json::parse_object;
use crate::atomic::is_temp_name;

/// Extensions libcni loads from a conf dir; only `.conflist` holds a list.
const EXTENSIONS: [&str; 3] = ["conf", "conflist", "json"];

/// Finds the primary config our entry goes into (or is copied from, in owned mode).
///
/// With `conf_name`, that file, or when it does not exist its twin (`X.conf` ↔ `X.conflist`);
/// its content is not checked here. Without it, the first valid config in lexical order,
/// skipping unparsable files, single configs without `type` and lists without a `name` or
/// plugins. Our temp files and the file named `skip` (the Istio-owned file) are never chosen.
/// `Ok(None)` means no primary exists yet: wait for one.
pub fn find_primary(dir: &Path, conf_name: Option<&str>, skip: Option<&str>) -> Result<Option<PathBuf>, ConfError> {
    match conf_name {
        Some(name) => Ok(named(dir, name, skip)),
        None => first_valid(dir, skip),
    }
}

fn named(dir: &Path, name: &str, skip: Option<&str>) -> Option<PathBuf> {
    let twin = if let Some(stem) = name.strip_suffix(".conflist") {
        Some(format!("{stem}.conf"))
    } else {
        name.strip_suffix(".conf").map(|stem| format!("{stem}.conflist"))
    };
    [Some(name.to_owned()), twin]
        .into_iter()
        .flatten()
        .filter(|n| Some(n.as_str()) != skip)
        .map(|n| dir.join(n))
        .find(|p| p.exists())
}

/// The first file in `dir` a CNI runtime would load, in lexical order (libcni's `ConfFiles` and
/// the kubelet's default-network rule). A missing dir has no config.
pub(crate) fn first_valid(dir: &Path, skip: Option<&str>) -> Result<Option<PathBuf>, ConfError> {
    for path in config_files(dir, skip)? {
        let verdict = fs::read(&path).map_err(|e| e.to_string()).and_then(|bytes| {
            let is_list = path.extension().is_some_and(|e| e == "conflist");
            loadable_config(&bytes, is_list).map_err(|e| e.to_string())
        });
        match verdict {
            Ok(()) => return Ok(Some(path)),
            Err(reason) => tracing::warn!(path = %path.display(), %reason, "skipping invalid CNI config"),
        }
    }
    Ok(None)
}

/// The `.conf`/`.json` files in `dir` (the names libcni reads as one plugin), in lexical order, for
/// finishing interrupted conversions. A missing dir has none.
pub(crate) fn single_config_files(dir: &Path) -> Result<Vec<PathBuf>, ConfError> {
    let mut files = config_files(dir, None)?;
    files.retain(|p| p.extension().is_some_and(|e| e != "conflist"));
    Ok(files)
}

/// Every file in `dir` libcni's `ConfFiles` lists (`.conf`, `.conflist`, `.json`; no dirs), in lexical
/// order, without our temp files and the file named `skip`. A missing dir has none.
fn config_files(dir: &Path, skip: Option<&str>) -> Result<Vec<PathBuf>, ConfError> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => return Err(ConfError::ListDir { path: dir.to_owned(), source }),
    };
    let mut candidates = Vec::new();
    for dirent in entries {
        let dirent = dirent.map_err(|source| ConfError::ListDir { path: dir.to_owned(), source })?;
        let name = dirent.file_name();
        let path = dirent.path();
        let loadable = path.extension().and_then(|e| e.to_str()).is_some_and(|e| EXTENSIONS.contains(&e));
        if !loadable || is_temp_name(&name) || name.to_str() == skip || path.is_dir() {
            continue;
        }
        candidates.push(path);
    }
    candidates.sort();
    Ok(candidates)
}

/// Tells whether a parsed config loads as a list by libcni's rules (see [`loadable_config`]).
pub(crate) fn is_loadable_list(map: &Map<String, Value>) -> bool {
    loadable_list(map).is_ok()
}

/// libcni's load rules: a single config needs a `type`; a list needs a `name` and a non-empty
/// `plugins` array of configs that each have a `type`; `name`/`cniVersion` must be strings.
fn loadable_config(bytes: &[u8], is_list: bool) -> Result<(), Malformed> {
    let map = parse_object(bytes)?;
    if is_list {
        loadable_list(&map)
    } else {
        loadable_plugin(&map)
    }
}

fn loadable_list(map: &Map<String, Value>) -> Result<(), Malformed> {
    string_field(map, "cniVersion")?;
    if !matches!(map.get("name"), Some(Value::String(_))) {
        return Err(Malformed::NoName);
    }
    let Some(Value::Array(plugins)) = map.get("plugins") else {
        return Err(Malformed::NoPluginList);
    };
    if plugins.is_empty() {
        return Err(Malformed::EmptyPluginList);
    }
    for (i, plugin) in plugins.iter().enumerate() {
        let Value::Object(plugin) = plugin else {
            return Err(Malformed::PluginNotObject(i));
        };
        loadable_plugin(plugin).map_err(|e| match e {
            Malformed::NoType => Malformed::PluginNoType(i),
            other => other,
        })?;
    }
    Ok(())
}

fn loadable_plugin(map: &Map<String, Value>) -> Result<(), Malformed> {
    string_field(map, "cniVersion")?;
    string_field(map, "name")?;
    match map.get("type") {
        Some(Value::String(t)) if !t.is_empty() => Ok(()),
        _ => Err(Malformed::NoType),
    }
}

fn string_field(map: &Map<String, Value>, key: &'static str) -> Result<(), Malformed> {
    match map.get(key) {
        None | Some(Value::String(_)) => Ok(()),
        Some(_) => Err(Malformed::NotString(key)),
    }
}

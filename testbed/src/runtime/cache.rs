//! The result cache: what ADD stored, read back by CHECK, DEL and GC (libcni's `/var/lib/cni/results`).

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use super::config::{NetworkConfigList, RuntimeConf};
use super::error::RuntimeError;

/// File holding the cached attachment of `conf` on network `network`: `<dir>/results/<net>-<id>-<ifname>`.
pub(super) fn entry_path(dir: &Path, network: &str, conf: &RuntimeConf) -> PathBuf {
    dir.join("results").join(format!("{network}-{}-{}", conf.container_id, conf.ifname))
}

/// The `kind` of the cache entries libcni writes and reads.
pub(super) const KIND: &str = "cniCacheV1";

/// Stores the final ADD result together with what is needed to DEL the attachment later (GC does).
pub(super) fn store(
    dir: &Path,
    list: &NetworkConfigList,
    conf: &RuntimeConf,
    result: &Value,
) -> Result<(), RuntimeError> {
    let path = entry_path(dir, &list.name, conf);
    let entry = json!({
        "kind": KIND,
        "containerId": conf.container_id,
        "ifName": conf.ifname,
        "networkName": list.name,
        "netns": conf.netns,
        "cniArgs": conf.args,
        "capabilityArgs": conf.capability_args,
        "config": list.raw,
        "result": result,
    });
    let parent = path.parent().expect("cache entry has a parent");
    std::fs::create_dir_all(parent).map_err(|e| cache_err(parent, e))?;
    std::fs::write(&path, entry.to_string()).map_err(|e| cache_err(&path, e))
}

/// The cached entry of an attachment, if any.
pub(super) fn load(dir: &Path, network: &str, conf: &RuntimeConf) -> Result<Option<Value>, RuntimeError> {
    read(&entry_path(dir, network, conf))
}

/// Removes the cached entry; a missing entry is fine (DEL is idempotent).
pub(super) fn remove(dir: &Path, network: &str, conf: &RuntimeConf) -> Result<(), RuntimeError> {
    let path = entry_path(dir, network, conf);
    match std::fs::remove_file(&path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(cache_err(&path, e)),
        _ => Ok(()),
    }
}

/// All cached attachments of network `network`, as libcni's `GetCachedAttachments` lists them: files in name
/// order; unreadable or unparsable files, other kinds, and entries without an ifName are skipped.
pub(super) fn entries(dir: &Path, network: &str) -> Result<Vec<Value>, RuntimeError> {
    let results = dir.join("results");
    let listing = match std::fs::read_dir(&results) {
        Ok(l) => l,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(cache_err(&results, e)),
    };
    let mut paths = listing
        .map(|item| item.map(|i| i.path()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| cache_err(&results, e))?;
    paths.sort();
    Ok(paths
        .iter()
        .filter_map(|p| read(p).ok().flatten())
        .filter(|entry| entry["kind"] == KIND && entry["networkName"] == network)
        .filter(|entry| entry["ifName"].as_str().is_some_and(|i| !i.is_empty()))
        .collect())
}

fn read(path: &Path) -> Result<Option<Value>, RuntimeError> {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes).map(Some).map_err(|e| cache_err(path, e)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(cache_err(path, e)),
    }
}

fn cache_err(path: &Path, e: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Cache { path: path.to_path_buf(), reason: e.to_string() }
}

//! Finishing a `.conf` → `.conflist` conversion that a crash interrupted, before the first install looks for
//! the primary config.

use std::fs;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use serde_json::{Map, Value};

use super::discover::{is_loadable_list, single_config_files};
use super::error::ConfError;
use super::json::{is_ours, parse_object, plugins};
use super::plan::Change;
use crate::atomic::{remove_synced, write_atomic};

/// Completes every conversion a crash left half done in `dir`, so no stale `.conf` shadows our `.conflist`:
///
/// - a single-plugin `X.conf` (or `X.json`) whose `X.conflist` holds exactly that plugin plus our entry is
///   our conversion interrupted before its last step: the `.conf` is removed ([`Change::Deleted`]);
/// - a list-shaped `X.conf` (`plugins: [...]`, no top-level `type`) that holds our entry is a conversion by
///   the write-in-place-then-rename order (ours before, Istio's still) interrupted before its rename: it
///   becomes `X.conflist`, written atomically with the `.conf`'s bytes and mode, then the `.conf` is removed
///   ([`Change::Converted`]); the next install refreshes our entry in it.
///
/// Anything else is left alone: a list-shaped `.conf` without our entry is skipped by discovery as libcni and
/// Istio skip it, and a `.conf` whose `.conflist` differs is someone else's (the next install converts it).
pub fn complete_conversions(dir: &Path) -> Result<Vec<Change>, ConfError> {
    let mut changes = Vec::new();
    for conf in single_config_files(dir)? {
        let bytes = match fs::read(&conf) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(source) => return Err(ConfError::Read { path: conf, source }),
        };
        let Ok(map) = parse_object(&bytes) else { continue };
        let conflist = conf.with_extension("conflist");
        if map.contains_key("type") {
            if !is_ours(&Value::Object(map.clone())) && holds_converted(&conflist, map)? {
                remove(&conf)?;
                changes.push(Change::Deleted(conf));
            }
        } else if holds_ours(&map) && is_loadable_list(&map) {
            let mode = fs::metadata(&conf)
                .map_err(|source| ConfError::Read { path: conf.clone(), source })?
                .permissions()
                .mode()
                & 0o7777;
            write_atomic(&conflist, &bytes, mode)
                .map_err(|source| ConfError::Write { path: conflist.clone(), source })?;
            remove(&conf)?;
            changes.push(Change::Converted { from: conf, to: conflist });
        }
    }
    Ok(changes)
}

/// True when the list at `conflist` is `single` converted: our entry plus exactly that plugin (without its
/// `cniVersion`, which the conversion moves to the list).
fn holds_converted(conflist: &Path, mut single: Map<String, Value>) -> Result<bool, ConfError> {
    let bytes = match fs::read(conflist) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(source) => return Err(ConfError::Read { path: conflist.to_owned(), source }),
    };
    let Ok(list) = parse_object(&bytes) else { return Ok(false) };
    if !holds_ours(&list) {
        return Ok(false);
    }
    single.shift_remove("cniVersion");
    let theirs: Vec<&Value> = plugins(&list).into_iter().flatten().filter(|p| !is_ours(p)).collect();
    Ok(theirs == [&Value::Object(single)])
}

fn holds_ours(map: &Map<String, Value>) -> bool {
    plugins(map).is_ok_and(|plugins| plugins.iter().any(is_ours))
}

fn remove(path: &Path) -> Result<(), ConfError> {
    remove_synced(path).map(drop).map_err(|source| ConfError::Remove { path: path.to_owned(), source })
}

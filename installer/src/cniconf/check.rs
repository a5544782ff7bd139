//! The validity check behind readiness and repair: is our config still in effect?

use std::fs;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::discover::first_valid;
use super::entry::{PluginEntry, PLUGIN_TYPE};
use super::error::ConfError;
use super::json::{is_ours, parse_object, plugins};
use super::plan::{desired, ConfSettings};

/// Why the installed config is no longer in effect; the watch loop logs it and reinstalls.
#[derive(Debug, thiserror::Error)]
pub enum Invalid {
    /// No loadable config at all in the conf dir.
    #[error("no valid CNI config in {dir}")]
    NoValidConfig {
        /// The CNI config directory.
        dir: PathBuf,
    },
    /// Owned mode: another file sorts before our owned file, so runtimes load that one instead.
    #[error("Istio-owned CNI config {owned} is not the highest-priority file: {first} sorts first")]
    OwnedNotFirst {
        /// Our owned file.
        owned: String,
        /// The file that sorts before it.
        first: PathBuf,
    },
    /// A higher-priority file appeared, so runtimes no longer load the file holding our entry.
    #[error("CNI config {installed} is preempted by {by}")]
    Preempted {
        /// The file holding our entry.
        installed: PathBuf,
        /// The file that preempts it.
        by: PathBuf,
    },
    /// The file holding our config is gone.
    #[error("CNI config {path} was removed")]
    Missing {
        /// The file concerned.
        path: PathBuf,
    },
    /// The file cannot be read or parsed.
    #[error(transparent)]
    Unusable(#[from] ConfError),
    /// Our entry is not in the file (or the standalone file is not ours any more).
    #[error("istio-cni entry missing from {path}")]
    EntryMissing {
        /// The file concerned.
        path: PathBuf,
    },
    /// Our entry is there but differs from what we would write.
    #[error("istio-cni entry in {path} was modified")]
    EntryChanged {
        /// The file concerned.
        path: PathBuf,
    },
    /// Our entry is duplicated or no longer the last plugin of the chain.
    #[error("istio-cni entry in {path} is duplicated or not last")]
    EntryMisplaced {
        /// The file concerned.
        path: PathBuf,
    },
    /// Owned mode: the primary changed since we copied its plugins.
    #[error("{path} no longer matches its primary {primary}")]
    PrimaryChanged {
        /// The file concerned.
        path: PathBuf,
        /// The primary config it was copied from.
        primary: PathBuf,
    },
}

/// Checks that the config we installed at `installed` is still in effect, with Istio's pass/fail
/// rules plus stricter content checks: the first loadable file in the dir must be ours (in owned
/// mode always; otherwise only without `CNI_CONF_NAME`, where pre-emption merely warns), the file
/// must exist, hold our entry exactly once, last and unchanged, and in owned mode still carry the
/// primary's current plugins.
pub fn check(dir: &Path, settings: &ConfSettings, entry: &PluginEntry, installed: &Path) -> Result<(), Invalid> {
    let first = first_valid(dir, None)?.ok_or_else(|| Invalid::NoValidConfig { dir: dir.to_owned() })?;
    if let Some(owned) = settings.effective_owned() {
        if first.file_name().and_then(|n| n.to_str()) != Some(owned) {
            return Err(Invalid::OwnedNotFirst { owned: owned.to_owned(), first });
        }
    }
    if first != installed {
        if settings.conf_name.is_none() && settings.chained {
            return Err(Invalid::Preempted { installed: installed.to_owned(), by: first });
        }
        tracing::warn!(installed = %installed.display(), by = %first.display(), "CNI config preempted");
    }
    let bytes = match fs::read(installed) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(Invalid::Missing { path: installed.to_owned() });
        }
        Err(source) => return Err(ConfError::Read { path: installed.to_owned(), source }.into()),
    };
    let plan = desired(dir, settings, entry)?;
    if let Some(plan) = &plan {
        // A `.conf` that should have become `target`, or a target elsewhere, sorts before our file.
        let by = match &plan.replaces {
            Some(conf) => Some(conf),
            None => Some(&plan.target).filter(|target| *target != installed),
        };
        if let Some(by) = by {
            return Err(Invalid::Preempted { installed: installed.to_owned(), by: by.clone() });
        }
    }
    let malformed = |reason| ConfError::Malformed { path: installed.to_owned(), reason };
    let map = parse_object(&bytes).map_err(malformed)?;
    if settings.chained {
        check_chained_entry(&map, entry, installed)?;
    } else if map.get("type").and_then(Value::as_str) != Some(PLUGIN_TYPE) {
        return Err(Invalid::EntryMissing { path: installed.to_owned() });
    }
    match plan {
        Some(plan) if serde_json::from_slice::<Value>(&plan.bytes).ok() != Some(Value::Object(map)) => {
            match plan.primary.filter(|p| p != installed) {
                Some(primary) => Err(Invalid::PrimaryChanged { path: installed.to_owned(), primary }),
                None => Err(Invalid::EntryChanged { path: installed.to_owned() }),
            }
        }
        _ => Ok(()),
    }
}

fn check_chained_entry(
    map: &serde_json::Map<String, Value>,
    entry: &PluginEntry,
    installed: &Path,
) -> Result<(), Invalid> {
    let path = || installed.to_owned();
    let plugins = plugins(map).map_err(|reason| ConfError::Malformed { path: path(), reason })?;
    let ours: Vec<usize> = plugins.iter().enumerate().filter(|(_, p)| is_ours(p)).map(|(i, _)| i).collect();
    match ours.as_slice() {
        [] => Err(Invalid::EntryMissing { path: path() }),
        [i] if *i + 1 == plugins.len() => {
            if plugins[*i] == entry.to_list_json() {
                Ok(())
            } else {
                Err(Invalid::EntryChanged { path: path() })
            }
        }
        _ => Err(Invalid::EntryMisplaced { path: path() }),
    }
}

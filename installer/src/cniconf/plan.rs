//! What our CNI config should look like on disk, and the operations that put it there or take it
//! away again.

use std::fs;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use super::discover::find_primary;
use super::entry::PluginEntry;
use super::error::ConfError;
use super::json::{insert, remove_entry, standalone, ConfForm};
use crate::atomic::{remove_synced, write_atomic, write_atomic_staged};
use crate::crash::{self, Step};

/// File name of the standalone config when `CNI_CONF_NAME` is unset (Istio's name: it sorts after
/// the usual primaries).
pub const DEFAULT_STANDALONE_FILENAME: &str = "YYY-istio-cni.conf";

/// Default file name of the Istio-owned config (`ISTIO_OWNED_CNI_CONFIG_FILENAME`); it sorts before
/// the usual primaries.
pub const DEFAULT_OWNED_FILENAME: &str = "02-istio-cni.conflist";

/// Permission bits of a config file we create (the primary's own mode is kept when we rewrite it): 0600, as Istio
/// writes its config since istio/istio#59075 (the CIS Kubernetes benchmark asks for 0600 or stricter).
pub const NEW_FILE_MODE: u32 = 0o600;

/// The agent settings that decide where our config goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfSettings {
    /// `CHAINED_CNI_PLUGIN`: insert into the primary's list (true) or write a standalone file.
    pub chained: bool,
    /// `CNI_CONF_NAME`: the primary's file name (chained) or our file's name (standalone).
    pub conf_name: Option<String>,
    /// `ISTIO_OWNED_CNI_CONFIG_FILENAME` when `ISTIO_OWNED_CNI_CONFIG` is on, else `None`.
    pub owned_filename: Option<String>,
    /// `AMBIENT_ENABLED`: owned mode only takes effect in chained ambient mode.
    pub ambient: bool,
}

impl ConfSettings {
    /// The owned file's name when owned mode takes effect (owned, chained and ambient), as Istio
    /// decides; otherwise `None` and the primary itself is rewritten.
    pub fn effective_owned(&self) -> Option<&str> {
        self.owned_filename.as_deref().filter(|_| self.chained && self.ambient)
    }

    fn standalone_path(&self, dir: &Path) -> PathBuf {
        dir.join(self.conf_name.as_deref().unwrap_or(DEFAULT_STANDALONE_FILENAME))
    }
}

/// The config file that should be on disk: the watch loop compares it with what is there and
/// passes it to [`apply`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Desired {
    /// Where the config goes.
    pub target: PathBuf,
    /// Its exact content.
    pub bytes: Vec<u8>,
    /// Its permission bits: the primary's when we rewrite the primary, else the existing file's,
    /// else [`NEW_FILE_MODE`].
    pub mode: u32,
    /// The primary config the content was derived from (`None` in standalone mode).
    pub primary: Option<PathBuf>,
    /// A single-plugin `.conf`/`.json` primary that becomes `target` (its `.conflist`).
    pub replaces: Option<PathBuf>,
}

/// A change made on disk, for logs and for the cleanup journal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// The file was (re)written in place.
    Wrote(PathBuf),
    /// `from` was converted into `to` (a `.conf` into its `.conflist`): `to` written, then `from` removed.
    Converted {
        /// The original file.
        from: PathBuf,
        /// The file it became.
        to: PathBuf,
    },
    /// The file was deleted.
    Deleted(PathBuf),
}

/// Plans our config: in chained mode the primary with our entry merged in (or, in owned mode, our
/// own file holding the primary's plugins plus ours); in standalone mode our entry alone.
/// `Ok(None)` in chained mode means there is no primary yet: never write a standalone config then,
/// wait for the primary to appear.
pub fn desired(dir: &Path, settings: &ConfSettings, entry: &PluginEntry) -> Result<Option<Desired>, ConfError> {
    if !settings.chained {
        let target = settings.standalone_path(dir);
        let mode = mode_or_new(&target)?;
        return Ok(Some(Desired { target, bytes: standalone(entry), mode, primary: None, replaces: None }));
    }
    let owned = settings.effective_owned();
    let Some(primary) = find_primary(dir, settings.conf_name.as_deref(), owned)? else {
        return Ok(None);
    };
    let existing = fs::read(&primary).map_err(|source| ConfError::Read { path: primary.clone(), source })?;
    let bytes = insert(&existing, entry, ConfForm::of(&primary))
        .map_err(|reason| ConfError::Malformed { path: primary.clone(), reason })?;
    let plan = match owned {
        Some(name) => {
            let target = dir.join(name);
            let mode = mode_or_new(&target)?;
            Desired { target, bytes, mode, primary: Some(primary), replaces: None }
        }
        None => {
            let mode = mode_of(&primary)?;
            let single = primary.extension().is_some_and(|e| e == "conf" || e == "json");
            let (target, replaces) = if single {
                (primary.with_extension("conflist"), Some(primary.clone()))
            } else {
                (primary.clone(), None)
            };
            Desired { target, bytes, mode, primary: Some(primary), replaces }
        }
    };
    Ok(Some(plan))
}

/// Puts a planned config on disk atomically. A `.conf` is converted in an order a crash cannot break:
/// the `.conflist` is written first (temp file, fsync, rename, dir fsync) and the `.conf` removed last. In
/// between both exist; `X.conf` sorts before `X.conflist`, so a runtime still loads the old, valid
/// config (without our entry) until the removal, and a restarted install-cni finds the `.conflist`
/// and removes the leftover ([`complete_conversions`](super::complete_conversions)). Each step is a
/// [`crash`](crate::crash) hook point.
pub fn apply(plan: &Desired) -> Result<Change, ConfError> {
    let write_err = |source| ConfError::Write { path: plan.target.clone(), source };
    let Some(from) = &plan.replaces else {
        write_atomic(&plan.target, &plan.bytes, plan.mode).map_err(write_err)?;
        return Ok(Change::Wrote(plan.target.clone()));
    };
    write_atomic_staged(&plan.target, &plan.bytes, plan.mode, || crash::after(Step::ConflistStaged))
        .map_err(write_err)?;
    crash::after(Step::ConflistWritten);
    remove_synced(from).map_err(|source| ConfError::Remove { path: from.clone(), source })?;
    crash::after(Step::ConfRemoved);
    Ok(Change::Converted { from: from.clone(), to: plan.target.clone() })
}

/// Undoes our config for uninstall: deletes the owned or standalone file, or removes our entry from
/// the primary keeping its mode. A converted `.conf` stays a `.conflist`, as with Istio.
pub fn cleanup(dir: &Path, settings: &ConfSettings) -> Result<Vec<Change>, ConfError> {
    let ours = match settings.effective_owned() {
        Some(name) => Some(dir.join(name)),
        None if !settings.chained => Some(settings.standalone_path(dir)),
        None => None,
    };
    if let Some(path) = ours {
        return match fs::remove_file(&path) {
            Ok(()) => Ok(vec![Change::Deleted(path)]),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(vec![]),
            Err(source) => Err(ConfError::Remove { path, source }),
        };
    }
    match find_primary(dir, settings.conf_name.as_deref(), None)? {
        Some(primary) => Ok(strip_file(&primary)?.into_iter().collect()),
        None => Ok(vec![]),
    }
}

/// Removes our entry from one config list in place, keeping its mode; `None` when it held none
/// (or is not a list at all).
/// Cleanup uses it on the primary, and a journal can use it on any file we once wrote into.
pub fn strip_file(path: &Path) -> Result<Option<Change>, ConfError> {
    let existing = match fs::read(path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(ConfError::Read { path: path.to_owned(), source }),
    };
    let malformed = |reason| ConfError::Malformed { path: path.to_owned(), reason };
    let map = super::json::parse_object(&existing).map_err(malformed)?;
    let holds_ours = super::json::plugins(&map).is_ok_and(|plugins| plugins.iter().any(super::json::is_ours));
    if !holds_ours {
        return Ok(None);
    }
    let bytes = remove_entry(&existing).map_err(malformed)?;
    let mode = mode_of(path)?;
    write_atomic(path, &bytes, mode).map_err(|source| ConfError::Write { path: path.to_owned(), source })?;
    Ok(Some(Change::Wrote(path.to_owned())))
}

fn mode_of(path: &Path) -> Result<u32, ConfError> {
    let meta = fs::metadata(path).map_err(|source| ConfError::Read { path: path.to_owned(), source })?;
    Ok(meta.permissions().mode() & 0o7777)
}

fn mode_or_new(path: &Path) -> Result<u32, ConfError> {
    match fs::metadata(path) {
        Ok(meta) => Ok(meta.permissions().mode() & 0o7777),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(NEW_FILE_MODE),
        Err(source) => Err(ConfError::Read { path: path.to_owned(), source }),
    }
}

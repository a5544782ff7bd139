//! Crash-safe file replacement: every file we put on the node (CNI config, kubeconfig, binaries) is
//! written to a temp file in the same directory and renamed over the target, so a kubelet, container
//! runtime or rival agent never reads half a file.

use std::ffi::OsStr;
use std::fs::{self, File, Permissions};
use std::io::{self, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// Name prefix of our temp files. They start with a dot and have no `.conf`/`.conflist`/`.json`
/// extension, so no CNI runtime loads them; the watch loop must ignore events for these names
/// (see [`is_temp_name`]) or our own writes would wake it.
pub const TEMP_PREFIX: &str = ".istio-cni-tmp-";

/// Tells whether a directory entry is one of our temp files, so watchers and config discovery skip it.
pub fn is_temp_name(name: &OsStr) -> bool {
    name.as_encoded_bytes().starts_with(TEMP_PREFIX.as_bytes())
}

/// Replaces `path` with `contents` and permission bits `mode` so that readers see either the old or
/// the new file, never a partial one, and the change survives a crash: temp file in the same
/// directory, write, fsync, chmod, rename, fsync the directory.
pub fn write_atomic(path: &Path, contents: &[u8], mode: u32) -> io::Result<()> {
    write_atomic_staged(path, contents, mode, || {})
}

/// [`write_atomic`], calling `staged` once the temp file is complete and synced but not yet renamed over
/// `path`: the crash hook's [`Step::ConflistStaged`](crate::crash::Step::ConflistStaged).
pub(crate) fn write_atomic_staged(path: &Path, contents: &[u8], mode: u32, staged: impl FnOnce()) -> io::Result<()> {
    let dir = parent_dir(path);
    let mut tmp = tempfile::Builder::new().prefix(TEMP_PREFIX).tempfile_in(dir)?;
    tmp.write_all(contents)?;
    tmp.as_file().set_permissions(Permissions::from_mode(mode))?;
    tmp.as_file().sync_all()?;
    staged();
    tmp.persist(path).map_err(|e| e.error)?;
    sync_dir(dir)
}

/// Deletes `path` and fsyncs its directory, so the removal survives a crash (the last step of converting a
/// `.conf`); `false` when it was already gone.
pub fn remove_synced(path: &Path) -> io::Result<bool> {
    match fs::remove_file(path) {
        Ok(()) => sync_dir(parent_dir(path)).map(|()| true),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

/// Deletes temp files a crashed earlier run left behind in `dir`, so they do not pile up on the
/// host. Returns the removed paths for logging.
pub fn remove_stale_temps(dir: &Path) -> io::Result<Vec<PathBuf>> {
    let mut removed = Vec::new();
    for dirent in fs::read_dir(dir)? {
        let dirent = dirent?;
        if is_temp_name(&dirent.file_name()) && !dirent.file_type()?.is_dir() {
            let path = dirent.path();
            match fs::remove_file(&path) {
                Ok(()) => removed.push(path),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
    }
    Ok(removed)
}

fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

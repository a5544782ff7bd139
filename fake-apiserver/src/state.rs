//! Files in the state directory (`--state-dir`): read when present, written atomically, secrets `0600`.

use crate::Error;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::Path;

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::State { path: path.to_path_buf(), source }
}

/// The contents of `dir/name`, `None` when the file does not exist.
pub(crate) fn read(dir: &Path, name: &str) -> Result<Option<String>, Error> {
    let path = dir.join(name);
    match std::fs::read_to_string(&path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io_err(&path)(e)),
    }
}

/// Replaces `dir/name` with `contents` (temp file + rename), creating `dir` (`0700`) first; `secret` files
/// are readable by their owner only.
pub(crate) fn write(dir: &Path, name: &str, contents: &str, secret: bool) -> Result<(), Error> {
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir).map_err(io_err(dir))?;
    let path = dir.join(name);
    let tmp = dir.join(format!(".{name}.tmp"));
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(if secret { 0o600 } else { 0o644 })
        .open(&tmp)
        .map_err(io_err(&tmp))?;
    file.write_all(contents.as_bytes()).map_err(io_err(&tmp))?;
    drop(file);
    std::fs::rename(&tmp, &path).map_err(io_err(&path))
}

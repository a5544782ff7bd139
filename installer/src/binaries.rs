//! Copies the image's binaries onto the host, atomically, and tells when an installed copy was removed or
//! replaced by someone else.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::atomic::{remove_stale_temps, write_atomic};

/// Why binaries could not be installed.
#[derive(Debug, thiserror::Error)]
pub enum BinError {
    /// The source dir (inside the image) could not be read.
    #[error("read binaries from {dir}: {source}")]
    Source {
        /// The source directory.
        dir: PathBuf,
        /// Underlying error.
        source: std::io::Error,
    },
    /// The target dir is mounted read-only; the operator has to point us elsewhere.
    #[error("{dir} is read-only: set HOST_CNI_BIN_DIR (or SECONDARY_BIN_DIR) to a writable host directory, e.g. /var/lib/rancher/k3s/data/cni on k3s or /home/kubernetes/bin on GKE")]
    ReadOnly {
        /// The read-only directory.
        dir: PathBuf,
    },
    /// Writing a copy failed.
    #[error("install {path}: {source}")]
    Write {
        /// The file being written.
        path: PathBuf,
        /// Underlying error.
        source: std::io::Error,
    },
}

/// One installed copy and the identity it had right after we wrote it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstalledBinary {
    /// Where the copy lives on the host.
    pub path: PathBuf,
    identity: (u64, u64, u64, i64),
}

impl InstalledBinary {
    fn identity(meta: &std::fs::Metadata) -> (u64, u64, u64, i64) {
        (meta.dev(), meta.ino(), meta.len(), meta.mtime_nsec() + meta.mtime() * 1_000_000_000)
    }

    /// `None` while the copy is exactly the one we wrote; otherwise why it is not.
    pub fn problem(&self) -> Option<String> {
        match std::fs::metadata(&self.path) {
            Err(e) => Some(format!("binary {} is gone: {e}", self.path.display())),
            Ok(meta) if Self::identity(&meta) != self.identity => {
                Some(format!("binary {} was replaced", self.path.display()))
            }
            Ok(_) => None,
        }
    }
}

/// Copies every regular file of `source` into each of `targets` (temp file, mode, rename), after removing our
/// stale temp files there.
pub fn install(source: &Path, targets: &[PathBuf]) -> Result<Vec<InstalledBinary>, BinError> {
    let src_err = |source_err| BinError::Source { dir: source.to_path_buf(), source: source_err };
    let mut files = Vec::new();
    for entry in std::fs::read_dir(source).map_err(src_err)? {
        let entry = entry.map_err(src_err)?;
        let meta = std::fs::metadata(entry.path()).map_err(src_err)?;
        if meta.is_file() {
            files.push((entry.file_name(), entry.path(), meta.permissions().mode() & 0o777));
        }
    }
    files.sort();
    let mut installed = Vec::new();
    for dir in targets {
        match remove_stale_temps(dir) {
            Ok(stale) => stale.iter().for_each(|p| tracing::info!(temp = %p.display(), "removed stale temp file")),
            Err(e) if read_only(&e) => return Err(BinError::ReadOnly { dir: dir.clone() }),
            Err(e) => return Err(BinError::Write { path: dir.clone(), source: e }),
        }
        for (name, path, mode) in &files {
            let dest = dir.join(name);
            let write_err = |e: std::io::Error| {
                if read_only(&e) {
                    BinError::ReadOnly { dir: dir.clone() }
                } else {
                    BinError::Write { path: dest.clone(), source: e }
                }
            };
            let contents = std::fs::read(path).map_err(src_err)?;
            write_atomic(&dest, &contents, *mode | 0o111).map_err(write_err)?;
            let meta = std::fs::metadata(&dest).map_err(write_err)?;
            tracing::info!(binary = %dest.display(), "installed");
            installed.push(InstalledBinary { path: dest, identity: InstalledBinary::identity(&meta) });
        }
    }
    Ok(installed)
}

/// Whether an error comes from a read-only mount (EROFS), also when wrapped with a path (as tempfile does).
fn read_only(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::ReadOnlyFilesystem
}

/// Deletes our copies (cleanup); missing files are fine.
pub fn uninstall(installed: &[InstalledBinary]) {
    for bin in installed {
        match std::fs::remove_file(&bin.path) {
            Ok(()) => tracing::info!(binary = %bin.path.display(), "removed"),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(binary = %bin.path.display(), error = %e, "could not remove"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn installs_every_file_executable_and_detects_tampering() {
        let src = tempfile::tempdir().unwrap();
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        std::fs::write(src.path().join("istio-cni"), b"\x7fELF plugin").unwrap();
        std::fs::write(src.path().join("other"), b"x").unwrap();
        std::fs::create_dir(src.path().join("subdir")).unwrap();
        let installed = install(src.path(), &[a.path().to_path_buf(), b.path().to_path_buf()]).unwrap();
        assert_eq!(installed.len(), 4);
        let copy = a.path().join("istio-cni");
        assert_eq!(std::fs::read(&copy).unwrap(), b"\x7fELF plugin");
        assert_eq!(std::fs::metadata(&copy).unwrap().permissions().mode() & 0o111, 0o111);
        assert!(installed.iter().all(|i| i.problem().is_none()));

        std::fs::write(a.path().join("x.tmp"), b"").unwrap();
        std::fs::remove_file(&copy).unwrap();
        assert!(installed[0].problem().unwrap().contains("gone"));
        std::fs::write(&copy, b"evil").unwrap();
        assert!(installed[0].problem().unwrap().contains("replaced"));

        uninstall(&installed);
        assert!(!copy.exists() && !b.path().join("other").exists());
        assert!(a.path().join("x.tmp").exists(), "only our own files are removed");
    }

    /// A read-only tmpfs mounted over a temp dir for the life of the guard (tests run as root).
    struct ReadOnlyMount(tempfile::TempDir);

    impl Drop for ReadOnlyMount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg(self.0.path()).status();
        }
    }

    #[test]
    fn a_read_only_bin_dir_says_which_setting_to_change() {
        let src = tempfile::tempdir().unwrap();
        std::fs::write(src.path().join("istio-cni"), b"plugin").unwrap();
        let ro = ReadOnlyMount(tempfile::tempdir().unwrap());
        let mounted = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", "ro,size=1m", "tmpfs"])
            .arg(ro.0.path())
            .status()
            .expect("run mount");
        assert!(mounted.success(), "mount a read-only tmpfs");
        let err = install(src.path(), &[ro.0.path().to_path_buf()]).unwrap_err();
        assert!(matches!(err, BinError::ReadOnly { .. }), "{err}");
        assert!(err.to_string().contains("HOST_CNI_BIN_DIR"), "{err}");
    }
}

//! What this agent changed on the node, persisted in the run dir, so cleanup reverts exactly that (even after a
//! crash and restart) and nothing else.

use std::path::{Path, PathBuf};

use base64::Engine as _;
use serde::{Deserialize, Serialize};

use crate::atomic::write_atomic;

/// File name of the journal inside the run dir.
pub const JOURNAL_FILE: &str = "install-journal.json";

/// One change to a CNI config file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ConfRecord {
    /// Our entry was merged into this existing list.
    Inserted {
        /// The list file.
        file: PathBuf,
    },
    /// A single-plugin `.conf` was converted into `to` (a `.conflist`); the original is kept to restore it.
    Converted {
        /// The original file.
        from: PathBuf,
        /// The list it became.
        to: PathBuf,
        /// The original bytes, base64.
        original: String,
        /// The original permission bits.
        mode: u32,
    },
    /// We created this file (owned or standalone config).
    Created {
        /// The file.
        file: PathBuf,
    },
}

/// Everything we installed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Journal {
    /// Binaries we copied onto the host.
    pub binaries: Vec<PathBuf>,
    /// The kubeconfig we wrote.
    pub kubeconfig: Option<PathBuf>,
    /// CNI config changes, oldest first.
    pub conf: Vec<ConfRecord>,
    #[serde(skip)]
    path: PathBuf,
}

impl Journal {
    /// Loads the journal of an earlier run from `run_dir`, or starts an empty one.
    pub fn load(run_dir: &Path) -> Journal {
        let path = run_dir.join(JOURNAL_FILE);
        let mut journal: Journal = std::fs::read(&path)
            .ok()
            .and_then(|bytes| match serde_json::from_slice(&bytes) {
                Ok(j) => Some(j),
                Err(e) => {
                    tracing::warn!(journal = %path.display(), error = %e, "ignoring unreadable install journal");
                    None
                }
            })
            .unwrap_or_default();
        journal.path = path;
        journal
    }

    /// Adds a binary path (once).
    pub fn binary(&mut self, path: &Path) {
        if !self.binaries.iter().any(|b| b == path) {
            self.binaries.push(path.to_path_buf());
        }
    }

    /// Adds a config change (once; a conversion is never overwritten, so the true original survives repairs).
    pub fn conf(&mut self, record: ConfRecord) {
        let known = self.conf.iter().any(|r| match (r, &record) {
            (ConfRecord::Converted { from, .. }, ConfRecord::Converted { from: f, .. }) => from == f,
            _ => *r == record,
        });
        if !known {
            self.conf.push(record);
        }
    }

    /// Records the conversion of `from` (its bytes and mode) and saves the journal, before the conversion writes
    /// anything, so a crash at any later step still leaves the original to restore on uninstall.
    pub fn converting(&mut self, from: &Path, to: &Path) -> std::io::Result<()> {
        use std::os::unix::fs::PermissionsExt;
        let original = std::fs::read(from)?;
        let mode = std::fs::metadata(from)?.permissions().mode() & 0o7777;
        self.conf(ConfRecord::Converted {
            from: from.to_path_buf(),
            to: to.to_path_buf(),
            original: base64::engine::general_purpose::STANDARD.encode(original),
            mode,
        });
        self.save()
    }

    /// Writes the journal atomically.
    pub fn save(&self) -> std::io::Result<()> {
        let bytes = serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?;
        write_atomic(&self.path, &bytes, 0o600)
    }

    /// Deletes the journal after a complete cleanup.
    pub fn remove(&self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Decodes a conversion record's original bytes.
pub fn original_bytes(encoded: &str) -> Option<Vec<u8>> {
    base64::engine::general_purpose::STANDARD.decode(encoded).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn survives_a_restart_and_keeps_the_first_original() {
        let dir = tempfile::tempdir().unwrap();
        let conf = dir.path().join("10-bridge.conf");
        std::fs::write(&conf, b"original").unwrap();
        let mut j = Journal::load(dir.path());
        j.converting(&conf, &conf.with_extension("conflist")).unwrap();
        std::fs::write(&conf, b"rewritten by a repair").unwrap();
        j.converting(&conf, &conf.with_extension("conflist")).unwrap();
        j.binary(Path::new("/opt/cni/bin/istio-cni"));
        j.binary(Path::new("/opt/cni/bin/istio-cni"));
        j.save().unwrap();
        let again = Journal::load(dir.path());
        assert_eq!(again, j);
        assert_eq!(again.binaries.len(), 1);
        let ConfRecord::Converted { original, .. } = &again.conf[0] else { panic!("{:?}", again.conf) };
        assert_eq!(original_bytes(original).unwrap(), b"original");
        assert_eq!(again.conf.len(), 1);
    }
}

//! The directory source for the embedded default: a YAML file in ztunnel's local-config shape, re-read
//! whenever it changes.

use std::path::{Path, PathBuf};

use notify::{RecommendedWatcher, RecursiveMode, Watcher};

use super::{parse_local_config, Directory, Workload};

/// The name this source's entries are kept under in the [`Directory`].
pub const SOURCE: &str = "local-file";

/// Why the local workloads file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum LocalFileError {
    /// The file could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The file is not valid local config YAML.
    #[error("parsing {path}: {source}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: serde_yaml::Error,
    },
    /// The file's directory could not be watched.
    #[error("watching {path}: {source}")]
    Watch {
        /// The directory.
        path: PathBuf,
        /// The underlying error.
        source: notify::Error,
    },
}

/// Loads `path` into `directory` (a missing file counts as empty) and keeps doing so on every change until
/// the returned watcher is dropped. The parent directory is watched, so files replaced by rename are seen.
pub fn watch(path: &Path, directory: Directory) -> Result<RecommendedWatcher, LocalFileError> {
    reload(path, &directory);
    let file = path.to_path_buf();
    let parent = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new(".")).to_path_buf();
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| match event {
        // Reading the file raises access events of its own: reacting to those would reload in a loop.
        Ok(event) if !event.kind.is_access() && event.paths.iter().any(|p| p.file_name() == file.file_name()) => {
            reload(&file, &directory)
        }
        Ok(_) => {}
        Err(error) => tracing::warn!(%error, "watching the local workloads file"),
    })
    .map_err(|source| LocalFileError::Watch { path: parent.clone(), source })?;
    watcher
        .watch(&parent, RecursiveMode::NonRecursive)
        .map_err(|source| LocalFileError::Watch { path: parent, source })?;
    Ok(watcher)
}

/// Reads the file and replaces this source's entries; on a read or parse error the old entries stay.
fn reload(path: &Path, directory: &Directory) {
    match load(path) {
        Ok(workloads) => {
            for error in directory.replace(SOURCE, workloads) {
                tracing::warn!(%error, file = %path.display(), "skipping workload");
            }
        }
        Err(error) => tracing::warn!(%error, "keeping the previous local workloads"),
    }
}

fn load(path: &Path) -> Result<Vec<Workload>, LocalFileError> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => return Err(LocalFileError::Read { path: path.to_path_buf(), source }),
    };
    parse_local_config(&text).map_err(|source| LocalFileError::Parse { path: path.to_path_buf(), source })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::directory::Protocol;
    use std::time::{Duration, Instant};

    const YAML: &str = r#"
workloads:
- uid: cluster1//v1/Pod/shop/b
  name: b
  namespace: shop
  serviceAccount: b-sa
  trustDomain: example.org
  workloadIps: [10.1.2.3]
  protocol: HBONE
  node: node-1
services: []
"#;

    #[test]
    fn reads_ztunnels_local_config_shape() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("workloads.yaml");
        std::fs::write(&path, YAML).unwrap();
        let workloads = load(&path).unwrap();
        assert_eq!(workloads.len(), 1);
        assert_eq!(workloads[0].service_account, "b-sa");
        assert_eq!(workloads[0].protocol, Protocol::Hbone);
        assert_eq!(workloads[0].workload_ips, vec!["10.1.2.3".parse::<std::net::IpAddr>().unwrap()]);
    }

    #[test]
    fn a_file_written_after_the_watch_started_is_picked_up() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("workloads.yaml");
        let directory = Directory::new("cluster.local");
        let _watcher = watch(&path, directory.clone()).unwrap();
        let ip = "10.1.2.3".parse().unwrap();
        assert!(directory.lookup(ip).is_none());
        std::fs::write(&path, YAML).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while directory.lookup(ip).is_none() {
            assert!(Instant::now() < deadline, "the watcher never loaded the new file");
            std::thread::sleep(Duration::from_millis(20));
        }
        let found = directory.lookup(ip).unwrap();
        assert_eq!(found.identity.to_string(), "spiffe://example.org/ns/shop/sa/b-sa");
    }
}

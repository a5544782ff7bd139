//! Locating the binaries under test (built by `cargo build --workspace --bins`) and the CNI reference
//! plugins installed by the OS package.

use std::path::{Path, PathBuf};

/// The cargo target profile dir (e.g. `target/debug`) holding the workspace binaries.
///
/// Integration tests run from `target/debug/deps/<test>-<hash>`, so it is the parent of that `deps` dir.
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let mut dir = exe.parent().expect("test binary has a parent dir").to_path_buf();
    if dir.ends_with("deps") {
        dir.pop();
    }
    dir
}

/// Path of the workspace binary `name`; panics with the command to run when it has not been built.
pub fn path(name: &str) -> PathBuf {
    let p = target_dir().join(name);
    assert!(
        p.is_file(),
        "binary {} not found; run `cargo build --workspace --bins` first (scripts/test.sh does)",
        p.display()
    );
    p
}

/// Directories where distributions install the CNI reference plugins.
const REFERENCE_DIRS: [&str; 2] = ["/usr/lib/cni", "/opt/cni/bin"];

/// The dir holding the CNI reference plugins (`bridge`, `host-local`, ...); panics naming the install
/// script when none is installed.
pub fn reference_plugin_dir() -> &'static Path {
    REFERENCE_DIRS
        .iter()
        .map(Path::new)
        .find(|d| d.join("bridge").is_file())
        .unwrap_or_else(|| panic!("CNI reference plugins not found in {REFERENCE_DIRS:?}; run scripts/install-deps.sh"))
}

/// Path of the reference plugin `name` (e.g. `"bridge"`).
pub fn reference_plugin(name: &str) -> PathBuf {
    let p = reference_plugin_dir().join(name);
    assert!(p.is_file(), "reference CNI plugin {} not found", p.display());
    p
}

//! Istio's own programs as baselines (#29): built and cached outside the clone by `scripts/istio-ref/build.sh`,
//! which also pins their version in one place. The benchmark only looks them up (`build.sh bin-dir`, `build.sh
//! version`, both answered without building anything); without them a scenario skips Istio's rows and says so.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The node's bin-dir name Istio's `istio-cni` is installed under, beside ours.
pub const PLUGIN_TYPE: &str = "istio-cni-istio";

/// One of Istio's binaries, and the pinned istio.io/istio version it was built from.
pub struct IstioBinary {
    /// The binary.
    pub path: PathBuf,
    /// The pinned module version (`build.sh version`).
    pub version: String,
}

/// Istio's built `name` (e.g. `istio-cni`), or why it is not there (the reason names the script that builds it).
pub fn binary(name: &str) -> Result<IstioBinary, String> {
    // As for the test suite (scripts/test.sh): `ISTIO_REF=0` leaves Istio's binaries out of the run.
    if std::env::var("ISTIO_REF").is_ok_and(|v| v == "0") {
        return Err("ISTIO_REF=0 left Istio's binaries out of this run".into());
    }
    let script: PathBuf = [env!("CARGO_MANIFEST_DIR"), "..", "scripts", "istio-ref", "build.sh"].iter().collect();
    let dir = PathBuf::from(ask(&script, "bin-dir")?);
    let path = dir.join(name);
    if !path.is_file() {
        return Err(format!(
            "Istio's {name} is not built ({} missing; run scripts/istio-ref/build.sh)",
            path.display()
        ));
    }
    Ok(IstioBinary { path, version: ask(&script, "version")? })
}

/// `bash build.sh what`'s one line of output.
fn ask(script: &Path, what: &str) -> Result<String, String> {
    let out = Command::new("bash")
        .arg(script)
        .arg(what)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("run {} {what}: {e}", script.display()))?;
    let text = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    if !out.status.success() || text.is_empty() {
        return Err(format!("{} {what} answered nothing: {}", script.display(), String::from_utf8_lossy(&out.stderr)));
    }
    Ok(text)
}

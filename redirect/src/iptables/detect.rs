//! Which iptables flavour the node uses, chosen as Istio chooses it.

use std::process::{Command, Stdio};

use super::error::IptablesError;
use super::flavour::IptablesBackend;
use crate::model::Family;

/// Chains kube components create in the host netns; their presence tells which backend the node uses.
const KUBE_HINT_CHAINS: [&str; 2] = [":KUBE-IPTABLES-HINT", ":KUBE-KUBELET-CANARY"];

/// Chooses the backend as Istio does: `force` (FORCE_IPTABLES_BINARY) wins; otherwise whichever flavour holds
/// kube's hint chains in the caller's (host) netns; otherwise nft if installed, else legacy.
///
/// Runs at most two `*-save` commands (nft first, as it is the common case).
pub fn detect_backend(force: Option<&str>) -> Result<IptablesBackend, IptablesError> {
    match force.map(str::trim).filter(|f| !f.is_empty()) {
        Some("iptables-legacy") => return Ok(IptablesBackend::Legacy),
        Some("iptables-nft") => return Ok(IptablesBackend::Nft),
        Some("iptables") => return plain_iptables_flavour(),
        Some(other) => return Err(IptablesError::UnknownForcedBinary(other.to_string())),
        None => {}
    }
    for backend in [IptablesBackend::Nft, IptablesBackend::Legacy] {
        let binary = backend.binary(Family::V4, "save");
        let out = Command::new(&binary).args(["-t", "mangle"]).stdin(Stdio::null()).output();
        if let Ok(out) = out {
            let text = String::from_utf8_lossy(&out.stdout);
            if text.lines().any(|l| KUBE_HINT_CHAINS.iter().any(|h| l.starts_with(h))) {
                return Ok(backend);
            }
        }
    }
    if in_path(&IptablesBackend::Nft.binary(Family::V4, "restore")) {
        Ok(IptablesBackend::Nft)
    } else {
        Ok(IptablesBackend::Legacy)
    }
}

/// What the distribution's plain `iptables` is (`iptables v1.8.9 (nf_tables)` vs `(legacy)`).
fn plain_iptables_flavour() -> Result<IptablesBackend, IptablesError> {
    let out = Command::new("iptables")
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .map_err(|source| IptablesError::Spawn { binary: "iptables".into(), source })?;
    let text = String::from_utf8_lossy(&out.stdout);
    Ok(if text.contains("nf_tables") { IptablesBackend::Nft } else { IptablesBackend::Legacy })
}

fn in_path(binary: &str) -> bool {
    std::env::var_os("PATH")
        .map(|paths| std::env::split_paths(&paths).any(|dir| dir.join(binary).is_file()))
        .unwrap_or(false)
}

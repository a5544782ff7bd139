//! `istio-cni`: the CNI plugin the container runtime execs for every pod.
//!
//! stdout carries exactly one thing: the result, or a CNI error JSON. Panics are caught and reported the same way.

mod agent;
mod ambient;
mod commands;
mod k8s;
mod logging;

use std::collections::HashMap;
use std::io::{Read, Write};

use cni::{CniError, ErrorCode, Version};
// The netconf parser lives in the library (the fuzz targets build it too); `crate::config` is that module.
use plugin::config;

/// Largest stdin we accept; a netconf is a few KiB.
const MAX_STDIN: u64 = 4 << 20;

fn read_stdin() -> Result<Vec<u8>, CniError> {
    let mut buf = Vec::new();
    std::io::stdin()
        .take(MAX_STDIN + 1)
        .read_to_end(&mut buf)
        .map_err(|e| CniError::new(ErrorCode::Io, format!("read stdin: {e}")))?;
    if buf.len() as u64 > MAX_STDIN {
        return Err(CniError::new(ErrorCode::Decoding, format!("stdin is larger than {MAX_STDIN} bytes")));
    }
    Ok(buf)
}

/// The version to report errors in: the request's if it is readable, else the newest we speak.
fn reply_version(stdin: &[u8]) -> String {
    serde_json::from_slice::<serde_json::Value>(stdin)
        .ok()
        .and_then(|v| v.get("cniVersion")?.as_str().map(String::from))
        .filter(|v| Version::supported(v).is_ok())
        .unwrap_or_else(|| Version::LATEST.to_string())
}

/// Where iptables lives on every distribution we know; used when the runtime gives us no PATH at all.
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

fn main() {
    commands::STARTED.get_or_init(std::time::Instant::now);
    std::panic::set_hook(Box::new(|info| eprintln!("istio-cni: panic: {info}")));
    // Runtimes may exec plugins with a sanitized environment; still find the host's iptables.
    if std::env::var_os("PATH").is_none_or(|p| p.is_empty()) {
        std::env::set_var("PATH", DEFAULT_PATH);
    }
    let env: HashMap<String, String> =
        std::env::vars_os().filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?))).collect();
    let stdin = read_stdin();
    let version = stdin.as_deref().map(reply_version).unwrap_or_else(|_| Version::LATEST.to_string());
    let outcome = std::panic::catch_unwind(|| commands::run(&env, stdin?)).unwrap_or_else(|panic| {
        let what = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        Err(CniError::new(ErrorCode::Internal, format!("internal error: plugin panicked: {what}")))
    });
    let mut out = std::io::stdout().lock();
    let code = match outcome {
        Ok(Some(result)) => {
            let _ = writeln!(out, "{result}");
            0
        }
        Ok(None) => 0,
        Err(e) => {
            tracing::error!(code = e.code, msg = %e.msg, details = %e.details, "command failed");
            let _ = writeln!(out, "{}", e.to_json(&version));
            1
        }
    };
    let _ = out.flush();
    std::process::exit(code);
}

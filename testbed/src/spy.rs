//! A spy CNI plugin for tests: a tiny `/bin/sh` script (tests only; the product never uses a shell) that
//! records the stdin and `CNI_*` env of every invocation and prints a fixed result, so tests can verify
//! what a runtime (ours or podman) passed to a chained plugin.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use serde_json::Value;

/// File in the record dir where every spy sharing it appends `<name> <command> <container id>`.
const CALL_LOG: &str = "spy-calls.log";

/// What a spy answers to VERSION: every spec version up to 1.1.0.
pub const VERSION_INFO: &str =
    r#"{"cniVersion":"1.1.0","supportedVersions":["0.3.0","0.3.1","0.4.0","1.0.0","1.1.0"]}"#;

/// The calls of all spies recording into `record_dir`, in order, as `<name> <command> <container id>`.
pub fn calls(record_dir: &Path) -> Vec<String> {
    std::fs::read_to_string(record_dir.join(CALL_LOG))
        .map(|t| t.lines().map(|l| l.trim_end().to_owned()).collect())
        .unwrap_or_default()
}

/// An installed spy plugin and the dir where it records its invocations.
#[derive(Debug)]
pub struct Spy {
    /// Path of the plugin executable.
    pub bin: PathBuf,
    record_dir: PathBuf,
}

impl Spy {
    /// Writes the spy as `<bin_dir>/<name>`. On ADD it prints `output`, on VERSION [`VERSION_INFO`]; with `fail` set, it
    /// prints that error object instead and exits 1 on every command. Records go to `<record_dir>`.
    pub fn install(bin_dir: &Path, record_dir: &Path, name: &str, output: &Value, fail: Option<&Value>) -> Self {
        let quoted = output.to_string().contains('\'') || fail.is_some_and(|f| f.to_string().contains('\''));
        assert!(!quoted, "spy output must not contain single quotes");
        let log = record_dir.join(CALL_LOG);
        let record_dir = record_dir.join(format!("spy-{name}"));
        std::fs::create_dir_all(&record_dir).expect("spy record dir");
        let failing = match fail {
            Some(err) => format!("printf '%s' '{err}'\necho 'spy {name} failing' >&2\nexit 1\n"),
            None => String::new(),
        };
        let script = format!(
            "#!/bin/sh\n\
             f=\"{dir}/$CNI_COMMAND.$CNI_CONTAINERID\"\n\
             echo \"{name} $CNI_COMMAND $CNI_CONTAINERID\" >> \"{log}\"\n\
             cat > \"$f.stdin\"\n\
             env > \"$f.env\"\n\
             {failing}\
             case \"$CNI_COMMAND\" in\n\
               ADD) printf '%s' '{output}';;\n\
               VERSION) printf '%s' '{VERSION_INFO}';;\n\
             esac\n",
            dir = record_dir.display(),
            log = log.display(),
        );
        let bin = bin_dir.join(name);
        std::fs::write(&bin, script).expect("write spy");
        std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).expect("chmod spy");
        Self { bin, record_dir }
    }

    /// The JSON stdin of the `command` invocation for `container_id` (`""` for STATUS/GC/VERSION).
    pub fn stdin(&self, command: &str, container_id: &str) -> Option<Value> {
        let text = std::fs::read(self.record(command, container_id, "stdin")).ok()?;
        Some(serde_json::from_slice(&text).unwrap_or_else(|e| panic!("spy stdin is not JSON: {e}")))
    }

    /// The environment (`KEY=VALUE` lines) of the `command` invocation for `container_id`.
    pub fn env(&self, command: &str, container_id: &str) -> Option<Vec<String>> {
        let text = std::fs::read_to_string(self.record(command, container_id, "env")).ok()?;
        Some(text.lines().map(str::to_owned).collect())
    }

    fn record(&self, command: &str, container_id: &str, kind: &str) -> PathBuf {
        self.record_dir.join(format!("{command}.{container_id}.{kind}"))
    }
}

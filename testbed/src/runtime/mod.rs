//! A fake CNI runtime that drives plugins exactly like libcni (what containerd, CRI-O and podman use):
//! conflist parsing, per-plugin config injection, prevResult threading, the result cache, and the
//! ADD/CHECK/DEL/STATUS/GC/VERSION commands, with a deadline on every exec.

mod cache;
mod config;
mod error;
pub(crate) mod exec;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::{json, Map, Value};

pub use config::{NetworkConfigList, RuntimeConf};
pub use error::{PluginError, RuntimeError};
pub use exec::RawOutput;

/// How long a plugin may run before it is killed, so a hung plugin cannot hang the suite.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// The fake runtime: where plugins live, where results are cached, and which netns plugins are spawned in.
#[derive(Debug, Clone)]
pub struct Runtime {
    bin_dirs: Vec<PathBuf>,
    cache_dir: PathBuf,
    netns: Option<PathBuf>,
    timeout: Duration,
}

impl Runtime {
    /// A runtime that finds plugins in `bin_dirs` (in order; also passed as `CNI_PATH`) and caches results
    /// under `cache_dir`. Plugins are spawned in the caller's netns until [`Runtime::in_netns`] is used.
    pub fn new(bin_dirs: Vec<PathBuf>, cache_dir: impl Into<PathBuf>) -> Self {
        Self { bin_dirs, cache_dir: cache_dir.into(), netns: None, timeout: DEFAULT_TIMEOUT }
    }

    /// Spawns plugins from inside the netns at `path`, like a runtime running on a node: the `bridge`
    /// plugin creates the bridge and host veth in the runtime's netns.
    pub fn in_netns(mut self, path: impl Into<PathBuf>) -> Self {
        self.netns = Some(path.into());
        self
    }

    /// Overrides the per-exec deadline.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The result cache dir.
    pub fn cache_dir(&self) -> &Path {
        &self.cache_dir
    }

    /// Where the result of attachment `conf` on network `network` is cached.
    pub fn cache_path(&self, network: &str, conf: &RuntimeConf) -> PathBuf {
        cache::entry_path(&self.cache_dir, network, conf)
    }

    /// The result ADD cached for `conf` on `list`, if any.
    pub fn cached_result(&self, list: &NetworkConfigList, conf: &RuntimeConf) -> Result<Option<Value>, RuntimeError> {
        Ok(cache::load(&self.cache_dir, &list.name, conf)?.map(|entry| entry["result"].clone()))
    }

    /// CNI ADD: runs each plugin in order, each getting the previous one's result as `prevResult`, caches
    /// and returns the final result.
    pub fn add(&self, list: &NetworkConfigList, conf: &RuntimeConf) -> Result<Value, RuntimeError> {
        let mut prev: Option<Value> = None;
        for plugin in &list.plugins {
            let stdin = config::plugin_stdin(list, plugin, prev.as_ref(), &conf.capability_args);
            let out = self.exec_plugin(plugin, "ADD", Some(conf), &stdin)?;
            prev = Some(parse_result(plugin, &out)?);
        }
        let result = prev.expect("conflist has at least one plugin");
        cache::store(&self.cache_dir, list, conf, &result)?;
        Ok(result)
    }

    /// CNI CHECK: runs each plugin in order with the cached result as `prevResult`; errors when nothing
    /// is cached, is a no-op with `disableCheck`, and needs cniVersion >= 0.4.0, as in libcni.
    pub fn check(&self, list: &NetworkConfigList, conf: &RuntimeConf) -> Result<(), RuntimeError> {
        if !list.version_at_least((0, 4, 0)) {
            return Err(RuntimeError::Config {
                source_name: list.name.clone(),
                reason: format!("CHECK not supported by cniVersion {}", list.cni_version),
            });
        }
        if list.disable_check {
            return Ok(());
        }
        let cached = self.cached_result(list, conf)?.ok_or_else(|| RuntimeError::NoCachedResult {
            network: list.name.clone(),
            container_id: conf.container_id.clone(),
            ifname: conf.ifname.clone(),
        })?;
        for plugin in &list.plugins {
            let stdin = config::plugin_stdin(list, plugin, Some(&cached), &conf.capability_args);
            self.exec_plugin(plugin, "CHECK", Some(conf), &stdin)?;
        }
        Ok(())
    }

    /// CNI DEL: runs the plugins in reverse order with the cached result as `prevResult` (none if nothing
    /// is cached), then drops the cache entry. Safe to repeat.
    pub fn del(&self, list: &NetworkConfigList, conf: &RuntimeConf) -> Result<(), RuntimeError> {
        let cached = self.cached_result(list, conf)?;
        for plugin in list.plugins.iter().rev() {
            let stdin = config::plugin_stdin(list, plugin, cached.as_ref(), &conf.capability_args);
            self.exec_plugin(plugin, "DEL", Some(conf), &stdin)?;
        }
        cache::remove(&self.cache_dir, &list.name, conf)
    }

    /// CNI STATUS (1.1.0): asks every plugin whether it is ready for ADDs; a no-op for older lists.
    pub fn status(&self, list: &NetworkConfigList) -> Result<(), RuntimeError> {
        if !list.version_at_least((1, 1, 0)) {
            return Ok(());
        }
        for plugin in &list.plugins {
            let stdin = config::plugin_stdin(list, plugin, None, &Map::new());
            self.exec_plugin(plugin, "STATUS", None, &stdin)?;
        }
        Ok(())
    }

    /// CNI GC like libcni: DELs every cached attachment of this network that is not in `valid`
    /// (`(container_id, ifname)` pairs), then, for 1.1.0 lists, runs GC on each plugin with
    /// `cni.dev/valid-attachments` injected.
    pub fn gc(&self, list: &NetworkConfigList, valid: &[(&str, &str)]) -> Result<(), RuntimeError> {
        for entry in cache::entries(&self.cache_dir, &list.name)? {
            let id = entry["containerId"].as_str().unwrap_or_default();
            let ifname = entry["ifName"].as_str().unwrap_or_default();
            if valid.contains(&(id, ifname)) {
                continue;
            }
            let mut conf = RuntimeConf::new(id, entry["netns"].as_str().unwrap_or_default());
            conf.ifname = ifname.into();
            conf.args = serde_json::from_value(entry["cniArgs"].clone()).unwrap_or_default();
            conf.capability_args = serde_json::from_value(entry["capabilityArgs"].clone()).unwrap_or_default();
            self.del(list, &conf)?;
        }
        if !list.version_at_least((1, 1, 0)) {
            return Ok(());
        }
        let attachments: Vec<Value> =
            valid.iter().map(|(id, ifname)| json!({"containerID": id, "ifname": ifname})).collect();
        for plugin in &list.plugins {
            let mut stdin = config::plugin_stdin(list, plugin, None, &Map::new());
            stdin["cni.dev/valid-attachments"] = Value::Array(attachments.clone());
            self.exec_plugin(plugin, "GC", None, &stdin)?;
        }
        Ok(())
    }

    /// CNI VERSION: returns the plugin's version info (`{cniVersion, supportedVersions}`).
    pub fn version(&self, plugin_type: &str) -> Result<Value, RuntimeError> {
        let plugin = json!({"type": plugin_type});
        let out = self.exec_plugin(&plugin, "VERSION", None, &json!({"cniVersion": "1.1.0"}))?;
        parse_result(&plugin, &out)
    }

    /// Executes one binary directly with exactly `env` (the environment is cleared first, like podman's
    /// sanitized env) and `stdin`, under the runtime's netns and deadline. For "bad input" tests.
    pub fn exec_raw(&self, bin: &Path, env: &[(&str, &str)], stdin: &[u8]) -> Result<RawOutput, RuntimeError> {
        let mut cmd = Command::new(bin);
        cmd.env_clear().envs(env.iter().copied());
        exec::run(cmd, bin, self.netns.as_deref(), stdin.to_vec(), self.timeout)
    }

    /// Runs one plugin with the CNI env of `command` (inheriting the runtime's env, like libcni) and turns
    /// a non-zero exit into a [`PluginError`].
    fn exec_plugin(
        &self,
        plugin: &Value,
        command: &str,
        conf: Option<&RuntimeConf>,
        stdin: &Value,
    ) -> Result<RawOutput, RuntimeError> {
        let name = config::plugin_type(plugin);
        let bin = exec::find_plugin(name, &self.bin_dirs)?;
        let cni_path = std::env::join_paths(&self.bin_dirs).expect("bin dirs contain no ':'");
        let mut cmd = Command::new(&bin);
        cmd.env("CNI_COMMAND", command).env("CNI_PATH", cni_path);
        if let Some(conf) = conf {
            cmd.env("CNI_CONTAINERID", &conf.container_id)
                .env("CNI_NETNS", &conf.netns)
                .env("CNI_IFNAME", &conf.ifname)
                .env("CNI_ARGS", conf.cni_args());
        }
        let out = exec::run(cmd, &bin, self.netns.as_deref(), stdin.to_string().into_bytes(), self.timeout)?;
        if out.status.success() {
            Ok(out)
        } else {
            Err(Box::new(plugin_error(name, &out)).into())
        }
    }
}

fn parse_result(plugin: &Value, out: &RawOutput) -> Result<Value, RuntimeError> {
    serde_json::from_slice::<Value>(&out.stdout)
        .map_err(|e| e.to_string())
        .and_then(|v| if v.is_object() { Ok(v) } else { Err("not a JSON object".into()) })
        .map_err(|reason| RuntimeError::BadResult {
            plugin: config::plugin_type(plugin).to_owned(),
            reason,
            stdout: out.stdout_str(),
        })
}

fn plugin_error(plugin: &str, out: &RawOutput) -> PluginError {
    let parsed: Option<Value> = serde_json::from_slice(&out.stdout).ok();
    let field = |k: &str| parsed.as_ref().and_then(|v| v.get(k)).and_then(Value::as_str).unwrap_or_default().to_owned();
    PluginError {
        plugin: plugin.to_owned(),
        code: parsed.as_ref().and_then(|v| v.get("code")).and_then(Value::as_u64),
        msg: field("msg"),
        details: field("details"),
        exit: out.status.code(),
        stdout: out.stdout_str(),
        stderr: out.stderr_str(),
    }
}

//! A fake CNI runtime that drives plugins exactly like libcni (what containerd, CRI-O and podman use):
//! conflist parsing, per-plugin config injection, prevResult threading, the result cache, and the
//! ADD/CHECK/DEL/STATUS/GC/VERSION commands, with a deadline on every exec.
//!
//! Checked against libcni v1.2.3 (`libcni/api.go`, `pkg/invoke`), including where it surprises: CHECK
//! runs without a prevResult when nothing is cached; DEL sends a prevResult only from cniVersion 0.4.0 on;
//! GC honours `disableGC`, runs every DEL and plugin GC and returns all failures; plugin results are decoded
//! as their own version and cached results handed on in the list's version; STATUS, GC and VERSION get
//! libcni's (empty or dummy) `CNI_*` variables. [`crate::node`] adds what containerd's CRI puts around it.

mod cache;
mod config;
mod error;
pub(crate) mod exec;
mod result;

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

    /// The result ADD cached for `conf` on `list`, if any, converted to the list's version (libcni's
    /// `GetNetworkListCachedResult`): the cache holds what the last plugin returned, in its own version.
    pub fn cached_result(&self, list: &NetworkConfigList, conf: &RuntimeConf) -> Result<Option<Value>, RuntimeError> {
        let Some(entry) = cache::load(&self.cache_dir, &list.name, conf).ok().flatten() else {
            // libcni ignores a cache file it cannot read: there is no cached result.
            return Ok(None);
        };
        let cached = |reason: String| RuntimeError::CachedResult { network: list.name.clone(), reason };
        if entry["kind"] != cache::KIND {
            return Err(cached(format!("cache entry has kind {}, not {}", entry["kind"], cache::KIND)));
        }
        result::convert(&entry["result"], &list.cni_version).map(Some).map_err(|e| {
            cached(format!("failed to convert cached result to config version {:?}: {e}", list.cni_version))
        })
    }

    /// CNI ADD: runs each plugin in order, each getting the previous one's result as `prevResult`. Each result
    /// is read as libcni does (a missing `cniVersion` is the list's; only the keys of its version are kept) and
    /// is otherwise left in the version the plugin chose: the last one is cached and returned as is.
    pub fn add(&self, list: &NetworkConfigList, conf: &RuntimeConf) -> Result<Value, RuntimeError> {
        let mut prev: Option<Value> = None;
        for plugin in &list.plugins {
            let stdin = config::plugin_stdin(list, plugin, prev.as_ref(), &conf.capability_args);
            let out = self.exec_plugin(plugin, "ADD", &Env::of(conf), &stdin)?;
            prev = Some(parse_result(plugin, &out, &list.cni_version)?);
        }
        let result = prev.expect("conflist has at least one plugin");
        cache::store(&self.cache_dir, list, conf, &result)?;
        Ok(result)
    }

    /// CNI CHECK like libcni's `CheckNetworkList`: an error for lists older than 0.4.0, a no-op with
    /// `disableCheck`, else each plugin in order with the cached result (in the list's version) as
    /// `prevResult`. With nothing cached the plugins still run, without a `prevResult`: libcni does not stop
    /// there, the plugins must refuse.
    pub fn check(&self, list: &NetworkConfigList, conf: &RuntimeConf) -> Result<(), RuntimeError> {
        if !list.version_at_least((0, 4, 0)) {
            return Err(RuntimeError::Config {
                source_name: list.name.clone(),
                reason: format!("configuration version {:?} does not support the CHECK command", list.cni_version),
            });
        }
        if list.disable_check {
            return Ok(());
        }
        let cached = self.cached_result(list, conf)?;
        for plugin in &list.plugins {
            let stdin = config::plugin_stdin(list, plugin, cached.as_ref(), &conf.capability_args);
            self.exec_plugin(plugin, "CHECK", &Env::of(conf), &stdin)?;
        }
        Ok(())
    }

    /// CNI DEL like libcni's `DelNetworkList`: the plugins in reverse order; from cniVersion 0.4.0 on with the
    /// cached result (in the list's version) as `prevResult`, before that never. A cache entry that cannot be
    /// read back is dropped and DEL runs without it. When every plugin succeeded the entry is removed; when
    /// one fails it stays, for the retry. Safe to repeat, also with an empty netns (`CNI_NETNS=""`), which
    /// containerd sends once the sandbox's netns is gone.
    pub fn del(&self, list: &NetworkConfigList, conf: &RuntimeConf) -> Result<(), RuntimeError> {
        let cached = if list.version_at_least((0, 4, 0)) {
            self.cached_result(list, conf).unwrap_or_else(|_| {
                let _ = cache::remove(&self.cache_dir, &list.name, conf);
                None
            })
        } else {
            None
        };
        for plugin in list.plugins.iter().rev() {
            let stdin = config::plugin_stdin(list, plugin, cached.as_ref(), &conf.capability_args);
            self.exec_plugin(plugin, "DEL", &Env::of(conf), &stdin)?;
        }
        // libcni ignores a failure to remove the entry.
        let _ = cache::remove(&self.cache_dir, &list.name, conf);
        Ok(())
    }

    /// CNI STATUS (1.1.0): asks every plugin whether it is ready for ADDs, stopping at the first that is not;
    /// a no-op for older lists.
    pub fn status(&self, list: &NetworkConfigList) -> Result<(), RuntimeError> {
        if !list.version_at_least((1, 1, 0)) {
            return Ok(());
        }
        for plugin in &list.plugins {
            let stdin = config::plugin_stdin(list, plugin, None, &Map::new());
            self.exec_plugin(plugin, "STATUS", &Env::empty(), &stdin)?;
        }
        Ok(())
    }

    /// CNI GC like libcni's `GCNetworkList`: nothing at all with `disableGC`; else a DEL of every cached
    /// attachment of this network that is not in `valid` (`(container_id, ifname)` pairs), then, for 1.1.0
    /// lists, GC on every plugin with the valid attachments injected (under both keys libcni sets). Every DEL
    /// and every GC runs even when an earlier one failed; the failures come back together as
    /// [`RuntimeError::Gc`].
    pub fn gc(&self, list: &NetworkConfigList, valid: &[(&str, &str)]) -> Result<(), RuntimeError> {
        if list.disable_gc {
            return Ok(());
        }
        let mut failures = Vec::new();
        // libcni gives up silently when it cannot list the cache.
        for entry in cache::entries(&self.cache_dir, &list.name).unwrap_or_default() {
            let id = entry["containerId"].as_str().unwrap_or_default();
            let ifname = entry["ifName"].as_str().unwrap_or_default();
            if valid.contains(&(id, ifname)) {
                continue;
            }
            let mut conf = RuntimeConf::new(id, entry["netns"].as_str().unwrap_or_default());
            conf.ifname = ifname.into();
            conf.args = serde_json::from_value(entry["cniArgs"].clone()).unwrap_or_default();
            conf.capability_args = serde_json::from_value(entry["capabilityArgs"].clone()).unwrap_or_default();
            if let Err(e) = self.del(list, &conf) {
                failures.push((format!("failed to delete stale attachment {id} {ifname}"), e));
            }
        }
        if list.version_at_least((1, 1, 0)) {
            let attachments: Vec<Value> =
                valid.iter().map(|(id, ifname)| json!({"containerID": id, "ifname": ifname})).collect();
            for plugin in &list.plugins {
                let mut stdin = config::plugin_stdin(list, plugin, None, &Map::new());
                stdin["cni.dev/valid-attachments"] = Value::Array(attachments.clone());
                stdin["cni.dev/attachments"] = Value::Array(attachments.clone());
                if let Err(e) = self.exec_plugin(plugin, "GC", &Env::empty(), &stdin) {
                    failures.push((format!("failed to GC plugin {}", config::plugin_type(plugin)), e));
                }
            }
        }
        if failures.is_empty() {
            Ok(())
        } else {
            Err(RuntimeError::Gc(failures))
        }
    }

    /// CNI VERSION: returns the plugin's version info (`{cniVersion, supportedVersions}`), asked like libcni's
    /// `GetVersionInfo` (dummy netns, ifname and path for plugins built on an old skel).
    pub fn version(&self, plugin_type: &str) -> Result<Value, RuntimeError> {
        let plugin = json!({"type": plugin_type});
        let env = Env { container_id: "", netns: Path::new("dummy"), ifname: "dummy", args: String::new() };
        let out =
            self.exec_plugin_with_path(&plugin, "VERSION", &env, &json!({"cniVersion": "1.1.0"}), Some("dummy"))?;
        serde_json::from_slice::<Value>(&out.stdout).ok().filter(Value::is_object).ok_or_else(|| {
            RuntimeError::BadResult {
                plugin: plugin_type.to_owned(),
                reason: "not a JSON object".into(),
                stdout: out.stdout_str(),
            }
        })
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
    fn exec_plugin(&self, plugin: &Value, command: &str, env: &Env, stdin: &Value) -> Result<RawOutput, RuntimeError> {
        self.exec_plugin_with_path(plugin, command, env, stdin, None)
    }

    fn exec_plugin_with_path(
        &self,
        plugin: &Value,
        command: &str,
        env: &Env,
        stdin: &Value,
        cni_path: Option<&str>,
    ) -> Result<RawOutput, RuntimeError> {
        let name = config::plugin_type(plugin);
        let bin = exec::find_plugin(name, &self.bin_dirs)?;
        let path = std::env::join_paths(&self.bin_dirs).expect("bin dirs contain no ':'");
        let mut cmd = Command::new(&bin);
        // libcni's `Args.AsEnv`: all six variables on every command, empty when not applicable.
        cmd.env("CNI_COMMAND", command)
            .env("CNI_CONTAINERID", env.container_id)
            .env("CNI_NETNS", env.netns)
            .env("CNI_ARGS", &env.args)
            .env("CNI_IFNAME", env.ifname)
            .env("CNI_PATH", cni_path.map_or(path, Into::into));
        let out = exec::run(cmd, &bin, self.netns.as_deref(), stdin.to_string().into_bytes(), self.timeout)?;
        if out.status.success() {
            Ok(out)
        } else {
            Err(Box::new(plugin_error(name, &out)).into())
        }
    }
}

/// The per-attachment part of a plugin's environment.
struct Env<'a> {
    container_id: &'a str,
    netns: &'a Path,
    ifname: &'a str,
    args: String,
}

impl<'a> Env<'a> {
    fn of(conf: &'a RuntimeConf) -> Self {
        Self { container_id: &conf.container_id, netns: &conf.netns, ifname: &conf.ifname, args: conf.cni_args() }
    }

    /// STATUS and GC: no attachment.
    fn empty() -> Self {
        Self { container_id: "", netns: Path::new(""), ifname: "", args: String::new() }
    }
}

fn parse_result(plugin: &Value, out: &RawOutput, conf_version: &str) -> Result<Value, RuntimeError> {
    result::from_plugin(&out.stdout, conf_version).map_err(|reason| RuntimeError::BadResult {
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

//! Network configuration lists (`.conflist`) and the per-plugin config a runtime derives from them.

use std::path::{Path, PathBuf};

use serde_json::{json, Map, Value};

use super::error::RuntimeError;

/// A parsed `.conflist`: `{cniVersion, name, disableCheck?, plugins: [...]}`; kept as JSON so tests can
/// feed arbitrary (also odd) plugin configs through.
#[derive(Debug, Clone)]
pub struct NetworkConfigList {
    /// The list's `cniVersion`, injected into every plugin config.
    pub cni_version: String,
    /// The network name, injected into every plugin config and part of the cache key.
    pub name: String,
    /// `disableCheck`: CHECK becomes a no-op, as in libcni.
    pub disable_check: bool,
    /// `disableGC` (spec 1.1, libcni 1.2.1): GC does nothing at all, neither the DELs of stale attachments
    /// nor the plugins' GC.
    pub disable_gc: bool,
    /// Plugin configs in order; each has at least `type`.
    pub plugins: Vec<Value>,
    /// The whole list as given.
    pub raw: Value,
}

impl NetworkConfigList {
    /// Parses a conflist from JSON, validating what libcni validates (name, cniVersion, plugins[].type).
    pub fn from_value(raw: Value) -> Result<Self, RuntimeError> {
        Self::parse(raw, "<inline>")
    }

    /// Reads and parses a `.conflist` file.
    pub fn from_file(path: &Path) -> Result<Self, RuntimeError> {
        let name = path.display().to_string();
        let text = std::fs::read(path).map_err(|e| config_err(&name, e.to_string()))?;
        let raw: Value = serde_json::from_slice(&text).map_err(|e| config_err(&name, e.to_string()))?;
        Self::parse(raw, &name)
    }

    /// Loads the network a runtime takes from the conf dir `dir`, as containerd does through libcni: of the
    /// files libcni's `ConfFiles` lists (`.conf`, `.conflist`, `.json`; no dirs), in lexical order, the first.
    /// A `.conflist` loads as a list; any other one as a single plugin config, which needs a `type` (so a list
    /// in a `.conf` does not load) and is wrapped into a list of its own `name` and `cniVersion`, as libcni's
    /// `ConfListFromConf`. Containerd stops at a first file that does not load and the node stays NotReady, so
    /// this errors too instead of trying the next file. Returns the file and the list.
    pub fn from_conf_dir(dir: &Path) -> Result<(PathBuf, Self), RuntimeError> {
        let dir_name = dir.display().to_string();
        let mut files = Vec::new();
        for entry in std::fs::read_dir(dir).map_err(|e| config_err(&dir_name, e.to_string()))? {
            let entry = entry.map_err(|e| config_err(&dir_name, e.to_string()))?;
            let path = entry.path();
            let listed = path.extension().is_some_and(|e| e == "conf" || e == "conflist" || e == "json");
            if listed && !entry.file_type().is_ok_and(|t| t.is_dir()) {
                files.push(path);
            }
        }
        files.sort();
        let first = files.into_iter().next().ok_or_else(|| config_err(&dir_name, "no network config found"))?;
        let list = Self::from_conf_file(&first)?;
        Ok((first, list))
    }

    /// Reads one file of a conf dir the way libcni does by its name: a `.conflist` as a list, anything else as
    /// a single plugin config with a `type`, wrapped into a list of its own `name` and `cniVersion`.
    pub fn from_conf_file(path: &Path) -> Result<Self, RuntimeError> {
        if path.extension().is_some_and(|e| e == "conflist") {
            return Self::from_file(path);
        }
        let name = path.display().to_string();
        let text = std::fs::read(path).map_err(|e| config_err(&name, e.to_string()))?;
        let conf: Value = serde_json::from_slice(&text).map_err(|e| config_err(&name, e.to_string()))?;
        if conf.get("type").and_then(Value::as_str).is_none_or(str::is_empty) {
            return Err(config_err(&name, "missing 'type' in a single plugin config (a list in a .conf?)"));
        }
        let list = json!({"cniVersion": conf.get("cniVersion"), "name": conf.get("name"), "plugins": [conf]});
        Self::parse(list, &name)
    }

    fn parse(raw: Value, source_name: &str) -> Result<Self, RuntimeError> {
        let field = |key: &str| raw.get(key).and_then(Value::as_str).map(str::to_owned);
        let name = field("name").ok_or_else(|| config_err(source_name, "missing string \"name\""))?;
        let cni_version =
            field("cniVersion").ok_or_else(|| config_err(source_name, "missing string \"cniVersion\""))?;
        let plugins = raw
            .get("plugins")
            .and_then(Value::as_array)
            .filter(|p| !p.is_empty())
            .ok_or_else(|| config_err(source_name, "\"plugins\" must be a non-empty array"))?
            .clone();
        if let Some(i) = plugins.iter().position(|p| p.get("type").and_then(Value::as_str).is_none()) {
            return Err(config_err(source_name, format!("plugins[{i}] has no string \"type\"")));
        }
        let disable_check = raw.get("disableCheck").and_then(Value::as_bool).unwrap_or(false);
        let disable_gc = raw.get("disableGC").and_then(Value::as_bool).unwrap_or(false);
        Ok(Self { cni_version, name, disable_check, disable_gc, plugins, raw })
    }

    /// The list's version is at least `major.minor.patch` (e.g. CHECK needs 0.4.0, STATUS/GC 1.1.0).
    pub fn version_at_least(&self, min: (u32, u32, u32)) -> bool {
        parse_version(&self.cni_version).is_some_and(|v| v >= min)
    }
}

/// The `type` of a plugin config (validated at parse time).
pub(super) fn plugin_type(plugin: &Value) -> &str {
    plugin.get("type").and_then(Value::as_str).unwrap_or_default()
}

/// Builds the stdin for one plugin exactly like libcni's `buildOneConfig`: `cniVersion` and `name` from the
/// list, `prevResult` when given, and `runtimeConfig` holding the capability args the plugin declares in
/// `capabilities` (only when at least one matches).
pub(super) fn plugin_stdin(
    list: &NetworkConfigList,
    plugin: &Value,
    prev_result: Option<&Value>,
    capability_args: &Map<String, Value>,
) -> Value {
    let mut conf = plugin.as_object().cloned().unwrap_or_default();
    conf.insert("cniVersion".into(), Value::String(list.cni_version.clone()));
    conf.insert("name".into(), Value::String(list.name.clone()));
    if let Some(prev) = prev_result {
        conf.insert("prevResult".into(), prev.clone());
    }
    let runtime_config: Map<String, Value> = plugin
        .get("capabilities")
        .and_then(Value::as_object)
        .into_iter()
        .flatten()
        .filter(|(_, enabled)| enabled.as_bool() == Some(true))
        .filter_map(|(cap, _)| capability_args.get(cap).map(|v| (cap.clone(), v.clone())))
        .collect();
    if !runtime_config.is_empty() {
        conf.insert("runtimeConfig".into(), Value::Object(runtime_config));
    }
    Value::Object(conf)
}

fn parse_version(v: &str) -> Option<(u32, u32, u32)> {
    let mut parts = v.split('.').map(|p| p.parse::<u32>().ok());
    Some((parts.next()??, parts.next()??, parts.next().unwrap_or(Some(0))?))
}

fn config_err(source_name: &str, reason: impl Into<String>) -> RuntimeError {
    RuntimeError::Config { source_name: source_name.to_owned(), reason: reason.into() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn list() -> NetworkConfigList {
        NetworkConfigList::from_value(json!({
            "cniVersion": "1.0.0", "name": "net",
            "plugins": [{"type": "a", "capabilities": {"portMappings": true, "bandwidth": false}}]
        }))
        .unwrap()
    }

    #[test]
    fn injects_version_name_prev_result_and_declared_capabilities_only() {
        let caps: Map<String, Value> =
            json!({"portMappings": [{"hostPort": 1}], "bandwidth": {"x": 1}, "ips": ["1.2.3.4"]})
                .as_object()
                .unwrap()
                .clone();
        let l = list();
        let stdin = plugin_stdin(&l, &l.plugins[0], Some(&json!({"ips": []})), &caps);
        assert_eq!(stdin["cniVersion"], "1.0.0");
        assert_eq!(stdin["name"], "net");
        assert_eq!(stdin["prevResult"], json!({"ips": []}));
        assert_eq!(stdin["runtimeConfig"], json!({"portMappings": [{"hostPort": 1}]}));
    }

    #[test]
    fn no_runtime_config_without_matching_capability() {
        let l = list();
        let stdin = plugin_stdin(&l, &l.plugins[0], None, &Map::new());
        assert!(stdin.get("runtimeConfig").is_none(), "{stdin}");
        assert!(stdin.get("prevResult").is_none(), "{stdin}");
    }

    #[test]
    fn rejects_plugin_without_type() {
        let err =
            NetworkConfigList::from_value(json!({"cniVersion": "1.0.0", "name": "n", "plugins": [{}]})).unwrap_err();
        assert!(err.to_string().contains("plugins[0]"), "{err}");
    }

    #[test]
    fn a_conf_dir_loads_its_first_file_like_libcni() {
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, v: Value| std::fs::write(dir.path().join(name), v.to_string()).unwrap();
        let single = json!({"cniVersion": "1.0.0", "name": "single", "type": "bridge"});
        write("20-list.conflist", json!({"cniVersion": "1.0.0", "name": "list", "plugins": [{"type": "b"}]}));
        write(".tmp-99", single.clone());
        write("00-notes.txt", single.clone());
        std::fs::create_dir(dir.path().join("00-dir.conf")).unwrap();
        let (file, list) = NetworkConfigList::from_conf_dir(dir.path()).unwrap();
        assert_eq!((file.file_name().unwrap().to_str(), list.name.as_str()), (Some("20-list.conflist"), "list"));

        write("10-single.conf", single);
        let (file, list) = NetworkConfigList::from_conf_dir(dir.path()).unwrap();
        assert!(file.ends_with("10-single.conf"));
        assert_eq!(
            (list.name.as_str(), list.cni_version.as_str(), plugin_type(&list.plugins[0])),
            ("single", "1.0.0", "bridge")
        );

        write("05-list-in-a.conf", json!({"cniVersion": "1.0.0", "name": "l", "plugins": [{"type": "b"}]}));
        let err = NetworkConfigList::from_conf_dir(dir.path()).unwrap_err().to_string();
        assert!(err.contains("05-list-in-a.conf") && err.contains("type"), "{err}");
    }

    #[test]
    fn compares_versions() {
        let l = list();
        assert!(l.version_at_least((0, 4, 0)));
        assert!(!l.version_at_least((1, 1, 0)));
    }
}

/// The per-attachment parameters a runtime passes to plugins (libcni's `RuntimeConf`).
#[derive(Debug, Clone)]
pub struct RuntimeConf {
    /// `CNI_CONTAINERID`.
    pub container_id: String,
    /// `CNI_NETNS`: path of the pod's network namespace.
    pub netns: PathBuf,
    /// `CNI_IFNAME`.
    pub ifname: String,
    /// `CNI_ARGS` pairs, joined as `K=V;K=V` in this order.
    pub args: Vec<(String, String)>,
    /// Capability args (e.g. `portMappings`), given to plugins that declare the capability as `runtimeConfig`.
    pub capability_args: Map<String, Value>,
}

impl RuntimeConf {
    /// An attachment of container `container_id` in netns `netns` on `eth0`, without args.
    pub fn new(container_id: impl Into<String>, netns: impl Into<PathBuf>) -> Self {
        Self {
            container_id: container_id.into(),
            netns: netns.into(),
            ifname: "eth0".into(),
            args: Vec::new(),
            capability_args: Map::new(),
        }
    }

    /// Adds a `CNI_ARGS` pair.
    pub fn arg(mut self, key: &str, value: &str) -> Self {
        self.args.push((key.into(), value.into()));
        self
    }

    /// Sets a capability arg (what kubelet/podman put in `runtimeConfig`, e.g. `portMappings`).
    pub fn capability(mut self, name: &str, value: Value) -> Self {
        self.capability_args.insert(name.into(), value);
        self
    }

    pub(super) fn cni_args(&self) -> String {
        self.args.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(";")
    }
}

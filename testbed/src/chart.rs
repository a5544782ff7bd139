//! Rendering the Helm chart in `charts/istio-cni` with the real helm binary (installed and sha256-checked by
//! scripts/install-helm.sh) and looking at the result the way `kubectl` would: objects by kind and name,
//! containers, their env and mounts. Also reads the env names each binary accepts from its `--help`.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

use crate::bins;

/// Namespace every render uses (the chart works in any).
pub const NAMESPACE: &str = "istio-system";
/// Kubernetes version renders and validation assume, so the output does not depend on helm's default.
pub const KUBE_VERSION: &str = "1.32.0";
/// The service account istio-cni-node runs as: install-cni, the node agent, and the plugin through the
/// kubeconfig install-cni writes (as the chart names it).
pub const CNI_SERVICE_ACCOUNT: &str = "istio-cni";
/// The service account the bundled node proxy runs as (as the chart names it).
pub const PROXY_SERVICE_ACCOUNT: &str = "hbone-proxy";
/// The kinds that make up the chart's RBAC: who its pods run as and what they may do.
const RBAC_KINDS: [&str; 5] = ["ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"];

/// The chart's directory.
pub fn chart_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../charts/istio-cni")
}

/// The helm binary: `$HELM`, else `helm` on PATH.
pub fn helm() -> Command {
    Command::new(std::env::var_os("HELM").unwrap_or_else(|| "helm".into()))
}

/// Runs a command to completion; panics naming the program when it cannot be started.
pub fn output(cmd: &mut Command) -> Output {
    cmd.output().unwrap_or_else(|e| panic!("run {:?}: {e} (run scripts/install-deps.sh)", cmd.get_program()))
}

/// `helm template istio-cni <chart> -n istio-system --set <each>`: the rendered text, or helm's stderr.
pub fn template(sets: &[&str]) -> Result<String, String> {
    let mut cmd = helm();
    cmd.args(["template", "istio-cni"]).arg(chart_dir()).args([
        "--namespace",
        NAMESPACE,
        "--kube-version",
        KUBE_VERSION,
    ]);
    for set in sets {
        cmd.args(["--set", set]);
    }
    let out = output(&mut cmd);
    if out.status.success() {
        Ok(String::from_utf8(out.stdout).expect("helm prints UTF-8"))
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// The objects of a render.
#[derive(Debug, Clone)]
pub struct Rendered {
    /// The objects in render order.
    pub objects: Vec<Value>,
}

impl Rendered {
    /// Renders with `sets`; panics with helm's message if it refuses.
    pub fn new(sets: &[&str]) -> Self {
        let text = template(sets).unwrap_or_else(|e| panic!("helm template {sets:?} failed:\n{e}"));
        Self::parse(&text)
    }

    /// Splits a multi-document YAML stream into objects (empty documents skipped).
    pub fn parse(text: &str) -> Self {
        let objects = serde_yaml::Deserializer::from_str(text)
            .map(|doc| serde::Deserialize::deserialize(doc).expect("rendered YAML parses"))
            .filter(|v: &Value| !v.is_null())
            .collect();
        Self { objects }
    }

    /// The object of `kind` named `name`, if rendered.
    pub fn find(&self, kind: &str, name: &str) -> Option<&Value> {
        self.objects.iter().find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
    }

    /// The object of `kind` named `name`; panics listing what was rendered.
    pub fn get(&self, kind: &str, name: &str) -> &Value {
        self.find(kind, name).unwrap_or_else(|| panic!("no {kind}/{name} rendered; have {:?}", self.names()))
    }

    /// `Kind/name` of every object.
    pub fn names(&self) -> Vec<String> {
        self.objects
            .iter()
            .map(|o| format!("{}/{}", o["kind"].as_str().unwrap_or("?"), o["metadata"]["name"]))
            .collect()
    }

    /// The pod spec of DaemonSet `name`.
    pub fn pod_spec(&self, daemonset: &str) -> &Value {
        &self.get("DaemonSet", daemonset)["spec"]["template"]["spec"]
    }

    /// Container `name` of DaemonSet `daemonset`, if present.
    pub fn container(&self, daemonset: &str, name: &str) -> Option<&Value> {
        self.pod_spec(daemonset)["containers"].as_array()?.iter().find(|c| c["name"] == name)
    }

    /// Every (DaemonSet name, container) pair rendered.
    pub fn containers(&self) -> Vec<(String, Value)> {
        let mut out = Vec::new();
        for ds in self.objects.iter().filter(|o| o["kind"] == "DaemonSet") {
            let name = ds["metadata"]["name"].as_str().unwrap_or_default().to_owned();
            for container in list(&ds["spec"]["template"]["spec"]["containers"]) {
                out.push((name.clone(), container));
            }
        }
        out
    }

    /// The env a container gets: its `env` entries plus the keys of every ConfigMap in its `envFrom`.
    pub fn env_names(&self, container: &Value) -> BTreeSet<String> {
        let mut names: BTreeSet<String> =
            list(&container["env"]).iter().filter_map(|e| e["name"].as_str()).map(str::to_owned).collect();
        for source in list(&container["envFrom"]) {
            let map = source["configMapRef"]["name"].as_str().expect("envFrom names a ConfigMap");
            names.extend(self.config_map(map).keys().cloned());
        }
        names
    }

    /// The value a container gets for `name` from its ConfigMaps (the chart puts plain values there).
    pub fn env_value(&self, container: &Value, name: &str) -> Option<String> {
        list(&container["envFrom"])
            .iter()
            .filter_map(|s| s["configMapRef"]["name"].as_str())
            .find_map(|map| self.config_map(map).get(name).cloned())
    }

    /// The data of ConfigMap `name`.
    pub fn config_map(&self, name: &str) -> std::collections::BTreeMap<String, String> {
        let data = &self.get("ConfigMap", name)["data"];
        data.as_object()
            .into_iter()
            .flatten()
            .map(|(k, v)| (k.clone(), v.as_str().expect("ConfigMap values are strings").to_owned()))
            .collect()
    }

    /// The rendered service accounts, roles and bindings, in render order: what an API server enforcing RBAC
    /// is seeded with.
    pub fn rbac(&self) -> Vec<Value> {
        self.objects.iter().filter(|o| RBAC_KINDS.iter().any(|k| o["kind"] == *k)).cloned().collect()
    }

    /// The rules of ClusterRole `name` as `(resource, verb)` pairs.
    pub fn grants(&self, role: &str) -> BTreeSet<(String, String)> {
        let mut grants = BTreeSet::new();
        for rule in list(&self.get("ClusterRole", role)["rules"]) {
            for resource in list(&rule["resources"]) {
                for verb in list(&rule["verbs"]) {
                    grants.insert((resource.as_str().unwrap().to_owned(), verb.as_str().unwrap().to_owned()));
                }
            }
        }
        grants
    }
}

/// A JSON array's items, or nothing.
pub fn list(v: &Value) -> Vec<Value> {
    v.as_array().cloned().unwrap_or_default()
}

/// The env names `binary` (a workspace binary in target/debug) reads: every `[env: NAME=...]` of its `--help`.
pub fn accepted_env(binary: &str) -> BTreeSet<String> {
    let out = output(Command::new(bins::path(binary)).arg("--help").env_clear());
    assert!(out.status.success(), "{binary} --help failed: {}", String::from_utf8_lossy(&out.stderr));
    let help = String::from_utf8(out.stdout).expect("help is UTF-8");
    let names: BTreeSet<String> = help
        .split("[env: ")
        .skip(1)
        .map(|rest| rest.split('=').next().expect("split yields one piece").to_owned())
        .collect();
    assert!(names.len() > 3, "{binary} --help lists no env vars:\n{help}");
    names
}

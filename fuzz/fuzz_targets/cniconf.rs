//! install-cni's CNI config handling on arbitrary file content, read as a `.conf` and as a `.conflist`: libcni's
//! load rules (discovery, on a file in a tmpfs dir), inserting our entry and removing it again. Invariants:
//! whatever insertion accepts comes out as a config list holding every original plugin, unchanged and in order,
//! with our entry exactly once and last; a loadable input stays loadable; inserting twice changes nothing;
//! removing our entry gives the list back.

#![no_main]

use std::path::Path;
use std::sync::OnceLock;

use installer::cniconf::{find_primary, insert, remove_entry, standalone, ConfForm, PluginEntry, PLUGIN_TYPE};
use istio_contract::enablement::Selectors;
use istio_contract::paths;
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

/// A scratch conf dir in tmpfs, so discovery reads real files at memory speed.
fn conf_dir() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| tempfile::Builder::new().prefix("fuzz-cniconf").tempdir_in("/dev/shm").unwrap()).path()
}

/// Whether discovery would pick `data` as the primary config when it is named `name`.
fn loadable_as(data: &[u8], name: &str) -> bool {
    let path = conf_dir().join(name);
    std::fs::write(&path, data).unwrap();
    let found = find_primary(conf_dir(), None, None).expect("the conf dir is listable");
    std::fs::remove_file(&path).unwrap();
    found.as_deref() == Some(path.as_path())
}

/// Our entry as it appears inside a list: the standalone config without its cniVersion.
fn list_entry(entry: &PluginEntry) -> Value {
    let mut value: Value = serde_json::from_slice(&standalone(entry)).unwrap();
    value.as_object_mut().unwrap().shift_remove("cniVersion");
    value
}

fn entry() -> PluginEntry {
    PluginEntry {
        plugin_log_level: "info".into(),
        cni_agent_run_dir: paths::RUN_DIR.into(),
        ambient_enabled: true,
        enablement_selectors: Selectors::default().to_json(),
        exclude_namespaces: Some(vec!["kube-system".into()]),
        pod_namespace: "istio-system".into(),
        native_nftables: false,
        enable_ambient_detection_retry: true,
    }
}

fn is_ours(plugin: &Value) -> bool {
    plugin.get("type").and_then(Value::as_str) == Some(PLUGIN_TYPE)
}

/// The invariants for `data` in a file named `name`, which libcni reads as `form`.
fn check(data: &[u8], name: &str, form: ConfForm) {
    let loadable = loadable_as(data, name);
    let entry = entry();
    let Ok(out) = insert(data, &entry, form) else {
        assert!(!loadable, "insertion refused a config libcni would load");
        return;
    };
    let original: Value = serde_json::from_slice(data).expect("insert accepted it, so it is JSON");
    let written: Value = serde_json::from_slice(&out).expect("insert writes JSON");
    assert!(out.ends_with(b"\n"));
    let plugins = written["plugins"].as_array().expect("insert writes a list");
    let (last, before) = plugins.split_last().expect("at least our entry");
    assert_eq!(last, &list_entry(&entry), "our entry is last");
    if form == ConfForm::Single && original.get("type").is_some() {
        // A single-plugin config is wrapped, whatever its type, minus its cniVersion.
        let mut single = original.as_object().expect("an object").clone();
        single.shift_remove("cniVersion");
        assert_eq!(before, [Value::Object(single)], "the wrapped plugin is the original");
        assert_eq!(written["cniVersion"], "0.3.1");
        if is_ours(&original) {
            // Our own standalone config wrapped as a primary (Istio does the same) holds our entry twice; the
            // next insertion drops both copies, so this one input is not idempotent. Discovery only offers it
            // when a stale standalone file sorts first (its default name, YYY-istio-cni.conf, sorts last).
            return;
        }
    } else {
        let kept: Vec<&Value> =
            original["plugins"].as_array().expect("a list").iter().filter(|p| !is_ours(p)).collect();
        assert!(before.iter().all(|p| !is_ours(p)), "our entry appears once");
        assert_eq!(before.iter().collect::<Vec<_>>(), kept, "every other plugin is kept, in order");
        let mut top = original.as_object().expect("an object").clone();
        let mut got = written.as_object().expect("an object").clone();
        top.shift_remove("plugins");
        got.shift_remove("plugins");
        assert_eq!(got, top, "the list's own fields are kept");
        let removed = remove_entry(&out).expect("our own output can be cleaned up");
        assert_eq!(removed, remove_entry(data).expect("the input list can be cleaned up"), "cleanup restores the list");
    }
    let again = insert(&out, &entry, ConfForm::List).expect("our own output is accepted");
    assert_eq!(again, out, "inserting twice changed the file");
    if loadable {
        assert!(loadable_as(&out, "10-primary.conflist"), "a loadable config became unloadable");
    }
}

fuzz_target!(|data: &[u8]| {
    check(data, "10-primary.conf", ConfForm::Single);
    check(data, "10-primary.conflist", ConfForm::List);
});

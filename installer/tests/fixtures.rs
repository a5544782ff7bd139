//! Reproduces Istio's install-cni fixtures (copied into `tests/data`, see its README) on temp dirs:
//! the merge cases, the "write the CNI config into the net dir" table (each case run twice), the
//! validity checks, cleanup, the kubeconfig goldens, and the integration cases whose expected files
//! are pure functions of the inputs. Outputs are compared byte for byte, final newline included.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use installer::atomic::{is_temp_name, remove_stale_temps, write_atomic, TEMP_PREFIX};
use installer::cniconf::{
    apply, check, cleanup, complete_conversions, desired, find_primary, insert, remove_entry, standalone, Change,
    ConfForm, ConfSettings, Invalid, Malformed, PluginEntry,
};
use installer::kubeconfig::{render, KubeconfigError, KubeconfigSettings};
use serde_json::json;

fn data(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(rel)
}

fn read(rel: &str) -> Vec<u8> {
    fs::read(data(rel)).unwrap_or_else(|e| panic!("reading fixture {rel}: {e}"))
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The entry every unit golden carries.
fn unit_entry(ambient: bool) -> PluginEntry {
    PluginEntry {
        plugin_log_level: "debug".into(),
        cni_agent_run_dir: "/path/to/kubeconfig".into(),
        ambient_enabled: ambient,
        enablement_selectors: json!([]),
        exclude_namespaces: None,
        pod_namespace: "my-namespace".into(),
        native_nftables: false,
        enable_ambient_detection_retry: false,
    }
}

/// The entry the integration agent settings produce.
fn integration_entry() -> PluginEntry {
    PluginEntry {
        plugin_log_level: "debug".into(),
        cni_agent_run_dir: "/tmp".into(),
        ambient_enabled: false,
        enablement_selectors: json!([]),
        exclude_namespaces: Some(vec!["istio-system".into()]),
        pod_namespace: String::new(),
        native_nftables: false,
        enable_ambient_detection_retry: false,
    }
}

fn settings(chained: bool, conf_name: Option<&str>, owned: Option<&str>, ambient: bool) -> ConfSettings {
    ConfSettings { chained, conf_name: conf_name.map(str::to_owned), owned_filename: owned.map(str::to_owned), ambient }
}

/// A temp net dir filled from fixtures.
struct NetDir(tempfile::TempDir);

impl NetDir {
    fn new(files: &[(&str, &str)]) -> Self {
        let dir = NetDir(tempfile::tempdir().expect("temp dir"));
        for (src, name) in files {
            fs::write(dir.path(name), read(src)).expect("copy fixture");
            // Whatever the umask: the mode a primary CNI typically leaves.
            fs::set_permissions(dir.path(name), fs::Permissions::from_mode(FIXTURE_MODE)).expect("chmod fixture");
        }
        dir
    }
    fn root(&self) -> &Path {
        self.0.path()
    }
    fn path(&self, name: &str) -> PathBuf {
        self.0.path().join(name)
    }
    fn read(&self, name: &str) -> String {
        text(&fs::read(self.path(name)).unwrap_or_else(|e| panic!("reading {name}: {e}")))
    }
    fn mode(&self, name: &str) -> u32 {
        fs::metadata(self.path(name)).expect("stat").permissions().mode() & 0o7777
    }
    fn names(&self) -> Vec<String> {
        let mut names: Vec<String> =
            fs::read_dir(self.root()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        names.sort();
        names
    }
}

/// Plans and applies once, as one pass of the installer; `None` when there is nothing to write yet.
fn install(dir: &NetDir, settings: &ConfSettings, entry: &PluginEntry) -> Option<Change> {
    desired(dir.root(), settings, entry).expect("plan").map(|plan| apply(&plan).expect("apply"))
}

// ---------------------------------------------------------------------------------------------
// Merging an istio entry into an existing file.

#[test]
fn merge_goldens() {
    let entry = unit_entry(false);
    for (existing, golden) in [
        ("unit/bridge.conf", "unit/bridge.conf.golden"),
        ("unit/list.conflist", "unit/list.conflist.golden"),
        ("unit/list-with-istio.conflist", "unit/list-with-istio.conflist.golden"),
    ] {
        let merged = insert(&read(existing), &entry, ConfForm::of(Path::new(existing)))
            .unwrap_or_else(|e| panic!("{existing}: {e}"));
        assert_eq!(text(&merged), text(&read(golden)), "{existing}");
    }
}

/// Istio's fifth merge case feeds `invalid-arr.conflist` as the *new* config; our entry is a typed
/// struct, so that input cannot be constructed.
#[test]
fn merge_rejects_malformed_existing_configs() {
    let entry = unit_entry(false);
    assert!(matches!(insert(&read("unit/invalid-map.conflist"), &entry, ConfForm::List), Err(Malformed::NoPluginList)));
    assert!(matches!(insert(&read("unit/invalid-arr.conflist"), &entry, ConfForm::List), Err(Malformed::NotObject)));
    assert!(matches!(
        insert(&read("integration/pre/non_json.conf"), &entry, ConfForm::Single),
        Err(Malformed::NotJson(_))
    ));
    let bad_plugin = br#"{"name":"x","plugins":[{"type":"bridge"},7]}"#;
    assert!(matches!(insert(bad_plugin, &entry, ConfForm::List), Err(Malformed::PluginNotObject(1))));
}

/// Found by the cniconf fuzzer: libcni reads a `.conflist` as a list whatever top-level fields it has, so a
/// stray `type` there must not make us wrap the whole list as one plugin (Istio does, and breaks the node).
#[test]
fn a_conflist_with_a_stray_top_level_type_stays_a_list() {
    let dir = tempfile::tempdir().unwrap();
    let existing = br#"{"name":"n","type":"","plugins":[{"type":"bridge"},{"type":"tuning"}]}"#;
    fs::write(dir.path().join("10-net.conflist"), existing).unwrap();
    let primary = find_primary(dir.path(), None, None).unwrap().expect("libcni loads it as a list");
    let merged = insert(existing, &unit_entry(false), ConfForm::of(&primary)).unwrap();
    let merged: serde_json::Value = serde_json::from_slice(&merged).unwrap();
    let types: Vec<&str> = merged["plugins"].as_array().unwrap().iter().map(|p| p["type"].as_str().unwrap()).collect();
    assert_eq!(types, ["bridge", "tuning", "istio-cni"]);
    // The same bytes in a `.conf` are one plugin to libcni (with an empty type it is not loadable at all), and a
    // `.conf` with a real type and a stray `plugins` is still wrapped whole.
    let single = br#"{"name":"n","type":"bridge","plugins":[{"type":"tuning"}]}"#;
    let wrapped: serde_json::Value =
        serde_json::from_slice(&insert(single, &unit_entry(false), ConfForm::Single).unwrap()).unwrap();
    assert_eq!(wrapped["plugins"][0]["type"], "bridge");
    assert_eq!(wrapped["plugins"].as_array().unwrap().len(), 2);
}

#[test]
fn merge_replaces_every_old_istio_entry_and_appends_ours_last() {
    let existing = br#"{"name":"n","cniVersion":"1.0.0","plugins":[
        {"type":"istio-cni","old":1},{"type":"bridge"},{"type":"istio-cni","old":2},{"type":"tuning"}]}"#;
    let merged: serde_json::Value =
        serde_json::from_slice(&insert(existing, &unit_entry(true), ConfForm::List).unwrap()).unwrap();
    let types: Vec<&str> = merged["plugins"].as_array().unwrap().iter().map(|p| p["type"].as_str().unwrap()).collect();
    assert_eq!(types, ["bridge", "tuning", "istio-cni"]);
    assert_eq!(merged["plugins"][2]["ambient_enabled"], json!(true));
    assert!(merged["plugins"][2].get("cniVersion").is_none());
}

#[test]
fn standalone_config_is_the_istio_cni_conf_fixture() {
    assert_eq!(text(&standalone(&unit_entry(false))), text(&read("unit/istio-cni.conf")));
    assert_eq!(text(&standalone(&integration_entry())), text(&read("integration/expected/YYY-istio-cni.conf")));
}

#[test]
fn removing_the_entry_restores_the_list() {
    let cleaned = remove_entry(&read("unit/list-with-istio.conflist")).unwrap();
    assert_eq!(text(&cleaned), text(&read("unit/list-no-istio.conflist")));
    let cleaned = remove_entry(&read("integration/expected/10-calico.conflist-istioconfig")).unwrap();
    assert_eq!(text(&cleaned), text(&read("integration/pre/calico.conflist")), "canonical input comes back identical");
    let cleaned = remove_entry(&read("integration/expected/minikube_cni.conflist.expected")).unwrap();
    assert_eq!(text(&cleaned), text(&read("integration/expected/minikube_cni.conflist.clean")));
    assert!(matches!(remove_entry(&read("unit/invalid-map.conflist")), Err(Malformed::NoPluginList)));
}

// ---------------------------------------------------------------------------------------------
// Writing the CNI config into the net dir (every case twice with identical settings).

struct WriteCase {
    chained: bool,
    conf_name: Option<&'static str>,
    files: &'static [(&'static str, &'static str)],
    owned_ambient: bool,
    /// (file written, golden), or `None` when nothing may be written yet.
    expect: Option<(&'static str, &'static str)>,
}

const BRIDGE_AND_LIST: &[(&str, &str)] =
    &[("unit/bridge.conf", "bridge.conf"), ("unit/list.conflist", "list.conflist")];
const BRIDGE_AND_UNDETECTABLE: &[(&str, &str)] =
    &[("unit/bridge.conf", "bridge.conf"), ("unit/list.conflist", "undetectable.file")];
const OWNED: &str = "02-istio-conf.conflist";

#[test]
fn writing_into_the_net_dir_twice_gives_the_goldens() {
    let cases = [
        WriteCase {
            chained: true,
            conf_name: None,
            files: BRIDGE_AND_LIST,
            owned_ambient: false,
            expect: Some(("bridge.conflist", "unit/bridge.conf.golden")),
        },
        WriteCase { chained: true, conf_name: None, files: &[], owned_ambient: false, expect: None },
        WriteCase {
            chained: true,
            conf_name: Some("list.conflist"),
            files: BRIDGE_AND_LIST,
            owned_ambient: false,
            expect: Some(("list.conflist", "unit/list.conflist.golden")),
        },
        WriteCase {
            chained: true,
            conf_name: Some("list.conf"),
            files: BRIDGE_AND_LIST,
            owned_ambient: false,
            expect: Some(("list.conflist", "unit/list.conflist.golden")),
        },
        WriteCase {
            chained: true,
            conf_name: Some("bridge.conflist"),
            files: BRIDGE_AND_LIST,
            owned_ambient: false,
            expect: Some(("bridge.conflist", "unit/bridge.conf.golden")),
        },
        WriteCase {
            chained: true,
            conf_name: Some("never-created.conf"),
            files: BRIDGE_AND_LIST,
            owned_ambient: false,
            expect: None,
        },
        WriteCase {
            chained: true,
            conf_name: Some("undetectable.file"),
            files: BRIDGE_AND_UNDETECTABLE,
            owned_ambient: false,
            expect: Some(("undetectable.file", "unit/list.conflist.golden")),
        },
        WriteCase {
            chained: false,
            conf_name: None,
            files: &[],
            owned_ambient: false,
            expect: Some(("YYY-istio-cni.conf", "unit/istio-cni.conf")),
        },
        WriteCase {
            chained: false,
            conf_name: Some("specific-name.conf"),
            files: &[],
            owned_ambient: false,
            expect: Some(("specific-name.conf", "unit/istio-cni.conf")),
        },
        WriteCase {
            chained: true,
            conf_name: Some("bridge.conflist"),
            files: BRIDGE_AND_LIST,
            owned_ambient: true,
            expect: Some((OWNED, "unit/istio-owned-bridge.conflist.golden")),
        },
        WriteCase {
            chained: true,
            conf_name: Some("list.conflist"),
            files: BRIDGE_AND_LIST,
            owned_ambient: true,
            expect: Some((OWNED, "unit/istio-owned.conflist.golden")),
        },
        WriteCase {
            chained: true,
            conf_name: Some("list.conf"),
            files: BRIDGE_AND_LIST,
            owned_ambient: true,
            expect: Some((OWNED, "unit/istio-owned.conflist.golden")),
        },
        WriteCase {
            chained: true,
            conf_name: Some("undetectable.file"),
            files: BRIDGE_AND_UNDETECTABLE,
            owned_ambient: true,
            expect: Some((OWNED, "unit/istio-owned.conflist.golden")),
        },
        WriteCase { chained: true, conf_name: Some(OWNED), files: BRIDGE_AND_LIST, owned_ambient: true, expect: None },
    ];
    for (i, case) in cases.iter().enumerate() {
        let owned = case.owned_ambient.then_some(OWNED);
        let settings = settings(case.chained, case.conf_name, owned, case.owned_ambient);
        let entry = unit_entry(case.owned_ambient);
        let dir = NetDir::new(case.files);
        for run in 1..=2 {
            let change = install(&dir, &settings, &entry);
            let label = format!("case {i} ({:?}), run {run}", case.conf_name);
            match case.expect {
                None => {
                    assert_eq!(change, None, "{label}: nothing may be written");
                    assert_eq!(dir.names().len(), case.files.len(), "{label}");
                }
                Some((written, golden)) => {
                    assert!(change.is_some(), "{label}");
                    assert_eq!(dir.read(written), text(&read(golden)), "{label}");
                    // A file of our own (standalone or Istio-owned) is created 0600; a primary (or its conversion)
                    // keeps the fixture's mode.
                    let new_file = !case.chained || owned.is_some();
                    let expected = if new_file { NEW_FILE_MODE_EXPECTED } else { FIXTURE_MODE };
                    assert_eq!(dir.mode(written), expected, "{label}");
                    check(dir.root(), &settings, &entry, &dir.path(written))
                        .unwrap_or_else(|e| panic!("{label}: freshly installed config invalid: {e}"));
                }
            }
            if owned.is_some() {
                for (src, name) in case.files {
                    assert_eq!(dir.read(name), text(&read(src)), "{label}: owned mode leaves {name} untouched");
                }
            }
        }
    }
}

/// The mode of a config file install-cni creates: Istio's 0600 (istio/istio#59075); a primary we rewrite keeps its
/// own.
const NEW_FILE_MODE_EXPECTED: u32 = 0o600;
/// The mode the fixtures' files are given.
const FIXTURE_MODE: u32 = 0o644;

#[test]
fn a_converted_conf_becomes_its_conflist() {
    let dir = NetDir::new(BRIDGE_AND_LIST);
    let change = install(&dir, &settings(true, None, None, false), &unit_entry(false));
    assert_eq!(change, Some(Change::Converted { from: dir.path("bridge.conf"), to: dir.path("bridge.conflist") }));
    assert_eq!(dir.names(), ["bridge.conflist", "list.conflist"]);
}

#[test]
fn the_primary_keeps_its_mode_and_new_files_get_0600() {
    let dir = NetDir::new(&[("unit/list.conflist", "10-list.conflist")]);
    fs::set_permissions(dir.path("10-list.conflist"), fs::Permissions::from_mode(0o644)).unwrap();
    install(&dir, &settings(true, None, None, false), &unit_entry(false));
    assert_eq!(dir.mode("10-list.conflist"), 0o644, "the primary CNI's choice is kept");
    let changes = cleanup(dir.root(), &settings(true, None, None, false)).unwrap();
    assert_eq!(changes, [Change::Wrote(dir.path("10-list.conflist"))]);
    assert_eq!(dir.mode("10-list.conflist"), 0o644, "cleanup keeps the mode");

    let dir = NetDir::new(&[("unit/list.conflist", "10-list.conflist")]);
    fs::set_permissions(dir.path("10-list.conflist"), fs::Permissions::from_mode(0o644)).unwrap();
    install(&dir, &settings(true, None, Some(OWNED), true), &unit_entry(true));
    assert_eq!(dir.mode(OWNED), 0o600, "a file we create is 0600, as Istio's");
}

#[test]
fn a_single_json_config_is_converted_to_a_conflist() {
    let dir = NetDir::new(&[("unit/bridge.conf", "10-bridge.json")]);
    install(&dir, &settings(true, None, None, false), &unit_entry(false));
    assert_eq!(dir.names(), ["10-bridge.conflist"]);
    assert_eq!(dir.read("10-bridge.conflist"), text(&read("unit/bridge.conf.golden")));
}

/// A conversion crashed after its `.conflist` was written but before the `.conf` was removed: the restart
/// removes the leftover `.conf`, and the next install leaves our entry chained once.
#[test]
fn a_leftover_conf_beside_its_converted_conflist_is_removed() {
    let dir = NetDir::new(&[("unit/bridge.conf", "bridge.conf"), ("unit/bridge.conf.golden", "bridge.conflist")]);
    let changes = complete_conversions(dir.root()).unwrap();
    assert_eq!(changes, [Change::Deleted(dir.path("bridge.conf"))]);
    assert_eq!(dir.names(), ["bridge.conflist"]);
    install(&dir, &settings(true, None, None, false), &unit_entry(false));
    assert_eq!(dir.read("bridge.conflist"), text(&read("unit/bridge.conf.golden")), "chained exactly once");
    assert_eq!(complete_conversions(dir.root()).unwrap(), [], "nothing left to complete");
}

/// A list-shaped `.conf` holding our entry is what the old rewrite-then-rename order (Istio's too) leaves when
/// it crashes before the rename; libcni cannot load it. The restart completes the rename, keeping the mode.
#[test]
fn a_list_shaped_conf_holding_our_entry_becomes_its_conflist() {
    let dir = NetDir::new(&[("unit/bridge.conf.golden", "bridge.conf"), ("unit/list.conflist", "list.conflist")]);
    fs::set_permissions(dir.path("bridge.conf"), fs::Permissions::from_mode(0o600)).unwrap();
    let changes = complete_conversions(dir.root()).unwrap();
    assert_eq!(changes, [Change::Converted { from: dir.path("bridge.conf"), to: dir.path("bridge.conflist") }]);
    assert_eq!(dir.names(), ["bridge.conflist", "list.conflist"]);
    assert_eq!(dir.read("bridge.conflist"), text(&read("unit/bridge.conf.golden")));
    assert_eq!(dir.mode("bridge.conflist"), 0o600);
    install(&dir, &settings(true, None, None, false), &unit_entry(false));
    assert_eq!(dir.read("bridge.conflist"), text(&read("unit/bridge.conf.golden")), "chained exactly once");
}

/// What is not a half-done conversion of ours stays as it is: a list-shaped `.conf` without our entry (which,
/// as in Istio, discovery skips for want of a `type`), a `.conf` whose `.conflist` holds another plugin, our
/// standalone config, and non-JSON files.
#[test]
fn completing_conversions_leaves_everything_else_alone() {
    let files = [
        ("unit/list.conflist", "00-list.conf"),
        ("integration/pre/non_json.conf", "01-non_json.conf"),
        ("integration/pre/bad_minikube_cni.conf", "02-bad.conf"),
        ("unit/bridge.conf", "10-bridge.conf"),
        ("unit/list.conflist.golden", "10-bridge.conflist"),
        ("unit/istio-cni.conf", "YYY-istio-cni.conf"),
    ];
    let dir = NetDir::new(&files);
    let before: Vec<String> = files.iter().map(|(_, name)| dir.read(name)).collect();
    assert_eq!(complete_conversions(dir.root()).unwrap(), []);
    let after: Vec<String> = files.iter().map(|(_, name)| dir.read(name)).collect();
    assert_eq!(after, before);
    assert_eq!(find_primary(dir.root(), None, None).unwrap(), Some(dir.path("10-bridge.conf")));
}

// ---------------------------------------------------------------------------------------------
// Finding the primary.

#[test]
fn find_primary_follows_libcni_and_the_twin_rule() {
    let dir = NetDir::new(&[
        ("integration/pre/non_json.conf", "00-non_json.conf"),
        ("integration/pre/bad_minikube_cni.conf", "01-bad.conf"),
        ("integration/pre/noname_calico.conflist", "02-noname.conflist"),
        ("integration/pre/noplugins_calico.conflist", "03-noplugins.conflist"),
        ("unit/list.conflist", "04-list.conflist"),
        ("unit/bridge.conf", "05-bridge.conf"),
    ]);
    fs::write(dir.path(format!("{TEMP_PREFIX}0.conflist").as_str()), read("unit/list.conflist")).unwrap();
    fs::create_dir(dir.path("000-dir.conflist")).unwrap();
    fs::write(dir.path("000-other.txt"), read("unit/list.conflist")).unwrap();
    let root = dir.root();
    assert_eq!(find_primary(root, None, None).unwrap(), Some(dir.path("04-list.conflist")));
    assert_eq!(find_primary(root, None, Some("04-list.conflist")).unwrap(), Some(dir.path("05-bridge.conf")));
    assert_eq!(find_primary(root, Some("05-bridge.conflist"), None).unwrap(), Some(dir.path("05-bridge.conf")));
    assert_eq!(find_primary(root, Some("04-list.conf"), None).unwrap(), Some(dir.path("04-list.conflist")));
    assert_eq!(
        find_primary(root, Some("01-bad.conf"), None).unwrap(),
        Some(dir.path("01-bad.conf")),
        "named: unchecked"
    );
    assert_eq!(find_primary(root, Some("04-list.conflist"), Some("04-list.conflist")).unwrap(), None);
    assert_eq!(find_primary(root, Some("missing.conf"), None).unwrap(), None);
    assert_eq!(find_primary(&dir.path("no-such-dir"), None, None).unwrap(), None);
}

// ---------------------------------------------------------------------------------------------
// Validity checks. Our check also compares our entry's content, so the entry passed is the one the
// checked file carries (`list.conflist.golden`: ambient false) even where the settings enable ambient.

fn check_case(files: &[(&str, &str)], checked: &str, settings: &ConfSettings) -> Result<(), Invalid> {
    let dir = NetDir::new(files);
    check(dir.root(), settings, &unit_entry(false), &dir.path(checked))
}

#[test]
fn validity_checks() {
    let golden_as_list = &[("unit/bridge.conf", "bridge.conf"), ("unit/list.conflist.golden", "list.conflist")][..];
    let owned01 = Some("01-istio-conf.conflist");

    let r = check_case(golden_as_list, "list.conflist", &settings(true, None, None, false));
    assert!(matches!(r, Err(Invalid::Preempted { .. })), "{r:?}");
    let r = check_case(golden_as_list, "list.conflist", &settings(true, Some("list.conflist"), None, false));
    assert!(r.is_ok(), "{r:?}");
    let r = check_case(golden_as_list, "list.conflist", &settings(true, Some("list.conflist"), Some(OWNED), true));
    assert!(matches!(r, Err(Invalid::OwnedNotFirst { .. })), "{r:?}");
    let r = check_case(
        &[("unit/bridge.conf", "bridge.conf"), ("unit/invalid-arr.conflist", "invalid-arr.conflist")],
        "invalid-arr.conflist",
        &settings(true, Some("invalid-arr.conflist"), None, false),
    );
    assert!(matches!(r, Err(Invalid::Unusable(_))), "{r:?}");
    let r = check_case(&[], "file-removed.conflist", &settings(true, None, None, false));
    assert!(matches!(r, Err(Invalid::NoValidConfig { .. })), "{r:?}");
    let r = check_case(&[("unit/list.conflist", "list.conflist")], "list.conflist", &settings(true, None, None, false));
    assert!(matches!(r, Err(Invalid::EntryMissing { .. })), "{r:?}");
    let r = check_case(&[("unit/list.conflist", OWNED)], OWNED, &settings(true, None, Some(OWNED), true));
    assert!(matches!(r, Err(Invalid::EntryMissing { .. })), "{r:?}");
    let r = check_case(
        &[("unit/list.conflist.golden", "list.conflist")],
        "list.conflist",
        &settings(true, None, None, false),
    );
    assert!(r.is_ok(), "{r:?}");
    let r = check_case(&[("unit/list.conflist.golden", OWNED)], OWNED, &settings(true, None, Some(OWNED), true));
    assert!(r.is_ok(), "with no other file the owned file is also the primary: {r:?}");
    let r = check_case(
        &[("unit/list.conflist.golden", "01-istio-conf.conflist")],
        "01-istio-conf.conflist",
        &settings(true, None, owned01, true),
    );
    assert!(r.is_ok(), "{r:?}");
    let r = check_case(
        &[("unit/list.conflist.golden", "list.conflist")],
        "list.conflist",
        &settings(true, None, owned01, true),
    );
    assert!(matches!(r, Err(Invalid::OwnedNotFirst { .. })), "{r:?}");
    let r = check_case(
        &[("unit/bridge.conf", "bridge.conf")],
        "bridge.conf",
        &settings(false, Some("bridge.conf"), None, false),
    );
    assert!(matches!(r, Err(Invalid::EntryMissing { .. })), "{r:?}");
    let r = check_case(
        &[("unit/istio-cni.conf", "istio-cni.conf")],
        "istio-cni.conf",
        &settings(false, Some("istio-cni.conf"), None, false),
    );
    assert!(r.is_ok(), "{r:?}");
}

#[test]
fn check_notices_changed_duplicated_and_stale_entries() {
    let s = settings(true, None, None, false);
    let dir = NetDir::new(&[("unit/list.conflist.golden", "list.conflist")]);
    let installed = dir.path("list.conflist");
    let r = check(dir.root(), &s, &unit_entry(true), &installed);
    assert!(matches!(r, Err(Invalid::EntryChanged { .. })), "{r:?}");

    let mut doubled: serde_json::Value = serde_json::from_slice(&read("unit/list.conflist.golden")).unwrap();
    let ours = doubled["plugins"][2].clone();
    doubled["plugins"].as_array_mut().unwrap().insert(0, ours);
    fs::write(&installed, serde_json::to_vec(&doubled).unwrap()).unwrap();
    let r = check(dir.root(), &s, &unit_entry(false), &installed);
    assert!(matches!(r, Err(Invalid::EntryMisplaced { .. })), "{r:?}");

    fs::remove_file(&installed).unwrap();
    fs::write(dir.path("00-other.conflist"), read("unit/list.conflist.golden")).unwrap();
    let r = check(dir.root(), &settings(true, Some("list.conflist"), None, false), &unit_entry(false), &installed);
    assert!(matches!(r, Err(Invalid::Missing { .. })), "{r:?}");
}

#[test]
fn check_notices_a_changed_primary_in_owned_mode() {
    let s = settings(true, Some("list.conflist"), Some(OWNED), true);
    let dir = NetDir::new(&[("unit/list.conflist", "list.conflist")]);
    install(&dir, &s, &unit_entry(true));
    assert!(check(dir.root(), &s, &unit_entry(true), &dir.path(OWNED)).is_ok());
    let retuned = text(&read("unit/list.conflist")).replace("\"500\"", "\"1024\"");
    fs::write(dir.path("list.conflist"), retuned).unwrap();
    let r = check(dir.root(), &s, &unit_entry(true), &dir.path(OWNED));
    assert!(matches!(r, Err(Invalid::PrimaryChanged { .. })), "{r:?}");
    install(&dir, &s, &unit_entry(true));
    assert!(check(dir.root(), &s, &unit_entry(true), &dir.path(OWNED)).is_ok(), "repaired");
    assert!(dir.read(OWNED).contains("\"net.core.somaxconn\": \"1024\""));
}

// ---------------------------------------------------------------------------------------------
// Cleanup.

#[test]
fn cleanup_cases() {
    let dir = NetDir::new(&[("unit/list-with-istio.conflist", "list-with-istio.conflist")]);
    let changes = cleanup(dir.root(), &settings(true, None, None, false)).unwrap();
    assert_eq!(changes, [Change::Wrote(dir.path("list-with-istio.conflist"))]);
    assert_eq!(dir.read("list-with-istio.conflist"), text(&read("unit/list-no-istio.conflist")));
    assert_eq!(cleanup(dir.root(), &settings(true, None, None, false)).unwrap(), [], "nothing left to remove");

    let dir = NetDir::new(&[("unit/istio-cni.conf", "istio-cni.conf")]);
    let changes = cleanup(dir.root(), &settings(false, Some("istio-cni.conf"), None, false)).unwrap();
    assert_eq!(changes, [Change::Deleted(dir.path("istio-cni.conf"))]);
    assert!(dir.names().is_empty());

    let dir = NetDir::new(&[("unit/istio-owned.conflist.golden", OWNED), ("unit/list.conflist", "list.conflist")]);
    let changes = cleanup(dir.root(), &settings(true, None, Some(OWNED), true)).unwrap();
    assert_eq!(changes, [Change::Deleted(dir.path(OWNED))]);
    assert_eq!(dir.names(), ["list.conflist"]);
    assert_eq!(dir.read("list.conflist"), text(&read("unit/list.conflist")));
}

// ---------------------------------------------------------------------------------------------
// Integration expectations (cni/test/testdata): pre files copied in as `0<i>-<name>`.

struct IntegrationCase {
    chained: bool,
    conf_name: Option<&'static str>,
    pre: &'static [&'static str],
    delayed: Option<(&'static str, &'static str)>,
    checked: &'static str,
    expected: &'static str,
    /// Content after cleanup, or `None` when the file is removed.
    clean: Option<&'static str>,
}

const CALICO_EXPECTED: &str = "integration/expected/10-calico.conflist-istioconfig";
const CALICO_CLEAN: Option<&str> = Some("integration/pre/calico.conflist");
const MINIKUBE_EXPECTED: &str = "integration/expected/minikube_cni.conflist.expected";
const MINIKUBE_CLEAN: Option<&str> = Some("integration/expected/minikube_cni.conflist.clean");

#[test]
fn integration_cases() {
    let c = |conf_name, pre, checked, calico: bool| IntegrationCase {
        chained: true,
        conf_name,
        pre,
        delayed: None,
        checked,
        expected: if calico { CALICO_EXPECTED } else { MINIKUBE_EXPECTED },
        clean: if calico { CALICO_CLEAN } else { MINIKUBE_CLEAN },
    };
    let cases = [
        c(Some("00-calico.conflist"), &["calico.conflist"], "00-calico.conflist", true),
        c(Some("00-minikube_cni.conf"), &["minikube_cni.conf"], "00-minikube_cni.conflist", false),
        c(None, &["calico.conflist", "minikube_cni.conf"], "00-calico.conflist", true),
        c(None, &["minikube_cni.conf", "calico.conflist"], "00-minikube_cni.conflist", false),
        c(None, &["non_json.conf", "minikube_cni.conf", "calico.conflist"], "01-minikube_cni.conflist", false),
        c(None, &["non_json.conf", "calico.conflist", "minikube_cni.conf"], "01-calico.conflist", true),
        c(None, &["bad_minikube_cni.conf", "minikube_cni.conf", "calico.conflist"], "01-minikube_cni.conflist", false),
        c(None, &["bad_minikube_cni.conf", "calico.conflist", "minikube_cni.conf"], "01-calico.conflist", true),
        c(
            None,
            &["noname_calico.conflist", "noplugins_calico.conflist", "minikube_cni.conf", "calico.conflist"],
            "02-minikube_cni.conflist",
            false,
        ),
        c(
            None,
            &["noname_calico.conflist", "noplugins_calico.conflist", "calico.conflist", "minikube_cni.conf"],
            "02-calico.conflist",
            true,
        ),
        c(Some("00-calico.conf"), &["calico.conflist"], "00-calico.conflist", true),
        c(Some("00-minikube_cni.conflist"), &["minikube_cni.conf"], "00-minikube_cni.conflist", false),
        IntegrationCase {
            delayed: Some(("calico.conflist", "missing_initially.conf")),
            ..c(Some("missing_initially.conf"), &[], "missing_initially.conflist", true)
        },
        IntegrationCase {
            delayed: Some(("calico.conflist", "calico.conflist")),
            ..c(None, &[], "calico.conflist", true)
        },
        IntegrationCase {
            chained: false,
            conf_name: None,
            pre: &[],
            delayed: None,
            checked: "YYY-istio-cni.conf",
            expected: "integration/expected/YYY-istio-cni.conf",
            clean: None,
        },
        IntegrationCase {
            chained: false,
            conf_name: Some("user-defined.conf"),
            pre: &[],
            delayed: None,
            checked: "user-defined.conf",
            expected: "integration/expected/YYY-istio-cni.conf",
            clean: None,
        },
    ];
    let entry = integration_entry();
    for (i, case) in cases.iter().enumerate() {
        let label = format!("integration case {i} ({:?}, {:?})", case.conf_name, case.pre);
        let files: Vec<(String, String)> = case
            .pre
            .iter()
            .enumerate()
            .map(|(n, name)| (format!("integration/pre/{name}"), format!("0{n}-{name}")))
            .collect();
        let borrowed: Vec<(&str, &str)> = files.iter().map(|(s, n)| (s.as_str(), n.as_str())).collect();
        let dir = NetDir::new(&borrowed);
        let s = settings(case.chained, case.conf_name, None, false);
        if let Some((src, name)) = case.delayed {
            assert_eq!(install(&dir, &s, &entry), None, "{label}: waits for the primary");
            fs::write(dir.path(name), read(&format!("integration/pre/{src}"))).unwrap();
        }
        install(&dir, &s, &entry).unwrap_or_else(|| panic!("{label}: nothing written"));
        assert_eq!(dir.read(case.checked), text(&read(case.expected)), "{label}");
        let installed = dir.path(case.checked);
        check(dir.root(), &s, &entry, &installed).unwrap_or_else(|e| panic!("{label}: {e}"));

        // Someone removes our entry (or the standalone file): the check notices, a reinstall restores it.
        if case.chained {
            fs::write(&installed, remove_entry(&fs::read(&installed).unwrap()).unwrap()).unwrap();
            let r = check(dir.root(), &s, &entry, &installed);
            assert!(matches!(r, Err(Invalid::EntryMissing { .. })), "{label}: {r:?}");
        } else {
            fs::remove_file(&installed).unwrap();
            let r = check(dir.root(), &s, &entry, &installed);
            assert!(matches!(r, Err(Invalid::NoValidConfig { .. } | Invalid::Missing { .. })), "{label}: {r:?}");
        }
        install(&dir, &s, &entry);
        assert_eq!(dir.read(case.checked), text(&read(case.expected)), "{label}: restored");

        cleanup(dir.root(), &s).unwrap_or_else(|e| panic!("{label}: cleanup: {e}"));
        match case.clean {
            Some(clean) => assert_eq!(dir.read(case.checked), text(&read(clean)), "{label}: after cleanup"),
            None => assert!(!installed.exists(), "{label}: standalone file removed"),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Kubeconfig.

const TOKEN: &str = "service_account_token_string";

fn sa_dir(with_ca: bool) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join("token"), TOKEN).unwrap();
    if with_ca {
        fs::write(dir.path().join("ca.crt"), read("unit/kube-ca.crt")).unwrap();
    }
    dir
}

fn kube(host: Option<&str>, port: Option<&str>, ca: bool, skip_tls: bool, sa: &Path) -> KubeconfigSettings {
    KubeconfigSettings {
        protocol: None,
        host: host.map(str::to_owned),
        port: port.map(str::to_owned),
        ca_file: ca.then(|| data("unit/kube-ca.crt")),
        skip_tls_verify: skip_tls,
        service_account_dir: sa.to_owned(),
    }
}

#[test]
fn kubeconfig_goldens() {
    let sa = sa_dir(false);
    for (host, ca, skip, golden) in [
        ("10.96.0.1", true, false, "unit/kubeconfig-tls"),
        ("10.96.0.1", false, true, "unit/kubeconfig-skip-tls"),
        ("50.76.2.1", true, false, "unit/kubeconfig-newhost"),
    ] {
        let rendered = render(&kube(Some(host), Some("443"), ca, skip, sa.path())).unwrap();
        assert_eq!(text(rendered.as_bytes()), text(&read(golden)), "{golden}");
    }
}

#[test]
fn kubeconfig_reads_the_ca_from_the_service_account_dir_by_default() {
    let sa = sa_dir(true);
    let rendered = render(&kube(Some("10.96.0.1"), Some("443"), false, false, sa.path())).unwrap();
    assert_eq!(text(rendered.as_bytes()), text(&read("unit/kubeconfig-tls")));
    let no_ca = sa_dir(false);
    let err = render(&kube(Some("10.96.0.1"), Some("443"), false, false, no_ca.path())).unwrap_err();
    assert!(matches!(err, KubeconfigError::Read { .. }), "{err}");
    assert!(err.to_string().contains("ca.crt"), "{err}");
}

#[test]
fn kubeconfig_needs_host_and_port() {
    let sa = sa_dir(true);
    let err = render(&kube(None, Some("443"), true, false, sa.path())).unwrap_err();
    assert!(matches!(err, KubeconfigError::HostUnset));
    let err = render(&kube(None, None, true, false, sa.path())).unwrap_err();
    assert!(matches!(err, KubeconfigError::HostUnset));
    let err = render(&kube(Some("10.96.0.1"), None, true, false, sa.path())).unwrap_err();
    assert!(matches!(err, KubeconfigError::PortUnset));
    assert!(err.to_string().contains("KUBERNETES_SERVICE_PORT"));
    let err = render(&kube(Some("10.96.0.1\nkind: Evil"), Some("443"), true, false, sa.path())).unwrap_err();
    assert!(matches!(err, KubeconfigError::BadHost(_)));
    let err = render(&kube(Some("10.96.0.1"), Some("https"), true, false, sa.path())).unwrap_err();
    assert!(matches!(err, KubeconfigError::BadPort(_)));
}

#[test]
fn kubeconfig_brackets_ipv6_and_never_shows_the_token_in_debug() {
    let sa = sa_dir(true);
    let mut s = kube(Some("fd00::1"), Some("6443"), false, true, sa.path());
    s.protocol = Some("http".into());
    let rendered = render(&s).unwrap();
    assert!(text(rendered.as_bytes()).contains("    server: http://[fd00::1]:6443\n"));
    assert!(text(rendered.as_bytes()).contains(&format!("    token: {TOKEN}\n")));
    assert!(!format!("{rendered:?}").contains(TOKEN));
}

// ---------------------------------------------------------------------------------------------
// Atomic writes.

#[test]
fn write_atomic_sets_content_and_mode_and_leaves_no_temp_files() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("file");
    write_atomic(&path, b"one", 0o640).unwrap();
    write_atomic(&path, b"two", 0o600).unwrap();
    assert_eq!(fs::read(&path).unwrap(), b"two");
    assert_eq!(fs::metadata(&path).unwrap().permissions().mode() & 0o7777, 0o600);
    let names: Vec<_> = fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, ["file"]);
}

#[test]
fn stale_temp_files_are_removed_and_nothing_else() {
    let dir = tempfile::tempdir().unwrap();
    let stale = dir.path().join(format!("{TEMP_PREFIX}abc"));
    fs::write(&stale, b"half").unwrap();
    fs::write(dir.path().join("10-calico.conflist"), b"{}").unwrap();
    assert!(is_temp_name(stale.file_name().unwrap()));
    assert_eq!(remove_stale_temps(dir.path()).unwrap(), [stale]);
    let names: Vec<_> = fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, ["10-calico.conflist"]);
}

#[test]
fn a_concurrent_reader_never_sees_a_partial_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("10-list.conflist");
    let a = vec![b'a'; 256 * 1024];
    let b = vec![b'b'; 128 * 1024];
    write_atomic(&path, &a, 0o644).unwrap();
    let done = Arc::new(AtomicBool::new(false));
    let reader = {
        let (path, a, b, done) = (path.clone(), a.clone(), b.clone(), done.clone());
        std::thread::spawn(move || {
            let mut reads = 0u32;
            while !done.load(Ordering::Acquire) {
                let seen = fs::read(&path).expect("the file always exists");
                assert!(seen == a || seen == b, "partial file of {} bytes", seen.len());
                reads += 1;
            }
            reads
        })
    };
    for i in 0..200 {
        write_atomic(&path, if i % 2 == 0 { &b } else { &a }, 0o644).unwrap();
    }
    done.store(true, Ordering::Release);
    assert!(reader.join().unwrap() > 0);
}

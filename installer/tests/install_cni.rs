//! Acceptance for `install-cni`: the real binary runs in a test node's netns against the fake API server, edits the
//! node's real net.d and bin dir, and pods are then created through the fake CNI runtime from what it left on disk.

use std::io::Write;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use installer::crash::{Step, CRASH_AFTER_ENV};
use istio_contract::{names, ports};
use serde_json::{json, Value};
use testbed::chart;
use testbed::install_cni::{InstallCni, Installer};
use testbed::mesh::sidecar_pod;
use testbed::{Cluster, NetworkConfigList};

/// The primary config the node starts with.
const PRIMARY: &str = "10-bridge.conflist";
/// An uninstall only deletes a few files; anything slower is waiting on something it should not.
const PROMPT_EXIT: Duration = Duration::from_secs(3);

fn write_json(path: &Path, value: &Value) {
    std::fs::write(path, format!("{}\n", serde_json::to_string_pretty(value).unwrap())).unwrap();
}

fn read_json(path: &Path) -> Option<Value> {
    serde_json::from_slice(&std::fs::read(path).ok()?).ok()
}

/// The plugin types of the conflist at `path`, in order.
fn plugin_types(path: &Path) -> Option<Vec<String>> {
    let list = read_json(path)?;
    Some(list["plugins"].as_array()?.iter().map(|p| p["type"].as_str().unwrap_or_default().to_owned()).collect())
}

/// True once `path` is bridge followed by exactly one istio-cni entry.
fn chained(path: &Path) -> bool {
    plugin_types(path).is_some_and(|t| t == ["bridge", names::PLUGIN_TYPE])
}

/// File names and parsed contents of every file in `dir`, to compare states semantically.
fn snapshot(dir: &Path) -> Vec<(String, Option<Value>)> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let path = e.unwrap().path();
            (path.file_name().unwrap().to_string_lossy().into_owned(), read_json(&path))
        })
        .collect();
    files.sort_by(|a, b| a.0.cmp(&b.0));
    files
}

/// The node's bridge-only conflist written as `10-bridge.conflist`, installer set up for that node.
fn node_with_bridge() -> (Cluster, Installer) {
    let cluster = Cluster::new();
    let installer = Installer::new(&cluster);
    write_json(&installer.net_d.join(PRIMARY), &cluster.node.conflist(vec![]));
    (cluster, installer)
}

/// Starts the installer and waits until it reports ready with our entry chained into the primary.
fn installed(installer: &Installer) -> InstallCni {
    let run = installer.start();
    run.wait_readyz(200);
    assert!(chained(&installer.net_d.join(PRIMARY)), "ready but not chained: {}", run.log());
    run
}

/// The installed plugin binary: a regular executable file identical in size to the image's.
fn binary_installed(installer: &Installer) -> bool {
    let want = std::fs::metadata(installer.source_dir.join(names::PLUGIN_TYPE)).unwrap().len();
    std::fs::symlink_metadata(installer.bin_dir.join(names::PLUGIN_TYPE))
        .is_ok_and(|m| m.is_file() && m.len() == want && m.permissions().mode() & 0o111 == 0o111)
}

fn kubeconfig_text(installer: &Installer) -> String {
    std::fs::read_to_string(installer.kubeconfig()).unwrap_or_default()
}

#[test]
fn installs_into_a_bridge_conflist_and_a_new_sidecar_pod_gets_its_rules() {
    let (cluster, installer) = node_with_bridge();
    let run = installed(&installer);

    let primary = installer.net_d.join(PRIMARY);
    let list = read_json(&primary).unwrap();
    let entry = &list["plugins"][1];
    assert_eq!(entry["cni_agent_run_dir"], json!(installer.run_dir), "{list:#}");
    assert_eq!(entry["exclude_namespaces"], json!(["kube-system"]), "{list:#}");
    assert_eq!(entry["pod_namespace"], "istio-system", "{list:#}");
    assert!(binary_installed(&installer), "plugin binary not copied into the bin dir");

    let meta = std::fs::metadata(installer.kubeconfig()).expect("kubeconfig written into the run dir");
    assert_eq!(meta.mode() & 0o777, 0o600);
    let token = installer.sa.token();
    assert!(kubeconfig_text(&installer).contains(&token), "kubeconfig lacks the service-account token");
    assert!(!run.log().contains(&token), "the token was logged");
    assert_eq!(run.get(ports::CNI_READINESS, "/healthz").unwrap().0, 200);
    assert_eq!(run.metric("istio_cni_install_ready"), Some(1.0));

    NetworkConfigList::from_file(&primary).expect("the runtime accepts the installed conflist");
    let pod = sidecar_pod("shop", "web");
    cluster.create(&pod);
    let pod = cluster.node.try_add_pod_with(list, "web", "shop").expect("ADD with the installed conflist");
    let rules = pod.netns.exec_ok(&["iptables-nft-save"]);
    assert!(rules.contains("ISTIO_OUTPUT"), "no sidecar rules in the pod netns:\n{rules}");
}

#[test]
fn a_deleted_binary_comes_back_and_a_rival_writer_loses_without_torn_files() {
    let (_cluster, mut installer) = node_with_bridge();
    installer.env("CONFIG_FIGHT_THRESHOLD", "2").env("CONFIG_FIGHT_WINDOW_SECONDS", "600");
    let run = installed(&installer);

    std::fs::remove_file(installer.bin_dir.join(names::PLUGIN_TYPE)).unwrap();
    run.until("the deleted plugin binary is restored", || binary_installed(&installer).then_some(()));

    let primary = installer.net_d.join(PRIMARY);
    let original = std::fs::read(&primary).unwrap();
    let bridge_only = {
        let mut list = read_json(&primary).unwrap();
        list["plugins"].as_array_mut().unwrap().truncate(1);
        serde_json::to_vec_pretty(&list).unwrap()
    };
    let stop = StopOnDrop(Arc::new(AtomicBool::new(false)));
    let reader = {
        let (stop, primary) = (stop.0.clone(), primary.clone());
        std::thread::spawn(move || sample_until(&primary, &stop))
    };
    let rival_tmp = installer.net_d.join(".rival-tmp");
    for _ in 0..200 {
        let mut tmp = std::fs::File::create(&rival_tmp).unwrap();
        tmp.write_all(&bridge_only).unwrap();
        tmp.sync_all().unwrap();
        std::fs::rename(&rival_tmp, &primary).unwrap();
    }

    run.until("the entry is back after the fight, the fight is logged and counted", || {
        let fought =
            run.log().contains("config fight") && run.metric("istio_cni_config_fights_total").is_some_and(|n| n >= 1.0);
        (fought && chained(&primary) && run.get(ports::CNI_READINESS, "/readyz").is_ok_and(|r| r.0 == 200))
            .then_some(())
    });
    drop(stop);
    let (samples, bad) = reader.join().unwrap();
    assert!(samples > 0, "the reader sampled nothing");
    assert!(bad.is_empty(), "{} of {samples} samples were not a valid conflist: {:?}", bad.len(), &bad[..1]);
    let list = read_json(&primary).unwrap();
    let before: Value = serde_json::from_slice(&original).unwrap();
    assert_eq!(list["plugins"][0], before["plugins"][0], "the bridge plugin changed");
    let log = run.log();
    let warning = log.lines().find(|l| l.contains("config fight")).unwrap();
    assert!(warning.contains(&primary.display().to_string()), "the fight warning names no file: {warning}");
}

/// Stops the sampling thread also when the test panics, so it does not spin on for the rest of the run.
struct StopOnDrop(Arc<AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Reads `path` continually until `stop`; returns how many samples were taken and the ones that were not a
/// parsable conflist whose first plugin is bridge.
fn sample_until(path: &Path, stop: &AtomicBool) -> (usize, Vec<String>) {
    let (mut samples, mut bad) = (0, Vec::new());
    while !stop.load(Ordering::Relaxed) {
        samples += 1;
        match std::fs::read(path) {
            Ok(bytes) => match serde_json::from_slice::<Value>(&bytes) {
                Ok(v) if v["plugins"][0]["type"] == "bridge" => {}
                Ok(v) => bad.push(format!("not a bridge conflist: {v}")),
                Err(e) => bad.push(format!("{e}: {}", String::from_utf8_lossy(&bytes))),
            },
            Err(e) => bad.push(format!("read failed: {e}")),
        }
    }
    (samples, bad)
}

/// `istio_cni_installs_total{result="..."}` with one of Istio's values.
fn installs(run: &InstallCni, result: &str) -> Option<f64> {
    run.metric(&format!("istio_cni_installs_total{{result=\"{result}\"}}"))
}

#[test]
fn installs_are_counted_with_istios_result_values() {
    let (_cluster, installer) = node_with_bridge();
    let run = installed(&installer);
    assert_eq!(installs(&run, "SUCCESS"), Some(1.0), "{}", run.get(ports::CNI_MONITORING, "/metrics").unwrap().1);

    // The service account's token disappears: the kubeconfig cannot be written, as Istio counts it.
    std::fs::remove_file(installer.sa.path().join("token")).unwrap();
    std::fs::write(installer.net_d.join("99-nudge.txt"), "not a CNI config").unwrap();
    run.until("the unreadable token is counted", || {
        installs(&run, "READ_SERVICE_ACCOUNT_FAILURE").is_some_and(|n| n >= 1.0).then_some(())
    });
    let metrics = run.get(ports::CNI_MONITORING, "/metrics").unwrap().1;
    assert!(!metrics.contains("result=\"success\"") && !metrics.contains("result=\"failure\""), "{metrics}");
}

#[test]
fn a_rotated_token_reaches_the_kubeconfig() {
    let (cluster, mut installer) = node_with_bridge();
    let run = installed(&installer);
    let token_one = installer.sa.token();
    assert!(kubeconfig_text(&installer).contains(&token_one));

    let token_two = cluster
        .api
        .rotate_service_account_token(chart::NAMESPACE, chart::CNI_SERVICE_ACCOUNT)
        .expect("rotate the service account's token");
    installer.sa.rotate(&token_two);
    run.until("the kubeconfig holds the rotated token", || {
        let text = kubeconfig_text(&installer);
        (text.contains(&token_two) && !text.contains(&token_one)).then_some(())
    });
    run.wait_readyz(200);
    assert!(!run.log().contains(&token_two), "the token was logged");
}

#[test]
fn sigterm_leaves_net_d_as_it_was_and_removes_the_kubeconfig_and_binary() {
    let (_cluster, installer) = node_with_bridge();
    let before = snapshot(&installer.net_d);
    let mut run = installed(&installer);
    assert_ne!(snapshot(&installer.net_d), before);

    let asked = Instant::now();
    assert!(run.terminate().success(), "install-cni failed on SIGTERM:\n{}", run.log());
    let took = asked.elapsed();
    assert!(took < PROMPT_EXIT, "exit took {took:?} after SIGTERM; the pod's grace period is not for idling");
    assert_eq!(snapshot(&installer.net_d), before, "net.d differs after cleanup:\n{}", run.log());
    assert_gone(&installer.kubeconfig());
    assert_gone(&installer.bin_dir.join(names::PLUGIN_TYPE));
    let left: Vec<_> = std::fs::read_dir(&installer.run_dir).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(left.is_empty(), "run dir not empty after cleanup: {left:?}");
}

/// A higher-priority primary appears: our entry moves into it, and the old primary is left as it was (not only at
/// cleanup). A `.conf` we converted and then left becomes its original `.conf` again.
#[test]
fn a_higher_priority_primary_takes_our_entry_and_the_old_one_is_left_as_it_was() {
    let (cluster, installer) = node_with_bridge();
    let (conf, conf_text) = single_bridge_conf(&cluster, &installer);
    let primary = installer.net_d.join(PRIMARY);
    std::fs::remove_file(&primary).unwrap();
    let before = snapshot(&installer.net_d);
    let mut run = installed(&installer);
    assert!(!conf.exists(), "10-bridge.conf not converted: {:?}", file_names(&installer.net_d));

    let higher = installer.net_d.join("05-bridge.conflist");
    let tmp = installer.net_d.join(".05-bridge.tmp");
    write_json(&tmp, &cluster.node.conflist(vec![]));
    std::fs::rename(&tmp, &higher).unwrap();
    run.until("our entry moves into 05-bridge.conflist", || chained(&higher).then_some(()));
    run.until("10-bridge.conf is back as it was", || {
        (std::fs::read_to_string(&conf).ok().as_deref() == Some(conf_text.as_str()) && !primary.exists()).then_some(())
    });
    run.wait_readyz(200);

    assert!(run.terminate().success(), "install-cni failed on SIGTERM:\n{}", run.log());
    std::fs::remove_file(&higher).unwrap();
    assert_eq!(snapshot(&installer.net_d), before, "net.d differs after cleanup:\n{}", run.log());
}

/// The node's bridge plugin alone as the single-plugin `10-bridge.conf`, which install-cni converts into
/// [`PRIMARY`]; returns its path and exact text.
fn single_bridge_conf(cluster: &Cluster, installer: &Installer) -> (PathBuf, String) {
    let mut conf = cluster.node.conflist(vec![])["plugins"][0].clone();
    conf["cniVersion"] = json!("1.0.0");
    conf["name"] = json!(testbed::node::NETWORK_NAME);
    let single = installer.net_d.join("10-bridge.conf");
    let original = format!("{}\n", serde_json::to_string_pretty(&conf).unwrap());
    std::fs::write(&single, &original).unwrap();
    (single, original)
}

/// The names of the files in `dir`, sorted.
fn file_names(dir: &Path) -> Vec<String> {
    snapshot(dir).into_iter().map(|(name, _)| name).collect()
}

/// The network a runtime loads from the node's net.d right now (libcni's rules, first file only) and its
/// plugin types; panics naming `when` and the files there when it does not load.
#[track_caller]
fn runtime_loads(installer: &Installer, when: &str) -> (PathBuf, NetworkConfigList, Vec<String>) {
    let (file, list) = NetworkConfigList::from_conf_dir(&installer.net_d).unwrap_or_else(|e| {
        panic!("{when}: a runtime cannot load net.d ({e}); files: {:?}", snapshot(&installer.net_d))
    });
    let types = list.plugins.iter().map(|p| p["type"].as_str().unwrap_or_default().to_owned()).collect();
    (file, list, types)
}

#[test]
fn sigterm_restores_a_converted_single_plugin_conf_byte_for_byte() {
    let cluster = Cluster::new();
    let installer = Installer::new(&cluster);
    let (single, original) = single_bridge_conf(&cluster, &installer);

    let mut run = installed(&installer);
    assert!(!single.exists(), "the .conf was not converted");

    assert!(run.terminate().success(), "install-cni failed on SIGTERM:\n{}", run.log());
    assert_eq!(std::fs::read_to_string(&single).ok().as_deref(), Some(original.as_str()), "{}", run.log());
    assert_gone(&installer.net_d.join(PRIMARY));
    assert_gone(&installer.bin_dir.join(names::PLUGIN_TYPE));
}

/// Issue #15's "Crash" acceptance. For each step of converting `10-bridge.conf` into `10-bridge.conflist`,
/// install-cni aborts right after it (the debug build's crash hook). At that moment a runtime must load net.d
/// and bring a pod up with it. After a restart the runtime must load our plugin chained exactly once, with no
/// stale `.conf` or temp file left, a sidecar pod must get its rules, and SIGTERM must still restore the
/// original `.conf` byte for byte. Also with `CNI_CONF_NAME` naming the `.conflist`, which the restart then
/// finds first.
#[test]
fn a_crash_at_any_conversion_step_leaves_a_loadable_config_and_a_restart_completes_it() {
    for conf_name in [None, Some(PRIMARY)] {
        for step in Step::ALL {
            crash_then_restart(step, conf_name);
        }
    }
}

fn crash_then_restart(step: Step, conf_name: Option<&str>) {
    let cluster = Cluster::new();
    let mut installer = Installer::new(&cluster);
    installer.env("CNI_CONF_NAME", conf_name.unwrap_or_default());
    let (single, original) = single_bridge_conf(&cluster, &installer);
    cluster.create(&sidecar_pod("shop", "during"));
    cluster.create(&sidecar_pod("shop", "after"));

    installer.env(CRASH_AFTER_ENV, step.name());
    let mut crashed = installer.start();
    let status = crashed.wait_exit();
    let log = crashed.log();
    let hook = format!("crash hook: aborting after {}", step.name());
    assert!(status.code().is_none() && log.contains(&hook), "no crash after {step:?} ({status}):\n{log}");
    let when = format!("CNI_CONF_NAME={conf_name:?}, after a crash at {step:?}");
    let (_, list, _) = runtime_loads(&installer, &when);
    let pod = cluster.node.try_add_pod_with(list.raw, "during", "shop");
    pod.unwrap_or_else(|e| panic!("{when}: ADD with the config a runtime loads failed: {e}"));

    installer.env(CRASH_AFTER_ENV, "");
    let mut run = installer.start();
    run.wait_readyz(200);
    let when = format!("{when} and a restart");
    let (file, list, types) = runtime_loads(&installer, &when);
    assert_eq!(file, installer.net_d.join(PRIMARY), "{when}: {}", run.log());
    assert_eq!(types, ["bridge", names::PLUGIN_TYPE], "{when}: our plugin is not chained exactly once");
    assert_eq!(file_names(&installer.net_d), [PRIMARY], "{when}: a stale file is left");
    let pod = cluster.node.try_add_pod_with(list.raw, "after", "shop");
    let pod = pod.unwrap_or_else(|e| panic!("{when}: ADD with the config a runtime loads failed: {e}"));
    let rules = pod.netns.exec_ok(&["iptables-nft-save"]);
    assert!(rules.contains("ISTIO_OUTPUT"), "{when}: no sidecar rules in the pod netns:\n{rules}");

    assert!(run.terminate().success(), "{when}: install-cni failed on SIGTERM:\n{}", run.log());
    assert_eq!(std::fs::read_to_string(&single).ok().as_deref(), Some(original.as_str()), "{when}: {}", run.log());
    assert_eq!(file_names(&installer.net_d), ["10-bridge.conf"], "{when}: uninstall left files behind");
}

/// The old conversion order (Istio's: the list written into `X.conf`, then renamed) crashed before its rename
/// leaves a list in `10-bridge.conf`, which libcni cannot load. A restarted install-cni finishes the rename and
/// the runtime loads our plugin chained exactly once.
#[test]
fn a_list_shaped_conf_left_by_the_old_order_is_completed_at_start() {
    let (cluster, installer) = node_with_bridge();
    let run = installed(&installer);
    drop(run);
    let stale = installer.net_d.join("10-bridge.conf");
    std::fs::rename(installer.net_d.join(PRIMARY), &stale).unwrap();
    assert!(NetworkConfigList::from_conf_dir(&installer.net_d).is_err(), "a list in a .conf loaded");

    let run = installer.start();
    run.wait_readyz(200);
    let (file, list, types) = runtime_loads(&installer, "after the restart");
    assert_eq!(file, installer.net_d.join(PRIMARY), "{}", run.log());
    assert_eq!(types, ["bridge", names::PLUGIN_TYPE], "our plugin is not chained exactly once");
    assert_eq!(file_names(&installer.net_d), [PRIMARY], "the stale .conf is left");
    cluster.create(&sidecar_pod("shop", "web"));
    cluster.node.try_add_pod_with(list.raw, "web", "shop").expect("ADD with the completed conflist");
}

fn assert_gone(path: &Path) {
    assert!(std::fs::symlink_metadata(path).is_err(), "{} still exists", path.display());
}

/// Our DaemonSet as the chart renders it (no nodeSelector: it targets every node).
fn daemonset() -> Value {
    let labels = json!({"k8s-app": "istio-cni-node"});
    json!({
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": "istio-cni-node", "namespace": "istio-system"},
        "spec": {
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{"name": "install-cni", "image": "install-cni"}]},
            },
        },
    })
}

/// Runs an ambient install to readiness, SIGTERMs it, and tells what is still installed: (entry, kubeconfig,
/// binary).
fn ambient_install_then_sigterm(daemonset_exists: bool, disable_safe_upgrade: bool) -> (bool, bool, bool) {
    let (cluster, mut installer) = node_with_bridge();
    if daemonset_exists {
        cluster.api.upsert(daemonset()).unwrap();
    }
    installer.env("AMBIENT_ENABLED", "true");
    if disable_safe_upgrade {
        installer.env("AMBIENT_DISABLE_SAFE_UPGRADE", "true");
    }
    let mut run = installed(&installer);
    cluster.api.clear_requests();
    assert!(run.terminate().success(), "install-cni failed on SIGTERM:\n{}", run.log());
    let asked = cluster.api.requests().iter().any(|r| r.path.contains("daemonsets/istio-cni-node"));
    assert_eq!(asked, !disable_safe_upgrade, "DaemonSet lookup on SIGTERM: {:?}", cluster.api.requests());
    let entry = plugin_types(&installer.net_d.join(PRIMARY)).unwrap().contains(&names::PLUGIN_TYPE.to_owned());
    (entry, installer.kubeconfig().exists(), installer.bin_dir.join(names::PLUGIN_TYPE).exists())
}

#[test]
fn safe_upgrade_keeps_the_install_while_our_daemonset_targets_the_node() {
    assert_eq!(ambient_install_then_sigterm(true, false), (true, true, true), "upgrade must keep everything");
}

#[test]
fn safe_upgrade_cleans_up_when_disabled_or_when_the_daemonset_is_gone() {
    assert_eq!(ambient_install_then_sigterm(true, true), (false, false, false), "AMBIENT_DISABLE_SAFE_UPGRADE");
    assert_eq!(ambient_install_then_sigterm(false, false), (false, false, false), "DaemonSet deleted");
}

/// `helm uninstall` removes the DaemonSet and the chart's RBAC together: by the time install-cni gets SIGTERM its
/// DaemonSet lookup may be refused (403) rather than answered 404. That is an uninstall too; keeping the plugin
/// chained would fail every later pod's ADD on the node (seen on a real API server, e2e/tests/real_node.rs).
#[test]
fn safe_upgrade_cleans_up_when_the_charts_rbac_is_gone() {
    let (cluster, mut installer) = node_with_bridge();
    cluster.api.upsert(daemonset()).unwrap();
    installer.env("AMBIENT_ENABLED", "true");
    let mut run = installed(&installer);
    for binding in ["istio-cni", "istio-cni-ambient", "istio-cni-repair-rolebinding"] {
        cluster.api.delete("ClusterRoleBinding", None, binding);
    }
    cluster.api.clear_requests();
    assert!(run.terminate().success(), "install-cni failed on SIGTERM:\n{}", run.log());
    let refused =
        cluster.api.requests().iter().any(|r| r.path.contains("daemonsets/istio-cni-node") && r.status == 403);
    assert!(refused, "the DaemonSet lookup was not refused: {:?}", cluster.api.requests());
    assert!(!plugin_types(&installer.net_d.join(PRIMARY)).unwrap().contains(&names::PLUGIN_TYPE.to_owned()));
    assert!(!installer.bin_dir.join(names::PLUGIN_TYPE).exists(), "{}", run.log());
    // The refusal was this test's doing (the uninstall it plays), not a gap in the chart's RBAC.
    cluster.api.clear_requests();
}

#[test]
fn waits_for_a_primary_config_then_chains_into_it() {
    let cluster = Cluster::new();
    let installer = Installer::new(&cluster);
    let run = installer.start();
    let reason = run.until("/readyz says it waits for a primary config", || {
        run.get(ports::CNI_READINESS, "/readyz").ok().filter(|(s, body)| *s == 503 && body.contains("waiting"))
    });
    assert!(reason.1.contains("primary"), "{reason:?}");
    assert_eq!(snapshot(&installer.net_d), vec![], "wrote a config while waiting for the primary");
    assert_eq!(run.metric("istio_cni_install_ready"), Some(0.0));

    write_json(&installer.net_d.join(PRIMARY), &cluster.node.conflist(vec![]));
    run.wait_readyz(200);
    assert!(chained(&installer.net_d.join(PRIMARY)), "{}", run.log());
    assert_eq!(snapshot(&installer.net_d).len(), 1, "wrote more than the primary");
}

#[test]
fn readiness_flips_while_the_config_is_gone_and_back_once_repaired() {
    let (cluster, installer) = node_with_bridge();
    let run = installed(&installer);
    let primary = installer.net_d.join(PRIMARY);

    std::fs::remove_file(&primary).unwrap();
    run.wait_readyz(503);
    assert_eq!(run.metric("istio_cni_install_ready"), Some(0.0));

    write_json(&primary, &cluster.node.conflist(vec![]));
    run.wait_readyz(200);
    assert!(chained(&primary), "entry not re-inserted: {:?}", plugin_types(&primary));
    assert_eq!(run.metric("istio_cni_install_ready"), Some(1.0));
    assert_eq!(run.get(ports::CNI_MONITORING, "/healthz").map(|r| r.0), Ok(200));
}

#[test]
fn a_bad_setting_exits_non_zero_naming_the_variable() {
    let (_cluster, mut installer) = node_with_bridge();
    let before = snapshot(&installer.net_d);
    for (key, value) in [("HOST_CNI_BIN_DIR", "relative/path"), ("KUBECONFIG_MODE", "999")] {
        let bin_dir = installer.bin_dir.display().to_string();
        installer.env("HOST_CNI_BIN_DIR", &bin_dir).env("KUBECONFIG_MODE", "600").env(key, value);
        let mut run = installer.start();
        let status = run.wait_exit();
        assert!(!status.success(), "{key}={value} was accepted");
        let log = run.log();
        assert!(log.contains(key), "{key}={value}: the message does not name the variable:\n{log}");
    }
    assert_eq!(snapshot(&installer.net_d), before, "a rejected config touched net.d");
    assert!(!installer.kubeconfig().exists(), "a rejected config wrote the kubeconfig");
    let link: PathBuf = std::fs::read_link(installer.bin_dir.join(names::PLUGIN_TYPE)).expect("bin dir untouched");
    assert!(link.is_absolute());
}

/// Istio's DaemonSet passes the log settings as `--log_output_level` (scoped, `default:debug`) and `--log_as_json`:
/// install-cni takes them, over `LOG_LEVEL`, and logs at debug, one JSON object a line.
#[test]
fn istios_log_flags_set_a_scoped_level_and_json_lines() {
    let (_cluster, mut installer) = node_with_bridge();
    installer.env("LOG_LEVEL", "warn").arg("--log_output_level=default:debug").arg("--log_as_json");
    let mut run = installed(&installer);
    assert!(run.terminate().success());
    let log = run.log();
    let lines: Vec<Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not a JSON line ({e}): {l}\n{log}")))
        .collect();
    assert!(lines.iter().any(|l| l["level"] == "DEBUG"), "no debug line:\n{log}");
}

/// Istio's `CNI_CONF_GROUP_READ`: a CNI config file of install-cni's own (here standalone) is readable by its group
/// (0640); a primary it chains into keeps its own mode, as in Istio.
#[test]
fn cni_conf_group_read_makes_our_own_config_0640_and_keeps_the_primarys_mode() {
    let (_cluster, mut installer) = node_with_bridge();
    let primary = installer.net_d.join(PRIMARY);
    std::fs::set_permissions(&primary, std::fs::Permissions::from_mode(0o644)).unwrap();
    installer.env("CNI_CONF_GROUP_READ", "true");
    let mut run = installed(&installer);
    let mode = std::fs::metadata(&primary).unwrap().mode() & 0o777;
    assert_eq!(mode, 0o644, "the primary's mode {mode:o}");
    run.terminate();

    std::fs::remove_file(&primary).unwrap();
    installer.env("CHAINED_CNI_PLUGIN", "false");
    let run = installer.start();
    run.wait_readyz(200);
    let mode = std::fs::metadata(installer.net_d.join("YYY-istio-cni.conf")).unwrap().mode() & 0o777;
    assert_eq!(mode, 0o640, "the standalone config's mode {mode:o}\n{}", run.log());
}

/// `AMBIENT_ENABLEMENT_SELECTOR` in YAML, as Istio's chart renders it, is accepted and reaches the plugin's netconf
/// as the same selectors in JSON.
#[test]
fn a_yaml_enablement_selector_reaches_the_netconf() {
    let (_cluster, mut installer) = node_with_bridge();
    let yaml = "- podSelector:\n    matchLabels:\n      mesh: ambient\n- podSelector:\n    matchExpressions:\n    \
                - key: tier\n      operator: In\n      values: [front]\n";
    installer.env("AMBIENT_ENABLED", "true").env("AMBIENT_ENABLEMENT_SELECTOR", yaml);
    let run = installed(&installer);
    let list = read_json(&installer.net_d.join(PRIMARY)).unwrap();
    let want = json!([
        { "podSelector": { "matchLabels": { "mesh": "ambient" } }, "namespaceSelector": {} },
        {
            "podSelector": { "matchExpressions": [{ "key": "tier", "operator": "In", "values": ["front"] }] },
            "namespaceSelector": {}
        },
    ]);
    assert_eq!(list["plugins"][1]["enablement_selectors"], want, "{list:#}\n{}", run.log());
}

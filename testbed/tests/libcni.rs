//! Where the fake runtime used to differ from libcni (containernetworking/cni `libcni/api.go`, v1.2.3) and
//! containerd's CRI, each pinned by what a plugin is given: CHECK without a cached result, DEL's prevResult
//! before 0.4.0, GC's error collection and `disableGC`, results in the list's version, containerd's `CNI_ARGS`,
//! and DEL with an empty netns.

use std::collections::BTreeSet;
use std::os::unix::fs::PermissionsExt;

use serde_json::{json, Value};
use testbed::runtime::{NetworkConfigList, RuntimeConf, RuntimeError};
use testbed::{Node, Spy};

fn list(version: &str, plugins: Value) -> NetworkConfigList {
    NetworkConfigList::from_value(json!({"cniVersion": version, "name": "net", "plugins": plugins})).unwrap()
}

/// A plugin printing `{}` on ADD that fails DEL and GC with a CNI error (tests only; a shell script).
fn failing_del_and_gc(node: &Node, name: &str) {
    let bin = node.bin_dir().join(name);
    let script = "#!/bin/sh\ncat >/dev/null\ncase \"$CNI_COMMAND\" in\n\
                  DEL|GC) printf '{\"code\":7,\"msg\":\"%s refused\"}' \"$CNI_COMMAND\"; exit 1;;\n\
                  ADD) printf '{}';;\nesac\n";
    std::fs::write(&bin, script).unwrap();
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
}

#[test]
fn check_without_a_cached_result_runs_every_plugin_without_prev_result() {
    let node = Node::new();
    let a = Spy::install(&node.bin_dir(), node.dir(), "a", &json!({}), None);
    let b = Spy::install(&node.bin_dir(), node.dir(), "b", &json!({}), None);
    let list = list("1.0.0", json!([{"type": "a"}, {"type": "b"}]));
    let ns = node.pod_netns();
    node.runtime().check(&list, &RuntimeConf::new("never-added", ns.path())).expect("libcni does not stop CHECK");
    for spy in [&a, &b] {
        let stdin = spy.stdin("CHECK", "never-added").expect("CHECK ran");
        assert!(stdin.get("prevResult").is_none(), "{stdin}");
    }
    assert_eq!(testbed::spy::calls(node.dir()), ["a CHECK never-added", "b CHECK never-added"]);

    // Below 0.4.0 CHECK does not exist; libcni's error names the version.
    let old = list_with("0.3.1", "a");
    let err = node.runtime().check(&old, &RuntimeConf::new("c", ns.path())).unwrap_err().to_string();
    assert!(err.contains("\"0.3.1\" does not support the CHECK command"), "{err}");
}

fn list_with(version: &str, plugin: &str) -> NetworkConfigList {
    list(version, json!([{ "type": plugin }]))
}

#[test]
fn del_sends_the_cached_result_only_from_0_4_0_and_always_drops_the_cache() {
    let node = Node::new();
    let out = json!({"cniVersion": "0.3.1", "ips": [{"version": "4", "address": "10.1.0.2/24"}]});
    let spy = Spy::install(&node.bin_dir(), node.dir(), "spy", &out, None);
    let ns = node.pod_netns();
    let rt = node.runtime();

    let old = list_with("0.3.1", "spy");
    let conf = RuntimeConf::new("old", ns.path());
    rt.add(&old, &conf).unwrap();
    rt.del(&old, &conf).expect("DEL");
    let del = spy.stdin("DEL", "old").expect("DEL ran");
    assert!(del.get("prevResult").is_none(), "0.3.1: no prevResult on DEL: {del}");
    assert!(!rt.cache_path("net", &conf).exists(), "the entry is removed all the same");

    let new = list_with("0.4.0", "spy");
    let conf = RuntimeConf::new("new", ns.path());
    rt.add(&new, &conf).unwrap();
    rt.del(&new, &conf).expect("DEL");
    let prev = &spy.stdin("DEL", "new").expect("DEL ran")["prevResult"];
    assert_eq!(prev["ips"], json!([{"version": "4", "address": "10.1.0.2/24"}]), "{prev}");
    assert_eq!(prev["cniVersion"], "0.4.0", "converted to the list's version");
}

#[test]
fn a_failed_del_keeps_the_cache_and_an_unreadable_entry_is_dropped() {
    let node = Node::new();
    failing_del_and_gc(&node, "stubborn");
    let ns = node.pod_netns();
    let rt = node.runtime();
    let list = list_with("1.0.0", "stubborn");
    let conf = RuntimeConf::new("c", ns.path());
    rt.add(&list, &conf).unwrap();
    rt.del(&list, &conf).expect_err("the plugin refuses DEL");
    assert!(rt.cache_path("net", &conf).exists(), "kept for the retry");

    // A result libcni cannot read back in the list's version: DEL runs without it and drops the entry.
    let spy = Spy::install(&node.bin_dir(), node.dir(), "spy", &json!({"cniVersion": "1.0.0"}), None);
    let list = list_with("0.2.0", "spy");
    let conf = RuntimeConf::new("noips", ns.path());
    rt.add(&list, &conf).unwrap();
    let err = rt.cached_result(&list, &conf).expect_err("no 0.2.0 result without an IP");
    assert!(matches!(err, RuntimeError::CachedResult { .. }), "{err}");
    rt.del(&list, &conf).expect("DEL");
    assert!(spy.stdin("DEL", "noips").unwrap().get("prevResult").is_none());
    assert!(!rt.cache_path("net", &conf).exists());
}

#[test]
fn gc_runs_every_del_and_every_plugin_gc_and_returns_all_failures() {
    let node = Node::new();
    failing_del_and_gc(&node, "stubborn");
    let spy = Spy::install(&node.bin_dir(), node.dir(), "spy", &json!({}), None);
    let list = list("1.1.0", json!([{"type": "stubborn"}, {"type": "spy"}]));
    let ns = node.pod_netns();
    let rt = node.runtime();
    for id in ["keep", "stale-1", "stale-2"] {
        rt.add(&list, &RuntimeConf::new(id, ns.path())).unwrap();
    }

    let err = rt.gc(&list, &[("keep", "eth0")]).expect_err("DELs and one GC fail");
    let RuntimeError::Gc(failures) = &err else { panic!("not GC's joined errors: {err}") };
    let what: Vec<&str> = failures.iter().map(|(w, _)| w.as_str()).collect();
    assert_eq!(
        what,
        [
            "failed to delete stale attachment stale-1 eth0",
            "failed to delete stale attachment stale-2 eth0",
            "failed to GC plugin stubborn"
        ],
        "{err}"
    );
    assert_eq!(err.to_string().lines().count(), 3, "{err}");
    // Nothing stopped at the first failure: both stale DELs reached spy (DEL runs the list backwards), and
    // spy's GC ran after stubborn's failed.
    assert!(spy.stdin("DEL", "stale-1").is_some() && spy.stdin("DEL", "stale-2").is_some());
    let gc = spy.stdin("GC", "").expect("spy's GC ran");
    let valid = json!([{"containerID": "keep", "ifname": "eth0"}]);
    assert_eq!((&gc["cni.dev/valid-attachments"], &gc["cni.dev/attachments"]), (&valid, &valid));
    let env = spy.env("GC", "").unwrap();
    for empty in ["CNI_CONTAINERID=", "CNI_NETNS=", "CNI_IFNAME=", "CNI_ARGS="] {
        assert!(env.iter().any(|l| l == empty), "libcni sets {empty} on GC: {env:?}");
    }
}

#[test]
fn disable_gc_turns_gc_off_entirely() {
    let node = Node::new();
    Spy::install(&node.bin_dir(), node.dir(), "spy", &json!({}), None);
    let list = NetworkConfigList::from_value(
        json!({"cniVersion": "1.1.0", "name": "net", "disableGC": true, "plugins": [{"type": "spy"}]}),
    )
    .unwrap();
    let ns = node.pod_netns();
    let stale = RuntimeConf::new("stale", ns.path());
    node.runtime().add(&list, &stale).unwrap();
    node.runtime().gc(&list, &[]).expect("GC");
    assert_eq!(testbed::spy::calls(node.dir()), ["spy ADD stale"], "no DEL, no GC");
    assert!(node.runtime().cache_path("net", &stale).exists());
}

#[test]
fn results_are_read_as_their_own_version_and_handed_on_in_the_lists() {
    let node = Node::new();
    // The first plugin answers 0.4.0 in a 1.0.0 list; the second names no version at all.
    let a_out = json!({"cniVersion": "0.4.0", "ips": [{"version": "4", "address": "10.1.0.2/24"}], "x": 1});
    let a = Spy::install(&node.bin_dir(), node.dir(), "a", &a_out, None);
    let b = Spy::install(&node.bin_dir(), node.dir(), "b", &json!({"ips": [{"address": "10.1.0.3/24"}]}), None);
    let ns = node.pod_netns();
    let rt = node.runtime();
    let conf = RuntimeConf::new("c", ns.path());

    let list = list("1.0.0", json!([{"type": "a"}, {"type": "b"}]));
    let result = rt.add(&list, &conf).unwrap();
    // libcni decodes each result as the typed result of its version: unknown keys go, `dns` is always there.
    let a_typed = json!({"cniVersion": "0.4.0", "ips": [{"version": "4", "address": "10.1.0.2/24"}], "dns": {}});
    assert_eq!(b.stdin("ADD", "c").unwrap()["prevResult"], a_typed);
    assert_eq!(result, json!({"cniVersion": "1.0.0", "ips": [{"address": "10.1.0.3/24"}], "dns": {}}));

    // A cached result is handed on converted to the list's version.
    let list = list_with("1.0.0", "a");
    let conf = RuntimeConf::new("d", ns.path());
    assert_eq!(rt.add(&list, &conf).unwrap(), a_typed, "ADD returns what the last plugin returned");
    let in_list_version = json!({"cniVersion": "1.0.0", "ips": [{"address": "10.1.0.2/24"}], "dns": {}});
    assert_eq!(rt.cached_result(&list, &conf).unwrap(), Some(in_list_version.clone()));
    rt.check(&list, &conf).unwrap();
    assert_eq!(a.stdin("CHECK", "d").unwrap()["prevResult"], in_list_version);
    rt.del(&list, &conf).unwrap();
    assert_eq!(a.stdin("DEL", "d").unwrap()["prevResult"], in_list_version);
}

#[test]
fn pods_get_containerds_cni_args_in_an_order_of_their_own() {
    let node = Node::new();
    let spy = Spy::install(&node.bin_dir(), node.dir(), "spy", &json!({"ips": [{"address": "10.1.0.9/24"}]}), None);
    let conflist = json!({"cniVersion": "1.0.0", "name": "net", "plugins": [{"type": "spy"}]});
    let mut orders = BTreeSet::new();
    for i in 0..8 {
        let name = format!("web-{i}");
        let pod = node.try_add_pod_with_uid(conflist.clone(), &name, "shop", &format!("uid-{i}")).unwrap();
        let id = pod.conf.container_id.clone();
        let env = spy.env("ADD", &id).unwrap();
        let args = env.iter().find_map(|l| l.strip_prefix("CNI_ARGS=")).expect("CNI_ARGS").to_owned();
        let pairs: Vec<&str> = args.split(';').collect();
        let want = [
            "IgnoreUnknown=1".to_owned(),
            "K8S_POD_NAMESPACE=shop".to_owned(),
            format!("K8S_POD_NAME={name}"),
            format!("K8S_POD_INFRA_CONTAINER_ID={id}"),
            format!("K8S_POD_UID=uid-{i}"),
        ];
        assert_eq!(pairs.iter().copied().collect::<BTreeSet<_>>(), want.iter().map(String::as_str).collect());
        orders.insert(pairs.iter().map(|p| p.split('=').next().unwrap().to_owned()).collect::<Vec<_>>());
    }
    assert!(orders.len() > 1, "containerd's map order is not fixed: {orders:?}");
}

#[test]
fn del_with_an_empty_netns_after_the_sandbox_is_gone_runs_and_succeeds() {
    let node = Node::new();
    let spy = Spy::install(&node.bin_dir(), node.dir(), "spy", &json!({}), None);
    // The spy prints `{}`, so it goes before bridge, whose result (the pod's IP) must come last.
    let mut conflist = node.conflist(vec![]);
    conflist["plugins"].as_array_mut().unwrap().insert(0, json!({"type": "spy"}));
    let mut pod = node.try_add_pod_with(conflist, "web", "default").expect("ADD");
    let id = pod.conf.container_id.clone();
    pod.del().expect("DEL");
    let out = std::process::Command::new("ip").args(["netns", "del", pod.netns.name()]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    pod.del_without_netns().expect("bridge and host-local accept DEL without a netns");
    let dels = testbed::spy::calls(node.dir()).iter().filter(|c| **c == format!("spy DEL {id}")).count();
    assert_eq!(dels, 2, "the repeated DEL reached the plugins");
    let env = spy.env("DEL", &id).unwrap();
    assert!(env.iter().any(|l| l == "CNI_NETNS="), "{env:?}");
}

//! The CNI protocol as runtimes speak it to the real `istio-cni` binary: versions, prevResult conversion, DEL
//! tolerance, STATUS, GC. Plus a real runtime: podman with the CNI backend. Hostile input: plugin_hostile.rs.

use std::path::PathBuf;

use serde_json::{json, Value};
use testbed::mesh::sidecar_pod;
use testbed::{bins, Cluster, RawOutput, Runtime};

const VERSIONS: [&str; 5] = ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];

struct Plugin {
    runtime: Runtime,
    dir: tempfile::TempDir,
}

impl Plugin {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        Self { runtime: Runtime::new(vec![], dir.path().join("cache")), dir }
    }

    fn run_dir(&self) -> PathBuf {
        self.dir.path().join("run")
    }

    fn conf(&self, version: &str) -> Value {
        json!({ "cniVersion": version, "name": "k8s-pod-network", "type": "istio-cni",
                "cni_agent_run_dir": self.run_dir(), "pod_lookup_attempts": 1 })
    }

    fn exec(&self, env: &[(&str, &str)], stdin: &[u8]) -> RawOutput {
        let out = self.runtime.exec_raw(&bins::path("istio-cni"), env, stdin).expect("exec istio-cni");
        assert!(!out.stderr_str().contains("panicked"), "plugin panicked: {}", out.stderr_str());
        out
    }

    fn add(&self, stdin: &Value, cni_args: &str) -> RawOutput {
        let env = [
            ("CNI_COMMAND", "ADD"),
            ("CNI_CONTAINERID", "c1"),
            ("CNI_NETNS", "/proc/self/ns/net"),
            ("CNI_IFNAME", "eth0"),
            ("CNI_ARGS", cni_args),
            ("CNI_PATH", "/opt/cni/bin"),
        ];
        self.exec(&env, stdin.to_string().as_bytes())
    }
}

fn json_out(out: &RawOutput) -> Value {
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("stdout is not one JSON value ({e}): {}", out.stdout_str()))
}

/// The failure contract: non-zero exit, exactly one spec error object on stdout.
fn assert_error(out: &RawOutput, code: u64, case: &str) -> Value {
    assert!(!out.status.success(), "{case}: exited 0: {}", out.stdout_str());
    let err = json_out(out);
    assert_eq!(err["code"], json!(code), "{case}: {err}");
    assert!(err["msg"].as_str().is_some_and(|m| !m.is_empty()), "{case}: no msg: {err}");
    assert!(err["cniVersion"].is_string(), "{case}: no cniVersion: {err}");
    err
}

fn v1_prev_result() -> Value {
    json!({
        "cniVersion": "1.0.0",
        "interfaces": [{ "name": "eth0", "mac": "0a:58:0a:00:00:02", "sandbox": "/var/run/netns/pod" }],
        "ips": [{ "interface": 0, "address": "10.0.0.2/24", "gateway": "10.0.0.1" }],
        "routes": [{ "dst": "0.0.0.0/0", "gw": "10.0.0.1" }],
        "dns": {}
    })
}

#[test]
fn version_answers_with_junk_env_and_podmans_stdin() {
    let p = Plugin::new();
    for stdin in [&br#"{"cniVersion":"1.0.0"}"#[..], b"", b"junk"] {
        let out = p.exec(&[("CNI_COMMAND", "VERSION"), ("CNI_NETNS", "dummy"), ("CNI_CONTAINERID", "")], stdin);
        assert!(out.status.success(), "{}", out.stderr_str());
        let v = json_out(&out);
        assert_eq!(v["supportedVersions"], json!(VERSIONS));
    }
}

/// The runtime execs the plugin for every pod: it is linked at a fixed address so its start skips the loader's
/// relocations (plugin/build.rs). ELF `e_type` 2 is a position-dependent executable, 3 a PIE.
#[test]
fn the_plugin_is_a_position_dependent_executable() {
    let elf = std::fs::read(bins::path("istio-cni")).expect("read istio-cni");
    assert_eq!(&elf[..4], b"\x7fELF");
    assert_eq!(u16::from_le_bytes([elf[16], elf[17]]), 2, "istio-cni is not linked with -no-pie");
}

#[test]
fn prev_result_is_returned_in_the_requested_version() {
    let p = Plugin::new();
    for version in VERSIONS {
        let mut stdin = p.conf(version);
        stdin["prevResult"] = v1_prev_result();
        let out = p.add(&stdin, "");
        assert!(out.status.success(), "{version}: {}", out.stdout_str());
        let r = json_out(&out);
        assert_eq!(r["cniVersion"], version);
        assert_eq!(r["ips"][0]["address"], "10.0.0.2/24");
        assert_eq!(r["interfaces"], v1_prev_result()["interfaces"]);
        let has_version_field = r["ips"][0].get("version").is_some();
        assert_eq!(has_version_field, version.starts_with("0."), "{version}: {r}");
    }
}

#[test]
fn no_prev_result_gives_the_empty_result_and_non_pods_pass_through() {
    let p = Plugin::new();
    let out = p.add(&p.conf("1.1.0"), "IgnoreUnknown=1");
    assert!(out.status.success());
    assert_eq!(json_out(&out), json!({ "cniVersion": "1.1.0", "dns": {} }));
    // Istio's fixture spells the nested version key in lower case.
    let mut stdin = p.conf("1.0.0");
    stdin["prevResult"] = json!({ "cniversion": "1.0.0", "interfaces": [{ "name": "eth0", "sandbox": "/tmp" }],
                                  "ips": [{ "address": "10.0.0.2/24", "gateway": "10.0.0.1", "interface": 0 }] });
    let r = json_out(&p.add(&stdin, ""));
    assert_eq!(r["ips"][0]["address"], "10.0.0.2/24");
}

#[test]
fn del_succeeds_whatever_is_missing_and_when_repeated() {
    let p = Plugin::new();
    let mut with_prev = p.conf("1.0.0");
    with_prev["prevResult"] = v1_prev_result();
    for (case, netns, stdin) in [
        ("empty netns", "", p.conf("1.0.0")),
        ("vanished netns", "/var/run/netns/does-not-exist", p.conf("1.0.0")),
        ("with prevResult", "/var/run/netns/does-not-exist", with_prev.clone()),
        ("repeat", "/var/run/netns/does-not-exist", with_prev),
    ] {
        // A sanitized environment, as podman uses for DEL: nothing but the CNI variables.
        let env = [("CNI_COMMAND", "DEL"), ("CNI_CONTAINERID", "c1"), ("CNI_NETNS", netns), ("CNI_IFNAME", "eth0")];
        let out = p.exec(&env, stdin.to_string().as_bytes());
        assert!(out.status.success(), "{case}: {}{}", out.stdout_str(), out.stderr_str());
        assert!(out.stdout.is_empty(), "{case}: DEL printed {}", out.stdout_str());
    }
}

#[test]
fn status_reports_ready_only_when_the_plugin_can_work() {
    let p = Plugin::new();
    let status = |conf: &Value| p.exec(&[("CNI_COMMAND", "STATUS")], conf.to_string().as_bytes());
    let err = assert_error(&status(&p.conf("1.1.0")), 50, "no kubeconfig");
    assert!(err["msg"].as_str().unwrap().contains("istio-cni-kubeconfig"), "{err}");

    std::fs::create_dir_all(p.run_dir()).unwrap();
    std::fs::write(p.run_dir().join("istio-cni-kubeconfig"), "apiVersion: v1\nkind: Config\n").unwrap();
    let out = status(&p.conf("1.1.0"));
    assert!(out.status.success() && out.stdout.is_empty(), "{}", out.stdout_str());

    let mut ambient = p.conf("1.1.0");
    ambient["ambient_enabled"] = json!(true);
    let err = assert_error(&status(&ambient), 50, "agent down");
    assert!(err["msg"].as_str().unwrap().contains("pluginevent.sock"), "{err}");
    let _agent = std::os::unix::net::UnixListener::bind(p.run_dir().join("pluginevent.sock")).unwrap();
    assert!(status(&ambient).status.success(), "agent socket answers");
}

#[test]
fn gc_succeeds_because_the_plugin_keeps_no_state() {
    let p = Plugin::new();
    let mut conf = p.conf("1.1.0");
    conf["cni.dev/valid-attachments"] = json!([{ "containerID": "c1", "ifname": "eth0" }]);
    let out = p.exec(&[("CNI_COMMAND", "GC")], conf.to_string().as_bytes());
    assert!(out.status.success() && out.stdout.is_empty(), "{}{}", out.stdout_str(), out.stderr_str());
}

#[test]
fn logs_go_to_stderr_and_the_run_dir_never_stdout() {
    let p = Plugin::new();
    let mut conf = p.conf("1.0.0");
    conf["plugin_log_level"] = json!("debug");
    let out = p.add(&conf, "");
    assert_eq!(json_out(&out), json!({ "cniVersion": "1.0.0", "dns": {} }));
    assert!(out.stderr_str().contains("not a Kubernetes pod"), "{}", out.stderr_str());
    let log = std::fs::read_to_string(p.run_dir().join("istio-cni.log")).unwrap();
    assert!(log.contains("not a Kubernetes pod"), "{log}");
}

#[test]
fn podman_runs_a_sidecar_container_through_the_plugin() {
    let c = Cluster::new();
    c.create(&sidecar_pod("shop", "web"));
    let podman = c.node.podman(vec![c.istio_cni()]);
    let gateway = c.node.gateway().to_string();
    // Inside the container: listen where the sidecar would, then connect out to a port nobody serves on the
    // gateway. Only the redirect rules can make that connect succeed.
    let script = format!(
        "ip -4 -o addr show eth0; nc -l -p 15001 </dev/null >/dev/null & \
         i=0; while [ $i -lt 500 ]; do if nc -w 1 {gateway} 9 </dev/null 2>/dev/null; then echo REDIRECTED; break; fi; i=$((i+1)); done"
    );
    let out = podman.run_kept(
        testbed::node::NETWORK_NAME,
        "web-1",
        &[("K8S_POD_NAMESPACE", "shop"), ("K8S_POD_NAME", "web")],
        &["sh", "-c", &script],
    );
    assert!(out.status.success(), "podman run failed: {}{}", out.stdout_str(), out.stderr_str());
    let prefix = c.node.subnet().trim_end_matches("0/24").to_owned();
    assert!(out.stdout_str().contains(&format!("inet {prefix}")), "container has no IP: {}", out.stdout_str());
    assert!(out.stdout_str().contains("REDIRECTED"), "outbound was not redirected: {}", out.stdout_str());
    let rm = podman.rm("web-1");
    assert!(rm.status.success(), "podman rm: {}", rm.stderr_str());
    let log = std::fs::read_to_string(c.run_dir().join("istio-cni.log")).unwrap();
    assert!(log.contains("redirect rules programmed"), "{log}");
    assert!(log.contains("command=Del"), "DEL reached the plugin: {log}");
}

//! The real `istio-cni` binary under a generated matrix of hostile input: every command with each variable it
//! requires missing or empty, each netconf field replaced in turn by a value of every other JSON type, broken,
//! oversized and non-UTF-8 stdin, unsupported and future versions, invalid prevResults. Every case must end with
//! the CNI failure contract (non-zero exit, exactly one spec error object with the expected code on stdout), or
//! where the spec makes the input harmless (`null` for an optional field, VERSION ignoring stdin) exactly like
//! the harmless input. No case may panic or outlive its deadline. A rejected ADD leaves no rules in the pod.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{json, Value};
use testbed::mesh::{sidecar_pod, RuleBackend};
use testbed::{bins, Cluster, NetnsGuard, RawOutput, Runtime, RuntimeError};

/// Longest any one exec may take before it is killed and the case fails as hung.
const DEADLINE: Duration = Duration::from_secs(10);
/// How many plugin processes run at once.
const PARALLEL: usize = 4;
const COMMANDS: [&str; 6] = ["ADD", "DEL", "CHECK", "VERSION", "STATUS", "GC"];
/// Commands that read the netconf (VERSION ignores stdin).
const CONF_COMMANDS: [&str; 5] = ["ADD", "DEL", "CHECK", "STATUS", "GC"];

/// The variables each command cannot do without, as the CNI spec lists them for a plugin like ours.
fn required(command: &str) -> &'static [&'static str] {
    match command {
        "ADD" | "CHECK" => &["CNI_COMMAND", "CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME"],
        "DEL" => &["CNI_COMMAND", "CNI_CONTAINERID", "CNI_IFNAME"],
        _ => &["CNI_COMMAND"],
    }
}

/// What a case must end with.
#[derive(Debug, Clone)]
enum Expect {
    /// Non-zero exit and one spec error object with this code.
    Error(u64),
    /// Exactly what the given harmless input gives (exit status and stdout).
    SameAs(Env, Vec<u8>),
}

type Env = Vec<(&'static str, String)>;

#[derive(Debug, Clone)]
struct Case {
    name: String,
    env: Env,
    stdin: Vec<u8>,
    expect: Expect,
}

/// A run dir with a kubeconfig, so STATUS is ready and every command succeeds on valid input.
struct Scene {
    dir: tempfile::TempDir,
    runtime: Runtime,
}

impl Scene {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("run")).unwrap();
        std::fs::write(dir.path().join("run/istio-cni-kubeconfig"), "apiVersion: v1\nkind: Config\n").unwrap();
        let runtime = Runtime::new(vec![], dir.path().join("cache")).with_timeout(DEADLINE);
        Scene { dir, runtime }
    }

    fn run_dir(&self) -> PathBuf {
        self.dir.path().join("run")
    }

    /// A netconf with every field the plugin reads, each with a valid value.
    fn conf(&self, version: &str) -> Value {
        json!({
            "cniVersion": version,
            "name": "k8s-pod-network",
            "type": "istio-cni",
            "prevResult": prev_result(),
            "plugin_log_level": "debug",
            "log_level": "info",
            "cni_agent_run_dir": self.run_dir(),
            "ambient_enabled": false,
            "exclude_namespaces": ["kube-system"],
            "pod_namespace": "istio-system",
            "native_nftables": false,
            "enable_ambient_detection_retry": false,
            "kubernetes": {
                "kubeconfig": self.run_dir().join("istio-cni-kubeconfig"),
                "exclude_namespaces": ["istio-system"],
                "cni_bin_dir": "/opt/cni/bin"
            },
            "pod_lookup_attempts": 1,
            "pod_lookup_interval_ms": 10,
            "force_iptables_binary": "iptables-nft",
            "cni.dev/valid-attachments": [{ "containerID": "c1", "ifname": "eth0" }],
        })
    }

    fn exec(&self, env: &Env, stdin: &[u8]) -> RawOutput {
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        match self.runtime.exec_raw(&bins::path("istio-cni"), &env, stdin) {
            Ok(out) => out,
            Err(RuntimeError::Timeout { after, stderr, .. }) => panic!("hung for {after:?}: {stderr}"),
            Err(e) => panic!("exec istio-cni: {e}"),
        }
    }
}

fn prev_result() -> Value {
    json!({
        "cniVersion": "1.1.0",
        "interfaces": [{ "name": "eth0", "mac": "0a:58:0a:00:00:02", "sandbox": "/var/run/netns/pod" }],
        "ips": [{ "interface": 0, "address": "10.0.0.2/24", "gateway": "10.0.0.1" }],
        "routes": [{ "dst": "0.0.0.0/0", "gw": "10.0.0.1" }],
        "dns": {}
    })
}

/// The environment a runtime passes for `command`, not a Kubernetes pod (so ADD passes through).
fn env(command: &str) -> Env {
    vec![
        ("CNI_COMMAND", command.to_string()),
        ("CNI_CONTAINERID", "c1".into()),
        ("CNI_NETNS", "/proc/self/ns/net".into()),
        ("CNI_IFNAME", "eth0".into()),
        ("CNI_ARGS", "IgnoreUnknown=1".into()),
        ("CNI_PATH", "/opt/cni/bin".into()),
    ]
}

fn with_var(mut env: Env, name: &'static str, value: Option<&str>) -> Env {
    env.retain(|(k, _)| *k != name);
    if let Some(value) = value {
        env.push((name, value.to_string()));
    }
    env
}

/// The failure contract: non-zero exit, stdout exactly one error object with the code, a message and a version.
fn assert_error(out: &RawOutput, code: u64, case: &str) {
    assert!(!out.status.success(), "{case}: exited 0: {}", out.stdout_str());
    let err: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{case}: stdout is not exactly one JSON value ({e}): {:?}", out.stdout_str()));
    assert_eq!(err["code"], json!(code), "{case}: {err}");
    assert!(err["msg"].as_str().is_some_and(|m| !m.is_empty()), "{case}: no msg: {err}");
    let version = err["cniVersion"].as_str().unwrap_or_else(|| panic!("{case}: no cniVersion: {err}"));
    assert!(cni::Version::supported(version).is_ok(), "{case}: error reported in version {version:?}");
    let keys: Vec<&String> = err.as_object().unwrap().keys().collect();
    assert!(keys.iter().all(|k| ["cniVersion", "code", "msg", "details"].contains(&k.as_str())), "{case}: {err}");
}

fn run_case(scene: &Scene, case: &Case) {
    let out = scene.exec(&case.env, &case.stdin);
    let stderr = out.stderr_str().to_lowercase();
    assert!(!stderr.contains("panic"), "{}: the plugin panicked: {}", case.name, out.stderr_str());
    match &case.expect {
        Expect::Error(code) => assert_error(&out, *code, &case.name),
        Expect::SameAs(env, stdin) => {
            let want = scene.exec(env, stdin);
            assert_eq!(out.status.code(), want.status.code(), "{}: {}", case.name, out.stdout_str());
            assert_eq!(out.stdout_str(), want.stdout_str(), "{}", case.name);
        }
    }
}

/// Runs the cases `PARALLEL` at a time; every failure is collected so one run shows them all.
fn run_all(scene: &Scene, cases: Vec<Case>) {
    let chunk = cases.len().div_ceil(PARALLEL).max(1);
    let failures: Vec<String> = std::thread::scope(|s| {
        let workers: Vec<_> = cases
            .chunks(chunk)
            .map(|part| {
                s.spawn(move || {
                    part.iter()
                        .filter_map(|case| {
                            std::panic::catch_unwind(|| run_case(scene, case)).err().map(|panic| {
                                panic
                                    .downcast_ref::<String>()
                                    .cloned()
                                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                                    .unwrap_or_else(|| case.name.clone())
                            })
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        workers.into_iter().flat_map(|w| w.join().unwrap()).collect()
    });
    assert!(failures.is_empty(), "{} of {} cases failed:\n{}", failures.len(), cases.len(), failures.join("\n"));
}

#[test]
fn valid_input_succeeds_for_every_command() {
    // The baseline every generated case is a mutation of: if this fails, the matrix proves nothing.
    let scene = Scene::new();
    let stdin = scene.conf("1.1.0").to_string();
    for command in COMMANDS {
        let out = scene.exec(&env(command), stdin.as_bytes());
        assert!(out.status.success(), "{command}: {}{}", out.stdout_str(), out.stderr_str());
        match command {
            "ADD" => assert_eq!(serde_json::from_slice::<Value>(&out.stdout).unwrap()["ips"], prev_result()["ips"]),
            "VERSION" => assert!(out.stdout_str().contains("supportedVersions"), "{}", out.stdout_str()),
            _ => assert!(out.stdout.is_empty(), "{command} printed {}", out.stdout_str()),
        }
    }
}

#[test]
fn each_missing_or_invalid_variable_is_error_4_for_every_command() {
    let scene = Scene::new();
    let stdin = scene.conf("1.1.0").to_string().into_bytes();
    let mut cases = Vec::new();
    for command in COMMANDS {
        for var in required(command) {
            for (how, value) in [("missing", None), ("empty", Some(""))] {
                let env = with_var(env(command), var, value);
                cases.push(Case {
                    name: format!("{command}: {var} {how}"),
                    env,
                    stdin: stdin.clone(),
                    expect: Expect::Error(4),
                });
            }
        }
        let lower = with_var(env(command), "CNI_COMMAND", Some(&command.to_lowercase()));
        cases.push(Case {
            name: format!("{command}: lower case"),
            env: lower,
            stdin: stdin.clone(),
            expect: Expect::Error(4),
        });
    }
    for command in ["ADD", "DEL", "CHECK"] {
        for ifname in ["eth0123456789abc", "eth/0"] {
            let env = with_var(env(command), "CNI_IFNAME", Some(ifname));
            let name = format!("{command}: CNI_IFNAME {ifname:?}");
            cases.push(Case { name, env, stdin: stdin.clone(), expect: Expect::Error(4) });
        }
    }
    let unknown = with_var(env("ADD"), "CNI_COMMAND", Some("FROB"));
    cases.push(Case { name: "unknown command".into(), env: unknown, stdin, expect: Expect::Error(4) });
    run_all(&scene, cases);
}

#[test]
fn broken_oversized_and_unsupported_stdin_gets_the_spec_code_for_every_command() {
    let scene = Scene::new();
    let version = |v: &str| scene.conf(v).to_string().into_bytes();
    let mut no_version = scene.conf("1.1.0");
    no_version.as_object_mut().unwrap().remove("cniVersion");
    let mut not_utf8 = version("1.1.0");
    not_utf8.splice(1..1, [0xff, 0xfe]);
    let inputs: Vec<(&str, Vec<u8>, u64)> = vec![
        ("empty stdin", Vec::new(), 6),
        ("truncated JSON", version("1.1.0")[..40].to_vec(), 6),
        ("invalid UTF-8", not_utf8, 6),
        ("NUL bytes", vec![0; 64], 6),
        ("oversized stdin", [version("1.1.0"), vec![b' '; 5 << 20]].concat(), 6),
        (
            "deeply nested JSON",
            [&br#"{"cniVersion":"1.1.0","prevResult":"#[..], &[b'['; 100_000], &[b']'; 100_000], b"}"].concat(),
            6,
        ),
        ("a JSON array", b"[]".to_vec(), 7),
        ("a JSON string", b"\"1.1.0\"".to_vec(), 7),
        ("unsupported old version", version("0.2.0"), 1),
        ("future version", version("2.0.0"), 1),
        ("future minor version", version("1.2.0"), 1),
        ("garbage version", version("one"), 1),
        ("no cniVersion", no_version.to_string().into_bytes(), 1),
    ];
    let mut cases = Vec::new();
    for command in COMMANDS {
        for (what, stdin, code) in &inputs {
            let expect = match (command, *what) {
                // Stdin is read, and bounded, before the command is even looked at.
                ("VERSION", "oversized stdin") => Expect::Error(6),
                // Otherwise VERSION answers whatever comes on stdin (podman sends none, some runtimes junk).
                ("VERSION", _) => Expect::SameAs(env("VERSION"), b"{}".to_vec()),
                _ => Expect::Error(*code),
            };
            cases.push(Case { name: format!("{command}: {what}"), env: env(command), stdin: stdin.clone(), expect });
        }
    }
    for (command, too_old) in [("CHECK", "0.3.1"), ("STATUS", "1.0.0"), ("GC", "0.4.0")] {
        let name = format!("{command} on {too_old}");
        cases.push(Case { name, env: env(command), stdin: version(too_old), expect: Expect::Error(1) });
    }
    run_all(&scene, cases);
}

/// The JSON type a field must have, and whether `null` is as good as leaving it out.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    String,
    OptString,
    Bool,
    OptStringList,
    OptObject,
    OptNumber,
    OptList,
}

fn kind_matches(kind: Kind, value: &Value) -> bool {
    match kind {
        Kind::String | Kind::OptString => value.is_string(),
        Kind::Bool => value.is_boolean(),
        Kind::OptStringList | Kind::OptList => value.is_array(),
        Kind::OptObject => value.is_object(),
        Kind::OptNumber => value.is_number(),
    }
}

/// Every netconf field the plugin reads (JSON pointer, kind). `enablement_selectors` is opaque here and decoded
/// by the ambient path, whose tests cover invalid selectors; `prevResult` has its own test below.
const FIELDS: [(&str, Kind); 17] = [
    ("/cniVersion", Kind::String),
    ("/name", Kind::String),
    ("/plugin_log_level", Kind::OptString),
    ("/log_level", Kind::OptString),
    ("/cni_agent_run_dir", Kind::OptString),
    ("/ambient_enabled", Kind::Bool),
    ("/exclude_namespaces", Kind::OptStringList),
    ("/pod_namespace", Kind::OptString),
    ("/native_nftables", Kind::Bool),
    ("/enable_ambient_detection_retry", Kind::Bool),
    ("/kubernetes", Kind::OptObject),
    ("/kubernetes/kubeconfig", Kind::OptString),
    ("/kubernetes/exclude_namespaces", Kind::OptStringList),
    ("/pod_lookup_attempts", Kind::OptNumber),
    ("/pod_lookup_interval_ms", Kind::OptNumber),
    ("/force_iptables_binary", Kind::OptString),
    ("/cni.dev~1valid-attachments", Kind::OptList),
];

/// One value of each JSON type.
fn replacements() -> [(&'static str, Value); 5] {
    [
        ("a number", json!(7)),
        ("an array", json!(["x"])),
        ("an object", json!({ "x": 1 })),
        ("null", Value::Null),
        ("a string", json!("x")),
    ]
}

fn set(conf: &Value, pointer: &str, value: Option<Value>) -> Vec<u8> {
    let mut conf = conf.clone();
    let (parent, key) = pointer.rsplit_once('/').unwrap();
    let key = key.replace("~1", "/");
    let parent = conf.pointer_mut(parent).unwrap().as_object_mut().unwrap();
    match value {
        Some(value) => parent.insert(key, value),
        None => parent.remove(&key),
    };
    conf.to_string().into_bytes()
}

/// Values of the right JSON type that are still wrong for the field.
fn wrong_content(kind: Kind) -> Vec<(&'static str, Value)> {
    match kind {
        Kind::OptStringList => vec![("a list of numbers", json!([1, 2]))],
        Kind::OptNumber => vec![("a negative number", json!(-1)), ("a fraction", json!(1.5)), ("huge", json!(1e30))],
        _ => vec![],
    }
}

#[test]
fn each_field_with_a_wrong_json_type_is_error_7_and_null_is_absent() {
    let scene = Scene::new();
    let conf = scene.conf("1.1.0");
    let mut cases = Vec::new();
    for command in CONF_COMMANDS {
        for (field, kind) in FIELDS {
            let wrong_type = replacements().into_iter().filter(|(_, v)| !kind_matches(kind, v));
            for (what, value) in wrong_type.chain(wrong_content(kind)) {
                // null run dir means the host's /var/run/istio-cni, which tests must not write to.
                if value.is_null() && field == "/cni_agent_run_dir" {
                    continue;
                }
                let expect = match kind {
                    Kind::OptString | Kind::OptStringList | Kind::OptObject | Kind::OptNumber | Kind::OptList
                        if value.is_null() =>
                    {
                        Expect::SameAs(env(command), set(&conf, field, None))
                    }
                    _ => Expect::Error(7),
                };
                let stdin = set(&conf, field, Some(value));
                cases.push(Case { name: format!("{command}: {field} is {what}"), env: env(command), stdin, expect });
            }
        }
    }
    run_all(&scene, cases);
}

#[test]
fn an_invalid_prev_result_is_a_decoding_error_for_add_and_check_and_ignored_by_the_rest() {
    let scene = Scene::new();
    let invalid: [(&str, Value); 10] = [
        ("a number", json!(7)),
        ("an array", json!([prev_result()])),
        ("a string", json!("10.0.0.2/24")),
        ("ips not a list", json!({ "ips": "nope" })),
        ("an ip entry not an object", json!({ "ips": ["10.0.0.2/24"] })),
        ("an ip without address", json!({ "ips": [{ "gateway": "10.0.0.1" }] })),
        ("an address that is not a string", json!({ "ips": [{ "address": 10 }] })),
        ("legacy ip4 without ip", json!({ "ip4": { "gateway": "10.0.0.1" } })),
        ("interfaces not a list", json!({ "interfaces": 3 })),
        ("routes not a list", json!({ "routes": { "dst": "0.0.0.0/0" } })),
    ];
    let mut cases = Vec::new();
    // 1.1.0 keeps every field, older versions rewrite some: a malformed result is refused either way.
    for (command, version) in CONF_COMMANDS.into_iter().flat_map(|c| [(c, "0.4.0"), (c, "1.1.0")]) {
        let conf = scene.conf(version);
        for (what, value) in &invalid {
            let expect = match command {
                "ADD" | "CHECK" => Expect::Error(6),
                // DEL must succeed whatever is left of the attachment; STATUS and GC take no prevResult.
                _ => Expect::SameAs(env(command), set(&conf, "/prevResult", None)),
            };
            let stdin = set(&conf, "/prevResult", Some(value.clone()));
            cases.push(Case {
                name: format!("{command} {version}: prevResult is {what}"),
                env: env(command),
                stdin,
                expect,
            });
        }
    }
    run_all(&scene, cases);
}

/// What any backend left in `ns` that belongs to us.
fn istio_rules(ns: &NetnsGuard) -> Vec<String> {
    RuleBackend::dump_all(ns).lines().filter(|l| l.to_lowercase().contains("istio")).map(String::from).collect()
}

fn add_in(c: &Cluster, netns: &Path, netconf: &Value, ifname: &str, stdin: Option<Vec<u8>>) -> RawOutput {
    let env = [
        ("CNI_COMMAND", "ADD"),
        ("CNI_CONTAINERID", "c1"),
        ("CNI_NETNS", netns.to_str().unwrap()),
        ("CNI_IFNAME", ifname),
        ("CNI_ARGS", "IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME=web"),
        ("CNI_PATH", "/opt/cni/bin"),
    ];
    let stdin = stdin.unwrap_or_else(|| netconf.to_string().into_bytes());
    let runtime = c.node.runtime().clone().with_timeout(DEADLINE);
    let out = runtime.exec_raw(&bins::path("istio-cni"), &env, &stdin).expect("istio-cni ran within its deadline");
    assert!(!out.stderr_str().to_lowercase().contains("panic"), "panicked: {}", out.stderr_str());
    out
}

/// A rejected ADD: name, netconf, interface name, raw stdin (instead of the netconf), expected error code.
type RejectedAdd = (&'static str, Value, &'static str, Option<Vec<u8>>, u64);

#[test]
fn a_rejected_add_of_a_sidecar_pod_leaves_no_rules_in_its_netns() {
    let c = Cluster::new();
    c.create(&sidecar_pod("shop", "web"));
    let mut netconf = c.istio_cni();
    netconf["cniVersion"] = json!("1.0.0");
    netconf["name"] = json!("k8s-pod-network");
    netconf["prevResult"] = prev_result();

    // The same request, valid, programs the pod: so an empty netns below means the rejection, not a no-op.
    let control = c.node.pod_netns();
    let out = add_in(&c, &control.path(), &netconf, "eth0", None);
    assert!(out.status.success(), "valid ADD failed: {}{}", out.stdout_str(), out.stderr_str());
    assert!(!istio_rules(&control).is_empty(), "a valid ADD of a sidecar pod programs rules");

    let mutate = |pointer: &str, value: Value| {
        let mut conf = netconf.clone();
        *conf.pointer_mut(pointer).unwrap() = value;
        conf
    };
    let cases: Vec<RejectedAdd> = vec![
        ("invalid prevResult", mutate("/prevResult/ips", json!("nope")), "eth0", None, 6),
        ("wrong field type", mutate("/native_nftables", json!("yes")), "eth0", None, 7),
        ("future version", mutate("/cniVersion", json!("2.0.0")), "eth0", None, 1),
        ("interface name too long", netconf.clone(), "eth0123456789abc", None, 4),
        (
            "oversized stdin",
            netconf.clone(),
            "eth0",
            Some([netconf.to_string().into_bytes(), vec![b' '; 5 << 20]].concat()),
            6,
        ),
        ("unknown iptables binary", mutate("/force_iptables_binary", json!("iptables-nonexistent")), "eth0", None, 7),
    ];
    for (case, conf, ifname, stdin, code) in cases {
        let netns = c.node.pod_netns();
        let out = add_in(&c, &netns.path(), &conf, ifname, stdin);
        assert_error(&out, code, case);
        assert_eq!(istio_rules(&netns), Vec::<String>::new(), "{case}: a rejected ADD left rules behind");
    }
}

//! The Helm chart in charts/istio-cni, rendered by a real helm: lint, offline validation against the Kubernetes
//! 1.32 schemas, golden snapshots, and what an operator relies on (no capabilities for the installer, exact
//! capabilities for the node agent, the kubeconfig in the run dir, RBAC per feature, env names the binaries
//! really read, a schema that refuses bad values).
//!
//! Istio users' inputs too: Istio's own values.yaml and profile files (e2e/testdata/istio-chart, see its NOTICE)
//! and Istio's documented commands must lint, render and validate, and give every container the settings Istio's
//! chart gives for them (expected.yaml).
//!
//! Goldens live in e2e/goldens/chart/<case>.yaml; `UPDATE_GOLDENS=1` rewrites them.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use base64::Engine as _;
use serde_json::{json, Value};
use testbed::chart::{self, accepted_env, list, output, Rendered, KUBE_VERSION};

const PLATFORMS: [&str; 6] = ["k3s", "k3d", "microk8s", "minikube", "openshift", "gke"];
const AMBIENT: &str = "cni.ambient.enabled=true";
const PROXY: &str = "proxy.enabled=true";
const ISTIOD: &str = "proxy.controlPlane=istiod";
const REPAIR_DELETE: &str = "cni.repair.deletePods=true";
const REPAIR_LABEL: &str = "cni.repair.labelPods=true";
const NO_REPAIR_IN_PLACE: &str = "cni.repair.repairPods=false";

/// Every golden case: name and `--set`s.
fn cases() -> Vec<(String, Vec<String>)> {
    let mut cases = vec![
        ("default".to_owned(), vec![]),
        ("ambient".to_owned(), vec![AMBIENT.to_owned()]),
        ("proxy".to_owned(), vec![AMBIENT.to_owned(), PROXY.to_owned()]),
        ("proxy-istiod".to_owned(), vec![AMBIENT.to_owned(), PROXY.to_owned(), ISTIOD.to_owned()]),
        ("repair-sidecar-only".to_owned(), vec![REPAIR_DELETE.to_owned(), NO_REPAIR_IN_PLACE.to_owned()]),
        // Istio's install command, and the templates Istio has that are off by default.
        ("profile-ambient".to_owned(), vec!["profile=ambient".to_owned()]),
        (
            "istio-templates".to_owned(),
            [
                "ambient.enabled=true",
                "global.networkPolicy.enabled=true",
                "resourceQuotas.enabled=true",
                "provider=multus",
            ]
            .map(String::from)
            .into(),
        ),
    ];
    for platform in PLATFORMS {
        cases.push((format!("platform-{platform}"), vec![AMBIENT.to_owned(), format!("global.platform={platform}")]));
    }
    cases
}

fn render(sets: &[String]) -> (String, Rendered) {
    let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
    let text = chart::template(&sets).unwrap_or_else(|e| panic!("helm template {sets:?}: {e}"));
    let rendered = Rendered::parse(&text);
    (text, rendered)
}

fn goldens_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("goldens/chart")
}

#[test]
fn lint_strict_passes() {
    let everything = ["--set", AMBIENT, "--set", PROXY, "--set", "proxy.selfSignedCA=true"];
    for extra in [&[][..], &everything[..]] {
        let out = output(chart::helm().args(["lint", "--strict"]).arg(chart::chart_dir()).args(extra));
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "helm lint --strict {extra:?} failed:\n{text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(text.contains("0 chart(s) failed"), "{text}");
        assert!(!text.contains("[WARNING]") && !text.contains("[ERROR]"), "{text}");
    }
}

#[test]
fn renders_match_goldens_and_validate_against_kubernetes_schemas() {
    let scratch = tempfile::tempdir().expect("tempdir");
    let update = std::env::var_os("UPDATE_GOLDENS").is_some();
    let mut files = Vec::new();
    let mut mismatches = Vec::new();
    for (name, sets) in cases() {
        let (text, _) = render(&sets);
        let golden = goldens_dir().join(format!("{name}.yaml"));
        if update {
            std::fs::create_dir_all(goldens_dir()).expect("goldens dir");
            std::fs::write(&golden, &text).expect("write golden");
        } else {
            let want = std::fs::read_to_string(&golden)
                .unwrap_or_else(|e| panic!("{}: {e} (UPDATE_GOLDENS=1 creates it)", golden.display()));
            if want != text {
                let rendered = scratch.path().join(format!("{name}.rendered.yaml"));
                std::fs::write(&rendered, &text).expect("write render");
                let diff = output(Command::new("diff").arg("-u").arg(&golden).arg(&rendered));
                mismatches.push(format!("{name}:\n{}", String::from_utf8_lossy(&diff.stdout)));
            }
        }
        let file = scratch.path().join(format!("{name}.yaml"));
        std::fs::write(&file, &text).expect("write render");
        files.push(file);
    }
    assert!(
        mismatches.is_empty(),
        "renders differ from goldens (UPDATE_GOLDENS=1 to accept):\n{}",
        mismatches.join("\n")
    );

    let out = output(Command::new("kubernetes-validate").args(["--strict", "-k", KUBE_VERSION]).args(&files));
    let log = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "kubernetes-validate rejected a render:\n{log}");
    assert!(log.contains("passed for resource daemonset/istio-cni-node"), "{log}");

    // The validator does catch a field Kubernetes does not know.
    let bad = scratch.path().join("bad.yaml");
    let (text, _) = render(&[]);
    std::fs::write(&bad, text.replace("priorityClassName:", "priorityClassNam:")).expect("write bad");
    let out = output(Command::new("kubernetes-validate").args(["--strict", "-k", KUBE_VERSION]).arg(&bad));
    assert!(!out.status.success(), "kubernetes-validate accepted an unknown field");
}

#[test]
fn install_container_is_unprivileged_and_writes_only_its_three_dirs() {
    for (name, sets) in cases() {
        let (_, r) = render(&sets);
        let c = r.container("istio-cni-node", "install-cni").expect("install-cni container");
        let sc = &c["securityContext"];
        assert_eq!(sc["privileged"], false, "{name}");
        assert_eq!(sc["allowPrivilegeEscalation"], false, "{name}");
        assert_eq!(sc["readOnlyRootFilesystem"], true, "{name}");
        assert_eq!(sc["capabilities"]["drop"], json!(["ALL"]), "{name}");
        assert!(list(&sc["capabilities"]["add"]).is_empty(), "{name}: install-cni adds capabilities: {sc}");
        let mounts: BTreeSet<String> =
            list(&c["volumeMounts"]).iter().map(|m| m["mountPath"].as_str().unwrap().to_owned()).collect();
        let want: BTreeSet<String> =
            ["/host/opt/cni/bin", "/host/etc/cni/net.d", "/var/run/istio-cni"].map(String::from).into();
        assert_eq!(mounts, want, "{name}");
        assert!(list(&c["volumeMounts"]).iter().all(|m| m["readOnly"] != true), "{name}: its dirs must be writable");
    }
}

#[test]
fn kubeconfig_goes_to_the_host_run_dir_not_the_conf_dir() {
    for (name, sets) in cases() {
        let (_, r) = render(&sets);
        let c = r.container("istio-cni-node", "install-cni").unwrap();
        // install-cni writes <CNI_AGENT_RUN_DIR>/istio-cni-kubeconfig; the plugin reads the same path on the host.
        assert_eq!(r.env_value(c, "CNI_AGENT_RUN_DIR").as_deref(), Some("/var/run/istio-cni"), "{name}");
        let mount = list(&c["volumeMounts"]).into_iter().find(|m| m["mountPath"] == "/var/run/istio-cni").unwrap();
        let volume = volume(&r, "istio-cni-node", mount["name"].as_str().unwrap());
        assert_eq!(volume["hostPath"]["path"], "/var/run/istio-cni", "{name}");
        let conf_mount = r.env_value(c, "MOUNTED_CNI_NET_DIR").unwrap();
        assert!(!"/var/run/istio-cni".starts_with(&conf_mount), "{name}: run dir inside the conf dir mount");
    }
}

#[test]
fn node_agent_has_exactly_its_capabilities_and_the_pod_its_scheduling_guarantees() {
    let (_, r) = render(&[AMBIENT.to_owned()]);
    let c = r.container("istio-cni-node", "node-agent").expect("node-agent container with ambient on");
    let sc = &c["securityContext"];
    assert_eq!(sc["privileged"], false);
    let added: BTreeSet<&str> =
        sc["capabilities"]["add"].as_array().unwrap().iter().filter_map(Value::as_str).collect();
    assert_eq!(added, BTreeSet::from(["NET_ADMIN", "NET_RAW", "SYS_ADMIN", "SYS_PTRACE"]));
    assert_eq!(sc["capabilities"]["drop"], json!(["ALL"]));
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz");
    let install = r.container("istio-cni-node", "install-cni").unwrap();
    assert_eq!(install["readinessProbe"]["httpGet"], json!({"path": "/readyz", "port": 8000}));
    // The probe port is the one the agent is told to listen on.
    let port = r.env_value(c, "READINESS_PORT").unwrap();
    assert_eq!(c["readinessProbe"]["httpGet"]["port"].to_string(), port);

    let ds = r.get("DaemonSet", "istio-cni-node");
    let pod = r.pod_spec("istio-cni-node");
    assert_ne!(pod["hostNetwork"], true);
    assert_eq!(pod["priorityClassName"], "system-node-critical");
    // Istio's tolerations: every NoSchedule and NoExecute taint, and CriticalAddonsOnly.
    assert_eq!(
        pod["tolerations"],
        json!([
            {"effect": "NoSchedule", "operator": "Exists"},
            {"key": "CriticalAddonsOnly", "operator": "Exists"},
            {"effect": "NoExecute", "operator": "Exists"}
        ])
    );
    assert_eq!(ds["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"], 1);

    let mut host_paths: Vec<String> = list(&pod["volumes"])
        .iter()
        .map(|v| v["hostPath"]["path"].as_str().expect("only hostPaths").to_owned())
        .collect();
    host_paths.sort();
    assert_eq!(
        host_paths,
        ["/etc/cni/net.d", "/opt/cni/bin", "/proc", "/var/run/istio-cni", "/var/run/netns", "/var/run/ztunnel"]
    );
    let mount = |path: &str| list(&c["volumeMounts"]).into_iter().find(|m| m["mountPath"] == path).unwrap();
    assert_eq!(mount("/host/proc")["readOnly"], true);
    assert_eq!(mount("/var/run/netns")["mountPropagation"], "HostToContainer");
    assert_eq!(r.env_value(c, "HOST_PROC").as_deref(), Some("/host/proc"));
}

fn host_paths(r: &Rendered) -> Vec<Value> {
    list(&r.pod_spec("istio-cni-node")["volumes"]).iter().map(|v| v["hostPath"]["path"].clone()).collect()
}

/// The node agent's mount of the run dir, where the plugin's socket is: in every mode, as the plugin's pod source.
fn run_dir_mount() -> Value {
    json!({ "name": "cni-run-dir", "mountPath": "/var/run/istio-cni" })
}

#[test]
fn without_ambient_or_any_repair_mode_the_node_agent_only_serves_pod_lookups_without_capabilities_or_host_proc() {
    for sets in [vec![NO_REPAIR_IN_PLACE.to_owned()], vec!["cni.repair.enabled=false".to_owned()]] {
        let (_, r) = render(&sets);
        let c = r.container("istio-cni-node", "node-agent").expect("the node agent, the plugin's pod source");
        assert_eq!(c["securityContext"]["capabilities"], json!({"drop": ["ALL"]}), "{sets:?}");
        assert_eq!(c["volumeMounts"], json!([run_dir_mount()]), "{sets:?}");
        assert_eq!(r.env_value(c, "CNI_AGENT_RUN_DIR").as_deref(), Some("/var/run/istio-cni"));
        assert_eq!(host_paths(&r), [json!("/opt/cni/bin"), json!("/etc/cni/net.d"), json!("/var/run/istio-cni")]);
    }
}

#[test]
fn sidecar_only_in_place_repair_by_default_gives_the_node_agent_rule_capabilities_and_host_proc_only() {
    let (_, r) = render(&[]);
    let c = r.container("istio-cni-node", "node-agent").expect("node-agent container for in-place repair");
    let sc = &c["securityContext"];
    let added: BTreeSet<&str> =
        sc["capabilities"]["add"].as_array().unwrap().iter().filter_map(Value::as_str).collect();
    assert_eq!(added, BTreeSet::from(["NET_ADMIN", "NET_RAW", "SYS_ADMIN", "SYS_PTRACE"]));
    assert_eq!(sc["capabilities"]["drop"], json!(["ALL"]));
    assert_eq!(sc["privileged"], false);
    assert_eq!(
        c["volumeMounts"],
        json!([run_dir_mount(), { "name": "host-proc", "mountPath": "/host/proc", "readOnly": true }])
    );
    assert_eq!(
        host_paths(&r),
        [json!("/opt/cni/bin"), json!("/etc/cni/net.d"), json!("/var/run/istio-cni"), json!("/proc")]
    );
    assert_eq!(r.env_value(c, "HOST_PROC").as_deref(), Some("/host/proc"));
    assert_eq!(r.env_value(c, "AMBIENT_ENABLED").as_deref(), Some("false"));
    assert_eq!(r.env_value(c, "REPAIR_REPAIR_PODS").as_deref(), Some("true"));
}

#[test]
fn sidecar_only_label_or_delete_repair_runs_the_node_agent_without_capabilities_or_host_mounts() {
    for mode in [REPAIR_LABEL, REPAIR_DELETE] {
        let (_, r) = render(&[mode.to_owned(), NO_REPAIR_IN_PLACE.to_owned()]);
        let c = r.container("istio-cni-node", "node-agent").expect("node-agent container for label/delete repair");
        assert_eq!(c["securityContext"]["capabilities"], json!({"drop": ["ALL"]}), "{mode}");
        assert_eq!(c["volumeMounts"], json!([run_dir_mount()]), "{mode}");
        assert_eq!(r.env_value(c, "AMBIENT_ENABLED").as_deref(), Some("false"));
        assert_eq!(r.env_value(c, "REPAIR_REPAIR_PODS").as_deref(), Some("false"));
        let set = |m: &str| Some(if m == mode { "true" } else { "false" });
        assert_eq!(r.env_value(c, "REPAIR_LABEL_PODS").as_deref(), set(REPAIR_LABEL));
        assert_eq!(r.env_value(c, "REPAIR_DELETE_PODS").as_deref(), set(REPAIR_DELETE));
        assert_eq!(host_paths(&r), [json!("/opt/cni/bin"), json!("/etc/cni/net.d"), json!("/var/run/istio-cni")]);
    }
}

#[test]
fn platform_profiles_set_their_directories_and_explicit_values_win() {
    let expect = [
        ("k3s", "/var/lib/rancher/k3s/data/cni", "/var/lib/rancher/k3s/agent/etc/cni/net.d", "/var/run/netns"),
        ("k3d", "/var/lib/rancher/k3s/data/cni", "/var/lib/rancher/k3s/agent/etc/cni/net.d", "/var/run/netns"),
        (
            "microk8s",
            "/var/snap/microk8s/current/opt/cni/bin",
            "/var/snap/microk8s/current/args/cni-network",
            "/var/run/netns",
        ),
        ("minikube", "/opt/cni/bin", "/etc/cni/net.d", "/var/run/docker/netns"),
        ("openshift", "/var/lib/cni/bin", "/etc/cni/multus/net.d", "/var/run/netns"),
        ("gke", "/home/kubernetes/bin", "/etc/cni/net.d", "/var/run/netns"),
    ];
    for (platform, bin, conf, netns) in expect {
        let (_, r) = render(&[AMBIENT.to_owned(), format!("global.platform={platform}")]);
        assert_eq!(volume(&r, "istio-cni-node", "cni-bin-dir")["hostPath"]["path"], bin, "{platform}");
        assert_eq!(volume(&r, "istio-cni-node", "cni-net-dir")["hostPath"]["path"], conf, "{platform}");
        assert_eq!(volume(&r, "istio-cni-node", "cni-netns-dir")["hostPath"]["path"], netns, "{platform}");
    }
    let (_, r) = render(&["global.platform=openshift".to_owned()]);
    let config = r.config_map("istio-cni-config");
    assert_eq!(config["CHAINED_CNI_PLUGIN"], "false");
    assert_eq!(config["CNI_CONF_NAME"], "istio-cni.conf");
    let install = r.container("istio-cni-node", "install-cni").unwrap();
    assert_eq!(install["securityContext"]["seLinuxOptions"]["type"], "spc_t");

    let (_, r) = render(&["global.platform=k3s".to_owned(), "cni.cniBinDir=/opt/custom/bin".to_owned()]);
    assert_eq!(volume(&r, "istio-cni-node", "cni-bin-dir")["hostPath"]["path"], "/opt/custom/bin");
    let (_, r) = render(&["global.platform=openshift".to_owned(), "cni.chained=true".to_owned()]);
    assert_eq!(r.config_map("istio-cni-config")["CHAINED_CNI_PLUGIN"], "true");
}

#[test]
fn schema_refuses_bad_values_naming_the_value() {
    let err = chart::template(&["cni.cniBinDir=opt/cni/bin"]).expect_err("relative bin dir accepted");
    assert!(err.contains("/cni/cniBinDir") && err.contains("does not match pattern"), "{err}");
    let err = chart::template(&["cni.cniNetnsDir=run/netns"]).expect_err("relative netns dir accepted");
    assert!(err.contains("/cni/cniNetnsDir"), "{err}");
    let err = chart::template(&["cni.cniBinDirs=/opt/cni/bin"]).expect_err("unknown key accepted");
    assert!(err.contains("additional properties 'cniBinDirs' not allowed"), "{err}");
    let err = chart::template(&["global.platform=k8s"]).expect_err("unknown platform accepted");
    assert!(err.contains("/global/platform") && err.contains("k3s"), "{err}");
    let err = chart::template(&["cni.cniConfFileName=../10-x.conflist"]).expect_err("path as file name accepted");
    assert!(err.contains("/cni/cniConfFileName"), "{err}");
    let err = chart::template(&["cni.ambient.enabled=yes"]).expect_err("string for a boolean accepted");
    assert!(err.contains("/cni/ambient/enabled"), "{err}");
    // A key that is neither Istio's nor ours is refused, at the top level, under cni and under global.
    let err = chart::template(&["ambientt.enabled=true"]).expect_err("unknown top-level key accepted");
    assert!(err.contains("at '': additional properties 'ambientt' not allowed"), "{err}");
    let err = chart::template(&["cni.ambient.dnscapture=false"]).expect_err("misspelt key accepted");
    assert!(err.contains("at '/cni/ambient': additional properties 'dnscapture' not allowed"), "{err}");
    let err = chart::template(&["global.hubb=x"]).expect_err("unknown global key accepted");
    assert!(err.contains("at '/global': additional properties 'hubb' not allowed"), "{err}");
    // Enums and types of Istio's values.
    for (set, at) in [
        ("provider=calico", "/provider"),
        ("profile=bogus", "/profile"),
        ("compatibilityVersion=1.20", "/compatibilityVersion"),
        ("global.resourceScope=everything", "/global/resourceScope"),
        ("terminationGracePeriodSeconds=soon", "/terminationGracePeriodSeconds"),
        ("updateStrategy.type=Sometimes", "/updateStrategy/type"),
    ] {
        let err = chart::template(&[set]).expect_err(set);
        assert!(err.contains(&format!("at '{at}'")), "{set}: {err}");
    }
    // Keys of Istio's other charts that Istio's profiles carry are accepted (no effect here).
    chart::template(&[
        "meshConfig.accessLogFile=/dev/stdout",
        "pilot.env.X=1",
        "global.proxy.resources.requests.cpu=1",
    ])
    .expect("Istio's other charts' keys refused");
    // A compatibility version written as a YAML number (1.30 is 1.3 to YAML) still names its file.
    let scratch = tempfile::tempdir().expect("tempdir");
    let file = scratch.path().join("v.yaml");
    std::fs::write(&file, "compatibilityVersion: 1.30\n").unwrap();
    template_with(&["-f".to_owned(), file.display().to_string()], KUBE_VERSION).expect("compatibilityVersion 1.30");
    let err = chart::template(&[PROXY]).expect_err("proxy without ambient accepted");
    assert!(err.contains("proxy.enabled needs cni.ambient.enabled=true"), "{err}");
}

/// The grants of istio-cni-node's service account: Istio's roles istio-cni, istio-cni-repair-role and
/// istio-cni-ambient, each bound to it.
fn node_grants(r: &Rendered) -> BTreeSet<(String, String)> {
    let mut grants = BTreeSet::new();
    for (role, binding) in [
        ("istio-cni", "istio-cni"),
        ("istio-cni-repair-role", "istio-cni-repair-rolebinding"),
        ("istio-cni-ambient", "istio-cni-ambient"),
    ] {
        if r.find("ClusterRole", role).is_some() {
            let b = r.get("ClusterRoleBinding", binding);
            assert_eq!(b["roleRef"]["name"], role);
            assert_eq!(
                b["subjects"],
                json!([{"kind": "ServiceAccount", "name": "istio-cni", "namespace": chart::NAMESPACE}])
            );
            grants.extend(r.grants(role));
        }
    }
    grants
}

#[test]
fn rbac_grows_only_with_the_features_enabled() {
    let grant = |resource: &str, verb: &str| (resource.to_owned(), verb.to_owned());
    let reads: BTreeSet<_> = ["pods", "namespaces", "nodes"]
        .iter()
        .flat_map(|res| ["get", "list", "watch"].map(|v| grant(res, v)))
        .collect();
    let events: BTreeSet<_> = [grant("events", "create"), grant("events", "patch")].into();
    let (_, r) = render(&[]);
    // In-place repair (the default) needs no pod writes; the repair role lets it record Events.
    assert_eq!(node_grants(&r), &reads | &events, "default install grants reads and repair Events");
    assert_eq!(r.grants("istio-cni-repair-role"), events);
    let (_, r) = render(&["cni.repair.enabled=false".to_owned()]);
    assert_eq!(node_grants(&r), reads, "without repair only reads");
    assert!(r.find("ClusterRole", "istio-cni-repair-role").is_none());

    let (_, r) = render(&[AMBIENT.to_owned()]);
    let grants = node_grants(&r);
    assert!(grants.contains(&grant("pods/status", "patch")) && grants.contains(&grant("daemonsets", "get")));
    assert!(!grants.contains(&grant("pods", "delete")));
    let ds_rule = list(&r.get("ClusterRole", "istio-cni-ambient")["rules"])
        .into_iter()
        .find(|r| r["resources"] == json!(["daemonsets"]));
    assert_eq!(ds_rule.unwrap()["resourceNames"], json!(["istio-cni-node"]));

    // Repair: delete needs pods delete, label a patch of the pod itself (labels are metadata, not status); both
    // record Events. Both with and without ambient, and nothing when repair is off.
    for ambient in [vec![], vec![AMBIENT.to_owned()]] {
        let (_, r) = render(&[ambient.clone(), vec![REPAIR_DELETE.to_owned()]].concat());
        let grants = node_grants(&r);
        assert!(grants.contains(&grant("pods", "delete")) && !grants.contains(&grant("pods", "patch")));
        assert!(grants.is_superset(&events), "{grants:?}");
        let (_, r) = render(&[ambient.clone(), vec![REPAIR_LABEL.to_owned()]].concat());
        let grants = node_grants(&r);
        assert!(grants.contains(&grant("pods", "patch")) && !grants.contains(&grant("pods", "delete")));
        let off = [ambient, vec![REPAIR_LABEL.to_owned(), REPAIR_DELETE.to_owned(), "cni.repair.enabled=false".into()]];
        let (_, r) = render(&off.concat());
        let grants = node_grants(&r);
        assert!(!grants.contains(&grant("pods", "patch")) && !grants.contains(&grant("pods", "delete")));
        assert!(!grants.iter().any(|(res, _)| res == "events"), "{grants:?}");
    }

    let (_, r) = render(&["global.platform=openshift".to_owned()]);
    assert!(r.grants("istio-cni").contains(&grant("securitycontextconstraints", "use")));

    let (_, r) = render(&[AMBIENT.to_owned(), PROXY.to_owned()]);
    let reads: BTreeSet<_> = ["get", "list", "watch"].map(|v| grant("pods", v)).into();
    assert_eq!(r.grants("hbone-proxy"), reads);
    let (_, r) = render(&[AMBIENT.to_owned(), PROXY.to_owned(), "proxy.kubeWorkloads=false".to_owned()]);
    assert!(r.find("ClusterRole", "hbone-proxy").is_none());
}

/// Names the chart must set for each binary to run as the chart intends.
fn required_env(binary: &str) -> &'static [&'static str] {
    match binary {
        "install-cni" => &[
            "MOUNTED_CNI_NET_DIR",
            "HOST_CNI_BIN_DIR",
            "CNI_BIN_SOURCE_DIR",
            "CNI_AGENT_RUN_DIR",
            "CHAINED_CNI_PLUGIN",
            "EXCLUDE_NAMESPACES",
            "AMBIENT_ENABLED",
            "AMBIENT_ENABLEMENT_SELECTOR",
            "NATIVE_NFTABLES",
            "ISTIO_OWNED_CNI_CONFIG",
            "ISTIO_OWNED_CNI_CONFIG_FILENAME",
            "POD_NAME",
            "POD_NAMESPACE",
            "NODE_NAME",
            "LOG_LEVEL",
        ],
        "node-agent" => &[
            "NODE_NAME",
            "AMBIENT_DNS_CAPTURE",
            "AMBIENT_IPV6",
            "AMBIENT_RECONCILE_POD_RULES_ON_STARTUP",
            "AMBIENT_ENABLEMENT_SELECTOR",
            "EXCLUDE_NAMESPACES",
            "CNI_AGENT_RUN_DIR",
            "NATIVE_NFTABLES",
            "HOST_PROC",
            "ZTUNNEL_UDS_ADDRESS",
            "READINESS_PORT",
            "REPAIR_ENABLED",
            "REPAIR_LABEL_PODS",
            "REPAIR_DELETE_PODS",
            "REPAIR_REPAIR_PODS",
            "REPAIR_INIT_CONTAINER_NAME",
            "REPAIR_BROKEN_POD_LABEL_KEY",
            "REPAIR_BROKEN_POD_LABEL_VALUE",
            "DRIFT_CHECK_INTERVAL",
            "DRIFT_REPAIR_SIDECAR",
            "PROBE_SELFTEST_INTERVAL",
            "LOG_LEVEL",
        ],
        "hbone-proxy" => &["INPOD_UDS", "TRUST_DOMAIN", "CONTROL_PLANE", "LOG_LEVEL"],
        other => panic!("no container should run {other}"),
    }
}

#[test]
fn every_env_name_is_one_the_consuming_binary_reads() {
    let mut seen = BTreeSet::new();
    for (name, sets) in cases() {
        let (_, r) = render(&sets);
        for (daemonset, container) in r.containers() {
            let binary = container["command"][0].as_str().expect("containers name their binary").to_owned();
            let accepted = accepted_env(&binary);
            let given = r.env_names(&container);
            let unknown: Vec<_> = given.difference(&accepted).collect();
            assert!(unknown.is_empty(), "{name}: {daemonset}/{binary} is given env it does not read: {unknown:?}");
            let missing: Vec<_> = required_env(&binary).iter().filter(|n| !given.contains(**n)).collect();
            assert!(missing.is_empty(), "{name}: {daemonset}/{binary} lacks {missing:?}");
            seen.insert(binary);
        }
    }
    assert_eq!(seen, ["hbone-proxy", "install-cni", "node-agent"].map(String::from).into());

    // Both ends of the ZDS socket and of the plugin socket agree.
    let (_, r) = render(&[AMBIENT.to_owned(), PROXY.to_owned()]);
    let agent = r.container("istio-cni-node", "node-agent").unwrap();
    let proxy = r.container("hbone-proxy", "hbone-proxy").unwrap();
    assert_eq!(r.env_value(agent, "ZTUNNEL_UDS_ADDRESS"), r.env_value(proxy, "INPOD_UDS"));
    let install = r.container("istio-cni-node", "install-cni").unwrap();
    assert_eq!(r.env_value(agent, "CNI_AGENT_RUN_DIR"), r.env_value(install, "CNI_AGENT_RUN_DIR"));
}

/// The default `binary --help` shows for the option read from env `name`.
fn binary_default(binary: &str, name: &str) -> String {
    let out = output(Command::new(testbed::bins::path(binary)).arg("--help").env_clear());
    let help = String::from_utf8(out.stdout).expect("help is UTF-8");
    let line = help.lines().find(|l| l.contains(&format!("[env: {name}="))).unwrap_or_else(|| panic!("no {name}"));
    let default = line.split("[default: ").nth(1).unwrap_or_else(|| panic!("{name} has no default: {line}"));
    default.split(']').next().expect("split yields one piece").to_owned()
}

#[test]
fn drift_and_probe_selftest_values_reach_the_node_agent_with_the_binarys_defaults() {
    let settings = [
        ("drift.checkInterval", "DRIFT_CHECK_INTERVAL"),
        ("drift.repairSidecar", "DRIFT_REPAIR_SIDECAR"),
        ("ambient.probeSelfTestInterval", "PROBE_SELFTEST_INTERVAL"),
    ];
    // By default the agent gets what it would take without the chart, with ambient or without.
    for sets in [&[][..], &[AMBIENT][..]] {
        let r = Rendered::new(sets);
        let agent = r.container("istio-cni-node", "node-agent").unwrap();
        for (_, env) in settings {
            assert_eq!(r.env_value(agent, env), Some(binary_default("node-agent", env)), "{sets:?}: {env}");
        }
    }
    // Set at the top level or under cni., they reach the agent's env.
    let r =
        Rendered::new(&["drift.checkInterval=5m", "cni.drift.repairSidecar=true", "ambient.probeSelfTestInterval=0s"]);
    let agent = r.container("istio-cni-node", "node-agent").unwrap();
    let got: Vec<_> = settings.iter().map(|(_, env)| r.env_value(agent, env).unwrap_or_default()).collect();
    assert_eq!(got, ["5m", "true", "0s"]);
    // Not a duration: the schema refuses it, naming the value.
    let err = chart::template(&["drift.checkInterval=often"]).expect_err("a bad interval is accepted");
    assert!(err.contains("/drift/checkInterval"), "{err}");
}

#[test]
fn proxy_mounts_the_ztunnel_dir_and_the_cacerts_secret_at_its_ca_dir() {
    let (_, r) = render(&[AMBIENT.to_owned(), PROXY.to_owned()]);
    let c = r.container("hbone-proxy", "hbone-proxy").unwrap();
    let sc = &c["securityContext"];
    assert_eq!(sc["privileged"], false);
    let added: BTreeSet<&str> =
        sc["capabilities"]["add"].as_array().unwrap().iter().filter_map(Value::as_str).collect();
    assert_eq!(added, BTreeSet::from(["NET_ADMIN", "NET_RAW", "SYS_ADMIN"]));
    assert_ne!(r.pod_spec("hbone-proxy")["hostNetwork"], true);
    let ca_dir = r.env_value(c, "CA_DIR").unwrap();
    let mount = list(&c["volumeMounts"]).into_iter().find(|m| m["mountPath"] == ca_dir.as_str()).expect("CA mount");
    assert_eq!(volume(&r, "hbone-proxy", mount["name"].as_str().unwrap())["secret"]["secretName"], "cacerts");
    assert!(list(&c["volumeMounts"]).iter().any(|m| m["mountPath"] == "/var/run/ztunnel"));
    assert!(r.find("Secret", "cacerts").is_none(), "the CA Secret is the operator's unless selfSignedCA is on");
}

#[test]
fn proxy_with_istiod_gets_ztunnels_addresses_token_and_root_and_no_ca_secret_or_pod_watch() {
    let (_, r) = render(&[AMBIENT.to_owned(), PROXY.to_owned(), ISTIOD.to_owned()]);
    let c = r.container("hbone-proxy", "hbone-proxy").unwrap();
    assert_eq!(r.env_value(c, "CONTROL_PLANE").as_deref(), Some("istiod"));
    // ztunnel chart's defaults: istiod's Service in istio-system, for both.
    for name in ["XDS_ADDRESS", "CA_ADDRESS"] {
        assert_eq!(r.env_value(c, name).as_deref(), Some("istiod.istio-system.svc:15012"), "{name}");
    }
    assert_eq!(r.env_value(c, "CA_DIR"), None, "no local CA");
    let names = r.env_names(c);
    for name in ["POD_NAME", "POD_NAMESPACE", "NODE_NAME", "INSTANCE_IP"] {
        assert!(names.contains(name), "{name} (the node id ztunnel sends): {names:?}");
    }
    // The token (audience istio-ca) and istiod's root, where the xDS and CA settings look by default.
    let mounts = list(&c["volumeMounts"]);
    let mounted = |path: &str| {
        let mount = mounts.iter().find(|m| m["mountPath"] == path).unwrap_or_else(|| panic!("nothing at {path}"));
        volume(&r, "hbone-proxy", mount["name"].as_str().unwrap())
    };
    let token = mounted("/var/run/secrets/tokens");
    let projected = &token["projected"]["sources"][0]["serviceAccountToken"];
    assert_eq!((projected["audience"].as_str(), projected["path"].as_str()), (Some("istio-ca"), Some("istio-token")));
    assert_eq!(mounted("/var/run/secrets/istio")["configMap"]["name"], "istio-ca-root-cert");
    assert!(!mounts.iter().any(|m| m["mountPath"] == "/etc/cacerts"), "no CA secret mounted");
    assert!(r.find("ClusterRole", "hbone-proxy").is_none(), "istiod sends the workloads: no pod watch");

    // Another revision, namespace or explicit address, and ztunnel's account in place of ours.
    let (_, r) = render(&[
        AMBIENT.to_owned(),
        PROXY.to_owned(),
        ISTIOD.to_owned(),
        "proxy.revision=canary".to_owned(),
        "proxy.istioNamespace=mesh".to_owned(),
        "proxy.caAddress=ca.example:15012".to_owned(),
        "proxy.serviceAccountName=ztunnel".to_owned(),
        "proxy.env.ALT_XDS_HOSTNAME=istiod.mesh.svc".to_owned(),
    ]);
    let c = r.container("hbone-proxy", "hbone-proxy").unwrap();
    assert_eq!(r.env_value(c, "ALT_XDS_HOSTNAME").as_deref(), Some("istiod.mesh.svc"), "proxy.env reaches the proxy");
    assert_eq!(r.env_value(c, "XDS_ADDRESS").as_deref(), Some("istiod-canary.mesh.svc:15012"));
    assert_eq!(r.env_value(c, "CA_ADDRESS").as_deref(), Some("ca.example:15012"));
    assert_eq!(r.pod_spec("hbone-proxy")["serviceAccountName"], "ztunnel");
    assert!(r.find("ServiceAccount", "ztunnel").is_some());
    let err = chart::template(&[AMBIENT, PROXY, "proxy.controlPlane=pilot"]).expect_err("an unknown control plane");
    assert!(err.contains("/proxy/controlPlane"), "{err}");
}

#[test]
fn trial_ca_is_a_complete_cacerts_secret_and_says_it_is_for_trials() {
    let sets = [AMBIENT, PROXY, "proxy.selfSignedCA=true"];
    let text = chart::template(&sets).unwrap();
    assert!(text.contains("FOR TRIALS ONLY"), "the rendered Secret must say it is for trials only");
    let r = Rendered::parse(&text);
    let secret = r.get("Secret", "cacerts");
    let keys: BTreeSet<&str> = secret["data"].as_object().unwrap().keys().map(String::as_str).collect();
    assert_eq!(keys, BTreeSet::from(["ca-cert.pem", "ca-key.pem", "cert-chain.pem", "root-cert.pem"]));
    let pem = |key: &str| {
        let b64 = secret["data"][key].as_str().unwrap();
        String::from_utf8(base64::engine::general_purpose::STANDARD.decode(b64).expect("base64")).expect("PEM text")
    };
    assert!(pem("ca-cert.pem").starts_with("-----BEGIN CERTIFICATE-----"));
    assert!(pem("ca-key.pem").contains("PRIVATE KEY-----"));
    assert_eq!(pem("root-cert.pem"), pem("ca-cert.pem"));
    assert!(secret["metadata"]["annotations"]["istio-cni/trial-only"]
        .as_str()
        .unwrap()
        .contains("do not use in production"));

    // The real proxy loads it as its mesh CA and goes on to wait for the node agent (a bad CA makes it exit).
    let ca_dir = tempfile::tempdir().expect("CA dir");
    for key in ["ca-cert.pem", "ca-key.pem", "cert-chain.pem", "root-cert.pem"] {
        std::fs::write(ca_dir.path().join(key), pem(key)).expect("write CA file");
    }
    let log = ca_dir.path().join("proxy.log");
    let mut proxy = Command::new(testbed::bins::path("hbone-proxy"));
    proxy
        .env_clear()
        .env("CA_DIR", ca_dir.path())
        .env("INPOD_UDS", ca_dir.path().join("no-node-agent.sock"))
        .env("KUBE_WORKLOADS", "false")
        .env("LISTEN_ADDRESS", "127.0.0.1")
        .env("READINESS_PORT", "0")
        .env("MONITORING_PORT", "0")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).expect("log file"));
    let mut proxy = KillOnDrop(proxy.spawn().expect("spawn hbone-proxy"));
    let read_log = || std::fs::read_to_string(&log).unwrap_or_default();
    testbed::wait::eventually_or(
        "hbone-proxy loads the trial CA and waits for the node agent",
        || {
            let exited = proxy.0.try_wait().expect("wait").is_some();
            assert!(!exited, "hbone-proxy exited:\n{}", read_log());
            read_log().contains("cannot reach the node agent").then_some(())
        },
        read_log,
    );

    let notes = output(
        chart::helm()
            .args(["install", "istio-cni", "--dry-run=client", "-n", "istio-system"])
            .arg(chart::chart_dir())
            .args(sets.iter().flat_map(|s| ["--set", s])),
    );
    let notes = String::from_utf8_lossy(&notes.stdout);
    assert!(notes.contains("It is for trials only"), "{notes}");
}

/// Volume `name` of DaemonSet `daemonset`.
fn volume(r: &Rendered, daemonset: &str, name: &str) -> Value {
    list(&r.pod_spec(daemonset)["volumes"])
        .into_iter()
        .find(|v| v["name"] == name)
        .unwrap_or_else(|| panic!("no volume {name}"))
}

/// A child process killed when the test ends, also on panic.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

// ---- Istio's values, profiles and commands (e2e/testdata/istio-chart: Istio's files and the settings Istio's
// ---- chart gives for them).

/// e2e/testdata/istio-chart.
fn istio_data() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/istio-chart")
}

/// One input of expected.yaml: helm arguments and the settings Istio's chart gives (ours where `deviation` says).
struct IstioCase {
    name: String,
    args: Vec<String>,
    kube_version: String,
    expect: Value,
}

/// `b` merged into `a`, maps key by key; a missing (null) `b` changes nothing. (expected.yaml's cases list
/// differences from `default`.)
fn merged(a: &Value, b: &Value) -> Value {
    match (a, b) {
        (Value::Object(a), Value::Object(b)) => {
            let mut out = a.clone();
            for (k, v) in b {
                let next = out.get(k).map_or_else(|| v.clone(), |old| merged(old, v));
                out.insert(k.clone(), next);
            }
            Value::Object(out)
        }
        (a, Value::Null) => a.clone(),
        (_, b) => b.clone(),
    }
}

fn istio_cases() -> Vec<IstioCase> {
    let path = istio_data().join("expected.yaml");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let data: Value = serde_yaml::from_str(&text).expect("expected.yaml parses");
    let default = &data["default"];
    let mut out = vec![IstioCase {
        name: "no values".into(),
        args: vec![],
        kube_version: KUBE_VERSION.into(),
        expect: default.clone(),
    }];
    for case in list(&data["cases"]) {
        let mut args = Vec::new();
        for file in list(&case["files"]) {
            args.push("-f".to_owned());
            args.push(istio_data().join(file.as_str().unwrap()).display().to_string());
        }
        for set in list(&case["set"]) {
            args.push("--set".to_owned());
            args.push(set.as_str().unwrap().to_owned());
        }
        let expect = merged(&merged(default, &case["expect"]), &case["deviation"]);
        out.push(IstioCase {
            name: case["name"].as_str().unwrap().to_owned(),
            args,
            kube_version: case["kubeVersion"].as_str().unwrap_or(KUBE_VERSION).to_owned(),
            expect,
        });
    }
    out
}

/// `helm template` of the chart with raw helm arguments (`-f`, `--set`) at `kube_version`.
fn template_with(args: &[String], kube_version: &str) -> Result<String, String> {
    let out = output(
        chart::helm()
            .args(["template", "istio-cni"])
            .arg(chart::chart_dir())
            .args(["--namespace", chart::NAMESPACE, "--kube-version", kube_version])
            .args(args),
    );
    if out.status.success() {
        Ok(String::from_utf8(out.stdout).expect("helm prints UTF-8"))
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

#[test]
fn istio_files_and_commands_pass_lint_template_and_kubernetes_validate() {
    let scratch = tempfile::tempdir().expect("tempdir");
    let cases = istio_cases();
    // helm lint is slow: a few cases at a time.
    let files: Vec<PathBuf> = std::thread::scope(|s| {
        let workers: Vec<_> = cases
            .chunks(cases.len().div_ceil(4))
            .enumerate()
            .map(|(w, chunk)| {
                let dir = scratch.path();
                s.spawn(move || {
                    let mut files = Vec::new();
                    for (i, case) in chunk.iter().enumerate() {
                        let out = output(
                            chart::helm()
                                .args(["lint", "--strict", "--kube-version", &case.kube_version])
                                .arg(chart::chart_dir())
                                .args(&case.args),
                        );
                        let text = String::from_utf8_lossy(&out.stdout);
                        assert!(
                            out.status.success() && text.contains("0 chart(s) failed") && !text.contains("[WARNING]"),
                            "helm lint --strict, {}:\n{text}{}",
                            case.name,
                            String::from_utf8_lossy(&out.stderr)
                        );
                        let rendered = template_with(&case.args, &case.kube_version)
                            .unwrap_or_else(|e| panic!("helm template, {}: {e}", case.name));
                        let file = dir.join(format!("case-{w}-{i}.yaml"));
                        std::fs::write(&file, rendered).expect("write render");
                        files.push(file);
                    }
                    files
                })
            })
            .collect();
        workers.into_iter().flat_map(|w| w.join().expect("lint worker")).collect()
    });
    assert_eq!(files.len(), cases.len());
    let out = output(Command::new("kubernetes-validate").args(["--strict", "-k", KUBE_VERSION]).args(&files));
    let log = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "kubernetes-validate rejected a render:\n{log}");
    assert_eq!(log.matches("passed for resource daemonset/istio-cni-node").count(), cases.len(), "{log}");
}

/// The env keys of Istio's configmap that go to install-cni, and those that go to the node agent.
const INSTALL_ENV: [&str; 7] = [
    "CHAINED_CNI_PLUGIN",
    "CNI_CONF_NAME",
    "EXCLUDE_NAMESPACES",
    "AMBIENT_ENABLED",
    "ENABLE_AMBIENT_DETECTION_RETRY",
    "NATIVE_NFTABLES",
    "ISTIO_OWNED_CNI_CONFIG",
];
const AGENT_ENV: [&str; 13] = [
    "EXCLUDE_NAMESPACES",
    "AMBIENT_ENABLED",
    "AMBIENT_DNS_CAPTURE",
    "AMBIENT_IPV6",
    "AMBIENT_RECONCILE_POD_RULES_ON_STARTUP",
    "NATIVE_NFTABLES",
    "REPAIR_ENABLED",
    "REPAIR_LABEL_PODS",
    "REPAIR_DELETE_PODS",
    "REPAIR_REPAIR_PODS",
    "REPAIR_INIT_CONTAINER_NAME",
    "REPAIR_BROKEN_POD_LABEL_KEY",
    "REPAIR_BROKEN_POD_LABEL_VALUE",
];

#[test]
fn istio_inputs_give_each_container_istios_effective_settings() {
    let cases = istio_cases();
    assert!(cases.len() > 40, "expected.yaml lost cases");
    for case in cases {
        let name = &case.name;
        let want = &case.expect;
        let text = template_with(&case.args, &case.kube_version).unwrap_or_else(|e| panic!("{name}: {e}"));
        let r = Rendered::parse(&text);
        let env = &want["env"];
        let on = |key: &str| env[key] == "true";
        let ambient = on("AMBIENT_ENABLED");
        let in_place = on("REPAIR_ENABLED") && on("REPAIR_REPAIR_PODS");
        let repair =
            on("REPAIR_ENABLED") && (on("REPAIR_REPAIR_PODS") || on("REPAIR_DELETE_PODS") || on("REPAIR_LABEL_PODS"));

        let install = r.container("istio-cni-node", "install-cni").expect("install-cni");
        let agent = r.container("istio-cni-node", "node-agent");
        assert_eq!(agent.is_some(), ambient || repair, "{name}: node-agent container");
        for key in INSTALL_ENV {
            assert_eq!(
                r.env_value(install, key).map(Value::from).unwrap_or(Value::Null),
                env[key],
                "{name}: install-cni {key}"
            );
        }
        if let Some(agent) = agent {
            for key in AGENT_ENV {
                assert_eq!(
                    r.env_value(agent, key).map(Value::from).unwrap_or(Value::Null),
                    env[key],
                    "{name}: node-agent {key}"
                );
            }
        }
        // Istio passes --log_output_level; ours read LOG_LEVEL (same value).
        for c in [Some(install), agent].into_iter().flatten() {
            assert_eq!(
                r.env_value(c, "LOG_LEVEL").map(Value::from),
                Some(want["logOutputLevel"].clone()),
                "{name}: {}",
                c["name"]
            );
            assert_eq!(c["resources"], want["resources"], "{name}: {} resources", c["name"]);
            assert_eq!(
                c["securityContext"]["seLinuxOptions"]["type"], want["seLinuxType"],
                "{name}: {} SELinux type",
                c["name"]
            );
        }

        // Host paths and where each container sees them.
        assert_eq!(volume(&r, "istio-cni-node", "cni-bin-dir")["hostPath"]["path"], want["binDir"], "{name}: bin dir");
        assert_eq!(
            volume(&r, "istio-cni-node", "cni-net-dir")["hostPath"]["path"],
            want["confDir"],
            "{name}: conf dir"
        );
        let mount_of = |c: &Value, volume: &str| {
            list(&c["volumeMounts"]).into_iter().find(|m| m["name"] == volume).map(|m| m["mountPath"].clone())
        };
        assert_eq!(mount_of(install, "cni-bin-dir"), Some(json!("/host/opt/cni/bin")), "{name}");
        assert_eq!(mount_of(install, "cni-net-dir"), Some(json!("/host/etc/cni/net.d")), "{name}");
        assert_eq!(r.env_value(install, "MOUNTED_CNI_NET_DIR").as_deref(), Some("/host/etc/cni/net.d"), "{name}");
        assert_eq!(r.env_value(install, "HOST_CNI_BIN_DIR").as_deref(), Some("/host/opt/cni/bin"), "{name}");
        if ambient {
            let agent = agent.unwrap();
            assert_eq!(volume(&r, "istio-cni-node", "cni-netns-dir")["hostPath"]["path"], want["netnsDir"], "{name}");
            assert_eq!(mount_of(agent, "cni-netns-dir").as_ref(), Some(&want["netnsDir"]), "{name}: netns mount");
            assert_eq!(mount_of(agent, "ztunnel-dir"), Some(json!("/var/run/ztunnel")), "{name}");
        }

        // Capabilities: ours, split by container (docs/helm.md): install-cni none, the node agent the rule
        // capabilities when it programs rules (ambient or in-place repair).
        assert_eq!(install["securityContext"]["capabilities"], json!({"drop": ["ALL"]}), "{name}");
        if let Some(agent) = agent {
            let want_caps = if ambient || in_place {
                json!({"drop": ["ALL"], "add": ["NET_ADMIN", "NET_RAW", "SYS_ADMIN", "SYS_PTRACE"]})
            } else {
                json!({"drop": ["ALL"]})
            };
            assert_eq!(agent["securityContext"]["capabilities"], want_caps, "{name}");
            assert_eq!(mount_of(agent, "host-proc").is_some(), ambient || in_place, "{name}: host /proc");
        }

        let pod = r.pod_spec("istio-cni-node");
        assert_eq!(pod["hostNetwork"] == true, want["hostNetwork"] == true, "{name}: hostNetwork");
        assert_eq!(
            r.find("ResourceQuota", "istio-cni-resource-quota").is_some(),
            want["resourceQuota"] == true,
            "{name}"
        );
        assert_eq!(
            r.find("NetworkAttachmentDefinition", "istio-cni").is_some(),
            want["networkAttachmentDefinition"] == true,
            "{name}"
        );
        if let Some(image) = want["image"].as_str() {
            assert_eq!(install["image"], image, "{name}: image");
        }
    }
}

/// Istio's defaults block (values.yaml `_internal_defaults_do_not_set`), as a user's values file.
fn istio_defaults() -> Value {
    let text = std::fs::read_to_string(istio_data().join("values.yaml")).expect("Istio's values.yaml");
    let values: Value = serde_yaml::from_str(&text).expect("values.yaml parses");
    values["_internal_defaults_do_not_set"].clone()
}

#[test]
fn every_key_of_istios_values_is_accepted_at_the_top_level_and_under_cni() {
    let scratch = tempfile::tempdir().expect("tempdir");
    let defaults = istio_defaults();
    assert!(defaults.as_object().unwrap().len() > 30, "Istio's defaults lost keys");
    let mut under_cni = defaults.clone();
    let global = under_cni.as_object_mut().unwrap().remove("global").unwrap();
    let forms = [("top-level", defaults.clone()), ("cni", json!({"cni": under_cni, "global": global}))];
    let mut env_by_form = Vec::new();
    for (form, values) in forms {
        let file = scratch.path().join(format!("{form}.yaml"));
        std::fs::write(&file, serde_yaml::to_string(&values).unwrap()).unwrap();
        let args = vec!["-f".to_owned(), file.display().to_string()];
        let text = template_with(&args, KUBE_VERSION).unwrap_or_else(|e| panic!("{form}: Istio's values refused: {e}"));
        let r = Rendered::parse(&text);
        let install = r.container("istio-cni-node", "install-cni").unwrap();
        assert_eq!(install["image"], "registry.istio.io/testing/install-cni:latest", "{form}");
        env_by_form.push((r.config_map("istio-cni-config"), r.config_map("istio-cni-node-agent-config")));
    }
    assert_eq!(env_by_form[0], env_by_form[1], "both forms mean the same");

    // Both forms of one setting mean the same, and the cni form wins when both are set.
    let top = Rendered::new(&["ambient.enabled=true", "ambient.dnsCapture=false"]);
    let cni = Rendered::new(&["cni.ambient.enabled=true", "cni.ambient.dnsCapture=false"]);
    assert_eq!(top.config_map("istio-cni-node-agent-config"), cni.config_map("istio-cni-node-agent-config"));
    let both = Rendered::new(&["ambient.enabled=true", "ambient.dnsCapture=true", "cni.ambient.dnsCapture=false"]);
    assert_eq!(both.config_map("istio-cni-node-agent-config")["AMBIENT_DNS_CAPTURE"], "false");

    // User values come after the profile, also to turn off what the profile turned on.
    let r = Rendered::new(&["profile=ambient", "ambient.enabled=false"]);
    assert_eq!(r.config_map("istio-cni-config")["AMBIENT_ENABLED"], "false");
    let r = Rendered::new(&["global.platform=openshift", "chained=true", "cni.cniConfFileName="]);
    assert_eq!(r.config_map("istio-cni-config")["CHAINED_CNI_PLUGIN"], "true");
    assert!(!r.config_map("istio-cni-config").contains_key("CNI_CONF_NAME"));
}

#[test]
fn defaults_equal_istios() {
    let d = istio_defaults();
    let r = Rendered::new(&[]);
    let ds = r.get("DaemonSet", "istio-cni-node");
    let pod = r.pod_spec("istio-cni-node");
    assert_eq!(ds["spec"]["updateStrategy"], d["updateStrategy"]);
    assert_eq!(pod["terminationGracePeriodSeconds"], d["terminationGracePeriodSeconds"]);
    assert_eq!(pod["tolerations"], d["tolerations"]);
    let install = r.container("istio-cni-node", "install-cni").unwrap();
    assert_eq!(install["resources"], d["resources"]);
    assert!(install.get("imagePullPolicy").is_none(), "Istio leaves the pull policy to Kubernetes");
    // The image is composed as Istio's: <hub>/install-cni:<tag>; hub and tag are ours (our image, our version).
    assert_eq!(install["image"], "localhost/install-cni:0.1.0");
    let config = r.config_map("istio-cni-config");
    let exclude: Vec<String> = list(&d["excludeNamespaces"]).iter().map(|v| v.as_str().unwrap().to_owned()).collect();
    assert_eq!(config["EXCLUDE_NAMESPACES"], exclude.join(","));
    let agent = r.config_map("istio-cni-node-agent-config");
    assert_eq!(agent["AMBIENT_RECONCILE_POD_RULES_ON_STARTUP"], d["ambient"]["reconcileIptablesOnStartup"].to_string());
    assert_eq!(agent["AMBIENT_DNS_CAPTURE"], d["ambient"]["dnsCapture"].to_string());
    assert_eq!(agent["REPAIR_REPAIR_PODS"], d["repair"]["repairPods"].to_string());
    assert_eq!(
        serde_json::from_str::<Value>(&config["AMBIENT_ENABLEMENT_SELECTOR"]).unwrap(),
        d["ambient"]["enablementSelectors"]
    );
    // Image composition: hub, tag and variant as Istio's chart composes them; an image with a "/" as is.
    let image =
        |sets: &[&str]| Rendered::new(sets).container("istio-cni-node", "install-cni").unwrap()["image"].clone();
    assert_eq!(
        image(&["global.hub=r.example/istio", "global.tag=1.2.3", "global.variant=debug"]),
        "r.example/istio/install-cni:1.2.3-debug"
    );
    assert_eq!(
        image(&["hub=h.example", "tag=9", "variant=distroless", "global.variant=debug"]),
        "h.example/install-cni:9-distroless"
    );
    assert_eq!(image(&["cni.image=my.example/cni:x"]), "my.example/cni:x");
    assert_eq!(image(&["image=other"]), "localhost/other:0.1.0");
}

#[test]
fn templates_istio_has_render_from_their_values() {
    // NetworkAttachmentDefinition: provider multus (the openshift platform sets it).
    let r = Rendered::new(&["provider=multus"]);
    assert_eq!(r.get("NetworkAttachmentDefinition", "istio-cni")["metadata"]["namespace"], "default");
    assert!(Rendered::new(&[]).find("NetworkAttachmentDefinition", "istio-cni").is_none());
    let r = Rendered::new(&["global.platform=openshift"]);
    assert!(r.find("NetworkAttachmentDefinition", "istio-cni").is_some());

    // NetworkPolicy: global.networkPolicy.enabled; the ports it lets in are the ones the containers serve.
    assert!(Rendered::new(&[]).objects.iter().all(|o| o["kind"] != "NetworkPolicy"));
    let r = Rendered::new(&[AMBIENT, PROXY, "global.networkPolicy.enabled=true"]);
    let np = r.get("NetworkPolicy", "istio-cni");
    assert_eq!(np["spec"]["podSelector"]["matchLabels"]["k8s-app"], "istio-cni-node");
    let allowed: BTreeSet<i64> = list(&np["spec"]["ingress"])
        .iter()
        .flat_map(|rule| list(&rule["ports"]))
        .map(|p| p["port"].as_i64().unwrap())
        .collect();
    let mut served = BTreeSet::new();
    for c in ["install-cni", "node-agent"] {
        let c = r.container("istio-cni-node", c).unwrap();
        served.insert(c["readinessProbe"]["httpGet"]["port"].as_i64().unwrap());
        served.extend(list(&c["ports"]).iter().map(|p| p["containerPort"].as_i64().unwrap()));
    }
    assert_eq!(allowed, served);
    assert_eq!(np["spec"]["egress"], json!([{}]));
    assert!(r.find("NetworkPolicy", "hbone-proxy").is_some());

    // ResourceQuota: resourceQuotas.enabled, and the gke profile turns it on.
    let r = Rendered::new(&["resourceQuotas.enabled=true", "resourceQuotas.pods=77"]);
    let quota = &r.get("ResourceQuota", "istio-cni-resource-quota")["spec"];
    assert_eq!(quota["hard"]["pods"], "77");
    assert_eq!(quota["scopeSelector"]["matchExpressions"][0]["values"], json!(["system-node-critical"]));
    assert!(Rendered::new(&["global.platform=gke"]).find("ResourceQuota", "istio-cni-resource-quota").is_some());

    // Passthrough: daemonSetLabels, podLabels, podAnnotations, env (to every istio-cni-node container).
    let r = Rendered::new(&[
        AMBIENT,
        "daemonSetLabels.team=net",
        "podLabels.tier=node",
        "cni.podAnnotations.example\\.com/a=b",
        "env.GODEBUG=x",
        "cni.env.EXTRA=1",
    ]);
    let ds = r.get("DaemonSet", "istio-cni-node");
    assert_eq!(ds["metadata"]["labels"]["team"], "net");
    assert_eq!(ds["spec"]["template"]["metadata"]["labels"]["tier"], "node");
    assert_eq!(ds["spec"]["template"]["metadata"]["annotations"]["example.com/a"], "b");
    for c in ["install-cni", "node-agent"] {
        let env = list(&r.container("istio-cni-node", c).unwrap()["env"]);
        assert!(env.contains(&json!({"name": "GODEBUG", "value": "x"})), "{c}: {env:?}");
        assert!(env.contains(&json!({"name": "EXTRA", "value": "1"})), "{c}: {env:?}");
    }

    // AppArmor: the annotation by default (useAppArmorAnnotation), else securityContext.appArmorProfile.
    let r = Rendered::new(&[AMBIENT]);
    let annotations = &r.get("DaemonSet", "istio-cni-node")["spec"]["template"]["metadata"]["annotations"];
    assert_eq!(annotations["container.apparmor.security.beta.kubernetes.io/install-cni"], "unconfined");
    assert_eq!(annotations["container.apparmor.security.beta.kubernetes.io/node-agent"], "unconfined");
    let r = Rendered::new(&[AMBIENT, "useAppArmorAnnotation=false"]);
    let annotations = &r.get("DaemonSet", "istio-cni-node")["spec"]["template"]["metadata"]["annotations"];
    assert!(annotations.get("container.apparmor.security.beta.kubernetes.io/install-cni").is_none());
    for c in ["install-cni", "node-agent"] {
        let sc = &r.container("istio-cni-node", c).unwrap()["securityContext"];
        assert_eq!(sc["appArmorProfile"], json!({"type": "Unconfined"}), "{c}");
    }

    // global.resourceScope: namespaced objects only, or cluster-scoped only.
    let r = Rendered::new(&["global.resourceScope=cluster"]);
    assert!(r.objects.iter().all(|o| o["kind"].as_str().unwrap().starts_with("Cluster")), "{:?}", r.names());
    let r = Rendered::new(&["global.resourceScope=namespace"]);
    assert!(r.objects.iter().all(|o| !o["kind"].as_str().unwrap().starts_with("Cluster")), "{:?}", r.names());
    assert!(r.find("DaemonSet", "istio-cni-node").is_some());
}

/// The port a container's binary serves `/metrics` on: the chart's `MONITORING_PORT`, else the binary's default.
fn metrics_port(r: &Rendered, container: &Value) -> u16 {
    r.env_value(container, "MONITORING_PORT")
        .map_or(istio_contract::ports::CNI_MONITORING, |p| p.parse().expect("MONITORING_PORT is a port"))
}

#[test]
fn prometheus_annotation_points_at_the_port_the_node_agent_serves_its_metrics_on() {
    // Ambient, and sidecar-only with the default in-place repair: the node agent runs beside install-cni.
    for sets in [vec![AMBIENT.to_owned()], vec![]] {
        let (_, r) = render(&sets);
        let annotations = &r.get("DaemonSet", "istio-cni-node")["spec"]["template"]["metadata"]["annotations"];
        assert_eq!(annotations["prometheus.io/scrape"], "true");
        let port: u16 = annotations["prometheus.io/port"].as_str().unwrap().parse().expect("a port");
        let path = annotations["prometheus.io/path"].as_str().unwrap().to_owned();
        assert_eq!((port, path.as_str()), (15014, "/metrics"), "Istio's chart's annotation");
        let agent = r.container("istio-cni-node", "node-agent").expect("node agent").clone();
        let install = r.container("istio-cni-node", "install-cni").unwrap();
        assert_ne!(metrics_port(&r, install), port, "{sets:?}: two containers of one pod on one port");
        let declared: Vec<_> = list(&agent["ports"]).iter().map(|p| p["containerPort"].as_u64()).collect();
        assert!(declared.contains(&Some(u64::from(port))), "{sets:?}: the node agent declares {declared:?}");

        // The real agent, given the chart's metrics port, serves its metrics on the annotated port.
        let c = testbed::Cluster::with_backend(testbed::mesh::RuleBackend::Nftables);
        let chart_port = metrics_port(&r, &agent).to_string();
        let _agent = testbed::node_agent::NodeAgent::start(&c, &[("MONITORING_PORT", &chart_port)]);
        let scraped = testbed::http::get(&c.node.netns().path(), port, &path);
        let (status, body) = scraped.unwrap_or_else(|e| panic!("{sets:?}: nothing on the annotated port: {e}"));
        assert_eq!(status, 200, "{body}");
        for metric in ["ztunnel_connected", "nodeagent_enrolled_pods"] {
            assert!(body.contains(&format!("# TYPE {metric} ")), "{sets:?}: no {metric} on {port}:\n{body}");
        }
    }
}

//! The Grafana dashboard the chart ships (`dashboards.enabled`): rendered by a real helm, it is a ConfigMap with
//! the label Grafana's dashboard sidecar loads, its JSON parses, and every metric name any of its queries reads is
//! one the real binaries export: the node agent, install-cni and the node proxy are started on a test node and
//! their `/metrics` scraped. A panel over a name nobody exports would stay empty forever without anyone noticing.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::process::Command;
use std::time::Duration;

use istio_contract::ports;
use serde_json::{json, Value};
use testbed::chart::{self, output, Rendered, KUBE_VERSION};
use testbed::install_cni::Installer;
use testbed::mesh::RuleBackend;
use testbed::node_agent::{crash_looping_pod, namespace, NodeAgent, VALIDATION_CONTAINER};
use testbed::wait::eventually_or;
use testbed::{Cluster, Pod};

use support::traffic::{transfer, Payload};
use support::{
    ambient_member, await_kubernetes_listing, connect_from, listen_on, Proxy, APP_PORT, B_SA, HBONE_ON_ONE_NODE, NS,
};

const DASHBOARDS: &str = "dashboards.enabled=true";
/// The ConfigMap the chart ships the dashboard in.
const CONFIG_MAP: &str = "istio-cni-grafana-dashboard";
/// Its one key.
const JSON_KEY: &str = "istio-cni.json";

/// The dashboard of a render with `sets`: its ConfigMap and the parsed JSON.
fn dashboard(sets: &[&str]) -> (Value, Value) {
    let r = Rendered::new(sets);
    let map = r.get("ConfigMap", CONFIG_MAP).clone();
    let text = map["data"][JSON_KEY].as_str().unwrap_or_else(|| panic!("{CONFIG_MAP} has no {JSON_KEY}: {map:#}"));
    let json = serde_json::from_str(text).unwrap_or_else(|e| panic!("the dashboard JSON does not parse: {e}"));
    (map, json)
}

/// Every panel, rows' nested panels included.
fn panels(dashboard: &Value) -> Vec<Value> {
    let mut out = Vec::new();
    for panel in chart::list(&dashboard["panels"]) {
        out.extend(chart::list(&panel["panels"]));
        out.push(panel);
    }
    out
}

/// Every query of the dashboard: (panel title, PromQL).
fn queries(dashboard: &Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for panel in panels(dashboard) {
        let title = panel["title"].as_str().unwrap_or("?").to_owned();
        for target in chart::list(&panel["targets"]) {
            let expr = target["expr"].as_str().unwrap_or_else(|| panic!("panel {title:?}: a target without expr"));
            out.push((title.clone(), expr.to_owned()));
        }
    }
    out
}

/// PromQL words that are neither metric names nor functions.
const KEYWORDS: [&str; 12] =
    ["by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or", "unless", "inf"];
/// Aggregation operators: followed by `(` or by a label list (`sum by (le) (...)`), never metric names.
const AGGREGATIONS: [&str; 14] = [
    "sum",
    "min",
    "max",
    "avg",
    "count",
    "stddev",
    "stdvar",
    "topk",
    "bottomk",
    "quantile",
    "count_values",
    "group",
    "limitk",
    "limit_ratio",
];
/// Keywords followed by a parenthesised list of label names (not metric names).
const LABEL_LISTS: [&str; 6] = ["by", "without", "on", "ignoring", "group_left", "group_right"];

/// The metric names a PromQL expression reads: every identifier outside strings, label matchers `{...}`, ranges
/// `[...]` and label lists (`by (...)` ...) that is neither a function (followed by `(`), a keyword nor a number.
fn metric_names(expr: &str) -> BTreeSet<String> {
    let chars: Vec<char> = expr.chars().collect();
    let mut names = BTreeSet::new();
    let mut i = 0;
    // Set after a label-list keyword: the next parenthesised group holds label names.
    let mut label_list = false;
    while i < chars.len() {
        let c = chars[i];
        match c {
            '"' | '\'' | '`' => {
                i += 1;
                while i < chars.len() && chars[i] != c {
                    i += if chars[i] == '\\' { 2 } else { 1 };
                }
                i += 1;
            }
            '{' | '[' => {
                let close = if c == '{' { '}' } else { ']' };
                while i < chars.len() && chars[i] != close {
                    i += 1;
                }
                i += 1;
            }
            '(' if label_list => {
                while i < chars.len() && chars[i] != ')' {
                    i += 1;
                }
                i += 1;
                label_list = false;
            }
            '0'..='9' | '.' => {
                while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.' || chars[i] == '_') {
                    i += 1;
                }
            }
            '$' => {
                // A Grafana variable ($__rate_interval, ${datasource}).
                i += 1;
                while i < chars.len() && (chars[i].is_ascii_alphanumeric() || "_{}".contains(chars[i])) {
                    i += 1;
                }
            }
            c if c.is_ascii_alphabetic() || c == '_' || c == ':' => {
                let start = i;
                while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == ':') {
                    i += 1;
                }
                let word: String = chars[start..i].iter().collect();
                let next = chars[i..].iter().find(|c| !c.is_whitespace());
                if LABEL_LISTS.contains(&word.as_str()) {
                    label_list = true;
                } else if next != Some(&'(')
                    && !KEYWORDS.contains(&word.as_str())
                    && !AGGREGATIONS.contains(&word.as_str())
                    && word != "nan"
                {
                    names.insert(word);
                }
            }
            _ => i += 1,
        }
    }
    names
}

/// The names a query can read from one `/metrics` text, from its `# TYPE <family> <type>` lines (the encoder
/// writes one for every registered family, with samples or not): `<family>_total` for a counter,
/// `_bucket`/`_sum`/`_count` for a histogram, `<family>_info` for an info metric, the family itself otherwise.
fn exported_names(metrics: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in metrics.lines() {
        let Some(rest) = line.strip_prefix("# TYPE ") else { continue };
        let mut words = rest.split_whitespace();
        let (Some(family), Some(kind)) = (words.next(), words.next()) else { continue };
        match kind {
            "counter" => {
                names.insert(format!("{family}_total"));
            }
            "histogram" => names.extend(["_bucket", "_sum", "_count"].map(|s| format!("{family}{s}"))),
            "info" => {
                names.insert(format!("{family}_info"));
            }
            _ => {
                names.insert(family.to_owned());
            }
        }
    }
    names
}

#[test]
fn promql_names_are_the_metrics_read_not_functions_labels_or_variables() {
    let expr = r#"histogram_quantile(0.99, sum by (le, phase) (rate(a_seconds_bucket{phase="x y", k=~"b_c"}[$__rate_interval])))
        / on (instance) group_left (pod) sum without (le) (b_total offset 5m) * 1e3 - ignoring(x) ${var} + c:recorded"#;
    let want: BTreeSet<String> = ["a_seconds_bucket", "b_total", "c:recorded"].map(String::from).into();
    assert_eq!(metric_names(expr), want);
    let metrics = "# HELP a Help.\n# TYPE a counter\n# TYPE h histogram\n# TYPE g gauge\na_total 1\n# EOF\n";
    let want: BTreeSet<String> = ["a_total", "h_bucket", "h_sum", "h_count", "g"].map(String::from).into();
    assert_eq!(exported_names(metrics), want);
}

#[test]
fn dashboard_is_off_by_default_and_a_configmap_grafanas_sidecar_loads_when_on() {
    assert!(Rendered::new(&[]).find("ConfigMap", CONFIG_MAP).is_none(), "the dashboard renders by default");
    let (map, json) = dashboard(&[DASHBOARDS]);
    assert_eq!(map["metadata"]["namespace"], chart::NAMESPACE);
    assert_eq!(map["metadata"]["labels"]["grafana_dashboard"], "1", "kube-prometheus-stack's sidecar label");
    assert!(json["uid"].is_string() && json["title"].is_string(), "{json:#}");
    // Every query goes to the data source the user picks.
    let variables = chart::list(&json["templating"]["list"]);
    assert!(variables.iter().any(|v| v["name"] == "datasource" && v["type"] == "datasource"), "{variables:#?}");
    for panel in panels(&json).iter().filter(|p| p["type"] != "row") {
        assert_eq!(panel["datasource"]["uid"], "${datasource}", "panel {}", panel["title"]);
    }
    let all = panels(&json);
    let ids: BTreeSet<String> = all.iter().map(|p| p["id"].to_string()).collect();
    assert_eq!(ids.len(), all.len(), "panel ids are unique");

    // The label, its value, the namespace and annotations are the user's to set.
    let (map, _) = dashboard(&[
        DASHBOARDS,
        "dashboards.label=grafana.com/dashboard",
        "dashboards.labelValue=yes",
        "dashboards.namespace=monitoring",
        "dashboards.annotations.grafana_folder=Istio",
    ]);
    assert_eq!(map["metadata"]["labels"]["grafana.com/dashboard"], "yes");
    assert!(map["metadata"]["labels"].get("grafana_dashboard").is_none());
    assert_eq!(map["metadata"]["namespace"], "monitoring");
    assert_eq!(map["metadata"]["annotations"], json!({"grafana_folder": "Istio"}));
    // `--set dashboards.labelValue=1` is a number to helm: still the label value "1".
    let (map, _) = dashboard(&[DASHBOARDS, "dashboards.labelValue=1"]);
    assert_eq!(map["metadata"]["labels"]["grafana_dashboard"], "1");
    // Only namespaced objects: none.
    let r = Rendered::new(&[DASHBOARDS, "global.resourceScope=cluster"]);
    assert!(r.find("ConfigMap", CONFIG_MAP).is_none());
    // A label key Kubernetes would refuse is refused before anything renders.
    let err = chart::template(&[DASHBOARDS, "dashboards.label=not a label"]).expect_err("bad label accepted");
    assert!(err.contains("/dashboards/label"), "{err}");
}

#[test]
fn render_with_the_dashboard_lints_and_validates_against_kubernetes_schemas() {
    let out = output(chart::helm().args(["lint", "--strict"]).arg(chart::chart_dir()).args(["--set", DASHBOARDS]));
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && !text.contains("[WARNING]"), "helm lint --strict:\n{text}");
    let scratch = tempfile::tempdir().expect("tempdir");
    let file = scratch.path().join("dashboard.yaml");
    std::fs::write(&file, chart::template(&[DASHBOARDS]).expect("render")).expect("write render");
    let out = output(Command::new("kubernetes-validate").args(["--strict", "-k", KUBE_VERSION]).arg(&file));
    let log = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "kubernetes-validate rejected the render:\n{log}");
    assert!(log.contains(&format!("passed for resource configmap/{CONFIG_MAP}")), "{log}");
}

/// An app in `pod` dials its own node proxy's outbound port on loopback (a self-call the proxy refuses) and reads
/// until the proxy ends the connection.
fn self_call(pod: &Pod) {
    let ns = pod.netns.open().expect("open pod netns");
    let dst = SocketAddr::from((Ipv4Addr::LOCALHOST, ports::OUTBOUND));
    let connected = ns.run(|| TcpStream::connect_timeout(&dst, Duration::from_secs(10))).expect("enter pod netns");
    if let Ok(mut stream) = connected {
        let _ = stream.write_all(b"hello\n");
        stream.set_read_timeout(Some(Duration::from_secs(10))).expect("read timeout");
        let _ = stream.read_to_end(&mut Vec::new());
    }
}

/// Another agent or a debug session flushes every nftables rule in `pod`'s netns: drift for the node agent.
fn flush_rules(pod: &Pod) {
    let ns = pod.netns.open().expect("open pod netns");
    let out = ns.run(|| output(Command::new("nft").args(["flush", "ruleset"]))).expect("enter pod netns");
    assert!(out.status.success(), "nft flush ruleset: {}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn every_metric_the_dashboard_queries_is_one_the_binaries_export() {
    let (_, json) = dashboard(&[DASHBOARDS]);
    // name -> the panels reading it.
    let mut queried: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (panel, expr) in queries(&json) {
        let names = metric_names(&expr);
        assert!(!names.is_empty(), "panel {panel:?} reads no metric: {expr}");
        for name in names {
            queried.entry(name).or_default().insert(panel.clone());
        }
    }

    // The binaries as the chart runs them, on one test node: the node agent (its metrics on 15014, where the pod's
    // prometheus.io/port points, with install-cni's appended), install-cni beside it on the chart's port, and the
    // node proxy (15020).
    let r = Rendered::new(&[DASHBOARDS]);
    let install_port = r.config_map("istio-cni-config")["MONITORING_PORT"].clone();
    let appended_port = r.config_map("istio-cni-node-agent-config")["INSTALL_CNI_METRICS_PORT"].clone();
    assert_eq!(appended_port, install_port, "the agent appends the metrics of install-cni's port");
    let cluster = Cluster::with_backend(RuleBackend::Nftables);
    cluster.api.upsert(namespace(NS, json!({}))).expect("store namespace");
    // Drift checks and probe self-tests every second, so the test need not wait the default minute.
    let agent = NodeAgent::start(
        &cluster,
        &[
            ("REPAIR_LABEL_PODS", "true"),
            ("DRIFT_CHECK_INTERVAL", "1s"),
            ("PROBE_SELFTEST_INTERVAL", "1s"),
            ("INSTALL_CNI_METRICS_PORT", &appended_port),
        ],
    );
    let mut installer = Installer::new(&cluster);
    // Any free readiness port: the test's node agent holds 8000 (in the chart it is on 8001).
    installer.env("MONITORING_PORT", &install_port).env("READINESS_PORT", "18000");
    let primary = cluster.node.conflist(vec![]);
    std::fs::write(installer.net_d.join("10-bridge.conflist"), primary.to_string()).expect("write the primary");
    let install = installer.start();
    // Installed (the installs counter has its SUCCESS sample) before any pod's ADD uses the plugin's kubeconfig.
    install.wait_readyz(200);
    let dir = tempfile::tempdir().expect("scratch dir");
    let proxy = Proxy::start(&cluster, &agent, dir.path(), &dir.path().join("workloads.yaml"), &[HBONE_ON_ONE_NODE]);

    // A family is exported once it has a sample (prometheus-client writes no `# TYPE` line for a labelled family
    // before its first series), so the node does what a real one does: two ambient pods enrolled through the
    // plugin, bytes over HBONE between them, a self-call the proxy refuses, a sidecar pod whose validation init
    // container failed, which the repair controller labels, and an enrolled pod's rules flushed by someone else.
    let a = ambient_member(&cluster, "a", "a-sa");
    let b = ambient_member(&cluster, "b", B_SA);
    await_kubernetes_listing(&proxy, 2);
    let to_b = SocketAddr::from((b.ip, APP_PORT));
    transfer(listen_on(&b, APP_PORT), || connect_from(&a, to_b), Payload::new(1, 4096), Payload::new(2, 4096));
    self_call(&a);
    cluster.api.upsert(crash_looping_pod(NS, "broken", "node-1", VALIDATION_CONTAINER, 126, true)).expect("store pod");
    flush_rules(&a);

    let netns = cluster.node.netns().path();
    let scrape = |port: u16| match testbed::http::get(&netns, port, "/metrics") {
        Ok((200, body)) => exported_names(&body),
        _ => BTreeSet::new(),
    };
    // Only the ports the pods' prometheus.io/port annotations name: what an annotation-driven Prometheus scrapes.
    let exported =
        || -> BTreeSet<String> { [ports::CNI_MONITORING, ports::STATS].into_iter().flat_map(scrape).collect() };
    let missing = |exported: &BTreeSet<String>| -> Vec<String> {
        queried
            .iter()
            .filter(|(name, _)| !exported.contains(*name))
            .map(|(name, panels)| format!("{name} (panels {panels:?})"))
            .collect()
    };
    // Counted when each connection ends, labelled when the repair acts: wait for every name, and on timeout say
    // which are still missing.
    eventually_or(
        "every metric the dashboard queries is exported",
        || missing(&exported()).is_empty().then_some(()),
        || format!("still missing:\n  {}\nexported: {:?}", missing(&exported()).join("\n  "), exported()),
    );
}

//! Pod → Istio's decision and settings (istio-contract) → rules (redirect), checked against our goldens for
//! Istio's `plugin-sidecar` cases (see the reference INDEX §1).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use serde_json::{json, Value};

use istio_contract::names::{PROXY_CONTAINER, SIDECAR_STATUS_ANNOTATION};
use istio_contract::pod::PodInfo;
use istio_contract::sidecar::{decide, settings, Decision};

fn pod(annotations: Value, security_context: Value, env: Value) -> PodInfo {
    let mut ann = json!({ SIDECAR_STATUS_ANNOTATION: "true" });
    ann.as_object_mut().unwrap().extend(annotations.as_object().unwrap().clone());
    let pod: Pod = serde_json::from_value(json!({
        "metadata": { "name": "testPod", "namespace": "testNS", "annotations": ann },
        "spec": { "containers": [
            { "name": "test" },
            { "name": PROXY_CONTAINER, "securityContext": security_context, "env": env },
            { "name": "istio-validate" }
        ]}
    }))
    .unwrap();
    PodInfo::from(&pod)
}

/// Istio's plugin-sidecar comparison: split at COMMIT, key each block by its `* table` line.
fn tables(text: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for block in text.split("COMMIT") {
        let lines: Vec<&str> = block
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && *l != "iptables-save" && *l != "ip6tables-save")
            .collect();
        if let Some(head) = lines.first() {
            out.insert(head.to_string(), lines.join("\n"));
        }
    }
    out
}

fn golden(name: &str) -> String {
    let path = format!("{}/tests/golden/plugin-sidecar/{name}.golden", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {path}: {e}"))
}

fn assert_case(case: &str, golden_name: &str, p: PodInfo) {
    assert_eq!(decide(&p), Decision::Redirect, "{case}");
    let plan = redirect::sidecar::build(&settings(&p, false).unwrap());
    assert!(plan.v6.is_none(), "{case}: IPv4-only pod got v6 rules");
    let got = tables(&redirect::iptables::render(&plan.v4).unwrap());
    let want = tables(&golden(golden_name));
    assert_eq!(got, want, "{case}: rendered rules differ from {golden_name}");
}

#[test]
fn plugin_sidecar_goldens() {
    let none = json!({});
    let custom = json!({ "runAsUser": 1000670000, "runAsGroup": 1000670001 });
    assert_case("basic", "basic", pod(none.clone(), none.clone(), json!([])));
    assert_case("custom-uid-zero", "basic", pod(none.clone(), json!({ "runAsUser": 0 }), json!([])));
    assert_case(
        "include-exclude-ip",
        "include-exclude-ip",
        pod(
            json!({ "traffic.sidecar.istio.io/includeOutboundIPRanges": "127.0.0.0/8",
                    "traffic.sidecar.istio.io/excludeOutboundIPRanges": "10.0.0.0/8" }),
            none.clone(),
            json!([]),
        ),
    );
    assert_case(
        "include-exclude-ports",
        "include-exclude-ports",
        pod(
            json!({ "traffic.sidecar.istio.io/includeInboundPorts": "1111,2222",
                    "traffic.sidecar.istio.io/excludeInboundPorts": "3333,4444",
                    "traffic.sidecar.istio.io/excludeOutboundPorts": "5555,6666" }),
            none.clone(),
            json!([]),
        ),
    );
    let tproxy = json!({ "sidecar.istio.io/interceptionMode": "TPROXY" });
    assert_case("tproxy", "tproxy", pod(tproxy.clone(), none.clone(), json!([])));
    assert_case(
        "DNS",
        "dns",
        pod(none.clone(), none.clone(), json!([{ "name": "ISTIO_META_DNS_CAPTURE", "value": "true" }])),
    );
    assert_case(
        "invalid-drop",
        "invalid-drop",
        pod(none.clone(), none.clone(), json!([{ "name": "INVALID_DROP", "value": "true" }])),
    );
    assert_case("custom-uid", "custom-uid", pod(none.clone(), custom.clone(), json!([])));
    assert_case("custom-uid-tproxy", "custom-uid-tproxy", pod(tproxy, custom, json!([])));
}

#[test]
fn ipv6_pods_get_a_v6_rule_set() {
    let p = pod(json!({}), json!({}), json!([]));
    assert!(redirect::sidecar::build(&settings(&p, true).unwrap()).v6.is_some());
    let p = pod(json!({}), json!({}), json!([{ "name": "ISTIO_DUAL_STACK", "value": "true" }]));
    assert!(redirect::sidecar::build(&settings(&p, false).unwrap()).v6.is_some());
}

//! Istio's sidecar decision on pods built from API objects: the skip reasons in Istio's order, and invalid
//! annotations refused with the annotation named. The rules these settings produce are checked against Istio's
//! goldens in redirect/tests/sidecar_decision.rs.

use k8s_openapi::api::core::v1::Pod;
use serde_json::{json, Value};

use super::{decide, settings, Decision, Skip};
use crate::names::{INIT_CONTAINER, PROXY_CONTAINER, SIDECAR_INJECT, SIDECAR_STATUS_ANNOTATION};
use crate::pod::PodInfo;

fn pod(annotations: Value, security_context: Value, env: Value) -> PodInfo {
    let mut ann = json!({ SIDECAR_STATUS_ANNOTATION: "true" });
    ann.as_object_mut().unwrap().extend(annotations.as_object().unwrap().clone());
    let pod: Pod = serde_json::from_value(json!({
        "metadata": { "name": "testPod", "namespace": "testNS", "annotations": ann },
        "spec": { "containers": [
            { "name": "test" },
            { "name": PROXY_CONTAINER, "securityContext": security_context, "env": env },
        ]}
    }))
    .unwrap();
    PodInfo::from(&pod)
}

#[test]
fn skip_reasons_follow_istio() {
    let mut p = pod(json!({}), json!({}), json!([]));
    assert_eq!(decide(&p), Decision::Redirect);
    p.annotations.remove(SIDECAR_STATUS_ANNOTATION);
    assert_eq!(decide(&p), Decision::Skip(Skip::NotInjected));

    let p = pod(json!({ SIDECAR_INJECT: "false" }), json!({}), json!([]));
    assert_eq!(decide(&p), Decision::Skip(Skip::InjectionDisabled));
    let mut p = pod(json!({ SIDECAR_INJECT: "false" }), json!({}), json!([]));
    p.labels.insert(SIDECAR_INJECT.into(), "true".into());
    assert_eq!(decide(&p), Decision::Redirect, "the label wins over the annotation");

    let p = pod(json!({}), json!({}), json!([{ "name": "DISABLE_ENVOY", "value": "true" }]));
    assert_eq!(decide(&p), Decision::Skip(Skip::EnvoyDisabled));

    let mut p = pod(json!({}), json!({}), json!([]));
    p.proxy.as_mut().unwrap().args = vec!["proxy".into(), "router".into()];
    assert_eq!(decide(&p), Decision::Skip(Skip::NotSidecar("router".into())));
    p.proxy.as_mut().unwrap().args = vec!["proxy".into(), "sidecar".into()];
    assert_eq!(decide(&p), Decision::Redirect);

    let mut p = pod(json!({}), json!({}), json!([]));
    p.init_containers.push(INIT_CONTAINER.into());
    assert_eq!(decide(&p), Decision::Skip(Skip::HasInitContainer));
    p.proxy = None;
    p.init_containers.clear();
    assert_eq!(decide(&p), Decision::Skip(Skip::NoProxy));
}

#[test]
fn native_sidecar_in_init_containers_is_found() {
    let pod: Pod = serde_json::from_value(json!({
        "metadata": { "name": "p", "annotations": { SIDECAR_STATUS_ANNOTATION: "{}" } },
        "spec": { "containers": [{ "name": "app" }],
                  "initContainers": [{ "name": PROXY_CONTAINER, "restartPolicy": "Always" }] }
    }))
    .unwrap();
    assert_eq!(decide(&PodInfo::from(&pod)), Decision::Redirect);
}

#[test]
fn invalid_annotations_are_refused_and_named() {
    for (k, v) in [
        ("sidecar.istio.io/interceptionMode", "BOGUS"),
        ("traffic.sidecar.istio.io/includeInboundPorts", "80,http"),
        ("traffic.sidecar.istio.io/excludeInboundPorts", "99999"),
        ("traffic.sidecar.istio.io/excludeOutboundPorts", "-1"),
        ("traffic.sidecar.istio.io/includeOutboundPorts", "x"),
        ("traffic.sidecar.istio.io/includeOutboundIPRanges", "10.0.0.0/33"),
        ("traffic.sidecar.istio.io/excludeOutboundIPRanges", "not-a-cidr"),
    ] {
        let err = settings(&pod(json!({ k: v }), json!({}), json!([])), false).unwrap_err();
        assert_eq!((err.annotation, err.value.as_str()), (k, v));
        assert!(err.to_string().contains(k), "{k}: {err}");
    }
}

//! Istio's sidecar decision on pods built from API objects: the skip reasons in Istio's order, and invalid
//! annotations refused with the annotation named. The rules these settings produce are checked against Istio's
//! goldens in redirect/tests/sidecar_decision.rs.

use k8s_openapi::api::core::v1::Pod;
use serde_json::{json, Value};

use super::{decide, settings, Decision, Skip};
use crate::names::{
    EXCLUDE_INBOUND_PORTS, EXCLUDE_INTERFACES, EXCLUDE_OUTBOUND_PORTS, INCLUDE_INBOUND_PORTS, INCLUDE_OUTBOUND_PORTS,
    INIT_CONTAINER, KUBEVIRT_INTERFACES, PROXY_CONTAINER, PROXY_RUN_AS_GROUP, PROXY_RUN_AS_USER,
    REROUTE_VIRTUAL_INTERFACES, SIDECAR_INJECT, SIDECAR_STATUS_ANNOTATION,
};
use crate::pod::PodInfo;
use crate::proxy::{PROXY_GID, PROXY_UID};
use crate::validate::Setting;

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
        assert_eq!((err.annotation(), err.value.as_str()), (Some(k), v));
        assert!(err.to_string().contains(k), "{k}: {err}");
    }
}

#[test]
fn interface_annotations_refuse_injection_and_names_the_kernel_would_not_take() {
    let injected = "eth9\n-I OUTPUT -j ACCEPT";
    let too_long = "abcdefghijklmnop";
    for k in [EXCLUDE_INTERFACES, REROUTE_VIRTUAL_INTERFACES, KUBEVIRT_INTERFACES] {
        for v in [injected, too_long, "eth0 -j ACCEPT", "eth0,eth+"] {
            let err = settings(&pod(json!({ k: v }), json!({}), json!([])), false).unwrap_err();
            assert_eq!((err.annotation(), err.value.as_str()), (Some(k), v));
        }
    }
    let ok = settings(&pod(json!({ EXCLUDE_INTERFACES: "eth1, abcdefghijklmno" }), json!({}), json!([])), false);
    assert_eq!(ok.unwrap().exclude_interfaces, ["eth1", "abcdefghijklmno"]);
}

#[test]
fn port_0_in_an_explicit_list_is_refused() {
    for k in [INCLUDE_INBOUND_PORTS, EXCLUDE_INBOUND_PORTS, INCLUDE_OUTBOUND_PORTS, EXCLUDE_OUTBOUND_PORTS] {
        let err = settings(&pod(json!({ k: "80,0" }), json!({}), json!([])), false).unwrap_err();
        assert_eq!(err.annotation(), Some(k));
    }
}

#[test]
fn the_proxy_uid_and_gid_default_when_unset_or_0_and_are_refused_out_of_range() {
    let ids = |sc: Value| settings(&pod(json!({}), sc, json!([])), false).map(|c| (c.proxy_uids, c.proxy_gids));
    assert_eq!(ids(json!({})).unwrap(), (vec![PROXY_UID], vec![PROXY_GID]));
    assert_eq!(ids(json!({ "runAsUser": 0, "runAsGroup": 0 })).unwrap(), (vec![PROXY_UID], vec![PROXY_GID]));
    assert_eq!(
        ids(json!({ "runAsUser": 1000670000, "runAsGroup": 1000670001 })).unwrap(),
        (vec![1000670000], vec![1000670001])
    );
    for (field, sc) in [
        (PROXY_RUN_AS_USER, json!({ "runAsUser": -1 })),
        (PROXY_RUN_AS_USER, json!({ "runAsUser": 4294967295i64 })),
        (PROXY_RUN_AS_GROUP, json!({ "runAsGroup": 1i64 << 40 })),
    ] {
        let err = ids(sc).unwrap_err();
        assert_eq!(err.setting, Setting::ProxyField(field), "{err}");
        assert!(err.to_string().contains(field) && err.to_string().contains(PROXY_CONTAINER), "{err}");
    }
}

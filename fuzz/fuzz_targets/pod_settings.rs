//! The values a pod's author controls, before they can reach a rule: the input is up to ten `\x1f`-separated
//! values for Istio's redirect annotations (interception mode, inbound and outbound port lists, outbound ranges,
//! excluded, rerouted and KubeVirt interfaces), and `istio_contract::sidecar::settings` builds the sidecar's
//! settings from them. Invariants: accepted settings hold only interface names of `^[A-Za-z0-9_.:@-]{1,15}$`
//! and no port 0; a refusal names one of the annotations it was given and renders as one line; the checks in
//! `istio_contract::validate` accept an interface name exactly when it matches that pattern.

#![no_main]

use istio_contract::names::{
    EXCLUDE_INBOUND_PORTS, EXCLUDE_INTERFACES, EXCLUDE_OUTBOUND_IP_RANGES, EXCLUDE_OUTBOUND_PORTS,
    INCLUDE_INBOUND_PORTS, INCLUDE_OUTBOUND_IP_RANGES, INCLUDE_OUTBOUND_PORTS, INTERCEPTION_MODE, KUBEVIRT_INTERFACES,
    REROUTE_VIRTUAL_INTERFACES, SIDECAR_STATUS_ANNOTATION,
};
use istio_contract::pod::{PodInfo, ProxyContainer};
use istio_contract::sidecar::{self, PortSpec};
use istio_contract::validate::{self, MAX_INTERFACE_NAME};
use libfuzzer_sys::fuzz_target;

const ANNOTATIONS: [&str; 10] = [
    INTERCEPTION_MODE,
    INCLUDE_INBOUND_PORTS,
    EXCLUDE_INBOUND_PORTS,
    INCLUDE_OUTBOUND_PORTS,
    EXCLUDE_OUTBOUND_PORTS,
    INCLUDE_OUTBOUND_IP_RANGES,
    EXCLUDE_OUTBOUND_IP_RANGES,
    EXCLUDE_INTERFACES,
    REROUTE_VIRTUAL_INTERFACES,
    KUBEVIRT_INTERFACES,
];

/// The pattern, spelled independently of the validator.
fn is_interface_name(s: &str) -> bool {
    (1..=MAX_INTERFACE_NAME).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"_.:@-".contains(&b))
}

fuzz_target!(|text: &str| {
    for item in text.split([',', '\x1f']) {
        assert_eq!(validate::interface_name(item).is_ok(), is_interface_name(item), "{item:?}");
    }
    let mut pod = PodInfo { proxy: Some(ProxyContainer::default()), ..PodInfo::default() };
    pod.annotations.insert(SIDECAR_STATUS_ANNOTATION.into(), "{}".into());
    let given: Vec<&str> = ANNOTATIONS.iter().zip(text.split('\x1f')).map(|(k, _)| *k).collect();
    for (k, v) in ANNOTATIONS.iter().zip(text.split('\x1f')) {
        pod.annotations.insert(k.to_string(), v.to_string());
    }
    match sidecar::settings(&pod, false) {
        Ok(cfg) => {
            for name in cfg.exclude_interfaces.iter().chain(&cfg.reroute_virtual_interfaces) {
                assert!(is_interface_name(name), "accepted interface {name:?}");
            }
            let listed = match &cfg.inbound_ports_include {
                PortSpec::All => Vec::new(),
                PortSpec::List(ports) => ports.clone(),
            };
            let ports = [&listed, &cfg.inbound_ports_exclude, &cfg.outbound_ports_include, &cfg.outbound_ports_exclude];
            assert!(ports.iter().all(|list| !list.contains(&0)), "accepted port 0: {cfg:?}");
        }
        Err(e) => {
            let annotation = e.annotation().expect("only annotations are given");
            assert!(given.contains(&annotation), "{annotation} was not given");
            assert!(!e.to_string().contains(['\n', '\r']), "one line: {e}");
        }
    }
});

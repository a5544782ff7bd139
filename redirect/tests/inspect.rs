//! Kernel tests of the rule inspection behind drift repair and `explain`: right after programming, every
//! backend reads back exactly the plan (no false drift, for every ambient and sidecar case); a deleted jump,
//! a flushed chain, a deleted table or someone else's rule is drift, and re-applying clears it.

use redirect::ambient::{build, InpodConfig};
use redirect::backend::Backend;
use redirect::hostprobe::{HostProbe, HostProbeConfig};
use redirect::inspect::RuleReport;
use redirect::iptables::IptablesBackend;
use redirect::sidecar::SidecarConfig;
use support::TestNetns;

#[macro_use]
mod sidecar_cases;
mod support;

const BACKENDS: [Backend; 3] =
    [Backend::Iptables(IptablesBackend::Nft), Backend::Iptables(IptablesBackend::Legacy), Backend::Nftables];

fn assert_clean(what: &str, report: &RuleReport) {
    assert!(!report.expected.is_empty(), "{what}: nothing expected");
    assert!(
        !report.drifted(),
        "{what}: false drift\nmissing: {:#?}\nunexpected: {:#?}\nfound: {:#?}",
        report.missing,
        report.unexpected,
        report.found
    );
}

fn ambient_cases() -> Vec<(&'static str, InpodConfig)> {
    let vifs = || vec!["fake1s0f0".to_string(), "fake1s0f1".to_string()];
    let mut out = Vec::new();
    for ipv6 in [false, true] {
        let base = InpodConfig { enable_ipv6: ipv6, ..Default::default() };
        out.push(("default", base.clone()));
        out.push(("ingress", InpodConfig { dns_capture: false, ingress_mode: true, ..base.clone() }));
        out.push(("virtual", InpodConfig { dns_capture: false, virtual_interfaces: vifs(), ..base.clone() }));
        out.push(("no-dns", InpodConfig { dns_capture: false, ..base.clone() }));
    }
    out
}

#[test]
fn every_ambient_case_reads_back_without_drift_on_every_backend() {
    for backend in BACKENDS {
        for (name, cfg) in ambient_cases() {
            let t = TestNetns::new();
            let plan = build(&cfg);
            backend.apply_ambient(&t.ns, &plan).unwrap_or_else(|e| panic!("{backend} {name}: apply: {e}"));
            let report = backend.inspect_ambient(&t.ns, &plan).expect("inspect");
            assert_eq!(report.backend, backend.to_string());
            assert_clean(&format!("{backend} {name} ipv6={}", cfg.enable_ipv6), &report);
            if backend == Backend::Nftables {
                // The tags that recognise our rules are user data nft does not show: `nft list` stays Istio's.
                let text = t.text();
                assert!(!text.contains("comment") && text.contains("istio-ambient-nat"), "{text}");
            }
        }
    }
}

/// Removes part of the ambient rules the way a user or another agent would, with the tools themselves.
fn break_rules(t: &TestNetns, backend: Backend, how: &str) {
    match (backend, how) {
        (Backend::Iptables(b), "jump") => {
            let bin = if b == IptablesBackend::Nft { "iptables-nft" } else { "iptables-legacy" };
            t.exec(&[bin, "-t", "nat", "-D", "PREROUTING", "-j", "ISTIO_PRERT"]);
        }
        (Backend::Iptables(b), "flush") => {
            let bin = if b == IptablesBackend::Nft { "iptables-nft" } else { "iptables-legacy" };
            t.exec(&[bin, "-t", "nat", "-F", "ISTIO_OUTPUT"]);
        }
        (Backend::Iptables(b), _) => {
            let bin = if b == IptablesBackend::Nft { "iptables-nft" } else { "iptables-legacy" };
            t.exec(&[bin, "-t", "nat", "-A", "ISTIO_OUTPUT", "-p", "tcp", "--dport", "9", "-j", "ACCEPT"]);
        }
        (Backend::Nftables, "jump") => t.nft(&["flush", "chain", "inet", "istio-ambient-nat", "prerouting"]),
        (Backend::Nftables, "flush") => t.nft(&["delete", "table", "inet", "istio-ambient-nat"]),
        (Backend::Nftables, _) => {
            t.nft(&["add", "rule", "inet", "istio-ambient-nat", "istio-output", "tcp", "dport", "9", "accept"])
        }
    }
}

#[test]
fn removed_or_foreign_rules_are_drift_until_the_plan_is_applied_again() {
    let plan = build(&InpodConfig::default());
    for backend in BACKENDS {
        for how in ["jump", "flush", "foreign"] {
            let t = TestNetns::new();
            backend.apply_ambient(&t.ns, &plan).expect("apply");
            break_rules(&t, backend, how);
            let report = backend.inspect_ambient(&t.ns, &plan).expect("inspect");
            assert!(report.drifted(), "{backend} {how}: no drift seen:\n{report:#?}");
            assert_ne!(report.digest_expected, report.digest_found);
            if how == "foreign" {
                assert!(report.missing.is_empty(), "{backend}: {:#?}", report.missing);
                assert_eq!(report.unexpected.len(), 1, "{backend}: {:#?}", report.unexpected);
            } else {
                assert!(!report.missing.is_empty() && report.unexpected.is_empty(), "{backend} {how}: {report:#?}");
            }
            backend.apply_ambient(&t.ns, &plan).expect("apply again");
            assert_clean(&format!("{backend} {how} repaired"), &backend.inspect_ambient(&t.ns, &plan).unwrap());
        }
    }
}

#[test]
fn the_host_probe_rule_reads_back_and_its_removal_is_drift() {
    for backend in BACKENDS {
        let t = TestNetns::new();
        let cfg = HostProbeConfig { enable_ipv6: true, ..Default::default() };
        let probe = HostProbe::ensure(t.guard.open().unwrap(), backend, cfg).expect("ensure");
        assert_clean(&format!("{backend} host probe"), &probe.inspect().expect("inspect"));
        match backend {
            Backend::Iptables(b) => {
                let bin = if b == IptablesBackend::Nft { "iptables-nft" } else { "iptables-legacy" };
                t.exec(&[bin, "-t", "nat", "-F", "ISTIO_POSTRT"]);
            }
            Backend::Nftables => t.nft(&["flush", "chain", "inet", "istio-ambient-nat", "postrouting"]),
        }
        let report = probe.inspect().expect("inspect");
        assert!(report.drifted() && !report.missing.is_empty(), "{backend}: {report:#?}");
        probe.delete().expect("delete");
    }
}

/// Every sidecar case each backend can program reads back without drift.
fn check_sidecar(name: &str, cfg: SidecarConfig) {
    let plan = redirect::sidecar::build(&cfg);
    for backend in BACKENDS {
        let t = TestNetns::new();
        if let Err(e) = backend.apply(&t.ns, &plan) {
            // Not every case translates to every backend (nftables lacks some matches); that is tested elsewhere.
            eprintln!("{backend} {name}: not programmable here: {e}");
            continue;
        }
        assert_clean(&format!("{backend} sidecar {name}"), &backend.inspect_sidecar(&t.ns, &plan).expect("inspect"));
    }
}

capture_tests!(check_sidecar);
plugin_tests!(check_sidecar);

//! Kernel tests for the apply step: real netns, real iptables binaries (nft and legacy), real policy routing.

use istio_contract::ports;
use redirect::iptables::{apply, detect_backend, dump, remove, IptablesBackend, IptablesError};
use redirect::model::{Family, Match, OwnerId, Rule, Table, Target};
use redirect::sidecar::{build, InterceptMode, Plan, SidecarConfig};
use support::TestNetns;

mod support;

fn rule_lines(save: &str) -> Vec<&str> {
    save.lines().filter(|l| l.starts_with("-A ")).collect()
}

fn basic_plan_applies_and_reapplies(backend: IptablesBackend) {
    let t = TestNetns::new();
    let plan = build(&SidecarConfig::cni_pod_defaults());
    apply(&t.ns, &plan, backend).expect("first apply");
    let first = dump(&t.ns, backend, Family::V4).expect("dump");
    assert!(first.contains("-A ISTIO_OUTPUT -j ISTIO_REDIRECT"), "{first}");
    let redirect = format!("-A ISTIO_REDIRECT -p tcp -j REDIRECT --to-ports {}", ports::OUTBOUND);
    assert!(first.contains(&redirect), "{first}");
    assert!(first.contains("-A PREROUTING -p tcp -j ISTIO_INBOUND"), "{first}");
    let expected_rules = plan.v4.tables.iter().map(|t| t.rules.len()).sum::<usize>();
    assert_eq!(rule_lines(&first).len(), expected_rules, "{first}");

    apply(&t.ns, &plan, backend).expect("second apply");
    let second = dump(&t.ns, backend, Family::V4).expect("dump");
    assert_eq!(rule_lines(&first), rule_lines(&second), "re-apply must not duplicate rules");

    remove(&t.ns, backend).expect("remove");
    let after = dump(&t.ns, backend, Family::V4).expect("dump");
    assert!(rule_lines(&after).is_empty() && !after.contains("ISTIO_"), "{after}");
}

#[test]
fn nft_apply_is_idempotent_and_removable() {
    basic_plan_applies_and_reapplies(IptablesBackend::Nft);
}

#[test]
fn legacy_apply_is_idempotent_and_removable() {
    basic_plan_applies_and_reapplies(IptablesBackend::Legacy);
}

/// A payload iptables rejects must fail with its stderr and leave the previous rules untouched.
fn broken_payload_is_atomic(backend: IptablesBackend) {
    let t = TestNetns::new();
    let plan = build(&SidecarConfig::cni_pod_defaults());
    apply(&t.ns, &plan, backend).expect("apply good plan");
    let before = dump(&t.ns, backend, Family::V4).expect("dump");

    let mut broken: Plan = plan.clone();
    let nat = broken.v4.tables.iter_mut().find(|t| t.table == Table::Nat).expect("nat table");
    nat.rules.push(Rule::append(
        "ISTIO_OUTPUT",
        vec![Match::OwnerGid { id: OwnerId::Name("no-such-group-redirect-test".into()), negate: false }],
        Target::Return,
    ));
    let err = apply(&t.ns, &broken, backend).expect_err("broken payload must fail");
    match &err {
        IptablesError::Command { binary, family, stderr, .. } => {
            assert!(binary.ends_with("-restore"), "{err}");
            assert_eq!(*family, Family::V4);
            assert!(!stderr.is_empty(), "stderr must be carried: {err}");
        }
        other => panic!("unexpected error kind: {other}"),
    }
    let after = dump(&t.ns, backend, Family::V4).expect("dump");
    assert_eq!(rule_lines(&before), rule_lines(&after), "failed restore must not change rules");
}

#[test]
fn nft_broken_payload_keeps_previous_rules() {
    broken_payload_is_atomic(IptablesBackend::Nft);
}

#[test]
fn legacy_broken_payload_keeps_previous_rules() {
    broken_payload_is_atomic(IptablesBackend::Legacy);
}

#[test]
fn tproxy_plan_programs_policy_routing_for_both_families() {
    let t = TestNetns::new();
    // Also turn on DNS capture and INVALID drop so every table and target we generate meets the kernel.
    let cfg = SidecarConfig {
        mode: InterceptMode::Tproxy,
        enable_ipv6: true,
        redirect_dns: true,
        capture_all_dns: true,
        drop_invalid: true,
        ..SidecarConfig::cni_pod_defaults()
    };
    let plan = build(&cfg);
    let backend = IptablesBackend::Nft;
    apply(&t.ns, &plan, backend).expect("apply tproxy");
    apply(&t.ns, &plan, backend).expect("re-apply tproxy");

    let (mark, table) = (cfg.tproxy_mark, cfg.tproxy_route_table.to_string());
    for (flag, family) in [("-4", Family::V4), ("-6", Family::V6)] {
        let rules = t.exec(&["ip", flag, "rule", "show"]);
        let ours: Vec<&str> =
            rules.lines().filter(|l| l.contains(&format!("fwmark {mark:#x} lookup {table}"))).collect();
        assert_eq!(ours.len(), 1, "{family}: exactly one fwmark rule expected:\n{rules}");
        let routes = t.exec(&["ip", flag, "route", "show", "table", &table]);
        assert!(routes.contains("local default dev lo"), "{family}: {routes}");
        let save = dump(&t.ns, backend, family).expect("dump");
        assert!(save.contains("-j TPROXY"), "{family}: {save}");
        assert!(save.contains("-j CT --zone 2"), "{family}: {save}");
    }
}

/// `ip -6 -j addr show dev lo` inside the netns, and how many of its addresses are `::6`.
fn passthrough_v6_on_lo(t: &TestNetns) -> (usize, String) {
    let json = t.exec(&["ip", "-6", "-j", "addr", "show", "dev", "lo"]);
    (json.matches(r#""local":"::6""#).count(), json)
}

#[test]
fn ipv6_plan_adds_passthrough_source_to_lo_once() {
    let t = TestNetns::new();
    let plan = build(&SidecarConfig { enable_ipv6: true, ..SidecarConfig::cni_pod_defaults() });
    apply(&t.ns, &plan, IptablesBackend::Nft).expect("apply v6 plan");
    apply(&t.ns, &plan, IptablesBackend::Nft).expect("re-apply v6 plan");

    let (count, json) = passthrough_v6_on_lo(&t);
    assert_eq!(count, 1, "::6 must be on lo exactly once:\n{json}");
    assert!(json.contains(r#""local":"::6","prefixlen":128,"scope":"global","nodad":true"#), "{json}");
    // What Envoy does with it: bind the passthrough source (fails with EADDRNOTAVAIL if absent or tentative).
    let bound = t.ns.run(|| std::net::TcpListener::bind("[::6]:0").map(drop)).expect("enter netns");
    bound.expect("bind [::6]:0 inside the netns");
}

#[test]
fn ipv4_only_plan_leaves_lo_without_passthrough_v6() {
    let t = TestNetns::new();
    apply(&t.ns, &build(&SidecarConfig::cni_pod_defaults()), IptablesBackend::Nft).expect("apply v4 plan");
    let (count, json) = passthrough_v6_on_lo(&t);
    assert_eq!(count, 0, "{json}");
}

#[test]
fn forced_binary_wins_and_unknown_is_rejected() {
    assert_eq!(detect_backend(Some("iptables-legacy")).unwrap(), IptablesBackend::Legacy);
    assert_eq!(detect_backend(Some("iptables-nft")).unwrap(), IptablesBackend::Nft);
    let err = detect_backend(Some("iptables-foo")).unwrap_err();
    assert!(matches!(err, IptablesError::UnknownForcedBinary(_)), "{err}");
}

#[test]
fn detection_follows_kube_hint_chain_in_caller_netns() {
    // Run the detection from inside a fresh netns that plays the host: put the hint in legacy only.
    let t = TestNetns::new();
    t.exec(&["iptables-legacy", "-t", "mangle", "-N", "KUBE-IPTABLES-HINT"]);
    let detected = t.ns.run(|| detect_backend(None)).expect("enter netns").expect("detect");
    assert_eq!(detected, IptablesBackend::Legacy);

    let t = TestNetns::new();
    t.exec(&["iptables-nft", "-t", "mangle", "-N", "KUBE-KUBELET-CANARY"]);
    let detected = t.ns.run(|| detect_backend(None)).expect("enter netns").expect("detect");
    assert_eq!(detected, IptablesBackend::Nft);
}

//! Kernel tests for the native nftables backend: real netns, our netlink encoder, read back with `nft -j`
//! (inside the tests only) and compared with goldens written from Istio's nftables layout.
//!
//! A golden is an nft transaction. The test loads it with `nft -f` into one fresh netns, programs our plan
//! into another, and compares what the kernel holds in both, so the comparison is about effect: tables,
//! chains with hooks/priorities/policies, and every chain's rules in order. Within a rule the order of the
//! match conditions is ignored (they are ANDed) and a `!= { a, b }` set match counts as `!= a` plus `!= b`.

use std::collections::BTreeMap;
use std::path::PathBuf;

use netns::Netns;
use redirect::model::{Rule, Table, Target};
use redirect::nft::layout::NftLayout;
use redirect::nft::{apply, remove, tables, NftError, TableId};
use redirect::sidecar::{build, InterceptMode, Plan, SidecarConfig};
use support::TestNetns;

#[macro_use]
mod sidecar_cases;
mod support;

fn golden_path(dir: &str, name: &str) -> PathBuf {
    [env!("CARGO_MANIFEST_DIR"), "tests", "golden", "nft", dir, &format!("{name}.golden")].iter().collect()
}

/// Programs `plan` into a fresh netns and the golden transaction into another; both kernels must agree.
fn check_against_golden(dir: &str, name: &str, plan: &Plan) {
    let ours = TestNetns::new();
    apply(&ours.ns, plan).unwrap_or_else(|e| panic!("{name}: apply: {e}"));
    ours.assert_matches_golden(name, &golden_path(dir, name));
}

// ---- sidecar-capture: Istio's own nftables goldens (copied unchanged), INDEX §3 inputs ----

fn check_capture(name: &str, cfg: SidecarConfig) {
    check_against_golden("sidecar-capture", name, &build(&cfg));
}

capture_tests!(check_capture);
sidecar_tests! { check_capture, SidecarConfig::default();
    capture_inbound_ports_empty_tproxy, "inbound-ports-empty-tproxy", |c| {
        c.mode = InterceptMode::Tproxy;
    };
}

/// Owner groups by name must resolve on the host; an unknown one is named and nothing is programmed.
#[test]
fn unknown_owner_group_is_named_and_nothing_is_programmed() {
    let t = TestNetns::new();
    let cfg = SidecarConfig { owner_groups_include: "java,202".into(), ..SidecarConfig::default() };
    match apply(&t.ns, &build(&cfg)) {
        Err(NftError::UnknownOwner { kind: "group", name }) => assert_eq!(name, "java"),
        other => panic!("expected unknown group java, got {other:?}"),
    }
    assert!(t.ruleset().is_empty(), "nothing may be programmed:\n{}", t.text());
}

// ---- plugin-sidecar: the CNI plugin's cases (INDEX §1 settings), in Istio's nftables layout ----

fn check_plugin(name: &str, cfg: SidecarConfig) {
    check_against_golden("plugin-sidecar", name, &build(&cfg));
}

plugin_tests!(check_plugin);
sidecar_tests! { check_plugin, SidecarConfig::cni_pod_defaults();
    plugin_dual_stack, "dual-stack", |c| {
        c.enable_ipv6 = true;
    };
    plugin_dual_stack_tproxy_dns, "dual-stack-tproxy-dns", |c| {
        c.enable_ipv6 = true;
        c.mode = InterceptMode::Tproxy;
        c.redirect_dns = true;
        c.capture_all_dns = true;
        c.drop_invalid = true;
    };
}

// ---- transaction behaviour ----

fn count_rules(rs: &BTreeMap<String, Vec<String>>) -> usize {
    rs.values().map(|v| v.len() - 1).sum()
}

#[test]
fn programming_twice_changes_nothing() {
    let t = TestNetns::new();
    let cfg = SidecarConfig { enable_ipv6: true, mode: InterceptMode::Tproxy, ..SidecarConfig::cni_pod_defaults() };
    let plan = build(&cfg);
    apply(&t.ns, &plan).expect("first apply");
    let first = t.ruleset();
    let expected: usize = NftLayout::sidecar(&plan).expect("layout").tables.iter().map(|t| t.rules.len()).sum();
    assert_eq!(count_rules(&first), expected, "{}", t.text());
    apply(&t.ns, &plan).expect("second apply");
    assert_eq!(first, t.ruleset(), "re-apply changed the ruleset:\n{}", t.text());
    let rules = t.guard.exec_ok(&["ip", "-4", "rule", "show"]);
    let fwmark = format!("fwmark {:#x} lookup {}", cfg.tproxy_mark, cfg.tproxy_route_table);
    assert_eq!(rules.matches(&fwmark).count(), 1, "TPROXY routing once: {rules}");
}

#[test]
fn stale_tables_are_replaced_without_leftovers() {
    let t = TestNetns::new();
    // An older version's partial state: a junk chain in our nat table and a mangle table the plan lacks.
    t.nft(&["add", "table", "inet", "istio-proxy-nat"]);
    t.nft(&["add", "chain", "inet", "istio-proxy-nat", "junk"]);
    t.nft(&["add", "rule", "inet", "istio-proxy-nat", "junk", "counter", "drop"]);
    t.nft(&["add", "table", "inet", "istio-proxy-mangle"]);
    t.nft(&["add", "chain", "inet", "istio-proxy-mangle", "istio-divert"]);
    apply(&t.ns, &build(&SidecarConfig::cni_pod_defaults())).expect("apply over stale tables");

    let reference = TestNetns::new();
    reference.nft_file(&golden_path("plugin-sidecar", "basic"));
    assert_eq!(reference.ruleset(), t.ruleset(), "stale objects left:\n{}", t.text());
}

#[test]
fn remove_deletes_exactly_our_tables() {
    let t = TestNetns::new();
    t.nft(&["add", "table", "inet", "foreign"]);
    t.nft(&["add", "chain", "inet", "foreign", "output", "{ type filter hook output priority 0 ; }"]);
    t.nft(&["add", "rule", "inet", "foreign", "output", "counter", "accept"]);
    t.nft(&["add", "table", "ip", "istio-proxy-nat"]);
    let before = t.ruleset();

    apply(
        &t.ns,
        &build(&SidecarConfig { mode: InterceptMode::Tproxy, drop_invalid: true, ..SidecarConfig::cni_pod_defaults() }),
    )
    .expect("apply");
    let names = |list: Vec<TableId>| list.into_iter().map(|t| (t.family, t.name)).collect::<Vec<_>>();
    let programmed = names(tables(&t.ns).expect("list tables"));
    for name in ["istio-proxy-nat", "istio-proxy-mangle", "foreign"] {
        assert!(programmed.contains(&(1, name.to_string())), "inet {name} missing: {programmed:?}");
    }
    assert!(programmed.contains(&(2, "istio-proxy-nat".to_string())), "{programmed:?}");
    remove(&t.ns).expect("remove");
    let left = names(tables(&t.ns).expect("list tables"));
    assert_eq!(left, vec![(1, "foreign".to_string()), (2, "istio-proxy-nat".to_string())]);
    assert_eq!(before, t.ruleset(), "remove must leave exactly the foreign tables:\n{}", t.text());
    remove(&t.ns).expect("removing again is fine");
    assert!(t.text().contains("table ip istio-proxy-nat"), "other families' tables stay");
}

#[test]
fn batch_with_a_bad_rule_fails_and_keeps_previous_rules() {
    let t = TestNetns::new();
    let plan = build(&SidecarConfig::cni_pod_defaults());
    apply(&t.ns, &plan).expect("apply good plan");
    let before = t.ruleset();

    // A jump loop: every part encodes, the kernel's loop check refuses the rule.
    let mut broken = plan.clone();
    let nat = broken.v4.tables.iter_mut().find(|t| t.table == Table::Nat).expect("nat table");
    nat.rules.push(Rule::append("ISTIO_REDIRECT", vec![], Target::Jump("ISTIO_OUTPUT".into())));
    let err = apply(&t.ns, &broken).expect_err("loop must be refused");
    match &err {
        NftError::Rejected { object, source } => {
            // The rule closing the loop is refused: ELOOP, or EMLINK when found by the jump-depth check.
            assert!(object.starts_with("rule ") && object.contains("inet istio-proxy-nat istio-"), "{err}");
            assert!(matches!(source.raw_os_error(), Some(ELOOP | EMLINK)), "{err}");
        }
        other => panic!("expected a rejected rule, got {other}"),
    }
    assert_eq!(before, t.ruleset(), "a failed transaction must change nothing:\n{}", t.text());
}

/// Linux errnos (asm-generic) for a jump loop.
const ELOOP: i32 = 40;
const EMLINK: i32 = 31;

/// Set in the child process of [`programs_with_empty_path`]: the netns to program.
const CHILD_NETNS_ENV: &str = "REDIRECT_NFT_TEST_NETNS";

/// The backend needs no binary: the test binary re-runs this test with PATH emptied, and the child programs a
/// dual-stack TPROXY plan into the netns the parent created and then checks.
#[test]
fn programs_with_empty_path() {
    let plan = build(&SidecarConfig {
        enable_ipv6: true,
        mode: InterceptMode::Tproxy,
        redirect_dns: true,
        capture_all_dns: true,
        ..SidecarConfig::cni_pod_defaults()
    });
    if let Ok(path) = std::env::var(CHILD_NETNS_ENV) {
        assert_eq!(std::env::var("PATH").as_deref(), Ok(""), "child must run without PATH");
        let ns = Netns::open(&path).expect("open netns");
        apply(&ns, &plan).expect("apply without binaries");
        return;
    }
    let t = TestNetns::new();
    let out = std::process::Command::new(std::env::current_exe().expect("test binary"))
        .args(["--exact", "programs_with_empty_path", "--test-threads=1", "--nocapture"])
        .env("PATH", "")
        .env(CHILD_NETNS_ENV, t.guard.path())
        .output()
        .expect("spawn child test");
    let log = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && log.contains("1 passed"), "child failed:\n{log}");
    let expected: usize = NftLayout::sidecar(&plan).expect("layout").tables.iter().map(|t| t.rules.len()).sum();
    assert_eq!(count_rules(&t.ruleset()), expected, "{}", t.text());
}

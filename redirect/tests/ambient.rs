//! Ambient in-pod rules and host-probe SNAT: Istio's iptables payloads text for text, Istio's nftables
//! transactions by kernel effect, and the three backends programming real netns (idempotent, exact removal).

use std::path::PathBuf;

use redirect::ambient::{self, build, AmbientPlan, InpodConfig};
use redirect::apply::IptablesBackend;
use redirect::backend::Backend;
use redirect::iptables::render;
use support::{diff, TestNetns};

mod support;

/// The v6 probe SNAT address Istio's ambient tests use (INDEX §2).
const TEST_SNAT_V6: &str = "e9ac:1e77:90ca:399f:4d6d:ece2:2f9b:3164";

fn golden(kind: &str, name: &str) -> PathBuf {
    [env!("CARGO_MANIFEST_DIR"), "tests", "golden", "ambient", kind, &format!("{name}.golden")].iter().collect()
}

fn read(path: &PathBuf) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

/// Istio's case inputs (INDEX §2); `ipv6` selects the `_ipv6` variant.
fn case(name: &str, ipv6: bool) -> InpodConfig {
    let mut c = InpodConfig { enable_ipv6: ipv6, probe_snat_v6: TEST_SNAT_V6.parse().unwrap(), ..Default::default() };
    let vifs = || vec!["fake1s0f0".to_string(), "fake1s0f1".to_string()];
    match name {
        "default" | "dns_pod_enabled_and_off_globally" => {}
        "ingress" => (c.dns_capture, c.ingress_mode) = (false, true),
        "virtual_interfaces" => (c.dns_capture, c.virtual_interfaces) = (false, vifs()),
        "ingress_and_virtual_interfaces" => {
            (c.dns_capture, c.ingress_mode, c.virtual_interfaces) = (false, true, vifs())
        }
        "dns_pod_disabled_and_on_globally" => c.dns_capture = false,
        other => panic!("unknown case {other}"),
    }
    c
}

/// Our payload: the IPv4 restore input, then the IPv6 one.
fn payload(plan: &AmbientPlan) -> String {
    let mut out = render(&plan.v4);
    if let Some(v6) = &plan.v6 {
        out += &render(v6);
    }
    out
}

/// Istio's golden without the dry-run stub's two state reads, trimmed.
fn iptables_golden(name: &str) -> String {
    let text = read(&golden("iptables", name));
    text.lines().filter(|l| *l != "iptables-save" && *l != "ip6tables-save").collect::<Vec<_>>().join("\n")
}

fn assert_text(name: &str, expected: &str, actual: &str) {
    let (e, a) = (expected.trim(), actual.trim());
    assert!(e == a, "{name}: payload differs\n--- expected:\n{e}\n--- actual:\n{a}");
}

const CASES: [&str; 6] = [
    "default",
    "ingress",
    "virtual_interfaces",
    "ingress_and_virtual_interfaces",
    "dns_pod_enabled_and_off_globally",
    "dns_pod_disabled_and_on_globally",
];

#[test]
fn iptables_payloads_equal_istio_goldens() {
    for name in CASES {
        for ipv6 in [false, true] {
            let file = if ipv6 { format!("{name}_ipv6") } else { name.to_string() };
            assert_text(&file, &iptables_golden(&file), &payload(&build(&case(name, ipv6))));
        }
    }
}

/// Programs the plan's nftables layout into a fresh netns and the golden into another; the kernels agree.
fn check_nft(file: &str, plan: &AmbientPlan) {
    let ours = TestNetns::new();
    Backend::Nftables.apply_ambient(&ours.ns, plan).unwrap_or_else(|e| panic!("{file}: apply: {e}"));
    let reference = TestNetns::new();
    reference.nft_file(&golden("nftables", file));
    let (expected, actual) = (reference.ruleset(), ours.ruleset());
    assert!(
        expected == actual,
        "{file}: kernel state differs from the golden\n{}\n--- ours:\n{}\n--- golden:\n{}",
        diff(&expected, &actual),
        ours.text(),
        reference.text()
    );
}

macro_rules! nft_case {
    ($fn:ident, $name:literal) => {
        #[test]
        fn $fn() {
            check_nft($name, &build(&case($name, false)));
            check_nft(concat!($name, "_ipv6"), &build(&case($name, true)));
        }
    };
}

nft_case!(nft_default, "default");
nft_case!(nft_ingress, "ingress");
nft_case!(nft_virtual_interfaces, "virtual_interfaces");
nft_case!(nft_ingress_and_virtual_interfaces, "ingress_and_virtual_interfaces");
nft_case!(nft_dns_pod_enabled_and_off_globally, "dns_pod_enabled_and_off_globally");
nft_case!(nft_dns_pod_disabled_and_on_globally, "dns_pod_disabled_and_on_globally");

#[test]
fn nft_layout_text_has_istio_spellings() {
    // Base-chain jumps have no counter; the connmark set is spelled as Istio spells it.
    let text = ambient::nft_layout(&build(&case("default", true))).unwrap().to_string();
    assert!(text.contains("add rule inet istio-ambient-nat output jump istio-output\n"), "{text}");
    assert!(text.contains("ct mark set ct mark & 0xfffff000 | 0x111"), "{text}");
}

// ---- backends on real netns ----

const BACKENDS: [Backend; 3] =
    [Backend::Iptables(IptablesBackend::Nft), Backend::Iptables(IptablesBackend::Legacy), Backend::Nftables];

/// What a backend holds in the netns, as the tools of that backend show it (tests only).
fn dump(t: &TestNetns, backend: Backend) -> String {
    match backend {
        Backend::Iptables(b) => {
            let flavour = if b == IptablesBackend::Nft { "nft" } else { "legacy" };
            let v4 = t.guard.exec_ok(&[&format!("iptables-{flavour}-save")]);
            let v6 = t.guard.exec_ok(&[&format!("ip6tables-{flavour}-save")]);
            strip_comments(&(v4 + &v6))
        }
        Backend::Nftables => t.text(),
    }
}

/// Rules and user chains per table (`nat: -A OUTPUT -j X`); empty built-in tables and chains do not count.
fn strip_comments(save: &str) -> String {
    let builtin = ["PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"];
    let mut table = "";
    let mut out = Vec::new();
    for line in save.lines() {
        if let Some(t) = line.strip_prefix('*') {
            table = t;
        } else if line.starts_with("-A ") {
            out.push(format!("{table}: {line}"));
        } else if let Some(chain) = line.strip_prefix(':').and_then(|c| c.split_whitespace().next()) {
            if !builtin.contains(&chain) {
                out.push(format!("{table}: :{chain}"));
            }
        }
    }
    out.join("\n")
}

fn routing(t: &TestNetns) -> String {
    let mut out = String::new();
    for flag in ["-4", "-6"] {
        out += &t.guard.exec_ok(&["ip", flag, "rule", "show"]);
        out += &t
            .guard
            .exec(&["ip", flag, "route", "show", "table", "100"])
            .stdout
            .iter()
            .map(|b| *b as char)
            .collect::<String>();
    }
    out
}

/// Foreign rules a pod might already hold in the same tables and families as ours.
fn add_foreign(t: &TestNetns, backend: Backend) {
    match backend {
        Backend::Iptables(b) => {
            let bin = if b == IptablesBackend::Nft { "iptables-nft" } else { "iptables-legacy" };
            t.guard.exec_ok(&[bin, "-t", "nat", "-N", "FOREIGN"]);
            t.guard.exec_ok(&[bin, "-t", "nat", "-A", "FOREIGN", "-p", "udp", "-j", "RETURN"]);
            t.guard.exec_ok(&[bin, "-t", "nat", "-A", "OUTPUT", "-j", "FOREIGN"]);
            t.guard.exec_ok(&[bin, "-t", "mangle", "-A", "PREROUTING", "-p", "icmp", "-j", "ACCEPT"]);
        }
        Backend::Nftables => {
            t.nft(&["add", "table", "inet", "foreign"]);
            t.nft(&["add", "chain", "inet", "foreign", "output", "{ type nat hook output priority 0 ; }"]);
            t.nft(&["add", "rule", "inet", "foreign", "output", "counter", "accept"]);
        }
    }
}

fn program_twice_and_remove(backend: Backend) {
    let t = TestNetns::new();
    add_foreign(&t, backend);
    let (before, routes_before) = (dump(&t, backend), routing(&t));
    let plan = build(&InpodConfig { enable_ipv6: true, virtual_interfaces: vec!["vif0".into()], ..Default::default() });

    backend.apply_ambient(&t.ns, &plan).unwrap_or_else(|e| panic!("{backend}: apply: {e}"));
    let first = dump(&t, backend);
    assert!(first.contains("15001") && first.contains("15006") && first.contains("15053"), "{backend}:\n{first}");
    assert!(first.contains("FOREIGN") || first.contains("foreign"), "{backend}: foreign rules kept:\n{first}");
    let routes = routing(&t);
    assert_eq!(routes.matches("fwmark 0x111/0xfff lookup 100").count(), 2, "{backend}: v4+v6 rule:\n{routes}");
    assert_eq!(routes.matches("local default dev lo").count(), 2, "{backend}: v4+v6 route:\n{routes}");

    backend.apply_ambient(&t.ns, &plan).unwrap_or_else(|e| panic!("{backend}: re-apply: {e}"));
    assert_eq!(first, dump(&t, backend), "{backend}: re-apply changed the rules");
    assert_eq!(routes, routing(&t), "{backend}: re-apply changed the routing");

    // A smaller plan replaces ours: no DNS, no IPv6, so raw and all IPv6 rules go.
    let small = build(&InpodConfig { dns_capture: false, ..Default::default() });
    backend.apply_ambient(&t.ns, &small).unwrap_or_else(|e| panic!("{backend}: apply small: {e}"));
    let shrunk = dump(&t, backend);
    assert!(!shrunk.contains("15053") && !shrunk.contains("vif0"), "{backend}: stale rules:\n{shrunk}");

    backend.remove_ambient(&t.ns).unwrap_or_else(|e| panic!("{backend}: remove: {e}"));
    assert_eq!(before, dump(&t, backend), "{backend}: remove must leave exactly the foreign rules");
    assert_eq!(routes_before, routing(&t), "{backend}: remove must delete our routing");
    backend.remove_ambient(&t.ns).unwrap_or_else(|e| panic!("{backend}: remove again: {e}"));
}

#[test]
fn iptables_nft_programs_twice_and_removes_exactly_ours() {
    program_twice_and_remove(BACKENDS[0]);
}

#[test]
fn iptables_legacy_programs_twice_and_removes_exactly_ours() {
    program_twice_and_remove(BACKENDS[1]);
}

#[test]
fn nftables_programs_twice_and_removes_exactly_ours() {
    program_twice_and_remove(BACKENDS[2]);
}

//! Ambient in-pod rules and host-probe SNAT: Istio's iptables payloads text for text, Istio's nftables
//! transactions by kernel effect, and the three backends programming real netns (idempotent, exact removal).

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

use istio_contract::ports;
use redirect::ambient::{self, build, AmbientPlan, InpodConfig};
use redirect::backend::Backend;
use redirect::hostprobe::{self, HostProbe, HostProbeConfig, ProbeEntry};
use redirect::iptables::{render, IptablesBackend};
use redirect::model::Family;
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
    let mut out = render(&plan.v4).unwrap();
    if let Some(v6) = &plan.v6 {
        out += &render(v6).unwrap();
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
    ours.assert_matches_golden(file, &golden("nftables", file));
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
    let redirected = [ports::OUTBOUND, ports::INBOUND_PLAINTEXT, ports::DNS].map(|p| p.to_string());
    assert!(redirected.iter().all(|p| first.contains(p.as_str())), "{backend}:\n{first}");
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
    assert!(!shrunk.contains(&ports::DNS.to_string()) && !shrunk.contains("vif0"), "{backend}: stale rules:\n{shrunk}");

    backend.remove_ambient(&t.ns).unwrap_or_else(|e| panic!("{backend}: remove: {e}"));
    assert_eq!(before, dump(&t, backend), "{backend}: remove must leave exactly the foreign rules");
    assert_eq!(routes_before, routing(&t), "{backend}: remove must delete our routing");
    backend.remove_ambient(&t.ns).unwrap_or_else(|e| panic!("{backend}: remove again: {e}"));
}

/// A new pod's netns holds no table: the first apply skips reading the tables (nothing to read), the second must
/// see what the first made and change nothing (a wrong "no table" answer would add every jump twice).
fn program_twice_into_a_fresh_netns(backend: Backend) {
    let t = TestNetns::new();
    let plan = build(&InpodConfig { enable_ipv6: true, ..Default::default() });
    backend.apply_ambient(&t.ns, &plan).unwrap_or_else(|e| panic!("{backend}: apply: {e}"));
    let first = dump(&t, backend);
    assert!(first.contains(&ports::OUTBOUND.to_string()), "{backend}:\n{first}");
    backend.apply_ambient(&t.ns, &plan).unwrap_or_else(|e| panic!("{backend}: re-apply: {e}"));
    assert_eq!(first, dump(&t, backend), "{backend}: re-apply into a netns we programmed changed the rules");
}

#[test]
fn iptables_nft_programs_a_fresh_netns_twice_alike() {
    program_twice_into_a_fresh_netns(BACKENDS[0]);
}

#[test]
fn iptables_legacy_programs_a_fresh_netns_twice_alike() {
    program_twice_into_a_fresh_netns(BACKENDS[1]);
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

// ---- host probe SNAT ----

#[test]
fn hostprobe_iptables_payloads_equal_istio_goldens() {
    let cfg = HostProbeConfig::default();
    let v4 = render(&hostprobe::iptables_rules(&cfg, Family::V4)).unwrap();
    assert_text("hostprobe", &iptables_golden("hostprobe"), &v4);
    let v6 =
        render(&hostprobe::iptables_rules(&HostProbeConfig { enable_ipv6: true, ..cfg.clone() }, Family::V6)).unwrap();
    assert_text("hostprobe_ipv6", &iptables_golden("hostprobe_ipv6"), &(v4 + &v6));
}

/// Istio's hostprobe transactions use sets they do not declare; the reference netns gets them first.
fn check_hostprobe_nft(file: &str, cfg: HostProbeConfig) {
    let ours = TestNetns::new();
    let probe = HostProbe::ensure(ours.guard.open().unwrap(), Backend::Nftables, cfg.clone()).expect("ensure");
    let reference = TestNetns::new();
    reference.nft(&["add", "table", "inet", "istio-ambient-nat"]);
    reference.nft(&["add", "set", "inet", "istio-ambient-nat", "istio-inpod-probes-v4", "{ type ipv4_addr ; }"]);
    if cfg.enable_ipv6 {
        reference.nft(&["add", "set", "inet", "istio-ambient-nat", "istio-inpod-probes-v6", "{ type ipv6_addr ; }"]);
    }
    reference.nft_file(&golden("nftables", file));
    let (expected, actual) = (reference.ruleset(), ours.ruleset());
    assert!(expected == actual, "{file}:\n{}\n--- ours:\n{}", diff(&expected, &actual), ours.text());
    // Ensuring again keeps the rule single and the entries.
    probe.add("uid-a", &["10.9.0.5".parse().unwrap()]).expect("add");
    let again = HostProbe::ensure(ours.guard.open().unwrap(), Backend::Nftables, cfg).expect("ensure again");
    assert_eq!(expected, ours.ruleset(), "{file}: re-ensure");
    assert_eq!(again.entries().unwrap().len(), 1, "{}", ours.text());
}

#[test]
fn hostprobe_nft_equals_istio_goldens() {
    let cfg = HostProbeConfig { kubelet_uid: 1000, ..Default::default() };
    check_hostprobe_nft("hostprobe", cfg.clone());
    let v6 = HostProbeConfig { enable_ipv6: true, snat_v6: TEST_SNAT_V6.parse().unwrap(), ..cfg };
    check_hostprobe_nft("hostprobe_ipv6", v6);
}

/// A "host" netns and a "pod" netns joined by a veth: host 10.77.0.1/24, pod 10.77.0.2/24 (default via host).
struct HostAndPod {
    host: TestNetns,
    pod: TestNetns,
}

const POD_IP: &str = "10.77.0.2";

impl HostAndPod {
    fn new() -> Self {
        let (host, pod) = (TestNetns::new(), TestNetns::new());
        host.guard.exec_ok(&["ip", "link", "add", "hp0", "type", "veth", "peer", "name", "pp0"]);
        host.guard.exec_ok(&["ip", "link", "set", "pp0", "netns", pod.guard.name()]);
        host.guard.exec_ok(&["ip", "addr", "add", "10.77.0.1/24", "dev", "hp0"]);
        host.guard.exec_ok(&["ip", "link", "set", "hp0", "up"]);
        pod.guard.exec_ok(&["ip", "addr", "add", &format!("{POD_IP}/24"), "dev", "pp0"]);
        pod.guard.exec_ok(&["ip", "link", "set", "pp0", "up"]);
        pod.guard.exec_ok(&["ip", "route", "add", "default", "via", "10.77.0.1"]);
        Self { host, pod }
    }

    /// Connects from the host to the pod and returns the source the pod saw.
    fn probe_source(&self, port: u16) -> IpAddr {
        let listener = self.pod.guard.listen_tcp(port);
        let target = SocketAddr::new(POD_IP.parse().unwrap(), port);
        self.host.guard.connect_tcp(target, None).expect("connect from host");
        listener.accepted().peer.ip()
    }
}

fn host_probe_snat(backend: Backend) {
    let net = HostAndPod::new();
    let probe = HostProbe::ensure(net.host.guard.open().unwrap(), backend, HostProbeConfig::default())
        .unwrap_or_else(|e| panic!("{backend}: ensure: {e}"));
    let pod_ip: IpAddr = POD_IP.parse().unwrap();
    assert_eq!(net.probe_source(18080), "10.77.0.1".parse::<IpAddr>().unwrap(), "{backend}: not enrolled yet");

    probe.add("pod-uid-1", &[pod_ip]).unwrap_or_else(|e| panic!("{backend}: add: {e}"));
    assert_eq!(net.probe_source(18081), IpAddr::V4(istio_contract::proxy::PROBE_SNAT_V4), "{backend}: probe source");

    probe.remove("pod-uid-1", &[pod_ip]).unwrap_or_else(|e| panic!("{backend}: remove: {e}"));
    assert!(probe.entries().unwrap().is_empty(), "{backend}");
    assert_eq!(net.probe_source(18082), "10.77.0.1".parse::<IpAddr>().unwrap(), "{backend}: after remove");
    probe.delete().unwrap_or_else(|e| panic!("{backend}: delete: {e}"));
}

#[test]
fn host_probe_snat_iptables_nft() {
    host_probe_snat(BACKENDS[0]);
}

#[test]
fn host_probe_snat_iptables_legacy() {
    host_probe_snat(BACKENDS[1]);
}

#[test]
fn host_probe_snat_nftables() {
    host_probe_snat(BACKENDS[2]);
}

/// An IP reused by a new pod: removing the old pod's entry keeps the new pod's.
fn reused_ip_keeps_new_owner(backend: Backend) {
    let t = TestNetns::new();
    let cfg = HostProbeConfig { enable_ipv6: true, ..Default::default() };
    let probe = HostProbe::ensure(t.guard.open().unwrap(), backend, cfg).expect("ensure");
    let (ip, other, v6): (IpAddr, IpAddr, IpAddr) =
        ("10.1.0.7".parse().unwrap(), "10.1.0.8".parse().unwrap(), "fd00::7".parse().unwrap());
    probe.add("old-pod", &[ip, v6]).expect("add old");
    probe.add("new-pod", &[ip]).expect("add new");
    probe.add("other-pod", &[other]).expect("add other");
    probe.add("new-pod", &[ip]).expect("add new twice");
    probe.remove("old-pod", &[ip, v6]).expect("remove old");
    let entries = probe.entries().expect("entries");
    let want = vec![
        ProbeEntry { ip, pod_uid: Some("new-pod".into()) },
        ProbeEntry { ip: other, pod_uid: Some("other-pod".into()) },
    ];
    assert_eq!(entries, want, "{backend}");
    if backend == Backend::Nftables {
        let text = t.text();
        assert!(text.contains("10.1.0.7 comment \"new-pod\""), "nft shows the UID as the comment:\n{text}");
    }
    probe.remove("new-pod", &[ip]).expect("remove new");
    assert_eq!(probe.entries().unwrap(), want[1..], "{backend}");
    // An address that is no element (a pod removed twice, or never added) is nothing to remove.
    probe.remove("other-pod", &["10.1.0.99".parse().unwrap(), v6]).expect("remove addresses that are not there");
    assert_eq!(probe.entries().unwrap(), want[1..], "{backend}");
}

/// A pod with one new IP and one another pod had, in the same family: both end up the pod's, the other pod's
/// entries untouched (the add that finds an IP already there falls back to taking it over).
fn add_with_one_reused_ip_takes_it_over(backend: Backend) {
    let t = TestNetns::new();
    let probe = HostProbe::ensure(t.guard.open().unwrap(), backend, HostProbeConfig::default()).expect("ensure");
    let ip = |s: &str| -> IpAddr { s.parse().unwrap() };
    probe.add("old-pod", &[ip("10.1.0.7")]).expect("add old");
    probe.add("kept-pod", &[ip("10.1.0.9")]).expect("add kept");
    probe.add("new-pod", &[ip("10.1.0.8"), ip("10.1.0.7")]).expect("add new with a reused ip");
    let want = vec![
        ProbeEntry { ip: ip("10.1.0.7"), pod_uid: Some("new-pod".into()) },
        ProbeEntry { ip: ip("10.1.0.8"), pod_uid: Some("new-pod".into()) },
        ProbeEntry { ip: ip("10.1.0.9"), pod_uid: Some("kept-pod".into()) },
    ];
    let mut entries = probe.entries().expect("entries");
    entries.sort();
    assert_eq!(entries, want, "{backend}");
}

#[test]
fn add_with_one_reused_ip_takes_it_over_ipset() {
    add_with_one_reused_ip_takes_it_over(BACKENDS[0]);
}

#[test]
fn add_with_one_reused_ip_takes_it_over_nftables() {
    add_with_one_reused_ip_takes_it_over(BACKENDS[2]);
}

#[test]
fn reused_ip_keeps_new_owner_ipset() {
    reused_ip_keeps_new_owner(BACKENDS[0]);
}

#[test]
fn reused_ip_keeps_new_owner_nftables() {
    reused_ip_keeps_new_owner(BACKENDS[2]);
}
